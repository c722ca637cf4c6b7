#!/usr/bin/env bash
# Make (or reuse) the virtual environment in which mptier's vLLM integration
# tests run against the real vLLM 0.33.0, on a CPU-only machine.
#
#   scripts/vllm-env.sh [--force] [--skip-mptier]
#
# What ends up in the venv (default: <repo>/.venv-vllm, or $MPTIER_VLLM_VENV,
# taken relative to the repo root unless absolute):
#   1. torch 2.13.0, CPU build, installed first and pinned as 2.13.0+cpu, so
#      pip can only take the CPU wheel (a CUDA torch is several GB);
#   2. the packages vLLM's offloading/tiering modules import, locked in
#      scripts/vllm-env-requirements.txt and installed with --no-deps;
#   3. vllm==0.33.0 with --no-deps (its declared dependencies are a GPU stack);
#   4. vLLM's own C extension vllm.fs_io_C, built from vLLM's sdist: the one
#      in the wheel is linked against libtorch_cuda, libc10_cuda and libnvrtc,
#      so with a CPU torch it does not load and vLLM's file-system tier falls
#      back to Python os.write/os.readv per block (io._HAS_FSIO_C and
#      manager._HAS_BATCH_LOOKUP_C False). Its source, csrc/fs_io.cpp, uses
#      only the CPython API and POSIX calls, so it is compiled here as a plain
#      CPython extension (g++, C++20, -O2, the limited API of 3.11) and
#      replaces vllm/fs_io_C.abi3.so; the script then fails unless both flags
#      are True in the venv. Every CUDA deployment of vLLM has that extension,
#      so this is the vLLM that mptier is compared with and tested against.
#      The sdist's files it needs (csrc/fs_io.cpp, PKG-INFO and vLLM's own
#      tests/v1/kv_offload/tiering/test_fs_tier.py, which the vllm-marked
#      tests run) are kept in $MPTIER_VLLM_CACHE/vllm-sdist-<version>; none of
#      vLLM's code is copied into this repository;
#   5. mptier itself, editable, with its test extras (builds the cffi module).
# Every install after torch runs under a constraints file pinning torch, so
# nothing can replace it.
#
# Reuse: a stamp file in the venv holds the hash of this script, the lock file
# and the venv path. When it matches, steps 1-3 are skipped; otherwise the
# venv is deleted and made again. Step 4 has its own stamp, keyed on the files
# that decide mptier's build and dependencies, so editing the native sources
# reinstalls mptier alone. A complete venv takes well under a second to check.
#
# Machine cache: after steps 1-3 succeed, the venv (without mptier) is also
# kept under $MPTIER_VLLM_CACHE as a tree of hard links (no extra disk space
# while a venv shares it), keyed on this script, the lock file and the
# interpreter. A venv made again on the same machine, e.g. by CI in a fresh
# clone, is then linked from there in about a second instead of installed
# (about 90 s); the whole run then takes about 35 s, mostly the import check
# and mptier's own install. Files there are never written in place: mptier's editable
# install only adds files, and anything rewritten per venv (bin/, stamps) is
# a real copy. The two most recently made entries are kept. If the cache
# cannot be used (another file system, a damaged entry), the venv is
# installed from nothing as before.
#
# Options:
#   --force         rebuild the whole venv from nothing even if its stamp
#                   matches or the machine cache holds it (and refresh the cache)
#   --skip-mptier   stop after step 4 (e.g. while mptier does not build)
# Environment:
#   MPTIER_VLLM_VENV    where the venv lives (default .venv-vllm)
#   MPTIER_VLLM_PYTHON  interpreter that makes the venv (default python3; 3.11)
#   MPTIER_VLLM_SKIP_MPTIER=1  same as --skip-mptier
#   MPTIER_VLLM_CACHE   machine cache folder (default
#                       ${XDG_CACHE_HOME:-~/.cache}/mptier); "none" turns it off
#                       (the sdist is then fetched into a temporary folder)
set -euo pipefail

readonly VLLM_VERSION=0.33.0
# The local version label keeps out the index's CUDA builds (which carry none).
readonly TORCH_PIN="torch==2.13.0+cpu"

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd)
script_path="$script_dir/$(basename "${BASH_SOURCE[0]}")"
requirements="$script_dir/vllm-env-requirements.txt"

venv=${MPTIER_VLLM_VENV:-.venv-vllm}
case $venv in
    /*) ;;
    *) venv="$repo_root/$venv" ;;
esac
python=${MPTIER_VLLM_PYTHON:-python3}
if [[ -n ${MPTIER_VLLM_CACHE+set} ]]; then
    cache_dir=$MPTIER_VLLM_CACHE
elif [[ -n ${XDG_CACHE_HOME:-} ]]; then
    cache_dir=$XDG_CACHE_HOME/mptier
elif [[ -n ${HOME:-} ]]; then
    cache_dir=$HOME/.cache/mptier
else
    cache_dir=
fi
[[ $cache_dir == none ]] && cache_dir=

force=0
skip_mptier=${MPTIER_VLLM_SKIP_MPTIER:-0}
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        --skip-mptier) skip_mptier=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$script_path" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "vllm-env: unknown argument: $arg (try --help)" >&2
            exit 2
            ;;
    esac
done

start=$SECONDS
step() { printf '[vllm-env +%3ds] %s\n' "$((SECONDS - start))" "$*"; }
die() {
    printf 'vllm-env: error: %s\n' "$*" >&2
    exit 1
}

[[ -f $requirements ]] || die "missing lock file $requirements"

# Keys for the two stamps.
env_key=$(
    {
        sha256sum "$script_path" "$requirements" | cut -d' ' -f1
        echo "$venv"
    } | sha256sum | cut -d' ' -f1
)
self_files=()
for f in pyproject.toml setup.py mptier/native/*.c mptier/native/*.h mptier/native/build_ffi.py; do
    [[ -f $repo_root/$f ]] && self_files+=("$repo_root/$f")
done
if ((${#self_files[@]})); then
    self_key=$(sha256sum "${self_files[@]}" | cut -d' ' -f1 | sha256sum | cut -d' ' -f1)
else
    self_key=none
fi

env_stamp="$venv/.mptier-vllm-env.stamp"
self_stamp="$venv/.mptier-self.stamp"
constraints="$venv/mptier-constraints.txt"
vpy="$venv/bin/python"

# One run at a time (a developer and a CI run may share a machine). The lock is
# taken on this script itself, so no lock file is left behind.
mkdir -p "$(dirname "$venv")"
exec 9<"$script_path"
if ! flock -n 9; then
    step "another run of this script is in progress; waiting for it"
    flock 9
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
# This machine kind's pip configuration names local package mirrors that do not
# hold every project; pip warns about each miss, so those lines are dropped.
pip_install() {
    "$vpy" -m pip install --progress-bar off "$@" \
        2> >(grep -v "^WARNING: Location 'file:.* is ignored" >&2)
}

stamp_matches() { [[ -f $1 && "$(cat "$1")" == "$2" && -x $vpy ]]; }

# Steps 1-3 into an empty $venv.
install_from_nothing() {
    "$python" -m venv "$venv"
    echo "$TORCH_PIN" >"$constraints"

    step "1/3 torch (CPU build): $TORCH_PIN"
    # --no-deps: torch's own dependencies are pinned in the lock file (step 2).
    if ! pip_install -q --no-deps --only-binary :all: "$TORCH_PIN"; then
        die "no CPU build of torch 2.13.0 was found. On this machine kind pip takes it from a wheel on local disk (see 'pip config list'); a CUDA torch is deliberately refused"
    fi

    step "2/3 packages vLLM's tiering modules import ($(grep -c '^[A-Za-z]' "$requirements") locked in $(basename "$requirements"))"
    pip_install -q --no-deps -c "$constraints" -r "$requirements"

    step "3/3 vllm==$VLLM_VERSION (--no-deps)"
    pip_install -q --no-deps -c "$constraints" "vllm==$VLLM_VERSION"
}

# Link the venv from the machine cache entry $1; fails (leaving a partial venv)
# if anything goes wrong. Everything but bin/ and pyvenv.cfg is a hard link:
# those name the venv's path, so they are real copies rewritten for this one.
link_from_cache() {
    local entry=$1 origin
    origin=$(cat "$entry/.mptier-origin") || return 1
    [[ -n $origin ]] || return 1
    mkdir -p "$venv" || return 1
    cp -al "$entry/." "$venv/" 2>/dev/null || return 1
    rm -rf "${venv:?}/bin" "$venv/pyvenv.cfg" "$venv/.mptier-origin" || return 1
    cp -a "$entry/bin" "$entry/pyvenv.cfg" "$venv/" || return 1
    local f from to
    from=$(printf '%s' "$origin" | sed 's/[][\\.*^$|]/\\&/g')
    to=$(printf '%s' "$venv" | sed 's/[\\&|]/\\&/g')
    for f in "$venv"/bin/* "$venv/pyvenv.cfg"; do
        # Text files only (scripts, activate*): python itself is a symlink.
        if [[ -f $f && ! -L $f ]] && grep -Iq . "$f" && grep -qF "$origin" "$f"; then
            sed -i "s|$from|$to|g" "$f" || return 1
        fi
    done
}

# Keep the freshly installed venv (steps 1-3) as the machine cache entry $1.
# Best effort: a failure only costs the next venv its shortcut.
save_to_cache() {
    local entry=$1 tmp="$1.tmp.$$"
    mkdir -p "$cache_dir" 2>/dev/null || return 0
    rm -rf "$tmp"
    if ! cp -al "$venv/." "$tmp/" 2>/dev/null; then
        rm -rf "$tmp"
        step "not caching the environment: $cache_dir cannot hold hard links to $venv"
        return 0
    fi
    # Per-venv files are written in place later: they must not be shared.
    rm -f "$tmp/$(basename "$env_stamp")" "$tmp/$(basename "$self_stamp")" \
        "$tmp/$(basename "$fsio_stamp")"
    echo "$venv" >"$tmp/.mptier-origin"
    if [[ -e $entry ]]; then
        mv -T "$entry" "$entry.old.$$" 2>/dev/null && rm -rf "$entry.old.$$"
    fi
    if mv -T "$tmp" "$entry" 2>/dev/null; then
        step "cached the environment for other venvs on this machine: $entry"
    else
        rm -rf "$tmp"  # another run published the same entry first
    fi
    # Keep the two newest entries (e.g. two branches with different lock files).
    local old
    while IFS= read -r old; do
        [[ $old == "$cache_dir"/vllm-env-* && -d $old ]] && rm -rf -- "$old"
    done < <(find "$cache_dir" -mindepth 1 -maxdepth 1 -type d -name 'vllm-env-*' \
        ! -name '*.tmp.*' ! -name '*.old.*' -printf '%T@ %p\n' | sort -rn | tail -n +3 | cut -d' ' -f2-)
    return 0
}

check_imports() {
    step "checking the imports and the torch build"
    # vLLM warns at import that its compiled extension vllm._C is missing:
    # expected without a GPU, and nothing below needs it.
    if ! "$vpy" - <<'EOF'; then
import importlib
import sys

import torch
import vllm

modules = [
    "vllm.v1.kv_offload.base",
    "vllm.v1.kv_offload.config",
    "vllm.v1.kv_offload.file_mapper",
    "vllm.v1.kv_offload.tiering.base",
    "vllm.v1.kv_offload.tiering.factory",
    "vllm.v1.kv_offload.tiering.async_lookup",
    "vllm.v1.kv_offload.tiering.fs.manager",
    "vllm.v1.kv_offload.tiering.manager",
    "vllm.v1.kv_offload.tiering.spec",
    "vllm.distributed.kv_events",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
]
for name in modules:
    importlib.import_module(name)
if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} is a CUDA build")
print(f"  torch {torch.__version__} (CPU), vllm {vllm.__version__}: {len(modules)} modules import")
EOF
        return 1
    fi
}

# Step 4: vLLM's fs_io_C, built from the sdist.
readonly FSIO_SOURCE=csrc/fs_io.cpp
readonly FSIO_VLLM_TEST=tests/v1/kv_offload/tiering/test_fs_tier.py
# The flags vLLM's own build gives this extension (a plain CPython module that
# keeps to the limited API of 3.11, so one .abi3.so serves 3.11 and later).
readonly FSIO_CXXFLAGS=(-std=c++20 -O2 -fPIC -shared -DPy_LIMITED_API=0x030B0000
    -DTORCH_EXTENSION_NAME=fs_io_C)
fsio_stamp="$venv/.mptier-fsio.stamp"

# Fetch vLLM $VLLM_VERSION's sdist and keep the files step 4 and the tests need
# in $1 (made whole or not at all). pip prepares an sdist's metadata before it
# saves it, which for vLLM means running its setup.py with its build
# dependencies (a CUDA torch, cmake, rust: gigabytes, and it fails here). So
# pip runs from a bare venv without build isolation: the metadata step stops
# at once at setup.py's first import, and --no-clean keeps the tree pip
# fetched and unpacked (its hash checked). Should the metadata step ever pass,
# the sdist is in the download folder instead; both are handled.
fetch_vllm_sources() {
    local dest=$1 work tree member
    work=$(mktemp -d "$dest.tmp.XXXXXX") || return 1
    step "  fetching vLLM $VLLM_VERSION's source distribution (pip download, no build)"
    "$python" -m venv "$work/pip-venv" || { rm -rf "$work"; return 1; }
    mkdir -p "$work/tmp" "$work/dl"
    TMPDIR="$work/tmp" "$work/pip-venv/bin/python" -m pip download --progress-bar off \
        --no-deps --no-binary :all: --no-build-isolation --no-clean \
        -d "$work/dl" "vllm==$VLLM_VERSION" >"$work/pip.log" 2>&1 || true
    tree=
    if [[ -f $work/dl/vllm-$VLLM_VERSION.tar.gz ]]; then
        mkdir -p "$work/sdist"
        tar -xzf "$work/dl/vllm-$VLLM_VERSION.tar.gz" -C "$work/sdist" --strip-components=1 \
            "vllm-$VLLM_VERSION/PKG-INFO" "vllm-$VLLM_VERSION/csrc" \
            "vllm-$VLLM_VERSION/$FSIO_VLLM_TEST" && tree=$work/sdist
    else
        tree=$(find "$work/tmp" -mindepth 2 -maxdepth 2 -type d -path '*/pip-download-*/vllm_*' \
            -print -quit)
    fi
    if [[ -z $tree || ! -f $tree/PKG-INFO ]] ||
        ! grep -qx "Name: vllm" "$tree/PKG-INFO" ||
        ! grep -qx "Version: $VLLM_VERSION" "$tree/PKG-INFO"; then
        grep -v "is ignored" "$work/pip.log" | tail -n 20 >&2
        rm -rf "$work"
        step "pip download did not yield vLLM $VLLM_VERSION's sdist (its output is above)"
        return 1
    fi
    mkdir -p "$work/keep/csrc" "$work/keep/$(dirname "$FSIO_VLLM_TEST")"
    cp "$tree/PKG-INFO" "$work/keep/" || { rm -rf "$work"; return 1; }
    cp "$tree/$FSIO_SOURCE" "$work/keep/csrc/" || { rm -rf "$work"; return 1; }
    cp "$tree/$FSIO_VLLM_TEST" "$work/keep/$FSIO_VLLM_TEST" || { rm -rf "$work"; return 1; }
    # Headers of vLLM's own that the source includes (none in 0.33.0), one level.
    while IFS= read -r member; do
        cp "$tree/csrc/$member" "$work/keep/csrc/$member" || { rm -rf "$work"; return 1; }
    done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' \
        "$tree/$FSIO_SOURCE")
    rm -rf "$dest"
    mv -T "$work/keep" "$dest" || { rm -rf "$work"; return 1; }
    rm -rf "$work"
}

# True (0) when vLLM's tier reports both of its C paths in the venv.
fsio_flags_true() {
    "$vpy" - <<'PYEOF' 2>/dev/null
import sys

from vllm.v1.kv_offload.tiering.fs import io, manager

sys.exit(0 if io._HAS_FSIO_C and manager._HAS_BATCH_LOOKUP_C else 1)
PYEOF
}

ensure_fs_io_c() {
    local pkg so sources own_sources= inc tmp_so key
    pkg=$("$vpy" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("vllm").origin))') ||
        die "vllm is not importable in $venv"
    so="$pkg/fs_io_C.abi3.so"
    if [[ -f $so && -f $fsio_stamp ]] &&
        [[ "$(cat "$fsio_stamp")" == "$VLLM_VERSION $(sha256sum "$so" | cut -d' ' -f1)" ]]; then
        step "vllm.fs_io_C (built from the sdist) is installed and loads"
        return 0
    fi
    if [[ -f $so ]] && fsio_flags_true; then
        step "vllm.fs_io_C loads: _HAS_FSIO_C and _HAS_BATCH_LOOKUP_C are True"
        echo "$VLLM_VERSION $(sha256sum "$so" | cut -d' ' -f1)" >"$fsio_stamp"
        return 0
    fi
    step "vllm.fs_io_C does not load with this torch (the wheel's links CUDA libraries): building it from the sdist"
    command -v g++ >/dev/null || die "g++ is needed to build vllm.fs_io_C (apt-get install g++)"
    if [[ -n $cache_dir ]]; then
        sources="$cache_dir/vllm-sdist-$VLLM_VERSION"
    else
        own_sources=$(mktemp -d)
        sources="$own_sources/vllm-sdist-$VLLM_VERSION"
    fi
    if [[ -f $sources/PKG-INFO && -f $sources/$FSIO_SOURCE ]]; then
        step "  using the cached sdist files in $sources"
    else
        mkdir -p "$(dirname "$sources")" || die "cannot create $(dirname "$sources")"
        fetch_vllm_sources "$sources" ||
            die "could not fetch vLLM $VLLM_VERSION's sdist with pip download; vllm.fs_io_C cannot be built"
    fi
    inc=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    [[ -f $inc/Python.h ]] || die "no Python.h in $inc: the Python headers are needed to build vllm.fs_io_C"
    tmp_so="$pkg/.fs_io_C.abi3.so.tmp.$$"
    step "  g++ ${FSIO_CXXFLAGS[*]} $FSIO_SOURCE"
    g++ "${FSIO_CXXFLAGS[@]}" -I"$inc" "$sources/$FSIO_SOURCE" -o "$tmp_so" ||
        { rm -f "$tmp_so"; die "compiling vLLM's $FSIO_SOURCE failed (g++ output above)"; }
    # A rename, never a write in place: the wheel's file may be a hard link
    # into the machine cache, shared with other venvs.
    mv -f "$tmp_so" "$so" || die "cannot install $so"
    [[ -n $own_sources ]] && rm -rf "$own_sources"
    fsio_flags_true || {
        "$vpy" -c 'import vllm.fs_io_C' || true
        die "vllm.fs_io_C was built and installed as $so, but vllm.v1.kv_offload.tiering.fs.io._HAS_FSIO_C or .manager._HAS_BATCH_LOOKUP_C is still False (the import error is above)"
    }
    echo "$VLLM_VERSION $(sha256sum "$so" | cut -d' ' -f1)" >"$fsio_stamp"
    step "vllm.fs_io_C built and installed: _HAS_FSIO_C and _HAS_BATCH_LOOKUP_C are True"
}

if ((force == 0)) && stamp_matches "$env_stamp" "$env_key"; then
    step "vLLM $VLLM_VERSION environment at $venv is up to date"
else
    if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        die "$python is not Python 3.11 (the CPU torch 2.13.0 wheel is for 3.11); set MPTIER_VLLM_PYTHON"
    fi
    if [[ -e $venv ]]; then
        # Only ever delete something that is recognisably a venv.
        [[ -f $venv/pyvenv.cfg ]] || die "$venv exists and is not a virtual environment; not touching it"
        step "removing the incomplete or outdated venv"
        rm -rf -- "$venv"
    fi
    entry=
    if [[ -n $cache_dir ]]; then
        cache_key=$(
            {
                sha256sum "$script_path" "$requirements" | cut -d' ' -f1
                "$python" -c 'import sys; print(sys.executable, sys.version)'
            } | sha256sum | cut -c1-16
        )
        entry="$cache_dir/vllm-env-$cache_key"
    fi
    linked=0
    if ((force == 0)) && [[ -n $entry && -f $entry/.mptier-origin ]]; then
        step "linking the vLLM $VLLM_VERSION environment at $venv from the machine cache ($entry)"
        if link_from_cache "$entry" && check_imports; then
            linked=1
        else
            step "the cached environment did not work; installing from nothing instead"
            rm -rf -- "$venv"
        fi
    fi
    if ((linked == 0)); then
        step "building the vLLM $VLLM_VERSION environment at $venv from nothing"
        install_from_nothing
        check_imports || die "the vLLM modules do not import; the lock file is incomplete or a package changed"
        ensure_fs_io_c
        [[ -n $entry ]] && save_to_cache "$entry"
    fi
    echo "$env_key" >"$env_stamp"
    rm -f "$self_stamp"
    step "vLLM environment ready ($(du -sh "$venv" | cut -f1))"
fi

# Also where the venv was up to date or linked from the cache: a no-op when its
# stamp matches.
ensure_fs_io_c

if ((skip_mptier)); then
    step "skipping the mptier install (--skip-mptier)"
elif ((force == 0)) && stamp_matches "$self_stamp" "$self_key"; then
    step "mptier (editable) is installed and up to date"
else
    step "installing mptier (editable, with test extras; builds the native module)"
    # The lock file doubles as constraints, so mptier's own dependencies
    # (numpy, psutil, ...) cannot move the versions vLLM was checked with.
    pip_install -q -c "$constraints" -c "$requirements" -e "${repo_root}[test]"
    "$vpy" -c 'import mptier; print("  mptier", getattr(mptier, "__version__", "?"), "from", mptier.__file__)'
    echo "$self_key" >"$self_stamp"
fi

step "done: activate with 'source ${venv#"$repo_root"/}/bin/activate' or run ${venv#"$repo_root"/}/bin/python"
