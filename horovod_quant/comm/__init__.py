"""The former name of :mod:`horovod_quant.exchange`, for code written against it (the DDP door
in progress): the same objects, and its modules under their old names (``backend`` is
:mod:`~horovod_quant.exchange.collectives`, ``exchange`` :mod:`~horovod_quant.exchange.driver`,
``steps`` :mod:`~horovod_quant.exchange.wire`). New code imports :mod:`horovod_quant.exchange`."""
import sys

from ..exchange import *
from ..exchange import __all__, collectives, driver, mpi_exp, staging, wire  # noqa: F401

for _old, _module in {"backend": collectives, "exchange": driver, "mpi_exp": mpi_exp,
                      "staging": staging, "steps": wire}.items():
    sys.modules[f"{__name__}.{_old}"] = _module
    globals()[_old] = _module
