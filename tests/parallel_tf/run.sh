#!/usr/bin/env bash
# Runs tests/parallel_tf under real 2-rank Horovod worlds, gloo and MPI controllers.
# Every run has a deadline, so a hang fails the job instead of stalling CI. A machine without
# TensorFlow or horovod.tensorflow skips the suite (exit 0) with a message.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1
# pytest loads no plugin by itself: hypothesis's costs 2.7 s in each rank; these suites use none
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
# tf-keras (Keras 2) for horovod.tensorflow.keras; quiet TF start-up logs
export TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
# ranks waiting in MPI must not spin on a 2-core machine
export OMPI_MCA_mpi_yield_when_idle=1 HOROVOD_CYCLE_TIME=${HOROVOD_CYCLE_TIME:-1}
: "${HQ_PARALLEL_TF_WORLDS:=2}"
: "${HQ_PARALLEL_CONTROLLERS:=gloo mpi}"
: "${HQ_PARALLEL_TF_TIMEOUT:=900}"
PY=${PYTHON:-python3}
if ! "$PY" -c "import tensorflow, tf_keras, horovod.tensorflow" >/dev/null 2>&1; then
  echo "== tests/parallel_tf: skipped (tensorflow, tf_keras or horovod.tensorflow missing) =="
  exit 0
fi
status=0
# this runner's 2-rank door jobs write their results for tests/doors (compared at the end)
export HQ_DOORS_DIR=${HQ_DOORS_DIR:-${TMPDIR:-/tmp}/hq-doors}
bash tests/doors/compare.sh clear tensorflow
for np in $HQ_PARALLEL_TF_WORLDS; do
  # the first controller runs every test; the others leave out what no controller changes
  # (pyproject.toml's controller_independent marker)
  only=()
  for ctrl in $HQ_PARALLEL_CONTROLLERS; do
    echo "== tests/parallel_tf: $np ranks, $ctrl ${only[*]} =="
    start=$SECONDS
    if ! HQ_CONTROLLER=$ctrl timeout --kill-after=30 "$HQ_PARALLEL_TF_TIMEOUT" \
        "$PY" tests/horovodrun.py -np "$np" -H "localhost:$np" "--$ctrl" \
        "$PY" -m pytest -q -x -p no:cacheprovider "${only[@]}" tests/parallel_tf "$@"; then
      echo "!! tests/parallel_tf failed: $np ranks, $ctrl"
      status=1
    fi
    echo "== tests/parallel_tf: $np ranks, $ctrl: $((SECONDS - start)) s =="
    only=(-m "not controller_independent")
  done
done
# the doors' results agree; those this runner wrote must be there unless its worlds or
# arguments left the 2-rank door jobs out
required=""
[[ " $HQ_PARALLEL_TF_WORLDS " == *" 2 "* && $# -eq 0 ]] && required="tensorflow"
bash tests/doors/compare.sh $required || status=1
exit $status
