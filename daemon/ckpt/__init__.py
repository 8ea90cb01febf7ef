"""The checkpoint tier: a writable `MOUNTPOINT/ckpt/` backed by a node-local directory,
drained to the job's checkpoint store in the background (docs/CKPT.md)."""
