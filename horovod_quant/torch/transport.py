"""Which transport carries the payloads of ``hq.torch.DistributedOptimizer``: Horovod's
collectives, or the collectives of a gloo process group built beside Horovod.

Measured on two emulated hosts behind a 1 Gbit/s link (``benchmarks/cluster.py
--transport-probe --overlap-probe``, docs/cluster.md "Which transport moves a payload
fastest"): Horovod's allgather moves a payload at about half the link rate under its gloo
controller, and under its MPI controller a transfer stalls while the rank computes (Open MPI's
progress busy-polls), so encoding and decoding add to the wire time; concurrent all_gathers of
a torch.distributed gloo group filled 0.78-0.86 of the link under either controller and went
on while the rank computed. So ``"auto"`` runs the optimizer's exchanges over such a group
(:class:`~.distributed.StandaloneGroupCollectives`) for CPU gradients, and keeps Horovod's
collectives for CUDA gradients (NCCL moves device buffers) or when the group cannot be built
(the reason is logged once). Its collectives pair by call order, so the optimizer starts its
buckets in bucket order, as DDP does.

The group is built once per Horovod process set, collectively (the first optimizer of every
rank builds it at the same point): rank 0 opens a ``TCPStore`` on a free port at its address
(:func:`reachable_address`), tells the others through Horovod, and every rank connects a
``ProcessGroupGloo`` through it; the default ``torch.distributed`` group is left alone.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from datetime import timedelta
from typing import Any

import horovod.torch as hvd
import torch
import torch.distributed as dist

from .. import gpu
from ..env import env_choice, env_text
from ..exchange.collectives import Collectives
from ..exchange.staging import HostStaged
from .collectives import HorovodTorchCollectives
from .distributed import StandaloneGroupCollectives

log = logging.getLogger("horovod_quant")

#: what ``transport=`` takes
TRANSPORTS = ("auto", "horovod", "gloo")
#: how long reaching rank 0's store may take (a peer that cannot be reached fails here)
CONNECT_TIMEOUT = timedelta(seconds=60)
#: how long one of the group's collectives may wait for a peer before it raises (gloo needs a
#: bound; torch.distributed's default)
OPERATION_TIMEOUT = timedelta(minutes=30)
#: environment variables that name the address (``HQ_PEER_ADDR``) or network interface the
#: group uses, in order of precedence; horovodrun sets ``HOROVOD_GLOO_IFACE`` under gloo
ADDRESS_ENV = "HQ_PEER_ADDR"
INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE")

#: environment variable that sets the optimizer's transport where no ``transport=`` is given
TRANSPORT_ENV = "HQ_TRANSPORT"

_groups: dict[str, StandaloneGroupCollectives | str] = {}  # process set id -> group, or why none


def resolve_transport(transport: str | None = None) -> str:
    """The transport for a ``transport=`` argument: itself, validated, or when None the
    ``HQ_TRANSPORT`` environment variable's, else "auto".

    Raises:
        ValueError: not one of :data:`TRANSPORTS`.
    """
    if transport is None:
        return env_choice(TRANSPORT_ENV, TRANSPORTS, "auto")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not valid: choose one of {list(TRANSPORTS)}"
                         " ('auto': a gloo group beside Horovod for CPU gradients)")
    return transport


def _interface_address(interface: str) -> str:
    """The IPv4 address of a network interface (Linux ``SIOCGIFADDR``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def reachable_address() -> tuple[str, str | None]:
    """(address the other ranks reach this one at, its interface or None): ``HQ_PEER_ADDR``,
    else the first interface of ``GLOO_SOCKET_IFNAME`` / ``HOROVOD_GLOO_IFACE``, else what
    this host's name resolves to (as gloo itself would)."""
    interface = next((os.environ[k].split(",")[0] for k in INTERFACE_ENVS if os.environ.get(k)),
                     None)
    if env_text(ADDRESS_ENV):
        return env_text(ADDRESS_ENV), interface
    if interface is not None:
        return _interface_address(interface), interface
    return socket.gethostbyname(socket.gethostname()), None


def gloo_group_beside_horovod(comm: Collectives) -> StandaloneGroupCollectives:
    """Build a gloo process group over ``comm``'s ranks (same rank order) and return its
    collectives; ``comm`` (Horovod's) carries the rendezvous.

    Collective: every rank of ``comm`` calls it at the same point.

    Raises:
        RuntimeError: on every rank, when a rank cannot reach rank 0's store (the message names
            the rank and the address); errors while gloo connects surface after
            :data:`CONNECT_TIMEOUT`.
    """
    name = f"hq.transport.{comm.group_id}"
    address, interface = reachable_address()
    store, error = None, None
    if comm.rank == 0:
        try:
            store = dist.TCPStore(address, 0, comm.size, True, timeout=CONNECT_TIMEOUT,
                                  wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            error = f"rank 0 could not open a store at {address}: {exc}"
    host = comm.allgather_object({"address": address, "port": store.port if store else 0,
                                  "error": error}, name + ".addr")[0]
    if comm.rank != 0 and host["error"] is None:
        try:
            store = dist.TCPStore(host["address"], host["port"], comm.size, False,
                                  timeout=CONNECT_TIMEOUT)
        except (RuntimeError, OSError) as exc:
            error = (f"rank {comm.rank} could not reach rank 0's store at "
                     f"{host['address']}:{host['port']}: {exc}")
    errors = [e for e in comm.allgather_object(error, name + ".check") if e]
    if errors:
        raise RuntimeError("; ".join(errors) + f" (set {ADDRESS_ENV} or GLOO_SOCKET_IFNAME to "
                           "an address/interface the ranks reach each other at)")
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)
                        if interface else dist.ProcessGroupGloo.create_default_device()]
    options._timeout = OPERATION_TIMEOUT
    group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), comm.rank, comm.size, options)
    collectives = StandaloneGroupCollectives(group, f"gloo:{comm.group_id}")
    collectives.allgather_object(comm.rank, name + ".hello")  # every pair is connected
    return collectives


def collectives_for(process_set: Any = None, transport: str | None = None) -> Collectives:
    """The collectives the exchanges of ``process_set`` run on (collective on first use).

    Args:
        process_set: Horovod process set (default: all ranks).
        transport: "horovod" (Horovod's collectives), "gloo" (a gloo group beside Horovod,
            whose collectives pair by call order; raises if it cannot be built), or "auto"
            (gloo where gradients live on the host and the group can be built, else Horovod's;
            the choice is logged once); None: :func:`resolve_transport`'s.

    Returns:
        The collectives; where CuPy encodes CUDA gradients, their payloads are staged through
        host memory (:class:`~horovod_quant.exchange.staging.HostStaged`) unless the
        collectives move device buffers (Horovod's with NCCL or CUDA-aware MPI).
    """
    transport = resolve_transport(transport)
    horovod = HorovodTorchCollectives(process_set)
    on_gpu = torch.cuda.is_available() and gpu.available()
    comm: Collectives = horovod
    if horovod.size > 1 and (transport == "gloo" or (transport == "auto" and not on_gpu)):
        comm = _gloo_group(horovod, required=transport == "gloo") or horovod
    if on_gpu and not (comm is horovod and gpu.horovod_device_collectives(hvd)[0]):
        return HostStaged(comm)
    return comm


def _gloo_group(horovod: HorovodTorchCollectives,
                required: bool) -> StandaloneGroupCollectives | None:
    """The process set's gloo group, built on first use (logged); None when it cannot be built
    (logged once), unless ``required`` (RuntimeError)."""
    group = _groups.get(horovod.group_id)
    if group is None:
        try:
            group = gloo_group_beside_horovod(horovod)
            log.info("horovod_quant: payloads of process set %s travel over a gloo group beside "
                     "Horovod (%d ranks); transport='horovod' keeps Horovod's collectives",
                     horovod.group_id, horovod.size)
        except RuntimeError as exc:
            group = str(exc)
            log.warning("horovod_quant: no gloo group beside Horovod (%s); Horovod's "
                        "collectives carry the payloads", exc)
        _groups[horovod.group_id] = group
    if isinstance(group, str):
        if required:
            raise RuntimeError(f"transport='gloo': {group}")
        return None
    return group


def transport_of(comm: Collectives) -> str:
    """Which transport ``comm`` (or the collectives it stages for) is: "gloo" or "horovod"."""
    inner = comm.inner if isinstance(comm, HostStaged) else comm
    return "gloo" if isinstance(inner, StandaloneGroupCollectives) else "horovod"
