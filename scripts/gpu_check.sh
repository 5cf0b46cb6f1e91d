#!/usr/bin/env bash
# make gpu-check: every check that needs a GPU, in one command, on a bare machine with one
# NVIDIA GPU and no network, from a copy of the working tree. Needs Python with a CUDA build of
# PyTorch, CuPy, numba and pytest, and nvcc, ncu, compute-sanitizer and CMake; no Horovod: a
# Horovod with CPU collectives (gloo, no MPI, no TensorFlow) is built from the sdist by
# scripts/horovod_build.sh's recipe, and cached. Every step has a deadline; every log and JSON
# goes to one folder (8 files at most).
#
#   make gpu-check-inputs                             # once, with network: the sdist into vendor/
#   bash scripts/gpu_check.sh                         # every step, at most 8 minutes (the budget)
#   bash scripts/gpu_check.sh --out DIR --steps tests,throughput
#   bash scripts/gpu_check.sh --list                  # the steps in the order they start
#
# The order: what has never run on a GPU first, so that a short lease or the budget cuts what has:
# Horovod's build starts in the background; the DDP hook and tests/gpu run while it builds; both
# Horovod doors at 2 hosts x 2 ranks (hierarchical), then at 2 ranks, as soon as it is built;
# then, alone on the GPU, the sanitizers, the timed throughput and the profiler. Each step's row
# is appended to the summary as the step ends: a run stopped from outside keeps its rows.
#
# GPU_CHECK_STEPS: the steps to run when --steps is not given (default: every step). The GPU
# image sets it to every step but ncu: Nsight Compute is not published as a pip wheel.
#
# The sdist travels with the working tree: $HOROVOD_SDIST, else vendor/horovod-<version>.tar.gz
# (ignored by git: name vendor/ among the paths a copy carries). Without it, and without an
# importable Horovod (used as it is), a run that asks for the Horovod steps stops at the preflight.
# The summary's commit is the one whose files the working tree holds (scripts/source_commit.py).
#
# Exit status: 0 every step passed; 1 a step failed (the others still ran); 2 bad arguments
# or a failed preflight (nothing ran).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
: "${PYTHON:=python3}"
: "${HOROVOD_VERSION:=0.28.1}"
: "${HQ_CACHE:=${HOME:-/root}/.cache/horovod_quant}"
: "${HOROVOD_SDIST:=$ROOT/vendor/horovod-$HOROVOD_VERSION.tar.gz}"
: "${GPU_CHECK_OUT:=$ROOT/gpu_check_out}"
: "${GPU_CHECK_SIZE:=256M}"        # elements of the throughput benchmark's largest vector
: "${GPU_CHECK_BUDGET:=480}"       # seconds for the whole run: a step's deadline never passes it
# the kernels ncu profiles: qsgd's (uniform levels, max scales) 8- and 4-bit encode and decode
NCU_KERNELS='hq_(encode_tile_uniform_max|decode_words_levels)_[48]b'

# name|deadline in seconds|file|what, in the order the steps start (kernels always runs)
STEPS=(
  "preflight|60|gpu_check_summary.md|GPU, Python packages, tools, the commit and the Horovod sdist"
  "horovod|420|gpu_check_doors.log|Horovod (gloo) built from the sdist, in the background"
  "kernels|120|gpu_check_tests.log|the CUDA kernels compiled with NVRTC, cached for the steps"
  "ddp|300|gpu_check_ddp.log|the DDP hook on CUDA parameters (torchrun 2 x 2, then 2)"
  "tests|420|gpu_check_tests.log|tests/gpu: every codec on the GPU equals the CPU bit for bit"
  "doors2x2|300|gpu_check_doors.log|both Horovod doors on CUDA parameters, horovodrun 2 hosts x 2 ranks"
  "doors2|240|gpu_check_doors.log|both Horovod doors on CUDA parameters, horovodrun 2 ranks"
  "sanitizer|300|gpu_check_sanitizer.log|compute-sanitizer memcheck and racecheck, every kernel once"
  "throughput|240|gpu_check_throughput.txt|codec kernels vs a device copy and plain PyTorch (+ .json)"
  "ncu|240|gpu_check_ncu.txt|Nsight Compute summary of qsgd 8/4-bit encode and decode"
)
ALL_STEPS="$(printf '%s\n' "${STEPS[@]}" | cut -d'|' -f1 | grep -vx 'preflight\|kernels' \
  | paste -sd, -)"

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
  echo "steps (--steps takes a comma-separated subset; preflight and kernels always run):" \
    "$ALL_STEPS"
}

step_field() {  # NAME FIELD(2: deadline, 3: file, 4: what)
  printf '%s\n' "${STEPS[@]}" | awk -F'|' -v n="$1" -v f="$2" '$1 == n { print $f }'
}

WANT="${GPU_CHECK_STEPS:-$ALL_STEPS}"
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --list) printf '%s\n' "${STEPS[@]}" | awk -F'|' '{ printf "%-10s %4ss  %-26s %s\n", $1, $2, $3, $4 }'
            exit 0 ;;
    --out) [[ $# -ge 2 ]] || { echo "gpu_check: --out needs a folder" >&2; exit 2; }
           GPU_CHECK_OUT="$2"; shift ;;
    --steps) [[ $# -ge 2 ]] || { echo "gpu_check: --steps needs a list" >&2; exit 2; }
             WANT="$2"; shift ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for s in ${WANT//,/ }; do
  [[ ",$ALL_STEPS," == *",$s,"* ]] || { echo "gpu_check: unknown step '$s': choose from $ALL_STEPS" >&2; exit 2; }
done
wanted() { [[ ",$WANT," == *",$1,"* ]]; }
wants_horovod() { wanted horovod || wanted doors2x2 || wanted doors2; }  # the doors need it
if [[ -e "$GPU_CHECK_OUT" && ! -d "$GPU_CHECK_OUT" ]]; then
  echo "gpu_check: --out $GPU_CHECK_OUT exists and is not a folder" >&2
  exit 2
fi
mkdir -p "$GPU_CHECK_OUT" || exit 2
OUT="$(cd "$GPU_CHECK_OUT" && pwd -P)"
rm -f "$OUT"/gpu_check_*  # one run's files, never a mix of two runs
SUMMARY="$OUT/gpu_check_summary.md"
PYTHON="$(command -v "$PYTHON" || echo "$PYTHON")"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HQ_TEST_GPU=1
# where CUDA toolkits and Nsight Compute install themselves, for PATHs that lack them
for dir in /usr/local/cuda/bin /opt/nvidia/nsight-compute/*/ /usr/local/cuda/nsight-compute*/; do
  [[ -d "$dir" && ":$PATH:" != *":${dir%/}:"* ]] && PATH="$PATH:${dir%/}"
done
export PATH
export HQ_KERNEL_CACHE="${HQ_KERNEL_CACHE:-$HQ_CACHE/kernels}"
cd "$ROOT" || exit 2
T0=$SECONDS
STATE="$(mktemp -d "${TMPDIR:-/tmp}/hq-gpu-check.XXXXXX")"  # each step's result and seconds
trap 'rm -rf "$STATE"' EXIT
export ROOT PYTHON HOROVOD_VERSION HQ_CACHE HOROVOD_SDIST OUT SUMMARY T0 GPU_CHECK_SIZE NCU_KERNELS \
  GPU_CHECK_BUDGET WANT

say() { printf '[gpu-check %3ds] %s\n' "$((SECONDS - T0))" "$*"; }
die() { say "ERROR: $*" >&2; exit 1; }  # (only ever called inside a step's own bash)

# run_step NAME FUNCTION: the step's function under its deadline (in a bash of its own, so that
# the deadline reaches every process it starts), its output appended to the step's file and kept
# out of the terminal; the result (ok, FAILED (rc N), TIMEOUT, skipped) and the seconds go to
# $STATE/NAME and, as a row of the summary's table, to the summary as soon as the step ends
run_step() {
  local name="$1" fn="$2" deadline file rc result t=$SECONDS
  deadline="$(step_field "$name" 2)"
  file="$OUT/$(step_field "$name" 3)"
  local left=$((GPU_CHECK_BUDGET - (SECONDS - T0)))
  if [[ $name != preflight ]] && ((left < 15)); then
    record_step "$name" "skipped (the ${GPU_CHECK_BUDGET}s budget was spent)" 0
    say "$name: skipped, the ${GPU_CHECK_BUDGET}s budget is spent"
    return 1
  fi
  ((deadline > left)) && deadline=$left
  say "$name: $(step_field "$name" 4) (deadline ${deadline}s)"
  [[ $file == "$SUMMARY" ]] || { echo "### $name ($(date -u +%H:%M:%S))"; echo; } >>"$file"
  timeout --kill-after=20 "$deadline" bash -c "$fn" >>"$file" 2>&1
  rc=$?
  if ((rc == 0)); then result=ok
  elif ((rc == 124 || rc == 137)); then result="TIMEOUT after ${deadline}s"
  else result="FAILED (rc $rc)"; fi
  record_step "$name" "$result" $((SECONDS - t))
  say "$name: $result in $((SECONDS - t))s"
  ((rc == 0))
}

record_step() {  # NAME RESULT SECONDS: the state file and the summary's row (one append: whole)
  echo "$2|$3" >"$STATE/$1"
  [[ $1 == preflight ]] && return 0  # its row comes with the table's head, after its lines
  printf '| %s | %s | %s | %s | %s |\n' "$1" "$2" "$3" "$(step_field "$1" 3)" \
    "$(step_field "$1" 4)" >>"$SUMMARY"
}

# ---- preflight: what the steps need, before anything runs ---------------------------------------
preflight() {  # prints the summary's head; fails, saying why, when a step would miss something
  local bad=() tool report
  echo "# make gpu-check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $("$PYTHON" "$ROOT/scripts/source_commit.py" 2>&1 | tail -1)"
  echo "- host: $(uname -srm), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
  else
    bad+=("no GPU (nvidia-smi -L fails or is missing)")
  fi
  if report="$("$PYTHON" - 2>&1 <<'PY'
import importlib, sys
versions = {name: importlib.import_module(name).__version__
            for name in ("torch", "cupy", "numba", "numpy", "pytest")}
import torch, cupy
assert torch.cuda.is_available(), "torch sees no CUDA device"
assert cupy.cuda.runtime.getDeviceCount() > 0, "CuPy sees no CUDA device"
print(f"- Python {sys.version.split()[0]}; " + ", ".join(f"{k} {v}" for k, v in versions.items())
      + f"; torch CUDA {torch.version.cuda}")
PY
)"; then echo "$report"; else bad+=("Python packages: $(echo "$report" | tail -1)"); fi
  local tools=(nvcc)  # a missing tool fails only its own step
  wanted ncu && tools+=(ncu)
  wanted sanitizer && tools+=(compute-sanitizer)
  for tool in "${tools[@]}"; do
    command -v "$tool" >/dev/null || echo "- note: $tool is not on PATH: its step will fail"
  done
  if wants_horovod && ! "$PYTHON" -c "import horovod.torch" 2>/dev/null; then
    if [[ -f "$HOROVOD_SDIST" ]]; then
      echo "- Horovod sdist: $HOROVOD_SDIST"
    else
      bad+=("no Horovod and no sdist at $HOROVOD_SDIST: the Horovod steps cannot run (with network, before copying the working tree: make gpu-check-inputs; carry vendor/ with it, or set HOROVOD_SDIST; or leave horovod and doors out of --steps)")
    fi
    command -v cmake >/dev/null || [[ -x /usr/bin/cmake ]] || echo "- note: cmake not found: Horovod cannot be built"
  fi
  if ((${#bad[@]})); then
    printf -- '- preflight failed: %s\n' "${bad[@]}"
    return 1
  fi
  report="$(nvcc --version 2>&1 | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p')"
  wanted ncu && report+=", $(ncu --version 2>&1 | tail -1)"
  wanted sanitizer && report+=", $(compute-sanitizer --version 2>&1 \
    | sed -n 's/.*Version \(.*\)/compute-sanitizer \1/p')"
  echo "- tools: $report, $(cmake --version 2>&1 | head -1)"
}

# ---- horovod: build (or find) a Horovod with CPU collectives; runs in the background -------------
HVD_PREFIX="$HQ_CACHE/gpu-check-horovod"  # a private install: the user's environment is left alone
horovod_step() {
  if "$PYTHON" -c "import horovod.torch" 2>/dev/null; then
    echo "Horovod is importable: $("$PYTHON" -c 'import horovod; print(horovod.__version__, horovod.__file__)')"
    return 0
  fi
  # shellcheck source=scripts/horovod_build.sh
  source "$ROOT/scripts/horovod_build.sh"
  local key wheel dir torch_version
  read -r torch_version _ < <(hvd_torch_version) || return 1
  key="horovod-${HOROVOD_VERSION}_torch-${torch_version}_$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')_gloo_${HOROVOD_PATCH_REV}"
  key="${key//+/-}"
  dir="$HQ_CACHE/wheels/$key"
  wheel="$(ls "$dir"/horovod-*.whl 2>/dev/null | head -1)"
  if [[ -z "$wheel" ]]; then
    HQ_HOROVOD_MPI=0 HQ_WITH_TENSORFLOW=0 HQ_HOROVOD_CUDA_CC="${HQ_HOROVOD_CUDA_CC:-90}" \
      horovod_build_wheel "$HOROVOD_SDIST" "$dir" "$STATE/horovod-build.log" || return 1
    tail -n 100 "$STATE/horovod-build.log"  # the end of the build log (the whole is long)
    wheel="$(ls "$dir"/horovod-*.whl | head -1)"
  else
    say "horovod: cached wheel $wheel"
  fi
  rm -rf "$HVD_PREFIX"
  "$PYTHON" -m pip install -q --no-deps --no-index --target "$HVD_PREFIX" "$wheel" || return 1
  PYTHONPATH="$HVD_PREFIX:$PYTHONPATH" "$PYTHON" -c "import horovod.torch as h; assert h.gloo_built(); print('horovod', h.__version__ if hasattr(h, '__version__') else '', 'gloo built')"
}

# ---- the GPU steps -----------------------------------------------------------------------------
throughput_step() {
  "$PYTHON" benchmarks/codec_throughput.py --device cuda --sizes "1M,64M,$GPU_CHECK_SIZE" \
    --codecs qsgd --bits 4,8 --torch-ref --json "$OUT/gpu_check_throughput.json"
}

ncu_step() {
  ncu --clock-control none --target-processes all -k "regex:$NCU_KERNELS" -c 8 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers \
    "$PYTHON" benchmarks/kernel_launches.py --size "$GPU_CHECK_SIZE" --kernels "$NCU_KERNELS"
}

sanitizer_step() {  # fails on any error, and on any hazard in this package's kernels (hq_*)
  local tool rc=0 log
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    log="$(compute-sanitizer --tool "$tool" --print-limit 20 \
           "$PYTHON" benchmarks/kernel_launches.py 2>&1)" || rc=1
    echo "$log"
    grep -Eq "(ERROR|RACECHECK) SUMMARY: 0 (errors|hazards)|SUMMARY: .*\(0 errors" <<<"$log" || rc=1
    if grep -E "(Race reported|Invalid|Error).* hq_" <<<"$log" >/dev/null; then rc=1; fi
  done
  return $rc
}

tests_step() {
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu
}

with_horovod() {  # COMMAND...: with the private Horovod on the paths
  PYTHONPATH="$HVD_PREFIX:$PYTHONPATH" PATH="$HVD_PREFIX/bin:$PATH" "$@"
}

doors_run() {  # NP HOSTS WHAT: the doors' tests under horovodrun's gloo
  echo "== horovodrun -np $1 -H $2 ($3)"
  with_horovod horovodrun -np "$1" -H "$2" --gloo \
    "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/parallel/test_torch_cuda.py
}
doors2x2_step() { doors_run 4 localhost:2,127.0.0.1:2 "2 hosts x 2 ranks: hierarchical"; }
doors2_step() { doors_run 2 localhost:2 "2 ranks, one host: flat"; }

torchrun_nodes() {  # NODES RANKS ARGS...: NODES torchruns of RANKS ranks each on this host
  local nodes=$1 ranks=$2 port=$((29700 + RANDOM % 1000)) pids=() rc=0 node
  shift 2
  for ((node = 0; node < nodes; node++)); do
    "$PYTHON" -m torch.distributed.run --nnodes "$nodes" --node_rank "$node" \
      --master_addr 127.0.0.1 --master_port "$port" --nproc_per_node "$ranks" "$@" &
    pids+=($!)
  done
  for node in "${pids[@]}"; do wait "$node" || rc=1; done
  return $rc
}

ddp_step() {  # the shape not yet run on a GPU (hierarchical) first
  local rc=0
  echo "== torchrun 2 nodes x 2 ranks (hierarchical)"
  torchrun_nodes 2 2 -m pytest -q -x -p no:cacheprovider tests/parallel_ddp/test_ddp_cuda.py || rc=1
  echo "== torchrun 1 node x 2 ranks (flat)"
  torchrun_nodes 1 2 -m pytest -q -x -p no:cacheprovider tests/parallel_ddp/test_ddp_cuda.py || rc=1
  return $rc
}

kernels_step() {
  "$PYTHON" -c "import horovod_quant.gpu as g; print('kernels compiled:', g.compile_kernels())"
}

# ---- the run -----------------------------------------------------------------------------------
export HVD_PREFIX STATE
export -f say die step_field wanted wants_horovod record_step preflight horovod_step \
  kernels_step throughput_step ncu_step sanitizer_step tests_step with_horovod doors_run \
  doors2x2_step doors2_step torchrun_nodes ddp_step
say "output: $OUT; steps: $WANT"
if ! run_step preflight preflight; then
  grep -- '- preflight failed' "$SUMMARY" >&2
  exit 2
fi
{
  echo
  echo "| step | result | seconds | file | what |"
  echo "|---|---|---|---|---|"
  IFS='|' read -r result secs <"$STATE/preflight"
  echo "| preflight | $result | $secs | gpu_check_summary.md | $(step_field preflight 4) |"
} >>"$SUMMARY"
# Horovod's build takes minutes and the CPU only: it starts first, in the background, and the
# doors (never run at 2 x 2 on a GPU) start as soon as it is there
chain_pid=""
if wants_horovod; then
  { run_step horovod horovod_step &&
      { ! wanted doors2x2 || run_step doors2x2 doors2x2_step
        ! wanted doors2 || run_step doors2 doors2_step; }; } &
  chain_pid=$!
fi
run_step kernels kernels_step || say "the kernels do not compile; the GPU steps will fail"
# meanwhile the correctness checks, one after the other (the doors may run beside them)
for step in ddp tests; do wanted "$step" && run_step "$step" "${step}_step"; done
[[ -z $chain_pid ]] || wait "$chain_pid"
for step in doors2x2 doors2; do  # the build failed or ran out of time: say so in their rows
  if wanted "$step" && [[ ! -f "$STATE/$step" ]]; then record_step "$step" "not run (no Horovod)" 0; fi
done
# last, alone on the GPU: the sanitizers, the timed steps and the profiler
for step in sanitizer throughput ncu; do wanted "$step" && run_step "$step" "${step}_step"; done

status=0
for entry in "${STEPS[@]}"; do
  name="${entry%%|*}"
  [[ -f "$STATE/$name" ]] || continue  # steps not asked for
  IFS='|' read -r result _ <"$STATE/$name"
  [[ $result == ok ]] || status=1
done
{
  echo
  echo "Total: $((SECONDS - T0)) s; files in $OUT: $(cd "$OUT" && ls | paste -sd' ' -)."
} >>"$SUMMARY"
cat "$SUMMARY"
exit $status
