"""horovod_quant: unbiased gradient quantizers for Horovod (QSGD, NUQSGD, natural compression
and dithering, Global-QSGD, nested dithered quantization).

Framework adapters live in ``horovod_quant.torch`` and ``horovod_quant.tensorflow``; the math
is in ``horovod_quant.core``.
"""
from .core import Codec, Payload, available_codecs, derive_key, get_codec, mean_estimate, worker_seed

__version__ = "0.1.0"

__all__ = [
    "Codec", "Payload", "available_codecs", "derive_key", "get_codec", "mean_estimate",
    "worker_seed", "__version__",
]
