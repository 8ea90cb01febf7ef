"""`dlfs order`: one epoch of a DLFSSampler as a file list, for frameworks that read
lists (DALI's file_list, tf.data from a text file) instead of taking a sampler;
with `--resume STATE`, the rest of a stopped epoch (DLFSSampler.state_dict as JSON).

Thin: dlfs.order.sampler plans the epoch and writes the list; this module only turns
flags and a directory or list file into its arguments. The list is planned
exactly as the sampler of the same seed, epoch, rank and world would iterate it.
"""

from __future__ import annotations

import argparse
import json
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
        "  dlfs order paths.txt -o rest.txt --resume state.json --rank 0 --world-size 2\n"
        "\nSOURCE is a directory (every file under it, sorted: the sample indices) or a "
        "text file\nof paths, one per line. The list equals what DLFSSampler with the same "
        "--seed,\n--epoch, --rank, --world-size and --mode yields (docs/ORDER.md). Writing "
        "a list\nannounces nothing to the daemon: only a sampler does. --resume STATE (a "
        "JSON file\nof DLFSSampler.state_dict(), saved by any rank of a job of any size) "
        "writes this\nrank's share of the rest of that epoch; seed, epoch and --drop-last "
        "are the state's.")
    p.add_argument("source", type=_path, help="a directory of samples, or a file of paths")
    p.add_argument("-o", "--output", type=_path, required=True, metavar="FILE",
                   help="the file list to write (written whole, then renamed into place)")
    p.add_argument("--seed", type=_non_negative, default=0, help="shuffle seed (default 0)")
    p.add_argument("--epoch", type=_non_negative, default=None,
                   help="epoch (default 0; with --resume the state's)")
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
    p.add_argument("--resume", type=_path, metavar="STATE",
                   help="write the rest of the epoch a DLFSSampler state (JSON) stopped in")


def cmd_order(args: argparse.Namespace) -> int:
    from dlfs.order.sampler import DLFSSampler, write_order

    paths = _sample_paths(args.source)
    if not paths:
        raise DlfsError(f"no samples in {args.source}: give a directory with files or a "
                        "file listing paths")
    if args.rank >= args.world_size:
        raise UsageError(f"--rank {args.rank} must be below --world-size {args.world_size}")
    state = None if args.resume is None else _read_state(args.resume)
    with DLFSSampler(paths, seed=args.seed, rank=args.rank, world_size=args.world_size,
                     mode=args.mode, window=args.window, drop_last=args.drop_last) as sampler:
        if state is not None:
            try:
                sampler.load_state_dict(state)
            except ValueError as err:
                raise DlfsError(f"cannot resume from {args.resume}: {err}") from None
            if args.epoch is not None and args.epoch != sampler.epoch:
                raise UsageError(f"--epoch {args.epoch} is not the epoch {sampler.epoch} "
                                 f"that {args.resume} stopped in: leave --epoch out")
        elif args.epoch is not None:
            sampler.set_epoch(args.epoch)
        count = write_order(sampler, args.output)
        note = "" if sampler.mode == args.mode else f" (mode {sampler.mode}: see the warning)"
        what = "paths" if state is None else "paths left"
        epoch = sampler.epoch
    print(f"wrote {count} {what} of epoch {epoch}, rank {args.rank}/{args.world_size}, "
          f"to {args.output}{note}")
    return 0


def _read_state(path: str) -> dict:
    """A DLFSSampler state saved as JSON (`json.dump(sampler.state_dict(), f)`)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as err:
        raise DlfsError(f"cannot read {path}: {err.strerror}") from None
    except ValueError as err:
        raise DlfsError(f"{path} is not a JSON sampler state ({err}): save "
                        "DLFSSampler.state_dict() with json.dump") from None


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
