#!/usr/bin/env bash
# The release a user installs, checked as they would install it (`make test` runs this):
#
#  1. `python -m build --no-isolation` makes the sdist and the wheel (no isolation: the build's
#     requirements, setuptools and wheel, are installed already; scripts/install.sh installs
#     `build`);
#  2. a fresh virtual environment (no system site packages) gets the wheel with only its
#     declared dependencies (numpy, numba: from PyPI, or pip's cache after the first time);
#  3. from there, outside the checkout: a codec round trip, the CUDA kernels' sources found
#     inside the installed package, and `python -m horovod_quant.predict --help`;
#  4. each documented extra (mpi, gpu-cuda12, gpu-cuda13, examples) resolves (`pip install
#     --dry-run`: the index's metadata, nothing installed; examples without torch's own
#     dependencies, whose CUDA wheels' metadata alone takes 40 s), beside step 3;
#  5. the sdist holds LICENSE, CHANGELOG.md, CITATION.cff and the kernels, and the version of
#     the wheel, CITATION.cff and CHANGELOG.md's newest section are `horovod_quant.__version__`.
#
#   bash scripts/check_wheel.sh                 # builds into a temporary folder, then removes it
#   bash scripts/check_wheel.sh --keep DIR      # keeps the sdist and the wheel in DIR
#   HQ_WHEEL_EXTRAS="mpi" bash scripts/check_wheel.sh   # the extras to resolve
#
# Exit status 0 when every check passed; the failing step is named otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
: "${PYTHON:=python3}"
: "${HQ_WHEEL_EXTRAS:=mpi gpu-cuda12 gpu-cuda13 examples}"
KEEP=""
while (($#)); do
  case "$1" in
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    --keep) [[ $# -ge 2 ]] || { echo "check_wheel: --keep needs a folder" >&2; exit 2; }
            KEEP="$2"; shift ;;
    *) echo "check_wheel: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

T0=$SECONDS
say() { printf '[check-wheel %3ds] %s\n' "$((SECONDS - T0))" "$*"; }
fail() { say "FAILED: $*" >&2; exit 1; }
WORK="$(mktemp -d "${TMPDIR:-/tmp}/hq-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
DIST="${KEEP:-$WORK/dist}"
mkdir -p "$DIST"

"$PYTHON" -c "import build" 2>/dev/null \
  || fail "no 'build' module in $PYTHON: pip install build (scripts/install.sh installs it)"
# a copy of the tracked and new files: the build writes build/ and *.egg-info beside its sources,
# and the checkout's own must not leak into the release
SRC="$WORK/src"
mkdir -p "$SRC"
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
     | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$SRC"
else
  (cd "$ROOT" && tar --exclude=./build --exclude=./dist --exclude='*.egg-info' -cf - .) \
    | tar -xf - -C "$SRC"
fi
"$PYTHON" -m build --no-isolation --outdir "$DIST" "$SRC" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; fail "python -m build"; }
WHEEL="$(ls "$DIST"/horovod_quant-*.whl)"
SDIST="$(ls "$DIST"/horovod_quant-*.tar.gz)"
say "built $(basename "$SDIST") and $(basename "$WHEEL")"

VERSION="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$SRC/horovod_quant/__init__.py")"
[[ -n "$VERSION" ]] || fail "no __version__ in horovod_quant/__init__.py"
[[ "$(basename "$WHEEL")" == "horovod_quant-$VERSION-"* ]] || fail "the wheel is not version $VERSION"
grep -qx "version: $VERSION" "$ROOT/CITATION.cff" || fail "CITATION.cff's version is not $VERSION"
[[ "$(grep -m1 '^## ' "$ROOT/CHANGELOG.md")" == "## $VERSION "* ]] \
  || fail "CHANGELOG.md's newest section is not $VERSION"
listing="$(tar -tzf "$SDIST")"
for f in LICENSE CHANGELOG.md CITATION.cff kernels/levels.cu setup.py; do
  grep -q "^horovod_quant-$VERSION/$f\$" <<<"$listing" || fail "the sdist lacks $f"
done

VENV="$WORK/venv"
t=$SECONDS
# without pip of its own (ensurepip alone takes 10-20 s): this interpreter's pip installs into it
"$PYTHON" -m venv --without-pip "$VENV"
VPIP=("$PYTHON" -m pip --python "$VENV/bin/python" --disable-pip-version-check)
"${VPIP[@]}" install -q "$WHEEL" \
  || fail "pip install of the wheel into a fresh virtual environment"
say "the wheel and its dependencies installed in a fresh virtual environment in $((SECONDS - t))s:" \
  "$("${VPIP[@]}" list --format freeze | paste -sd' ' -)"
# the extras resolve in the background while the round trip compiles its kernels (numba, ~20 s)
resolve_extra() {  # EXTRA: pip's dry run of the wheel with it; examples without torch's own deps
  local no_deps=()
  [[ $1 == examples ]] && no_deps=(--no-deps)  # torch's CUDA wheels' metadata: 40 s more
  "${VPIP[@]}" install -q --dry-run "${no_deps[@]}" \
    "horovod_quant[$1] @ file://$WHEEL"
}
pids=()
for extra in $HQ_WHEEL_EXTRAS; do
  resolve_extra "$extra" >"$WORK/extra-$extra.log" 2>&1 & pids+=($!)
done
(cd "$WORK" && "$VENV/bin/python" - "$VERSION" <<'PY') || fail "the installed wheel's checks"
import importlib.metadata as md
import importlib.resources as resources
import sys

import numpy as np

import horovod_quant as hq

assert hq.__version__ == sys.argv[1] == md.version("horovod_quant"), hq.__version__
assert "site-packages" in hq.__file__, hq.__file__  # the wheel's copy, not the checkout's
license_ = md.metadata("horovod_quant").get("License-Expression") or \
    md.metadata("horovod_quant").get("License")
assert license_ == "Apache-2.0", license_
kernels = {p.name for p in resources.files("horovod_quant.kernels").iterdir()}
assert {"levels.cu", "hq_common.cuh"} <= kernels, kernels
x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
codec = hq.get_codec("qsgd", bits=8)
y = codec.decode(codec.encode(x, seed=1))
assert y.shape == x.shape and np.isfinite(y).all() and abs(float(y.mean() - x.mean())) < 0.05
print(f"horovod_quant {hq.__version__} from the wheel: qsgd:8 round trip of 10,000 elements,"
      f" {len(kernels)} kernel files, license {license_}")
PY
(cd "$WORK" && "$VENV/bin/python" -m horovod_quant.predict --help >/dev/null) \
  || fail "python -m horovod_quant.predict --help from the wheel"
say "the installed wheel: round trip, kernels, predict --help ok"

i=0
for extra in $HQ_WHEEL_EXTRAS; do
  wait "${pids[$i]}" || { tail -20 "$WORK/extra-$extra.log"; fail "the extra [$extra] does not resolve"; }
  i=$((i + 1))
done
say "extras resolve: $HQ_WHEEL_EXTRAS"
say "ok in $((SECONDS - T0))s"
