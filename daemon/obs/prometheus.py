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
    for metric, key, help_ in (
            ("dlfs_adopted_bytes_total", "bytes",
             "Local bytes read from copies an earlier mount staged (node cache hits)."),
            ("dlfs_adopted_reads_total", "reads",
             "Local reads of copies an earlier mount staged (node cache hits).")):
        _header(lines, metric, help_, "counter")
        lines += [f'{metric}{{dataset="{_label(ds)}"}} {c["adopted"][key]}'
                  for ds, c in datasets.items()]
    _health(lines, snapshot.get("health") or {})
    _ckpt(lines, snapshot.get("ckpt") or {})
    return "\n".join(lines) + "\n"


#: The checkpoint tier's report (dlfsd.ckpt.drain.Drainer.report): key -> metric.
CKPT_METRICS = (
    ("written_bytes", "dlfs_ckpt_written_bytes_total", "counter",
     "Bytes written into MOUNTPOINT/ckpt/."),
    ("queued_bytes", "dlfs_ckpt_queued_bytes", "gauge", "Bytes not on the checkpoint store yet."),
    ("queued_files", "dlfs_ckpt_queued_files", "gauge", "Files not on the checkpoint store yet."),
    ("drained_bytes", "dlfs_ckpt_drained_bytes_total", "counter",
     "Bytes copied to the checkpoint store."),
    ("drained_files", "dlfs_ckpt_drained_files_total", "counter",
     "Files copied to the checkpoint store."),
    ("drain_rate", "dlfs_ckpt_drain_bytes_per_second", "gauge",
     "Drain rate over the last 10 s."),
    ("eta_seconds", "dlfs_ckpt_drain_eta_seconds", "gauge",
     "Seconds until the queued bytes are drained at that rate."),
    ("oldest_undrained_age", "dlfs_ckpt_oldest_undrained_seconds", "gauge",
     "Age of the oldest file not drained yet."),
    ("failures", "dlfs_ckpt_drain_failures_total", "counter",
     "Drain attempts that failed (each retried with back-off)."),
)


def _ckpt(lines: list[str], report: dict) -> None:
    """The checkpoint tier (absent without --ckpt-store, or before its first report)."""
    for key, metric, kind, help_ in CKPT_METRICS:
        if key in report:
            _header(lines, metric, help_, kind)
            value = report[key]
            lines.append(f"{metric} {0 if value is None else value:.9g}")


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


def _health(lines: list[str], health: dict) -> None:
    """Stalled reads, peers skipped and staging trouble (docs/STATS.md, "Health"); the
    main process's report of the last second, absent until its first one."""
    if not health:
        return
    _stalls(lines, health)
    if "peers" in health or "peers_down" in health:
        _peers(lines, health)
    if "staging" in health:
        _staging(lines, health["staging"])


def _stalls(lines: list[str], health: dict) -> None:
    _header(lines, "dlfs_stall_threshold_seconds",
            "A read outstanding this long counts as stalled (0: not watched).", "gauge")
    lines.append(f"dlfs_stall_threshold_seconds {health.get('stall_seconds', 0):.9g}")
    _header(lines, "dlfs_stalled_reads", "Reads outstanding past the threshold now.", "gauge")
    lines.append(f"dlfs_stalled_reads {health.get('stalled_reads', 0)}")
    _header(lines, "dlfs_stalls_total",
            "Reads found outstanding past the threshold, by what they waited for.", "counter")
    for source, count in (health.get("stalls_by_source") or {}).items():
        lines.append(f'dlfs_stalls_total{{waiting="{_label(source)}"}} {count}')
    _header(lines, "dlfs_oldest_read_seconds",
            "Age of the oldest read in progress (0: none).", "gauge")
    lines.append(f"dlfs_oldest_read_seconds {health.get('oldest_read_seconds', 0):.9g}")


def _peers(lines: list[str], health: dict) -> None:
    for name, help_, key in (
            ("dlfs_peers_down", "Peers some daemon process skips now (timed out, refused).",
             "peers_down"),
            ("dlfs_peers_with_bad_copies",
             "Peers a chunk of which some daemon process reads elsewhere now (bad copy).",
             "peers_with_bad_copies")):
        _header(lines, name, help_, "gauge")
        lines.append(f"{name} {health.get(key, 0)}")
    peers = health.get("peers") or []
    for name, kind, help_, key in (
            ("dlfs_peer_down_processes", "gauge", "Daemon processes that skip this peer now.",
             "down_processes"),
            ("dlfs_peer_down_marks_total", "counter", "Times a daemon process marked the peer "
             "down.", "down_marks"),
            ("dlfs_peer_bad_copy_processes", "gauge",
             "Daemon processes that read some chunk of this peer elsewhere now.",
             "bad_copy_processes"),
            ("dlfs_peer_bad_copy_marks_total", "counter",
             "Copies from this peer that failed their checksum.", "bad_copy_marks")):
        _header(lines, name, help_, kind)
        lines += [f'{name}{{peer="{_label(p["name"])}"}} {p[key]}' for p in peers]


def _staging(lines: list[str], staging: dict) -> None:
    datasets = staging.get("datasets") or {}
    for name, help_, key in (
            ("dlfs_stage_over_limit_chunks", "Owned chunks not staged: over --cache-limit.",
             "over_limit_chunks"),
            ("dlfs_stage_over_limit_bytes", "Bytes of owned chunks over --cache-limit.",
             "over_limit_bytes"),
            ("dlfs_stage_demanded_chunks", "Chunks readers or peers asked for, not staged yet.",
             "demanded_chunks"),
            ("dlfs_stage_failing_chunks", "Chunks whose last copy failed (tried again later).",
             "failing_chunks")):
        _header(lines, name, help_, "gauge")
        lines += [f'{name}{{dataset="{_label(ds)}"}} {c[key]}' for ds, c in datasets.items()]
    _header(lines, "dlfs_stage_errors_total", "Chunk copies that failed.", "counter")
    lines.append(f"dlfs_stage_errors_total {staging.get('copy_errors', 0)}")
    _header(lines, "dlfs_stage_paused",
            "1 while staging is paused: the cache dir cannot be written.", "gauge")
    lines.append(f"dlfs_stage_paused {1 if staging.get('paused') else 0}")
