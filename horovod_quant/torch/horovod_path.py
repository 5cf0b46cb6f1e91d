"""The gradients ``hq.torch.DistributedOptimizer`` leaves to Horovod's own allreduce.

The bucket layout (:mod:`~horovod_quant.torch.buckets`) leaves uncompressed, cast, sparse and
fallen-back gradients to Horovod; :class:`HorovodPath` starts their allreduces from the
backward hooks under ``<check prefix>.raw.<parameter name>`` and writes the results into the
gradients at ``synchronize()``. The one module of the optimizer's parts that needs Horovod
(besides the optimizer itself and Horovod's collectives).
"""
from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from ..stats import StepStats
from .collectives import synchronize


class HorovodPath:
    """The gradients Horovod's own allreduce carries (uncompressed, cast, sparse), with the
    optimizer's ``op``, ``gradient_predivide_factor`` and process set.

    Args:
        op: ``hvd.Average`` or ``hvd.Sum``.
        gradient_predivide_factor: as in Horovod.
        process_set: the Horovod process set.
        prefix: the configuration check's prefix (names the collectives).
    """

    def __init__(self, op: Any, gradient_predivide_factor: float, process_set: Any,
                 prefix: str) -> None:
        self._op, self._factor = op, gradient_predivide_factor
        self._process_set, self._prefix = process_set, prefix
        self._handles: dict[int, tuple[torch.nn.Parameter, Any]] = {}

    def carries(self, p: torch.nn.Parameter) -> bool:
        """Whether ``p``'s gradient travels here this step."""
        return id(p) in self._handles

    @property
    def in_flight(self) -> bool:
        return bool(self._handles)

    def start(self, p: torch.nn.Parameter, name: str, dtype: torch.dtype | None,
              stats: StepStats) -> None:
        """Horovod's allreduce of ``p``'s gradient (sparse: Horovod's sparse path; ``dtype``:
        a cast copy, as Horovod's ``Compression.fp16``; a gradient that is not contiguous,
        such as a ``channels_last`` one: a contiguous copy)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        name = f"{self._prefix}.raw.{name}"
        wire = p.grad
        if wire.is_sparse:
            handle = hvd.sparse_allreduce_async(wire, name=name, op=self._op,
                                                process_set=self._process_set)
        else:  # Horovod refuses strided tensors (channels_last): those travel as a copy
            wire = wire.to(dtype or wire.dtype, memory_format=torch.contiguous_format)
            handle = self.allreduce_async_(wire, name)
        stats.add_raw(wire.numel() * wire.element_size(), p.grad.numel() * p.grad.element_size())
        self._handles[id(p)] = (p, handle)

    def allreduce_async_(self, tensor: torch.Tensor, name: str) -> Any:
        """Horovod's in-place allreduce of ``tensor`` with the configured op and factors."""
        scale = self._factor if self._op == hvd.Average else 1.0
        return hvd.allreduce_async_(tensor, name=name, op=self._op, prescale_factor=1.0 / scale,
                                    postscale_factor=scale, process_set=self._process_set)

    def finish(self) -> None:
        """Wait for every allreduce of the step and write the results into the gradients."""
        for p, handle in self._handles.values():
            out = handle() if callable(handle) else synchronize(handle)  # sparse: callable
            if p.grad.is_sparse:
                p.grad = out
            elif out.data_ptr() != p.grad.data_ptr():  # a cast or contiguous copy travelled
                p.grad.copy_(out)
        self._handles.clear()
