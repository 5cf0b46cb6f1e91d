#!/usr/bin/env bash
# Runs tests/parallel under real Horovod worlds (launched by tests/horovodrun.py: horovodrun,
# its build probe importing torch, not TensorFlow): 2 ranks under the gloo and MPI controllers, 4
# under MPI, and 2 hosts x 2 ranks under gloo (horovodrun takes localhost and 127.0.0.1 for two
# hosts, so ranks share "hosts" and the hierarchical exchange runs; MPI sees one host). A world
# WORLD:CTRL runs under that controller only: what 4 gloo ranks on one host would run, the
# 2 x 2 world's four gloo ranks and the four MPI ranks on one host run, and on 2 cores it took
# 305 s against 70 s under MPI (Horovod's gloo controller with more ranks than cores). Every
# run has a deadline, so a hang fails the job instead of stalling CI.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 TF_USE_LEGACY_KERAS=1
# pytest loads no plugin by itself: hypothesis's costs 2.7 s in each rank; these suites use none
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
# oversubscribed ranks (4 on 2 cores) must not spin while waiting
export OMPI_MCA_mpi_yield_when_idle=1 HOROVOD_CYCLE_TIME=${HOROVOD_CYCLE_TIME:-1}
: "${HQ_PARALLEL_WORLDS:=2 4:mpi 2x2}"
: "${HQ_PARALLEL_CONTROLLERS:=gloo mpi}"
: "${HQ_PARALLEL_TIMEOUT:=900}"
status=0
# this runner's 2-rank door jobs write their results for tests/doors (compared at the end)
export HQ_DOORS_DIR=${HQ_DOORS_DIR:-${TMPDIR:-/tmp}/hq-doors}
bash tests/doors/compare.sh clear torch_compressor optimizer
names=(localhost 127.0.0.1 "$(hostname)")  # names horovodrun runs locally, as distinct hosts
for entry in $HQ_PARALLEL_WORLDS; do
  world=${entry%%:*}
  if [[ $world == *x* ]]; then  # HOSTSxRANKS
    h=${world%x*} k=${world#*x} np=$(( ${world%x*} * ${world#*x} )) hosts=()
    for ((i = 0; i < h; i++)); do hosts+=("${names[i]}:$k"); done
    hosts=$(IFS=,; echo "${hosts[*]}") ctrls=gloo
  else
    np=$world hosts="localhost:$world" ctrls=$HQ_PARALLEL_CONTROLLERS
  fi
  [[ $entry == *:* ]] && ctrls=${entry#*:}
  # the first controller of a world runs every test; the others leave out what no controller
  # changes, a flat world of more than 2 ranks what the size does not change (pyproject.toml's
  # controller_independent and size_independent markers)
  left_out=()
  [[ $world != *x* ]] && ((world > 2)) && left_out=(size_independent)
  for ctrl in $ctrls; do
    [[ " $HQ_PARALLEL_CONTROLLERS " == *" $ctrl "* ]] || continue
    only=()
    ((${#left_out[@]})) && only=(-m "$(printf 'not %s and ' "${left_out[@]}" | sed 's/ and $//')")
    echo "== tests/parallel: $world ranks, $ctrl ${only[*]} =="
    if ! HQ_CONTROLLER=$ctrl timeout --kill-after=30 "$HQ_PARALLEL_TIMEOUT" \
        python3 tests/horovodrun.py -np "$np" -H "$hosts" "--$ctrl" \
        python3 -m pytest -q -x -p no:cacheprovider "${only[@]}" tests/parallel "$@"; then
      echo "!! tests/parallel failed: $world ranks, $ctrl"
      status=1
    fi
    left_out+=(controller_independent)
  done
done
# non-power-of-two world for the custom exchanges (fold round of the exponent allreduce)
for ctrl in $HQ_PARALLEL_CONTROLLERS; do
  echo "== tests/parallel/test_global_exchange.py: 3 ranks, $ctrl =="
  if ! HQ_CONTROLLER=$ctrl timeout --kill-after=30 "$HQ_PARALLEL_TIMEOUT" \
      python3 tests/horovodrun.py -np 3 -H localhost:3 "--$ctrl" \
      python3 -m pytest -q -x -p no:cacheprovider tests/parallel/test_global_exchange.py; then
    echo "!! tests/parallel/test_global_exchange.py failed: 3 ranks, $ctrl"
    status=1
  fi
done
# the doors' results agree; those this runner wrote must be there unless its worlds or
# arguments left the 2-rank door jobs out
required=""
[[ " $HQ_PARALLEL_WORLDS " == *" 2 "* && $# -eq 0 ]] && required="torch_compressor optimizer"
bash tests/doors/compare.sh $required || status=1
# gloo on a host whose own name does not resolve (containers): the patched Horovod's case
if [[ " $HQ_PARALLEL_CONTROLLERS " == *" gloo "* ]]; then
  bash tests/parallel/unresolved_hostname.sh || status=1
fi
exit $status
