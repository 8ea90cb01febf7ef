"""`dlfs order`: one epoch of a DLFSSampler as a file list, for frameworks that read
lists (DALI's file_list, tf.data from a text file) instead of taking a sampler.

Thin: dlfs.sampler plans the epoch and writes the list; this module only turns
flags and a directory or list file into its arguments. The list is planned
exactly as the sampler of the same seed, epoch, rank and world would iterate it.
"""

from __future__ import annotations

import argparse
import os

from dlfs.cli.common import Subparsers, _non_negative, _path, _positive, add_command
from dlfs.errors import DlfsError, UsageError


def register(subs: Subparsers) -> None:
    """Add `order`."""
    p = add_command(
        subs, "order", cmd_order,
        "write one epoch's sample order as a file list (one path per line) for DALI or "
        "tf.data",
        "examples:\n"
        "  dlfs order /mnt/dlfs/imagenet/train -o epoch0.txt\n"
        "  dlfs order /mnt/dlfs/imagenet/train -o rank1.txt --epoch 3 --rank 1 "
        "--world-size 8 --mode locality\n"
        "  dlfs order paths.txt -o epoch0.txt --seed 42\n"
        "\nSOURCE is a directory (every file under it, sorted: the sample indices) or a "
        "text file\nof paths, one per line. The list equals what DLFSSampler with the same "
        "--seed,\n--epoch, --rank, --world-size and --mode yields (docs/ORDER.md). Writing "
        "a list\nannounces nothing to the daemon: only a sampler does.")
    p.add_argument("source", type=_path, help="a directory of samples, or a file of paths")
    p.add_argument("-o", "--output", type=_path, required=True, metavar="FILE",
                   help="the file list to write (written whole, then renamed into place)")
    p.add_argument("--seed", type=_non_negative, default=0, help="shuffle seed (default 0)")
    p.add_argument("--epoch", type=_non_negative, default=0, help="epoch (default 0)")
    p.add_argument("--rank", type=_non_negative, default=0, help="this rank (default 0)")
    p.add_argument("--world-size", type=_positive, default=1,
                   help="ranks in the job (default 1)")
    p.add_argument("--mode", choices=("random", "locality"), default="random",
                   help="random (DistributedSampler's distribution, default) or locality "
                        "(mostly chunks this node holds; needs a DLFS mount)")
    p.add_argument("--window", type=_positive, default=8,
                   help="locality: chunks open at a time per rank (default 8)")
    p.add_argument("--drop-last", action="store_true",
                   help="drop the tail instead of padding it (DistributedSampler's rule)")


def cmd_order(args: argparse.Namespace) -> int:
    from dlfs.sampler import DLFSSampler, write_order

    paths = _sample_paths(args.source)
    if not paths:
        raise DlfsError(f"no samples in {args.source}: give a directory with files or a "
                        "file listing paths")
    if args.rank >= args.world_size:
        raise UsageError(f"--rank {args.rank} must be below --world-size {args.world_size}")
    with DLFSSampler(paths, seed=args.seed, rank=args.rank, world_size=args.world_size,
                     mode=args.mode, window=args.window, drop_last=args.drop_last) as sampler:
        count = write_order(sampler, args.output, args.epoch)
        note = "" if sampler.mode == args.mode else f" (mode {sampler.mode}: see the warning)"
    print(f"wrote {count} paths of epoch {args.epoch}, rank {args.rank}/{args.world_size}, "
          f"to {args.output}{note}")
    return 0


def _sample_paths(source: str) -> list[str]:
    """Every file under a directory (sorted, walked without following links), or the
    non-empty lines of a list file."""
    try:
        if os.path.isdir(source):
            found = []
            for top, dirs, files in os.walk(source, onerror=_raise):
                dirs.sort()
                found += [os.path.join(top, name) for name in sorted(files)]
            return found
        with open(source, encoding="utf-8", errors="surrogateescape") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except OSError as err:
        raise DlfsError(f"cannot read {err.filename or source}: {err.strerror}") from None


def _raise(err: OSError) -> None:
    raise err
