"""`dlfs status`'s problem lines: a mount's health, one line per problem, none when healthy.

Renders the "health" part of the daemon's status file (dlfsd.obs.health):
reads stalled now, peers skipped, owned chunks kept off the NVMe. Each line
starts with "problem:" so a script (or a test) can pick them out; a past stall
that is over is history, not a problem, and gets one summary line.
"""

from __future__ import annotations

from dlfs.sizes import format_size

PROBLEM = "problem: "
#: A demanded chunk not staged within this long means the stager lags behind the
#: readers (they keep going to the store); a younger demand is staging at work.
DEMAND_LATE_SECONDS = 10.0


def problem_lines(health: dict | None) -> list[str]:
    """One line per problem now (empty when healthy or for a daemon without health)."""
    if not health:
        return []
    lines = _stall_lines(health) + _peer_lines(health)
    if health.get("staging"):
        lines += _staging_lines(health["staging"])
    return lines


def peer_server_problems(counters: dict | None) -> list[str]:
    """A problem line when fewer peer server processes run than `--peer-procs` asked
    for: a slot waits out the back-off of a server that keeps dying young (a crash loop,
    dlfsd.pool.peerprocs), and peers get less service from this node meanwhile. One
    that died once is started again at once and never shows here."""
    if not counters or counters.get("processes", 0) >= counters.get("configured", 0):
        return []
    return [f"{PROBLEM}peer server: {counters['processes']} of {counters['configured']} "
            f"processes running, {counters.get('restarts', 0)} restarted since mount (a "
            "server keeps dying soon after it starts: the log says why)"]


def history_lines(health: dict | None) -> list[str]:
    """What went wrong earlier and is over: stalls since mount."""
    total = (health or {}).get("stalls_total", 0)
    if not total:
        return []
    by_source = ", ".join(f"{n} waiting for {what}"
                          for what, n in health.get("stalls_by_source", {}).items() if n)
    return [f"stalls: {total} read{'s' if total != 1 else ''} outstanding over "
            f"{health['stall_seconds']:g} s since mount ({by_source}); the log names each"]


def _stall_lines(health: dict) -> list[str]:
    lines = [f"{PROBLEM}read of {s['path']} stalled for {s['seconds']:.0f} s, waiting for "
             f"{s['waiting']} (daemon process {s['pid']})" for s in health.get("stalled", [])]
    more = health.get("stalled_reads", 0) - len(lines)
    if more > 0:
        lines.append(f"{PROBLEM}{more} more reads stalled")
    return lines


def _peer_lines(health: dict) -> list[str]:
    lines = []
    for p in health.get("peers", []):
        if p["down_processes"]:
            slow = p["down_why"].startswith("slow")  # asked last, not skipped (dlfsd.pool.pool)
            lines.append(
                f"{PROBLEM}peer {p['name']} is {'slow' if slow else 'down'} for "
                f"{_processes(p['down_processes'])}, {'asked last' if slow else 'skipped'} for "
                f"{p['down_seconds_left']:.0f} s more: {p['down_why'] or '?'} "
                f"({p['down_marks']} time{'s' if p['down_marks'] != 1 else ''} since mount)")
        if p["bad_copy_processes"]:
            lines.append(
                f"{PROBLEM}peer {p['name']} sent a bad copy of chunk {p['bad_copy_chunk']} "
                f"of {p['bad_copy_dataset']}: read elsewhere for "
                f"{p['bad_copy_seconds_left']:.0f} s more ({p['bad_copy_marks']} bad "
                f"cop{'ies' if p['bad_copy_marks'] != 1 else 'y'} since mount)")
    listed = sum(1 for p in health.get("peers", []) if p["down_processes"])
    more = health.get("peers_down", 0) - listed
    if more > 0:
        lines.append(f"{PROBLEM}{more} more peers down")
    return lines


def _processes(n: int) -> str:
    return "1 daemon process" if n == 1 else f"{n} daemon processes"


def _staging_lines(staging: dict) -> list[str]:
    lines = []
    if staging.get("paused"):
        lines.append(f"{PROBLEM}staging paused for {staging['paused']['seconds_left']:.0f} s "
                     f"more: {staging['paused']['error']}")
    for name, d in staging.get("datasets", {}).items():
        if d["over_limit_chunks"]:
            lines.append(f"{PROBLEM}{name}: {d['over_limit_chunks']} owned chunks "
                         f"({format_size(d['over_limit_bytes'])}) not staged: over "
                         f"--cache-limit {format_size(staging.get('cache_limit', 0))}; "
                         "their reads go to the store")
        if d["demanded_chunks"] and d["demanded_oldest_seconds"] >= DEMAND_LATE_SECONDS:
            lines.append(f"{PROBLEM}{name}: {d['demanded_chunks']} chunks readers asked for "
                         f"are not staged yet (the oldest asked "
                         f"{d['demanded_oldest_seconds']:.0f} s ago)")
        if d["failing_chunks"]:
            lines.append(_failing_line(name, d["failing_chunks"], d["failing_example"]))
    return lines


def _failing_line(name: str, count: int, example: dict | None) -> str:
    line = f"{PROBLEM}{name}: cannot stage {count} chunk{'s' if count != 1 else ''}"
    if example:
        line += f", e.g. chunk {example['chunk']}: {example['error']}"
        if example.get("retry_seconds") is not None:
            line += f"; next try in {example['retry_seconds']:.0f} s"
    return line
