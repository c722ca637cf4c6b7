# Sourced by scripts/vllm-env.sh and scripts/vllm-cpu-env.sh: what the two vLLM venv
# scripts share, in one place.
#
#   - the venv's path, the machine cache folder, one run at a time per venv;
#   - the recipe key: a hash of what decides a venv's contents (the install steps as
#     bash prints them, so comments do not count; the pins; the interpreter; pip's
#     configuration and the constraints file it names), which keys both the venv's stamp
#     and its machine-cache entry;
#   - the machine cache of built venvs (below);
#   - making the venv: up to date (stamp) -> linked from the cache -> built from nothing;
#   - mptier's own editable install, keyed on the files that decide its build.
#
# Machine cache: a venv that took many minutes to install is kept under a cache folder
# as a tree of hard links (no extra disk space while a venv shares it), one entry per
# recipe key. A venv made again on the same machine (a fresh clone, a CI run) is linked
# from there in a few seconds. Files in an entry are never written in place: pip only
# removes and adds files, Python writes bytecode by rename, and what names the venv's
# own path (bin/, pyvenv.cfg) is a real copy, rewritten for each venv.
#
# The caller sets, before calling anything here: NAME (its short name: progress lines,
# lock, cache entries), venv (absolute path), python (the interpreter that makes it),
# repo_root, and defines install_from_nothing (steps into an empty venv, checks
# included) and check_imports (the check a venv linked from the cache must pass).
# Every path is absolute.

export PIP_DISABLE_PIP_VERSION_CHECK=1

venv_start=$SECONDS
step() { printf '[%s +%3ds] %s\n' "$NAME" "$((SECONDS - venv_start))" "$*"; }
die() {
    printf '%s: error: %s\n' "$NAME" "$*" >&2
    exit 1
}

# venv_abs_path PATH: PATH, relative to the repo root unless absolute.
venv_abs_path() {
    case $1 in
        /*) printf '%s' "$1" ;;
        *) printf '%s' "$repo_root/$1" ;;
    esac
}

# venv_cache_dir: the cache folder ($MPTIER_VLLM_CACHE, else
# ${XDG_CACHE_HOME:-~/.cache}/mptier); empty when turned off (MPTIER_VLLM_CACHE=none)
# or when there is no home folder.
venv_cache_dir() {
    local dir=
    if [[ -n ${MPTIER_VLLM_CACHE+set} ]]; then
        dir=$MPTIER_VLLM_CACHE
    elif [[ -n ${XDG_CACHE_HOME:-} ]]; then
        dir=$XDG_CACHE_HOME/mptier
    elif [[ -n ${HOME:-} ]]; then
        dir=$HOME/.cache/mptier
    fi
    [[ $dir == none ]] && dir=
    printf '%s' "$dir"
}

# This machine kind's pip configuration names local package mirrors that do not hold
# every project; pip warns about each miss, so those lines are dropped.
pip_install() {
    "$venv/bin/python" -m pip install --progress-bar off "$@" \
        2> >(grep -v "^WARNING: Location 'file:.* is ignored" >&2)
}

venv_stamp_matches() { [[ -f $1 && "$(cat "$1")" == "$2" && -x $venv/bin/python ]]; }

# venv_recipe_env: the part of every recipe that is the machine's, not the script's: the
# interpreter and pip's configuration, with the contents of a constraints file it names
# (such a file limits what pip resolves to).
venv_recipe_env() {
    "$python" -c 'import sys; print(sys.executable, sys.version)'
    local config constraint
    config=$("$python" -m pip config list 2>/dev/null || true)
    printf '%s\n' "$config"
    while IFS= read -r constraint; do
        [[ -f $constraint ]] && sha256sum "$constraint"
    done < <(printf '%s\n' "$config" | sed -n "s/^[^=]*constraint='\(.*\)'$/\1/p" | tr ' ' '\n')
    return 0
}

# venv_lock: one run at a time per venv, and per cache entry (a developer and a CI run
# may share a machine, and fresh clones share the cache), yet the two vLLM venvs can
# be made at once. The lock is a file of the cache folder named after the caller (a
# cache may hold its own lock file), else the calling script itself.
venv_lock() {
    local cache
    cache=$(venv_cache_dir)
    mkdir -p "$(dirname "$venv")"
    if [[ -n $cache ]] && mkdir -p "$cache" 2>/dev/null && : >>"$cache/$NAME.lock" 2>/dev/null; then
        exec 9<"$cache/$NAME.lock"
    else
        exec 9<"${BASH_SOURCE[-1]}"
    fi
    if ! flock -n 9; then
        step "another run making this environment is in progress; waiting for it"
        flock 9
    fi
}

# venv_cache_link ENTRY VENV: make VENV (absent or empty) from the cache entry ENTRY.
# Fails, leaving a partial VENV for the caller to remove, if anything goes wrong.
venv_cache_link() {
    local entry=$1 venv=$2 origin f from to
    origin=$(cat "$entry/.mptier-origin" 2>/dev/null) || return 1
    [[ -n $origin ]] || return 1
    mkdir -p "$venv" || return 1
    cp -al "$entry/." "$venv/" 2>/dev/null || return 1
    rm -rf "${venv:?}/bin" "$venv/pyvenv.cfg" "$venv/.mptier-origin" || return 1
    cp -a "$entry/bin" "$entry/pyvenv.cfg" "$venv/" || return 1
    from=$(printf '%s' "$origin" | sed 's/[][\\.*^$|]/\\&/g')
    to=$(printf '%s' "$venv" | sed 's/[\\&|]/\\&/g')
    for f in "$venv"/bin/* "$venv/pyvenv.cfg"; do
        # Text files only (scripts, activate*): python itself is a symlink.
        if [[ -f $f && ! -L $f ]] && grep -Iq . "$f" && grep -qF "$origin" "$f"; then
            sed -i "s|$from|$to|g" "$f" || return 1
        fi
    done
}

# What a venv holds but its cache entry must not: the stamps (per venv) and mptier
# itself (each venv installs its own clone's, editable). Globs inside the copy.
readonly VENV_NOT_CACHED=('.mptier-*.stamp' bin/mptier
    'lib/python*/site-packages/mptier-*.dist-info'
    'lib/python*/site-packages/__editable__*mptier*')
# Cache entries kept per script (e.g. two branches with different recipes).
readonly VENV_CACHE_KEEP=2

# venv_cache_save ENTRY VENV: publish VENV as the cache entry ENTRY, without
# VENV_NOT_CACHED, then keep only the VENV_CACHE_KEEP newest entries whose names start
# as ENTRY's does up to its last '-'. Best effort: a failure costs only the next venv
# its shortcut, never this run.
venv_cache_save() {
    local entry=$1 venv=$2 tmp="$1.tmp.$$" cache prefix drop old
    cache=$(dirname "$entry")
    prefix=$(basename "${entry%-*}")
    mkdir -p "$cache" 2>/dev/null || return 0
    rm -rf "$tmp"
    if ! cp -al "$venv/." "$tmp/" 2>/dev/null; then
        rm -rf "$tmp"
        step "not caching the environment: $cache cannot hold hard links to $venv"
        return 0
    fi
    for drop in "${VENV_NOT_CACHED[@]}"; do
        # Unquoted on purpose: the patterns are globs inside the copy.
        # shellcheck disable=SC2086
        rm -rf -- "$tmp"/$drop
    done
    echo "$venv" >"$tmp/.mptier-origin"
    if [[ -e $entry ]]; then
        mv -T "$entry" "$entry.old.$$" 2>/dev/null && rm -rf "$entry.old.$$"
    fi
    if mv -T "$tmp" "$entry" 2>/dev/null; then
        step "cached the environment for other venvs on this machine: $entry"
    else
        rm -rf "$tmp"  # another run published the same entry first
    fi
    while IFS= read -r old; do
        [[ $old == "$cache/$prefix"-* && -d $old ]] && rm -rf -- "$old"
    done < <(find "$cache" -mindepth 1 -maxdepth 1 -type d -name "$prefix-*" \
        ! -name '*.tmp.*' ! -name '*.old.*' -printf '%T@ %p\n' | sort -rn |
        tail -n +"$((VENV_CACHE_KEEP + 1))" | cut -d' ' -f2-)
    return 0
}

# venv_make RECIPE_KEY STAMP FORCE: make sure $venv holds the recipe RECIPE_KEY (without
# mptier): up to date when STAMP holds the key and the venv path; else linked from the
# machine cache (and checked with check_imports); else built from nothing with
# install_from_nothing and then cached. FORCE=1 skips the first two.
venv_make() {
    local key=$1 stamp=$2 force=$3 cache entry= linked=0
    local want="$key $venv"
    cache=$(venv_cache_dir)
    [[ -n $cache ]] && entry="$cache/$NAME-$key"
    if ((force == 0)) && venv_stamp_matches "$stamp" "$want"; then
        step "the environment at $venv is up to date"
        if [[ -n $entry && ! -f $entry/.mptier-origin ]]; then
            venv_cache_save "$entry" "$venv"
        fi
        return 0
    fi
    if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        die "$python is not Python 3.11 (the CPU torch 2.13.0 wheel is for 3.11); set MPTIER_VLLM_PYTHON"
    fi
    if [[ -e $venv ]]; then
        # Only ever delete something that is recognisably a venv.
        [[ -f $venv/pyvenv.cfg ]] || die "$venv exists and is not a virtual environment; not touching it"
        step "removing the incomplete or outdated venv"
        rm -rf -- "$venv"
    fi
    if ((force == 0)) && [[ -n $entry && -f $entry/.mptier-origin ]]; then
        step "linking the environment at $venv from the machine cache ($entry)"
        if venv_cache_link "$entry" "$venv" && check_imports; then
            linked=1
        else
            step "the cached environment did not work; installing from nothing instead"
            rm -rf -- "$venv"
        fi
    fi
    if ((linked == 0)); then
        step "building the environment at $venv from nothing"
        install_from_nothing
        [[ -n $entry ]] && venv_cache_save "$entry" "$venv"
    fi
    echo "$want" >"$stamp"
    rm -f "$venv/.mptier-self.stamp"
    step "environment ready ($(du -sh "$venv" | cut -f1))"
}

# venv_install_mptier FORCE [PIP ARGS...]: mptier itself, editable, with its test
# extras (this builds the native module in the source tree: no test may be running
# from that tree meanwhile), unless its stamp holds the hash of the files that decide
# its build. The PIP ARGS (constraints) come before the package.
venv_install_mptier() {
    local force=$1 key stamp="$venv/.mptier-self.stamp" f files=()
    shift
    for f in pyproject.toml setup.py mptier/native/*.c mptier/native/*.h mptier/native/build_ffi.py; do
        [[ -f $repo_root/$f ]] && files+=("$repo_root/$f")
    done
    key=$(sha256sum "${files[@]}" | cut -d' ' -f1 | sha256sum | cut -d' ' -f1)
    if ((force == 0)) && venv_stamp_matches "$stamp" "$key"; then
        step "mptier (editable) is installed and up to date"
        return 0
    fi
    step "installing mptier (editable, with test extras; builds the native module)"
    pip_install -q "$@" -e "${repo_root}[test]"
    "$venv/bin/python" -c 'import mptier.native as n; assert n.HAS_NATIVE, n.NATIVE_IMPORT_ERROR; print("  mptier from", n.__file__)'
    echo "$key" >"$stamp"
}
