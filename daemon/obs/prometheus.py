"""A stats snapshot in the Prometheus text exposition format (`.dlfs/metrics`).

Every metric has the `dlfs_` prefix and a `dataset` label (sum over datasets
for the mount). The log2 histograms become Prometheus histograms with
cumulative `le` buckets; the last, open log2 bucket only counts in `+Inf`.
"""

from __future__ import annotations

_COUNTERS = (
    ("dlfs_opens_total", "File opens.", "opens"),
    ("dlfs_reads_total", "Read requests answered.", "reads"),
    ("dlfs_read_bytes_total", "Bytes returned by reads.", "bytes"),
    ("dlfs_sequential_reads_total",
     "Reads starting where the previous read of the file ended (or at 0 after an open).",
     "sequential_reads"),
    ("dlfs_random_reads_total", "Reads that are not sequential.", "random_reads"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _header(lines: list[str], name: str, help_: str, kind: str) -> None:
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} {kind}")


def _histogram(lines: list[str], name: str, datasets: dict, hist_key: str, bound,
               total_key: str, scale: float) -> None:
    for ds, c in datasets.items():
        hist = c[hist_key]
        cumulative = 0
        for bucket, count in enumerate(hist[:-1]):
            cumulative += count
            lines.append(f'{name}_bucket{{dataset="{_label(ds)}",le="{bound(bucket)}"}} '
                         f"{cumulative}")
        lines.append(f'{name}_bucket{{dataset="{_label(ds)}",le="+Inf"}} {sum(hist)}')
        lines.append(f'{name}_sum{{dataset="{_label(ds)}"}} {c[total_key] * scale:.9g}')
        lines.append(f'{name}_count{{dataset="{_label(ds)}"}} {sum(hist)}')


def prometheus_text(snapshot: dict) -> str:
    """Render `snapshot` (see docs/STATS.md); counters off gives just dlfs_stats_enabled 0."""
    lines: list[str] = []
    _header(lines, "dlfs_stats_enabled", "1 if the mount counts its I/O (not --no-stats).",
            "gauge")
    lines.append(f"dlfs_stats_enabled {1 if snapshot.get('enabled') else 0}")
    if not snapshot.get("enabled"):
        return "\n".join(lines) + "\n"
    datasets = snapshot["datasets"]
    for name, help_, key in _COUNTERS:
        _header(lines, name, help_, "counter")
        lines += [f'{name}{{dataset="{_label(ds)}"}} {c[key]}' for ds, c in datasets.items()]
    _header(lines, "dlfs_files_touched", "Files opened or read at least once.", "gauge")
    lines += [f'dlfs_files_touched{{dataset="{_label(ds)}"}} {c["files_touched"]}'
              for ds, c in datasets.items()]
    for metric, help_, key, scale in (
            ("dlfs_source_bytes_total", "Bytes by where they came from.", "bytes", 1),
            ("dlfs_source_reads_total", "Reads from each source.", "reads", 1),
            ("dlfs_source_seconds_total", "Time spent reading from each source.",
             "latency_ns_sum", 1e-9)):
        _header(lines, metric, help_, "counter")
        for ds, c in datasets.items():
            for source, s in c["sources"].items():
                lines.append(f'{metric}{{dataset="{_label(ds)}",source="{source}"}} '
                             f"{s[key] * scale:.9g}")
    _header(lines, "dlfs_read_size_bytes", "Read request sizes (log2 buckets).", "histogram")
    _histogram(lines, "dlfs_read_size_bytes", datasets, "read_size_hist",
               lambda b: (1 << b) - 1, "bytes", 1)
    _header(lines, "dlfs_read_latency_seconds", "Read latency in the daemon (log2 buckets).",
            "histogram")
    _histogram(lines, "dlfs_read_latency_seconds", datasets, "read_latency_us_hist",
               lambda b: f"{(1 << b) * 1e-6:.9g}", "read_latency_ns_sum", 1e-9)
    _lookahead(lines, datasets, snapshot.get("lookahead"))
    return "\n".join(lines) + "\n"


def _lookahead(lines: list[str], datasets: dict, engine: dict | None) -> None:
    """Reads served by the look-ahead (hits) or not (misses), and what it fetched."""
    for metric, key, help_ in (
            ("dlfs_lookahead_hits_total", "hits", "Reads of extents the look-ahead fetched."),
            ("dlfs_lookahead_misses_total", "misses",
             "Reads, while the look-ahead followed an epoch, of extents it had not fetched.")):
        _header(lines, metric, help_, "counter")
        lines += [f'{metric}{{dataset="{_label(ds)}"}} {c["lookahead"][key]}'
                  for ds, c in datasets.items()]
    for key, value in (engine or {}).items():
        name = f"dlfs_lookahead_{key}_total"
        _header(lines, name, f"Look-ahead: {key.replace('_', ' ')}.", "counter")
        lines.append(f"{name} {value}")
