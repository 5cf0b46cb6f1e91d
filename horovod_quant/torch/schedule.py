"""When ``hq.torch.DistributedOptimizer``'s exchanges start and finish.

A bucket's exchange starts from the backward hook of its last gradient, so communication
overlaps the rest of backward. Over collectives that pair by call order (the gloo transport)
buckets start in bucket order, each once the ones before it have; a bucket whose exchange
blocks on its peers (an exchange that pairs by call order over Horovod's collectives) starts at
``synchronize()``, in bucket order. Bucket ``i`` of step ``t`` goes through the optimizer's
:class:`~horovod_quant.exchange.runtime.ExchangeRuntime` keyed by its parameters' names
(comma-joined: seed ``payload_seed(seed, t, names)``, as in every door) under the collective name
``<check prefix>.b<i>``. Gradients the
layout leaves to Horovod go through Horovod's own allreduce
(:class:`~horovod_quant.torch.horovod_path.HorovodPath`). This module imports no Horovod: it
runs on any :class:`~horovod_quant.exchange.collectives.Collectives`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from ..exchange.collectives import Collectives
from ..exchange.driver import Exchange
from ..exchange.runtime import ExchangeRuntime
from .buckets import Bucket
from .tensors import as_tensor, stream_of

#: gives a bucket's input vector (its gradients, flat)
FlatOf = Callable[[Bucket], Any]


class ExchangeSchedule:
    """Starts and finishes the buckets' exchanges of each step.

    Args:
        comm: the collectives the exchanges run on.
        runtime: the optimizer's exchanges (open on ``comm``).
        names: ``{id(parameter): name}`` (a bucket's key: its parameters' names).
        prefix: the configuration check's prefix (names the collectives).
    """

    def __init__(self, comm: Collectives, runtime: ExchangeRuntime, names: dict[int, str],
                 prefix: str) -> None:
        self._comm, self._runtime, self._names = comm, runtime, names
        self._prefix = prefix
        self.buckets: list[Bucket] = []
        self._next = 0  # the first bucket not started, over collectives that pair by order

    def use(self, buckets: list[Bucket]) -> None:
        """The buckets of the layout from now on."""
        self.buckets = buckets
        self._next = 0

    def exchange_of(self, bucket: Bucket) -> Exchange:
        return self._runtime.exchange_of(bucket.codec)

    def key_of(self, bucket: Bucket) -> str:
        """``bucket``'s key in the seeds: its parameters' names, comma-joined."""
        return ",".join(self._names[id(p)] for p in bucket.params)

    def seed_of(self, step: int, bucket: Bucket) -> int:
        """The seed of ``bucket``'s exchange at ``step``."""
        return self._runtime.seed_of(step, self.key_of(bucket))

    def start(self, bucket: Bucket, step: int, flat_of: FlatOf) -> None:
        """Start ``bucket``'s exchange of ``flat_of(bucket)`` (its name is the same every step:
        Horovod caches it; its tag carries ``step``, so ranks out of step raise)."""
        name = f"{self._prefix}.b{bucket.index}"
        with stream_of(bucket.params[0]):
            flat = flat_of(bucket)
            bucket.pending = self._runtime.start(bucket.codec, flat, step, self.key_of(bucket),
                                                 name, out=bucket.mean)

    def bucket_ready(self, bucket: Bucket, step: int, flat_of: FlatOf) -> None:
        """One more of ``bucket``'s gradients is ready: start what may start now
        (``flat_of(bucket)`` gives a bucket's input vector)."""
        bucket.ready += 1
        if self._comm.pairs_by_order:
            self._start_in_order(step, flat_of)
        elif (bucket.ready == len(bucket.params)
              and not self.exchange_of(bucket).blocks_on_peers):
            self.start(bucket, step, flat_of)

    def _start_in_order(self, step: int, flat_of: FlatOf) -> None:
        """Start each bucket whose gradients are all here once the buckets before it have
        started, and put its pieces on the wire at once (waiting for its norm), so that every
        rank issues the same collectives in the same order whatever order its hooks ran in,
        as DDP's reducer does."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.ready < len(bucket.params):
                return
            self.start(bucket, step, flat_of)
            with stream_of(bucket.params[0]):
                bucket.pending.advance(block=True)
            self._next += 1

    def advance(self) -> None:
        """Put on the wire the pieces of the started buckets whose global norm has arrived,
        so that they are encoded and sent during the rest of backward."""
        for b in self.buckets:
            if b.pending is not None and not b.pending.issued:
                with stream_of(b.params[0]):
                    b.pending.advance()

    def finish(self, step: int, flat_of: FlatOf) -> Iterator[tuple[Bucket, Any]]:
        """Start the buckets not started yet (in bucket order), put every bucket's pieces on
        the wire in bucket order (so no bucket's transfer waits for the one before it to
        finish), then yield each bucket with its mean (a tensor), in bucket order; they count
        in the runtime's statistics."""
        for b in self.buckets:
            if b.pending is None:
                self.start(b, step, flat_of)
        for b in self.buckets:
            with stream_of(b.params[0]):
                b.pending.advance(block=True)
        for b in self.buckets:
            with stream_of(b.params[0]):
                mean = as_tensor(self._runtime.finish(b.pending))
            yield b, mean
            b.pending = None
            b.ready = 0
        self._next = 0

    @property
    def in_flight(self) -> bool:
        return any(b.pending is not None for b in self.buckets)
