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
#   4. mptier itself, editable, with its test extras (builds the cffi module).
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
#   --skip-mptier   stop after step 3 (e.g. while mptier does not build)
# Environment:
#   MPTIER_VLLM_VENV    where the venv lives (default .venv-vllm)
#   MPTIER_VLLM_PYTHON  interpreter that makes the venv (default python3; 3.11)
#   MPTIER_VLLM_SKIP_MPTIER=1  same as --skip-mptier
#   MPTIER_VLLM_CACHE   machine cache folder (default
#                       ${XDG_CACHE_HOME:-~/.cache}/mptier); "none" turns it off
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
    rm -f "$tmp/$(basename "$env_stamp")" "$tmp/$(basename "$self_stamp")"
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
        [[ -n $entry ]] && save_to_cache "$entry"
    fi
    echo "$env_key" >"$env_stamp"
    rm -f "$self_stamp"
    step "vLLM environment ready ($(du -sh "$venv" | cut -f1))"
fi

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
