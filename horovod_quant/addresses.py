"""Which network addresses the ranks reach each other at beside Horovod (rank 0's store of
:mod:`.rendezvous`, and the torch door's gloo groups). Framework-free.

A host's name often resolves to a loopback address (``127.0.1.1`` on most Debian/Ubuntu
installs), so nothing here resolves it: rank 0 offers the IPv4 addresses of its interfaces
(:func:`own_addresses`, loopback last), every other rank tries them all at once with a short
timeout (:func:`probe`), and a gloo device binds to the local address its rank's connection
to rank 0 left from. The environment narrows the choice as it does for the
frameworks: ``HQ_PEER_ADDR`` names this rank's own address, ``GLOO_SOCKET_IFNAME``,
``HOROVOD_GLOO_IFACE`` and ``NCCL_SOCKET_IFNAME`` (NCCL's syntax: ``^`` excludes, ``=`` matches
exactly, else by prefix) the interfaces to use.
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import ipaddress
import socket
import struct

from .env import env_text

#: environment variable naming the address this rank is reached at
ADDRESS_ENV = "HQ_PEER_ADDR"
#: environment variables naming the interfaces to use, in order of precedence
INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME")
#: how long one connection attempt to a candidate address of rank 0 may take
PROBE_TIMEOUT_S = 3.0

_SIOCGIFADDR = 0x8915


class AddressError(ValueError):
    """The environment names an address or interface this host does not have."""


def interface_addresses() -> dict[str, str]:
    """Each network interface of this host that has an IPv4 address: name -> address, in the
    kernel's interface order."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address, or the interface went away
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def select_interfaces(spec: str, names: list[str]) -> list[str]:
    """The interfaces of ``names`` that ``spec`` selects, in its order: a comma-separated list
    of name prefixes, exact names after a leading ``=``, or prefixes to exclude after ``^``."""
    exclude, exact = spec.startswith("^"), spec.startswith("=")
    wanted = [w.strip() for w in spec.lstrip("^=").split(",") if w.strip()]

    def matches(name: str, w: str) -> bool:
        return name == w if exact else name.startswith(w)

    if exclude:
        return [n for n in names if not any(matches(n, w) for w in wanted)]
    return [n for w in wanted for n in names if matches(n, w)]


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def own_addresses() -> list[str]:
    """The addresses this rank may be reached at, best first.

    ``HQ_PEER_ADDR`` when set; else the addresses of the interfaces the first set variable of
    :data:`INTERFACE_ENVS` selects; else every interface's, loopback last (a one-host world
    needs nothing else).

    Raises:
        AddressError: the variable names an address that is not IPv4, or interfaces this host
            does not have (the message lists the ones it has).
    """
    address = env_text(ADDRESS_ENV)
    if address is not None:
        try:
            address = str(ipaddress.IPv4Address(address))
        except ValueError:
            raise AddressError(f"{ADDRESS_ENV}={address!r} is not an IPv4 address") from None
        if not bindable(address):
            raise AddressError(f"{ADDRESS_ENV}={address!r} is not an address of "
                               f"{socket.gethostname()} (it has {interface_addresses()})")
        return [address]
    interfaces = interface_addresses()
    for env in INTERFACE_ENVS:
        spec = env_text(env)
        if spec is not None:
            chosen = select_interfaces(spec, list(interfaces))
            if not chosen:
                raise AddressError(f"{env}={spec!r} selects no interface with an IPv4 address "
                                   f"on {socket.gethostname()} (it has {interfaces})")
            return [interfaces[name] for name in chosen]
    addresses = list(dict.fromkeys(interfaces.values()))
    return sorted(addresses, key=_is_loopback)


def _local_end(address: str, port: int, timeout: float) -> str | None:
    """The local address of a TCP connection to ``address:port``, or None if none opens in
    ``timeout`` seconds."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as s:
            return s.getsockname()[0]
    except OSError:
        return None


def probe(addresses: list[str], port: int, timeout: float = PROBE_TIMEOUT_S) -> list[str | None]:
    """For each of ``addresses``, the local address a TCP connection to it on ``port`` leaves
    from, or None where none opened within ``timeout`` seconds (all tried at once)."""
    if not addresses:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(addresses)) as pool:
        return list(pool.map(lambda a: _local_end(a, port, timeout), addresses))


def bindable(address: str) -> bool:
    """Whether this host has ``address`` (a socket can bind to it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError:
        return False
    return True


def named_in_environment() -> bool:
    """Whether the environment names this rank's address or interfaces (then
    :func:`own_addresses` is what the user chose, not a guess)."""
    return any(env_text(k) is not None for k in (ADDRESS_ENV, *INTERFACE_ENVS))
