"""What every test of tests/emulated needs: the emulator (``benchmarks/emulator.py``) on the
import path, and root with iproute2's ``ip`` for its network namespaces."""
import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def require_namespaces() -> None:
    """Skip the calling module where ``HQ_SKIP_EMULATED=1``; without root or ``ip``, fail."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        if os.environ.get("HQ_SKIP_EMULATED") == "1":
            pytest.skip("HQ_SKIP_EMULATED=1", allow_module_level=True)
        raise RuntimeError("tests/emulated needs root and iproute2's `ip` (network "
                           "namespaces); set HQ_SKIP_EMULATED=1 to skip them")
