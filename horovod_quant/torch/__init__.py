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

import importlib
from typing import Any

from ..doors import DoorOptions
from ..policy import LayerPolicy
from ..stats import StepStats

#: the names that need Horovod -> the module that defines them
_HOROVOD_NAMES = {"Compression": ".compression", "QuantizedCompressor": ".compression",
                  "DistributedOptimizer": ".optimizer", "StatsLogger": ".reporting"}


def __getattr__(name: str) -> Any:
    if name not in _HOROVOD_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_HOROVOD_NAMES[name], __name__)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "horovod":
            raise
        raise ModuleNotFoundError(
            f"horovod_quant.torch.{name} needs Horovod, which is not installed (scripts/"
            "install.sh builds it); the DDP hook does not: horovod_quant.torch.ddp."
            "QuantizationState(hq.get_codec(...))", name="horovod") from exc
    return getattr(module, name)

__all__ = ["Compression", "DistributedOptimizer", "DoorOptions", "LayerPolicy",
           "QuantizedCompressor", "StatsLogger", "StepStats"]
