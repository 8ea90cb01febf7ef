"""`dlfs demo`: the whole single-node story in one command, on generated data.

Generates an ImageNet-like tree, packs it, mounts it, reads it like a
shuffled training epoch with several worker processes, prints throughput
next to the same reads from the source directory, and unmounts.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from dlfs.cli.mountctl import FSTYPE, mount, mounted_fstype, umount
from dlfs.config import MountConfig
from dlfs.demo.sampledata import generate_tree
from dlfs.demo.workload import EpochResult, shuffled_epoch
from dlfs.runtime import mountpoint_path
from dlfs.sizes import format_size
from dlfs.store.populate import PopulateOptions, populate
from dlfs.store.store import Store


def _line(label: str, r: EpochResult) -> None:
    print(f"  {label:<28} {r.files_per_s:>10,.0f} files/s {r.mib_per_s:>9,.1f} MiB/s "
          f"({r.files} files in {r.seconds:.2f} s)")


def run_demo(files: int, mean_size: int, workers: int, workdir: Path | None, keep: bool) -> int:
    """Run the demo in a new directory under `workdir` (default /var/tmp), removed at the
    end unless `keep`: never in `workdir` itself, whose other contents are the user's."""
    parent = Path(workdir or "/var/tmp")
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dlfs-demo-", dir=parent))
    src, store, mnt = work / "source", Store(work / "store"), work / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    try:
        print(f"1. generating {files} samples of ~{format_size(mean_size)} under {src}")
        tree = generate_tree(src, files, mean_size)
        print(f"   {tree.files} files, {format_size(tree.bytes)}")

        print(f"2. dlfs populate {src} --store {store.path} --name demo")
        started = time.monotonic()
        dataset = populate(src, store, "demo", PopulateOptions(force=True))
        print(f"   {dataset.chunk_count} chunks in {time.monotonic() - started:.1f} s")

        print(f"3. dlfs mount {mnt} --store {store.path}")
        mount(MountConfig(mountpoint=str(mnt), store=str(store.path)), foreground=False)

        rel = [os.path.relpath(p, src) for p in tree.paths]
        via_mount = [str(mnt / "demo" / r) for r in rel]
        print(f"4. shuffled epochs, {workers} worker processes")
        _line("source directory", shuffled_epoch([str(p) for p in tree.paths], workers, seed=1))
        _line("mount, epoch 1 (from chunks)", shuffled_epoch(via_mount, workers, seed=2))
        _line("mount, epoch 2 (page cache)", shuffled_epoch(via_mount, workers, seed=3))

        sample = random.Random(0).sample(range(len(rel)), min(200, len(rel)))
        same = all((mnt / "demo" / rel[i]).read_bytes() == tree.paths[i].read_bytes()
                   for i in sample)
        print(f"5. {len(sample)} random samples compared with the source: "
              f"{'identical' if same else 'MISMATCH'}")
        return 0 if same else 1
    finally:
        # Asked of the kernel, not tracked: a Ctrl-C just as mount() returns must
        # still unmount, and a mount that failed left nothing to unmount.
        if mounted_fstype(mountpoint_path(str(mnt))) == FSTYPE:
            print(f"6. dlfs umount {mnt}")
            umount(str(mnt))  # raises if it fails: then nothing below runs on a mount
        if keep:
            print(f"   kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
