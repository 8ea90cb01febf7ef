#!/bin/bash
# Slurm Epilog for DLFS: drains the job's checkpoints to the store (dlfs flush,
# bounded), unmounts the job's datasets, stops the daemon, removes the job's secret,
# and its cache if it is per job or the site wipes it (dlfs.conf), never while it
# holds checkpoints the store lacks.
#
# slurm.conf: Epilog=/etc/slurm/dlfs/epilog.sh. Runs as root on every node of the
# job after it ends, also where the prolog failed or was never asked for DLFS,
# so "nothing mounted" is success. Exits 1 (Slurm drains the node) only if a
# mount or a daemon could not be removed.
set -u
DLFS_SCRIPT=epilog
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[ -n "$JOB" ] || exit 0
if ! is_mounted && [ ! -e "$RUN_DIR" ] && { ! cache_is_per_job || [ ! -e "$CACHE" ]; } \
        && [ ! -e "$(daemon_record)" ]; then
    rmdir -- "$MOUNT" 2>/dev/null
    exit 0  # not a DLFS job (the common case): nothing to do
fi
flush_checkpoints  # what it cannot drain, cleanup_job keeps (by the tier's ledger)
cleanup_job || exit 1
exit 0
