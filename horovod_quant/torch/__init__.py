"""PyTorch door: ``Compression.<codec>(...)`` for ``hvd.DistributedOptimizer`` and a drop-in
``DistributedOptimizer`` with fusion, grouped norms and a per-layer policy.

    import horovod.torch as hvd
    import horovod_quant.torch as hqt
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd(bits=4, bucket_size=512))

The Horovod doors' names are imported when first used, so the DDP hook
(:mod:`horovod_quant.torch.ddp`) works where Horovod is not installed.
"""
from __future__ import annotations

from typing import Any

from ..doors import DoorOptions
from ..policy import LayerPolicy
from ..stats import StepStats


def __getattr__(name: str) -> Any:
    """The Horovod doors' names, imported on first use (plain imports, so import tools see
    them); a ModuleNotFoundError that says what to use where Horovod is not installed."""
    try:
        if name in ("Compression", "QuantizedCompressor"):
            from . import compression as module
        elif name == "DistributedOptimizer":
            from . import optimizer as module
        elif name == "StatsLogger":
            from . import reporting as module
        elif name == "broadcast_state":
            from . import broadcast as module
        elif name in ("OuterAllreduce", "allreduce"):
            from . import outer as module
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "horovod":
            raise
        raise ModuleNotFoundError(
            f"horovod_quant.torch.{name} needs Horovod, which is not installed (scripts/"
            "install.sh builds it); the DDP hook does not: horovod_quant.torch.ddp."
            "QuantizationState(hq.get_codec(...))", name="horovod") from exc
    return getattr(module, name)


__all__ = ["Compression", "DistributedOptimizer", "DoorOptions", "LayerPolicy",
           "OuterAllreduce", "QuantizedCompressor", "StatsLogger", "StepStats", "allreduce",
           "broadcast_state"]
