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
# what is left (dlfs flush's one line) and return 1: the caller keeps the cache.
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

# PIDs of daemon processes serving $MOUNT (main and workers), from their command line.
daemon_pids() {
    local pid cmd
    for pid in $(pgrep -f -- '-m dlfsd --config' || true); do
        cmd=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) || continue
        case $cmd in *"\"mountpoint\": \"$MOUNT\""*) echo "$pid" ;; esac
    done
}

# Is the cache dir the job's own (DLFS_CACHE names %j)? Else the node's, kept for
# later jobs unless DLFS_CACHE_AFTER_JOB=wipe.
cache_is_per_job() {
    case $DLFS_CACHE in *%j*) return 0 ;; *) return 1 ;; esac
}

# Unmount (lazy if busy), stop any daemon left, remove the job dir, and the cache
# if it is the job's own or the site wipes it (never while it holds checkpoints the
# store lacks: `cleanup_job keep-ckpt`); a drained checkpoint tier goes.
# Returns non-zero only if a mount or a daemon survived everything.
cleanup_job() {
    local keep_ckpt=${1:-}
    if is_mounted; then
        "$DLFS_BIN" umount "$MOUNT" --timeout 20 </dev/null >/dev/null 2>&1 \
            || "$DLFS_BIN" umount --lazy "$MOUNT" </dev/null >/dev/null 2>&1 \
            || fusermount3 -u -z "$MOUNT" >/dev/null 2>&1 \
            || umount -l "$MOUNT" >/dev/null 2>&1
    fi
    local pids
    pids=$(daemon_pids)
    if [ -n "$pids" ]; then
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null
        for _ in $(seq 50); do
            [ -z "$(daemon_pids)" ] && break
            sleep 0.1
        done
        pids=$(daemon_pids)
        # shellcheck disable=SC2086
        [ -n "$pids" ] && kill -KILL $pids 2>/dev/null && sleep 0.2
    fi
    if [ -n "$keep_ckpt" ]; then
        :  # undrained checkpoints: the cache stays for an admin
    elif cache_is_per_job || [ "${DLFS_CACHE_AFTER_JOB:-keep}" = wipe ]; then
        rm -rf -- "$CACHE"
    elif [ -n "$CKPT" ]; then
        rm -rf -- "$(ckpt_tier)"  # drained: on the store now
    fi
    rm -rf -- "$RUN_DIR"
    rmdir -- "$MOUNT" 2>/dev/null
    local ok=0
    if is_mounted; then say "still mounted at $MOUNT after unmounting"; ok=1; fi
    if [ -n "$(daemon_pids)" ]; then say "daemon for $MOUNT survived SIGKILL"; ok=1; fi
    return $ok
}
