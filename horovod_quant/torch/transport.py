"""Which transport carries the payloads of ``hq.torch.DistributedOptimizer``: Horovod's
collectives, or torch.distributed groups built beside Horovod.

Concurrent all_gathers of a gloo group fill a slow link better than Horovod's collectives
and go on while the rank computes (docs/performance.md, "Which transport carries the
payloads"), so ``"auto"`` runs the optimizer's exchanges over such a group
(:class:`~.distributed.StandaloneGroupCollectives`) for CPU gradients, and for CUDA gradients
where ranks share hosts (the hierarchical exchange: each host's and each shard's groups are
NCCL's where every rank of a host has its own GPU, else gloo's with device payloads staged
through pinned host memory); flat CUDA exchanges keep Horovod's collectives (NCCL moves device
buffers), as does a failed build (one warning). The world group is gloo's: its collectives
pair by call order, so the optimizer starts its buckets in bucket order, as DDP does.

The groups are built once per Horovod process set and device, collectively: rank 0 opens a
``TCPStore`` beside Horovod (:func:`~horovod_quant.rendezvous.store_beside_horovod`), and each
rank connects its groups through it (:func:`connect_group`); the default ``torch.distributed``
group is left alone. The job's end is agreed in that store too (:func:`horovod_end_of_job`).
Horovod is imported only by the functions that build Horovod's collectives
(:func:`transport_collectives`, :func:`horovod_topology`, :func:`horovod_end_of_job`); the
choice itself (:func:`collectives_for`) runs on any :class:`Collectives`.
"""
from __future__ import annotations

import functools
import logging
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import gpu, rendezvous
from ..doors import TRANSPORTS, DoorEnvironment
from ..exchange.collectives import Collectives
from ..exchange.job_end import StoreRendezvous
from ..exchange.shared_memory import host_collectives
from ..exchange.staging import HostStaged, for_device_arrays
from ..exchange.topology import Hierarchy, SerialWorker, Topology
from .distributed import StandaloneGroupCollectives

log = logging.getLogger("horovod_quant")

#: how long building the group may take: connecting every pair of ranks, then a first
#: collective (a peer that cannot be reached fails the build here, on every rank)
CONNECT_TIMEOUT = timedelta(seconds=20)
#: how long one of the group's collectives may wait for a peer before it raises (gloo needs a
#: bound; torch.distributed's default)
OPERATION_TIMEOUT = timedelta(minutes=30)

_TOKEN_KEY = "hq.token"  # rank 0's store holds a random token: a probe reached the right store
#: (process set id, device) -> its world group (with its hierarchy), or why it has none
_groups: dict[tuple[str, str], StandaloneGroupCollectives | str] = {}
#: process set id -> the ``TCPStore`` of its gloo group (the job's end is agreed there too)
_stores: dict[str, Any] = {}


def resolve_transport(transport: str | None = None) -> str:
    """The transport for a ``transport=`` argument: itself, validated, or "auto" when None.
    (The optimizer resolves ``HQ_TRANSPORT`` at its door, ``doors.DoorEnvironment``: nothing
    here reads the environment.)

    Raises:
        ValueError: not one of :data:`TRANSPORTS`.
    """
    if transport is None:
        return "auto"
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not valid: choose one of {list(TRANSPORTS)}"
                         " ('auto': a gloo group beside Horovod for CPU gradients)")
    return transport


def connect_group(backend: str, store: Any, prefix: str, rank: int, size: int,
                  gloo_device: Any = None) -> Any:
    """A process group object of ``backend`` ("gloo" or "nccl") over the ranks that share
    ``store`` under ``prefix`` (not registered with torch.distributed). gloo binds
    ``gloo_device`` (``ProcessGroupGloo.create_device``); NCCL takes the CUDA device of the
    tensors of its first collective. Either raises (RuntimeError, ...) when its peers cannot
    be reached within its timeout."""
    view = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = OPERATION_TIMEOUT  # NCCL connects at the first collective
        return dist.ProcessGroupNCCL(view, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [gloo_device]
    options._timeout = CONNECT_TIMEOUT
    return dist.ProcessGroupGloo(view, rank, size, options)


def _device_report(device: torch.device | None) -> dict | None:
    """What this rank says about its GPU for :func:`host_group_backend`: whether torch has
    NCCL, and the UUID of ``device`` (None: CPU gradients)."""
    if device is None or device.type != "cuda":
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError):
        uuid = None
    return {"nccl": dist.is_nccl_available(), "gpu": uuid}


def host_group_backend(reports: list[dict | None], topology: Topology) -> tuple[str, str]:
    """Which backend carries the host and shard groups of CUDA gradients, from every rank's
    :func:`_device_report` (rank order): ``("nccl", why)`` where torch has NCCL on every rank
    and every rank of a host has a GPU of its own (NCCL refuses two ranks on one GPU), else
    ``("gloo", why not)``. Every rank computes the same answer from the same reports."""
    if any(r is None for r in reports):
        return "gloo", "some ranks' gradients are not on a GPU"
    without = [r for r, report in enumerate(reports) if not report["nccl"]]
    if without:
        return "gloo", f"torch has no NCCL on ranks {without}"
    for h, ranks in enumerate(topology.hosts):
        gpus = [reports[r]["gpu"] for r in ranks]
        if None in gpus or len(set(gpus)) < len(gpus):
            return "gloo", (f"the ranks of host {h} ({list(ranks)}) do not each have a GPU of "
                            "their own")
    return "nccl", "every rank of a host has a GPU of its own"


def _serve_tcp_store(size: int, host: str, token: str) -> Any:
    """Rank 0's ``TCPStore`` for ``size`` ranks, holding ``token``."""
    store = dist.TCPStore(host, 0, size, True, timeout=CONNECT_TIMEOUT, wait_for_workers=False)
    store.set(_TOKEN_KEY, token)
    return store


def _join_tcp_store(size: int, address: str, port: int, token: str) -> Any:
    """A client of the ``TCPStore`` at ``address:port``; RuntimeError where it does not hold
    ``token`` (another job's store)."""
    client = dist.TCPStore(address, port, size, False, timeout=CONNECT_TIMEOUT)
    if client.get(_TOKEN_KEY).decode() != token:
        raise RuntimeError(f"{address}:{port} is not rank 0's store")
    return client


def gloo_group_beside_horovod(comm: Collectives, topology: Topology | None = None,
                              device: torch.device | None = None) -> StandaloneGroupCollectives:
    """Build a gloo process group over ``comm``'s ranks (same rank order) and return its
    collectives; ``comm`` (Horovod's) carries the rendezvous. Where ``topology`` says ranks
    share hosts (:attr:`~horovod_quant.exchange.topology.Topology.hierarchical`), the groups of
    each host and of each shard between the hosts are built too (the collectives'
    ``hierarchy``): NCCL groups on ``device`` where :func:`host_group_backend` agrees (CUDA
    gradients), else gloo groups (a host's through shared memory where it can).

    Collective: every rank of ``comm`` calls it at the same point. Each step is agreed by
    every rank, so the ranks end with a group, or all raise the same error within about
    :data:`CONNECT_TIMEOUT` (a few seconds when no address of rank 0 is reachable).

    Raises:
        RuntimeError: on every rank, naming each rank that failed and why.
    """
    name = f"hq.transport.{comm.group_id}"
    agree = rendezvous.Agreement(comm, name)
    store, address, local = rendezvous.store_beside_horovod(
        comm, agree, functools.partial(_serve_tcp_store, comm.size),
        functools.partial(_join_tcp_store, comm.size))
    gloo_device, error = rendezvous.attempt(
        lambda: dist.ProcessGroupGloo.create_device(hostname=local))
    if error is None:
        group, error = rendezvous.attempt(
            lambda: connect_group("gloo", store, name, comm.rank, comm.size, gloo_device))
    agree.gather("connect", local, error)
    groups = [StandaloneGroupCollectives(group, f"gloo:{comm.group_id}")]
    if topology is not None and topology.hierarchical:
        backend, why = host_group_backend(agree.gather("devices", _device_report(device), None),
                                          topology)
        host, shard = topology.host_of(comm.rank), topology.local_rank(comm.rank)
        subgroups = [(f"{name}.host{host}", shard, topology.local_size),
                     (f"{name}.shard{shard}", host, topology.host_count)]
        built, error = rendezvous.attempt(
            lambda: [connect_group(backend, store, *g, gloo_device) for g in subgroups])
        agree.gather("subgroups", None, error)
        on = device if backend == "nccl" else None
        groups += [StandaloneGroupCollectives(g, f"{backend}:{comm.group_id}:{prefix}", on)
                   for g, (prefix, _, _) in zip(built, subgroups)]
        if comm.rank == 0 and device is not None:
            log.info("horovod_quant: the host and shard groups of process set %s are %s's (%s)",
                     comm.group_id, backend.upper() if backend == "nccl" else "gloo", why)
    _, error = rendezvous.attempt(
        lambda: [g.allgather_object(comm.rank, name + ".hello") for g in groups])
    agree.gather("hello", None, error)  # every pair of ranks has exchanged data
    for g in groups:
        g.group.set_timeout(OPERATION_TIMEOUT)
    world = groups[0]
    _stores[comm.group_id] = store
    if len(groups) == 3:
        local_group = groups[1] if groups[1].moves_device_arrays else host_collectives(groups[1])
        world.hierarchy = Hierarchy(topology, local_group, groups[2],
                                    SerialWorker(f"hq.hierarchy.{comm.group_id}"))
    return world


def horovod_end_of_job(comm: Collectives, shutdown: Callable[[], Any] | None = None
                       ) -> StoreRendezvous | None:
    """Where the torch Horovod doors over ``comm`` agree on the job's end
    (:func:`~horovod_quant.rendezvous.horovod_end_of_job`): the gloo group's ``TCPStore``
    where the process set has one, else the store of :mod:`horovod_quant.store` (collective on
    first use); ``shutdown``, None: ``horovod.torch``'s."""
    if shutdown is None:
        import horovod.torch as hvd

        shutdown = hvd.shutdown
    # one warning per cause: a gloo group that failed to build has said why already
    warned = any(gid == comm.group_id and isinstance(g, str) for (gid, _), g in _groups.items())
    return rendezvous.horovod_end_of_job(comm, shutdown, _stores.get(comm.group_id), warned)


def horovod_topology(comm: Collectives) -> Topology:
    """Which ranks of ``comm``'s process set share a host, from Horovod's own local and cross
    ranks (:func:`topology_of_places`). Collective."""
    import horovod.torch as hvd

    return topology_of_places(comm, [hvd.cross_rank(), hvd.local_rank(), hvd.local_size()])


def topology_of_places(comm: Collectives, place: list[int]) -> Topology:
    """Which ranks of ``comm`` share a host, from every rank's ``place``: ``[cross rank, local
    rank, local size]`` as Horovod numbers them. A host's ranks share a cross rank where every
    host runs as many ranks, each with a local rank of its own; else each rank counts as a
    host of its own (no hierarchical exchange). Collective."""
    places = comm.allgather_object(place, f"hq.topology.{comm.group_id}")
    if len({size for _, _, size in places}) != 1:
        return Topology.grid(comm.size, 1)
    topology = Topology.from_host_keys([cross for cross, _, _ in places])
    if any(len({places[r][1] for r in ranks}) != len(ranks) for ranks in topology.hosts):
        return Topology.grid(comm.size, 1)
    return topology


def transport_collectives(process_set: Any = None, transport: str | None = None,
                          device: torch.device | None = None,
                          environment: DoorEnvironment = DoorEnvironment()) -> Collectives:
    """The collectives the exchanges of ``process_set`` (a Horovod process set; default: all
    ranks) run on: :func:`collectives_for` over Horovod's collectives of the process set, the
    topology from Horovod's local and cross ranks. Collective on first use.

    Args:
        process_set, transport, device: as :func:`collectives_for` takes them.
        environment: the door's environment (``doors.DoorEnvironment``): whether Horovod's
            collectives may run a codec's custom reduction over MPI, and take CUDA buffers.
    """
    from .collectives import HorovodTorchCollectives

    transport = resolve_transport(transport)  # an invalid one fails before Horovod is asked
    return collectives_for(HorovodTorchCollectives(process_set, environment), transport,
                           device)


def collectives_for(horovod: Collectives, transport: str | None = None,
                    device: torch.device | None = None,
                    topology_of: Callable[[Collectives], Topology] = horovod_topology
                    ) -> Collectives:
    """The collectives the exchanges run on, chosen over ``horovod`` (Horovod's collectives
    of the ranks, which carry the rendezvous). Collective on first use.

    Args:
        horovod: Horovod's collectives of the ranks (the tests' in-process ones stand in).
        transport: "horovod" (``horovod`` itself), "gloo" (a gloo group beside Horovod,
            whose collectives pair by call order; raises if it cannot be built), or "auto"
            (the gloo group for CPU gradients, and for CUDA gradients where ranks share hosts,
            when it can be built; else ``horovod``; the choice is logged once); None: "auto".
        device: where the gradients' codec work runs: a CUDA device (CuPy encodes them
            there) or the CPU; None: the current CUDA device where torch and CuPy see one.
        topology_of: which ranks share a host (collective; asked only when a group beside
            Horovod may be built).

    Returns:
        The collectives; for CUDA gradients, device payloads are staged through host memory
        (:class:`~horovod_quant.exchange.staging.HostStaged`) on the groups that do not move
        device buffers themselves (NCCL groups and Horovod's GPU operations do).
    """
    transport = resolve_transport(transport)
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    on_gpu = device is not None and device.type == "cuda" and gpu.available()
    comm: Collectives = horovod
    if horovod.size > 1 and transport != "horovod":
        topology = topology_of(horovod)
        if transport == "gloo" or not on_gpu or topology.hierarchical:
            comm = _gloo_group(horovod, topology, device if on_gpu else None,
                               required=transport == "gloo") or horovod
    return for_device_arrays(comm) if on_gpu else comm


def _gloo_group(horovod: Collectives, topology: Topology,
                device: torch.device | None, required: bool) -> StandaloneGroupCollectives | None:
    """The process set's gloo group (its hierarchy's groups on ``device``), built on first use
    (logged); None when it cannot be built (logged once), unless ``required``
    (RuntimeError)."""
    key = (horovod.group_id, str(device or "cpu"))
    group = _groups.get(key)
    if group is None:
        try:
            group = gloo_group_beside_horovod(horovod, topology, device)
            log.info("horovod_quant: payloads of process set %s travel over a gloo group beside "
                     "Horovod (%d ranks); transport='horovod' keeps Horovod's collectives",
                     horovod.group_id, horovod.size)
        except RuntimeError as exc:
            group = str(exc)
            log.warning("horovod_quant: no gloo group beside Horovod (%s); Horovod's "
                        "collectives carry the payloads", exc)
        _groups[key] = group
    if isinstance(group, str):
        if required:
            raise RuntimeError(f"transport='gloo': {group}")
        return None
    return group


def transport_of(comm: Collectives) -> str:
    """Which transport ``comm`` (or the collectives it stages for) is: "gloo" or "horovod"."""
    inner = comm.inner if isinstance(comm, HostStaged) else comm
    return "gloo" if isinstance(inner, StandaloneGroupCollectives) else "horovod"
