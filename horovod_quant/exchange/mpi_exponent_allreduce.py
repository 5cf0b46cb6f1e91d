"""Global-QSGD's exponent reduction run between ranks over MPI point-to-point (mpi4py, or an
object with its method names): the rounds of :func:`horovod_quant.core.exponent_reduction.
schedule`, then an allgather of the owned ranges, so every rank holds the same codes as the
one-process :func:`~horovod_quant.core.exponent_reduction.reduce_packed`.

Each round posts every send and receive, waits, and combines what arrived with the buffers'
backend kernel (:func:`horovod_quant.gpu.exp_combine`). Device payloads stay on the device when
the MPI is CUDA-aware, else they are staged through host memory. Where no communicator is given
(gloo, ``HQ_MPI_EXCHANGE=0``) the runners take the allgather plan instead: the same bits.
When the doors hand out a communicator, and why reductions run on several lanes:
docs/dev/exchange.md ("The exponent allreduce over MPI").
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import gpu
from ..backends import PACK_BLOCK
from ..core.base import array_module
from ..core.contract import Reduced
from ..core.exponent_reduction import block_byte_range, round_key, schedule
from ..core.payload import Payload
from .collectives import Collectives, Handle


class _FutureHandle(Handle):
    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> Any:
        return self._future.result()


def allreduce_exponent_codes(comm: Any, data: np.ndarray, size: int, bits: int, seed: int,
                             reduction: str) -> np.ndarray:
    """Reduce every rank's packed exponent codes; every rank returns the same reduced bytes.

    Args:
        comm: an mpi4py communicator, or an object with the same ``Get_rank``, ``Get_size``,
            ``Isend``/``Irecv`` (requests with ``Wait``) and ``Allgatherv(buf, [out, (counts,
            displs)])`` (the DDP door's, over a torch.distributed process group).
        data: this rank's packed codes (uint8), host or device (then the MPI must be
            CUDA-aware).
        size: elements per payload.
        bits: code width.
        seed: the exchange seed (round keys:
            :func:`~horovod_quant.core.exponent_reduction.round_key`).
        reduction: "tree" or "ring".
    """
    xp = array_module(data)
    combine = gpu.exp_combine  # the kernel of the buffers' backend
    # MPI reads device buffers directly: the kernels before a send must have finished
    settle = (lambda: None) if xp is np else xp.cuda.get_current_stream().synchronize
    rank, n = comm.Get_rank(), comm.Get_size()
    work = xp.array(data, dtype=np.uint8, copy=True)
    rounds, owners = schedule(n, -(-size // PACK_BLOCK), reduction)

    for step in rounds:
        settle()
        requests, received = [], []
        for c in step:
            i0, i1, lo, hi = block_byte_range(c.b0, c.b1, size, bits)
            if i1 == i0:
                continue
            if c.partner == rank:
                requests.append(comm.Isend(work[lo:hi], dest=c.rank, tag=c.round))
            if c.rank == rank:
                buf = xp.empty(hi - lo, np.uint8)
                requests.append(comm.Irecv(buf, source=c.partner, tag=c.round))
                received.append((c, buf, i0, i1, lo, hi))
        for request in requests:  # all posted: waiting for each in turn is a Waitall
            request.Wait()
        for c, buf, i0, i1, lo, hi in received:
            k0, k1 = round_key(seed, c.round, c.rank)
            own = work[lo:hi]
            combine(own, buf, own, i1 - i0, i0, bits, k0, k1)
    counts, displs = [0] * n, [0] * n
    for g, b0, b1 in owners:
        _, _, lo, hi = block_byte_range(b0, b1, size, bits)
        counts[g], displs[g] = hi - lo, lo
    settle()
    out = xp.empty_like(work)
    mine = work[displs[rank]:displs[rank] + counts[rank]]
    comm.Allgatherv(mine, [out, (counts, displs)])  # uint8 buffers: the datatype is bytes
    return out


#: reductions in flight at once (pipelined pieces of one exchange), each lane a worker thread
#: with a communicator of its own; why several: docs/dev/exchange.md ("The exponent allreduce
#: over MPI")
EXPONENT_LANES = 4


class MpiExponentReduce:
    """The custom collective for dense exponential Global-QSGD (registered in
    :data:`horovod_quant.exchange.driver.CUSTOM_COLLECTIVES`).

    Call ``k`` runs on lane ``k % len(comms)``: a worker thread with its own communicator, so
    several pipelined pieces are on the wire at once and their messages never match across
    lanes. Every rank makes the same calls in the same order, so each call lands on the same
    lane everywhere, and each lane runs its calls in order. A device payload's estimate is on
    its device and complete (its stream synchronized) when the handle returns it.

    Args:
        codec: a codec with dense exponent codes (exponential Global-QSGD): its ``bits`` and
            ``reduction`` parameters and its ``decode_sum``.
        comms: one communicator per lane (mpi4py's, or :class:`~horovod_quant.torch.
            distributed.PointToPoint`), created in the same order on every rank.
        device_buffers: whether the communicators take device arrays (a CUDA-aware MPI);
            otherwise a device payload's codes are copied to host memory and back.
    """

    def __init__(self, codec: Reduced, comms: list[Any], device_buffers: bool = False) -> None:
        if not comms:
            raise ValueError("MpiExponentReduce needs at least one communicator")
        self.codec = codec
        self.comms = comms
        self.device_buffers = device_buffers
        self._lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hq-mpi-exp{i}")
                       for i in range(len(comms))]
        self._calls = 0

    def __call__(self, payload: Payload, seed: int, name: str) -> Handle:
        lane = self._calls % len(self._lanes)
        self._calls += 1
        comm = self.comms[lane]
        codec, n = self.codec, comm.Get_size()
        codes = payload.data.view(np.uint8)
        on_device = array_module(codes) is not np
        if on_device:
            codes.device.synchronize()  # the worker thread runs on another stream
        staged = on_device and not self.device_buffers

        def run() -> Any:
            with codes.device if on_device else contextlib.nullcontext():
                reduced = allreduce_exponent_codes(comm,
                                                   gpu.to_host(codes) if staged else codes,
                                                   payload.size, codec.params["bits"], seed,
                                                   codec.params["reduction"])
                if staged:
                    reduced = gpu.to_device(reduced, codes)
                mean = codec.decode_sum(Payload(reduced, payload.size, dict(payload.meta)), n)
                if on_device:
                    codes.device.synchronize()
                return mean

        return _FutureHandle(self._lanes[lane].submit(run))


def mpi_exponent_factory(codec: Reduced, collectives: Collectives) -> MpiExponentReduce | None:
    """The collective of reduced codecs whose ``traits.collective`` is
    ``"exponent_allreduce"`` (packed exponent codes, reduced with the codec's ``bits`` and
    ``reduction`` parameters) when the collectives expose an MPI communicator; None means "fall
    back to allgather + local reduction". Collective: asks for :data:`EXPONENT_LANES`
    communicators, in order, on every rank."""
    comm = collectives.mpi_communicator()
    if comm is None:
        return None
    lanes = [comm] + [collectives.mpi_communicator() for _ in range(EXPONENT_LANES - 1)]
    return MpiExponentReduce(codec, lanes, collectives.mpi_moves_device_arrays)
