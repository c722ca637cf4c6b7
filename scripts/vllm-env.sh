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
# venv is deleted and made again from nothing. Step 4 has its own stamp, keyed
# on the files that decide mptier's build and dependencies, so editing the
# native sources reinstalls mptier alone. A complete venv takes well under a
# second to check.
#
# Options:
#   --force         rebuild the whole venv even if its stamp matches
#   --skip-mptier   stop after step 3 (e.g. while mptier does not build)
# Environment:
#   MPTIER_VLLM_VENV    where the venv lives (default .venv-vllm)
#   MPTIER_VLLM_PYTHON  interpreter that makes the venv (default python3; 3.11)
#   MPTIER_VLLM_SKIP_MPTIER=1  same as --skip-mptier
set -euo pipefail

readonly VLLM_VERSION=0.33.0
# The local version label keeps PyPI's CUDA builds (which carry none) out.
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

if ((force == 0)) && stamp_matches "$env_stamp" "$env_key"; then
    step "vLLM $VLLM_VERSION environment at $venv is up to date"
else
    step "building the vLLM $VLLM_VERSION environment at $venv from nothing"
    if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        die "$python is not Python 3.11 (the CPU torch 2.13.0 wheel is for 3.11); set MPTIER_VLLM_PYTHON"
    fi
    if [[ -e $venv ]]; then
        # Only ever delete something that is recognisably a venv.
        [[ -f $venv/pyvenv.cfg ]] || die "$venv exists and is not a virtual environment; not touching it"
        step "removing the incomplete or outdated venv"
        rm -rf -- "$venv"
    fi
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
        die "the vLLM modules do not import; the lock file is incomplete or a package changed"
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
