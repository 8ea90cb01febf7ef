#!/usr/bin/env bash
# Set up a development machine from a clean clone, then run the demo or the tests.
#
#   deploy/dev.sh demo    install what is missing, pack a generated dataset, mount it,
#                         read it like a shuffled training epoch, print throughput, unmount
#   deploy/dev.sh test    install what is missing, lint, type-check, run the whole test suite
#   deploy/dev.sh test-overlay   the same with TMPDIR on an overlay file system (a
#                         container's /tmp) that it mounts and unmounts; needs root
#   deploy/dev.sh setup   only install (Debian packages, .venv, pip install -e .)
#   DLFS_TORCH_TESTS=1 deploy/dev.sh test   also install torch==2.13.0 (and torchdata) and run its tests
#   DLFS_TEST_JOBS=N deploy/dev.sh test   N pytest-xdist workers (default: one per core;
#                         0 runs the tests in this process, one after another)
#
# Needs root or sudo for apt-get and for mounting FUSE (/dev/fuse).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3}

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

install_debian_packages() {
    # fuse3: fusermount3 (mounts as a user); gcc and libopenmpi-dev build mpi4py.
    local want=(fuse3 gcc openmpi-bin libopenmpi-dev)
    # Debian's own python needs these to build venvs and C extensions (mpi4py).
    if [ "$(command -v "$PY")" = /usr/bin/python3 ]; then
        want+=(python3-venv python3-dev)
    fi
    local missing=()
    for pkg in "${want[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "dev.sh: installing Debian packages: ${missing[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

install_python_packages() {
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    # Reinstall only when the dependency list changed.
    local stamp="$VENV/.dlfs-installed"
    local want
    want=$(sha1sum pyproject.toml | cut -d' ' -f1)
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        echo "dev.sh: installing dlfs and its dependencies into $VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install -q -e ".[test,mpi]"
        echo "$want" > "$stamp"
    fi
}

# torch is no dependency of DLFS (on PyPI its Linux wheel pulls ~3 GB of CUDA); the
# sampler's real-torch tests skip without it, and DLFS_TORCH_TESTS=1 opts in. torchdata
# brings StatefulDataLoader, which the sampler's resume is tested inside.
TORCH_VERSION=2.13.0
TORCHDATA_VERSION=0.11.0
install_torch() {
    "$VENV/bin/python" -c "import importlib.metadata as m, sys
sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION'
         or m.version('torchdata').split('+')[0] != '$TORCHDATA_VERSION')" 2>/dev/null && return
    echo "dev.sh: installing torch==$TORCH_VERSION, torchdata==$TORCHDATA_VERSION into $VENV" \
        "(DLFS_TORCH_TESTS=1)"
    "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" \
        "torchdata==$TORCHDATA_VERSION"
}

install_git_hooks() {
    # Only in a git checkout of its own (not an unpacked release), and only if no other
    # hooks are configured.
    git rev-parse --git-dir >/dev/null 2>&1 || return 0
    [ -z "$(git config core.hooksPath)" ] || return 0
    git config core.hooksPath deploy/git-hooks
}

setup() {
    install_debian_packages
    install_python_packages
    install_git_hooks
}

# The packages whose seams are typed and checked (mypy, configured in pyproject.toml).
# The folder daemon/ is the package dlfsd (setup.py maps it), and mypy names modules
# by their folders: it checks a tree of two links, dlfsd -> daemon and dlfs -> dlfs.
TYPED=(dlfsd/ckpt dlfsd/pool dlfsd/core dlfsd/fuse dlfsd/ckptconnect.py)
typecheck() {
    local tree
    tree=$(mktemp -d "${TMPDIR:-/tmp}/dlfs-typecheck.XXXXXX")
    ln -s "$ROOT/daemon" "$tree/dlfsd"
    ln -s "$ROOT/dlfs" "$tree/dlfs"
    local rc=0
    (cd "$tree" && "$VENV/bin/mypy" --config-file "$ROOT/pyproject.toml" \
        --cache-dir "$ROOT/.mypy_cache" "${TYPED[@]}") || rc=$?
    rm -rf "$tree"
    return $rc
}

# Most tests wait (on FUSE timeouts, daemons, peers, Slurm), so workers side by side
# shorten the run even on 2 cores. Whole modules per worker (loadfile): a module's
# fixtures (a Slurm cluster, a populated store) are made once, and tests that share
# one machine-wide thing (Slurm's ports) never run at the same moment.
XDIST=(-n "${DLFS_TEST_JOBS:-auto}" --dist loadfile)

case "${1:-}" in
    setup) setup ;;
    demo) setup; shift; exec "$VENV/bin/dlfs" demo "$@" ;;
    test)
        setup; shift
        [ -e /dev/fuse ] || { echo "dev.sh: /dev/fuse is missing: FUSE tests cannot run" >&2; exit 1; }
        if [ "${DLFS_TORCH_TESTS:-}" = 1 ]; then install_torch; fi
        "$VENV/bin/ruff" check .
        typecheck
        exec "$VENV/bin/python" -m pytest "${XDIST[@]}" "$@" ;;
    test-overlay)
        # overlayfs lacks RWF_NOWAIT and its cachestat sees no page cache: every test
        # must pass or skip saying why (tests/pagecache.py probes the file system).
        setup; shift
        [ -e /dev/fuse ] || { echo "dev.sh: /dev/fuse is missing: FUSE tests cannot run" >&2; exit 1; }
        "$VENV/bin/ruff" check .
        base=$(mktemp -d "${TMPDIR:-/tmp}/dlfs-overlay.XXXXXX")
        mkdir "$base/lower" "$base/upper" "$base/work" "$base/merged"
        if ! as_root mount -t overlay overlay \
                -o "lowerdir=$base/lower,upperdir=$base/upper,workdir=$base/work" "$base/merged"; then
            rm -rf "$base"
            echo "dev.sh: cannot mount an overlay in $base (on an overlay itself, as in a" \
                 "container? then \`dev.sh test\` runs there already)" >&2
            exit 1
        fi
        # shellcheck disable=SC2064  # expand $base now
        trap "as_root umount '$base/merged' || as_root umount -l '$base/merged'; rm -rf '$base'" EXIT
        TMPDIR="$base/merged" "$VENV/bin/python" -m pytest "${XDIST[@]}" \
            --basetemp="$base/merged/pytest" "$@" ;;
    *) sed -n '2,11p' "$0"; exit 2 ;;
esac
