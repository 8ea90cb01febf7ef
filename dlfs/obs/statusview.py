"""`dlfs status`: a mount's staging progress, where its reads came from, and its problems.

Reads the status file the daemon's main process rewrites every second
(dlfs.runtime.status_path). On a terminal it draws a table with progress
bars (rich), refreshed with --watch; otherwise it prints plain lines a
script can parse, or JSON with --json.
"""

from __future__ import annotations

import json
import os
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dlfs.errors import EXIT_OK, NotFoundError
from dlfs.mountinfo import find_mount
from dlfs.obs.healthview import history_lines, peer_server_problems, problem_lines
from dlfs.procs import serving_daemon
from dlfs.runtime import (
    mountpoint_path,
    read_record,
    status_path,
)
from dlfs.sizes import format_size


def read_status(mountpoint: str) -> dict:
    """The daemon's latest status; NotFoundError if no live daemon serves MOUNTPOINT.

    A daemon killed without its cleanup (SIGKILL, the OOM killer) leaves its record
    and its last status file behind: those numbers are stale, so a dead daemon (its
    pid gone, or reused by another process) is said to be dead, never shown.
    """
    path = mountpoint_path(mountpoint)
    record = read_record(path)
    if record is None or not record.alive():
        entry = find_mount(path)
        serving = serving_daemon(path) if record is None else None
        if serving is not None:  # no record of ours, yet a daemon serves it: not ours
            raise NotFoundError(f"{path} is served by daemon {serving} of uid {_owner(serving)}, "
                                "whose status is not yours to read (e.g. root's Slurm prolog "
                                "mounted it); its owner can run `dlfs status`")
        if record is not None and entry is not None and entry.fstype == "fuse.dlfs":
            raise NotFoundError(f"the daemon of {path} (pid {record.pid}) is dead: "
                                f"{record.how_it_died()}; its mount answers ENOTCONN: run "
                                f"`dlfs umount {path}`, then mount again")
        if entry is not None and entry.fstype == "fuse.dlfs":
            raise NotFoundError(f"the daemon of {path} is gone, its mount is left; run "
                                f"`dlfs umount {path}`, then mount again")
        raise NotFoundError(f"no DLFS daemon serves {path} (mount it with `dlfs mount`)")
    try:
        return json.loads(status_path(path).read_text())
    except (OSError, ValueError):
        raise NotFoundError(f"the daemon of {path} (pid {record.pid}) has not reported its "
                            "status yet; retry in a second") from None


def _owner(pid: int) -> str:
    try:
        return str(os.stat(f"/proc/{pid}").st_uid)
    except OSError:
        return "?"


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds <= 0:
        return "done"
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else ">1 day"


def plain_lines(status: dict) -> list[str]:
    lines = [f"mount {status['mountpoint']} (store {status['store']}, pid {status['pid']}, "
             f"log {status.get('log', '?')})"]
    if status.get("pooled"):
        lines.append(f"node {status['node']} of {len(status['nodes'])}, "
                     f"{status['replicas']} replica(s), cache {status['cache_dir']}")
    for d in status["datasets"]:
        st = d.get("staging")
        if st:
            lines.append(
                f"{d['name']}: staged {st['staged_chunks']}/{st['owned_chunks']} owned chunks "
                f"({format_size(st['staged_bytes'])}/{format_size(st['owned_bytes'])}), "
                f"{format_size(st['rate'])}/s, eta {_eta(st['eta'])}")
        else:
            lines.append(f"{d['name']}: {d['chunks']} chunks, read from the store")
        for source, c in d["sources"].items():
            lines.append(f"  {source:<5} {c['requests']:>10} reads {format_size(c['bytes']):>10}"
                         f"  mean {c['mean_latency_us']:.0f} us")
        if d.get("node_cache"):
            lines.append("  " + node_cache_line(d["node_cache"]))
    if status.get("replication"):
        lines.append(replication_line(status["replication"]))
    if status.get("peer_server"):
        lines.append(peer_server_line(status["peer_server"]))
    lines += ckpt_lines(status.get("ckpt"))
    if status.get("fuse"):
        lines.append(fuse_line(status["fuse"]))
    if status.get("passthrough"):
        lines.append(passthrough_line(status["passthrough"]))
    return lines + history_lines(status.get("health")) + problem_lines(status.get("health")) \
        + peer_server_problems(status.get("peer_server"))


def passthrough_line(c: dict) -> str:
    """Whether large files are read by the kernel from whole-file copies (dlfsd.core.passthrough),
    why, and how far their copies and opens got."""
    line = f"large files by passthrough: {c.get('mode', '?')}"
    if "large_files" in c:
        line += (f"; {c['verified_copies']}/{c['large_files']} whole-file copies verified "
                 f"({format_size(c['large_bytes'])} in all), {c['unverified_copies']} to "
                 f"check; opens passed through {c['opens_passed']}, served "
                 f"{c['opens_served']}")
    return line


def fuse_line(c: dict) -> str:
    """What the kernel granted the datasets' connection at INIT (dlfsd.fuse.rawsession)."""
    timeout = (f"request timeout {c['request_timeout']} s" if c.get("request_timeout")
               else "no request timeout")
    line = (f"FUSE protocol {c.get('protocol', '?')}: {', '.join(c.get('granted', [])) or '-'}"
            f"; max_pages {c.get('max_pages', '?')}; {timeout}")
    if c.get("not_granted"):
        line += f"; not offered by the kernel: {', '.join(c['not_granted'])}"
    return line


def peer_server_line(c: dict) -> str:
    """What this node served its peers, and what it refused (auth, protocol, bounds)."""
    line = (f"peer server: {c.get('reads_served', 0)} reads served "
            f"({format_size(c.get('bytes_served', 0))}"
            + (f", {c['reads_from_disk']} from disk" if "reads_from_disk" in c else "")
            + f"), {c.get('reads_missed', 0)} not "
            f"staged here, {c.get('reads_refused', 0)} refused, {c.get('read_errors', 0)} "
            f"read errors; {c.get('connections_open', 0)} connections open, "
            f"{c.get('auth_failures', 0)} auth failures, {c.get('protocol_errors', 0)} "
            f"protocol errors")
    if "replies_waited" in c:
        line += f", {c['replies_waited']} replies waited for a slow peer"
    if "processes" in c:  # served by forked processes (dlfsd.pool.peerprocs)
        line += f"; {c['processes']} server processes"
        if c.get("restarts"):
            line += f", {c['restarts']} restarted"
    return line


def node_cache_line(c: dict) -> str:
    """Cache hits from earlier jobs: copies adopted at mount vs staged by this mount, and
    the reads the adopted copies served."""
    return (f"node cache: {c['adopted_at_mount']} chunks adopted from earlier jobs "
            f"({c['adopted_chunks']} still held, {format_size(c['adopted_bytes'])}), "
            f"{c['staged_now_chunks']} staged by this job "
            f"({format_size(c['staged_now_bytes'])}); {c['reads']} reads "
            f"({format_size(c['bytes'])}) served from adopted copies")


def replication_line(c: dict) -> str:
    """Where this node's copies came from with --replicas > 1: the store (as first owner,
    or as a fallback) or the chunk's first owner over the pool."""
    kinds = (("fallback_down", "down"), ("fallback_slow", "silent"),
             ("fallback_declined", "not staging it"), ("fallback_bad", "bad copy"))
    fallbacks = sum(c.get(key, 0) for key, _ in kinds)
    store = f"replicas: {c.get('from_store_chunks', 0)} chunks copied from the store"
    if fallbacks:
        store += (f" ({fallbacks} of them for want of their first owner: "
                  + ", ".join(f"{c.get(key, 0)} {what}" for key, what in kinds) + ")")
    return (f"{store}, {c.get('from_peer_chunks', 0)} from their first owners "
            f"({format_size(c.get('from_peer_bytes', 0))}), {c.get('waiting', 0)} waiting "
            "for them")


def ckpt_lines(c: dict | None) -> list[str]:
    """The checkpoint tier: written, drained, queued (rate, ETA, oldest), trouble."""
    if not c:
        return []
    lines = [f"checkpoints: {format_size(c.get('written_bytes', 0))} written, "
             f"{format_size(c['drained_bytes'])} drained ({c['drained_files']} files) to "
             f"{c['store']}; {c['queued_files']} files ({format_size(c['queued_bytes'])}) "
             f"queued, {format_size(c['drain_rate'])}/s, eta {_eta(c['eta_seconds'])}"]
    if c.get("passthrough"):
        lines.append(f"  passthrough {c['passthrough']}; "
                     f"{c.get('open_files') or 0} checkpoint files open"
                     + (f", {c['passthrough_open']} through passthrough"
                        if c.get("passthrough_open") is not None else ""))
    if c.get("limit"):
        lines.append(f"  local copies {format_size(c.get('local_bytes') or 0)} of "
                     f"{format_size(c['limit'])} (--ckpt-limit), {c['evicted_files']} evicted"
                     + (": FULL, writes wait for the drain" if c.get("full") else ""))
    if c.get("oldest_undrained"):
        lines.append(f"  oldest undrained: {c['oldest_undrained']} "
                     f"({c['oldest_undrained_age']:.0f} s)")
    if c.get("error"):
        lines.append(f"  drain failing: {c['error']} (local copies kept in {c['local']}, "
                     "retried with back-off)")
    if c.get("conflicts"):
        lines.append(f"  {c['conflicts']} files kept under a conflict name (another node "
                     f"replaced the store's copy meanwhile): "
                     f"{', '.join(c.get('conflict_names') or [])}")
    return lines


def rich_view(status: dict) -> Group:
    head = (f"[bold]{status['mountpoint']}[/] store {status['store']} pid {status['pid']}"
            f"\nlog {status.get('log', '?')}")
    if status.get("pooled"):
        head += (f"\nnode [bold]{status['node']}[/] of {len(status['nodes'])}, "
                 f"{status['replicas']} replica(s), cache {status['cache_dir']}")
    table = Table(box=None, pad_edge=False)
    for col in ("dataset", "staged", "", "rate", "eta", "local", "peer", "store"):
        table.add_column(col, justify="left" if col in ("dataset", "") else "right")
    for d in status["datasets"]:
        st, src = d.get("staging"), d["sources"]
        per_source = [f"{format_size(src[s]['bytes'])} / {src[s]['requests']}"
                      for s in ("local", "peer", "store")]
        if st:
            bar = ProgressBar(total=max(st["owned_bytes"], 1), completed=st["staged_bytes"],
                              width=24)
            table.add_row(d["name"], f"{st['staged_chunks']}/{st['owned_chunks']}", bar,
                          f"{format_size(st['rate'])}/s", _eta(st["eta"]), *per_source)
        else:
            table.add_row(d["name"], "-", "", "-", "-", *per_source)
    parts = [head, table, "[dim]sources: bytes / reads[/]"]
    parts += [f"{d['name']}: {node_cache_line(d['node_cache'])}" for d in status["datasets"]
              if d.get("node_cache")]
    if status.get("replication"):
        parts.append(replication_line(status["replication"]))
    if status.get("peer_server"):
        parts.append(peer_server_line(status["peer_server"]))
    parts += ckpt_lines(status.get("ckpt"))
    parts += [Text(line, style="dim") for line in history_lines(status.get("health"))]
    parts += [Text(line, style="bold red") for line in problem_lines(status.get("health"))
              + peer_server_problems(status.get("peer_server"))]
    return Group(*parts)


def show_status(mountpoint: str, watch: bool = False, as_json: bool = False,
                interval: float = 1.0) -> int:
    status = read_status(mountpoint)
    if as_json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    if not sys.stdout.isatty():
        try:
            while True:
                print("\n".join(plain_lines(status)), flush=True)
                if not watch:
                    return EXIT_OK
                time.sleep(interval)
                status = read_status(mountpoint)
        except KeyboardInterrupt:  # how --watch ends
            return EXIT_OK
    console = Console()
    if not watch:
        console.print(rich_view(status))
        return EXIT_OK
    with Live(rich_view(status), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(rich_view(read_status(mountpoint)))
        except KeyboardInterrupt:  # how --watch ends ("refresh until Ctrl-C"), as in stats
            return EXIT_OK
