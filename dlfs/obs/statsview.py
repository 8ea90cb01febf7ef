"""Reading a stats snapshot (the `.dlfs/stats.json` format, docs/STATS.md) for people.

Shared by the daemon (the per-job summary at unmount) and the CLI (`dlfs
stats`): per-dataset rows, quantiles from the log2 histograms, a short text
summary and the rich table. No pyfuse3, no daemon state: just the dict.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from dlfs.errors import DlfsError, NotFoundError
from dlfs.obs.healthview import history_lines
from dlfs.sizes import format_size

SOURCES = ("local", "peer", "store")


def hist_bucket_of_quantile(hist: list[int], q: float) -> int | None:
    """The log2 bucket holding quantile `q` (0..1) of a histogram; None if it is empty."""
    total = sum(hist)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for bucket, count in enumerate(hist):
        seen += count
        if seen >= rank and count:
            return bucket
    return len(hist) - 1


def bucket_range(bucket: int) -> tuple[int, int]:
    """[low, high) of values v with v.bit_length() == bucket."""
    return (0, 1) if bucket == 0 else (1 << (bucket - 1), 1 << bucket)


def size_quantile_text(hist: list[int], q: float) -> str:
    bucket = hist_bucket_of_quantile(hist, q)
    if bucket is None:
        return "-"
    low, high = bucket_range(bucket)
    return "0" if bucket == 0 else f"{_short_size(low)}-{_short_size(high)}"


def latency_quantile_text(hist_us: list[int], q: float) -> str:
    """Upper bound of the latency bucket holding quantile q, e.g. '<256us'."""
    bucket = hist_bucket_of_quantile(hist_us, q)
    if bucket is None:
        return "-"
    high_us = bucket_range(bucket)[1]
    if high_us >= 1_000_000:
        return f"<{high_us / 1e6:.3g}s"
    if high_us >= 1000:
        return f"<{high_us / 1e3:.3g}ms"
    return f"<{high_us}us"


def _short_size(n: int) -> str:
    """1536 -> '1.5K', 131072 -> '128K', 3 -> '3' (binary units, 3 significant digits)."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g}{unit}"
    return str(n)


@dataclass
class Row:
    """One line of `dlfs stats` / the summary: a dataset or the whole mount."""

    name: str
    files: int
    opens: int | None  # None: not counted (the kernel opened files without the daemon)
    reads: int
    bytes: int
    random_pct: float
    median_request: str
    source_bytes: dict[str, int]
    p50: str
    p99: str


def make_row(name: str, c: dict, opens_counted: bool = True) -> Row:
    reads = c["reads"]
    return Row(
        name=name, files=c.get("files_touched", 0),
        opens=c["opens"] if opens_counted else None, reads=reads,
        bytes=c["bytes"], random_pct=100.0 * c["random_reads"] / reads if reads else 0.0,
        median_request=size_quantile_text(c["read_size_hist"], 0.5),
        source_bytes={s: c["sources"][s]["bytes"] for s in SOURCES},
        p50=latency_quantile_text(c["read_latency_us_hist"], 0.5),
        p99=latency_quantile_text(c["read_latency_us_hist"], 0.99))


def rows(snapshot: dict) -> list[Row]:
    """Per-dataset rows, then the mount total (if more than one dataset)."""
    if not snapshot.get("enabled", False):
        return []
    counted = snapshot.get("opens_counted", True)
    out = [make_row(name, c, counted) for name, c in sorted(snapshot["datasets"].items())]
    if len(out) > 1:
        out.append(make_row("(all)", snapshot["mount"], counted))
    return out


def text_summary(snapshot: dict) -> list[str]:
    """A few lines a job log can keep: what was read, how, from where, how fast."""
    if not snapshot.get("enabled", False):
        return ["I/O counters were off (--no-stats)"]
    lines = []
    for r in rows(snapshot):
        sources = ", ".join(f"{s} {format_size(n)}" for s, n in r.source_bytes.items() if n)
        lines.append(
            f"{r.name}: {r.files} files touched, {_opens_text(r.opens)}, {r.reads} reads, "
            f"{format_size(r.bytes)} read, {r.random_pct:.1f}% random, median request "
            f"{r.median_request}, latency p50 {r.p50} p99 {r.p99}"
            + (f"; from {sources}" if sources else ""))
    lookahead = lookahead_text(snapshot)
    if lookahead:
        lines.append(lookahead)
    return lines + history_lines(snapshot.get("health"))  # stalls: why GPUs may have idled


def lookahead_text(snapshot: dict) -> str:
    """One line on the look-ahead (docs/ORDER.md), or "" if no epoch was announced."""
    engine = snapshot.get("lookahead") or {}
    if not engine.get("announcements"):
        return ""
    taken = snapshot["mount"].get("lookahead", {"hits": 0, "misses": 0})
    reads = taken["hits"] + taken["misses"]
    share = f" ({100.0 * taken['hits'] / reads:.0f}%)" if reads else ""
    return (f"look-ahead: {engine['announcements']} epochs announced, "
            f"{format_size(engine['bytes_prefetched'])} prefetched "
            f"({engine['samples_prefetched']:,} samples{_from_peers(engine)}); "
            f"reads hit {taken['hits']:,}{share}, "
            f"missed {taken['misses']:,}")


def _from_peers(engine: dict) -> str:
    peer = engine.get("bytes_prefetched_from_peers", 0)
    return f", {format_size(peer)} of it from peers" if peer else ""


def _opens_text(opens: int | None) -> str:
    return "opens not counted (see --count-opens)" if opens is None else f"{opens} opens"


def rich_table(snapshot: dict, title: str):
    """The `dlfs stats` table (a rich.table.Table)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for header in ("dataset", "files", "opens", "reads", "bytes", "random", "median req",
                   *SOURCES, "p50", "p99"):
        table.add_column(header, justify="left" if header == "dataset" else "right",
                         no_wrap=True)
    for r in rows(snapshot):
        table.add_row(r.name, f"{r.files:,}", "-" if r.opens is None else f"{r.opens:,}",
                      f"{r.reads:,}",
                      _short_size(r.bytes), f"{r.random_pct:.1f}%", r.median_request,
                      *(_short_size(r.source_bytes[s]) for s in SOURCES), r.p50, r.p99)
    return table


# -- `dlfs stats` -----------------------------------------------------------------------
def read_snapshot(mountpoint: str) -> dict:
    """MOUNTPOINT/.dlfs/stats.json, parsed."""
    path = os.path.join(mountpoint, ".dlfs", "stats.json")
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise NotFoundError(f"{path} does not exist: is {mountpoint} a DLFS mount?") from None
    except OSError as err:
        raise DlfsError(f"cannot read {path}: {err.strerror}") from None
    except ValueError as err:
        raise DlfsError(f"{path} is not valid JSON ({err})") from None


def show_stats(mountpoint: str, watch: bool = False, as_json: bool = False,
               interval: float = 1.0) -> int:
    """Print the stats of a mount once, or refresh them until Ctrl-C."""
    if as_json:
        print(json.dumps(read_snapshot(mountpoint), indent=1))
        return 0
    from rich.console import Console
    from rich.live import Live

    def render():
        snapshot = read_snapshot(mountpoint)
        if not snapshot.get("enabled", False):
            return f"{mountpoint}: I/O counters are off (mounted with --no-stats)"
        when = time.strftime("%H:%M:%S", time.localtime(snapshot["time_ns"] / 1e9))
        table = rich_table(snapshot, f"{mountpoint} at {when}")
        table.caption = lookahead_text(snapshot) or None
        table.caption_justify = "left"
        return table

    console = Console(width=None if sys.stdout.isatty() else 200)
    if not watch:
        console.print(render())
        return 0
    with Live(render(), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0
