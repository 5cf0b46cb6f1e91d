"""Which transport carries the payloads of ``hq.torch.DistributedOptimizer``: Horovod's
collectives, or the collectives of a gloo process group built beside Horovod.

Concurrent all_gathers of a gloo group fill a slow link better than Horovod's collectives
and go on while the rank computes (docs/performance.md, "Which transport carries the
payloads"), so ``"auto"`` runs the optimizer's exchanges over such a group
(:class:`~.distributed.StandaloneGroupCollectives`) for CPU gradients, and keeps Horovod's
collectives for CUDA gradients (NCCL moves device buffers) or when the group cannot be built
(one warning). Its collectives pair by call order, so the optimizer starts its buckets in
bucket order, as DDP does.

The group is built once per Horovod process set, collectively (the first optimizer of every
rank builds it at the same point): rank 0 opens a ``TCPStore`` (listening on every interface),
the ranks find an address of rank 0 they all reach (:mod:`.addresses`) through Horovod's
collectives, and each connects a ``ProcessGroupGloo`` bound to its own address on that route;
the default ``torch.distributed`` group is left alone.
"""
from __future__ import annotations

import logging
import secrets
from datetime import timedelta
from typing import Any, Callable

import horovod.torch as hvd
import torch
import torch.distributed as dist

from .. import gpu
from ..doors import TRANSPORTS
from ..env import env_choice
from ..exchange.collectives import Collectives
from ..exchange.shared_memory import host_collectives
from ..exchange.staging import HostStaged
from ..exchange.topology import Hierarchy, SerialWorker, Topology
from . import addresses
from .collectives import HorovodTorchCollectives
from .distributed import StandaloneGroupCollectives

log = logging.getLogger("horovod_quant")

#: how long building the group may take: connecting every pair of ranks, then a first
#: collective (a peer that cannot be reached fails the build here, on every rank)
CONNECT_TIMEOUT = timedelta(seconds=20)
#: how long one of the group's collectives may wait for a peer before it raises (gloo needs a
#: bound; torch.distributed's default)
OPERATION_TIMEOUT = timedelta(minutes=30)

#: environment variable that sets the optimizer's transport where no ``transport=`` is given
TRANSPORT_ENV = "HQ_TRANSPORT"

_TOKEN_KEY = "hq.token"  # rank 0's store holds a random token: a probe reached the right store
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


class _Agreement:
    """The steps of building a group, each agreed over Horovod's collectives: a step that
    failed on any rank fails on every rank, with every rank's reason.

    Args:
        comm: Horovod's collectives of the ranks.
        name: prefix of the steps' collective names.
    """

    def __init__(self, comm: Collectives, name: str) -> None:
        self._comm = comm
        self._name = name

    def gather(self, step: str, value: Any, error: str | None) -> list[Any]:
        """Every rank's ``value`` for ``step``; RuntimeError on every rank when any rank's
        ``error`` is set."""
        reports = self._comm.allgather_object({"value": value, "error": error},
                                              f"{self._name}.{step}")
        errors = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if rep["error"]]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [rep["value"] for rep in reports]


def _attempt(action: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(action(), None)``, or ``(None, why)`` when it raised as a failed connection does."""
    try:
        return action(), None
    except (RuntimeError, OSError, ValueError) as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return None, f"{type(exc).__name__}: {first_line}"


def gloo_group_beside_horovod(comm: Collectives,
                              topology: Topology | None = None) -> StandaloneGroupCollectives:
    """Build a gloo process group over ``comm``'s ranks (same rank order) and return its
    collectives; ``comm`` (Horovod's) carries the rendezvous. Where ``topology`` says ranks
    share hosts (:attr:`~horovod_quant.exchange.topology.Topology.hierarchical`), the groups of
    each host and of each shard between the hosts are built too (the collectives'
    ``hierarchy``).

    Collective: every rank of ``comm`` calls it at the same point. Each step is agreed by
    every rank, so the ranks end with a group, or all raise the same error within about
    :data:`CONNECT_TIMEOUT` (a few seconds when no address of rank 0 is reachable).

    Raises:
        RuntimeError: on every rank, naming each rank that failed and why.
    """
    name = f"hq.transport.{comm.group_id}"
    agree = _Agreement(comm, name)
    own, error = _attempt(addresses.own_addresses)
    store = token = None
    if comm.rank == 0 and error is None:
        token = secrets.token_hex(8)
        store, error = _attempt(lambda: dist.TCPStore(
            own[0], 0, comm.size, True, timeout=CONNECT_TIMEOUT, wait_for_workers=False))
    if store is not None:
        store.set(_TOKEN_KEY, token)
    offer = agree.gather("offer", {"addresses": own, "port": store.port if store else 0,
                                   "token": token}, error)[0]
    # which of rank 0's addresses each rank reaches, and the local address it leaves from
    reached = own if comm.rank == 0 else addresses.probe(offer["addresses"], offer["port"])
    reports = agree.gather("probe", reached, None)
    common = next((i for i in range(len(offer["addresses"]))
                   if all(rep[i] is not None for rep in reports)), None)
    if common is None:
        missed = "; ".join(f"rank {r} reached {[a for a, x in zip(offer['addresses'], rep) if x]}"
                           for r, rep in enumerate(reports) if not all(rep))
        raise RuntimeError(f"no address of rank 0 ({', '.join(offer['addresses'])}, port "
                           f"{offer['port']}) is reachable from every rank ({missed})")
    address = offer["addresses"][common]
    # the address this rank's gloo device binds: its route to rank 0, unless the user named
    # this rank's address or interfaces
    local = address if comm.rank == 0 else (own[0] if addresses.named_in_environment()
                                            else reached[common])

    def join_store() -> Any:
        client = dist.TCPStore(address, offer["port"], comm.size, False, timeout=CONNECT_TIMEOUT)
        if client.get(_TOKEN_KEY).decode() != offer["token"]:
            raise RuntimeError(f"{address}:{offer['port']} is not rank 0's store")
        return client

    if comm.rank != 0:
        store, error = _attempt(join_store)
    agree.gather("store", None, error)

    device = None

    def connect(prefix: str, rank: int, size: int) -> Any:
        nonlocal device
        device = device or dist.ProcessGroupGloo.create_device(hostname=local)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [device]
        options._timeout = CONNECT_TIMEOUT
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)

    group, error = _attempt(lambda: connect(name, comm.rank, comm.size))
    agree.gather("connect", local, error)
    groups = [StandaloneGroupCollectives(group, f"gloo:{comm.group_id}")]
    if topology is not None and topology.hierarchical:
        host, shard = topology.host_of(comm.rank), topology.local_rank(comm.rank)
        subgroups = [(f"{name}.host{host}", shard, topology.local_size),
                     (f"{name}.shard{shard}", host, topology.host_count)]
        built, error = _attempt(lambda: [connect(*g) for g in subgroups])
        agree.gather("subgroups", None, error)
        groups += [StandaloneGroupCollectives(g, f"gloo:{comm.group_id}:{prefix}")
                   for g, (prefix, _, _) in zip(built, subgroups)]
    _, error = _attempt(lambda: [g.allgather_object(comm.rank, name + ".hello") for g in groups])
    agree.gather("hello", None, error)  # every pair of ranks has exchanged data
    for g in groups:
        g.group.set_timeout(OPERATION_TIMEOUT)
    world = groups[0]
    if len(groups) == 3:
        world.hierarchy = Hierarchy(topology, host_collectives(groups[1]), groups[2],
                                    SerialWorker(f"hq.hierarchy.{comm.group_id}"))
    return world


def horovod_topology(comm: HorovodTorchCollectives) -> Topology:
    """Which ranks of ``comm``'s process set share a host, from Horovod's own local and cross
    ranks (a host's ranks share a cross rank where every host runs as many ranks; else each
    rank counts as a host of its own: no hierarchical exchange). Collective."""
    places = comm.allgather_object([hvd.cross_rank(), hvd.local_rank(), hvd.local_size()],
                                   f"hq.topology.{comm.group_id}")
    if len({size for _, _, size in places}) != 1:
        return Topology.grid(comm.size, 1)
    topology = Topology.from_host_keys([cross for cross, _, _ in places])
    if any(len({places[r][1] for r in ranks}) != len(ranks) for ranks in topology.hosts):
        return Topology.grid(comm.size, 1)
    return topology


def transport_collectives(process_set: Any = None, transport: str | None = None) -> Collectives:
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
            group = gloo_group_beside_horovod(horovod, horovod_topology(horovod))
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
