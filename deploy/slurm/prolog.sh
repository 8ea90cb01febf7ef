#!/bin/bash
# Slurm Prolog for DLFS: mounts the store's datasets for a job that asks for it.
#
# slurm.conf: Prolog=/etc/slurm/dlfs/prolog.sh, PrologFlags=Alloc (runs as root
# on every node of the allocation, before the job starts). Settings: dlfs.conf
# next to this script. A failure prints one line (it lands in the slurmd log),
# leaves nothing behind, and exits 1: Slurm then drains the node and requeues
# or fails the job. See deploy/slurm/README.md.
set -u
DLFS_SCRIPT=prolog
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

wanted || exit 0

fail() {
    say "$*"
    cleanup_job >/dev/null
    exit 1
}

[ -n "$JOB" ] && [ -n "${SLURM_JOB_UID:-}" ] || fail "not run by slurmd (SLURM_JOB_ID or SLURM_JOB_UID missing)"
[ -x "$DLFS_BIN" ] || fail "dlfs not found at DLFS_BIN=$DLFS_BIN (see $DLFS_CONF)"
[ -d "$DLFS_STORE" ] || fail "store not found: $DLFS_STORE (DLFS_STORE in $DLFS_CONF)"

umask 022
mkdir -p -- "$MOUNT" "$(dirname -- "$LOG")" || fail "cannot create $MOUNT"
mkdir -p -m 0700 -- "$CACHE" || fail "cannot create cache dir $CACHE"
mkdir -p -- "$RUN_DIR" && chown root:root "$RUN_DIR" && chmod 0711 "$RUN_DIR" \
    || fail "cannot create job dir $RUN_DIR"

out=$("$DLFS_BIN" slurm-secret --key-file "$DLFS_SITE_KEY" --job-id "$JOB" \
      --out "$RUN_DIR/secret" --uid "$SLURM_JOB_UID" --gid "${SLURM_JOB_GID:-$SLURM_JOB_UID}" \
      </dev/null 2>&1) || fail "${out:-cannot write the job secret}"

ckpt=()
if [ -n "$CKPT" ]; then
    case $DLFS_CKPT_STORE in
        *%j*) ;;
        *) warn "DLFS_CKPT_STORE=$DLFS_CKPT_STORE has no %j: every job shares one checkpoint dir, which belongs to the first job's user (refused to others); add %j in $DLFS_CONF" ;;
    esac
    # Made 0700 for the job's user by descriptors, never following a link the user
    # may have planted below the site's prefix (dlfs.cluster.slurm.make_job_dir).
    out=$("$DLFS_BIN" slurm-ckpt-dir "$DLFS_CKPT_STORE" --job-id "$JOB" --node "$NODE" \
          --uid "$SLURM_JOB_UID" --gid "${SLURM_JOB_GID:-$SLURM_JOB_UID}" </dev/null 2>&1) \
        || fail "cannot create the checkpoint dir: $(printf '%s' "$out" | tail -n 1) (DLFS_CKPT_STORE in $DLFS_CONF)"
    CKPT=$(printf '%s' "$out" | tail -n 1)
    # shellcheck disable=SC2206
    ckpt=(--ckpt-store "$CKPT" ${DLFS_CKPT_ARGS:-})
fi

replicas=${DLFS_REPLICAS:-1}
node_limit=()
[ -n "${DLFS_CACHE_NODE_LIMIT:-}" ] && node_limit=(--node-cache-limit "$DLFS_CACHE_NODE_LIMIT")
[ "$replicas" -gt "${SLURM_JOB_NUM_NODES:-1}" ] && replicas=${SLURM_JOB_NUM_NODES:-1}

# `dlfs mount` starts the daemon in its own session with stdio on the log and
# returns only once the mount answers, so nothing can outlive us half-started
# and nothing holds our stdout (slurmd would wait for it).
# shellcheck disable=SC2086
out=$("$DLFS_BIN" mount "$MOUNT" --slurm --store "$DLFS_STORE" \
      --uid "$SLURM_JOB_UID" --gid "${SLURM_JOB_GID:-$SLURM_JOB_UID}" \
      --cache-dir "$CACHE" "${node_limit[@]}" "${ckpt[@]}" --secret-file "$RUN_DIR/secret" \
      --replicas "$replicas" \
      --port-base "$DLFS_PORT_BASE" --port-span "${DLFS_PORT_SPAN:-1}" \
      --node-host "$DLFS_NODE_HOST" \
      --log-file "$LOG" --summary-file "${LOG%.log}.summary.json" \
      --timeout "$DLFS_MOUNT_TIMEOUT" $DLFS_MOUNT_ARGS \
      </dev/null 2>&1) || fail "mount failed: $(printf '%s' "$out" | tail -n 1)"
exit 0
