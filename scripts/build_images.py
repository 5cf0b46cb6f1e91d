#!/usr/bin/env python3
"""Builds the Docker images (docker/Dockerfile.cpu, docker/Dockerfile.gpu) with whatever builder
is present: docker (with a daemon), podman or buildah.

    python3 scripts/build_images.py                    # CPU image, as `make images`
    python3 scripts/build_images.py --images cpu,gpu --no-tensorflow

Base image: ``python:3.11-slim-bookworm`` (CPU) and ``nvidia/cuda:13.0.0-cudnn-devel-ubuntu22.04``
(GPU) where their registry answers; otherwise a Debian 12 base built here (``debootstrap
--variant=minbase bookworm`` + docker/Dockerfile.debian-base), which both Dockerfiles take
through ``BASE_IMAGE``: the GPU image needs no CUDA base (its CUDA comes as pip wheels).

Behind a proxy with its own CA (podman, buildah): the host's effective pip configuration
(``pip config list``) is written to a pip.conf under --work, and it, the CA bundle it names and
the local paths it names (find-links folders, the folders holding ``file://`` indexes,
constraint files) are mounted read-only into every RUN step (``--no-host-pip``: none); nothing
of them is copied into an image. When the PyTorch CPU index does not answer, torch is asked
for as ``torch==<version>+cpu``, so pip takes a CPU wheel from those sources or fails, never
the CUDA build from PyPI. docker build has no RUN-time mounts: with docker, pip inside the
build must reach its index by itself.

Caches shared with the build (podman, buildah; folders mounted read-write into RUN steps):
``--horovod-wheels`` (Horovod wheels by build key: installed instead of compiled) and
``--cuda-wheels`` (the GPU image's torch, CuPy and nvidia-* wheels, GBs: not downloaded again).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the base each Dockerfile names by default, used where its registry answers
OFFICIAL_BASE = {"cpu": "docker.io/library/python:3.11-slim-bookworm",
                 "gpu": "docker.io/nvidia/cuda:13.0.0-cudnn-devel-ubuntu22.04"}
DEBIAN_BASE = "localhost/horovod_quant-base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
REGISTRY_PROBE = "https://registry-1.docker.io/v2/"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu/torch/"
#: where the host's pip configuration and CA bundle appear inside a RUN step (read-only)
PIP_CONF_IN_BUILD = "/etc/pip.conf"
CA_IN_BUILD = "/run/hq-build-ca.pem"
#: where --horovod-wheels and --cuda-wheels appear inside a RUN step (read-write: what a build
#: compiles or downloads is left there)
WHEELS_IN_BUILD = "/run/hq-horovod-wheels"
CUDA_WHEELS_IN_BUILD = "/run/hq-cuda-wheels"
READ_WRITE_IN_BUILD = (WHEELS_IN_BUILD, CUDA_WHEELS_IN_BUILD)
DEFAULT_WORK = Path("/var/tmp/horovod_quant-images")


def log(msg: str) -> None:
    print(f"[images] {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log("$ " + shlex.join(cmd))
    return subprocess.run(cmd, check=True, **kw)


def answers(url: str, cafile: str | None, timeout: float = 10.0) -> bool:
    """True when ``url`` gives any HTTP answer (a 401 from a registry counts)."""
    ctx = ssl.create_default_context(cafile=cafile)
    try:
        urllib.request.urlopen(url, timeout=timeout, context=ctx)
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False
    return True


class Builder:
    """The build tool: its name and the commands that differ between docker, podman, buildah."""

    def __init__(self, name: str, storage_driver: str | None):
        self.name = name
        self.global_args = [f"--storage-driver={storage_driver}"] if storage_driver else []
        if storage_driver and name == "docker":
            raise SystemExit("--storage-driver is for podman and buildah; "
                             "configure dockerd instead")

    @classmethod
    def detect(cls, wanted: str, storage_driver: str | None) -> "Builder":
        order = [wanted] if wanted != "auto" else ["docker", "podman", "buildah"]
        for name in order:
            if not shutil.which(name):
                continue
            if name == "docker" and subprocess.run(
                    ["docker", "info"], capture_output=True).returncode != 0:
                log("docker: client present, no daemon answers; trying the next builder")
                continue
            return cls(name, storage_driver)
        raise SystemExit(f"no usable builder among {order}: install podman or buildah "
                         "(apt-get install buildah), or start dockerd")

    def base_cmd(self) -> list[str]:
        return [self.name, *self.global_args]

    def exists(self, image: str) -> bool:
        cmd = {"docker": ["docker", "image", "inspect", image],
               "podman": [*self.base_cmd(), "image", "exists", image],
               "buildah": [*self.base_cmd(), "inspect", "--type", "image", image]}[self.name]
        return subprocess.run(cmd, capture_output=True).returncode == 0

    def pull(self, image: str) -> bool:
        log(f"pulling {image}")
        return subprocess.run([*self.base_cmd(), "pull", image]).returncode == 0

    def build(self, dockerfile: Path, tag: str, context: Path, build_args: dict[str, str],
              mounts: list[tuple[str, str]]) -> None:
        cmd = [*self.base_cmd(), "build" if self.name != "buildah" else "bud",
               "-f", str(dockerfile), "-t", tag]
        if self.name != "docker":
            # docker format: OCI image configs have no SHELL, and the Dockerfiles set one
            cmd += ["--format", "docker", "--isolation", "chroot", "--network", "host",
                    "--layers"]
            cmd += [f"--volume={src}:{dst}" + ("" if dst in READ_WRITE_IN_BUILD else ":ro")
                    for src, dst in mounts]
        elif mounts:
            raise SystemExit("docker build cannot mount host folders into RUN steps (the host's "
                             "pip configuration, --horovod-wheels, --cuda-wheels): use "
                             "--no-host-pip (pip must reach its index by itself) without the "
                             "wheel caches, or --tool podman/buildah")
        for key, value in build_args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        t = time.time()
        run([*cmd, str(context)])
        log(f"built {tag} in {time.time() - t:.0f}s")


# -- host pip configuration ------------------------------------------------------------------
def host_pip_config(python: str) -> dict[str, dict[str, str]]:
    """The host's effective pip settings, by section (environment variables as [global])."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=True).stdout
    conf: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        section = "global" if section in (":env:", "") else section
        conf.setdefault(section, {})[name] = value.strip().strip("'\"")
    return conf


def pip_mounts(conf: dict[str, dict[str, str]], ca_bundle: str | None,
               work: Path) -> list[tuple[str, str]]:
    """Writes the build's pip.conf under ``work``; returns (host path, build path) mounts."""
    mounts: list[tuple[str, str]] = []
    seen: set[str] = set()

    def mount_same(path: str) -> None:
        if path in seen or not os.path.exists(path):
            return
        seen.add(path)
        mounts.append((path, path))

    lines = []
    for section, values in conf.items():
        lines.append(f"[{section}]")
        for name, value in values.items():
            if name == "cert":
                continue  # replaced below by the mounted bundle
            if name in ("find-links", "index-url", "extra-index-url", "constraint",
                        "requirement"):
                for item in value.split():
                    if item.startswith("file://"):  # a local index links to files beside it
                        mount_same(os.path.dirname(item[len("file://"):].rstrip("/")))
                    elif "://" not in item:
                        mount_same(item)
            lines.append(f"{name} = {value}")
    ca = ca_bundle or conf.get("global", {}).get("cert")
    if ca:
        if "[global]" not in lines:
            lines.insert(0, "[global]")
        lines.insert(lines.index("[global]") + 1, f"cert = {CA_IN_BUILD}")
        mounts.append((os.path.realpath(ca), CA_IN_BUILD))
    work.mkdir(parents=True, exist_ok=True)
    pip_conf = work / "pip.conf"
    pip_conf.write_text("\n".join(lines) + "\n")
    mounts.insert(0, (str(pip_conf), PIP_CONF_IN_BUILD))
    return mounts


# -- base images -----------------------------------------------------------------------------
def debian_base(builder: Builder, work: Path, mirror: str, rebuild: bool) -> str:
    """The Debian 12 + Python base image, made with debootstrap unless it exists already."""
    if builder.exists(DEBIAN_BASE) and not rebuild:
        log(f"base: {DEBIAN_BASE} exists (--rebuild-base to make it again)")
        return DEBIAN_BASE
    if not shutil.which("debootstrap"):
        raise SystemExit("no registry and no debootstrap: apt-get install debootstrap")
    with tempfile.TemporaryDirectory(dir=work, prefix="debootstrap-") as tmp:
        rootfs, context = Path(tmp) / "rootfs", Path(tmp) / "context"
        context.mkdir()
        run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror],
            stdout=subprocess.DEVNULL)
        run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(context / "rootfs.tar"), "."])
        shutil.rmtree(rootfs)
        builder.build(ROOT / "docker/Dockerfile.debian-base", DEBIAN_BASE, context, {}, [])
    return DEBIAN_BASE


def choose_base(args, builder: Builder, cafile: str | None, image: str) -> str | None:
    """The image to build ``image`` (cpu, gpu) on, or None to keep the Dockerfile's default."""
    official = OFFICIAL_BASE[image]
    if args.base in ("auto", "official") and (
            builder.exists(official) or (answers(REGISTRY_PROBE, cafile)
                                         and builder.pull(official))):
        return None
    if args.base == "official":
        raise SystemExit(f"{official} is not here and cannot be pulled: use --base debian")
    log(f"base: {official} is not here and no registry gives it; using a Debian base built "
        "with debootstrap")
    return debian_base(builder, args.work, args.mirror, args.rebuild_base)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", default="cpu", help="comma-separated: cpu, gpu")
    ap.add_argument("--tool", default="auto", choices=("auto", "docker", "podman", "buildah"))
    ap.add_argument("--base", default="auto", choices=("auto", "official", "debian"),
                    help="base image: the Dockerfile's own (python:3.11-slim-bookworm, "
                    "nvidia/cuda), or the debootstrap Debian one; auto: the own one where it is "
                    "here or can be pulled")
    ap.add_argument("--tag", default="horovod_quant", help="image name; tags are :cpu and :gpu")
    ap.add_argument("--no-tensorflow", action="store_true",
                    help="HQ_WITH_TENSORFLOW=0: no TensorFlow, Horovod without TF ops")
    ap.add_argument("--no-host-pip", action="store_true",
                    help="do not mount the host's pip configuration into the build")
    ap.add_argument("--ca-bundle", help="CA bundle for pip in the build (default: the host "
                    "pip configuration's cert)")
    ap.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="passed on to every Dockerfile built (overrides what this script "
                    "sets)")
    ap.add_argument("--horovod-wheels", type=Path, metavar="DIR",
                    help="Horovod wheel cache shared with the build (scripts/install.sh's "
                    "HQ_WHEEL_DIR layout): a wheel with the image's build key is installed "
                    "instead of compiled; a new build is left there (podman, buildah)")
    ap.add_argument("--cuda-wheels", type=Path, metavar="DIR",
                    help="wheel cache of the GPU image's torch, CuPy and nvidia-* wheels "
                    "(scripts/install.sh's HQ_CUDA_WHEEL_DIR): what is there is not downloaded "
                    "again; what is downloaded is left there (podman, buildah)")
    ap.add_argument("--storage-driver", help="podman/buildah storage driver (e.g. vfs)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK,
                    help="scratch folder (pip.conf for the build, debootstrap root)")
    ap.add_argument("--mirror", default=DEBIAN_MIRROR, help="Debian mirror for debootstrap")
    ap.add_argument("--rebuild-base", action="store_true", help="debootstrap the base again")
    ap.add_argument("--python", default=sys.executable, help="host Python whose pip config "
                    "is used")
    args = ap.parse_args(argv)
    images = [i.strip() for i in args.images.split(",") if i.strip()]
    unknown = set(images) - {"cpu", "gpu"}
    if unknown:
        ap.error(f"unknown image(s) {sorted(unknown)}; choose from cpu, gpu")
    args.work.mkdir(parents=True, exist_ok=True)

    builder = Builder.detect(args.tool, args.storage_driver)
    log(f"builder: {builder.name}")
    conf = {} if args.no_host_pip else host_pip_config(args.python)
    cafile = args.ca_bundle or conf.get("global", {}).get("cert")
    mounts = [] if args.no_host_pip else pip_mounts(conf, args.ca_bundle, args.work)
    for src, dst in mounts:
        log(f"mount (read-only, RUN steps only): {src} -> {dst}")

    common: dict[str, str] = {}
    if args.horovod_wheels:
        args.horovod_wheels.mkdir(parents=True, exist_ok=True)
        mounts.append((str(args.horovod_wheels.resolve()), WHEELS_IN_BUILD))
        common["HQ_WHEEL_DIR"] = WHEELS_IN_BUILD
        log(f"mount (read-write, RUN steps only): {args.horovod_wheels} -> {WHEELS_IN_BUILD}")
    if args.no_tensorflow:
        common["HQ_WITH_TENSORFLOW"] = "0"
    extra = dict(a.split("=", 1) for a in args.build_arg)

    gpu_mounts: list[tuple[str, str]] = []
    if args.cuda_wheels:
        args.cuda_wheels.mkdir(parents=True, exist_ok=True)
        gpu_mounts.append((str(args.cuda_wheels.resolve()), CUDA_WHEELS_IN_BUILD))
        log(f"mount (read-write, RUN steps only, gpu): {args.cuda_wheels} -> "
            f"{CUDA_WHEELS_IN_BUILD}")

    for image in images:
        dockerfile = ROOT / f"docker/Dockerfile.{image}"
        build_args = dict(common)
        image_mounts = list(mounts)
        base = choose_base(args, builder, cafile, image)
        if base:
            build_args["BASE_IMAGE"] = base
        if image == "gpu" and gpu_mounts:
            build_args["HQ_CUDA_WHEEL_DIR"] = CUDA_WHEELS_IN_BUILD
            image_mounts += gpu_mounts
        if image == "cpu" and not answers(TORCH_CPU_INDEX, cafile):
            version = extra.get("TORCH_VERSION", "2.13.0")
            log(f"PyTorch CPU index does not answer: torch=={version}+cpu from pip's "
                "other sources")
            build_args |= {"HQ_TORCH_SPEC": f"torch=={version}+cpu", "HQ_TORCH_PIP_ARGS": ""}
        build_args |= extra
        builder.build(dockerfile, f"{args.tag}:{image}", ROOT, build_args, image_mounts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
