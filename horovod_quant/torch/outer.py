"""A compressed all-reduce of one tensor per call, for the outer steps of local SGD / DiLoCo.

    import horovod_quant.torch as hqt
    outer = hqt.OuterAllreduce("qsgd:8")            # on every rank, after init_process_group
    mean = hqt.allreduce(pseudo_grad, outer, key=t)  # every outer step t, the same t everywhere
    checkpoint["outer"] = outer.state_dict()

It is the DDP hook's exchange (:mod:`horovod_quant.torch.ddp`), one tensor at a time and on the
caller's thread: the codec resolved as the hook resolves it (:func:`~.ddp.group_codec`), the
group's own collectives (:func:`~.distributed.own_group`), the cross-rank configuration check at
the first call, the door's :class:`~horovod_quant.exchange.runtime.ExchangeRuntime` (its exchange
and the codec states the holder keeps). A call with ``key`` first allgathers its tag
(:func:`~horovod_quant.exchange.wire.exchange_tag`: name, shape, dtype and the key as its step),
so ranks with different keys or tensors raise before anything is combined, whatever the plan; the
exchange seed is :meth:`OuterAllreduce.seed_of` ``(key)``, and ``hq.mean_estimate(codec, rows, that
seed, gather=, pipeline_elems=, topology=, fabric=, states=)`` with the holder's values reproduces
the result.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..core.base import Codec
from ..core.rng import name_key
from ..doors import (
    OUTER_DOOR,
    CompressorSettings,
    DoorOptions,
    door_options,
    load_codec_states,
)
from ..exchange.cost import Fabric
from ..exchange.wire import OutOfStep, check_tag_words, exchange_tag, tag_words
from .ddp import group_codec
from .distributed import own_group, process_group_collectives
from .tensors import as_tensor, flat_array, on_gpu

__all__ = ["OuterAllreduce", "allreduce"]

#: the dtypes a call takes: the codecs encode float32, and 16-bit values exactly as float32
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the key of the door's one tensor in its seeds (the call's key is the step)
PAYLOAD_KEY = "outer"
_DOOR = OUTER_DOOR


def key_number(key: Any) -> int:
    """The 64-bit number of an exchange's key: an int modulo 2**64, a str its
    :func:`~horovod_quant.core.rng.name_key`.

    Raises:
        ValueError: no key, or one that is neither an int nor a str.
    """
    if isinstance(key, str):
        return name_key(key)
    if key is None:
        raise ValueError("key= is required: an int or str naming the exchange (the outer step), "
                         "the same on every rank")
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
        raise ValueError(f"key={key!r}: pass an int or a str (the outer step), the same on every "
                         "rank")
    return int(key) & ((1 << 64) - 1)


def check_tensor(tensor: Any) -> None:
    """ValueError unless ``tensor`` is a dense float32, float16 or bfloat16 tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"allreduce takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"allreduce takes dense tensors, got layout {tensor.layout}")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"allreduce takes float32, float16 or bfloat16 tensors, got "
                         f"{tensor.dtype} (the codecs quantize floating values: cast with "
                         ".float(), or all-reduce integers with torch.distributed)")


def check_member(group: Any) -> None:
    """RuntimeError before ``init_process_group``; ValueError where this rank is not in
    ``group`` (None: the default group)."""
    if not dist.is_initialized():
        raise RuntimeError("horovod_quant allreduce: call torch.distributed.init_process_group "
                           "first")
    if dist.get_rank(group) < 0:
        raise ValueError(f"rank {dist.get_rank()} is not in the process group it was given: "
                         "call allreduce on the group's ranks only")


class OuterAllreduce(CompressorSettings):
    """The state of the compressed all-reduce over one group: the codec and settings, the
    exchange and the codec states an adaptive codec (nested dithered quantization) carries
    from one call to the next. Built on every rank of ``group`` at the same point (it is
    collective: it builds the group's own process group, which torch names by the number of
    groups each member has built, so every rank builds as many).

    Args:
        compression: a codec (``hq.get_codec``), a codec name or ``"name:bits"`` (``"qsgd:8"``),
            or ``horovod_quant.torch.Compression.<codec>(...)`` (its seed, gather and
            pipeline_elems come along); a world-sized codec without ``world_size`` gets the
            group's size.
        group: the torch.distributed process group (None: the default group).
        options: the settings as :class:`~horovod_quant.doors.DoorOptions`, or
        settings: ``seed``, ``gather``, ``pipeline_elems`` as keywords (the others raise).
            ``HQ_LINK_GBIT``, ``HQ_INTRA_GBYTE`` and ``HQ_ROUND_US`` are read here, once
            (:class:`~horovod_quant.doors.DoorEnvironment`).

    Attributes:
        stats: the :class:`~horovod_quant.stats.StepStats` of the calls since ``stats.reset()``.
        topology, fabric: what ``mean_estimate`` needs to reproduce a call (``fabric``: set at
            the first call, by where its tensor lives).
        codec_states: the adaptive codecs' states (``states=`` of ``mean_estimate``).
    """

    def __init__(self, compression: Codec | str | CompressorSettings, group: Any = None, *,
                 options: DoorOptions | None = None, **settings: Any) -> None:
        check_member(group)
        comm = process_group_collectives(own_group(group))
        codec, inherited = group_codec(compression, comm, "compression")
        super().__init__(codec, door_options(settings, options, inherited, _DOOR), _DOOR)
        self.group, self._comm = group, comm
        self.topology = getattr(comm.hierarchy, "topology", None)

    @property
    def fabric(self) -> Fabric | None:
        return self.runtime.fabric

    def seed_of(self, key: int | str) -> int:
        """The exchange seed of a call with ``key``: ``payload_seed(seed, key_number(key),
        "outer")``, the runtime's seed of the door's one tensor at step ``key``."""
        return self.runtime.seed_of(key_number(key), PAYLOAD_KEY)

    def shared_config(self) -> dict:
        return {**super().shared_config(), "door": "outer",
                "fabric": None if self.fabric is None else list(self.fabric)}

    def __call__(self, tensor: torch.Tensor, *, key: int | str) -> torch.Tensor:
        """The mean estimate of ``tensor`` over the group, as :func:`allreduce` (its doc)."""
        step = key_number(key)
        check_tensor(tensor)
        if not self.runtime.opened:  # the first call: the check, then the exchange
            if not self.runtime.checking:
                self.runtime.use_fabric(self.environment.fabric(on_gpu(tensor)))
                self.runtime.check(self._comm, self.shared_config())
            # a mismatch raises here, on every rank, and at every call
            self.runtime.open([self.codec], self._comm)
        label = f"{self.runtime.prefix}.outer"
        tag = exchange_tag(f"{label}|{tensor.dtype}", tuple(tensor.shape), step)
        words = tag_words(tag)
        try:  # the sum plans' allreduce carries no tag: every call checks it first
            check_tag_words(self._comm.allgather_async(words, f"{label}.tag").wait(), label)
        except OutOfStep as exc:  # (its advice is the doors' with steps of their own)
            raise OutOfStep(f"the ranks passed different keys to allreduce (this rank: key="
                            f"{key!r}); nothing was combined: pass the same key on every rank. "
                            + str(exc).split("; nothing was combined")[0]) from None
        self.stats.bytes_sent += words.nbytes
        if tensor.numel() == 0:
            return tensor.detach().clone()
        pending = self.runtime.start(self.codec, flat_array(tensor), step, PAYLOAD_KEY,
                                     f"{label}|{tensor.dtype}", shape=tuple(tensor.shape))
        pending.advance(block=True)
        mean = as_tensor(self.runtime.finish(pending))
        return mean.to(tensor.device).reshape(tensor.shape).to(tensor.dtype)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed job needs to continue bit for bit: the adaptive codecs' states and
        the group's size, as plain values."""
        return {"world_size": self._comm.size, "codec_states": self.codec_states.state_dict()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s state (load it on every rank). Saved at another
        world size, the states are adapted with one warning.

        Raises:
            ValueError: ``saved`` is not such a state.
        """
        if not isinstance(saved, dict) or "codec_states" not in saved:
            raise ValueError("not an OuterAllreduce state: pass what state_dict() returned")
        load_codec_states(self.codec_states, saved["codec_states"], saved.get("world_size"),
                          self._comm.size, _DOOR)


#: the holders :func:`allreduce` builds: (group, compression) -> (group, compression, holder),
#: the objects kept so that their ids stay theirs
_HOLDERS: dict[tuple[int, Any], tuple[Any, Any, OuterAllreduce]] = {}


def allreduce(tensor: torch.Tensor, compression: Codec | str | CompressorSettings | OuterAllreduce,
              group: Any = None, *, key: int | str) -> torch.Tensor:
    """The mean of ``tensor`` over the ranks of ``group``, estimated by an unbiased codec: the
    compressed all-reduce of a local-SGD or DiLoCo outer step.

    Rank i sends an unbiased Q(x_i) and every rank decodes every payload in one order, so every
    rank returns the same y = (1/n) sum_i Q(x_i), bit for bit, with E[y] = the mean and, per
    bucket of d elements, E||y - mean||^2 <= (1/n^2) sum_i omega ||x_i||^2 with omega =
    ``codec.omega(d)`` (QSGD: Communication-Efficient SGD via Gradient Quantization and
    Encoding, Lemma 3.1: min(d/s^2, sqrt(d)/s) for s levels). Global-QSGD (Global-QSGD:
    Practical Floatless Quantization for Distributed Learning with Theoretical Guarantees)
    scales by the norm over every rank: E||y - mean||^2 <= theta (1/n) sum_i ||x_i||^2, theta =
    ``codec.theta(d)`` (Definition 2.2). The draws depend only on the key and the seed
    (``OuterAllreduce.seed_of``), so ``hq.mean_estimate`` reproduces y.

    Args:
        tensor: this rank's float32, float16 or bfloat16 tensor, of any shape and device; the
            result has its shape, dtype and device. Non-finite values stay non-finite.
        compression: an :class:`OuterAllreduce`, or what it takes (a codec, ``"qsgd:8"``, a
            ``Compression.<codec>(...)``), for which one is built at the first call and kept
            for this group. A codec that adapts between exchanges (nested dithered quantization)
            must come in an ``OuterAllreduce``, whose ``state_dict()`` a checkpoint saves.
        group: the torch.distributed process group (None: the default group); this rank must be
            in it.
        key: an int or a str naming the exchange (the outer step), the same on every rank.

    Returns:
        The mean estimate, identical on every rank.

    Raises:
        ValueError: a tensor that is not float32, float16 or bfloat16; no key; a rank outside
            ``group``; an adaptive codec outside an ``OuterAllreduce``.
        horovod_quant.exchange.wire.OutOfStep: the ranks passed different keys (the tag check
            names them), on every rank, before anything is combined; its base class
            ``TagMismatch``: tensors of different shapes or dtypes.
    """
    if isinstance(compression, OuterAllreduce):
        if group is not None and group is not compression.group:
            raise ValueError("group= is not the OuterAllreduce's group: leave it out, or build "
                             "an OuterAllreduce for that group")
        return compression(tensor, key=key)
    key_number(key)
    check_tensor(tensor)
    check_member(group)
    ident = (id(group), compression if isinstance(compression, str) else id(compression))
    held = _HOLDERS.get(ident)
    if held is None:
        outer = OuterAllreduce(compression, group)
        if outer.codec.new_state() is not None:
            raise ValueError(
                f"{outer.codec.name} adapts from one exchange to the next: build outer = "
                f"horovod_quant.torch.OuterAllreduce(...) once and pass it as compression, so "
                "that outer.state_dict() goes into the checkpoint")
        held = _HOLDERS[ident] = (group, compression, outer)
    return held[2](tensor, key=key)
