"""The checkpoint tier: a writable `MOUNTPOINT/ckpt/` backed by a node-local directory,
drained to the job's checkpoint store in the background (docs/CKPT.md).

Its connection's start-up (mount, INIT, forked workers, the drain) is
dlfsd.ckptconnect, above the FUSE adapters it forks; its workers are
dlfsd.fuse.ckptworker.
"""
