"""Workers simulated in one process, for accuracy: ``hq.torch.DistributedOptimizer``'s means.

:class:`SimulatedWorkers` takes each worker's gradients (its own shard and mini-batch) and
returns the averaged gradient every rank of an n-rank job with the same settings would get,
step after step: the optimizer's bucket layout (:class:`~horovod_quant.torch.buckets.
BucketLayout`: policy, ``fusion_bytes``, groups), a door's runtime per worker
(:class:`~horovod_quant.exchange.runtime.ExchangeRuntime`: seeds of the step and the bucket's
parameter names, codec states), its plans and pipeline pieces, all run by the reference runner
(:func:`~horovod_quant.exchange.reference.start_estimate`) instead of sockets. So 8 to 64
workers fit on one machine, each quantizer's variance averaged over as many payloads as on a
cluster. It exchanges and times nothing: the fallback (which moves buckets to Horovod by their
timings) is not simulated, as with ``fallback="never"``.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from ..core.base import Codec
from ..doors import DoorOptions
from ..exchange.cost import Fabric
from ..exchange.reference import start_estimate
from ..exchange.runtime import ExchangeRuntime
from ..exchange.topology import Topology
from ..torch.buckets import BucketLayout

#: one worker's gradients: ``{parameter name: gradient}`` (a name left out: zeros, a parameter
#: it did not use), or one flat vector of every parameter's in ``named_parameters`` order
WorkerGradients = Mapping[str, Any] | torch.Tensor | np.ndarray


class SimulatedWorkers:
    """The gradient averaging of an n-worker ``hq.torch.DistributedOptimizer`` (``op`` Average),
    in one process.

    :meth:`average` of step ``t`` gives, bit for bit, the averaged gradients of a real job's
    step ``t`` whose ranks had the same gradients and settings: each compressed bucket is the
    exchange's mean estimate; a gradient the policy leaves uncompressed gets Horovod's mean,
    summed in rank order (Horovod's own order differs beyond two ranks: a float rounding).

    Args:
        named_parameters: the model's ``(name, parameter)`` pairs, as the optimizer's
            ``named_parameters`` (the names key the seeds); those without ``requires_grad``
            are left out, as the optimizer leaves them.
        codec: the default codec, built for ``workers`` where it needs the world size.
        workers: the number of simulated ranks.
        hosts: how many hosts they share, in equal blocks of consecutive ranks. Several hosts of
            several workers each take the hierarchical plans, as the optimizer's gloo
            transport (its default for CPU gradients) does there: ``opt.topology``.
        options: the optimizer's settings (``opt.options``): ``seed``, ``gather``, ``policy``,
            ``pipeline_elems``, ``fusion_bytes``; the others change no bit of the mean.
        fabric: the links the plan choice weighs (``opt.fabric``; None: CPU ranks' defaults).
        groups: the optimizer's ``num_groups`` or ``groups`` (None: by ``fusion_bytes``).

    Attributes:
        step: the step :meth:`average` simulates next (the seeds' step), from 0.
        codec_states: each worker's adaptive codec states, carried from step to step:
            worker r's is what rank r's ``opt.codec_states`` holds (a hierarchical plan's
            ranks advance their shards' states, which differ).
        topology: the workers' hosts where the plans may be hierarchical, else None.
        last_wire_bytes: payload bytes the busiest worker sent in the last step (every bucket's
            :func:`~horovod_quant.mean_estimate` ``wire_bytes``).

    Raises:
        ValueError: ``hosts`` does not divide ``workers``, or a codec of the policy is built
            for another number of workers.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], codec: Codec,
                 workers: int, hosts: int = 1, *, options: DoorOptions | None = None,
                 fabric: Fabric | None = None, groups: Any = None) -> None:
        if workers < 1 or hosts < 1 or workers % hosts:
            raise ValueError(f"{workers} workers cannot share {hosts} hosts equally")
        self.options = options or DoorOptions()
        for c in self.options.policy.codecs(codec):
            if c.needs_world_size and c.world_size != workers:
                raise ValueError(f"{c.name} is built for world_size={c.world_size}, not for "
                                 f"the {workers} simulated workers")
        named = [(name, p) for name, p in named_parameters if p.requires_grad]
        self.workers = workers
        grid = Topology.grid(hosts, workers // hosts)
        self.topology = grid if grid.hierarchical else None
        self.step = 0
        self._runtimes = [ExchangeRuntime(self.options.seed, self.options.gather,
                                          self.options.pipeline_elems, fabric)
                          for _ in range(workers)]
        self.codec_states = [runtime.states for runtime in self._runtimes]
        self.last_wire_bytes = 0
        self._params = {name: p for name, p in named}
        self._layout = BucketLayout([p for _, p in named], {id(p): name for name, p in named},
                                    codec, self.options.policy, groups,
                                    self.options.fusion_bytes)
        self._name_of = self._layout.names

    @property
    def bucket_keys(self) -> list[str]:
        """Each bucket's key (its parameters' names, comma-joined: its seeds), in bucket
        order; the other parameters travel uncompressed."""
        return [",".join(self._name_of[id(p)] for p in b.params) for b in self._layout.buckets]

    def average(self, gradients: Sequence[WorkerGradients]) -> dict[str, torch.Tensor]:
        """Simulate one step: every worker's gradients in, the averaged ones out.

        Args:
            gradients: one entry per worker, in rank order: ``{name: gradient}`` (tensors or
                arrays of the parameter's shape) or one flat vector of every parameter's
                gradient in ``named_parameters`` order.

        Returns:
            ``{name: averaged gradient}`` for every parameter, each of its parameter's shape,
            dtype and device: what every rank's ``p.grad`` holds after ``opt.synchronize()``.
        """
        if len(gradients) != self.workers:
            raise ValueError(f"got {len(gradients)} workers' gradients for {self.workers} "
                             "simulated workers")
        flats = [self._flat_by_name(g) for g in gradients]
        runtime = self._runtimes[0]  # (every worker's has the same settings)
        started = [(b, start_estimate(
            b.codec, [np.concatenate([f[self._name_of[id(p)]] for p in b.params]) for f in flats],
            runtime.seed_of(self.step, key), runtime.gather, runtime.pipeline_elems,
            self.topology, runtime.fabric, self.codec_states))
            for b, key in zip(self._layout.buckets, self.bucket_keys)]
        out: dict[str, torch.Tensor] = {}
        self.last_wire_bytes = 0
        for bucket, estimate in started:  # started all, finished in bucket order: as the door
            mean, wire_bytes = estimate.finish()
            self.last_wire_bytes += wire_bytes
            offset = 0
            for p in bucket.params:
                out[self._name_of[id(p)]] = self._like(p, mean[offset:offset + p.numel()])
                offset += p.numel()
        for p in self._layout.raw:
            out[self._name_of[id(p)]] = self._horovod_mean(p, [f[self._name_of[id(p)]]
                                                               for f in flats])
        self.step += 1
        return {name: out[name] for name in self._params}

    def _flat_by_name(self, gradients: WorkerGradients) -> dict[str, np.ndarray]:
        """One worker's gradients as ``{name: flat float32 array}``, zeros where it has none."""
        if not isinstance(gradients, Mapping):
            vector = _host(gradients)
            sizes = [p.numel() for p in self._params.values()]
            if vector.size != sum(sizes):
                raise ValueError(f"a worker's flat gradient has {vector.size} elements, the "
                                 f"parameters {sum(sizes)}")
            return dict(zip(self._params, np.split(vector, np.cumsum(sizes)[:-1])))
        unknown = sorted(set(gradients) - set(self._params))
        if unknown:
            raise ValueError(f"gradients of parameters the model does not have: {unknown}")
        return {name: _host(gradients[name]) if name in gradients
                else np.zeros(p.numel(), np.float32) for name, p in self._params.items()}

    def _horovod_mean(self, p: torch.nn.Parameter, flats: list[np.ndarray]) -> torch.Tensor:
        """Horovod's average of one uncompressed gradient: each worker's cast to the dtype it
        travels in (the layout's), summed in rank order, scaled by 1/n."""
        wire = [torch.from_numpy(f).to(self._layout.cast[id(p)]) for f in flats]
        total = wire[0].clone()
        for w in wire[1:]:
            total += w
        return self._like(p, (total.double() * (1.0 / self.workers)).to(total.dtype))

    @staticmethod
    def _like(p: torch.nn.Parameter, flat: Any) -> torch.Tensor:
        """``flat`` (a float32 array or tensor) as a gradient of ``p``."""
        return torch.as_tensor(flat).reshape(p.shape).to(dtype=p.dtype, device=p.device)


def _host(gradient: Any) -> np.ndarray:
    """A gradient (tensor or array, any shape) as a flat float32 host array."""
    if isinstance(gradient, torch.Tensor):
        gradient = gradient.detach().to("cpu", torch.float32).numpy()
    return np.asarray(gradient, np.float32).reshape(-1)
