"""The store beside Horovod (horovod_quant.store) and the rendezvous that builds it
(horovod_quant.rendezvous): its calls between threads, a ``get`` that waits and one that times
out, probes and strangers that leave it undisturbed, a wrong token refused, the threaded ranks'
rendezvous and end-of-job agreement over it, and no framework loaded on the way."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from horovod_quant import addresses, rendezvous
from horovod_quant.exchange.job_end import StoreRendezvous
from horovod_quant.store import StoreClient, StoreError, StoreServer

from threaded_comm import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "f00dfeedc0ffee00"


@pytest.fixture
def server():
    host = StoreServer(TOKEN, timeout=5.0)
    yield host
    host.close()


def _client(server, timeout=5.0):
    return StoreClient("127.0.0.1", server.port, TOKEN, timeout)


def test_set_get_add_check_between_the_host_and_clients_in_threads(server):
    clients = [_client(server) for _ in range(4)]
    server.set("a", "from the host")
    clients[0].set("b", '{"doors": []}')
    assert clients[1].get("a") == b"from the host" and server.get("b") == b'{"doors": []}'
    assert clients[2].check(["a", "b"]) and not clients[2].check(["a", "c"])

    def count(store):
        for _ in range(50):
            store.add("n", 1)

    threads = [threading.Thread(target=count, args=(s,)) for s in [server, *clients]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clients[3].add("n", 0) == server.add("n", 0) == 250
    assert server.get("n") == b"250"  # a counter reads as its decimal text, as in TCPStore
    for c in clients:
        c.close()


def test_get_waits_for_a_later_set_and_times_out_naming_the_key(server):
    client, setter = _client(server, timeout=0.5), _client(server)
    later = threading.Timer(0.2, setter.set, ("late", "here"))
    later.start()
    start = time.monotonic()
    assert client.get("late") == b"here" and time.monotonic() - start >= 0.15
    later.join()
    with pytest.raises(TimeoutError, match="no rank set 'never' within 0.5 s"):
        client.get("never")
    assert client.check(["late"])  # the connection goes on after a timeout
    with pytest.raises(TimeoutError, match="'never'"):
        StoreServer(TOKEN, timeout=0.1).get("never")
    setter.close()
    client.close()


def test_probes_and_strangers_do_not_disturb_the_server(server, capfd):
    client = _client(server)
    client.set("k", "v")
    assert addresses.probe(["127.0.0.1"] * 3, server.port) == ["127.0.0.1"] * 3
    with socket.create_connection(("127.0.0.1", server.port)) as stranger:
        stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert stranger.recv(100) == b""  # not this protocol: let go
    with socket.create_connection(("127.0.0.1", server.port)) as cut:
        cut.sendall(b'{"token": "f00d')  # closed mid-line
    assert client.get("k") == b"v" and _client(server).get("k") == b"v"
    assert capfd.readouterr().err == ""
    client.close()


def test_a_wrong_token_is_refused(server):
    with pytest.raises(StoreError, match=f"127.0.0.1:{server.port} is not rank 0's store "
                                         r"\(a wrong token"):
        StoreClient("127.0.0.1", server.port, "another job's token")
    assert _client(server).add("n", 1) == 1  # the server goes on


def test_a_client_of_a_closed_server_fails_as_a_connection_does():
    server = StoreServer(TOKEN)
    client = _client(server)
    client.set("hq.end.0/in", "1")
    rendezvous_of_rank1 = StoreRendezvous(client, 1, 2, "hq.end.0")
    assert rendezvous_of_rank1.rang()
    server.close()  # as the host's process ends
    assert not rendezvous_of_rank1.rang()  # the host ended: nothing to agree with
    with pytest.raises(ConnectionError):
        client.check(["x"])


@pytest.fixture
def unnamed(monkeypatch):
    """No address or interface named in the environment: rank 0 offers all of its own."""
    for name in (addresses.ADDRESS_ENV, *addresses.INTERFACE_ENVS):
        monkeypatch.delenv(name, raising=False)


def test_threaded_ranks_meet_in_rank_0s_store_and_agree_on_the_end(unnamed):
    def rank(comm):
        agree = rendezvous.Agreement(comm, "hq.test")
        store, address, local = rendezvous.store_beside_horovod(
            comm, agree, lambda host, token: StoreServer(token), StoreClient)
        records = StoreRendezvous(store, comm.rank, comm.size, "hq.end.t").announce(
            {"doors": [["optimizer", 3 + comm.rank, False]]})
        return type(store), address, records

    results = run_ranks(3, rank)
    assert [kind for kind, _, _ in results] == [StoreServer, StoreClient, StoreClient]
    assert len({address for _, address, _ in results}) == 1
    want = [{"doors": [["optimizer", 3 + r, False]]} for r in range(3)]
    assert all(records == want for _, _, records in results)


def test_a_rank_that_cannot_join_fails_every_rank_with_its_reason(unnamed):
    def refused(address, port, token):
        raise StoreError(f"{address}:{port} is not rank 0's store")

    def rank(comm):
        join = refused if comm.rank == 2 else StoreClient
        with pytest.raises(RuntimeError, match=r"^rank 2: StoreError: .* is not rank 0's store"):
            rendezvous.store_beside_horovod(comm, rendezvous.Agreement(comm, "hq.test"),
                                            lambda host, token: StoreServer(token), join)

    run_ranks(3, rank)


def test_the_end_of_job_store_loads_no_framework():
    """One rank's end-of-job rendezvous, built and announced in a fresh interpreter: neither
    torch nor TensorFlow is imported (the TensorFlow door builds it so)."""
    code = ("import sys\n"
            "from horovod_quant.exchange import LocalCollectives\n"
            "from horovod_quant.rendezvous import horovod_end_of_job\n"
            "end = horovod_end_of_job(LocalCollectives(), lambda: None)\n"
            "assert end.announce({'doors': []}) == [{'doors': []}]\n"
            "print(sorted({'torch', 'tensorflow', 'horovod'} & set(sys.modules)))\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name in (addresses.ADDRESS_ENV, *addresses.INTERFACE_ENVS):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_no_rank_ends_before_every_rank_acted_and_a_host_gone_after_counting_out_is_no_error(
        server):
    """Launchers stop a job at its first failed rank: every rank acts on the records (prints)
    before any rank's announce returns (and its process may end), and a rank still counting
    after the store's host ended (it ends once every rank counted out) returns its records
    instead of raising."""
    events = []

    class SlowHost:  # rank 0 reads the records after rank 1 counted out (it is busier)
        def __getattr__(self, name):
            return getattr(server, name)

        def get(self, key):
            time.sleep(0.5)
            return server.get(key)

    class SlowPolls:  # rank 1 looks at the count out again only once the host has ended
        def __init__(self, client):
            self.client = client

        def __getattr__(self, name):
            return getattr(self.client, name)

        def add(self, key, amount):
            if key.endswith("/out") and amount == 0:
                time.sleep(2.0)
            return self.client.add(key, amount)

    ranks = [StoreRendezvous(SlowHost(), 0, 2, "p"),
             StoreRendezvous(SlowPolls(StoreClient("127.0.0.1", server.port, TOKEN,
                                                   timeout=5.0)), 1, 2, "p")]
    got = {}

    def rank(r):
        got[r] = ranks[r].announce({"rank": r}, lambda records: events.append(("acted", r)))
        events.append(("returned", r))
        if r == 0:
            server.close()  # the host's process ends as soon as it returns

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got[0] == got[1] == [{"rank": 0}, {"rank": 1}]
    assert {e for e, _ in events[:2]} == {"acted"}, events


def test_requests_that_would_hold_the_host_or_lose_bits_are_refused(server):
    """A ``get`` without a finite bounded wait and an ``add`` of a non-integer get an error
    answer; the connection goes on serving."""
    with socket.create_connection(("127.0.0.1", server.port), 5) as sock:
        stream = sock.makefile("rwb")

        def call(request):
            stream.write((json.dumps(request) + "\n").encode())
            stream.flush()
            return json.loads(stream.readline())

        assert call({"op": "hello", "token": TOKEN}) == {"value": None}
        assert "timeout" in call({"op": "get", "key": "k", "timeout": float("nan")})["error"]
        assert "timeout" in call({"op": "get", "key": "k", "timeout": 1e308})["error"]
        assert "integer" in call({"op": "add", "key": "n", "amount": 1.5})["error"]
        assert call({"op": "add", "key": "n", "amount": 2}) == {"value": 2}
