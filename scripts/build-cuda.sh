#!/usr/bin/env bash
# Builds (or type-checks) the CUDA + NCCL code of Oobleck-rs on a machine with no system CUDA.
#
#   scripts/build-cuda.sh [build]   release `train` and `oobleck` with --features cuda,nccl
#   scripts/build-cuda.sh check     `cargo check` of the whole workspace with the GPU features (CI)
#
# The CUDA toolkit (nvcc, headers, cudart, nvvm) comes from NVIDIA's PyPI wheels, pinned to one
# release, installed into a virtual environment inside the project ($CUDA_VENV, default
# .cuda-venv/). Nothing outside the project is changed. `build` also installs the runtime
# libraries the binaries link against (cuBLAS, cuRAND, NVRTC, NCCL) and, where the machine has
# no NVIDIA driver, links against a stub libcuda.so made from cudarc's own list of driver
# functions: the binary then needs the real driver (libcuda.so.1) only when it runs.
#
# Environment: CUDA_COMPUTE_CAP (default 90, the H100/H200) is the GPU generation nvcc compiles
# candle's kernels for; CUDAFORGE_THREADS (default: every CPU) how many nvcc run at once;
# CARGO_TARGET_DIR is respected; CUDA_VENV moves the environment.
set -euo pipefail

mode="${1:-build}"
case "$mode" in
  build | check) ;;
  -h | --help)
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *)
    echo "usage: scripts/build-cuda.sh [build|check]" >&2
    exit 2
    ;;
esac

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
started=$SECONDS

# One CUDA release for every wheel: a newer nvvm than nvcc fails in ptxas with a version error.
cuda_release="13.2"
toolkit_wheels=(
  "nvidia-cuda-nvcc==${cuda_release}.*"
  "nvidia-cuda-crt==${cuda_release}.*"
  "nvidia-cuda-runtime==${cuda_release}.*"
  "nvidia-cuda-cccl==${cuda_release}.*"
  "nvidia-nvvm==${cuda_release}.*"
)
# What `-lnvrtc -lcublas -lcublasLt -lcurand -lnccl` need at link time (cudarc links them
# dynamically under candle's `cuda` feature; -lcudart is the toolkit's nvidia-cuda-runtime).
# cuBLAS 13.2 and cuRAND 10.4 ship with CUDA 13.2.
link_wheels=(
  "nvidia-cuda-nvrtc==${cuda_release}.*"
  "nvidia-cublas==13.2.*"
  "nvidia-curand==10.4.*"
  "nvidia-nccl-cu13==2.*"
)

venv="${CUDA_VENV:-$root/.cuda-venv}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
# candle-kernels' build script compiles its kernels with half the machine's threads unless
# told otherwise: on a 2-core CI machine that is one nvcc at a time, most of a cold check.
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"

echo "== scripts/build-cuda.sh $mode"
echo "   CUDA ${cuda_release} toolkit from PyPI wheels into ${venv#"$root"/}/"
echo "   CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} (kernels for sm_${CUDA_COMPUTE_CAP}; set it to change)"
echo "   CUDAFORGE_THREADS=${CUDAFORGE_THREADS} (nvcc processes at once for candle's kernels)"
echo "   target dir: ${CARGO_TARGET_DIR:-$root/target}"

die() {
  echo "build-cuda.sh: $*" >&2
  exit 1
}

# The first of its arguments (expanded globs) that exists, or nothing.
first_existing() {
  local path
  for path in "$@"; do
    if [[ -e "$path" ]]; then
      echo "$path"
      return
    fi
  done
}

# Creates the virtual environment, or says what to install when this Python cannot.
make_venv() {
  [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -m pip --version >/dev/null 2>&1 && return
  [[ ! -e "$venv" || -f "$venv/pyvenv.cfg" ]] ||
    die "$venv exists and is not a virtual environment: move it away or set CUDA_VENV"
  command -v python3 >/dev/null ||
    die "python3 is missing: install it (Debian: apt-get install python3 python3-venv)"
  rm -rf "$venv"
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"
    die "python3 cannot create a virtual environment with pip:" \
      "install python3-venv (Debian: apt-get install python3-venv python3-pip)"
  fi
  "$venv/bin/python" -m pip --version >/dev/null 2>&1 ||
    die "the virtual environment has no pip: install python3-pip (Debian: apt-get install python3-pip)"
}

# pip-installs the wheels unless the stamp says this exact list is already in.
install_wheels() {
  local stamp="$venv/.installed-$1"
  shift
  local want="$*"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "   wheels already installed: $want"
    return
  fi
  local t0=$SECONDS
  echo "   pip install $want"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input "$@" ||
    die "pip install failed (PyPI must be reachable): $want"
  echo "$want" >"$stamp"
  echo "   pip install took $((SECONDS - t0)) s"
}

# The wheels ship versioned libraries only (libcublas.so.13): `-lcublas` needs the unversioned
# name, so link names are made beside them, in cudarc's search path ($CUDA_ROOT/lib).
link_unversioned() {
  local into="$1" from="$2" name="$3" found
  found="$(first_existing "$from/$name".so.*)"
  [[ -n "$found" ]] || die "no $name.so.* in $from after pip install"
  ln -sfn "$found" "$into/$name.so"
}

# A stub libcuda.so (soname libcuda.so.1, like the one NVIDIA's toolkit ships in lib/stubs) that
# defines every driver function cudarc declares: the linker resolves against it and the binary
# loads the real driver at run time. It is never on the run-time library path.
make_libcuda_stub() {
  local stubs="$1/stubs" version src
  version="$(grep -A1 '^name = "cudarc"$' Cargo.lock | sed -n 's/^version = "\(.*\)"$/\1/p')"
  [[ -n "$version" ]] || die "cudarc is not in Cargo.lock"
  cargo fetch --locked --quiet
  src="$(first_existing "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-"$version"/src/driver/sys/mod.rs)"
  [[ -n "$src" ]] || die "cudarc $version's source is not in the cargo registry after cargo fetch"
  command -v cc >/dev/null || die "cc is missing (Debian: apt-get install gcc)"
  mkdir -p "$stubs"
  grep -A1 'extern "C" {' "$src" | sed -n 's/^ *fn \([A-Za-z0-9_]*\)(.*/\1/p' | sort -u |
    sed 's/.*/int &(void) { return 999; }/' >"$stubs/libcuda-stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$stubs/libcuda-stub.c"
  echo "   stub libcuda.so: $(grep -c . "$stubs/libcuda-stub.c") driver functions of cudarc $version"
}

# Everything `build` links against, under $CUDA_ROOT/lib where cudarc's build script looks.
prepare_link() {
  local lib="$1/lib" nccl_lib
  nccl_lib="$(dirname "$1")/nccl/lib"
  # cudart: candle-kernels links its statically compiled GGUF/MoE kernels with -lcudart.
  for name in libcudart libnvrtc libcublas libcublasLt libcurand; do
    link_unversioned "$lib" "$lib" "$name"
  done
  link_unversioned "$lib" "$nccl_lib" libnccl
  make_libcuda_stub "$lib"
  runtime_path="$lib:$nccl_lib"
  if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
    echo "   NVIDIA driver found (libcuda.so.1): the binaries can run here"
  else
    echo "   no NVIDIA driver here (no libcuda.so.1): the binaries link against a stub and need"
    echo "   the driver installed on the machine that runs them"
  fi
}

make_venv
install_wheels toolkit "${toolkit_wheels[@]}"

cuda_root="$(first_existing "$venv"/lib/python3*/site-packages/nvidia/cu13)"
[[ -n "$cuda_root" && -x "$cuda_root/bin/nvcc" ]] ||
  die "no nvidia/cu13/bin/nvcc under $venv after pip install"
export CUDA_ROOT="$cuda_root" CUDA_PATH="$cuda_root" PATH="$cuda_root/bin:$PATH"
echo "   CUDA_ROOT=$CUDA_ROOT"
nvcc --version | tail -n 2 | head -n 1 | sed 's/^/   nvcc: /'

if [[ "$mode" == check ]]; then
  echo "== cargo check --workspace --all-targets --locked --features oobleck-cli/cuda,oobleck-cli/nccl"
  t0=$SECONDS
  cargo check --workspace --all-targets --locked --features oobleck-cli/cuda,oobleck-cli/nccl
  echo "   cargo check took $((SECONDS - t0)) s"
else
  install_wheels link "${link_wheels[@]}"
  prepare_link "$cuda_root"
  echo "== cargo build --release --locked -p oobleck-cli --features cuda,nccl --bin train --bin oobleck"
  t0=$SECONDS
  cargo build --release --locked -p oobleck-cli --features cuda,nccl --bin train --bin oobleck
  echo "   cargo build took $((SECONDS - t0)) s"
  echo "   binaries: ${CARGO_TARGET_DIR:-$root/target}/release/{train,oobleck}"
  echo "   they load cudart, cuBLAS, cuRAND, NVRTC and NCCL from the wheels; run them with"
  echo "   LD_LIBRARY_PATH=$runtime_path"
fi
echo "== build-cuda.sh $mode done in $((SECONDS - started)) s"
