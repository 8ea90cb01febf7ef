"""dlfs.cluster.slurm and deploy/slurm/common.sh: hostlists, job env, ports, patterns, secrets.

Pure functions; the real Slurm cross-checks (scontrol show hostnames, a real
prolog's environment) live in test_slurm.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfs.cluster.slurm import (
    SHARED_HOST_STRIDE,
    PeerNode,
    SlurmJob,
    derive_job_secret,
    expand_hostlist,
    expand_pattern,
    job_from_env,
    peer_nodes,
    read_site_key,
    write_secret_file,
)
from dlfs.errors import DlfsError, UsageError

COMMON_SH = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "common.sh"


@pytest.mark.parametrize(("hostlist", "names"), [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[1-3,5],gpu07", ["node1", "node2", "node3", "node5", "gpu07"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("a[01-02]-b[1-2]", ["a01-b1", "a01-b2", "a02-b1", "a02-b2"]),
    ("rack[1]-x", ["rack1-x"]),
    ("vm", ["vm"]),
    ("c1, c2", ["c1", "c2"]),
])
def test_expand_hostlist(hostlist, names):
    assert expand_hostlist(hostlist) == names


@pytest.mark.parametrize("bad", ["", "a,,b", "n[1-", "n]1", "n[[1]]", "n[3-1]", "n[a-b]",
                                 "n[]", "a b"])
def test_expand_hostlist_rejects(bad):
    with pytest.raises(UsageError, match="invalid hostlist"):
        expand_hostlist(bad)


prefixes = st.from_regex(r"[a-z][a-z0-9-]{0,6}[a-z]", fullmatch=True)


@st.composite
def ranged_lists(draw):
    """A prefix, zero-padded ranges in order, and the names they must expand to."""
    prefix = draw(prefixes)
    width = draw(st.integers(1, 4))
    parts, names, at = [], [], 0
    for _ in range(draw(st.integers(1, 4))):
        first = at + draw(st.integers(0, 5))
        last = first + draw(st.integers(0, 5))
        at = last + 1
        f, la = str(first).zfill(width), str(last).zfill(width)
        parts.append(f if first == last else f"{f}-{la}")
        names += [prefix + str(n).zfill(width) for n in range(first, last + 1)]
    return f"{prefix}[{','.join(parts)}]", names


@given(ranged_lists())
def test_expand_hostlist_ranges(case):
    hostlist, names = case
    assert expand_hostlist(hostlist) == names


@given(st.lists(ranged_lists(), min_size=1, max_size=4))
def test_expand_hostlist_items_concatenate(cases):
    assert expand_hostlist(",".join(h for h, _ in cases)) == [n for _, ns in cases for n in ns]


PROLOG_ENV = {"SLURM_JOB_ID": "42", "SLURM_NODELIST": "node[1-3]", "SLURMD_NODENAME": "node2",
              "SLURM_JOB_UID": "1000", "SLURM_JOB_GID": "100"}


def test_job_from_prolog_env():
    job = job_from_env(PROLOG_ENV)
    assert job == SlurmJob("42", ("node1", "node2", "node3"), "node2", 1000, 100)


def test_job_from_step_env_prefers_job_nodelist():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NODELIST": "gpu01",
           "SLURMD_NODENAME": "gpu02"}
    job = job_from_env(env)
    assert job.nodes == ("gpu01", "gpu02") and job.uid is None


@pytest.mark.parametrize(("drop", "named"), [
    ("SLURM_JOB_ID", "SLURM_JOB_ID"), ("SLURM_NODELIST", "SLURM_NODELIST"),
    ("SLURMD_NODENAME", "SLURMD_NODENAME")])
def test_job_from_env_names_what_is_missing(drop, named):
    env = {k: v for k, v in PROLOG_ENV.items() if k != drop}
    with pytest.raises(UsageError, match=named):
        job_from_env(env)


def test_job_from_env_node_not_in_list():
    with pytest.raises(UsageError, match="node9"):
        job_from_env(dict(PROLOG_ENV, SLURMD_NODENAME="node9"))


def test_peer_nodes_ports_follow_node_order():
    job = job_from_env(PROLOG_ENV)
    assert peer_nodes(job, 7400, "127.0.0.1") == [  # one host: a port per node
        PeerNode("node1", "127.0.0.1", 7400), PeerNode("node2", "127.0.0.1", 7401),
        PeerNode("node3", "127.0.0.1", 7402)]
    assert [p.spec() for p in peer_nodes(job, 9000)] == [  # own hosts: the job's one port
        "node1=node1:9000", "node2=node2:9000", "node3=node3:9000"]
    assert peer_nodes(job, 9000, "%n.ib0")[0].host == "node1.ib0"


def test_a_port_span_gives_each_job_its_own_ports():
    nodes = ("node1", "node2")
    ports = {job_id: [p.port for p in peer_nodes(SlurmJob(job_id, nodes, "node1"), 20000,
                                                 port_span=1000)]
             for job_id in ("5", "6", "1005")}
    assert ports == {"5": [20005, 20005], "6": [20006, 20006], "1005": [20005, 20005]}
    shared = [p.port for p in peer_nodes(SlurmJob("6", nodes, "node1"), 20000, "127.0.0.1",
                                         port_span=1000)]
    assert shared == [20000 + 6 * SHARED_HOST_STRIDE, 20001 + 6 * SHARED_HOST_STRIDE]


@given(st.integers(1, 64), st.integers(1, 65535), st.integers(1, 4000),
       st.integers(1, 10**7), st.integers(1, 10**7), st.booleans())
def test_ports_are_in_range_distinct_per_host_and_apart_between_job_slots(
        n, base, span, job_a, job_b, shared):
    pattern = "127.0.0.1" if shared else "%n"
    jobs = [SlurmJob(str(j), tuple(f"n{i}" for i in range(n)), "n0") for j in (job_a, job_b)]
    try:
        a, b = ([p.port for p in peer_nodes(job, base, pattern, span)] for job in jobs)
    except UsageError as err:
        assert "out of range" in str(err)
        stride = SHARED_HOST_STRIDE if shared and span > 1 else 1
        assert base + max(span, n if shared else 1) - 1 > 65535 or n > stride
        return
    assert min(a + b) >= base and max(a + b) <= 65535
    assert len(set(a)) == (n if shared else 1)
    stride = SHARED_HOST_STRIDE if shared and span > 1 else 1
    slots = max(1, span // stride)
    if job_a % slots != job_b % slots:  # two jobs on one node at once: no port in common
        assert not set(a) & set(b)


def test_expand_pattern():
    assert expand_pattern("/mnt/dlfs/%j", "12", "n1") == "/mnt/dlfs/12"
    assert expand_pattern("/nvme/%j/%n/cache", "12", "n1") == "/nvme/12/n1/cache"
    assert expand_pattern("/a/100%%", "12", "n1") == "/a/100%"
    assert expand_pattern("/plain", "12", "n1") == "/plain"


@pytest.mark.parametrize("bad", ["/mnt/%u", "/mnt/%", "/mnt/%J", "/mnt/%%%"])
def test_expand_pattern_rejects_unknown_codes(bad):
    with pytest.raises(UsageError, match="%"):
        expand_pattern(bad, "1", "n")


@given(st.text(alphabet="ab/%jn", max_size=20), st.from_regex(r"\d{1,7}", fullmatch=True),
       prefixes)
def test_expand_pattern_never_leaves_codes(pattern, job_id, node):
    try:
        out = expand_pattern(pattern, job_id, node)
    except UsageError:
        return
    assert out.count("%") == pattern.count("%%")


@pytest.mark.parametrize(("comment", "constraints", "wanted"), [
    ("dlfs", None, True),
    ("please mount DLFS for me", None, True),
    ("dlfs=imagenet", None, True),
    ("nodlfs", None, False),
    ("my-dlfs-test", None, False),
    (None, "dlfs", True),
    (None, "gpu&dlfs", True),
    (None, "[dlfs|nvme]", True),
    (None, "dlfsx", False),
    ("", "", False),
    (None, None, False),
])
def test_prolog_opt_in_rule(tmp_path, comment, constraints, wanted):
    """The `wanted` function of deploy/slurm/common.sh, run by bash with a test dlfs.conf."""
    conf = tmp_path / "dlfs.conf"
    conf.write_text("DLFS_OPT_IN='comment constraint'\nDLFS_FEATURE=dlfs\nDLFS_MOUNT=/m/%j\n"
                    "DLFS_CACHE=/c/%j\nDLFS_RUN_DIR=/r/%j\nDLFS_LOG=/l/%j\n")
    env = {"DLFS_CONF": str(conf), "SLURM_JOB_ID": "5", "SLURMD_NODENAME": "n1"}
    if comment is not None:
        env["SLURM_JOB_COMMENT"] = comment
    if constraints is not None:
        env["SLURM_JOB_CONSTRAINTS"] = constraints
    result = subprocess.run(["bash", "-c", f". {COMMON_SH} && wanted"], env=env,
                            capture_output=True, text=True)
    assert result.stderr == ""
    assert (result.returncode == 0) is wanted


def test_common_sh_expands_paths_like_expand_pattern(tmp_path):
    conf = tmp_path / "dlfs.conf"
    conf.write_text("DLFS_MOUNT=/m/%j/%n/100%%\nDLFS_CACHE=/c/%j\nDLFS_RUN_DIR=/r/%j\n"
                    "DLFS_LOG=/l/%j-%n\n")
    env = {"DLFS_CONF": str(conf), "SLURM_JOB_ID": "77", "SLURMD_NODENAME": "gpu3"}
    result = subprocess.run(["bash", "-c", f". {COMMON_SH} && echo $MOUNT $LOG"], env=env,
                            capture_output=True, text=True)
    assert result.stdout.split() == [expand_pattern("/m/%j/%n/100%%", "77", "gpu3"),
                                     expand_pattern("/l/%j-%n", "77", "gpu3")]


def test_job_secret_is_deterministic_and_per_job():
    key = b"k" * 32
    assert derive_job_secret(key, "1") == derive_job_secret(key, "1")
    assert derive_job_secret(key, "1") != derive_job_secret(key, "2")
    assert derive_job_secret(key, "1") != derive_job_secret(b"x" * 32, "1")
    assert len(derive_job_secret(key, "1")) == 64
    int(derive_job_secret(key, "1"), 16)


def test_job_secret_refuses_short_key():
    with pytest.raises(DlfsError, match="too short"):
        derive_job_secret(b"short", "1")


def test_read_site_key_refuses_group_readable(tmp_path):
    key = tmp_path / "site.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o640)
    with pytest.raises(DlfsError, match="chmod 600"):
        read_site_key(str(key))
    key.chmod(0o600)
    assert read_site_key(str(key)) == b"k" * 32
    with pytest.raises(DlfsError, match="not found"):
        read_site_key(str(tmp_path / "nope"))


def test_write_secret_file_mode_and_owner(tmp_path):
    path = tmp_path / "secret"
    write_secret_file(str(path), "abc", uid=None, gid=None)
    st_ = path.stat()
    assert stat.S_IMODE(st_.st_mode) == 0o600
    assert path.read_text() == "abc\n"
    if os.geteuid() == 0:
        write_secret_file(str(path), "def", uid=4242, gid=4243)
        assert (path.stat().st_uid, path.stat().st_gid) == (4242, 4243)
        assert path.read_text() == "def\n"
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]


def test_mount_slurm_expands_every_path_flag_its_help_names():
    """`dlfs mount --slurm`: %j/%n expand in each path flag the help lists, the summary
    file (written at unmount, e.g. for the epilogue to keep) included."""
    from dlfs.cli.main import build_parser
    from dlfs.cli.mount_cmds import apply_slurm

    args = build_parser().parse_args([
        "mount", "/mnt/dlfs/%j", "--store", "/store", "--slurm",
        "--log-file", "/var/log/dlfs-%j-%n.log", "--summary-file", "/scratch/%j/%n.json"])
    apply_slurm(args, PROLOG_ENV)
    assert args.mountpoint == "/mnt/dlfs/42"
    assert args.log_file == "/var/log/dlfs-42-node2.log"
    assert args.summary_file == "/scratch/42/node2.json"
