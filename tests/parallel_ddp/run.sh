#!/usr/bin/env bash
# Runs tests/parallel_ddp under torchrun (gloo process groups): 2 and 4 ranks, 2 nodes x 2 ranks
# (two torchrun launches with --nnodes 2 on this host: the hierarchical exchange), and 3 for
# the non-power-of-two exponent reduction; then launches exit_job.py HQ_EXIT_RUNS times
# (default 20) as 2 ranks and as 2 nodes x 2 ranks, each run of which must exit 0. Every run
# has a deadline, so a hang fails the job.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1
: "${HQ_PARALLEL_WORLDS:=2 4 2x2}"
: "${HQ_PARALLEL_TIMEOUT:=900}"
status=0
# this runner's 2-rank door jobs write their results for tests/doors (compared at the end)
export HQ_DOORS_DIR=${HQ_DOORS_DIR:-${TMPDIR:-/tmp}/hq-doors}
bash tests/doors/compare.sh clear ddp
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
nodes() {  # NODESxRANKS: one torchrun per node, all on this host, rendezvous on loopback
  local n=${1%x*} k=${1#*x}; shift
  local port=$((29600 + RANDOM % 300)) pids=() rc=0
  echo "== tests/parallel_ddp: $n nodes x $k ranks, gloo $* =="
  for ((node = 0; node < n; node++)); do
    timeout --kill-after=30 "$HQ_PARALLEL_TIMEOUT" \
      torchrun --nnodes "$n" --node_rank "$node" --nproc_per_node "$k" \
      --master_addr 127.0.0.1 --master_port "$port" \
      -m pytest -q -x -p no:cacheprovider "$@" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  if [ "$rc" != 0 ]; then
    echo "!! tests/parallel_ddp failed: $n nodes x $k ranks $*"
    status=1
  fi
}
for world in $HQ_PARALLEL_WORLDS; do
  if [[ $world == *x* ]]; then nodes "$world" tests/parallel_ddp; else run "$world" tests/parallel_ddp; fi
done
run 3 tests/parallel_ddp/test_ddp_exact.py -k "global_qsgd or nested"

# the doors' results agree; the DDP hook's must be there when the 2-rank world ran
required=""
[[ " $HQ_PARALLEL_WORLDS " == *" 2 "* ]] && required="ddp"
bash tests/doors/compare.sh $required || status=1
# a DDP job with the hook exits 0, every time (docs/ddp.md), flat and hierarchical
: "${HQ_EXIT_RUNS:=20}"
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT
exit_runs() {  # 2: one torchrun of 2 ranks; NxK: N torchruns (nodes) of K ranks
  local shape=$1 n=1 k=$1 failed=0
  [[ $shape == *x* ]] && n=${shape%x*} k=${shape#*x}
  echo "== tests/parallel_ddp: exit_job.py, $HQ_EXIT_RUNS runs of $shape ranks, each must exit 0 =="
  for i in $(seq "$HQ_EXIT_RUNS"); do
    local port=$((29900 + RANDOM % 2000)) pids=() rc=0 where
    rm -f "$log"/node*
    for ((node = 0; node < n; node++)); do
      where=(--standalone)  # one node: torchrun picks a free port
      ((n > 1)) && where=(--nnodes "$n" --node_rank "$node" --master_addr 127.0.0.1
                          --master_port "$port")
      timeout --kill-after=10 120 torchrun "${where[@]}" --nproc_per_node "$k" \
        tests/parallel_ddp/exit_job.py >"$log/node$node" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    if [ "$rc" != 0 ]; then
      failed=$((failed + 1))
      echo "!! run $i exited $rc:"
      cat "$log"/node* | grep -E "terminate called|exitcode|Error" | head -5 || true
    fi
  done
  echo "exit_job.py: $((HQ_EXIT_RUNS - failed)) of $HQ_EXIT_RUNS runs of $shape exited 0"
  [ "$failed" = 0 ] || status=1
}
exit_runs 2
exit_runs 2x2
exit $status
