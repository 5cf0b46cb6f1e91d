"""What the launch modules of the CUDA backend share (``levels``, ``global_qsgd``, ``dithered``,
one per ``kernels/*.cu`` file, combined in :class:`horovod_quant.backends.cuda.CudaBackend`)."""
from __future__ import annotations

from typing import Any

from ..protocol import MODE_DITHER, MODE_EXP, MODE_GEOMETRIC, MODE_NESTED, MODE_UNIFORM, Keys

#: the modes of the ``hq_encode`` kernel
ENCODE_MODES = (MODE_UNIFORM, MODE_GEOMETRIC, MODE_EXP, MODE_DITHER, MODE_NESTED)


def int_keys(keys: Keys) -> tuple[int, int]:
    """Key halves as Python ints (kernel arguments)."""
    return int(keys[0]), int(keys[1])


class Launches:
    """Base of the launch classes: ``kernels`` is the kernel launcher (module doc of
    :mod:`horovod_quant.backends.cuda`), ``xp`` its array module."""

    kernels: Any
    xp: Any

    def to_host(self, a: Any) -> Any:
        """A NumPy copy of a device array."""
        return self.kernels.to_host(a)
