#!/usr/bin/env bash
# Build (or reuse) Horovod 0.28.1 against the torch (and, optionally, the
# TensorFlow) installed in a venv, install it there and check it with a
# 2-process horovodrun job.
#
#   bash scripts/install_horovod.sh [VENV]        (default: $VENV or ./.venv)
#   GTOPK_HOROVOD_TF=1 bash scripts/install_horovod.sh [VENV]
#
# Why a script: Horovod 0.28.1 (the newest release) sets CMAKE_CXX_STANDARD 14,
# but the headers of torch >= 2.1 need C++17, so the published sdist does not
# build against current torch.  This script downloads that sdist, raises the
# standard to 17 in the two CMake files that set it (nothing else is changed;
# horovod/tensorflow/CMakeLists.txt already uses 17), and builds a wheel with:
#   HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1
#   TensorFlow on when `import tensorflow` works in the venv,
#   MPI on only when an MPI compiler wrapper (mpicxx) is found.
#
# TensorFlow: GTOPK_HOROVOD_TF=1 first installs $GTOPK_TF_SPEC (default
# tensorflow-cpu==2.15.1, the newest release Horovod 0.28.1 builds against:
# the headers of TF >= 2.16 include highwayhash/arch_specific.h, which the
# TF wheels do not ship) and then builds Horovod with TensorFlow too.
# GTOPK_HOROVOD_TF=0 builds without TensorFlow even when it is importable.
# Unset: TensorFlow support follows `import tensorflow`.
#
# The wheel is cached under ${XDG_CACHE_HOME:-~/.cache}/gtopk_plugin/horovod/,
# keyed by Horovod, torch, Python and TensorFlow versions (and MPI), so a
# later run on the same machine installs in seconds.  The build itself takes
# about 9 minutes on 2 cores (longer with TensorFlow).
#
# Idempotent: when the venv already holds a verified install for the same key
# (a stamp file written after the smoke test passed), it exits at once.
# GTOPK_HOROVOD_FORCE=1 rebuilds; GTOPK_HOROVOD_SKIP_SMOKE=1 skips the check.
set -euo pipefail

HVD_VERSION=0.28.1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VENV:-$REPO/.venv}}"
VENV="$(cd "$VENV" 2>/dev/null && pwd)" || { echo "install_horovod: no virtual environment at ${1:-${VENV:-$REPO/.venv}}" >&2; exit 2; }
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install_horovod: $PY not found (is $VENV a venv?)" >&2; exit 2; }

log() { echo "[install_horovod] $*"; }
die() { echo "[install_horovod] ERROR: $*" >&2; exit 1; }

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" \
    || die "torch is not importable from $PY; install torch into the venv first (make setup)"
PY_TAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
ARCH="$(uname -m)"

# TensorFlow: Horovod 0.28.1 builds against TF 2.12-2.15 only (newer TF
# headers include highwayhash/arch_specific.h, which TF's wheels lack).
TF_SPEC="${GTOPK_TF_SPEC:-tensorflow-cpu==2.15.1}"
TF_WANT="${GTOPK_HOROVOD_TF:-auto}"
tf_version() { "$PY" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null; }
tf_supported() { case "$1" in 2.12.*|2.13.*|2.14.*|2.15.*) return 0 ;; *) return 1 ;; esac; }
if [ "$TF_WANT" = 1 ] && ! tf_supported "$(tf_version || true)"; then
    log "installing $TF_SPEC (found: $(tf_version || echo 'no TensorFlow'))"
    "$PY" -m pip install -q "$TF_SPEC" || die "could not install $TF_SPEC into $VENV"
fi
WITH_TF=0
TF_VERSION=""
if [ "$TF_WANT" != 0 ]; then
    TF_VERSION="$(tf_version || true)"
    if [ -n "$TF_VERSION" ] && tf_supported "$TF_VERSION"; then
        WITH_TF=1
    elif [ "$TF_WANT" = 1 ]; then
        die "TensorFlow '${TF_VERSION:-none}' in $VENV after installing $TF_SPEC; Horovod $HVD_VERSION builds against TF 2.12-2.15 only (or set GTOPK_HOROVOD_TF=0)"
    elif [ -n "$TF_VERSION" ]; then
        log "TensorFlow $TF_VERSION is installed, but Horovod $HVD_VERSION builds against TF 2.12-2.15 only: building without TensorFlow (GTOPK_HOROVOD_TF=1 installs $TF_SPEC)"
    fi
fi
[ "$WITH_TF" = 1 ] || TF_VERSION=""
WITH_MPI=0
if command -v mpicxx >/dev/null 2>&1; then WITH_MPI=1; fi
# TensorFlow / MPI choices are part of the cache key: a wheel built without
# TF must not be reused once TF is installed, nor one built against another TF.
if [ "$WITH_TF" = 1 ]; then TF_KEY="tf-${TF_VERSION}"; else TF_KEY="tf0"; fi
KEY="horovod-${HVD_VERSION}-torch-${TORCH_VERSION}-${PY_TAG}-${ARCH}-${TF_KEY}-mpi${WITH_MPI}"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/gtopk_plugin/horovod"
CACHE_DIR="$CACHE_ROOT/$KEY"
STAMP="$VENV/.horovod-installed"

installed_ok() {
    # Horovod's torch extension loads against *this* torch (an ABI mismatch
    # fails at import) and reports the expected version.
    "$PY" - <<EOF >/dev/null 2>&1
import horovod, horovod.torch as hvd
assert horovod.__version__ == "$HVD_VERSION", horovod.__version__
assert hvd.gloo_built()
if "$WITH_TF" == "1":
    import horovod.tensorflow as hvd_tf
    assert hvd_tf.gloo_built()
EOF
}

if [ "${GTOPK_HOROVOD_FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && installed_ok; then
    log "Horovod $HVD_VERSION already installed and verified in $VENV ($KEY)"
    exit 0
fi

# One build at a time per cache (two `make test` runs started together wait
# here; the second then finds the wheel).
mkdir -p "$CACHE_ROOT"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE_ROOT/.lock"
    flock 9
fi

WHEEL="$(ls "$CACHE_DIR"/horovod-"$HVD_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ "${GTOPK_HOROVOD_FORCE:-0}" = 1 ]; then WHEEL=""; fi

if [ -z "$WHEEL" ]; then
    # ---- tool checks: fail early with a clear message -----------------------
    # A cmake 4.x (e.g. `pip install cmake`) refuses the cmake_minimum_required
    # of Horovod's bundled gloo; prefer the system cmake 3.x when both exist,
    # and set CMAKE_POLICY_VERSION_MINIMUM so a 4.x still works.
    CMAKE_BIN=""
    for c in "${HOROVOD_CMAKE:-}" /usr/bin/cmake /usr/local/bin/cmake "$(command -v cmake || true)"; do
        if [ -n "$c" ] && [ -x "$c" ]; then CMAKE_BIN="$c"; break; fi
    done
    [ -n "$CMAKE_BIN" ] || die "cmake not found. Install CMake >= 3.13 (e.g. 'apt-get install cmake') and rerun."
    CXX_BIN="${CXX:-$(command -v c++ || command -v g++ || command -v clang++ || true)}"
    [ -n "$CXX_BIN" ] && command -v "$CXX_BIN" >/dev/null 2>&1 \
        || die "no C++ compiler found. Install one with C++17 support (e.g. 'apt-get install g++') and rerun."
    CC_BIN="${CC:-$(command -v cc || command -v gcc || command -v clang || true)}"
    [ -n "$CC_BIN" ] || die "no C compiler found (e.g. 'apt-get install gcc')."
    echo 'int main(){ if constexpr (true) return 0; }' > "${TMPDIR:-/tmp}/gtopk_cxx17_$$.cpp"
    "$CXX_BIN" -std=c++17 -c -o /dev/null "${TMPDIR:-/tmp}/gtopk_cxx17_$$.cpp" 2>/dev/null \
        || { rm -f "${TMPDIR:-/tmp}/gtopk_cxx17_$$.cpp"; die "$CXX_BIN cannot compile C++17; PyTorch's headers need it."; }
    rm -f "${TMPDIR:-/tmp}/gtopk_cxx17_$$.cpp"
    log "cmake: $CMAKE_BIN ($("$CMAKE_BIN" --version | head -n1)); C++: $CXX_BIN"

    # --no-build-isolation: the build must compile against the venv's torch.
    "$PY" -m pip install -q setuptools wheel packaging

    WORK="$(mktemp -d "${TMPDIR:-/tmp}/gtopk_hvd_build.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
    SDIST_CACHE="$CACHE_ROOT/sdist"
    mkdir -p "$SDIST_CACHE"
    SDIST="$(ls "$SDIST_CACHE"/horovod-"$HVD_VERSION".tar.gz 2>/dev/null || true)"
    if [ -z "$SDIST" ]; then
        log "downloading the horovod==$HVD_VERSION sdist"
        "$PY" -m pip download -q --no-binary :all: --no-deps "horovod==$HVD_VERSION" -d "$SDIST_CACHE" \
            || die "could not download horovod==$HVD_VERSION from the package index"
        SDIST="$SDIST_CACHE/horovod-$HVD_VERSION.tar.gz"
    fi
    tar -xzf "$SDIST" -C "$WORK"
    SRC="$WORK/horovod-$HVD_VERSION"

    # The one source change: C++14 -> C++17 (torch >= 2.1 headers need 17).
    for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
        grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || grep -q 'set(CMAKE_CXX_STANDARD 17)' "$f" \
            || die "unexpected $f: no 'set(CMAKE_CXX_STANDARD 14)' line to patch"
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
    done

    export HOROVOD_CMAKE="$CMAKE_BIN" CMAKE_POLICY_VERSION_MINIMUM=3.5
    export CC="$CC_BIN" CXX="$CXX_BIN"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1
    if [ "$WITH_TF" = 1 ]; then export HOROVOD_WITH_TENSORFLOW=1; unset HOROVOD_WITHOUT_TENSORFLOW || true
    else export HOROVOD_WITHOUT_TENSORFLOW=1; unset HOROVOD_WITH_TENSORFLOW || true; fi
    if [ "$WITH_MPI" = 1 ]; then export HOROVOD_WITH_MPI=1; unset HOROVOD_WITHOUT_MPI || true
    else export HOROVOD_WITHOUT_MPI=1; unset HOROVOD_WITH_MPI || true; fi
    JOBS="$(nproc 2>/dev/null || echo 2)"
    export CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" MAKEFLAGS="-j$JOBS"
    log "building the wheel ($KEY); this takes about 9 minutes on 2 cores (longer with TensorFlow)"
    mkdir -p "$WORK/wheel"
    "$PY" -m pip wheel --no-build-isolation --no-deps -w "$WORK/wheel" "$SRC" \
        || die "the Horovod build failed (see the compiler output above)"
    BUILT="$(ls "$WORK"/wheel/horovod-"$HVD_VERSION"-*.whl | head -n1)"
    mkdir -p "$CACHE_DIR"
    # Copy then rename, so an interrupted run never leaves a half wheel in the cache.
    cp "$BUILT" "$CACHE_DIR/.partial.whl"
    mv "$CACHE_DIR/.partial.whl" "$CACHE_DIR/$(basename "$BUILT")"
    WHEEL="$CACHE_DIR/$(basename "$BUILT")"
    log "cached $WHEEL"
else
    log "reusing cached wheel $WHEEL"
fi

# Runtime dependencies come from the index as usual; torch is not among them,
# so this never replaces the venv's torch.
"$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL"
# Second pass resolves the wheel's own requirements (cloudpickle, cffi,
# psutil, pyyaml, packaging) without reinstalling Horovod.
"$PY" -m pip install -q "$WHEEL"
rm -f "$STAMP"
installed_ok || die "Horovod installed but 'import horovod.torch' (or horovod.tensorflow) fails in $VENV (torch/TF ABI mismatch? rerun with GTOPK_HOROVOD_FORCE=1)"

if [ "${GTOPK_HOROVOD_SKIP_SMOKE:-0}" != 1 ]; then
    log "smoke test: horovodrun -np 2 -H localhost:2 --gloo"
    SMOKE="$(mktemp "${TMPDIR:-/tmp}/gtopk_hvd_smoke.XXXXXX.py")"
    cat > "$SMOKE" <<'EOF'
import torch, horovod.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
s = hvd.allreduce(torch.ones(3) * (r + 1), op=hvd.Sum, name="smoke.ar")
assert torch.equal(s, torch.full((3,), float(P * (P + 1) // 2))), s
g = hvd.allgather(torch.full((r + 1, 2), float(r)), name="smoke.ag")
assert g.shape[0] == P * (P + 1) // 2, g.shape
splits = torch.tensor([0] * P, dtype=torch.int32)
splits[(r + 1) % P] = r + 1
out = hvd.alltoall(torch.full((r + 1,), float(r)), splits=splits, name="smoke.a2a")
out = out[0] if isinstance(out, tuple) else out
src = (r - 1) % P
assert torch.equal(out, torch.full((src + 1,), float(src))), out
print("horovod smoke ok on rank", r, flush=True)
EOF
    if [ "$WITH_TF" = 1 ]; then
        cat >> "$SMOKE" <<'EOF'
import tensorflow as tf, horovod.tensorflow as hvd_tf
hvd_tf.init()
s = hvd_tf.allreduce(tf.ones(3) * (r + 1), op=hvd_tf.Sum, name="smoke.tf.ar")
assert (s.numpy() == P * (P + 1) // 2).all(), s
g = hvd_tf.allgather(tf.fill([r + 1, 2], float(r)), name="smoke.tf.ag")
assert g.shape[0] == P * (P + 1) // 2, g.shape
print("horovod-tensorflow smoke ok on rank", r, flush=True)
EOF
    fi
    # One retry: on a loaded machine Horovod's gloo rendezvous of the second
    # framework (TF after torch in one process) can race ("Connection
    # refused"); a second failure is real.
    smoke() { PATH="$VENV/bin:$PATH" timeout 180 "$VENV/bin/horovodrun" -np 2 -H localhost:2 --gloo "$PY" "$SMOKE"; }
    smoke || { log "smoke test failed once; retrying"; sleep 5; smoke; } \
        || { rm -f "$SMOKE"; die "the 2-process horovodrun smoke test failed twice"; }
    rm -f "$SMOKE"
fi
echo "$KEY" > "$STAMP"
log "Horovod $HVD_VERSION ready in $VENV"
