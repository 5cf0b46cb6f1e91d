"""A small key-value store over TCP, in the standard library only: what the ranks of a job
share beside Horovod where torch's ``TCPStore`` is not at hand (the TensorFlow door imports no
torch), with the calls :class:`~horovod_quant.exchange.job_end.StoreRendezvous` makes:
``set(key, str)``, ``get(key) -> bytes`` (waits until the key is set), ``add(key, int) ->
int`` and ``check([keys]) -> bool``.

Rank 0 holds it (:class:`StoreServer`: the values, served to the other ranks on a daemon
thread, which ends with the process) and calls it in-process; every other rank joins it over
one connection (:class:`StoreClient`). Each request and each answer is a line of JSON. A
connection starts with the token rank 0 drew, so that a rank that reached another job's
store is refused; a connection that closes before its first line (a probe of
:func:`~horovod_quant.addresses.probe`) is let go.
"""
from __future__ import annotations

import hmac
import json
import logging
import socket
import socketserver
import threading
from typing import Any, BinaryIO

log = logging.getLogger("horovod_quant")

#: seconds a ``get`` waits for its key, and a request for its answer, before they raise
STORE_TIMEOUT_S = 20.0
#: the longest line a request or an answer may be (the job's records are a few kB)
MAX_LINE = 1 << 20
#: the longest wait a ``get`` may ask the host for
MAX_WAIT_S = 3600.0
#: seconds an answer may take beyond the wait of the ``get`` it answers
_GRACE_S = 5.0


class StoreError(RuntimeError):
    """The store refused a request (a wrong token, a malformed request)."""


class _Table:
    """The values, as the host holds them; each call is thread-safe."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: str, timeout: float) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, timeout):
                raise TimeoutError(f"horovod_quant store: no rank set {key!r} within "
                                   f"{timeout:g} s")
            return self._values[key]

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            total = int(self._values.get(key, "0")) + amount
            self._values[key] = str(total)  # as TCPStore keeps a counter: its decimal text
            self._changed.notify_all()
            return total

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._values for k in keys)

    def answer(self, request: dict) -> dict:
        """The answer to a client's request (``{"value": ...}``, or ``{"error": ...}`` with
        ``"timeout": true`` where a ``get`` waited in vain)."""
        try:
            op, key = request["op"], request.get("key")
            if op == "set":
                self.set(str(key), str(request["value"]))
                return {"value": None}
            if op == "get":
                timeout = float(request["timeout"])
                if not 0 <= timeout <= MAX_WAIT_S:  # (NaN too): no thread held for ever
                    raise ValueError(f"timeout {timeout!r} outside [0, {MAX_WAIT_S:g}] s")
                return {"value": self.get(str(key), timeout)}
            if op == "add":
                amount = request["amount"]
                if isinstance(amount, bool) or not isinstance(amount, int):
                    raise TypeError(f"amount {amount!r} is not an integer")
                return {"value": self.add(str(key), amount)}
            if op == "check":
                return {"value": self.check([str(k) for k in request["keys"]])}
            return {"error": f"unknown request {op!r}"}
        except TimeoutError as exc:
            return {"error": str(exc), "timeout": True}
        except (KeyError, TypeError, ValueError) as exc:
            return {"error": f"malformed request ({type(exc).__name__}: {exc})"}


def _read(stream: BinaryIO) -> dict | None:
    """The next line's JSON object, or None where the peer closed the connection.

    Raises:
        ValueError: the line is not a JSON object (or longer than :data:`MAX_LINE`).
    """
    line = stream.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise ValueError("a line too long, or cut short")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    return message


def _line(message: dict) -> bytes:
    return json.dumps(message).encode() + b"\n"


class _Handler(socketserver.StreamRequestHandler):
    """One connection: the token, then requests until the client closes it."""

    disable_nagle_algorithm = True  # one short answer per request: no wait for an ACK

    def handle(self) -> None:
        server: _Server = self.server  # type: ignore[assignment]
        with server.lock:
            server.connections.add(self.request)
        try:
            self.request.settimeout(STORE_TIMEOUT_S)  # a connection that never says hello
            hello = _read(self.rfile)
            if hello is None:  # a probe: it only wanted to know that the port answers
                return
            self.request.settimeout(None)  # a rank's calls may be hours apart
            if not hmac.compare_digest(str(hello.get("token")), server.token):
                self.wfile.write(_line({"error": "a wrong token: another job's store"}))
                return
            self.wfile.write(_line({"value": None}))
            while (request := _read(self.rfile)) is not None:
                self.wfile.write(_line(server.table.answer(request)))
        except (OSError, ValueError) as exc:  # the client went away, or speaks another protocol
            log.debug("horovod_quant: store connection from %s ended: %s",
                      self.client_address, exc)
        finally:
            with server.lock:
                server.connections.discard(self.request)


class _Server(socketserver.ThreadingTCPServer):
    """The listening socket, and a thread per connection (:class:`_Handler`)."""

    daemon_threads = True  # a client's thread does not keep the host's process alive
    request_queue_size = 1024  # every rank probes and joins at once

    def __init__(self, token: str, table: _Table) -> None:
        self.token, self.table = token, table
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()  # the clients' (close() ends them)
        super().__init__(("", 0), _Handler)  # every interface: the ranks probe each address

    def close(self) -> None:
        """Stop accepting connections and end the clients' ones, as the process's exit
        does."""
        self.shutdown()
        self.server_close()
        with self.lock:
            for connection in self.connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:  # the client has closed it already
                    pass


class StoreServer:
    """The store's host (rank 0): the values, served on every interface at :attr:`port` to
    clients that bring ``token``, on a daemon thread; its own calls run in-process.

    Args:
        token: what a client must present (a random string rank 0 hands its peers).
        timeout: seconds a ``get`` waits for its key.
    """

    def __init__(self, token: str, timeout: float = STORE_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._table = _Table()
        self._server = _Server(token, self._table)
        self.port: int = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="horovod_quant-store",
                         daemon=True).start()

    def set(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``."""
        self._table.set(key, value)

    def get(self, key: str) -> bytes:
        """``key``'s value, once some rank set it; TimeoutError after :attr:`timeout` s."""
        return self._table.get(key, self.timeout).encode()

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 where unset); its new value."""
        return self._table.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set."""
        return self._table.check(keys)

    def close(self) -> None:
        """Stop serving and end the clients' connections (the process's exit does as much:
        their calls raise ConnectionError)."""
        self._server.close()


class StoreClient:
    """A rank's connection to the :class:`StoreServer` at ``address:port``; its calls run one
    at a time (a ``get`` that waits holds this rank's other calls back).

    Raises:
        StoreError: the server refused ``token`` (it is another job's store).
        OSError: no connection opened within ``timeout`` seconds.
    """

    def __init__(self, address: str, port: int, token: str,
                 timeout: float = STORE_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._socket: socket.socket | None = socket.create_connection((address, port), timeout)
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._stream = self._socket.makefile("rwb")
        try:
            self._call({"op": "hello", "token": token})
        except StoreError as exc:
            self.close()
            raise StoreError(f"{address}:{port} is not rank 0's store ({exc})") from None

    def _call(self, request: dict, wait: float = 0.0) -> Any:
        """The server's answer to ``request`` (``wait``: seconds the server may wait before
        it answers). A connection that failed mid-request is closed: every later call raises
        ConnectionError, as where the host has ended."""
        with self._lock:
            if self._socket is None:
                raise ConnectionError("horovod_quant store: the connection is closed")
            try:
                self._socket.settimeout(wait + _GRACE_S if wait else self.timeout)
                self._stream.write(_line(request))
                self._stream.flush()
                answer = _read(self._stream)
                if answer is None:
                    raise ConnectionError("horovod_quant store: the host closed the connection")
            except (OSError, ValueError):
                self.close()
                raise
        if "error" in answer:
            raise (TimeoutError if answer.get("timeout") else StoreError)(answer["error"])
        return answer["value"]

    def set(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``."""
        self._call({"op": "set", "key": key, "value": value})

    def get(self, key: str) -> bytes:
        """``key``'s value, once some rank set it; TimeoutError after :attr:`timeout` s."""
        return self._call({"op": "get", "key": key, "timeout": self.timeout},
                          self.timeout).encode()

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 where unset); its new value."""
        return self._call({"op": "add", "key": key, "amount": amount})

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set."""
        return self._call({"op": "check", "keys": list(keys)})

    def close(self) -> None:
        """Close the connection (later calls raise ConnectionError)."""
        if self._socket is not None:
            self._stream.close()
            self._socket.close()
            self._socket = None
