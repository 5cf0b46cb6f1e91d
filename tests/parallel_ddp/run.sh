#!/usr/bin/env bash
# Runs tests/parallel_ddp under torchrun (gloo process groups): 2 and 4 ranks (4 without the
# size_independent tests), 2 nodes x 2 ranks (two torchrun launches with --nnodes 2 on this
# host: the hierarchical exchange, and the FSDP hook's two hosts, test_fsdp_replicas.py, which
# runs in that world alone), and 3 for
# the non-power-of-two exponent reduction; then runs exit_job.py HQ_EXIT_RUNS times (default
# 20) as 2 ranks and as 2 nodes x 2 ranks, each rank of which must exit 0. Every run has a
# deadline, so a hang fails the job.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1
# pytest loads no plugin by itself: hypothesis's costs 2.7 s in each rank; these suites use none
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
: "${HQ_PARALLEL_WORLDS:=2 4 2x2}"
: "${HQ_PARALLEL_TIMEOUT:=900}"
status=0
# this runner's 2-rank door jobs write their results for tests/doors (compared at the end)
export HQ_DOORS_DIR=${HQ_DOORS_DIR:-${TMPDIR:-/tmp}/hq-doors}
bash tests/doors/compare.sh clear ddp
# launch SHAPE SECONDS ARGS...: torchrun ARGS as SHAPE ranks, each torchrun with a deadline:
# "N" is one node of N ranks; "NxK" is N torchruns (nodes) of K ranks on this host, rendezvous
# on loopback. Fails when any torchrun does.
launch() {
  local shape=$1 seconds=$2 n=1 k=$1 port=$((29600 + RANDOM % 2000)) pids=() rc=0 node where
  shift 2
  [[ $shape == *x* ]] && n=${shape%x*} k=${shape#*x}
  for ((node = 0; node < n; node++)); do
    where=(--standalone)  # one node: torchrun picks a free port
    ((n > 1)) && where=(--nnodes "$n" --node_rank "$node" --master_addr 127.0.0.1
                        --master_port "$port")
    timeout --kill-after=30 "$seconds" torchrun "${where[@]}" --nproc_per_node "$k" "$@" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  return $rc
}
suite() {  # SHAPE PYTEST-ARGS...
  local shape=$1; shift
  echo "== tests/parallel_ddp: $shape ranks, gloo $* =="
  if ! launch "$shape" "$HQ_PARALLEL_TIMEOUT" -m pytest -q -x -p no:cacheprovider "$@"; then
    echo "!! tests/parallel_ddp failed: $shape ranks $*"
    status=1
  fi
}
for world in $HQ_PARALLEL_WORLDS; do
  only=()  # a flat world of more than 2 ranks: what the size changes (size_independent marker)
  [[ $world != *x* ]] && ((world > 2)) && only=(-m "not size_independent")
  suite "$world" "${only[@]}" tests/parallel_ddp
done
suite 3 tests/parallel_ddp/test_ddp_exact.py -k "global_qsgd or nested"

# the doors' results agree; the DDP hook's must be there when the 2-rank world ran
required=""
[[ " $HQ_PARALLEL_WORLDS " == *" 2 "* ]] && required="ddp"
bash tests/doors/compare.sh $required || status=1
# a DDP job with the hook exits 0, every time (docs/ddp.md), flat and hierarchical: its ranks
# forked after the imports (exit_runs.py says why that checks the same exit)
: "${HQ_EXIT_RUNS:=20}"
for shape in 2 2x2; do
  echo "== tests/parallel_ddp: exit_job.py, $HQ_EXIT_RUNS runs of $shape ranks, each must exit 0 =="
  python3 tests/parallel_ddp/exit_runs.py --shape "$shape" --runs "$HQ_EXIT_RUNS" || status=1
done
exit $status
