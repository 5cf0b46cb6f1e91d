#!/usr/bin/env bash
# Runs tests/emulated: jobs on emulated hosts (network namespaces on a bridge, see
# benchmarks/emulator.py), under mpirun and Horovod's gloo controller. Needs root and `ip`
# (iproute2); without them it fails, unless HQ_SKIP_EMULATED=1. Every launch has a deadline
# (HQ_EMULATED_TIMEOUT seconds; its ranks' stacks are dumped, then they are killed), and the
# whole suite one more (HQ_EMULATED_SUITE_TIMEOUT).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ "${HQ_SKIP_EMULATED:-0}" == 1 ]]; then
  echo "== tests/emulated: skipped (HQ_SKIP_EMULATED=1) =="
  exit 0
fi
if [[ "$(id -u)" != 0 ]] || ! command -v ip >/dev/null; then
  echo "!! tests/emulated needs root and iproute2's ip (network namespaces); set HQ_SKIP_EMULATED=1 to skip them" >&2
  exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1
# pytest loads no plugin by itself: hypothesis's costs 2.7 s in each rank; these suites use none
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export OMPI_MCA_mpi_yield_when_idle=1
export HQ_EMULATED_TIMEOUT=${HQ_EMULATED_TIMEOUT:-120}
: "${HQ_EMULATED_SUITE_TIMEOUT:=2400}"
python3 benchmarks/emulator.py --cleanup >/dev/null  # what killed runs left behind
echo "== tests/emulated: 2 emulated hosts, mpirun and gloo =="
timeout --kill-after=30 "$HQ_EMULATED_SUITE_TIMEOUT" \
  python3 -m pytest -q -p no:cacheprovider tests/emulated "$@"
