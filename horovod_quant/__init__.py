"""horovod_quant: unbiased gradient quantizers for Horovod (QSGD, NUQSGD, natural compression
and dithering, Global-QSGD, nested dithered quantization).

The framework doors live in ``horovod_quant.torch`` and ``horovod_quant.tensorflow``; the math
is in ``horovod_quant.core``; applications of the package (the predictor) in
``horovod_quant.tools``.
"""
import os

# numba's error-message highlighting calls colorama.init(), whose exit hook writes ESC[0m when
# stdout is a terminal, which Open MPI gives every rank: off unless the user chose otherwise
# (effective when numba is imported after this package, the usual order).
os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")

from .core import Codec, Payload, available_codecs, derive_key, get_codec, worker_seed  # noqa: E402
from .exchange.reference import mean_estimate  # noqa: E402

__version__ = "0.2.0"

__all__ = [
    "Codec", "Payload", "available_codecs", "derive_key", "get_codec", "mean_estimate",
    "worker_seed", "__version__",
]
