"""How the ranks find the addresses they reach each other at beside Horovod (no host name is
resolved: on most Debian/Ubuntu hosts it maps to 127.0.1.1)."""
import socket
import time

import pytest

from horovod_quant import addresses

INTERFACES = {"lo": "127.0.0.1", "docker0": "172.17.0.1", "eth0": "10.0.0.5",
              "eth1": "10.1.0.5", "ib0": "192.168.7.5"}


@pytest.fixture
def host(monkeypatch):
    monkeypatch.setattr(addresses, "interface_addresses", lambda: dict(INTERFACES))
    for name in (addresses.ADDRESS_ENV, *addresses.INTERFACE_ENVS):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("spec, chosen", [
    ("eth", ["eth0", "eth1"]),          # NCCL: a prefix
    ("=eth0", ["eth0"]),                # exact
    ("=eth", []),
    ("^eth,lo", ["docker0", "ib0"]),    # excluded prefixes
    ("ib0,eth1", ["ib0", "eth1"]),      # in the variable's order
    ("wlan", []),
])
def test_interface_selection_follows_nccl_syntax(spec, chosen):
    assert addresses.select_interfaces(spec, list(INTERFACES)) == chosen


def test_every_interface_is_offered_loopback_last(host):
    assert addresses.own_addresses() == ["172.17.0.1", "10.0.0.5", "10.1.0.5", "192.168.7.5",
                                         "127.0.0.1"]
    assert not addresses.named_in_environment()


@pytest.mark.parametrize("env", addresses.INTERFACE_ENVS)
def test_an_interface_variable_narrows_the_offer(host, env):
    host.setenv(env, "eth1")
    assert addresses.own_addresses() == ["10.1.0.5"]
    assert addresses.named_in_environment()


def test_interface_variables_take_precedence_in_order(host):
    host.setenv("NCCL_SOCKET_IFNAME", "eth0")
    host.setenv("HOROVOD_GLOO_IFACE", "ib0")
    assert addresses.own_addresses() == ["192.168.7.5"]
    host.setenv("GLOO_SOCKET_IFNAME", "eth1")
    assert addresses.own_addresses() == ["10.1.0.5"]


def test_a_missing_interface_is_an_error_naming_what_the_host_has(host):
    host.setenv("GLOO_SOCKET_IFNAME", "doesnotexist")
    with pytest.raises(addresses.AddressError, match="GLOO_SOCKET_IFNAME='doesnotexist' selects "
                                                     "no interface.*eth0"):
        addresses.own_addresses()


def test_peer_address_must_be_ipv4_and_this_hosts(host):
    host.setenv(addresses.ADDRESS_ENV, "127.0.0.1")
    assert addresses.own_addresses() == ["127.0.0.1"]
    host.setenv(addresses.ADDRESS_ENV, "not-an-address")
    with pytest.raises(addresses.AddressError, match="not an IPv4 address"):
        addresses.own_addresses()
    host.setenv(addresses.ADDRESS_ENV, "192.0.2.254")  # TEST-NET-1: no host has it
    with pytest.raises(addresses.AddressError, match="is not an address of"):
        addresses.own_addresses()


def test_the_real_host_offers_its_interfaces(monkeypatch):
    for name in (addresses.ADDRESS_ENV, *addresses.INTERFACE_ENVS):
        monkeypatch.delenv(name, raising=False)
    offered = addresses.own_addresses()
    assert "127.0.0.1" in offered and offered[-1].startswith("127.")
    assert all(addresses.bindable(a) for a in offered)


def test_probe_tells_the_local_end_of_reachable_addresses_fast():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        with socket.socket() as closed:  # a port nothing listens on
            closed.bind(("127.0.0.1", 0))
            closed_port = closed.getsockname()[1]
        start = time.monotonic()
        assert addresses.probe(["127.0.0.1"], port) == ["127.0.0.1"]
        assert addresses.probe(["127.0.0.1"], closed_port) == [None]
        # an address that drops packets costs the timeout, once, whatever the number of them
        assert addresses.probe(["192.0.2.1", "192.0.2.2", "127.0.0.1"], port,
                               timeout=0.5) == [None, None, "127.0.0.1"]
        assert time.monotonic() - start < 3
    assert addresses.probe([], port) == []
