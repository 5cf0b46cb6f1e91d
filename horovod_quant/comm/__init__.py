"""How payloads travel between ranks: exchanges over Horovod collectives and custom allreduces."""
from .backend import Collectives, Done, Handle, LocalCollectives
from .exchange import CUSTOM_COLLECTIVES, Exchange, ExchangeStats, Pending, global_norm
from .mpi_exp import mpi_exponent_factory
from .staging import HostStaged

CUSTOM_COLLECTIVES["exponent_allreduce"] = mpi_exponent_factory

__all__ = [
    "CUSTOM_COLLECTIVES", "Collectives", "Done", "Exchange", "ExchangeStats", "Handle",
    "HostStaged", "LocalCollectives", "Pending", "global_norm",
]
