"""One door's exchanges: what every door hands ``(key, flat vector)`` to and takes the mean from.

Each door (``compression=``, ``hq.torch.DistributedOptimizer``, the DDP and FSDP hooks, the
outer all-reduce, Horovod TensorFlow) builds one :class:`ExchangeRuntime`. It owns the
exchanges (one :class:`~.driver.Exchange` per codec), the adaptive codecs' states, the
cross-rank check, the fabric the plans weigh, the statistics and the seeds. A payload's seed
is :func:`~horovod_quant.core.rng.payload_seed` of the door's base seed, its step, its key (a
tensor's name, or the names of a bucket's parameters) and its offset in that key's elements,
and each pipelined piece's :func:`~.plans.pipeline_seed` of that: the same function of the same
inputs in every door, so one gradient named alike gets the same bits through any of them. The
doors differ only in when they call it (a hook, a compressor, a graph op).
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from ..core.base import Codec
from ..core.rng import payload_seed
from . import plans, wire
from .check import CONFIG_TIMEOUT_S, ConfigCheck
from .codec_states import CodecStates
from .collectives import Collectives
from .cost import Fabric
from .driver import Exchange, Pending, custom_collective
from .step_stats import StepStats


class ExchangeRuntime:
    """The exchanges of one door over one group of ranks.

    Args:
        seed: the door's base seed.
        gather: the gather schedule (:data:`~.plans.GATHER_SCHEDULES`).
        pipeline_elems: piece length in elements (None: whole vectors).
        fabric: the links the plan choice weighs (None: set later, or CPU ranks' defaults).
        timeout: seconds the check waits for a rank that does not join.

    Attributes:
        states: the adaptive codecs' states (NDQSG's) the exchanges carry from step to step.
        stats: the :class:`~.step_stats.StepStats` of the exchanges finished through
            :meth:`finish` (and what the door adds) since the last ``stats.reset()``.
        codecs: the codecs of :meth:`open`, each configuration once, in the door's order.
        comm: the collectives the exchanges run on, once open.
    """

    def __init__(self, seed: int, gather: str, pipeline_elems: int | None,
                 fabric: Fabric | None = None, timeout: float = CONFIG_TIMEOUT_S) -> None:
        self.seed = seed
        self.gather = plans.check_gather(gather)
        self.pipeline_elems = plans.check_pipeline_elems(pipeline_elems)
        self.fabric = fabric
        self.timeout = timeout
        self.states = CodecStates()
        self.stats = StepStats()
        self.codecs: list[Codec] = []
        self.comm: Collectives | None = None
        self._check: ConfigCheck | None = None
        self._exchanges: dict[tuple, Exchange] = {}
        self._customs: dict[tuple, Any] = {}

    # -- seeds ------------------------------------------------------------------------------
    def seed_of(self, step: int, key: str, offset: int = 0, codec_index: int = 0) -> int:
        """The seed of the payload of ``key`` at ``step`` from element ``offset``, through
        the door's codec ``codec_index`` (:func:`~horovod_quant.core.rng.payload_seed`)."""
        return payload_seed(self.seed, step, key, offset, codec_index)

    # -- the check ------------------------------------------------------------------------------
    def check(self, comm: Collectives, config: dict) -> str:
        """Start the cross-rank check of ``config`` over ``comm`` without waiting (once; a
        later call returns the same prefix); returns its prefix, which names the door's
        collectives."""
        if self._check is None:
            self._check = ConfigCheck(comm, config, self.timeout)
        return self._check.prefix

    @property
    def checking(self) -> bool:
        """Whether the check has started."""
        return self._check is not None

    @property
    def prefix(self) -> str:
        """The check's prefix (the check must have started)."""
        return self._check.prefix

    def wait_check(self) -> str:
        """Wait for the check; the same ValueError on every rank when the configurations
        differ (again at every later call); returns the prefix."""
        return self._check.wait()

    def check_again(self, comm: Collectives, config: dict) -> str:
        """A further check, waited for (the door changed what it exchanges: a new layout);
        returns its prefix."""
        return ConfigCheck(comm, config, self.timeout).wait()

    # -- the exchanges ----------------------------------------------------------------------
    def open(self, codecs: Iterable[Codec], comm: Collectives) -> None:
        """Wait for the check, then build an exchange for each of ``codecs`` on ``comm`` in
        their order (their collective set-up, e.g. an MPI communicator, runs in the same order
        on every rank). Once: a later call only waits for the check."""
        self.wait_check()
        if self.comm is not None:
            return
        unique: dict[tuple, Codec] = {}
        for codec in codecs:
            unique.setdefault(codec.config_key(), codec)
        self.codecs, self.comm = list(unique.values()), comm
        self._exchanges = {key: Exchange(c, comm, gather=self.gather,
                                         pipeline_elems=self.pipeline_elems,
                                         fabric=self.fabric, states=self.states)
                           for key, c in unique.items()}

    @property
    def opened(self) -> bool:
        return self.comm is not None

    def exchange_of(self, codec: Codec) -> Exchange:
        return self._exchanges[codec.config_key()]

    def blocks_on_peers(self, codec: Codec) -> bool:
        """Whether ``codec``'s exchanges pair by call order (:attr:`.Exchange.blocks_on_peers`);
        True before :meth:`open`: nothing may start yet."""
        exchange = self._exchanges.get(codec.config_key())
        return exchange is None or exchange.blocks_on_peers

    def start(self, codec: Codec, vector: Any, step: int, key: str, name: str, *,
              offset: int = 0, codec_index: int = 0, out: Any = None,
              shape: Sequence[int] | None = None) -> Pending:
        """Start the exchange of ``vector`` (float32, 1-D; this rank's elements ``offset`` on
        of ``key``'s) at ``step`` under the collective name ``name``, seeded
        :meth:`seed_of`; its tag (:func:`~.wire.exchange_tag` of ``name``, ``shape``, default
        the vector's, and ``step``) makes ranks out of step or holding other tensors raise.
        The mean goes to ``out`` (None: a new array)."""
        tag = wire.exchange_tag(name, (vector.size,) if shape is None else shape, step)
        return self.exchange_of(codec).start(vector, self.seed_of(step, key, offset, codec_index),
                                             name, out=out, tag=tag)

    def finish(self, pending: Pending) -> Any:
        """The mean of a started exchange; its bytes and times count in :attr:`stats`."""
        mean = pending.wait()
        self.stats.add(pending.stats)
        return mean

    def use_fabric(self, fabric: Fabric) -> None:
        """Choose the plans again for ``fabric`` (a measured one)."""
        self.fabric = fabric
        for exchange in self._exchanges.values():
            exchange.use_fabric(fabric)

    # -- for a runner of its own (TensorFlow's graph ops) ---------------------------------------
    def custom_for(self, codec: Codec, comm: Collectives) -> Any:
        """``codec``'s custom collective on ``comm`` (set up once per codec), or None."""
        key = codec.config_key()
        if key not in self._customs:
            self._customs[key] = custom_collective(codec, comm)
        return self._customs[key]

    def piece_plan(self, kind: str, codec: Codec, x: np.ndarray, step: int, key: str,
                   piece: int, pieces: int, rank: int, n: int, norm: float | None,
                   tag: wire.Tag, label: str) -> plans.Plan:
        """The plan of piece ``piece`` of ``pieces`` of ``key``'s vector at ``step`` (``x``:
        its elements), seeded as :meth:`start` seeds it, for a runner that drives plans
        itself."""
        seed = plans.pipeline_seed(self.seed_of(step, key), piece, pieces)
        return plans.plan_of(kind)(plans.Piece(codec, x, seed, rank, n, norm, tag,
                                               np.empty(x.size, np.float32), label,
                                               states=self.states))
