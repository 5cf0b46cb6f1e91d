"""TensorFlow door: ``Compression.<codec>(...)`` for ``hvd.DistributedGradientTape`` and the
Keras ``hvd.DistributedOptimizer`` (horovod.tensorflow.keras), eager and inside ``tf.function``.

    import horovod.tensorflow as hvd
    import horovod_quant.tensorflow as hqtf
    tape = hvd.DistributedGradientTape(tape, compression=hqtf.Compression.qsgd(bits=4))

Use tf-keras (``TF_USE_LEGACY_KERAS=1``) for the Keras door; see docs/tensorflow.md.
"""
from ..doors import DoorOptions
from ..policy import LayerPolicy
from ..stats import StepStats
from .compression import Compression, QuantizedCompressor
from .reporting import StatsCallback

__all__ = ["Compression", "DoorOptions", "LayerPolicy", "QuantizedCompressor", "StatsCallback",
           "StepStats"]
