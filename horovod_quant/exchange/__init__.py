"""How payloads travel between ranks: the exchange plans and the runners that carry them out.

* :mod:`.plans`: every exchange kind (sum, allgather, custom, scatter-reduce-allgather, the
  global-norm prologue, the NDQSG outage epilogue) written once, as generators that yield
  collective requests between local steps;
* :mod:`.wire`: frames, tags and the norm statistics' words;
* :mod:`.driver`: :class:`Exchange`, the runner over asynchronous :class:`Collectives`
  (pipelined pieces, custom collectives);
* :mod:`.reference`: :func:`mean_estimate`, the runner of n simulated ranks in lockstep;
* :mod:`.collectives`: the :class:`Collectives` interface; :mod:`.staging`: device payloads over
  host-only collectives; :mod:`.mpi_exp`: the mpi4py exponent allreduce of Global-QSGD.

The TensorFlow compressor (``horovod_quant.tensorflow.compression``) is the graph runner.
"""
from .collectives import Collectives, Done, Handle, LocalCollectives
from .driver import CUSTOM_COLLECTIVES, Exchange, ExchangeStats, Pending, global_norm
from .mpi_exp import mpi_exponent_factory
from .reference import mean_estimate
from .staging import HostStaged

CUSTOM_COLLECTIVES["exponent_allreduce"] = mpi_exponent_factory

__all__ = [
    "CUSTOM_COLLECTIVES", "Collectives", "Done", "Exchange", "ExchangeStats", "Handle",
    "HostStaged", "LocalCollectives", "Pending", "global_norm", "mean_estimate",
]
