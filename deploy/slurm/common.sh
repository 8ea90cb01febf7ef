# Shared by prolog.sh and epilog.sh: settings, the job's paths, cleanup. Sourced.
# shellcheck shell=bash

# slurmd gives prolog and epilog no PATH at all.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

DLFS_SLURM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DLFS_CONF=${DLFS_CONF:-$DLFS_SLURM_DIR/dlfs.conf}
JOB=${SLURM_JOB_ID:-}
NODE=${SLURMD_NODENAME:-$(hostname -s)}

# One line on stdout: slurmd puts a failing prolog's output in its log.
say() { echo "dlfs $DLFS_SCRIPT: job $JOB on $NODE: $*"; }

# A warning an admin must see although the script succeeds (slurmd discards the
# output of a prolog or epilog that exits 0): on stdout, appended to the job's daemon
# log $LOG (in its format), and to syslog when there is one.
warn() {
    say "$*"
    # 0640 like the daemon's own lines (dlfs.runtime.LOG_MODE), whatever slurmd's umask.
    [ -d "$(dirname -- "$LOG")" ] && (umask 027; printf '%s dlfs.%s WARNING job %s on %s: %s\n' \
        "$(date '+%F %T,%3N')" "$DLFS_SCRIPT" "$JOB" "$NODE" "$*" >> "$LOG")
    command -v logger >/dev/null && logger -t dlfs -p user.warning -- \
        "dlfs $DLFS_SCRIPT: job $JOB on $NODE: $*" 2>/dev/null
    return 0
}

if [ ! -r "$DLFS_CONF" ]; then
    say "cannot read settings $DLFS_CONF"
    exit 1
fi
# shellcheck source=dlfs.conf
. "$DLFS_CONF"

# %j -> job id, %n -> node name, %% -> % (same rule as dlfs.cluster.slurm.expand_pattern).
expand() {
    local s=${1//%%/$'\x01'}
    s=${s//%j/$JOB}
    s=${s//%n/$NODE}
    printf '%s' "${s//$'\x01'/%}"
}

# Canonical, as `dlfs mount` records it (the epilog matches the daemon by this path).
MOUNT=$(readlink -m -- "$(expand "$DLFS_MOUNT")")
CACHE=$(expand "$DLFS_CACHE")
RUN_DIR=$(expand "$DLFS_RUN_DIR")
LOG=$(expand "$DLFS_LOG")
CKPT=""
[ -n "${DLFS_CKPT_STORE:-}" ] && CKPT=$(readlink -m -- "$(expand "$DLFS_CKPT_STORE")")

# The node-local tier of $CKPT (dlfsd.ckpt.tier.tier_path: a hash of its real path).
ckpt_tier() {
    printf '%s/ckpt/%s' "$CACHE" "$(printf '%s' "$CKPT" | sha256sum | cut -c1-16)"
}

# Before unmounting: drain the job's checkpoints to $CKPT (bounded); on failure say
# what is left (dlfs flush's one line) and return 1. Whether the tier then stays is
# not decided here: cleanup_job asks the tier's ledger (a mount may be gone too).
flush_checkpoints() {
    [ -n "$CKPT" ] && is_mounted || return 0
    local out
    out=$("$DLFS_BIN" flush "$MOUNT" --quiet --timeout "${DLFS_CKPT_FLUSH_TIMEOUT:-600}" \
          </dev/null 2>&1) && return 0
    warn "checkpoints not drained to $CKPT, kept in the node cache $(ckpt_tier): $(printf '%s' "$out" | tail -n 1)"
    return 1
}

# Does this job ask for DLFS? (DLFS_OPT_IN; a 22.05 prolog sees the comment and the
# constraints, not the job's environment.)
wanted() {
    local rule
    for rule in $DLFS_OPT_IN; do
        case $rule in
            all) return 0 ;;
            # The word dlfs anywhere, not inside a longer name (nodlfs, my-dlfs-x).
            comment) printf '%s' "${SLURM_JOB_COMMENT:-}" \
                         | grep -Eiq '(^|[^[:alnum:]_-])dlfs($|[^[:alnum:]_-])' && return 0 ;;
            constraint) printf '%s' "${SLURM_JOB_CONSTRAINTS:-}" | tr -c '[:alnum:]_.-' '\n' \
                         | grep -Fxq -- "$DLFS_FEATURE" && return 0 ;;
        esac
    done
    return 1
}

# True while a file system is mounted at $MOUNT (also a dead FUSE daemon's).
is_mounted() {
    awk -v mp="$MOUNT" '$2 == mp { found = 1 } END { exit !found }' /proc/self/mounts
}

# The runtime record `dlfs mount` leaves for $MOUNT's daemon (dlfs.runtime.record_path:
# root's /run/dlfs, keyed by a hash of the canonical mountpoint). It names the daemon's
# pid; a user cannot write there, unlike a command line, which anyone can imitate.
daemon_record() {
    printf '/run/dlfs/%s.json' "$(printf '%s' "$MOUNT" | sha1sum | cut -c1-16)"
}

# Stop whatever is left of $MOUNT's daemon: `dlfs stop-daemon` finds its processes by
# the record, the owner (root) and the session (the daemon's own), TERM then KILL.
# Non-zero, with its line on stdout, if one survived.
stop_daemon() {
    [ -e "$(daemon_record)" ] || return 0
    local out
    out=$("$DLFS_BIN" stop-daemon "$MOUNT" </dev/null 2>&1) && return 0
    printf '%s\n' "$out" | tail -n 1
    return 1
}

# Remove the checkpoint tiers of $CACHE that `dlfs ckpt-audit` clears (drained by the
# tier's own ledger and held by no mount), whatever became of the mount; keep every
# other one for an admin, with a warning. With "job": only $CKPT's tier. Returns 1 if
# a tier was kept.
clear_ckpt_tiers() {
    [ -d "$CACHE/ckpt" ] || return 0
    local which=() out code line verdict key kept=0
    [ "${1:-}" = job ] && which=(--ckpt-store "$CKPT")
    out=$("$DLFS_BIN" ckpt-audit --cache-dir "$CACHE" "${which[@]}" </dev/null 2>&1)
    code=$?
    case $code in
        0|4|5|6) ;;  # all clear, undrained, in use, unknown (dlfs ckpt-audit --help)
        *) warn "checkpoints kept in the node cache $CACHE/ckpt: cannot audit them: $(printf '%s' "$out" | tail -n 1)"
           return 1 ;;
    esac
    while IFS= read -r line; do
        verdict=${line%% *}
        key=${line#* }
        key=${key%%:*}
        case $key in ''|*[!0-9a-f]*) continue ;; esac  # not a tier's line
        if [ "$verdict" = drained ]; then
            # Under its lock: a mount that took the tier since the audit keeps it.
            flock -n "$CACHE/ckpt/$key/.lock" rm -rf -- "$CACHE/ckpt/$key" && continue
            line="in-use $key: a mount took it after the audit"
        fi
        kept=1
        case $verdict in
            in-use) say "checkpoint tier kept: $line" ;;  # another job's, or a live daemon
            *) warn "checkpoints kept in the node cache: $line" ;;
        esac
    done <<< "$out"
    return $kept
}

# Is the cache dir the job's own (DLFS_CACHE names %j)? Else the node's, kept for
# later jobs unless DLFS_CACHE_AFTER_JOB=wipe.
cache_is_per_job() {
    case $DLFS_CACHE in *%j*) return 0 ;; *) return 1 ;; esac
}

# Unmount (lazy if busy), stop any daemon left, remove the job dir, and the cache if
# it is the job's own or the site wipes it, sparing every checkpoint tier the audit
# does not clear (clear_ckpt_tiers); in a node cache kept for later jobs, only the
# job's own checkpoint tier goes, once drained. Returns non-zero only if a mount or a
# daemon survived everything.
cleanup_job() {
    if is_mounted; then
        "$DLFS_BIN" umount "$MOUNT" --timeout 20 </dev/null >/dev/null 2>&1 \
            || "$DLFS_BIN" umount --lazy "$MOUNT" </dev/null >/dev/null 2>&1 \
            || fusermount3 -u -z "$MOUNT" >/dev/null 2>&1 \
            || umount -l "$MOUNT" >/dev/null 2>&1
    fi
    local ok=0 survived
    survived=$(stop_daemon) || { say "daemon for $MOUNT survived SIGKILL: $survived"; ok=1; }
    if cache_is_per_job || [ "${DLFS_CACHE_AFTER_JOB:-keep}" = wipe ]; then
        if clear_ckpt_tiers; then
            rm -rf -- "$CACHE"
        elif [ -d "$CACHE" ]; then  # the chunk copies go, the kept tiers stay
            find "$CACHE" -mindepth 1 -maxdepth 1 ! -name ckpt -exec rm -rf -- {} +
        fi
    elif [ -n "$CKPT" ]; then
        clear_ckpt_tiers job
    fi
    rm -rf -- "$RUN_DIR"
    rmdir -- "$MOUNT" 2>/dev/null
    if is_mounted; then say "still mounted at $MOUNT after unmounting"; ok=1; fi
    return $ok
}
