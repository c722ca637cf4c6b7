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
# Reuse: a stamp file in the venv holds the recipe's hash and the venv path: the
# install steps below as bash prints them (comments do not count), the pins, the lock
# file, the interpreter and pip's configuration. When it matches, steps 1-4 are
# skipped; otherwise the venv is deleted and made again. Step 5 has its own stamp,
# keyed on the files that decide mptier's build and dependencies, so editing the native
# sources reinstalls mptier alone. A complete venv takes well under a second to check.
#
# Machine cache: after steps 1-4 succeed, the venv (without mptier) is also kept under
# $MPTIER_VLLM_CACHE/vllm-env-<recipe hash> as a tree of hard links (see
# scripts/venv-common.sh, which this script shares with scripts/vllm-cpu-env.sh; the
# two newest recipes are kept). A venv made again on the same machine, e.g. by CI in a
# fresh clone, is then linked from there in about a second instead of installed (about
# 90 s); the whole run then takes about 35 s, mostly the import check and mptier's own
# install. If the cache cannot be used (another file system, a damaged entry), the
# venv is installed from nothing as before.
#
# Options:
#   --force         rebuild the whole venv from nothing even if its stamp
#                   matches or the machine cache holds it (and refresh the cache)
#   --skip-mptier   stop after step 4 (e.g. while mptier does not build, or while a
#                   test suite runs from this tree: step 5 rebuilds its native module)
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

NAME=vllm-env
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd)
script_path="$script_dir/$(basename "${BASH_SOURCE[0]}")"
requirements="$script_dir/vllm-env-requirements.txt"
# shellcheck source=scripts/venv-common.sh
source "$script_dir/venv-common.sh"

venv=$(venv_abs_path "${MPTIER_VLLM_VENV:-.venv-vllm}")
python=${MPTIER_VLLM_PYTHON:-python3}
cache_dir=$(venv_cache_dir)

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

[[ -f $requirements ]] || die "missing lock file $requirements"

env_stamp="$venv/.mptier-vllm-env.stamp"
constraints="$venv/mptier-constraints.txt"
vpy="$venv/bin/python"

venv_lock

# Steps 1-4 into an empty $venv, checks included. Its text (as `declare -f` prints it)
# is part of the recipe's hash: change what it does and every cached venv is out of date.
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
    check_imports || die "the vLLM modules do not import; the lock file is incomplete or a package changed"
    ensure_fs_io_c
}

check_imports() {
    step "checking the imports and the torch build"
    # vLLM warns at import that its compiled extension vllm._C is missing:
    # expected without a GPU, and nothing below needs it.
    if ! "$vpy" - <<'PYEOF'; then
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
PYEOF
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

# What decides the venv's contents (see "Reuse" above).
recipe() {
    declare -f install_from_nothing pip_install check_imports fetch_vllm_sources \
        fsio_flags_true ensure_fs_io_c
    printf '%s\n' "$VLLM_VERSION" "$TORCH_PIN" "$FSIO_SOURCE" "${FSIO_CXXFLAGS[*]}"
    sha256sum <"$requirements"
    venv_recipe_env
}

venv_make "$(recipe | sha256sum | cut -c1-16)" "$env_stamp" "$force"
# Also where the venv was up to date or linked from the cache: a no-op when its
# stamp matches.
ensure_fs_io_c

if ((skip_mptier)); then
    step "skipping the mptier install (--skip-mptier)"
else
    # The lock file doubles as constraints, so mptier's own dependencies
    # (numpy, psutil, ...) cannot move the versions vLLM was checked with.
    venv_install_mptier "$force" -c "$constraints" -c "$requirements"
fi

step "done: activate with 'source ${venv#"$repo_root"/}/bin/activate' or run ${venv#"$repo_root"/}/bin/python"
