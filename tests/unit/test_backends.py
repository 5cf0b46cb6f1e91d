"""The backend interface: which backend an array gets, and missing kernels as errors (the
bytes themselves: tests/cuda_parity, tests/gpu; the import direction: test_architecture.py)."""
import subprocess
import sys

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant import backends as B
from horovod_quant.backends.cuda import CudaBackend
from horovod_quant.backends.numba import NumbaBackend


class _Launcher:
    """A CUDA kernel launcher on NumPy arrays whose kernels must not run."""

    xp = np

    def to_host(self, a):
        return np.asarray(a)

    def __getattr__(self, name):
        raise AssertionError(f"kernel {name} launched")


def test_numpy_arrays_get_numba_without_importing_cupy_or_torch():
    code = ("import sys, numpy as np, horovod_quant as hq\n"
            "from horovod_quant.backends import backend_of\n"
            "c = hq.get_codec('qsgd', bits=4)\n"
            "x = np.ones(100, np.float32)\n"
            "c.decode(c.encode(x, 1))\n"
            "print(type(backend_of(x)).__name__, 'cupy' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert out.stdout.split() == ["NumbaBackend", "False", "False"], out.stderr


def test_use_backend_chooses_for_numpy_and_restores():
    x = np.zeros(3, np.float32)
    fake = CudaBackend(_Launcher())
    assert isinstance(B.backend_of(x), NumbaBackend)
    with B.use_backend(fake) as be:
        assert be is fake and B.backend_of(x) is fake
    assert isinstance(B.backend_of(x), NumbaBackend)


def test_missing_kernel_is_an_error_that_says_what_to_do():
    codec = hq.get_codec("qsgd", bits=3, elias=True)
    x = np.ones(100, np.float32)
    with B.use_backend(CudaBackend(_Launcher())), \
            pytest.raises(B.MissingKernel, match=r"no CUDA kernel for Elias coding .*elias=False"):
        codec.encode(x, 1)


@pytest.mark.parametrize("backend", [NumbaBackend(), CudaBackend(_Launcher())],
                         ids=["numba", "cuda"])
def test_unknown_mode_is_rejected(backend):
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="unknown mode 9"):
        backend.encode(x, np.zeros(64, np.uint8), 0, 10, 9, 4, (1, 2))


#: key halves as a caller may hold them (Python integers): distinctive values to find in the
#: arguments the kernels receive
K0, K1 = 0x9E3779B9, 0x7F4A7C15


@pytest.mark.parametrize("call", [
    lambda be, z: be.encode(z, z, 0, 8, B.MODE_UNIFORM, 4, (K0, K1)),
    lambda be, z: be.encode(z, z, 0, 8, B.MODE_DITHER, 4, (K0, K1)),
    lambda be, z: be.encode(z, z, 0, 8, B.MODE_EXP, 4, (K0, K1)),
    lambda be, z: be.linear_encode(z, 4, 7, 1.0, (K0, K1), z),
    lambda be, z: be.encode_sparse(z, B.MODE_EXP, 1.0, 7, 1, 4, (K0, K1)),
    lambda be, z: be.exp_combine(z, z, z, 8, 0, 4, K0, K1),
    lambda be, z: be.decode_dither([z], [(K0, K1)], 0, 8, 8, 4, 3, z, False),
    lambda be, z: be.decode_nested(z, 0, 8, 8, 3, 2, 4, 1.0, 1.0, z, (K0, K1), z),
    lambda be, z: be.count_outside(z, z, 0, 8, 8, 3, 2, 4, 1.0, z, (K0, K1)),
], ids=["levels", "dither", "exp", "linear", "sparse", "exp_combine", "decode_dither",
        "decode_nested", "count_outside"])
def test_numba_kernels_get_uint32_keys_from_any_integers(call, monkeypatch):
    """Python integers as keys reach the kernels as uint32: numba compiles a kernel once per
    argument type, and a second compile of a keyed kernel costs as much as the first."""
    from horovod_quant.backends.numba import dithered, global_qsgd, levels

    received = []

    def record(*args):
        received.extend(a for a in args if not isinstance(a, np.ndarray) and a in (K0, K1))
        return (0.0, 0) if len(args) == 13 else 0  # decode_nested returns a pair

    for module in (levels, dithered, global_qsgd):
        for name in ("encode_levels", "encode_dithered", "encode_exp", "encode_linear",
                     "encode_sparse", "exp_combine", "decode_dithered", "decode_nested",
                     "fine_indices", "nested_outside"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, record)
    call(NumbaBackend(), np.zeros(8, np.float32))
    assert len(received) >= 2 and all(type(k) is np.uint32 for k in received), received
