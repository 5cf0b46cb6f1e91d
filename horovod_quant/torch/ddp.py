"""A ``DistributedDataParallel`` communication hook running any codec of this package.

    import horovod_quant as hq
    from horovod_quant.torch import ddp

    model = torch.nn.parallel.DistributedDataParallel(model)
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=8, bucket_size=512))
    model.register_comm_hook(state, ddp.quantization_hook)

DDP hands the hook its gradient buckets in bucket order on every rank (a bucket's hook runs
once every bucket before it has been launched). The hook starts the bucket's exchange
(:class:`~horovod_quant.exchange.Exchange` over the process group's collectives,
:mod:`horovod_quant.torch.distributed`) and returns a ``torch.futures.Future``; the hook of the
last bucket finishes every exchange of the step in bucket order, writes each mean into its
bucket and completes the futures. So the transfers overlap the rest of the backward pass, and
every collective (also those that finish an exchange: the second round of
scatter-reduce-allgather, NDQSG's outage count) is issued from one thread in an order that is
the same on every rank, which torch.distributed, matching collectives by call order, needs.

Bucket ``i`` of step ``t`` (``t`` counts the steps whose gradients were exchanged; ``no_sync()``
passes do not count) is exchanged with seed ``derive_key(seed, t, i)`` under the name
``<check prefix>.b<i>`` and tag ``exchange_tag(name, (numel,))``, so
``mean_estimate(codec, [bucket on each rank], derive_key(seed, t, i),
pipeline_elems=state.pipeline_elems)`` reproduces the result exactly. DDP gives every rank the
same buckets, also after it rebuilds them following the first step (their order then follows
the gradients' readiness, decided by rank 0); a rank whose bucket differs raises, through the
tag, on every rank. Global-norm codecs (Global-QSGD) take the norm of each bucket (one
allgather before its exchange, waited for in the bucket's hook: the pieces' collectives that
follow it must be issued at the same point on every rank).

The first hook runs the cross-rank configuration check (:class:`~horovod_quant.doors.
ConfigCheck`): a rank with another codec, seed or schedule raises the same ValueError on every
rank before anything is combined.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..doors import CodecRequest, CompressorSettings, ConfigCheck
from ..exchange.driver import Exchange, Pending
from ..core.base import Codec
from ..core.rng import derive_key
from ..exchange.plans import DEFAULT_PIPELINE_ELEMS, check_pipeline_elems
from .collectives import as_array, as_tensor
from .compression import QuantizedCompressor, flat_array, stream_of
from .distributed import collectives_for

__all__ = ["QuantizationState", "quantization_hook"]


class _BucketJob:
    """One bucket's exchange of this step, from its hook to its future's result."""

    __slots__ = ("bucket", "future", "pending")

    def __init__(self, bucket: torch.Tensor, pending: Pending) -> None:
        self.bucket, self.pending = bucket, pending
        self.future: torch.futures.Future[torch.Tensor] = torch.futures.Future()


class QuantizationState(CompressorSettings):
    """The state of :func:`quantization_hook` for one DDP model.

    Args:
        codec: the codec (:func:`horovod_quant.get_codec`), a codec name, or a
            ``horovod_quant.torch.Compression.<name>(...)`` object (its codec, seed and
            gather schedule). A world-sized codec asked for by name or through ``Compression``
            without ``world_size`` gets the process group's size.
        process_group: the DDP model's process group (None: the default group).
        seed: base seed of every random draw (default: the compressor's, else 0).
        gather: schedule for gather codecs, "auto", "allgather" or "sra" (default: the
            compressor's, else "auto").
        pipeline_elems: buckets longer than this are exchanged in pieces of this many elements
            (see :class:`horovod_quant.exchange.Exchange`); None sends every bucket whole.

    Attributes:
        stats: the :class:`~horovod_quant.stats.StepStats` of the exchanges since the last
            ``stats.reset()`` (the other doors report the same).
        step: steps whose gradients were exchanged so far.
    """

    def __init__(self, codec: Codec | str | QuantizedCompressor, process_group: Any = None,
                 seed: int | None = None, gather: str | None = None,
                 pipeline_elems: int | None = DEFAULT_PIPELINE_ELEMS) -> None:
        if not dist.is_initialized():
            raise RuntimeError("horovod_quant DDP hook: call torch.distributed.init_process_group"
                               " before building a QuantizationState")
        comm = collectives_for(process_group)
        settings: dict = {}
        if isinstance(codec, QuantizedCompressor):
            settings = {"seed": codec.seed, "gather": codec.gather}
            request = codec.codec_request
            codec = (request.build(lambda: comm.size) if request is not None
                     and request.needs_world_size else codec.codec)
        elif isinstance(codec, str):
            codec = CodecRequest(codec, {}).build(lambda: comm.size)
        if not isinstance(codec, Codec):
            raise ValueError(f"codec={codec!r} is not understood: pass hq.get_codec(...), a "
                             "codec name, or hq.torch.Compression.<codec>(...)")
        if codec.needs_world_size and codec.params.get("world_size") != comm.size:
            raise ValueError(f"{codec.name} was built for world_size="
                             f"{codec.params.get('world_size')}, but the process group has "
                             f"{comm.size} ranks: leave world_size out (it is filled in) or "
                             f"pass world_size={comm.size}")
        super().__init__(codec, seed if seed is not None else settings.get("seed", 0),
                         gather if gather is not None else settings.get("gather", "auto"))
        self.process_group = process_group
        self.pipeline_elems = check_pipeline_elems(pipeline_elems)
        self.step = 0
        self._comm = comm
        self._check: ConfigCheck | None = None
        self._exchange: Exchange | None = None
        self._means: dict[int, Any] = {}  # bucket index -> reused output array
        self._open: list[_BucketJob] = []

    def shared_config(self) -> dict:
        return {**super().shared_config(), "door": "ddp", "pipeline_elems": self.pipeline_elems}

    def seed_of(self, step: int, index: int) -> int:
        """The exchange seed of bucket ``index`` at step ``step``."""
        return derive_key(self.seed, step, index)

    def _mean_buffer(self, index: int, flat: Any) -> Any:
        """The float32 array bucket ``index``'s mean is written to, where ``flat`` lives
        (kept across steps: DDP's buckets keep their sizes after the first rebuild)."""
        mean = self._means.get(index)
        if mean is None or mean.size != flat.size or type(mean) is not type(flat):
            device = as_tensor(flat).device
            mean = self._means[index] = as_array(torch.empty(flat.size, dtype=torch.float32,
                                                             device=device))
        return mean

    def exchange_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start ``bucket``'s exchange; the last bucket's call finishes the step (module doc)."""
        if self._exchange is None:  # the first bucket: nothing is combined before the check
            if self._check is None:
                self._check = ConfigCheck(self._comm, self.shared_config())
            self._check.wait()  # a mismatch raises here, at this and every later call
            self._exchange = Exchange(self.codec, self._comm, gather=self.gather,
                                      pipeline_elems=self.pipeline_elems)
        grad, index = bucket.buffer(), bucket.index()
        if grad.is_sparse:
            future = self._average_sparse(grad)
            if bucket.is_last():
                self._finish_step()
            return future
        name = f"{self._check.prefix}.b{index}"
        with stream_of(grad):
            flat = flat_array(grad)
            pending = self._exchange.start(flat, self.seed_of(self.step, index), name,
                                           out=self._mean_buffer(index, flat))
            pending.advance(block=True)  # when a norm arrives differs between ranks
        job = _BucketJob(grad, pending)
        self._open.append(job)
        if bucket.is_last():
            self._finish_step()
        return job.future

    def _average_sparse(self, grad: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The exact mean of a sparse gradient (``nn.Embedding(sparse=True)``), as DDP's own
        reducer computes it: an allreduce of the sparse tensor. The codecs quantize dense
        vectors; the rows a sparse gradient sends are already few."""
        nbytes = grad._values().numel() * grad.element_size() + grad._indices().numel() * 8
        self.stats.add_raw(nbytes)
        work = dist.all_reduce(grad, group=self.process_group, async_op=True)
        size = self._comm.size
        return work.get_future().then(lambda fut: fut.value()[0].div_(size))

    def _finish_step(self) -> None:
        """Finish every open exchange in bucket order and complete its future with the
        bucket, now holding the mean (on error: every open future fails with it)."""
        jobs, self._open = self._open, []
        self.step += 1
        try:
            for job in jobs:
                with stream_of(job.bucket):
                    mean = as_tensor(job.pending.wait())
                    job.bucket.copy_(mean.reshape(job.bucket.shape))
                self.stats.add(job.pending.stats)
                job.future.set_result(job.bucket)
        except BaseException as exc:
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(exc)
            raise


def quantization_hook(state: QuantizationState, bucket: dist.GradBucket
                      ) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean of ``bucket`` over the state's process group,
    estimated by the state's codec (register with
    ``model.register_comm_hook(state, quantization_hook)``).

    Args:
        state: the :class:`QuantizationState`.
        bucket: DDP's gradient bucket.

    Returns:
        A future whose value is the bucket's flat tensor holding the mean estimate (complete
        once the last bucket of the step has been handed to the hook).
    """
    return state.exchange_bucket(bucket)


# DDP compares the hook's annotations with the objects themselves (not their strings)
quantization_hook.__annotations__.update(
    {"state": QuantizationState, "bucket": dist.GradBucket,
     "return": torch.futures.Future[torch.Tensor]})
