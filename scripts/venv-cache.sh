# Sourced by scripts/vllm-cpu-env.sh: a machine cache of built virtual environments.
#
# A venv that took many minutes to install is kept under a cache folder as a tree of
# hard links (no extra disk space while a venv shares it), one entry per key. A venv
# made again on the same machine (a fresh clone, a CI run) is linked from there in a
# few seconds. Files in an entry are never written in place: pip only removes and adds
# files, Python writes bytecode by rename, and what names the venv's own path (bin/,
# pyvenv.cfg) is a real copy, rewritten for each venv.
#
# The caller defines step() (progress lines) and gives every path absolute.
# scripts/vllm-env.sh still has its own copy of these steps: its cache key is its own
# text, so moving it onto this file makes every machine rebuild that venv once.

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

# venv_cache_save ENTRY VENV KEEP [DROP...]: publish VENV as the cache entry ENTRY,
# without the paths DROP (relative to VENV, globs allowed: what is per venv or not part
# of the cached contents), then keep only the KEEP newest entries whose names start as
# ENTRY's does up to its last '-'. Best effort: a failure costs only the next venv its
# shortcut, never this run.
venv_cache_save() {
    local entry=$1 venv=$2 keep=$3 tmp="$1.tmp.$$" cache prefix drop old
    shift 3
    cache=$(dirname "$entry")
    prefix=$(basename "${entry%-*}")
    mkdir -p "$cache" 2>/dev/null || return 0
    rm -rf "$tmp"
    if ! cp -al "$venv/." "$tmp/" 2>/dev/null; then
        rm -rf "$tmp"
        step "not caching the environment: $cache cannot hold hard links to $venv"
        return 0
    fi
    for drop in "$@"; do
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
        tail -n +"$((keep + 1))" | cut -d' ' -f2-)
    return 0
}
