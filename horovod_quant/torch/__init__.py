"""PyTorch door: ``Compression.<codec>(...)`` for ``hvd.DistributedOptimizer`` and a drop-in
``DistributedOptimizer`` with fusion, grouped norms and a per-layer policy.

    import horovod.torch as hvd
    import horovod_quant.torch as hqt
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd(bits=4, bucket_size=512))
"""
from ..doors import DoorOptions
from ..policy import LayerPolicy
from ..stats import StepStats
from .compression import Compression, QuantizedCompressor
from .optimizer import DistributedOptimizer
from .reporting import StatsLogger

__all__ = ["Compression", "DistributedOptimizer", "DoorOptions", "LayerPolicy",
           "QuantizedCompressor", "StatsLogger", "StepStats"]
