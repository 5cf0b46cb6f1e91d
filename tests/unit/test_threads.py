"""The CPU kernels release the GIL, so the mpi4py reduction thread (and any other thread of
the user's) runs beside an encode or decode on the main thread."""
import importlib
import pkgutil

from numba.core.registry import CPUDispatcher

import horovod_quant.backends.numba as numba_backend


def _kernels():
    for info in pkgutil.iter_modules(numba_backend.__path__):
        mod = importlib.import_module(f"{numba_backend.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == mod.__name__:
                yield f"{mod.__name__}.{name}", obj


def test_every_cached_kernel_releases_the_gil():
    kernels = dict(_kernels())
    assert "horovod_quant.backends.numba.global_qsgd.exp_combine" in kernels
    entry = {n: k for n, k in kernels.items() if k.targetoptions.get("inline") != "always"}
    holding = [n for n, k in entry.items() if not k.targetoptions.get("nogil")]
    assert len(entry) >= 20 and not holding, holding
