"""How payloads travel between ranks: the exchange plans (:mod:`.plans`, framing in
:mod:`.wire`) and their runners, :class:`Exchange` over :class:`Collectives` (:mod:`.driver`)
and :func:`mean_estimate` (:mod:`.reference`); the TensorFlow compressor is the third.
:mod:`.staging` carries device payloads over host-only collectives; :mod:`.mpi_exponent_allreduce`
runs Global-QSGD's exponent reduction between ranks over MPI (docs/dev/architecture.md)."""
from .codec_states import CodecStates
from .collectives import Collectives, Done, Handle, LocalCollectives
from .driver import CUSTOM_COLLECTIVES, Exchange, ExchangeStats, Pending
from .reference import mean_estimate
from .staging import HostStaged

__all__ = [
    "CUSTOM_COLLECTIVES", "CodecStates", "Collectives", "Done", "Exchange", "ExchangeStats",
    "Handle", "HostStaged", "LocalCollectives", "Pending", "mean_estimate",
]
