# shellcheck shell=bash
# The recipe that builds Horovod 0.28.1 from its sdist for this package, sourced by
# scripts/install.sh (every machine, CI, images) and scripts/gpu_check.sh (a bare GPU machine
# without network). DEVELOPERS.md ("Why Horovod needs patches") says why each patch exists.
#
#   horovod_patch_source DIR         apply the patches to an unpacked sdist (fails if one does not)
#   horovod_build_wheel SDIST OUT LOG
#                                    unpack, patch and build a wheel into OUT, the log into LOG
#   horovod_gpu_key                  the GPU part of a wheel's cache key (empty for a CPU build)
#   hvd_cuda_toolkit_from_wheels DIR make DIR a CUDA toolkit folder from the nvidia-* wheels
#
# Knobs (environment): PYTHON (interpreter to build for, default python3), HQ_HOROVOD_MPI (1:
# with MPI, 0: gloo only), HQ_WITH_TENSORFLOW (1: with TF ops), HQ_HOROVOD_JOBS (parallel
# compile jobs, default the CPU count), HOROVOD_CMAKE (the CMake; CMake 4 is told the oldest
# policy version, which Horovod's bundled gloo predates), HQ_HOROVOD_CUDA_CC (compute
# capabilities of the CUDA kernels Horovod compiles when the torch is a CUDA build, default
# "80,86,89,90"), HOROVOD_GPU_OPERATIONS (NCCL: GPU collectives; NCCL is taken from
# HOROVOD_NCCL_HOME / _INCLUDE / _LIB, else from the CUDA toolkit folder, which holds the
# nvidia-nccl wheel's files when it is made from the wheels).
# The CUDA toolkit (nvcc, headers) is, in this order: CUDA_HOME; /usr/local/cuda; the
# nvidia-cuda-nvcc wheel installed beside torch (pip pins it to torch's CUDA:
# cuda-toolkit[nvcc]); the nvcc on PATH.
# Callers define say/die (messages) before sourcing.

# Bump when the patches change, so that cached wheels built without them are not reused.
HOROVOD_PATCH_REV=p6
HOROVOD_DEFAULT_CUDA_CC=80,86,89,90  # A100 8.0, A10/A40 8.6, L4/L40 8.9, H100 9.0

# The installed torch's folder, found without importing torch: the steps below only read its
# files, and an import of torch costs seconds (every install step asks).
hvd_torch_dir() {
  "${PYTHON:-python3}" -c \
    'import importlib.util; print(importlib.util.find_spec("torch").submodule_search_locations[0])'
}

# Prints "<version> <CUDA version or none>" of the installed torch (its version.py).
hvd_torch_version() {
  local dir
  dir="$(hvd_torch_dir)" || return 1
  "${PYTHON:-python3}" - "$dir/version.py" <<'PY'
import runpy, sys
found = runpy.run_path(sys.argv[1])
print(found["__version__"], found["cuda"] or "none")
PY
}

# The C++ standard the headers at ATen.h's path (argv[1]) ask for (it refuses older ones by name).
_HVD_TORCH_STD='import re, sys
found = re.search(r"C\+\+(\d+) or later compatible compiler", open(sys.argv[1]).read())
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
  torch_std="$("${PYTHON:-python3}" -c "$_HVD_TORCH_STD" \
               "$(hvd_torch_dir)/include/ATen/ATen.h" 2>/dev/null)" || torch_std=17
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
  # Patch 6: one gloo. Patch 1 already compiles the bundled gloo as C++17, so the C++17 copy
  # made for TensorFlow compiles the same sources with the same flags once more; TF links the
  # one gloo when their C++ ABIs agree (the copy stays for a TF of the old ABI).
  _hvd_replace_once "$dir/CMakeLists.txt" \
    'if(HAVE_GLOO AND (DEFINED Tensorflow_CXX17 AND Tensorflow_CXX17))' \
    'if(HAVE_GLOO AND (DEFINED Tensorflow_CXX17 AND Tensorflow_CXX17 AND NOT Tensorflow_CXX11))'
  _hvd_replace_once "$dir/horovod/tensorflow/CMakeLists.txt" \
    $'    if (Tensorflow_CXX17)\n       list(APPEND TF_LINKER_LIBS compatible17_gloo)' \
    $'    if (Tensorflow_CXX17 AND NOT Tensorflow_CXX11)\n       list(APPEND TF_LINKER_LIBS compatible17_gloo)'
  # Patch 7: no debug information: in TF's and torch's headers it costs a third of the compile
  # time (and most of the wheel); the optimization stays -O3 and the symbols stay for backtraces.
  _hvd_replace_once "$dir/CMakeLists.txt" \
    'string(REPLACE "-O2" "-O3" CMAKE_CXX_FLAGS_RELWITHDEBINFO "${CMAKE_CXX_FLAGS_RELWITHDEBINFO}")' \
    'string(REPLACE "-O2 -g" "-O3" CMAKE_CXX_FLAGS_RELWITHDEBINFO "${CMAKE_CXX_FLAGS_RELWITHDEBINFO}")'
  _hvd_replace_once "$dir/CMakeLists.txt" \
    'string(REPLACE "-O2" "-O3" CMAKE_C_FLAGS_RELWITHDEBINFO "${CMAKE_C_FLAGS_RELWITHDEBINFO}")' \
    'string(REPLACE "-O2 -g" "-O3" CMAKE_C_FLAGS_RELWITHDEBINFO "${CMAKE_C_FLAGS_RELWITHDEBINFO}")'
}

_hvd_cmake() {  # prints the CMake to build with: HOROVOD_CMAKE, else the system's, else PATH's
  local bin="${HOROVOD_CMAKE:-/usr/bin/cmake}"  # a pip-installed cmake first on PATH may be 4.x
  [[ -x "$bin" ]] || bin="$(command -v cmake)" || die "cmake not found: install CMake 3.13 or newer"
  echo "$bin"
}

# The nvidia-* wheels put nvcc, headers and libraries in folders of site-packages/nvidia/
# (CUDA 13: cu13/ for the toolkit, nccl/, cudnn/ beside it). Merged into one folder of symlinks
# they are a toolkit as CMake, torch's extension builder and nvcc's own link line expect it:
# the unversioned library names (libcudart.so, libnccl.so) they link by, and lib64.
hvd_cuda_toolkit_from_wheels() {  # DIR: made (again) from the wheels of $PYTHON; fails without nvcc
  "${PYTHON:-python3}" - "$1" <<'PY'
import importlib.util, os, re, shutil, sys

dest = sys.argv[1]
MARK = ".hq-cuda-toolkit-from-wheels"
spec = importlib.util.find_spec("nvidia")
roots = [os.path.join(top, d) for top in (spec.submodule_search_locations if spec else [])
         for d in sorted(os.listdir(top)) if os.path.isdir(os.path.join(top, d))]
if not any(os.path.isfile(os.path.join(r, "bin", "nvcc")) for r in roots):
    sys.exit(f"no nvcc among the nvidia-* wheels of {sys.executable}: install the one of torch's "
             "CUDA (pip install 'cuda-toolkit[nvcc,cccl]') or set CUDA_HOME to a CUDA toolkit")
if os.path.lexists(dest):
    if not os.path.isfile(os.path.join(dest, MARK)):
        sys.exit(f"{dest} exists and was not made from the wheels: remove it or name another")
    shutil.rmtree(dest)


def merge(src, dst):  # dst gets a link to each entry of src; folders both have are merged
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if not os.path.lexists(d):
            os.symlink(s, d)
        elif os.path.isdir(s) and os.path.isdir(d):
            if os.path.islink(d):  # a linked folder becomes a real one holding both
                first = os.readlink(d)
                os.unlink(d)
                merge(first, d)
            merge(s, d)


for root in roots:
    for sub in ("bin", "include", "lib", "nvvm"):
        if os.path.isdir(os.path.join(root, sub)):
            merge(os.path.join(root, sub), os.path.join(dest, sub))
lib = os.path.join(dest, "lib")
for name in sorted(os.listdir(lib)) if os.path.isdir(lib) else []:
    m = re.fullmatch(r"(lib.+\.so)(\.\d+)+", name)
    if m and not os.path.lexists(os.path.join(lib, m.group(1))):
        os.symlink(name, os.path.join(lib, m.group(1)))
os.symlink("lib", os.path.join(dest, "lib64"))  # nvcc links with -L<toolkit>/lib64
open(os.path.join(dest, MARK), "w").write("\n".join(roots) + "\n")
PY
}

_hvd_has_nvcc_wheel() {  # succeeds when $PYTHON has an nvidia-* wheel with bin/nvcc
  "${PYTHON:-python3}" -c 'import glob, importlib.util, os, sys
spec = importlib.util.find_spec("nvidia")
tops = spec.submodule_search_locations if spec else []
sys.exit(not any(glob.glob(os.path.join(top, "*", "bin", "nvcc")) for top in tops))' 2>/dev/null
}

# Prints the CUDA toolkit's folder (see the head of this file for the order), if there is one;
# a toolkit from the wheels is made in SCRATCH. Fails when CUDA_HOME names no toolkit.
_hvd_cuda_home() {  # SCRATCH
  local home="${CUDA_HOME:-}" nvcc
  if [[ -n "$home" ]]; then
    if [[ ! -f "$home/include/cuda_runtime.h" ]]; then
      die "CUDA_HOME=$home has no include/cuda_runtime.h: name a CUDA toolkit or unset it"
      return 1
    fi
    echo "$home"
    return
  fi
  # a system toolkit first (the one the H100 build used), then one made from the wheels
  if [[ -x /usr/local/cuda/bin/nvcc && -f /usr/local/cuda/include/cuda_runtime.h ]]; then
    echo /usr/local/cuda
    return
  fi
  if _hvd_has_nvcc_wheel; then
    if ! hvd_cuda_toolkit_from_wheels "$1/cuda" >&2; then
      die "no CUDA toolkit made from the nvidia-* wheels"
      return 1
    fi
    echo "$1/cuda"
    return
  fi
  if nvcc="$(command -v nvcc)"; then home="$(dirname "$(dirname "$(readlink -f "$nvcc")")")"; fi
  if [[ -n "$home" && -f "$home/include/cuda_runtime.h" ]]; then echo "$home"; fi
}

# The GPU part of a Horovod wheel's cache key: empty for a CPU torch without GPU operations (the
# keys of CPU wheels stay as they were), else torch's CUDA, the GPU operations and the compute
# capabilities, so that CPU and GPU wheels, or GPU wheels of two flavours, never mix.
horovod_gpu_key() {
  local cuda ops="${HOROVOD_GPU_OPERATIONS:-}" cc="${HQ_HOROVOD_CUDA_CC:-$HOROVOD_DEFAULT_CUDA_CC}"
  read -r _ cuda < <(hvd_torch_version) || die "cannot read the installed torch's CUDA version"
  [[ "$cuda" == none ]] && cuda=""
  [[ -z "$cuda" && -z "$ops" ]] && return 0
  ops="${ops:-nogpuops}"
  printf '_cuda%s-%s-cc%s' "${cuda:-none}" "${ops,,}" "${cc//,/.}"
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
    HOROVOD_BUILD_CUDA_CC_LIST="${HQ_HOROVOD_CUDA_CC:-$HOROVOD_DEFAULT_CUDA_CC}"
  )
  ((major >= 4)) && env_build+=(CMAKE_POLICY_VERSION_MINIMUM=3.5)
  # GCC 13 no longer includes <cstdint>, <string>, <stdexcept> on the way; Horovod relied on it
  env_build+=(CXXFLAGS="${CXXFLAGS:+$CXXFLAGS }-include cstdint -include string -include stdexcept")
  # a CUDA torch makes Horovod compile its CUDA pieces: name the toolkit's folder to CMake,
  # torch and Horovod's own nvcc lookup alike (an nvcc on PATH may be a wrapper script outside
  # the toolkit, or another CUDA's)
  local cuda_home
  cuda_home="$(_hvd_cuda_home "$work")" || { rm -rf "$work"; return 1; }
  if [[ -n "$cuda_home" ]]; then
    env_build+=(CUDA_HOME="$cuda_home" CUDAToolkit_ROOT="$cuda_home" CUDACXX="$cuda_home/bin/nvcc"
                HOROVOD_CUDA_HOME="$cuda_home")
    # NCCL where no other is named: the toolkit folder's (the nvidia-nccl wheel's files when it
    # is made from the wheels; NCCL installed into the toolkit otherwise)
    if [[ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}${HOROVOD_NCCL_LIB:-}" \
          && -f "$cuda_home/include/nccl.h" ]]; then
      env_build+=(HOROVOD_NCCL_HOME="$cuda_home")
    fi
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
