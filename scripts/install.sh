#!/usr/bin/env bash
# Sets up everything horovod_quant needs: system packages (Open MPI, CMake, a C++ compiler),
# Python packages (CPU torch, optional CPU TensorFlow, numba, mpi4py, test tools), Horovod built
# from source with the patches it needs for torch 2.x / TensorFlow 2.21 (see DEVELOPERS.md), and
# this project itself (editable).
#
# One idempotent script for CI, the Makefile and Docker images: it installs what is missing and
# skips what is there. The Horovod wheel is cached under $HQ_WHEEL_DIR, keyed by the Horovod,
# torch and TensorFlow versions (and, for a CUDA torch, its CUDA, the GPU operations and compute
# capabilities), so only the first run on a machine compiles it.
#
# GPU installs (docker/Dockerfile.gpu): a CUDA torch with HQ_CUDA_PIP_SPECS beside it (CuPy, the
# CUDA compiler as wheels), HOROVOD_GPU_OPERATIONS=NCCL for Horovod's GPU collectives, and
# HQ_CUDA_MAJOR to check that torch, CuPy and the compiler are of one CUDA.
#
# A CUDA build of torch already installed is kept (and the script says so): the CPU pin would
# replace the user's GPU torch. HQ_TORCH_SPEC given explicitly, or HQ_KEEP_CUDA_TORCH=0,
# installs the spec instead.
#
# Every setting below can be overridden from the environment (Docker build args set them).
set -euo pipefail

# ---- pinned versions ---------------------------------------------------------------------------
: "${HOROVOD_VERSION:=0.28.1}"
: "${TORCH_VERSION:=2.13.0}"
: "${NUMBA_VERSION:=0.68.1}"
: "${RUFF_VERSION:=0.17.6}"               # the linter: its rules change between releases
: "${TENSORFLOW_VERSION:=2.21.0}"
: "${TF_KERAS_VERSION:=${TENSORFLOW_VERSION}}"

# ---- switches ----------------------------------------------------------------------------------
: "${HQ_WITH_TENSORFLOW:=1}"            # 1: tensorflow-cpu + tf-keras, Horovod built with TF ops
# pip specs installed with torch, in the same pip run, so that their CUDA wheels are the ones
# torch pins: e.g. "cuda-toolkit[nvcc,cccl] cupy-cuda13x" (the compiler and CuPy of its CUDA)
: "${HQ_CUDA_PIP_SPECS:=}"
# a folder that keeps the wheels of torch and HQ_CUDA_PIP_SPECS (GBs of nvidia-* wheels): pip
# downloads into it what it lacks, then installs from it alone
: "${HQ_CUDA_WHEEL_DIR:=}"
# a folder made into a CUDA toolkit (nvcc, headers, libraries: CUDA_HOME) from those wheels
: "${HQ_CUDA_TOOLKIT_DIR:=}"
: "${HQ_CUDA_MAJOR:=}"                  # e.g. 13: fail unless torch, CuPy and nvcc are CUDA 13
: "${HQ_CACHE:=${HOME:-/root}/.cache/horovod_quant}"
: "${HQ_WHEEL_DIR:=${HQ_CACHE}/wheels}" # cached Horovod wheels, one folder per build key
HQ_TORCH_SPEC_GIVEN="${HQ_TORCH_SPEC:-}"  # set by the caller: installed whatever is there
: "${HQ_TORCH_SPEC:=torch==${TORCH_VERSION}}"
: "${HQ_KEEP_CUDA_TORCH:=1}"            # 1: a CUDA torch already installed stays (see above)
: "${HQ_TORCH_PIP_ARGS:=}"              # e.g. "--index-url https://download.pytorch.org/whl/cpu"
: "${HQ_TENSORFLOW_SPEC:=tensorflow-cpu==${TENSORFLOW_VERSION}}"
: "${HQ_SKIP_APT:=0}"                   # 1: never call apt-get (images that bring their own MPI)
: "${HQ_INSTALL_PROJECT:=1}"            # 0: stop after the dependencies
: "${HQ_EDITABLE:=1}"                   # 0: install the project as a regular package
: "${PYTHON:=python3}"
: "${HQ_INSTALL_STEPS:=apt python horovod project}"  # the steps to run, in this order

APT_PACKAGES=(openmpi-bin libopenmpi-dev cmake g++ make)
# `ip` and `tc` for the emulated hosts of tests/emulated and benchmarks/cluster.py
command -v ip >/dev/null || APT_PACKAGES+=(iproute2)
PY_PACKAGES=(
  "setuptools>=64" wheel build packaging cloudpickle psutil pyyaml   # build + Horovod runtime deps
  numpy "numba==${NUMBA_VERSION}" mpi4py
  pytest pytest-xdist hypothesis scikit-learn matplotlib tqdm "ruff==${RUFF_VERSION}"
)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
# The real interpreter, not a pyenv shim: later steps must not depend on PATH.
PYTHON="$("$PYTHON" -c 'import sys; print(sys.executable)')" || { echo "[install] ERROR: no $PYTHON" >&2; exit 1; }
PIP=("$PYTHON" -m pip)
# nproc honours OMP_NUM_THREADS, which the images set to 1: count the CPUs without it.
NPROC="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)"
T_START=$SECONDS

say() { printf '[install] %s\n' "$*"; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }
pip_quiet() {  # pip with the noise filtered out (root warning, local-index notes); keeps errors
  local rc
  set +e
  "${PIP[@]}" "$@" 2>&1 | grep -v -e "is ignored: it is neither" -e "Running pip as the 'root'" \
    -e "^Looking in" -e "^Processing "
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

# Prints the requirement specs (args) that the current environment does not satisfy.
missing_py() {
  "$PYTHON" - "$@" <<'PY'
import sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:  # packaging itself may be the missing piece
    from pip._vendor.packaging.requirements import Requirement
def satisfied(req, extras=()):
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return False
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return False
    for extra in extras:  # an extra is there when what it requires is
        for dep in map(Requirement, metadata.requires(req.name) or []):
            if dep.marker and dep.marker.evaluate({"extra": extra}) and \
                    not dep.marker.evaluate({"extra": ""}) and not satisfied(dep):
                return False
    return True

for spec in sys.argv[1:]:
    req = Requirement(spec)
    if not satisfied(req, sorted(req.extras)):
        print(spec)
PY
}

# ---- 1. system packages --------------------------------------------------------------------------
step_apt() {
  if [[ "$HQ_SKIP_APT" == 1 ]]; then say "apt: skipped (HQ_SKIP_APT=1)"; return; fi
  local missing=() p
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then say "apt: all present (${APT_PACKAGES[*]})"; return; fi
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install them yourself"
  local sudo=()
  if [[ "$(id -u)" != 0 ]]; then command -v sudo >/dev/null && sudo=(sudo) || die "need root for apt-get"; fi
  say "apt: installing ${missing[*]}"
  local t=$SECONDS
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  say "apt: done in $((SECONDS - t))s"
}

# ---- 2. Python packages --------------------------------------------------------------------------
# pip install of torch and HQ_CUDA_PIP_SPECS (args), with HQ_TORCH_PIP_ARGS; with
# HQ_CUDA_WHEEL_DIR through that folder: `pip download` leaves the whole set there (a file already
# there is not fetched again), then the install takes it from there alone
pip_install_torch_set() {
  # shellcheck disable=SC2086  # HQ_TORCH_PIP_ARGS is a word list on purpose
  if [[ -z "$HQ_CUDA_WHEEL_DIR" ]]; then pip_quiet install -q $HQ_TORCH_PIP_ARGS "$@"; return; fi
  mkdir -p "$HQ_CUDA_WHEEL_DIR"
  local t=$SECONDS
  # shellcheck disable=SC2086
  pip_quiet download -q -d "$HQ_CUDA_WHEEL_DIR" --find-links "$HQ_CUDA_WHEEL_DIR" \
    $HQ_TORCH_PIP_ARGS "$@"
  say "pip: $(du -sh "$HQ_CUDA_WHEEL_DIR" | cut -f1) of wheels in $HQ_CUDA_WHEEL_DIR," \
    "downloads done in $((SECONDS - t))s"
  pip_quiet install -q --no-index --find-links "$HQ_CUDA_WHEEL_DIR" "$@"
}

# Fails unless torch, CuPy and the CUDA compiler (the toolkit Horovod's build takes) are all of
# CUDA $HQ_CUDA_MAJOR: two CUDA runtimes in one process, or Horovod's kernels compiled for
# another CUDA than torch's, fail only at run time on a GPU.
check_cuda_major() {
  [[ -n "$HQ_CUDA_MAJOR" ]] || return 0
  local scratch home torch_cuda cupy nvcc_release
  read -r _ torch_cuda < <(hvd_torch_version) || die "cannot read the installed torch's version"
  cupy="$("$PYTHON" - <<'PY'
import re
from importlib import metadata
names = {d.metadata["Name"] for d in metadata.distributions()}
print(" ".join(sorted(n for n in names if n and re.fullmatch(r"cupy-cuda\d+x", n))) or "none")
PY
)"
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/hq-cuda-check.XXXXXX")"
  home="$(_hvd_cuda_home "$scratch")" || { rm -rf "$scratch"; exit 1; }
  nvcc_release=none
  if [[ -n "$home" ]]; then
    nvcc_release="$("$home/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  fi
  rm -rf "$scratch"
  local found="torch CUDA $torch_cuda, CuPy $cupy, nvcc $nvcc_release (${home:-no toolkit})"
  if [[ "${torch_cuda%%.*}" != "$HQ_CUDA_MAJOR" || "$cupy" != "cupy-cuda${HQ_CUDA_MAJOR}x" \
        || "${nvcc_release%%.*}" != "$HQ_CUDA_MAJOR" ]]; then
    die "HQ_CUDA_MAJOR=$HQ_CUDA_MAJOR, found $found: install a CUDA $HQ_CUDA_MAJOR torch," \
      "cupy-cuda${HQ_CUDA_MAJOR}x and 'cuda-toolkit[nvcc]' together (HQ_TORCH_SPEC," \
      "HQ_CUDA_PIP_SPECS), or set CUDA_HOME to a CUDA $HQ_CUDA_MAJOR toolkit"
  fi
  say "CUDA $HQ_CUDA_MAJOR: $found"
}

step_python() {
  local t=$SECONDS
  # torch first and on its own (with the CUDA wheels that must match it), so nothing else can
  # pull in a (CUDA) torch from PyPI.
  local torch_set=("$HQ_TORCH_SPEC") installed_torch installed_cuda
  if [[ "$HQ_KEEP_CUDA_TORCH" == 1 && -z "$HQ_TORCH_SPEC_GIVEN" ]] &&
      read -r installed_torch installed_cuda < <(hvd_torch_version 2>/dev/null) &&
      [[ "$installed_cuda" != none ]]; then
    say "torch: keeping the installed CUDA build $installed_torch (CUDA $installed_cuda)," \
      "not $HQ_TORCH_SPEC (CPU); HQ_KEEP_CUDA_TORCH=0 or HQ_TORCH_SPEC replaces it"
    torch_set=()
  fi
  read -r -a cuda_specs <<<"$HQ_CUDA_PIP_SPECS"
  torch_set+=("${cuda_specs[@]}")
  if ((${#torch_set[@]})) && [[ -n "$(missing_py "${torch_set[@]}")" ]]; then
    say "pip: installing ${torch_set[*]} ${HQ_TORCH_PIP_ARGS}"
    pip_install_torch_set "${torch_set[@]}"
  fi
  say "torch: $(hvd_torch_version | sed 's/ / CUDA /')"
  if [[ -n "$HQ_CUDA_TOOLKIT_DIR" ]]; then
    hvd_cuda_toolkit_from_wheels "$HQ_CUDA_TOOLKIT_DIR" \
      || die "no CUDA toolkit made in $HQ_CUDA_TOOLKIT_DIR (HQ_CUDA_TOOLKIT_DIR)"
    export CUDA_HOME="$HQ_CUDA_TOOLKIT_DIR"  # the toolkit Horovod's build and the check take
    say "CUDA toolkit from the wheels: $HQ_CUDA_TOOLKIT_DIR"
  fi
  check_cuda_major

  local want=("${PY_PACKAGES[@]}")
  [[ "$HQ_WITH_TENSORFLOW" == 1 ]] && want+=("$HQ_TENSORFLOW_SPEC")
  local missing
  mapfile -t missing < <(missing_py "${want[@]}")
  if ((${#missing[@]})); then
    say "pip: installing ${missing[*]}"
    pip_quiet install -q "${missing[@]}"
  fi
  if [[ "$HQ_WITH_TENSORFLOW" == 1 && -n "$(missing_py "tf-keras==${TF_KERAS_VERSION}")" ]]; then
    # --no-deps: tf-keras requires the package "tensorflow", which would install a second,
    # full TensorFlow over tensorflow-cpu.
    say "pip: installing tf-keras==${TF_KERAS_VERSION} (--no-deps)"
    pip_quiet install -q --no-deps "tf-keras==${TF_KERAS_VERSION}"
  fi
  say "python packages: ready in $((SECONDS - t))s"
}

# ---- 3. Horovod ----------------------------------------------------------------------------------
pkg_version() { "$PYTHON" -c "from importlib import metadata as m; print(m.version('$1'))" 2>/dev/null || echo none; }

# Succeeds when the installed Horovod was built by this script with the same key and works.
horovod_ok() {
  local key="$1"
  TF_USE_LEGACY_KERAS=1 "$PYTHON" - "$key" "$HQ_WITH_TENSORFLOW" "${HOROVOD_GPU_OPERATIONS:-}" \
    <<'PY' >/dev/null 2>&1
import os, sys
import horovod, horovod.torch as hvd
stamp = os.path.join(os.path.dirname(horovod.__file__), "HQ_BUILD_KEY")
assert open(stamp).read().strip() == sys.argv[1]
assert hvd.mpi_built() and hvd.gloo_built()
if sys.argv[2] == "1":
    import horovod.tensorflow  # noqa: F401
if sys.argv[3] == "NCCL":
    assert hvd.nccl_built()
PY
}

# shellcheck source=scripts/horovod_build.sh
source "$ROOT/scripts/horovod_build.sh"  # the patches and the wheel build, shared with gpu_check.sh

build_horovod_wheel() {  # $1: folder that receives the wheel
  local src="$HQ_CACHE/src" sdist
  mkdir -p "$src" "$HQ_CACHE/logs"
  sdist="$src/horovod-${HOROVOD_VERSION}.tar.gz"
  if [[ ! -f "$sdist" ]]; then
    say "horovod: downloading sdist ${HOROVOD_VERSION}"
    pip_quiet download -q --no-binary :all: --no-deps -d "$src" "horovod==${HOROVOD_VERSION}"
  fi
  [[ -f "$sdist" ]] || die "no $sdist after pip download"
  HQ_HOROVOD_JOBS="$NPROC" horovod_build_wheel "$sdist" "$1" \
    "$HQ_CACHE/logs/horovod-build-$(date +%Y%m%d-%H%M%S).log"
}

step_horovod() {
  local torch_v tf_v key pyv dir wheel
  torch_v="$(pkg_version torch)"
  tf_v=none
  [[ "$HQ_WITH_TENSORFLOW" == 1 ]] && tf_v="$(pkg_version tensorflow-cpu)"
  [[ "$tf_v" == none && "$HQ_WITH_TENSORFLOW" == 1 ]] && tf_v="$(pkg_version tensorflow)"
  pyv="$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
  key="horovod-${HOROVOD_VERSION}_torch-${torch_v}_tf-${tf_v}_${pyv}_${HOROVOD_PATCH_REV}"
  key+="$(horovod_gpu_key)"
  key="${key//+/-}"

  if horovod_ok "$key"; then say "horovod: installed build matches ($key), skipping"; return; fi

  dir="$HQ_WHEEL_DIR/$key"
  wheel="$(ls "$dir"/horovod-*.whl 2>/dev/null | head -1 || true)"
  if [[ -z "$wheel" ]]; then
    say "horovod: no cached wheel for $key"
    build_horovod_wheel "$dir"
    wheel="$(ls "$dir"/horovod-*.whl | head -1)"
  else
    say "horovod: using cached wheel $wheel"
  fi
  pip_quiet install -q --no-deps --force-reinstall "$wheel"
  local pkgdir
  pkgdir="$("$PYTHON" -c 'import horovod, os; print(os.path.dirname(horovod.__file__))')"
  echo "$key" >"$pkgdir/HQ_BUILD_KEY"
  command -v pyenv >/dev/null 2>&1 && pyenv rehash 2>/dev/null || true  # horovodrun on PATH
  horovod_ok "$key" || die "Horovod installed but 'import horovod.torch' (or .tensorflow)" \
    "fails, or it lacks the MPI, gloo or NCCL (HOROVOD_GPU_OPERATIONS) it was built for"
  say "horovod: installed ($key)"
}

# ---- 4. this project -----------------------------------------------------------------------------
project_ok() {  # installed editable from this checkout, with horovod_quant.kernels resolvable
  (cd / && "$PYTHON" - "$ROOT" <<'PY' >/dev/null 2>&1
import os, sys, importlib.resources as r
import horovod_quant
here = os.path.realpath(os.path.dirname(os.path.dirname(horovod_quant.__file__)))
assert here == os.path.realpath(sys.argv[1]), here
r.files("horovod_quant.kernels")
PY
  )
}

step_project() {
  if [[ "$HQ_INSTALL_PROJECT" != 1 ]]; then say "project: skipped (HQ_INSTALL_PROJECT=0)"; return; fi
  [[ -f "$ROOT/setup.py" ]] || { say "project: no setup.py in $ROOT, skipped"; return; }
  if [[ "$HQ_EDITABLE" == 1 ]] && project_ok; then
    say "project: horovod_quant already installed (editable) from $ROOT"
    return
  fi
  # --no-deps: numpy/numba are installed above; nothing may drag a CUDA torch in.
  if [[ "$HQ_EDITABLE" == 1 ]]; then
    say "project: pip install -e $ROOT"
    pip_quiet install -q --no-deps --no-build-isolation -e "$ROOT"
  else
    say "project: pip install $ROOT"
    pip_quiet install -q --no-deps --no-build-isolation "$ROOT"
  fi
}

say "python: $("$PYTHON" --version 2>&1) ($(command -v "$PYTHON")); cache: $HQ_CACHE; TF: $HQ_WITH_TENSORFLOW"
for step in $HQ_INSTALL_STEPS; do
  [[ " apt python horovod project " == *" $step "* ]] ||
    die "HQ_INSTALL_STEPS: unknown step '$step' (apt, python, horovod, project)"
done
for step in $HQ_INSTALL_STEPS; do "step_$step"; done
say "done in $((SECONDS - T_START))s"
