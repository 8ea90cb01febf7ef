"""`dlfs cache ls|prune`: a node's chunk cache dir, for the admin who keeps it.

Thin: dlfs.store.nodecache knows the cache dir's layout, what each dataset
holds, when it was last used and whether a mount uses it now; this module
turns flags into its calls and prints one line per dataset, then one per
checkpoint tier (docs/CKPT.md): those are never pruned (they may hold the only
copy of a checkpoint), but their bytes count towards --to-size, as towards
--node-cache-limit.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from dlfs.cli.common import Subparsers, _path, _size, add_command
from dlfs.errors import DlfsError, UsageError
from dlfs.sizes import format_size

_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def register(subs: Subparsers) -> None:
    """Add `cache`."""
    p = add_command(
        subs, "cache", cmd_cache,
        "list or prune a node's chunk cache dir (the copies jobs staged, kept for later jobs)",
        "examples:\n"
        "  dlfs cache ls --cache-dir /local/dlfs-cache\n"
        "  dlfs cache prune --cache-dir /local/dlfs-cache --older-than 14d\n"
        "  dlfs cache prune --cache-dir /local/dlfs-cache --to-size 500G --dry-run\n"
        "  dlfs cache prune --cache-dir /local/dlfs-cache --dataset imagenet "
        "--store /lustre/dlfs-store\n"
        "\nDatasets are listed least recently used first. A dataset a mount uses now is "
        "never\npruned (it is shown as 'in use' and skipped). Datasets are named as the "
        "last mount\nusing them named them; with --store, by the store's manifests, and a "
        "uuid the store\nno longer has is an old version (re-populated or removed).\n"
        "Checkpoint tiers (CACHE_DIR/ckpt/, what jobs wrote into MOUNTPOINT/ckpt/ "
        "and what\nan epilog could not drain) are listed after the datasets; they are never "
        "pruned,\nbut their bytes count towards --to-size.")
    p.add_argument("action", choices=("ls", "prune"))
    p.add_argument("--cache-dir", type=_path, required=True, help="the node's cache dir")
    p.add_argument("--store", type=_path,
                   help="name datasets by this store's manifests (and tell old versions)")
    p.add_argument("--dataset", action="append", metavar="NAME|UUID",
                   help="prune: this dataset (repeatable; a name needs --store)")
    p.add_argument("--older-than", type=_age, metavar="AGE",
                   help="prune: datasets unused for AGE (e.g. 90m, 12h, 14d)")
    p.add_argument("--to-size", type=_size, metavar="SIZE",
                   help="prune: least recently used first until the cache holds SIZE")
    p.add_argument("--dry-run", action="store_true", help="prune: say what would go")
    p.add_argument("--json", action="store_true", help="ls: one JSON list")


def _age(text: str) -> float:
    match = _AGE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"must be a number with s, m, h or d, e.g. 14d, "
                                         f"got {text!r}")
    return float(match.group(1)) * _UNIT[match.group(2)]


def cmd_cache(args: argparse.Namespace) -> int:
    from dlfs.store.nodecache import ckpt_tiers, datasets

    root = Path(args.cache_dir)
    if not root.is_dir():
        raise DlfsError(f"cache dir {root} does not exist (give the --cache-dir the "
                        "mounts use)")
    names = _names(args.store)
    found = datasets(root)
    tiers = ckpt_tiers(root)
    if args.action == "ls":
        return _list(found, tiers, names, args.json)
    return _prune(found, tiers, names, args)


def _names(store: str | None) -> dict[str, str] | None:
    """uuid hex -> dataset name in `store`; None without a store (the names the
    cache dir recorded stand then)."""
    if not store:
        return None
    from dlfs.store.store import Store

    s = Store(store).require()
    return {s.open(name).uuid.hex(): name for name in s.dataset_names()}


def _name(d, names: dict[str, str] | None) -> str | None:
    """A cached dataset's name: the store's for its uuid given --store, else the one
    its last mount recorded."""
    return d.name if names is None else names.get(d.uuid)


def _list(found, tiers, names: dict[str, str] | None, as_json: bool) -> int:
    rows = [{"kind": "dataset", "dataset": _name(d, names), "uuid": d.uuid,
             "source": d.source, "chunks": d.chunks, "bytes": d.bytes,
             "last_used": d.last_used or None, "in_use": d.in_use} for d in found]
    rows += [{"kind": "ckpt", "dataset": None, "uuid": None, "path": str(t.path),
              "store": t.store or None, "files": t.files, "bytes": t.bytes,
              "undrained": t.undrained, "last_used": t.last_used or None,
              "in_use": t.in_use} for t in tiers]
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    if not found:
        print("no datasets cached")
    for d in found:
        print(_line(d, names))
    for t in tiers:
        print(_tier_line(t))
    total = f"{len(found)} datasets, {format_size(sum(d.bytes for d in found))}"
    if tiers:
        total += (f"; {len(tiers)} checkpoint tiers, {format_size(sum(t.bytes for t in tiers))}"
                  " (never pruned)")
    if found or tiers:
        print(total)
    return 0


def _tier_line(t) -> str:
    undrained = ("ledger unreadable" if t.undrained is None
                 else f"{t.undrained} not on the store" if t.undrained else "all on the store")
    return (f"checkpoint tier {t.path} (drains to {t.store or 'unknown'}): {t.files} files "
            f"({undrained}), {format_size(t.bytes)}" + (", in use" if t.in_use else ""))


def _line(d, names: dict[str, str] | None) -> str:
    if names is None:
        name = f"{d.name} ({d.uuid})" if d.name else f"{d.uuid} (name not recorded)"
    else:
        was = f", was {d.name}" if d.name else ""
        name = names.get(d.uuid) or f"{d.uuid} (not in the store{was})"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(d.last_used)) if d.last_used \
        else "never recorded"
    return (f"{name}: {d.chunks} chunks, {format_size(d.bytes)}, last used {when}"
            + (", in use" if d.in_use else ""))


def _prune(found, tiers, names: dict[str, str] | None, args: argparse.Namespace) -> int:
    from dlfs.store.nodecache import remove, select_for_pruning

    if not (args.dataset or args.older_than is not None or args.to_size is not None):
        raise UsageError("prune needs --dataset, --older-than or --to-size")
    uuids = _uuids(args.dataset, names) if args.dataset else None
    for d in found:
        if d.in_use and ((uuids and d.uuid in uuids) or args.to_size is not None):
            print(f"skipped {_line(d, names)}")
    held = sum(t.bytes for t in tiers)
    if held and args.to_size is not None:
        print(f"checkpoint tiers hold {format_size(held)} of the cache dir (never pruned; "
              "drain them with dlfs mount + dlfs flush, docs/CKPT.md)")
    chosen = select_for_pruning(found, uuids=uuids, older_than=args.older_than,
                                to_size=None if args.to_size is None
                                else max(args.to_size - held, 0))
    freed = 0
    for d in chosen:
        if args.dry_run:
            print(f"would remove {_line(d, names)}")
        elif remove(d):
            print(f"removed {_line(d, names)}")
        else:
            print(f"skipped {_line(d, names)}: a mount started using it")
            continue
        freed += d.bytes
    verb = "would free" if args.dry_run else "freed"
    print(f"{verb} {format_size(freed)} of {format_size(sum(d.bytes for d in found))}")
    return 0


def _uuids(wanted: list[str], names: dict[str, str] | None) -> set[str]:
    by_name = {name: uuid for uuid, name in (names or {}).items()}
    out = set()
    for item in wanted:
        if re.fullmatch(r"[0-9a-f]{32}", item):
            out.add(item)
        elif item in by_name:
            out.add(by_name[item])
        else:
            hint = "" if names is not None else " (give --store to name datasets)"
            raise UsageError(f"--dataset {item}: no such dataset{hint}")
    return out
