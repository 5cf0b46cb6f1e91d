#!/usr/bin/env python3
"""Two containers of the CPU image as two hosts on an emulated network, the "Docker images on
clusters" path end to end:

    sudo python3 scripts/image_two_hosts.py                  # as `make image-two-hosts`

Each container runs in its own network namespace of benchmarks/emulator.py's emulated cluster
(names ``hqimg-<pid>-*``; one NIC, eth0, on a bridge; its own hostname, and both names in its
/etc/hosts) and starts the image's sshd (port 12345). A key pair made for this run only is
mounted read-only as /root/.ssh in both. Then, in the first container,
``horovodrun -np 2 -H <host0>:1,<host1>:1 --<controller>`` starts one rank per container over
ssh and runs tests/parallel/compressed_training.py with a codec, which ends with the ranks
comparing their weights. Everything made (containers, namespaces, keys) is removed at the end,
also on failure. Needs root, buildah (containers run with ``buildah run --isolation chroot``),
``ip`` and ``unshare``. Exit status 0 when every controller's run passed.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from emulator import EmulatedCluster, cleanup_leftovers  # noqa: E402

#: names of this tool's namespaces, hostnames and temp dirs (the benchmarks' are ``hqem``)
PREFIX = "hqimg"
SSH_PORT = 12345  # the images' sshd and ssh client (docker/Dockerfile.cpu)
WORKDIR = "/opt/horovod_quant"


def log(msg: str) -> None:
    print(f"[two-hosts] {msg}", flush=True)


def buildah(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["buildah", *args], check=True, capture_output=True, text=True, **kw)


def wait_for_port(cluster: EmulatedCluster, host, address: str, timeout: float = 60.0) -> None:
    """Until ``address:SSH_PORT`` accepts a TCP connection, tried from inside ``host``."""
    probe = (f"import socket; socket.create_connection(('{address}', {SSH_PORT}), 2).close()")
    deadline = time.time() + timeout
    while time.time() < deadline:
        cmd = ["ip", "netns", "exec", host.namespace, sys.executable, "-c", probe]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"sshd on {address}:{SSH_PORT} did not answer within {timeout:.0f}s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="horovod_quant:cpu")
    ap.add_argument("--codec", default="qsgd", help="a hq.Compression attribute")
    ap.add_argument("--controllers", default="gloo,mpi", help="comma-separated: gloo, mpi")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per horovodrun")
    args = ap.parse_args(argv)
    controllers = [c for c in args.controllers.split(",") if c]

    for item in cleanup_leftovers(PREFIX):
        log(f"removed leftover of a killed run: {item}")
    containers: list[str] = []
    sshd: list[subprocess.Popen] = []
    results: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="hq-two-hosts-") as keys, \
            EmulatedCluster(hosts=2, ranks_per_host=1, prefix=PREFIX) as cluster:
        try:
            key = Path(keys) / "id_ed25519"
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hq-two-hosts",
                            "-f", str(key)], check=True)
            (Path(keys) / "authorized_keys").write_text((Path(keys) / "id_ed25519.pub").read_text())
            for p in Path(keys).iterdir():
                p.chmod(0o600)
            Path(keys).chmod(0o700)
            add_hosts = [f"--add-host={h.hostname}:{h.address}" for h in cluster.hosts]
            for host in cluster.hosts:
                name = f"hq-two-hosts-{cluster.run_id}-h{host.index}"
                containers.append(buildah("from", "--name", name, *add_hosts, args.image)
                                  .stdout.strip())
                log(f"{host.hostname} = container {name} in namespace {host.namespace}, "
                    f"eth0 {host.address}")

            def in_container(index: int, command: str) -> list[str]:
                host = cluster.hosts[index]
                return cluster.in_host(host, [
                    "buildah", "run", "--isolation", "chroot", f"--hostname={host.hostname}",
                    f"--volume={keys}:/root/.ssh:ro", containers[index], "--",
                    "bash", "-c", command])

            for i, host in enumerate(cluster.hosts):
                # host keys made at start: none are baked into the image
                sshd.append(subprocess.Popen(in_container(
                    i, "ssh-keygen -A >/dev/null && exec /usr/sbin/sshd -D -e")))
            for host in cluster.hosts:
                wait_for_port(cluster, cluster.hosts[0], host.address)
            hosts = ",".join(f"{h.hostname}:1" for h in cluster.hosts)
            for controller in controllers:
                job = (f"cd {WORKDIR} && horovodrun -np 2 -H {hosts} -p {SSH_PORT} "
                       f"--{controller} python3 tests/parallel/compressed_training.py "
                       f"--codec {shlex.quote(args.codec)} --steps {args.steps}")
                log(f"in {cluster.hosts[0].hostname}: {job}")
                t = time.time()
                proc = subprocess.run(in_container(0, job), timeout=args.timeout)
                results[controller] = proc.returncode
                log(f"{controller}: exit {proc.returncode} in {time.time() - t:.0f}s")
        finally:
            # sshd stopped from inside its container, by the pid it wrote
            for i, proc in enumerate(sshd):
                subprocess.run(in_container(i, "kill $(cat /run/sshd.pid)"), capture_output=True)
            for proc in sshd:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            # the cluster's exit kills whatever is left in the namespaces; the containers go here
            for name in containers:
                subprocess.run(["buildah", "rm", name], capture_output=True)
    for controller in controllers:
        log(f"{controller}: {'PASS' if results.get(controller) == 0 else 'FAIL'}")
    return 0 if results and all(results.get(c) == 0 for c in controllers) else 1


if __name__ == "__main__":
    sys.exit(main())
