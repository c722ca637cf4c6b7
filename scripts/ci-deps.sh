#!/usr/bin/env bash
# System packages the test suite needs beyond Python: libfuse 3 and fusermount3 for the
# FUSE test file system and JuiceFS mounts (tests/support). Idempotent: when everything
# is installed it only asks dpkg (well under a second) and changes nothing.
#
#   scripts/ci-deps.sh            install what is missing (root, or sudo when available)
#   scripts/ci-deps.sh --check    exit 1 and name what is missing; install nothing
#
# Without these packages the FUSE and JuiceFS tests skip with a reason; nothing else
# needs them.
set -euo pipefail

readonly PACKAGES=(fuse3 libfuse3-3)

check_only=0
case ${1:-} in
    --check) check_only=1 ;;
    "") ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "ci-deps: unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

missing=()
for pkg in "${PACKAGES[@]}"; do
    if [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null) != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done

if ((${#missing[@]} == 0)); then
    echo "ci-deps: system packages present: ${PACKAGES[*]}"
    exit 0
fi
if ((check_only)); then
    echo "ci-deps: missing: ${missing[*]} (run scripts/ci-deps.sh)" >&2
    exit 1
fi

if ((EUID == 0)); then
    as_root=()
elif command -v sudo >/dev/null; then
    as_root=(sudo)
else
    echo "ci-deps: need root to install ${missing[*]}: apt-get install -y ${missing[*]}" >&2
    exit 1
fi

echo "ci-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Install from the current lists first; refresh them only if that fails (stale lists).
if ! "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; then
    "${as_root[@]}" apt-get update -q >/dev/null
    "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "ci-deps: installed ${missing[*]}"
