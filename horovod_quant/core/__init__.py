"""Framework-neutral codecs: each method runs on the backend of its arrays
(:func:`horovod_quant.backends.backend_of`: numba for NumPy, CUDA for CuPy / CUDA torch).

Nothing here imports torch, tensorflow, CuPy or horovod.
"""
from .base import Codec, as_vector, worker_seed
from .baselines import BF16, FP16, NoCompression
from .dithered import DitheredQuantizer
from .global_qsgd import GlobalQSGD
from .nested_dithered import NestedDitheredQuantizer
from .payload import Payload
from .quantizers import NUQSGD, QSGD, NaturalCompression, NaturalDithering, StandardDithering
from .registry import available_codecs, get_codec, register
from .rng import derive_key

for _cls in (NoCompression, FP16, BF16, QSGD, NUQSGD, NaturalCompression, NaturalDithering,
             StandardDithering, GlobalQSGD, DitheredQuantizer, NestedDitheredQuantizer):
    register(_cls)

__all__ = [
    "Codec", "Payload", "as_vector", "available_codecs", "derive_key", "get_codec",
    "register", "worker_seed",
]
