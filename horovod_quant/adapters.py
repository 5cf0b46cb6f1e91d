"""What the torch and TensorFlow adapters share: the compressors' settings, the cross-rank
configuration check and the ``Compression.<codec>(...)`` namespace."""
from __future__ import annotations

from typing import Any, Callable

from .core import available_codecs, get_codec
from .core.base import Codec
from .core.schedules import resolve_gather
from .policy import LayerPolicy, describe
from .stats import StepStats

#: codecs whose construction needs the number of workers
WORLD_SIZED = ("global_qsgd", "nested_dithered")


def check_same_config(comm: Any, config: dict, name: str) -> None:
    """Raise the same ValueError on every rank when ``config`` differs between ranks.

    Args:
        comm: the adapter's :class:`~horovod_quant.comm.Collectives` (allgather_object).
        config: everything that must agree (codec, parameters, seed, policy, ...).
        name: collective name, the same on every rank.
    """
    configs = comm.allgather_object(config, name)
    if any(c != configs[0] for c in configs):
        lines = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(configs))
        raise ValueError("horovod_quant configuration differs between ranks; every rank must "
                         f"build the same codec, parameters and seed:\n{lines}")


class CompressorSettings:
    """The settings both adapters' ``QuantizedCompressor`` hold (validated here).

    Args:
        codec: the codec (see :func:`horovod_quant.get_codec`).
        seed: base seed of every random draw.
        gather: schedule for gather codecs: "auto", "allgather" or "sra".
        policy: which tensors are compressed (default :class:`LayerPolicy`: small and 1-D
            tensors travel uncompressed through Horovod's own allreduce).
        process_set: Horovod process set of the optimizer or tape, if not the global one.

    Attributes:
        stats: :class:`~horovod_quant.stats.StepStats` since the last ``stats.reset()``.
    """

    def __init__(self, codec: Codec, seed: int = 0, gather: str = "auto",
                 policy: LayerPolicy | None = None, process_set: Any = None) -> None:
        resolve_gather(gather, 1)  # validates the name
        self.codec = codec
        self.seed = int(seed)
        self.gather = gather
        self.policy = policy if policy is not None else LayerPolicy()
        self.process_set = process_set
        self.stats = StepStats()

    def shared_config(self) -> dict:
        """What must agree across ranks (see :func:`check_same_config`)."""
        return {**self.codec.config(), "seed": self.seed, "gather": self.gather,
                "policy": describe(self.policy)}


class CompressionNamespace:
    """``Compression.<codec>(**params)`` for every registered codec, like Horovod's
    ``hvd.Compression`` (whose members are used without a call).

    Args:
        compressor_cls: the adapter's compressor class, built as
            ``compressor_cls(codec, seed=, gather=, policy=, process_set=)``.
        global_process_set: the framework's ``hvd.global_process_set`` (fills ``world_size``).
        framework: named in the generated docstrings.
    """

    def __init__(self, compressor_cls: type, global_process_set: Any, framework: str) -> None:
        self._cls = compressor_cls
        self._global = global_process_set
        self._framework = framework

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in available_codecs():
            raise AttributeError(f"no codec {name!r}; valid: {', '.join(available_codecs())}")

        def make(seed: int = 0, gather: str = "auto", policy: Any = None,
                 process_set: Any = None, **params: Any) -> Any:
            if name in WORLD_SIZED and "world_size" not in params:
                params["world_size"] = (process_set if process_set is not None else self._global).size()
            return self._cls(get_codec(name, **params), seed=seed, gather=gather,
                             policy=policy, process_set=process_set)

        make.__name__ = name
        make.__doc__ = (f"A Horovod {self._framework} Compressor running the ``{name}`` codec.\n\n"
                        f"Args: seed, gather, policy, process_set (see QuantizedCompressor) and "
                        f"the codec's own parameters (docs/codecs.md).")
        return make

    def __dir__(self) -> list[str]:
        return available_codecs()
