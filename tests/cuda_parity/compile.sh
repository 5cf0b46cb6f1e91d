#!/usr/bin/env bash
# Compile every kernels/*.cu with nvcc for sm_80 and sm_90 (-fmad=false, warnings are errors);
# tests/cuda_parity builds the host build of the block programs itself, with the same rule.
# Fails on any error. No GPU needed. About 45 s on 2 cores.
#
#   bash tests/cuda_parity/compile.sh            # compile check (part of `make test`)
#   bash tests/cuda_parity/compile.sh --parity   # also run the CPU parity tests (pytest tests/cuda_parity)
#
# NVCC=/path/to/nvcc overrides the compiler; HQ_SKIP_NVCC=1 skips the check (prints why).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ "${HQ_SKIP_NVCC:-0}" = "1" ]; then
    echo "tests/cuda_parity/compile.sh: skipped (HQ_SKIP_NVCC=1)"
    exit 0
fi
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -z "$NVCC" ]; then
    echo "tests/cuda_parity/compile.sh: nvcc not found (install the CUDA toolkit, set NVCC=..., or" \
         "HQ_SKIP_NVCC=1 to skip)" >&2
    exit 1
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
flags=(-std=c++17 -fmad=false -Werror all-warnings)
archs=(80 90)
shopt -s nullglob
sources=(kernels/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
    echo "tests/cuda_parity/compile.sh: no kernels/*.cu" >&2
    exit 1
fi
echo "== nvcc $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'): ${sources[*]}"

# one nvcc per file and architecture: levels.cu takes 25 s per architecture, the others 2-6 s,
# so a job per file would leave one core compiling levels.cu alone for most of the step
jobs=()
for src in "${sources[@]}"; do
    for arch in "${archs[@]}"; do
        name="$(basename "$src" .cu).sm_$arch"
        ( "$NVCC" -c "${flags[@]}" -gencode "arch=compute_$arch,code=sm_$arch" "$src" \
            -o "$out/$name.o" > "$out/$name.log" 2>&1 \
          || { echo "FAILED: $src (sm_$arch)"; cat "$out/$name.log"; exit 1; } ) &
        jobs+=($!)
    done
done

status=0
for j in "${jobs[@]}"; do wait "$j" || status=1; done
if [ $status -ne 0 ]; then
    echo "tests/cuda_parity/compile.sh: FAILED" >&2
    exit 1
fi
echo "tests/cuda_parity/compile.sh: ${#sources[@]} kernel files compile (${archs[*]/#/sm_})"

if [ "${1:-}" = "--parity" ]; then
    "${PYTHON:-python3}" -m pytest -q tests/cuda_parity
fi
