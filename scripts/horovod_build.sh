# shellcheck shell=bash
# The recipe that builds Horovod 0.28.1 from its sdist for this package, sourced by
# scripts/install.sh (every machine, CI, images) and scripts/gpu_check.sh (a bare GPU machine
# without network). DEVELOPERS.md ("Why Horovod needs patches") says why each patch exists.
#
#   horovod_patch_source DIR         apply the patches to an unpacked sdist (fails if one does not)
#   horovod_build_wheel SDIST OUT LOG
#                                    unpack, patch and build a wheel into OUT, the log into LOG
#
# Knobs (environment): PYTHON (interpreter to build for, default python3), HQ_HOROVOD_MPI (1:
# with MPI, 0: gloo only), HQ_WITH_TENSORFLOW (1: with TF ops), HQ_HOROVOD_JOBS (parallel
# compile jobs, default the CPU count), HOROVOD_CMAKE (the CMake; CMake 4 is told the oldest
# policy version, which Horovod's bundled gloo predates), HQ_HOROVOD_CUDA_CC (compute
# capabilities of the CUDA kernels Horovod compiles when the torch is a CUDA build, default
# "80,86,89,90").
# Callers define say/die (messages) before sourcing.

# Bump when the patches change, so that cached wheels built without them are not reused.
HOROVOD_PATCH_REV=p5

# The C++ standard the installed torch's headers ask for (ATen.h refuses older ones by name).
_HVD_TORCH_STD='import os, re, torch
aten = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ATen.h")
found = re.search(r"C\+\+(\d+) or later compatible compiler", open(aten).read())
print(max(17, int(found.group(1))) if found else 17)'

_hvd_replace_once() {  # FILE OLD NEW: replaces the one occurrence of OLD in FILE, or fails
  "${PYTHON:-python3}" - "$@" <<'PY' || die "patch did not apply to $1"
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"{path}: expected one occurrence of the patched text, found {text.count(old)}")
open(path, "w").write(text.replace(old, new))
PY
}

horovod_patch_source() {  # DIR: an unpacked horovod-<version> sdist
  local dir="$1"
  # Patch 1: torch 2.x headers need C++17 (torch 2.14's C++20), Horovod 0.28.1 asks for C++14
  # (C++11 for the CUDA kernels, which CUDA 13's headers no longer accept).
  local torch_std
  torch_std="$("${PYTHON:-python3}" -c "$_HVD_TORCH_STD" 2>/dev/null)" || torch_std=17
  _hvd_replace_once "$dir/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
  _hvd_replace_once "$dir/horovod/torch/CMakeLists.txt" \
    'set(CMAKE_CXX_STANDARD 14)' "set(CMAKE_CXX_STANDARD $torch_std)"
  _hvd_replace_once "$dir/horovod/common/ops/cuda/CMakeLists.txt" \
    'set(CMAKE_CUDA_STANDARD 11)' 'set(CMAKE_CUDA_STANDARD 17)'
  # Patch 2: the TF XLA ops (a GPU-XLA feature) include a highwayhash header that TF 2.21
  # wheels no longer ship; leave that source out.
  _hvd_replace_once "$dir/horovod/tensorflow/CMakeLists.txt" \
    $'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n' ''
  # Patch 3: gloo on a host whose own name does not resolve (containers, chroots). Process-set
  # contexts dropped HOROVOD_GLOO_IFACE and fell back to the host name, and gloo read the
  # unset result of a failed getaddrinfo (segfault). Carry the interface over; make the lookup
  # failure an error that says what to set.
  _hvd_replace_once "$dir/horovod/common/gloo/gloo_context.cc" \
    $'  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;' \
    $'  gloo_iface_ = global_context.gloo_iface_;\n  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;'
  _hvd_replace_once "$dir/third_party/gloo/gloo/transport/tcp/device.cc" \
    '  GLOO_ENFORCE_NE(rv, -1);' \
    '  GLOO_ENFORCE_EQ(rv, 0, "getaddrinfo(\"", attr.hostname, "\"): ", gai_strerror(rv), ": this host name does not resolve; set HOROVOD_GLOO_IFACE to a network interface (horovodrun --network-interface) or add the name to /etc/hosts");'
  # Patch 4: Python 3.12 has no distutils (the build asks it for the include folder, horovodrun
  # for which()): the standard library's sysconfig and shutil answer the same.
  _hvd_replace_once "$dir/horovod/torch/CMakeLists.txt" \
    'from distutils.sysconfig import get_python_inc; print(get_python_inc())' \
    "import sysconfig; print(sysconfig.get_paths()['include'])"
  _hvd_replace_once "$dir/horovod/runner/js_run.py" \
    'from distutils.spawn import find_executable' 'from shutil import which as find_executable'
  # Patch 5: setup.py asks for cffi at build time for the PyTorch extension, which nothing uses
  # (the extension is pybind11's); a machine without network and without cffi cannot fetch it.
  _hvd_replace_once "$dir/setup.py" \
    $'if not os.environ.get(\'HOROVOD_WITHOUT_PYTORCH\'):\n    require_list.append(\'cffi>=1.4.0\')\n' ''
}

_hvd_cmake() {  # prints the CMake to build with: HOROVOD_CMAKE, else the system's, else PATH's
  local bin="${HOROVOD_CMAKE:-/usr/bin/cmake}"  # a pip-installed cmake first on PATH may be 4.x
  [[ -x "$bin" ]] || bin="$(command -v cmake)" || die "cmake not found: install CMake 3.13 or newer"
  echo "$bin"
}

_hvd_cuda_home() {  # prints the CUDA toolkit's folder (CUDA_HOME, /usr/local/cuda, nvcc's), if any
  local home="${CUDA_HOME:-}" nvcc
  if [[ -z "$home" && -x /usr/local/cuda/bin/nvcc ]]; then home=/usr/local/cuda; fi
  if [[ -z "$home" ]] && nvcc="$(command -v nvcc)"; then home="$(dirname "$(dirname "$(readlink -f "$nvcc")")")"; fi
  [[ -n "$home" && -f "$home/include/cuda_runtime.h" ]] && echo "$home"
}

horovod_build_wheel() {  # SDIST OUT LOG
  local sdist="$1" out="$2" log="$3" work cmake_bin major t
  [[ -f "$sdist" ]] || die "no Horovod sdist at $sdist"
  work="$(mktemp -d "${TMPDIR:-/tmp}/hq-horovod-build.XXXXXX")"
  tar xzf "$sdist" -C "$work"
  local src=("$work"/horovod-*)
  horovod_patch_source "${src[0]}"
  cmake_bin="$(_hvd_cmake)"
  major="$("$cmake_bin" --version | sed -n 's/^cmake version \([0-9]*\).*/\1/p')"
  local -a env_build=(
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1
    HOROVOD_CMAKE="$cmake_bin" MAKEFLAGS="-j${HQ_HOROVOD_JOBS:-$(nproc)}"
    HOROVOD_BUILD_CUDA_CC_LIST="${HQ_HOROVOD_CUDA_CC:-80,86,89,90}"
  )
  ((major >= 4)) && env_build+=(CMAKE_POLICY_VERSION_MINIMUM=3.5)
  # GCC 13 no longer includes <cstdint>, <string>, <stdexcept> on the way; Horovod relied on it
  env_build+=(CXXFLAGS="${CXXFLAGS:+$CXXFLAGS }-include cstdint -include string -include stdexcept")
  # a CUDA torch makes Horovod compile its CUDA pieces: name the toolkit's folder to CMake and
  # torch alike (an nvcc on PATH may be a wrapper script outside the toolkit)
  local cuda_home
  if cuda_home="$(_hvd_cuda_home)"; then
    env_build+=(CUDA_HOME="$cuda_home" CUDAToolkit_ROOT="$cuda_home" CUDACXX="$cuda_home/bin/nvcc")
  fi
  if [[ "${HQ_HOROVOD_MPI:-1}" == 1 ]]; then env_build+=(HOROVOD_WITH_MPI=1)
  else env_build+=(HOROVOD_WITHOUT_MPI=1); fi
  if [[ "${HQ_WITH_TENSORFLOW:-1}" == 1 ]]; then env_build+=(HOROVOD_WITH_TENSORFLOW=1)
  else env_build+=(HOROVOD_WITHOUT_TENSORFLOW=1); fi
  say "horovod: building a wheel with $cmake_bin (cmake $major), ${env_build[*]}; log: $log"
  t=$SECONDS
  if ! (cd "${src[0]}" && env "${env_build[@]}" "${PYTHON:-python3}" -m pip wheel \
        --no-build-isolation --no-deps --no-index -v -w "$work/dist" .) >"$log" 2>&1; then
    grep -n -m 12 -B 2 -A 8 -E "error:|Error [0-9]|CMake Error|No such file" "$log" >&2
    tail -n 30 "$log" >&2
    rm -rf "$work"
    die "Horovod build failed (full log: $log)"
    return 1  # where the caller's die does not exit
  fi
  say "horovod: wheel built in $((SECONDS - t))s"
  mkdir -p "$out"
  mv "$work"/dist/horovod-*.whl "$out"/
  rm -rf "$work"
}
