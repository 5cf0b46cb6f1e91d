"""The Horovod PyTorch call a compressor's ``compress`` runs in, and the name it gives the tensor.

Horovod passes ``compress`` the tensor alone. Its name is what the user gave Horovod in that
call, found in the call's frame by the tensor's identity (Horovod 0.28.1 is the final release,
so these call sites are fixed):

* ``DistributedOptimizer``, one tensor per call or grouped (``num_groups=``/``groups=``): the
  name of the parameter (``named_parameters``, else Horovod's ``allreduce.noname.<i>.<j>``)
  whose gradient the tensor is (or its dense copy, ``sparse_as_dense``);
* ``allreduce(tensor, name=)``: ``name``; ``grouped_allreduce(tensors, name=)``: ``name[i]``
  for the tensor at index ``i`` of ``tensors``.

The call site is the nearest calling frame that runs one of these Horovod functions, whatever
frames lie between: a subclass's ``compress``, or before Python 3.12 the frame of Horovod's list
comprehension, which 3.12 inlines into the function (PEP 709). Only the functions' own locals
(``self``, ``p``, ``ps``, ``tensor``, ``tensors``, ``name``) are read, which every Python keeps.

This module imports neither torch nor Horovod.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, NamedTuple

#: calling frames searched for Horovod's call site: a subclass's compress calling ours, a
#: comprehension's frame (Python < 3.12), the site, with room to spare
MAX_FRAMES = 8


def _optimizer_name(local: Mapping[str, Any], tensor: Any) -> str | None:
    """``_allreduce_grad_async(self, p)``: ``tensor`` is ``p.grad`` (or its dense copy, kept in
    ``tensor``), or ``p`` itself (the Adasum optimizer compresses the parameter's delta)."""
    p = local.get("p")
    if p is None or not (tensor is local.get("tensor") or tensor is p):
        return None
    return local["self"]._parameter_names.get(p)


def _grouped_optimizer_name(local: Mapping[str, Any], tensor: Any) -> str | None:
    """``_grouped_allreduce_grad_async(self, ps)``: the parameter of ``ps`` whose gradient
    ``tensor`` is."""
    p = next((p for p in local.get("ps", ()) if getattr(p, "grad", None) is tensor), None)
    return None if p is None else local["self"]._parameter_names.get(p)


def _allreduce_name(local: Mapping[str, Any], tensor: Any) -> str | None:
    """``allreduce(tensor, name=)``."""
    return local.get("name") if local.get("tensor") is tensor else None


def _grouped_allreduce_name(local: Mapping[str, Any], tensor: Any) -> str | None:
    """``grouped_allreduce(tensors, name=)``: ``name[i]``, ``i`` the tensor's index."""
    name = local.get("name")
    index = next((i for i, t in enumerate(local.get("tensors", ())) if t is tensor), None)
    return None if name is None or index is None else f"{name}[{index}]"


#: (module, function) of each Horovod function that calls ``compress`` -> how it names the tensor
SITES: dict[tuple[str, str], Callable[[Mapping[str, Any], Any], str | None]] = {
    ("horovod.torch.optimizer", "_allreduce_grad_async"): _optimizer_name,
    ("horovod.torch.optimizer", "_grouped_allreduce_grad_async"): _grouped_optimizer_name,
    ("horovod.torch.mpi_ops", "allreduce"): _allreduce_name,
    ("horovod.torch.mpi_ops", "grouped_allreduce"): _grouped_allreduce_name,
}


class HorovodCall(NamedTuple):
    """A Horovod call site found by :func:`horovod_call`.

    Attributes:
        site: its ``(module, function)``, a key of :data:`SITES`.
        local: the function's locals.
        caller: the name of the function that called it.
    """

    site: tuple[str, str]
    local: Mapping[str, Any]
    caller: str = ""

    def name(self, tensor: Any) -> str | None:
        """The name the call gives ``tensor`` (module doc), or None (``allreduce`` without
        ``name=``, or ``tensor`` is not what this call compresses)."""
        return SITES[self.site](self.local, tensor)

    @property
    def repeats_synchronize(self) -> bool:
        """Whether this is Horovod's optimizer averaging a gradient again: its
        ``synchronize()`` after a ``synchronize()`` with no backward pass between (a
        ``step()`` outside ``skip_synchronize()``), which Horovod documents as harmless."""
        return (self.site[1] in ("_allreduce_grad_async", "_grouped_allreduce_grad_async")
                and self.caller == "synchronize"
                and bool(getattr(self.local.get("self"), "_synchronized", False)))


def horovod_call(depth: int = 1) -> HorovodCall | None:
    """The nearest Horovod call site (module doc) among the callers of the function calling
    this one (``depth`` 1; 2: among the callers of that function's caller), or None."""
    frame = sys._getframe(depth)
    for _ in range(MAX_FRAMES):
        frame = frame.f_back
        if frame is None:
            return None
        site = (frame.f_globals.get("__name__"), frame.f_code.co_name)
        if site in SITES:
            caller = frame.f_back.f_code.co_name if frame.f_back is not None else ""
            return HorovodCall(site, frame.f_locals, caller)
    return None

