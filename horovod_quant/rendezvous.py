"""The ranks' rendezvous beside Horovod, framework-free: rank 0 serves a store, the ranks find
an address of rank 0 they all reach (:mod:`.addresses`) through Horovod's collectives, and each
joins the store there (:func:`store_beside_horovod`, every step agreed by every rank:
:class:`Agreement`). The torch door's gloo groups meet in a ``TCPStore`` built this way
(``torch/transport.py``). The Horovod doors agree on the job's end
(:mod:`~horovod_quant.exchange.job_end`) in the gloo group's store where the ranks have one,
else in this package's own store (:mod:`.store`, built by :func:`horovod_end_of_job`), so the
TensorFlow door imports no torch.
"""
from __future__ import annotations

import logging
import secrets
from typing import Any, Callable

from . import addresses
from .exchange.collectives import Collectives
from .exchange.job_end import StoreRendezvous
from .store import StoreClient, StoreServer

log = logging.getLogger("horovod_quant")

#: process set id -> the store of :mod:`.store` its ranks agree on the job's end in (None: it
#: could not be built)
_end_stores: dict[str, StoreServer | StoreClient | None] = {}


class Agreement:
    """The steps of a rendezvous, each agreed over Horovod's collectives: a step that failed
    on any rank fails on every rank, with every rank's reason.

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


def attempt(action: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(action(), None)``, or ``(None, why)`` when it raised as a failed connection does."""
    try:
        return action(), None
    except (RuntimeError, OSError, ValueError) as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return None, f"{type(exc).__name__}: {first_line}"


def store_beside_horovod(comm: Collectives, agree: Agreement,
                         serve: Callable[[str, str], Any],
                         join: Callable[[str, int, str], Any]) -> tuple[Any, str, str]:
    """Rank 0's store and every rank's client of it, at an address of rank 0 that every rank
    reaches (found through Horovod's collectives); returns the store, that address, and the
    local address this rank reaches it from (what a gloo device binds). Collective.

    Args:
        comm: Horovod's collectives of the ranks.
        agree: the steps' agreement (its name prefixes this rendezvous's collectives).
        serve: ``serve(host, token)``, on rank 0: the store, listening on every address of
            rank 0 (``host`` is the first) at its ``port``, for the clients that bring
            ``token`` (a random string).
        join: ``join(address, port, token)``, on the other ranks: the client of the store
            there, raising where that store is not the one holding ``token``.

    Raises:
        RuntimeError: on every rank, naming each rank that failed and why.
    """
    own, error = attempt(addresses.own_addresses)
    store = token = None
    if comm.rank == 0 and error is None:
        token = secrets.token_hex(8)
        store, error = attempt(lambda: serve(own[0], token))
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
    if comm.rank != 0:
        store, error = attempt(lambda: join(address, offer["port"], offer["token"]))
    agree.gather("store", None, error)
    return store, address, local


def _serve(host: str, token: str) -> StoreServer:
    """Rank 0's store of :mod:`.store` (it listens on every interface, ``host``'s too)."""
    return StoreServer(token)


def horovod_end_of_job(comm: Collectives, shutdown: Callable[[], Any], store: Any = None,
                       quiet: bool = False) -> StoreRendezvous | None:
    """Where the doors over ``comm`` (Horovod's collectives of a process set, PyTorch's or
    TensorFlow's) agree on the job's end (:mod:`~horovod_quant.exchange.job_end`).

    Args:
        comm: Horovod's collectives of the process set.
        shutdown: Horovod's ``shutdown``: it unblocks a rank waiting inside Horovod's own
            collectives.
        store: a store the ranks share already (the torch door's gloo group's), or None: the
            process set's store of :mod:`.store`, built beside Horovod on first use
            (collective).
        quiet: the cause of a failed build was logged already (a gloo group's failure): it is
            logged at the info level, not as a warning.

    Returns:
        The rendezvous, or None where no store could be built (logged once).
    """
    if store is None:
        if comm.group_id not in _end_stores:
            try:
                _end_stores[comm.group_id] = store_beside_horovod(
                    comm, Agreement(comm, f"hq.end.{comm.group_id}"), _serve, StoreClient)[0]
            except RuntimeError as exc:
                _end_stores[comm.group_id] = None
                (log.info if quiet else log.warning)(
                    "horovod_quant: no store beside Horovod (%s): a rank that runs more steps "
                    "than the others waits for its exchange", exc)
        store = _end_stores[comm.group_id]
    return None if store is None else StoreRendezvous(
        store, comm.rank, comm.size, f"hq.end.{comm.group_id}", shutdown)
