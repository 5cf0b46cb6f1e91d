"""An emulated cluster on one machine: H hosts x K ranks in Linux network namespaces.

    import sys; sys.path.insert(0, "benchmarks")
    from emulator import EmulatedCluster

    with EmulatedCluster(hosts=4, ranks_per_host=2, rate="1gbit") as cluster:
        result = cluster.run([sys.executable, "train.py"], controller="gloo", timeout=600)
        assert result.ok, result.report()

    sudo python3 benchmarks/emulator.py --cleanup      # leftovers of killed runs

What it builds (root, ``ip`` and ``tc`` needed; nothing of the machine's own network changes):

* a switch: namespace ``hqem-<pid>-sw`` holding a Linux bridge;
* H hosts: namespaces ``hqem-<pid>-h<i>``, each with one NIC, ``eth0`` (a veth pair whose
  other end is a port of the bridge), at ``10.214.<s>.<i+1>/24`` (``<s>`` chosen so that the
  subnet appears nowhere in the machine's routes and addresses, nor in another live run's);
  ``lo`` up. Ranks of one host talk over ``lo``; only traffic between hosts crosses a NIC;
* with ``rate``: a ``tbf`` qdisc at that rate on egress of both ends of every host's veth
  (the host's ``eth0`` and its bridge port), so each host sends and receives at most ``rate``,
  as behind a switch port; ``delay_ms`` adds a ``netem`` delay on the host's end where the
  kernel has netem;
* ``/etc/netns/<ns>/hosts`` (``ip netns exec`` mounts it over ``/etc/hosts``): every host's
  hostname ``hqem<pid>h<i>`` at its address, except its own, which resolves as asked:
  ``"own"`` (its address), ``"127.0.1.1"`` (Debian/Ubuntu's ``127.0.1.1 <hostname>``) or
  ``"127.0.0.1"``. Every process of a host runs in a UTS namespace with the host's hostname,
  so ``socket.gethostbyname(socket.gethostname())`` in a rank gives what a real host would.

Launching (:meth:`EmulatedCluster.start` / :meth:`~EmulatedCluster.run`), rank r on host
r // K, local rank r % K, cross rank r // K:

* ``controller="gloo"``: what ``horovodrun --gloo`` does for real hosts: Horovod's rendezvous
  server in host 0 (``python3 emulator.py --rendezvous``), then every rank with Horovod's gloo
  environment (``HOROVOD_RANK``/``LOCAL_RANK``/``CROSS_RANK`` and sizes, ``HOROVOD_HOSTNAME``,
  the rendezvous address, ``HOROVOD_GLOO_IFACE=NCCL_SOCKET_IFNAME=eth0``);
* ``controller="mpi"``: ``mpirun`` in host 0 (``-H <address>:K`` per host, no tree spawn) with
  an ``rsh`` agent that starts Open MPI's daemon in the namespace, and a UTS namespace with
  the hostname, of the host owning the address; ``btl tcp,self`` and the TCP transports on
  the hosts' subnet. With K > 1 this ran (2 x 2 and 4 x 2, Horovod allreduce/allgather of
  16 MB); an earlier launch that left every daemon the machine's own hostname had segfaulted
  inside ``hvd.init`` with two ranks per namespace.

Each rank's stdout and stderr go to files (:class:`LaunchResult`); ``PYTHONFAULTHANDLER=1``
is set, so at the deadline every rank still running gets SIGABRT first (Python dumps every
thread's stack to its stderr), then its process tree and everything left in the hosts'
namespaces is killed. Everything created (namespaces with their links and processes,
``/etc/netns`` entries, the temp dir, Open MPI's session dirs of the hosts) is removed on exit
from the ``with`` block, also on an exception, SIGINT, SIGTERM or SIGHUP;
:func:`cleanup_leftovers` removes what killed runs left (names with the pid of a process that
no longer runs), nothing else.

Bytes between hosts: :meth:`EmulatedCluster.nic_bytes` reads every host's kernel counters
(``/sys/class/net/eth0/statistics/{tx,rx}_bytes`` inside its namespace) from outside, for
whole runs (subtract an idle baseline); inside a rank, :func:`nic_counters` reads its own
host's, so a script can read them after a barrier around its measured steps and leave set-up
traffic out (``benchmarks/cluster_workloads.py`` does).

Horovod's gloo controller where hostnames resolve to loopback: Horovod 0.28.1 builds the context
of every process set with an interface of its own that is never set, so gloo binds the address
of ``gethostname()`` (loopback here) and a rank dies in ``hvd.init()``; the Horovod that
``scripts/install.sh`` builds carries ``HOROVOD_GLOO_IFACE`` over (its patch 3), so every
``hostname_resolves_to`` runs under both controllers.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Mapping, Sequence

PREFIX = "hqem"
#: the NIC of every emulated host (the same name on each, as on a real cluster)
NIC = "eth0"
#: environment variable naming the host's NIC inside a rank (:func:`nic_counters`)
NIC_ENV = "HQEMU_NIC"
HOSTNAME_MODES = ("own", "127.0.1.1", "127.0.0.1")
CONTROLLERS = ("gloo", "mpi")
#: the second octet of the hosts' subnets: 10.214.<s>.0/24
SUBNET_BASE = (10, 214)
#: seconds a rank dumping its stacks (SIGABRT, faulthandler) gets before it is killed
STACK_DUMP_S = 3.0

# -- small helpers -----------------------------------------------------------------------------
def sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and res.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def parse_rate(text: str) -> float:
    """Bits per second of ``"1gbit"``, ``"500mbit"``, ``"10gbit"``...

    Raises:
        ValueError: not a number followed by bit, kbit, mbit or gbit.
    """
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", str(text).strip().lower())
    if not m:
        raise ValueError(f"rate {text!r}: use e.g. 1gbit, 10gbit, 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_pids(ns: str) -> list[int]:
    res = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def kill_netns_processes(ns: str) -> None:
    """SIGTERM, then SIGKILL, every process inside namespace ``ns`` (all started by its run)."""
    for sig, pause in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 0.3)):
        pids = netns_pids(ns)
        if not pids:
            return
        _signal_all(pids, sig)
        time.sleep(pause)


def nic_counters(nic: str | None = None) -> dict[str, int]:
    """This host's NIC byte counters, read inside a rank: ``{"tx_bytes", "rx_bytes"}`` of
    ``nic`` (default: the launcher's ``HQEMU_NIC``)."""
    nic = nic or os.environ.get(NIC_ENV, NIC)
    out = {}
    for key in ("tx_bytes", "rx_bytes"):
        with open(f"/sys/class/net/{nic}/statistics/{key}") as f:
            out[key] = int(f.read())
    return out


# -- the cluster -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    hostname: str
    address: str
    switch_port: str  # its veth's other end, in the switch namespace


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where a rank runs and the ranks Horovod gives it."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: Host


class EmulatedCluster:
    """H hosts x K ranks on a shaped bridge, owned by this process (see the module doc).

    Args:
        hosts: number of hosts (2-250).
        ranks_per_host: ranks per host.
        rate: NIC rate both ways, e.g. ``"1gbit"`` or bits/s; None: unshaped.
        hostname_resolves_to: what a host's own hostname resolves to there: ``"own"`` (its
            address), ``"127.0.1.1"`` or ``"127.0.0.1"``.
        delay_ms: netem delay on each host's egress (applied only where the kernel has netem;
            :attr:`shaping` says whether it did).
        prefix: first part of every name this run makes (namespaces, hostnames, temp dir), so
            that a tool's runs are told apart from the benchmarks' ``hqem`` ones.
    """

    def __init__(self, hosts: int = 2, ranks_per_host: int = 1, rate: str | float | None = None,
                 hostname_resolves_to: str = "own", delay_ms: float = 0.0,
                 prefix: str = PREFIX) -> None:
        if not 2 <= hosts <= 250:
            raise ValueError(f"hosts={hosts}: between 2 and 250")
        if not re.fullmatch(r"[a-z]{2,8}", prefix):
            raise ValueError(f"prefix={prefix!r}: 2-8 lowercase letters")
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host={ranks_per_host}: at least 1")
        if hostname_resolves_to not in HOSTNAME_MODES:
            raise ValueError(f"hostname_resolves_to={hostname_resolves_to!r}: one of "
                             f"{list(HOSTNAME_MODES)}")
        self.num_hosts = hosts
        self.ranks_per_host = ranks_per_host
        self.rate_bps = None if rate is None else (parse_rate(rate) if isinstance(rate, str)
                                                   else float(rate))
        self.delay_ms = delay_ms
        self.hostname_resolves_to = hostname_resolves_to
        self.run_id = str(os.getpid())
        self.prefix = prefix
        self.switch_ns = f"{prefix}-{self.run_id}-sw"
        self.hosts: list[Host] = []
        self.subnet: str | None = None
        self.shaping: dict = {}
        self.tmp: str | None = None
        self._created_ns: list[str] = []
        self._created_etc: list[str] = []
        self._launches: list[Launch] = []
        self._old_handlers: dict = {}

    # -- lifecycle --
    def __enter__(self) -> "EmulatedCluster":
        if threading.current_thread() is threading.main_thread():
            def on_signal(signum, _frame):
                raise KeyboardInterrupt(f"signal {signum}")
            self._old_handlers = {s: signal.signal(s, on_signal)
                                  for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        """Build the switch, the hosts and their shaping (root needed)."""
        if os.geteuid() != 0:
            raise PermissionError("the emulated cluster needs root (network namespaces, tc)")
        for tool in ("ip", "tc", "unshare"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"the emulated cluster needs `{tool}` on PATH "
                                        "(apt-get install iproute2 util-linux)")
        self.tmp = tempfile.mkdtemp(prefix=f"{self.prefix}-{self.run_id}-")
        net = self._free_subnet()
        self.subnet = str(net)
        self._add_ns(self.switch_ns)
        sh("ip", "-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch_ns, "link", "set", "br0", "up")
        for i in range(self.num_hosts):
            host = Host(i, f"{self.prefix}-{self.run_id}-h{i}",
                        f"{self.prefix}{self.run_id}h{i}",
                        str(net.network_address + i + 1), f"h{i}")
            self._add_ns(host.namespace)
            sh("ip", "link", "add", NIC, "netns", host.namespace, "type", "veth",
               "peer", "name", host.switch_port, "netns", self.switch_ns)
            sh("ip", "-n", self.switch_ns, "link", "set", host.switch_port, "master", "br0")
            sh("ip", "-n", self.switch_ns, "link", "set", host.switch_port, "up")
            sh("ip", "-n", host.namespace, "link", "set", "lo", "up")
            sh("ip", "-n", host.namespace, "addr", "add", f"{host.address}/{net.prefixlen}",
               "dev", NIC)
            sh("ip", "-n", host.namespace, "link", "set", NIC, "up")
            self.hosts.append(host)
        for host in self.hosts:
            etc = os.path.join("/etc/netns", host.namespace)
            os.makedirs(etc, exist_ok=False)
            self._created_etc.append(etc)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(self.hosts_file(host))
        self.shape(self.rate_bps, self.delay_ms)

    def destroy(self) -> None:
        """Stop every launch, kill what runs in the namespaces, remove everything created
        (signals held off meanwhile, so that a second Ctrl-C cannot cut the cleanup short)."""
        held = ({s: signal.signal(s, signal.SIG_IGN)
                 for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
                if threading.current_thread() is threading.main_thread() else {})
        try:
            for launch in list(self._launches):
                launch.kill()
            for ns in self._created_ns:
                kill_netns_processes(ns)
            for ns in reversed(self._created_ns):
                sh("ip", "netns", "del", ns, check=False)  # takes its links along
            self._created_ns = []
            for etc in self._created_etc:
                shutil.rmtree(etc, ignore_errors=True)
            self._created_etc = []
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp = None
            for host in self.hosts:  # Open MPI's session dirs, left by killed daemons
                for path in glob.glob(os.path.join(tempfile.gettempdir(),
                                                   f"ompi.{host.hostname}.*")):
                    shutil.rmtree(path, ignore_errors=True)
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers = {}

    def _add_ns(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self._created_ns.append(ns)

    def _free_subnet(self) -> ipaddress.IPv4Network:
        """A /24 under 10.214/16 that no route or address of this machine (nor of another live
        run's namespaces) overlaps, starting from one derived from the pid."""
        used = []
        text = sh("ip", "-o", "-4", "addr", "show", check=False).stdout
        text += sh("ip", "-4", "route", "show", "table", "all", check=False).stdout
        for ns in sh("ip", "netns", "list", check=False).stdout.split("\n"):
            name = ns.split(" ")[0]
            if name.startswith((PREFIX + "-", self.prefix + "-")):
                text += sh("ip", "-n", name, "-o", "-4", "addr", "show", check=False).stdout
        for token in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", text):
            try:
                used.append(ipaddress.ip_network(token, strict=False))
            except ValueError:
                pass
        start = os.getpid() % 250
        for k in range(250):
            net = ipaddress.ip_network("{}.{}.{}.0/24".format(*SUBNET_BASE, (start + k) % 250))
            if not any(net.overlaps(u) and u.prefixlen > 0 for u in used):
                return net
        raise RuntimeError("no free 10.214.x.0/24 subnet")

    def hosts_file(self, host: Host) -> str:
        """``/etc/hosts`` of ``host``: its own name as asked, the others' at their addresses."""
        lines = ["127.0.0.1 localhost"]
        if self.hostname_resolves_to == "127.0.0.1":
            lines = [f"127.0.0.1 localhost {host.hostname}"]
        elif self.hostname_resolves_to == "127.0.1.1":
            lines.append(f"127.0.1.1 {host.hostname}")
        for other in self.hosts:
            if other is not host or self.hostname_resolves_to == "own":
                lines.append(f"{other.address} {other.hostname}")
        return "\n".join(lines) + "\n"

    def spare_address(self) -> str:
        """An address in the hosts' subnet that no host has (a peer that never answers)."""
        return str(ipaddress.ip_network(self.subnet).network_address + 254)

    # -- shaping and counters --
    def shape(self, rate: str | float | None, delay_ms: float = 0.0) -> dict:
        """(Re)shape every host's NIC both ways: ``tbf`` at ``rate`` on both veth ends' egress
        (burst: 1 ms of traffic, at least 64 KiB; queue up to 20 ms), under a netem delay on the
        host's end where the kernel has netem. None: no shaping. Returns :attr:`shaping`."""
        rate_bps = parse_rate(rate) if isinstance(rate, str) else rate
        burst = max(64 * 1024, int(rate_bps / 8 / 1000)) if rate_bps else None
        delay_applied, note = False, ""
        for host in self.hosts:
            for ns, dev, is_host_end in ((host.namespace, NIC, True),
                                         (self.switch_ns, host.switch_port, False)):
                sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
                if not rate_bps:
                    continue
                tbf = ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst),
                       "latency", "20ms"]
                if delay_ms > 0 and is_host_end:
                    res = sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                             "netem", "delay", f"{delay_ms}ms", "limit", "100000", check=False)
                    if res.returncode == 0:
                        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1",
                           "handle", "10:", *tbf)
                        delay_applied = True
                        continue
                    note = (f"netem is not available in this kernel ({res.stderr.strip()}): no "
                            "delay added, only the veth's own latency")
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf)
        self.rate_bps, self.delay_ms = rate_bps, delay_ms
        qdisc = sh("tc", "-n", self.hosts[0].namespace, "qdisc", "show", "dev",
                   NIC).stdout.strip() if self.hosts else ""
        self.shaping = {"rate_bps": rate_bps, "burst_bytes": burst, "both_ways": True,
                        "delay_ms_requested": delay_ms, "delay_applied": delay_applied,
                        "delay_note": note, "qdisc": qdisc}
        return self.shaping

    def nic_bytes(self) -> list[dict[str, int]]:
        """Every host's NIC counters, read inside its namespace: ``[{"tx_bytes", "rx_bytes"}]``
        in host order. Bytes that crossed between hosts = the sum of the hosts' ``tx_bytes``."""
        out = []
        for host in self.hosts:
            res = sh("ip", "netns", "exec", host.namespace, "cat",
                     f"/sys/class/net/{NIC}/statistics/tx_bytes",
                     f"/sys/class/net/{NIC}/statistics/rx_bytes")
            tx, rx = (int(v) for v in res.stdout.split())
            out.append({"tx_bytes": tx, "rx_bytes": rx})
        return out

    def calibrate(self, seconds: float = 2.0, src: int = 0, dst: int = 1) -> dict:
        """One TCP stream host ``src`` -> ``dst`` for ``seconds`` (Gbit/s; the CPU time it took,
        both ends together, per byte, ns) and the median round trip of 1-byte messages (ms)."""
        script = os.path.join(self.tmp, "calib.py")
        with open(script, "w") as f:
            f.write(CALIB_SCRIPT)
        a, b = self.hosts[src], self.hosts[dst]
        srv = subprocess.Popen(["ip", "netns", "exec", b.namespace, sys.executable, script,
                                "server", b.address, str(seconds)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(0.5)
            cli = sh("ip", "netns", "exec", a.namespace, sys.executable, script, "client",
                     b.address, str(seconds), timeout=60 + seconds)
            out, _ = srv.communicate(timeout=60)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()
        res = json.loads(out.strip().splitlines()[-1])
        res.update(json.loads(cli.stdout.strip().splitlines()[-1]))
        return res

    # -- ranks --
    @property
    def size(self) -> int:
        return self.num_hosts * self.ranks_per_host

    def slots(self) -> list[Slot]:
        """Rank r on host r // K, local rank r % K (Horovod's host-major order)."""
        k, h = self.ranks_per_host, self.num_hosts
        return [Slot(r, h * k, r % k, k, r // k, h, self.hosts[r // k]) for r in range(h * k)]

    def in_host(self, host: Host, command: Sequence[str]) -> list[str]:
        """``command`` as run in ``host``: its network namespace (``/etc/hosts`` included) and a
        UTS namespace with its hostname."""
        return ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host.hostname, *command]

    def start(self, command: Sequence[str], controller: str = "gloo",
              env: Mapping[str, str] | None = None,
              rank_env: Callable[[Slot], Mapping[str, str]] | None = None,
              timeout: float | None = None, log_dir: str | None = None,
              failure_grace_s: float = 30.0) -> "Launch":
        """Start ``command`` as every rank (see the module doc).

        Args:
            command: the same argv for every rank.
            controller: "gloo" (Horovod's rendezvous) or "mpi" (``mpirun``).
            env: added to this process's environment for every rank.
            rank_env: per-rank additions (called with each rank's :class:`Slot`).
            timeout: seconds from the start until the ranks still running are stopped (their
                stacks dumped first); None: no deadline.
            log_dir: where ``rank<r>.out``/``.err`` go (default: a folder of the temp dir,
                removed with the cluster).
            failure_grace_s: once a rank failed, seconds the others get before they are stopped
                like at the deadline.

        Raises:
            ValueError: unknown controller.
        """
        if controller not in CONTROLLERS:
            raise ValueError(f"controller={controller!r}: one of {list(CONTROLLERS)}")
        if not self.hosts:
            raise RuntimeError("the cluster is not created (use it as a context manager)")
        if log_dir is None:
            log_dir = tempfile.mkdtemp(prefix="launch-", dir=self.tmp)
        os.makedirs(log_dir, exist_ok=True)
        base = dict(os.environ)
        base.update(env or {})
        base.update(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        base[NIC_ENV] = NIC
        launch = Launch(self, controller, log_dir, timeout, failure_grace_s)
        self._launches.append(launch)
        try:
            if controller == "gloo":
                launch._start_gloo(list(command), base, rank_env)
            else:
                launch._start_mpi(list(command), base, rank_env)
        except BaseException:
            launch.kill()
            raise
        return launch

    def run(self, command: Sequence[str], controller: str = "gloo", **kw) -> "LaunchResult":
        """:meth:`start` and wait for every rank (or the deadline)."""
        return self.start(command, controller, **kw).wait()


@dataclasses.dataclass
class LaunchResult:
    """How a launch ended: ``returncodes[r]`` (negative: killed by that signal), whether the
    deadline (or a failed peer's grace) stopped it and which ranks were still running then,
    wall seconds, and each rank's captured output."""
    controller: str
    returncodes: list
    timed_out: bool
    stopped_ranks: list
    wall_s: float
    log_dir: str
    launcher_log: str | None = None

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.returncodes)

    def stdout(self, rank: int) -> str:
        return _read(os.path.join(self.log_dir, f"rank{rank}.out"))

    def stderr(self, rank: int) -> str:
        return _read(os.path.join(self.log_dir, f"rank{rank}.err"))

    def report(self, tail: int = 3000) -> str:
        """Return codes and the tail of every rank's stderr (for assertion messages)."""
        lines = [f"{self.controller}: returncodes {self.returncodes}, timed out "
                 f"{self.timed_out} (stopped ranks {self.stopped_ranks}), {self.wall_s:.1f} s"]
        if self.launcher_log:
            lines.append(f"-- launcher --\n{_read(self.launcher_log)[-tail:]}")
        for r in range(len(self.returncodes)):
            lines.append(f"-- rank {r} stderr --\n{self.stderr(r)[-tail:]}")
        return "\n".join(lines)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


class Launch:
    """The ranks of one :meth:`EmulatedCluster.start`."""

    def __init__(self, cluster: EmulatedCluster, controller: str, log_dir: str,
                 timeout: float | None, failure_grace_s: float) -> None:
        self.cluster = cluster
        self.controller = controller
        self.log_dir = log_dir
        self.t0 = time.monotonic()
        self.deadline = None if timeout is None else self.t0 + timeout
        self.failure_grace_s = failure_grace_s
        self.ranks: list[subprocess.Popen] = []  # gloo: one per rank
        self.mpirun: subprocess.Popen | None = None
        self.server: subprocess.Popen | None = None
        self.launcher_log: str | None = None
        self._result: LaunchResult | None = None
        self._failed_at: float | None = None
        self._files: list = []

    def _open(self, name: str):
        f = open(os.path.join(self.log_dir, name), "w")
        self._files.append(f)
        return f

    def _start_gloo(self, command: list[str], base: dict, rank_env) -> None:
        host0 = self.cluster.hosts[0]
        plan = os.path.join(self.log_dir, "rendezvous.json")
        with open(plan, "w") as f:
            json.dump([dataclasses.asdict(s) | {"host": s.host.hostname}
                       for s in self.cluster.slots()], f)
        self.launcher_log = os.path.join(self.log_dir, "rendezvous.log")
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", host0.namespace, sys.executable, os.path.abspath(__file__),
             "--rendezvous", plan], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._open("rendezvous.log"), text=True, start_new_session=True)
        line = self.server.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the rendezvous server did not start: {line!r} "
                               f"{_read(self.launcher_log)[-2000:]}")
        port = line.strip()
        for slot in self.cluster.slots():
            env = dict(base, HOROVOD_HOSTNAME=slot.host.hostname, HOROVOD_RANK=str(slot.rank),
                       HOROVOD_SIZE=str(slot.size), HOROVOD_LOCAL_RANK=str(slot.local_rank),
                       HOROVOD_LOCAL_SIZE=str(slot.local_size),
                       HOROVOD_CROSS_RANK=str(slot.cross_rank),
                       HOROVOD_CROSS_SIZE=str(slot.cross_size),
                       HOROVOD_GLOO_RENDEZVOUS_ADDR=host0.address,
                       HOROVOD_GLOO_RENDEZVOUS_PORT=port, HOROVOD_CONTROLLER="gloo",
                       HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE=NIC,
                       NCCL_SOCKET_IFNAME=NIC)
            env.update(rank_env(slot) if rank_env else {})
            self.ranks.append(subprocess.Popen(
                self.cluster.in_host(slot.host, command), env=env,
                stdout=self._open(f"rank{slot.rank}.out"),
                stderr=self._open(f"rank{slot.rank}.err"), stdin=subprocess.DEVNULL,
                start_new_session=True))

    def _start_mpi(self, command: list[str], base: dict, rank_env) -> None:
        cluster = self.cluster
        agent = os.path.join(self.log_dir, "netns_agent.sh")
        with open(agent, "w") as f:
            f.write("#!/bin/sh\n# Open MPI rsh agent: start the daemon in the namespace (and "
                    "hostname) of the host owning the address\n"
                    "while [ \"${1#-}\" != \"$1\" ]; do shift; done\nhost=$1; shift\n"
                    "case \"$host\" in\n")
            for h in cluster.hosts:
                f.write(f"  {h.address}) ns={h.namespace}; hn={h.hostname} ;;\n")
            f.write("  *) echo \"netns_agent: unknown host $host\" >&2; exit 1 ;;\nesac\n"
                    "exec ip netns exec \"$ns\" unshare --uts sh -c \"hostname $hn && $*\"\n")
        os.chmod(agent, 0o755)
        for slot in cluster.slots():  # sourced by the rank wrapper below
            with open(os.path.join(self.log_dir, f"env.{slot.rank}"), "w") as f:
                for k, v in (rank_env(slot) if rank_env else {}).items():
                    f.write(f"export {k}={shlex.quote(str(v))}\n")
        # per rank: its environment additions, its output files, its exit status
        wrapper = ('d="$0"; r=$OMPI_COMM_WORLD_RANK; . "$d/env.$r" || exit 1; '
                   '"$@" >"$d/rank$r.out" 2>"$d/rank$r.err"; c=$?; echo $c >"$d/rc.$r"; '
                   'exit $c')
        slots = ",".join(f"{h.address}:{cluster.ranks_per_host}" for h in cluster.hosts)
        cmd = ["mpirun", "--allow-run-as-root", "-np", str(cluster.size), "-H", slots,
               "--bind-to", "none",
               "--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1",
               "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", cluster.subnet,
               "--mca", "oob_tcp_if_include", cluster.subnet,
               "sh", "-c", wrapper, self.log_dir, *command]
        self.launcher_log = os.path.join(self.log_dir, "mpirun.log")
        log = self._open("mpirun.log")
        self.mpirun = subprocess.Popen(cluster.in_host(cluster.hosts[0], cmd), env=base,
                                       stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)

    # -- waiting and stopping --
    def returncodes(self) -> list:
        """Each rank's return code so far (None: running). Under MPI, a rank that left no
        status when ``mpirun`` ended gets ``mpirun``'s."""
        if self.controller == "gloo":
            return [p.poll() for p in self.ranks]
        launcher = self.mpirun.poll()
        codes = []
        for r in range(self.cluster.size):
            text = _read(os.path.join(self.log_dir, f"rc.{r}")).strip()
            codes.append(int(text) if text.lstrip("-").isdigit() else launcher)
        return codes

    def poll(self) -> LaunchResult | None:
        """The result once every rank ended (stopping them at the deadline, or
        ``failure_grace_s`` after a rank failed); None while they run."""
        if self._result is not None:
            return self._result
        codes = self.returncodes()
        now = time.monotonic()
        if all(c is not None for c in codes):
            return self._finish(codes, False, [])
        failed = [c for c in codes if c not in (None, 0)]
        if failed and self._failed_at is None:
            self._failed_at = now
        over = self.deadline is not None and now > self.deadline
        grace_over = failed and now - self._failed_at > self.failure_grace_s
        if over or grace_over:
            running = [r for r, c in enumerate(codes) if c is None]
            self._dump_and_kill()
            return self._finish(self.returncodes(), True, running)
        return None

    def wait(self, poll_s: float = 0.2) -> LaunchResult:
        while True:
            res = self.poll()
            if res is not None:
                return res
            time.sleep(poll_s)

    def kill(self) -> None:
        """Stop every rank now (stacks dumped first) and release the launch."""
        if self._result is None:
            running = [r for r, c in enumerate(self.returncodes()) if c is None]
            self._dump_and_kill()
            self._finish(self.returncodes(), bool(running), running)

    def _rank_pids(self) -> list[int]:
        """The Python processes of the ranks (in the hosts' namespaces, rendezvous excluded)."""
        skip = {self.server.pid} if self.server else set()
        pids = []
        for host in self.cluster.hosts:
            for pid in netns_pids(host.namespace):
                try:
                    exe = os.readlink(f"/proc/{pid}/exe")
                except OSError:
                    continue
                if pid not in skip and "python" in os.path.basename(exe):
                    pids.append(pid)
        return pids

    def _dump_and_kill(self) -> None:
        """SIGABRT the ranks' Python processes (faulthandler writes every thread's stack to
        their stderr), then kill the launch's process groups and whatever else runs in the
        hosts' namespaces."""
        pids = self._rank_pids()
        _signal_all(pids, signal.SIGABRT)
        end = time.monotonic() + STACK_DUMP_S
        while time.monotonic() < end and any(pid_alive(p) and not _zombie(p) for p in pids):
            time.sleep(0.1)
        procs = self.ranks + [p for p in (self.mpirun,) if p is not None]
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for host in self.cluster.hosts:
            _signal_all([p for p in netns_pids(host.namespace)
                         if not self.server or p != self.server.pid], signal.SIGKILL)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def _finish(self, codes: list, timed_out: bool, stopped: list) -> LaunchResult:
        if self.server is not None and self.server.poll() is None:
            try:
                self.server.stdin.close()
                self.server.wait(5)
            except (subprocess.TimeoutExpired, OSError):
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        for f in self._files:
            f.close()
        if self in self.cluster._launches:
            self.cluster._launches.remove(self)
        self._result = LaunchResult(self.controller, codes, timed_out, stopped,
                                    time.monotonic() - self.t0, self.log_dir, self.launcher_log)
        return self._result


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


CALIB_SCRIPT = r'''
import json, os, socket, sys, time
role, addr, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
if role == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 5199)); s.listen(2)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(200):
        c.sendall(c.recv(1))
    c.close()
    c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        if t0 is None:
            t0 = time.perf_counter()
        n += k
    dt = time.perf_counter() - t0
    print(json.dumps({"tcp_gbit_s": n * 8 / dt / 1e9, "tcp_bytes": n}))
else:
    c = socket.create_connection((addr, 5199))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(200):
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
    c.close()
    time.sleep(0.2)
    def busy_s():  # every core's busy time: both ends of the stream run on this machine
        with open("/proc/stat") as f:  # user nice system idle iowait irq softirq steal ...
            t = [int(v) for v in f.readline().split()[1:8]]
        return (sum(t) - t[3] - t[4]) / os.sysconf("SC_CLK_TCK")
    c = socket.create_connection((addr, 5199)); b = bytes(1 << 20); n = 0
    cpu = busy_s(); t = time.perf_counter()
    while time.perf_counter() - t < secs:
        c.sendall(b); n += len(b)
    cpu = busy_s() - cpu
    c.close()
    rtts.sort()
    print(json.dumps({"tcp_rtt_ms_median": rtts[len(rtts) // 2] * 1e3,
                      "tcp_cpu_ns_per_byte": cpu / n * 1e9}))
'''


def cleanup_leftovers(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces, ``/etc/netns`` entries, temp dirs and Open MPI session dirs of
    earlier runs whose process is gone (names ``<prefix>-<pid>-*``, ``ompi.<prefix><pid>h*``;
    prefix ``hqem`` unless given); returns what was removed."""
    removed = []
    pat = re.compile(rf"^{prefix}-(\d+)-(?:sw|h\d+)$")
    names = [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout
             .splitlines() if line.split()]
    dead = [n for n in names if pat.match(n) and not pid_alive(int(pat.match(n).group(1)))]
    for name in dead:
        kill_netns_processes(name)
    for name in sorted(dead, key=lambda n: n.endswith("-sw")):  # hosts first
        sh("ip", "netns", "del", name, check=False)
        removed.append(f"netns {name}")
    if os.path.isdir("/etc/netns"):
        for name in os.listdir("/etc/netns"):
            m = pat.match(name)
            if m and not pid_alive(int(m.group(1))):
                shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
                removed.append(f"dir /etc/netns/{name}")
    tpat = re.compile(rf"^(?:{prefix}-|ompi\.{prefix})(\d+)[-h]")
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        m = tpat.match(name)
        if m and not pid_alive(int(m.group(1))) and os.path.isdir(os.path.join(tmp, name)):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            removed.append(f"dir {os.path.join(tmp, name)}")
    return removed


def _serve_rendezvous(plan_path: str) -> None:
    """Horovod's rendezvous server for the slots of ``plan_path``; prints its port, serves
    until stdin closes."""
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer

    with open(plan_path) as f:
        slots = json.load(f)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init([SlotInfo(hostname=s["host"], rank=s["rank"], local_rank=s["local_rank"],
                          cross_rank=s["cross_rank"], size=s["size"],
                          local_size=s["local_size"], cross_size=s["cross_size"])
                 for s in slots])
    print(port, flush=True)
    sys.stdin.read()
    server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cleanup", action="store_true",
                    help="remove leftovers of killed runs (their pid no longer runs) and exit")
    ap.add_argument("--rendezvous", metavar="PLAN", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rendezvous:
        _serve_rendezvous(args.rendezvous)
        return 0
    if args.cleanup:
        if os.geteuid() != 0:
            print("--cleanup needs root", file=sys.stderr)
            return 2
        removed = cleanup_leftovers()
        print("\n".join(removed) if removed else "nothing to clean up")
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
