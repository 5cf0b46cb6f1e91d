"""The buckets of ``hq.torch.DistributedOptimizer``: which gradients travel together.

Compressed gradients are packed into buckets of about ``fusion_bytes`` float32 bytes, formed in
reverse parameter order (backward's order, so the first bucket is ready first), or into the
user's ``num_groups``/``groups``; a bucket holds the parameters of one codec and one device.
Gradients the policy leaves uncompressed, sparse ones and those the fallback moved travel on
Horovod's own allreduce instead. A bucket's flat vector is its gradients concatenated in
bucket order (docs/pytorch.md, section 1).
"""
from __future__ import annotations

from typing import Any, Callable, Collection

import numpy as np
import torch

from ..core.base import Codec
from ..policy import LayerPolicy
from .tensors import as_array, flat_array, horovod_dtype, on_gpu


class Bucket:
    """Parameters of one device and one codec exchanged together, with the bucket's flat input
    and output buffers (kept across steps: fresh multi-MB arrays would page-fault on every
    step), on the device the codec runs on.

    Attributes:
        index: the bucket's place in the layout (its seed and collective name).
        ready: how many of its parameters' gradients are ready this step.
        pending: its exchange in flight, or None.
        mean: the buffer its mean estimate is written to; the float32 contiguous gradients
            handed over by :meth:`hand_over` are views of it until the next exchange.
    """

    __slots__ = ("index", "params", "codec", "numel", "ready", "pending", "flat", "mean")

    def __init__(self, index: int, params: list[torch.nn.Parameter], codec: Codec) -> None:
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"a fusion group mixes devices {sorted(map(str, devices))}: put "
                             f"the parameters of each device in groups of their own")
        self.index = index
        self.params = params
        self.codec = codec
        self.numel = sum(p.numel() for p in params)
        self.ready = 0
        self.pending: Any = None
        self.flat: np.ndarray | None = None
        self.mean = self.buffer()

    @property
    def key(self) -> tuple:
        """What identifies the bucket across layouts (the step check switches between two)."""
        return (self.index, self.codec.config_key(), tuple(id(p) for p in self.params))

    def buffer(self) -> Any:
        """A float32 array of ``numel`` where the codec runs for these parameters."""
        p = self.params[0]
        device = p.device if on_gpu(p) else torch.device("cpu")
        return as_array(torch.empty(self.numel, dtype=torch.float32, device=device))

    def flat_input(self, travels: Callable[[torch.nn.Parameter], bool]) -> Any:
        """The bucket's gradients as one float32 vector: the gradient itself (a view) for a
        one-parameter float32 bucket, else copied into the bucket's buffer, with zeros for a
        parameter without a gradient this step or one that ``travels`` says is elsewhere."""
        parts = [flat_array(p.grad) if p.grad is not None and travels(p) else None
                 for p in self.params]
        if len(parts) == 1 and parts[0] is not None:
            return parts[0]
        if self.flat is None:
            self.flat = self.buffer()
        offset = 0
        for p, part in zip(self.params, parts):
            dst = self.flat[offset:offset + p.numel()]
            if part is None:
                dst.fill(0)
            else:
                dst[:] = part
            offset += p.numel()
        return self.flat

    def hand_over(self, p: torch.nn.Parameter, mean: torch.Tensor) -> None:
        """``p``'s averaged gradient (``mean``: its part of the bucket's mean) as ``p.grad``:
        the part itself where ``p`` is float32 and contiguous (as DDP's
        ``gradient_as_bucket_view``: no copy of the whole bucket on every step; the next
        exchange writes over it), else copied into ``p.grad`` (made if missing).

        A gradient ``zero_grad(set_to_none=False)`` keeps is then the next exchange's input
        and its output at once: every plan encodes a piece's input before it writes the
        piece's mean (tests/parallel/test_simulated_workers.py runs such steps)."""
        view = mean.view(p.shape)
        if p.dtype == torch.float32 and p.is_contiguous() and view.device == p.device:
            p.grad = view
            return
        if p.grad is None:  # unused here, used elsewhere
            p.grad = torch.zeros_like(p)
        p.grad.copy_(view)


def form_buckets(params: list, codec: Codec, groups: Any, fusion_bytes: int,
                 first: int) -> list[Bucket]:
    """The buckets of ``params`` (all of one codec), numbered from ``first``: the user's
    ``groups`` (lists of parameters; the others one bucket each), ``num_groups`` (an int:
    that many buckets of equal bytes), else buckets of about ``fusion_bytes``, in reverse
    parameter order and one device each."""
    if groups is not None and not isinstance(groups, int):
        chosen = {id(p) for g in groups for p in g}
        lists = [[p for p in g if any(p is q for q in params)] for g in groups]
        lists += [[p] for p in params if id(p) not in chosen]
    else:
        lists, current, size = [], [], 0
        limit = fusion_bytes
        if isinstance(groups, int) and groups > 0:
            total = sum(p.numel() * 4 for p in params)
            limit = max(1, -(-total // groups))
        for p in reversed(params):
            if current and p.device != current[-1].device:
                lists.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * 4
            if size >= limit:
                lists.append(current)
                current, size = [], 0
        if current:
            lists.append(current)
    return [Bucket(first + i, members, codec)
            for i, members in enumerate(m for m in lists if m)]


class BucketLayout:
    """Which parameters Horovod's allreduce carries (and in which dtype) and the buckets of
    the others, one codec per bucket, the policy's codecs in the policy's order.

    Args:
        params: the optimizer's parameters that take gradients.
        names: ``{id(parameter): name}``.
        codec: the default codec.
        policy: the per-layer policy.
        groups: ``num_groups`` or ``groups`` (None: by ``fusion_bytes``).
        fusion_bytes: float32 bytes per bucket.

    Attributes:
        sparse: ``id`` of the parameters whose gradients came sparse (Horovod's sparse path).
        raw: the parameters Horovod's allreduce carries, ``cast`` their dtypes on the wire.
        buckets: the buckets; ``bucket_of`` maps a parameter's ``id`` to its bucket.
    """

    def __init__(self, params: list[torch.nn.Parameter], names: dict[int, str], codec: Codec,
                 policy: LayerPolicy, groups: Any, fusion_bytes: int) -> None:
        self.params, self.names = params, names
        self._codec, self._policy = codec, policy
        self._groups, self._fusion_bytes = groups, fusion_bytes
        self.sparse: set[int] = set()
        self._cache: dict[tuple, Bucket] = {}
        self.form(set(), keep_buffers=False)

    def form(self, fallen_back: Collection[int], keep_buffers: bool,
             fallback_dtype: torch.dtype = torch.float32) -> None:
        """Form the layout again, with the sparse and the ``fallen_back`` parameters on
        Horovod's allreduce (the fallen-back ones cast to ``fallback_dtype``, the fallback's
        baseline, where it is a 16-bit one). A bucket formed again keeps its buffers;
        ``keep_buffers`` keeps those of buckets that leave the layout too (it comes back
        within the step check)."""
        self.raw: list[torch.nn.Parameter] = []
        self.cast: dict[int, torch.dtype] = {}
        by_codec: dict[tuple, tuple[Codec, list]] = {}
        for p in self.params:
            codec = (None if id(p) in self.sparse or id(p) in fallen_back else
                     self._policy.codec_for(self._codec, p.shape, self.names[id(p)]))
            wire = horovod_dtype(codec, p)
            if id(p) in fallen_back and fallback_dtype != torch.float32:
                wire = fallback_dtype
            if wire is not None:
                self.raw.append(p)
                self.cast[id(p)] = wire
            else:
                by_codec.setdefault(codec.config_key(), (codec, []))[1].append(p)
        buckets: list[Bucket] = []
        for codec in self._policy.codecs(self._codec):
            _, members = by_codec.get(codec.config_key(), (codec, []))
            buckets += form_buckets(members, codec, self._groups, self._fusion_bytes,
                                    len(buckets))
        self.buckets = [self._cache.setdefault(b.key, b) for b in buckets]
        if not keep_buffers:
            self._cache = {b.key: b for b in self.buckets}
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def unfrozen(self, trainable: list[torch.nn.Parameter], named_by_user: bool) -> list:
        """The parameters of ``trainable`` the layout lacks (``requires_grad`` set since it was
        formed), each named: by ``named_parameters``, else ``param.<i>`` after the others.

        Raises:
            ValueError: one is missing from the user's ``named_parameters``.
        """
        formed = {id(p) for p in self.params}
        new = [p for p in trainable if id(p) not in formed]
        for p in new:
            if id(p) not in self.names:
                if named_by_user:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} takes gradients "
                                     "now and is missing from named_parameters: pass every "
                                     "parameter (model.named_parameters()), frozen ones too")
                self.names[id(p)] = f"param.{len(self.names)}"
        return new

    def describe(self) -> dict:
        """What of the layout must agree across ranks (the configuration check)."""
        return {"fusion_bytes": self._fusion_bytes,
                "sparse": sorted(self.names[k] for k in self.sparse),
                "buckets": [[b.codec.config(), [[self.names[id(p)], list(p.shape)]
                                                for p in b.params]] for b in self.buckets]}

    def scratch(self) -> dict[Bucket, Any]:
        """A scratch float32 view per bucket, its buckets on one device sharing one buffer (the
        largest bucket's): room to run a bucket's exchange without touching its gradients."""
        largest: dict[torch.device, Bucket] = {}
        for b in self.buckets:
            device = b.params[0].device
            if device not in largest or b.numel > largest[device].numel:
                largest[device] = b
        shared = {device: b.buffer() for device, b in largest.items()}
        return {b: shared[b.params[0].device][:b.numel] for b in self.buckets}
