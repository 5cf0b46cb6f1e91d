#!/usr/bin/env bash
# Runs tests/parallel_ddp under torchrun (gloo process groups): 2 and 4 ranks, and 3 for the
# non-power-of-two exponent reduction. Every run has a deadline, so a hang fails the job.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1
: "${HQ_PARALLEL_WORLDS:=2 4}"
: "${HQ_PARALLEL_TIMEOUT:=900}"
status=0
run() {
  local np=$1; shift
  echo "== tests/parallel_ddp: $np ranks, gloo $* =="
  if ! timeout --kill-after=30 "$HQ_PARALLEL_TIMEOUT" \
      torchrun --standalone --nproc_per_node "$np" \
      -m pytest -q -x -p no:cacheprovider "$@"; then
    echo "!! tests/parallel_ddp failed: $np ranks $*"
    status=1
  fi
}
for np in $HQ_PARALLEL_WORLDS; do
  run "$np" tests/parallel_ddp
done
run 3 tests/parallel_ddp/test_ddp_exact.py -k "global_qsgd or nested"
exit $status
