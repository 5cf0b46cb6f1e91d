"""Start the two ranks of ``benchmarks/cluster.py --controller gloo`` (run inside host a).

    ip netns exec <ns a> python3 cluster_gloo_launch.py --hosts NS_A=ADDR_A,NS_B=ADDR_B \
        -- python3 cluster_workloads.py --plan ... --out ...

What ``horovodrun --gloo`` does for real hosts, for two network namespaces: a Horovod
rendezvous server in host a, then one rank per namespace with Horovod's gloo environment. Each
rank runs in its own UTS namespace whose hostname resolves, through ``/etc/netns/<ns>/hosts``
(which ``ip netns exec`` mounts over ``/etc/hosts``; cluster.py writes it), to the address of
its namespace. That matters because Horovod 0.28.1 creates the gloo devices of its process-set
contexts from the hostname, not from ``HOROVOD_GLOO_IFACE`` (``gloo_context.cc``,
``InitializeForProcessSet``): without it both ranks advertise 127.0.0.1 and never connect.
Exits with the first failing rank's status after terminating the other one.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.http.http_server import RendezvousServer


def hostname_of(ns: str) -> str:
    """The hostname rank processes of namespace ``ns`` run under (see module doc)."""
    return f"{ns}-host"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", required=True, help="NS=ADDR,NS=ADDR, rank order")
    ap.add_argument("--iface", required=True, help="IFACE_A,IFACE_B")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    hosts = [h.split("=") for h in args.hosts.split(",")]
    ifaces = args.iface.split(",")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    n = len(hosts)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init([SlotInfo(hostname=hostname_of(ns), rank=r, local_rank=0, cross_rank=r, size=n,
                          local_size=1, cross_size=n) for r, (ns, _) in enumerate(hosts)])
    procs = []
    try:
        for r, (ns, _) in enumerate(hosts):
            env = dict(os.environ, HOROVOD_HOSTNAME=hostname_of(ns), HOROVOD_RANK=str(r),
                       HOROVOD_SIZE=str(n), HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="1",
                       HOROVOD_CROSS_RANK=str(r), HOROVOD_CROSS_SIZE=str(n),
                       HOROVOD_GLOO_RENDEZVOUS_ADDR=hosts[0][1],
                       HOROVOD_GLOO_RENDEZVOUS_PORT=str(port), HOROVOD_CONTROLLER="gloo",
                       HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE=ifaces[r])
            inner = f"hostname {shlex.quote(hostname_of(ns))} && exec {shlex.join(command)}"
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts",
                                           "sh", "-c", inner], env=env))
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
