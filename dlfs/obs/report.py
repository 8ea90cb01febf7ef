"""`dlfs report TRACE -o DIR`: the plots the DL I/O studies use, from a trace CSV.

Writes DIR/spatial.png (file offset by process, colored by request size),
temporal.png (request size over time), request_sizes.png, sources.png (bytes
by source), throughput.png (MiB/s over time), top_files.png, plus
summary.txt and index.html showing all of them. Scatter plots draw at most
MAX_POINTS reads (an even sample; the summary always uses every record).
Needs matplotlib (the `report` extra).
"""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlfs.errors import DlfsError
from dlfs.obs.traceclient import Trace, read_trace_csv
from dlfs.sizes import format_size

MAX_POINTS = 200_000
PLOTS = (
    ("spatial.png", "Spatial pattern: offset within the dataset by process"),
    ("temporal.png", "Temporal pattern: request size over time"),
    ("request_sizes.png", "Read request sizes"),
    ("sources.png", "Bytes by source"),
    ("throughput.png", "Read throughput over time"),
    ("top_files.png", "Top files by bytes read"),
)


@dataclass
class Summary:
    operations: int
    reads: int
    opens: int
    files: int
    bytes: int
    random_pct: float
    median_request: float
    processes: int
    seconds: float
    dropped: int

    def lines(self) -> list[str]:
        rate = self.bytes / self.seconds if self.seconds > 0 else 0.0
        return [
            f"operations: {self.operations:,} ({self.opens:,} opens, {self.reads:,} reads; "
            f"{self.dropped:,} dropped by the ring)",
            f"files touched: {self.files:,}",
            f"bytes read: {self.bytes:,} ({format_size(self.bytes)})",
            f"random reads: {self.random_pct:.1f}% (sequential = starts where the previous "
            "read of the file ended, or at 0 after an open)",
            f"median request size: {self.median_request:,.0f} bytes",
            f"processes: {self.processes:,}",
            f"duration: {self.seconds:.3f} s ({format_size(rate)}/s)",
        ]


def _reads(trace: Trace) -> np.ndarray:
    ops = {name: i for i, name in enumerate(trace.ops)}
    return trace.records[trace.records["op"] == ops["read"]] if "read" in ops \
        else trace.records[:0]


def random_read_count(trace: Trace) -> int:
    """Reads not starting where the previous read of the same file ended, nor at 0:
    the daemon's counters' rule (docs/STATS.md), which must hold without opens too,
    since by default the kernel opens files without telling the daemon."""
    ops = {name: i for i, name in enumerate(trace.ops)}
    last_end: dict[int, int] = {}
    random = 0
    for op, path, offset, size in zip(trace.records["op"].tolist(), trace.records["path"].tolist(),
                                      trace.records["offset"].tolist(),
                                      trace.records["size"].tolist(), strict=True):
        if op == ops.get("open"):
            last_end[path] = 0
        elif op == ops.get("read"):
            if offset and last_end.get(path, 0) != offset:
                random += 1
            last_end[path] = offset + size
    return random


def summarize(trace: Trace) -> Summary:
    r = trace.records
    reads = _reads(trace)
    opens = int(np.count_nonzero(r["op"] == trace.ops.index("open"))) \
        if "open" in trace.ops else 0
    data_ops = [trace.ops.index(op) for op in ("open", "read") if op in trace.ops]
    touched = set(np.unique(r["path"][np.isin(r["op"], data_ops)]).tolist()) - {0}
    seconds = 0.0
    if r.size:
        seconds = (int((r["time_ns"] + r["latency_ns"]).max()) - int(r["time_ns"].min())) / 1e9
    return Summary(
        operations=int(r.size), reads=int(reads.size), opens=opens, files=len(touched),
        bytes=int(reads["size"].sum()),
        random_pct=100.0 * random_read_count(trace) / reads.size if reads.size else 0.0,
        median_request=float(statistics.median(reads["size"].tolist())) if reads.size else 0.0,
        processes=len(set(r["pid"].tolist()) - {-1}), seconds=seconds,
        dropped=trace.meta.get("dropped", 0))


# -- plots -------------------------------------------------------------------------------
def _sample(a: np.ndarray) -> np.ndarray:
    return a if a.size <= MAX_POINTS else a[np.linspace(0, a.size - 1, MAX_POINTS).astype(int)]


def _plot_spatial(ax, trace: Trace, reads: np.ndarray, plt) -> None:
    """x: offset in the dataset laid out file after file (by path); y: process."""
    extent: dict[int, int] = {}
    for path, end in zip(reads["path"].tolist(), (reads["offset"] + reads["size"]).tolist(),
                         strict=True):
        extent[path] = max(extent.get(path, 0), end)
    base, pos = {}, 0
    for path in sorted(extent, key=lambda p: trace.paths[p]):
        base[path] = pos
        pos += extent[path]
    pts = _sample(reads)
    x = np.array([base[p] for p in pts["path"].tolist()], dtype=np.int64) + pts["offset"]
    pids = sorted(set(pts["pid"].tolist()))
    y = np.searchsorted(np.array(pids), pts["pid"])
    from matplotlib.colors import LogNorm

    sizes = np.maximum(pts["size"], 1)
    sc = ax.scatter(x / (1 << 20), y, c=sizes, s=4, cmap="viridis", rasterized=True,
                    norm=LogNorm(vmin=sizes.min(), vmax=max(sizes.max(), sizes.min() + 1)))
    plt.colorbar(sc, ax=ax, label="request size (bytes)")
    ax.set_yticks(range(len(pids)), [str(p) for p in pids])
    ax.set_xlabel("offset in the dataset, files laid out by path (MiB)")
    ax.set_ylabel("process (pid)")


def _plot_temporal(ax, reads: np.ndarray, t0: int) -> None:
    pts = _sample(reads)
    ax.scatter((pts["time_ns"] - t0) / 1e9, np.maximum(pts["size"], 1), s=4, rasterized=True)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("time since the first operation (s)")
    ax.set_ylabel("request size (bytes)")


def _plot_sizes(ax, reads: np.ndarray) -> None:
    sizes = np.maximum(reads["size"], 1)
    top = int(np.ceil(np.log2(sizes.max()))) + 1 if sizes.size else 1
    ax.hist(sizes, bins=[2.0 ** b for b in range(top + 1)])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request size (bytes, log2 bins)")
    ax.set_ylabel("reads")


def _plot_sources(ax, reads: np.ndarray) -> None:
    totals: dict[str, int] = {"local": 0, "peer": 0, "store": 0}
    for source, size in zip(reads["source"].tolist(), reads["size"].tolist(), strict=True):
        key = source or "unknown"
        if "+" in key:
            key = "mixed"
        totals[key] = totals.get(key, 0) + size
    ax.bar(list(totals), [v / (1 << 20) for v in totals.values()])
    ax.set_ylabel("MiB read")


def _plot_throughput(ax, reads: np.ndarray, t0: int) -> None:
    if reads.size == 0:
        return
    t = (reads["time_ns"] + reads["latency_ns"] - t0) / 1e9
    span = max(float(t.max()), 1e-3)
    bins = max(1, min(200, int(reads.size // 20) or 1))
    width = span / bins
    counts, edges = np.histogram(t, bins=bins, range=(0, span), weights=reads["size"])
    ax.plot(edges[:-1], counts / width / (1 << 20), drawstyle="steps-post")
    ax.set_xlabel("time since the first operation (s)")
    ax.set_ylabel("MiB/s")


def _plot_top_files(ax, trace: Trace, reads: np.ndarray, count: int = 20) -> None:
    per_file = np.bincount(reads["path"], weights=reads["size"], minlength=len(trace.paths))
    order = np.argsort(-per_file)[:count]
    order = [i for i in order if per_file[i] > 0][::-1]
    labels = [trace.paths[i] if len(trace.paths[i]) < 50 else "..." + trace.paths[i][-47:]
              for i in order]
    ax.barh(range(len(order)), [per_file[i] / (1 << 20) for i in order])
    ax.set_yticks(range(len(order)), labels, fontsize=7)
    ax.set_xlabel("MiB read")


def _draw(out: Path, trace: Trace) -> None:
    try:
        import matplotlib
    except ImportError:
        raise DlfsError("dlfs report needs matplotlib: pip install 'dlfs[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reads = _reads(trace)
    t0 = int(trace.records["time_ns"].min()) if trace.records.size else 0
    draw = {
        "spatial.png": lambda ax: _plot_spatial(ax, trace, reads, plt),
        "temporal.png": lambda ax: _plot_temporal(ax, reads, t0),
        "request_sizes.png": lambda ax: _plot_sizes(ax, reads),
        "sources.png": lambda ax: _plot_sources(ax, reads),
        "throughput.png": lambda ax: _plot_throughput(ax, reads, t0),
        "top_files.png": lambda ax: _plot_top_files(ax, trace, reads),
    }
    for name, title in PLOTS:
        fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
        if reads.size:
            draw[name](ax)
        else:
            ax.text(0.5, 0.5, "no reads in this trace", ha="center", va="center")
        ax.set_title(title)
        fig.savefig(out / name, dpi=100)
        plt.close(fig)


def _index_html(summary_lines: list[str], source: Path) -> str:
    images = "\n".join(f'<h2>{html.escape(title)}</h2>\n<img src="{name}" alt="{name}">'
                       for name, title in PLOTS)
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>DLFS I/O report: "
            f"{html.escape(source.name)}</title></head>\n<body>\n<h1>DLFS I/O report: "
            f"{html.escape(str(source))}</h1>\n<pre>{html.escape(chr(10).join(summary_lines))}"
            f"</pre>\n{images}\n</body></html>\n")


def make_report(trace_path: Path, out: Path) -> int:
    """Write the report for `trace_path` into `out`; print the text summary."""
    trace = read_trace_csv(trace_path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DlfsError(f"cannot create report directory {out}: {err.strerror}") from None
    lines = summarize(trace).lines()
    _draw(out, trace)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    (out / "index.html").write_text(_index_html(lines, trace_path))
    print("\n".join(lines))
    print(f"report: {out / 'index.html'}")
    return 0
