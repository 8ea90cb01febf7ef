"""deploy/slurm prolog and epilog under a real Slurm (tests/slurmcluster.py).

One cluster for the module: this host as node `<hostname>` (partition `one`)
and simulated nodes node[1-3] (partition `sim`, the default), with the real
prolog.sh/epilog.sh/common.sh copied next to a test dlfs.conf. Everything
lives under one /tmp dir (0755, so a job of an unprivileged test user can
reach its mount); the fixture stops every daemon and unmounts everything in its
finally. Without Slurm packages and no way to install them, the module skips
(CI=true: fails).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    DLFS,
    daemons_under,
    force_unmount,
    in_ci,
    kill_and_reap,
    mounts_by_path,
    populate_store,
    require_fuse,
)
from slurmcluster import SIM_NODES, SlurmCluster, SlurmUnavailable
from sysusers import temp_user
from trees import make_small_tree

from dlfs.cluster.slurm import SHARED_HOST_STRIDE, derive_job_secret, expand_hostlist
from dlfs.store.store import Store

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("prolog.sh", "epilog.sh", "common.sh")
PORT_BASE = 7410


@dataclass
class Site:
    """The scratch site: paths follow the test dlfs.conf (%j/%n -> job/node)."""

    base: Path
    cluster: SlurmCluster
    source: Path
    store: Path
    key: bytes

    def conf(self, **overrides: str) -> None:
        settings = {
            "DLFS_BIN": DLFS[0],
            "DLFS_STORE": str(self.store),
            "DLFS_MOUNT": f"{self.base}/mnt/%j/%n",
            "DLFS_CACHE": f"{self.base}/cache/%j/%n",
            "DLFS_RUN_DIR": f"{self.base}/run/%j/%n",
            "DLFS_LOG": f"{self.base}/log/%j-%n.log",
            "DLFS_SITE_KEY": str(self.base / "site" / "site.key"),
            "DLFS_PORT_BASE": str(PORT_BASE),
            "DLFS_NODE_HOST": "127.0.0.1",
            "DLFS_REPLICAS": "2",
            "DLFS_OPT_IN": "comment constraint",
            "DLFS_FEATURE": "dlfs",
            "DLFS_MOUNT_ARGS": "--workers 2",
            "DLFS_MOUNT_TIMEOUT": "60",
            **overrides,
        }
        text = "".join(f"{k}='{v}'\n" for k, v in settings.items())
        (self.base / "site" / "dlfs.conf").write_text(text)

    def mount(self, job: str, node: str) -> Path:
        return self.base / "mnt" / job / node

    def job_dirs(self, job: str, node: str) -> list[Path]:
        return [self.base / "cache" / job / node, self.base / "run" / job / node]

    def log(self, job: str, node: str) -> Path:
        return self.base / "log" / f"{job}-{node}.log"

    def out(self, name: str) -> Path:
        return self.base / "out" / name

    def leftovers(self) -> list[str]:
        """Mounts and daemons under the site that should not be there."""
        prefix = str(self.base) + "/"
        mounts = [mp for mp in mounts_by_path() if mp.startswith(prefix)]
        daemons = [f"dlfsd {pid} for {mp}" for pid, mp in daemons_under(self.base).items()]
        return mounts + daemons


def _source_sums(source: Path) -> str:
    """What `find . -type f | sort | xargs sha256sum` prints in the dataset's root."""
    rels = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
    return "".join(f"{hashlib.sha256((source / r).read_bytes()).hexdigest()}  ./{r}\n"
                   for r in rels)


@pytest.fixture(scope="module")
def site():
    require_fuse()
    base = Path(tempfile.mkdtemp(prefix="dlfs-slurm-", dir="/tmp"))
    base.chmod(0o755)
    cluster = SlurmCluster(base / "slurm", base / "site" / "prolog.sh",
                           base / "site" / "epilog.sh")
    try:
        (base / "site").mkdir()
        for name in SCRIPTS:
            shutil.copy2(REPO / "deploy" / "slurm" / name, base / "site" / name)
        key = os.urandom(32)
        key_file = base / "site" / "site.key"
        key_file.write_bytes(key)
        key_file.chmod(0o600)
        (base / "out").mkdir(mode=0o777)
        (base / "out").chmod(0o1777)  # jobs of the test user write here too
        source = base / "src"
        make_small_tree(source, files=24)
        (source / "big.bin").write_bytes(os.urandom(700_000))  # spans several chunks
        store = populate_store(source, base / "store", "ds", "256K")
        site = Site(base, cluster, source, store, key)
        site.conf()
        try:
            cluster.start()
        except SlurmUnavailable as err:
            if in_ci():
                pytest.fail(str(err))
            pytest.skip(str(err))
        yield site
    finally:
        cluster.stop()
        for mp in [mp for mp in mounts_by_path() if mp.startswith(str(base) + "/")]:
            force_unmount(Path(mp))
        for pid in daemons_under(base):
            kill_and_reap(pid)
        shutil.rmtree(base, ignore_errors=True)


def _wait_for(path: Path, site: Site, job: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = site.cluster.job_state(job)
        assert state in ("PENDING", "CONFIGURING", "RUNNING", ""), \
            f"job {job} is {state} before writing {path.name}"
        assert time.monotonic() < deadline, f"job {job} did not write {path} in {timeout} s"
        time.sleep(0.1)


def _assert_cleaned(site: Site, job: str, nodes: list[str]) -> None:
    assert site.leftovers() == [], "left after the epilog"
    for node in nodes:
        for path in [site.mount(job, node), *site.job_dirs(job, node)]:
            assert not path.exists(), f"epilog left {path}"


def test_hostlists_expand_like_scontrol(site):
    for hostlist in ("node[1-3]", "node[1-3,05],gpu07", "a[01-02]-b[1-2]", "n[9-11],x"):
        names = site.cluster.scontrol("show", "hostnames", hostlist).split()
        assert expand_hostlist(hostlist) == names, hostlist


def test_opted_in_job_reads_the_dataset_on_every_node(site):
    script = site.out("read.sh")
    script.write_text(
        "#!/bin/bash\n"
        "srun -l bash -c 'cd " + str(site.base) + "/mnt/$SLURM_JOB_ID/$SLURMD_NODENAME/ds && "
        "find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum "
        "> " + str(site.base) + "/out/$SLURM_JOB_ID-$SLURMD_NODENAME.sums'\n")
    job = site.cluster.sbatch("-N3", "--comment=dlfs", f"--output={site.out('%j.out')}",
                              str(script))
    assert site.cluster.wait_finished(job) == "COMPLETED", site.out(f"{job}.out").read_text()
    expected = _source_sums(site.source)
    for node in SIM_NODES:
        assert site.out(f"{job}-{node}.sums").read_text() == expected, node
        log = site.log(job, node).read_text()
        assert "mounted" in log and f"chunk pool: node {node} of 3, 2 replicas" in log, log
    _assert_cleaned(site, job, SIM_NODES)
    for node in SIM_NODES:  # the job's I/O summary outlives the epilog, beside the log
        summary = json.loads(site.log(job, node).with_suffix(".summary.json").read_text())
        assert summary["datasets"]["ds"]["files_touched"] == len(expected.splitlines())


def test_constraint_opts_in_too(site):
    job = site.cluster.sbatch("-N1", "--constraint=dlfs", f"--output={site.out('%j.out')}",
                              "--wrap", f"ls {site.base}/mnt/$SLURM_JOB_ID/$SLURMD_NODENAME "
                                        f"> {site.base}/out/$SLURM_JOB_ID.ls")
    assert site.cluster.wait_finished(job) == "COMPLETED", site.out(f"{job}.out").read_text()
    assert site.out(f"{job}.ls").read_text() == "ds\n"
    _assert_cleaned(site, job, SIM_NODES)


def test_job_that_does_not_ask_gets_nothing(site):
    script = site.out("look.sh")
    script.write_text(
        "#!/bin/bash\n"
        "srun bash -c 'mp=" + str(site.base) + "/mnt/$SLURM_JOB_ID/$SLURMD_NODENAME; "
        "{ test -e \"$mp\" && echo exists || echo absent; "
        "grep -c \" " + str(site.base) + "/\" /proc/mounts || true; } "
        "> " + str(site.base) + "/out/$SLURM_JOB_ID-$SLURMD_NODENAME.seen'\n")
    job = site.cluster.sbatch("-N3", f"--output={site.out('%j.out')}", str(script))
    assert site.cluster.wait_finished(job) == "COMPLETED", site.out(f"{job}.out").read_text()
    for node in SIM_NODES:
        assert site.out(f"{job}-{node}.seen").read_text() == "absent\n0\n", node
        assert not site.log(job, node).exists()
    _assert_cleaned(site, job, SIM_NODES)


@pytest.mark.parametrize(("store", "says"), [
    ("missing-store", "store not found"),
    ("empty-store", "has no datasets"),
])
def test_prolog_failure_drains_the_node_and_leaves_nothing(site, store, says):
    node = "node1"
    (site.base / "empty-store").mkdir(exist_ok=True)
    site.conf(DLFS_STORE=str(site.base / store))
    job = None
    try:
        job = site.cluster.sbatch("-N1", f"-w{node}", "--no-requeue", "--comment=dlfs",
                                  f"--output={site.out('%j.out')}", "--wrap", "true")
        deadline = time.monotonic() + 60
        while "drain" not in site.cluster.node_states().get(node, ""):
            assert time.monotonic() < deadline, site.cluster.node_states()
            time.sleep(0.1)
        site.cluster.cmd("scancel", job, check=False)
        site.cluster.wait_finished(job)
        log = site.cluster.slurmd_log(node).read_text()
        line = f"dlfs prolog: job {job} on {node}: "
        assert any(line in row and says in row for row in log.splitlines()), log[-2000:]
        reason = site.cluster.scontrol("show", "node", node)
        assert "Prolog" in reason
        _assert_cleaned(site, job, [node])
    finally:
        site.conf()
        if job is not None:
            site.cluster.cmd("scancel", job, check=False)
        site.cluster.resume(node)


def test_secret_and_mount_belong_to_the_job_user(site):
    node = site.cluster.host
    with temp_user() as owner, temp_user() as other:
        mark = site.out("owner-ready")
        job = site.cluster.sbatch(
            "-p", "one", "-N1", "--comment=please use dlfs", f"--chdir={site.base / 'out'}",
            f"--output={site.out('%j.out')}", "--wrap",
            # Written under another name, then renamed: the test must not read the file
            # between the shell creating it and `ls` filling it (it once read it empty).
            f"ls {site.base}/mnt/$SLURM_JOB_ID/$SLURMD_NODENAME/ds/d0 > {mark}.tmp "
            f"&& mv {mark}.tmp {mark}.$SLURM_JOB_ID && sleep 120", user=owner.name)
        try:
            _wait_for(site.out(f"owner-ready.{job}"), site, job)
            assert "f000.bin" in site.out(f"owner-ready.{job}").read_text()
            mount = site.mount(job, node)
            secret = site.base / "run" / job / node / "secret"
            st = secret.stat()
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert (st.st_uid, st.st_gid) == (owner.uid, owner.gid)
            assert secret.read_text().strip() == derive_job_secret(site.key, job)
            assert owner.run("cat", str(secret)).returncode == 0
            denied = other.run("cat", str(secret))
            assert denied.returncode != 0 and "Permission denied" in denied.stderr
            root = os.stat(mount)
            assert (stat.S_IMODE(root.st_mode), root.st_uid) == (0o700, owner.uid)
            listing = other.run("ls", str(mount))
            assert listing.returncode != 0 and "Permission denied" in listing.stderr
        finally:
            site.cluster.cmd("scancel", job, check=False)
            site.cluster.wait_finished(job)
        _assert_cleaned(site, job, [node])


# -- the node cache outlives the job; several jobs share a node ------------------------

def _node_cache_conf(site: Site, **more: str) -> Path:
    cache = site.base / "nodecache"
    site.conf(DLFS_CACHE=f"{cache}/%n", DLFS_PORT_SPAN="6400", DLFS_REPLICAS="1", **more)
    return cache


def _read_script(site: Site, name: str, before_read: str = "") -> Path:
    """A job that, on every node, runs `before_read` in its mount, then lists sha256 sums.

    It first waits until every node's mount is up: a node's step may start before
    another node's prolog has mounted (its reads of that peer's chunks then go to the
    store, which these tests count)."""
    script = site.out(name)
    mount = f"{site.base}/mnt/$SLURM_JOB_ID/$SLURMD_NODENAME"
    all_up = (f"for i in $(seq 300); do n=0; for d in {site.base}/mnt/$SLURM_JOB_ID/*; do "
              "mountpoint -q $d && n=$((n+1)); done; [ $n -ge $SLURM_JOB_NUM_NODES ] && "
              "break; sleep 0.1; done;")
    script.write_text(
        "#!/bin/bash\n"
        f"srun -l bash -c '{all_up} M={mount}; {before_read} cd $M/ds && "
        "find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum "
        f"> {site.base}/out/$SLURM_JOB_ID-$SLURMD_NODENAME.sums'\n")
    return script


def _store_bytes(site: Site, job: str, node: str) -> int:
    summary = json.loads(site.log(job, node).with_suffix(".summary.json").read_text())
    return summary["datasets"]["ds"]["sources"]["store"]["bytes"]


WAIT_STAGED = """
import json, subprocess, sys, time
deadline = time.monotonic() + 90
while time.monotonic() < deadline:  # until this node staged its whole share
    out = subprocess.run([sys.argv[1], "status", sys.argv[2], "--json"],
                         capture_output=True, text=True).stdout
    staging = json.loads(out)["datasets"][0]["staging"] if out else {}
    if staging and staging["staged_chunks"] == staging["owned_chunks"]:
        sys.exit(0)
    time.sleep(0.2)
sys.exit("not staged in 90 s")
"""


def _wait_staged_step(site: Site) -> str:
    script = site.out("wait_staged.py")
    script.write_text(WAIT_STAGED)
    return f"{sys.executable} {script} {DLFS[0]} $M || exit 1;"


def test_a_later_job_on_the_same_nodes_reads_nothing_from_the_store(site):
    cache = _node_cache_conf(site)
    try:
        first = site.cluster.sbatch("-N3", "--comment=dlfs", f"--output={site.out('%j.out')}",
                                    str(_read_script(site, "stage.sh", _wait_staged_step(site))))
        assert site.cluster.wait_finished(first) == "COMPLETED", \
            site.out(f"{first}.out").read_text()
        assert all((cache / node / Store(site.store).open("ds").uuid.hex()).is_dir()
                   for node in SIM_NODES), "the epilog removed the node cache"
        second = site.cluster.sbatch("-N3", "--comment=dlfs", f"--output={site.out('%j.out')}",
                                     str(_read_script(site, "again.sh")))
        assert site.cluster.wait_finished(second) == "COMPLETED", \
            site.out(f"{second}.out").read_text()
        expected = _source_sums(site.source)
        for node in SIM_NODES:
            assert site.out(f"{second}-{node}.sums").read_text() == expected, node
            assert _store_bytes(site, second, node) == 0, site.log(second, node).read_text()
        reused = [int(re.search(r"\((\d+) staged chunks reused\)",
                                site.log(second, node).read_text()).group(1))
                  for node in SIM_NODES]
        assert sum(reused) == Store(site.store).open("ds").chunk_count  # job 1's, all kept
        _assert_cleaned(site, second, SIM_NODES)
    finally:
        site.conf()
        shutil.rmtree(cache, ignore_errors=True)


def test_two_jobs_at_once_on_the_same_nodes_each_read_their_whole_dataset(site):
    """Each job's step waits on every node until the other job is mounted there too, and
    fails if it never is: the jobs overlap or the test fails. Each asks for a little
    memory (--mem): with the default CR_Core_Memory and no --mem, a job takes all of a
    node's memory and Slurm ran the second only after the first (whose wait then ran
    out after 60 s and read alone: the test passed without two jobs at once)."""
    cache = _node_cache_conf(site)
    both_up = f"[ $(ls {site.base}/out | grep -c \"^up-.*-$SLURMD_NODENAME$\") -ge 2 ]"
    together = (  # both jobs mounted at once before either reads
        f"touch {site.base}/out/up-$SLURM_JOB_ID-$SLURMD_NODENAME; for i in $(seq 600); do "
        f"{both_up} && break; sleep 0.1; done; "
        f"{both_up} || {{ echo the other job never mounted on $SLURMD_NODENAME; exit 1; }};")
    try:
        script = _read_script(site, "together.sh", together)
        jobs = [site.cluster.sbatch("-N3", "--mem=100", "--comment=dlfs",
                                    f"--output={site.out('%j.out')}", str(script))
                for _ in range(2)]
        states = [site.cluster.wait_finished(job, timeout=180) for job in jobs]
        assert states == ["COMPLETED"] * 2, [site.out(f"{j}.out").read_text() for j in jobs]
        expected = _source_sums(site.source)
        for job in jobs:
            for node in SIM_NODES:
                assert site.out(f"{job}-{node}.sums").read_text() == expected, (job, node)
            _assert_cleaned(site, job, SIM_NODES)
        ports = [{re.search(r"peer port 127\.0\.0\.1:(\d+)",
                            site.log(job, node).read_text()).group(1)
                  for node in SIM_NODES} for job in jobs]
        assert not ports[0] & ports[1], ports
    finally:
        site.conf()
        shutil.rmtree(cache, ignore_errors=True)
        for flag in (site.base / "out").glob("up-*"):
            flag.unlink()


def test_srun_warmup_then_a_job_reads_nothing_from_the_store(site):
    cache = _node_cache_conf(site)
    try:
        warm = site.cluster.sbatch(
            "-N3", f"--output={site.out('%j.out')}", "--wrap",
            f"srun {DLFS[0]} warmup --slurm --store {site.store} --cache-dir {cache}/%n")
        assert site.cluster.wait_finished(warm) == "COMPLETED", \
            site.out(f"{warm}.out").read_text()
        out = site.out(f"{warm}.out").read_text()
        assert out.count("0 were staged already") == 3, out
        job = site.cluster.sbatch("-N3", "--comment=dlfs", f"--output={site.out('%j.out')}",
                                  str(_read_script(site, "after-warmup.sh")))
        assert site.cluster.wait_finished(job) == "COMPLETED", site.out(f"{job}.out").read_text()
        expected = _source_sums(site.source)
        for node in SIM_NODES:
            assert site.out(f"{job}-{node}.sums").read_text() == expected, node
            assert _store_bytes(site, job, node) == 0, site.log(job, node).read_text()
    finally:
        site.conf()
        shutil.rmtree(cache, ignore_errors=True)


def test_a_job_checkpoint_is_on_the_store_after_the_epilog_and_the_node_cache_is_clean(site):
    """Each node of a 3-node job writes its shard into MOUNT/ckpt/ and the job ends at
    once; the epilog's `dlfs flush` drains it before unmounting: every shard is on the
    per-job checkpoint store byte-exact, and the per-job cache is gone."""
    site.conf(DLFS_CKPT_STORE=f"{site.base}/ckstore/%j", DLFS_CKPT_FLUSH_TIMEOUT="120",
              DLFS_CKPT_ARGS="--drain-bandwidth 4M")
    try:
        script = site.out("ckpt.sh")
        script.write_text(
            "#!/bin/bash\n"
            "srun bash -c 'ck=" + str(site.base) + "/mnt/$SLURM_JOB_ID/$SLURMD_NODENAME/ckpt; "
            "mkdir -p $ck/step-9 && head -c 3000000 /dev/urandom > $ck/step-9/$SLURMD_NODENAME.pt"
            " && cd $ck && sha256sum step-9/$SLURMD_NODENAME.pt "
            "> " + str(site.base) + "/out/$SLURM_JOB_ID-$SLURMD_NODENAME.ckpt'\n")
        job = site.cluster.sbatch("-N3", "--comment=dlfs", f"--output={site.out('%j.out')}",
                                  str(script))
        assert site.cluster.wait_finished(job) == "COMPLETED", \
            site.out(f"{job}.out").read_text()
        deadline = time.monotonic() + 120
        while site.leftovers() and time.monotonic() < deadline:  # the epilog's flush
            time.sleep(0.2)
        store = site.base / "ckstore" / job
        for node in SIM_NODES:
            digest, rel = site.out(f"{job}-{node}.ckpt").read_text().split()
            assert hashlib.sha256((store / rel).read_bytes()).hexdigest() == digest, node
        assert sorted(p.name for p in (store / "step-9").iterdir()) == \
            sorted(f"{n}.pt" for n in SIM_NODES)
        _assert_cleaned(site, job, SIM_NODES)
    finally:
        site.conf()


def test_checkpoints_the_epilog_cannot_drain_stay_in_the_node_cache_until_drained_by_hand(
        site):
    """The checkpoint store turns read-only (a read-only bind mount of the job's
    checkpoint dir) before the job writes its checkpoint. The epilog's `dlfs flush`
    gives up after DLFS_CKPT_FLUSH_TIMEOUT, its line names what is left, and the job's
    files stay in the node cache byte-exact (mount and daemon gone, nothing deleted).
    With the store writable again, `dlfs mount` + `dlfs flush` by hand (as the README
    says) finish the drain."""
    node, job, store = site.cluster.host, None, None
    site.conf(DLFS_CKPT_STORE=f"{site.base}/ckstore/%j", DLFS_CKPT_FLUSH_TIMEOUT="2")
    payloads = {"step-3/model.pt": os.urandom(1_500_000), "extra.bin": os.urandom(5000)}
    for rel, data in payloads.items():
        site.out(f"ro-{rel.replace('/', '-')}").write_bytes(data)
    ck = f"{site.base}/mnt/$SLURM_JOB_ID/$SLURMD_NODENAME/ckpt"
    go = site.out("ro-go")
    try:
        job = site.cluster.sbatch(
            "-p", "one", "-N1", "--comment=dlfs", f"--output={site.out('%j.out')}", "--wrap",
            f"touch {site.out('ro-ready')}.$SLURM_JOB_ID; "
            f"while [ ! -e {go}.$SLURM_JOB_ID ]; do sleep 0.1; done; mkdir {ck}/step-3 && "
            + " && ".join(f"cp {site.out('ro-' + rel.replace('/', '-'))} {ck}/{rel}"
                          for rel in payloads))
        _wait_for(site.out(f"ro-ready.{job}"), site, job)
        store = site.base / "ckstore" / job  # the prolog made it
        for argv in (["mount", "--bind", str(store), str(store)],
                     ["mount", "-o", "remount,bind,ro", str(store)]):
            made = subprocess.run(argv, capture_output=True, text=True)
            if made.returncode:
                pytest.skip(f"cannot make the checkpoint dir read-only here "
                            f"({' '.join(argv)}: {made.stderr.strip()})")
        site.out(f"ro-go.{job}").touch()
        assert site.cluster.wait_finished(job) == "COMPLETED", \
            site.out(f"{job}.out").read_text()

        assert [x for x in site.leftovers() if x != str(store)] == [], \
            "mount or daemon left after the epilog"
        assert not site.mount(job, node).exists() and not site.job_dirs(job, node)[1].exists()
        cache = site.base / "cache" / job / node
        tree = next((cache / "ckpt").glob("*/tree"))
        local = {p.relative_to(tree).as_posix(): p.read_bytes()
                 for p in tree.rglob("*") if p.is_file()}
        assert local == payloads, "the node cache lost undrained checkpoint bytes"
        assert not any(store.iterdir()), "the read-only store got something"
        # slurmd drops a succeeding epilog's output: the line goes to the job's daemon log
        said = site.log(job, node).read_text()
        line = next((ln for ln in said.splitlines() if "dlfs.epilog WARNING" in ln), "")
        assert f"job {job} on {node}: checkpoints not drained to {store}" in line, said[-3000:]
        assert all(rel in line for rel in payloads) and str(tree.parent) in line, line
        assert "Read-only file system" in line, line

        subprocess.run(["umount", str(store)], check=True)  # the store is writable again
        mp = site.base / "mnt" / f"{job}-by-hand"
        mp.mkdir(parents=True)
        mounted = subprocess.run([*DLFS, "mount", str(mp), "--store", str(site.store),
                                  "--cache-dir", str(cache), "--ckpt-store", str(store)],
                                 capture_output=True, text=True, timeout=120)
        assert mounted.returncode == 0, mounted.stderr
        flushed = subprocess.run([*DLFS, "flush", str(mp), "--timeout", "60"],
                                 capture_output=True, text=True, timeout=120)
        unmounted = subprocess.run([*DLFS, "umount", str(mp)], capture_output=True, text=True,
                                   timeout=60)
        assert flushed.returncode == 0 and unmounted.returncode == 0, \
            flushed.stderr + unmounted.stderr
        assert {rel: (store / rel).read_bytes() for rel in payloads} == payloads
    finally:
        site.conf()
        if job is not None:
            site.cluster.cmd("scancel", job, check=False)
            site.cluster.wait_finished(job)
            if store is not None:
                while any(mp == str(store) for mp in mounts_by_path()):
                    subprocess.run(["umount", str(store)], capture_output=True)
            for mp in [mp for mp in mounts_by_path() if f"/mnt/{job}" in mp]:
                force_unmount(Path(mp))
            shutil.rmtree(site.base / "cache" / job, ignore_errors=True)
            shutil.rmtree(site.base / "mnt" / job, ignore_errors=True)
            shutil.rmtree(site.base / "mnt" / f"{job}-by-hand", ignore_errors=True)


def _record_pid(mount: Path) -> int:
    """The daemon's pid from its runtime record (root's /run/dlfs, dlfs.runtime)."""
    key = hashlib.sha1(os.fsencode(str(mount))).hexdigest()[:16]
    return json.loads(Path(f"/run/dlfs/{key}.json").read_text())["pid"]


def test_a_crashed_jobs_undrained_checkpoint_and_a_daemon_imitator_survive_the_epilog(site):
    """The job's daemon dies mid-job and its mount goes (SIGKILL, then a lazy unmount: a
    crash an admin cleaned up), with a checkpoint the read-only store never took. The
    site wipes the node cache after each job (DLFS_CACHE_AFTER_JOB=wipe), and the job's
    user runs a process whose command line reads like the daemon's (pgrep -f '-m dlfsd
    --config' and the mountpoint in it). The epilog must decide from the tier's ledger,
    not from the mount: the checkpoint stays byte-exact in the node cache with a
    warning, the rest of the cache goes; and it must find daemons by their runtime
    record, owner and session: the user's imitation lives on. The per-job checkpoint
    dir was made 0700 for the user, and the daemon log is 0640."""
    node, job, store, imitator = site.cluster.host, None, None, None
    cache = site.base / "nodecache"
    site.conf(DLFS_CACHE=f"{cache}/%n", DLFS_CACHE_AFTER_JOB="wipe", DLFS_PORT_SPAN="6400",
              DLFS_REPLICAS="1", DLFS_CKPT_STORE=f"{site.base}/ckstore/%j",
              DLFS_CKPT_FLUSH_TIMEOUT="2")
    payloads = {"step-5/model.pt": os.urandom(1_200_000), "meta.json": b'{"step": 5}'}
    for rel, data in payloads.items():
        site.out(f"crash-{rel.replace('/', '-')}").write_bytes(data)
    ck = f"{site.base}/mnt/$SLURM_JOB_ID/$SLURMD_NODENAME/ckpt"
    flag = f"{site.base}/out/crash"
    with temp_user() as user:
        try:
            job = site.cluster.sbatch(
                "-p", "one", "-N1", "--comment=dlfs", f"--chdir={site.base / 'out'}",
                f"--output={site.out('%j.out')}", "--wrap",
                f"touch {flag}-ready.$SLURM_JOB_ID; "
                f"while [ ! -e {flag}-go.$SLURM_JOB_ID ]; do sleep 0.1; done; "
                f"mkdir {ck}/step-5 && "
                + " && ".join(f"cp {site.out('crash-' + rel.replace('/', '-'))} {ck}/{rel}"
                              for rel in payloads)
                + f" && touch {flag}-written.$SLURM_JOB_ID; "
                f"while [ ! -e {flag}-end.$SLURM_JOB_ID ]; do sleep 0.1; done",
                user=user.name)
            _wait_for(site.out(f"crash-ready.{job}"), site, job)
            store = site.base / "ckstore" / job  # the prolog made it, 0700, the user's
            st = store.lstat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, user.uid)
            for argv in (["mount", "--bind", str(store), str(store)],
                         ["mount", "-o", "remount,bind,ro", str(store)]):
                made = subprocess.run(argv, capture_output=True, text=True)
                if made.returncode:
                    pytest.skip(f"cannot make the checkpoint dir read-only here "
                                f"({' '.join(argv)}: {made.stderr.strip()})")
            site.out(f"crash-go.{job}").touch()
            _wait_for(site.out(f"crash-written.{job}"), site, job)

            mount = site.mount(job, node)
            imitator = subprocess.Popen(
                ["bash", "-c", "sleep 600; :", "-m", "dlfsd", "--config",
                 json.dumps({"mountpoint": str(mount)})],
                user=user.uid, group=user.gid, extra_groups=[], start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            daemon = _record_pid(mount)
            os.killpg(daemon, signal.SIGKILL)  # the daemon's session: main and workers
            deadline = time.monotonic() + 30
            while [p for p, mp in daemons_under(site.base).items()
                   if mp == str(mount) and p != imitator.pid]:
                assert time.monotonic() < deadline, "the killed daemon did not go"
                time.sleep(0.1)
            subprocess.run(["umount", "-l", str(mount)], check=True)
            site.out(f"crash-end.{job}").touch()
            site.cluster.wait_finished(job)

            trees = list((cache / node / "ckpt").glob("*/tree"))
            assert len(trees) == 1, "the epilog deleted the undrained checkpoint tier"
            tree = trees[0]
            local = {p.relative_to(tree).as_posix(): p.read_bytes()
                     for p in tree.rglob("*") if p.is_file()}
            assert local == payloads, "the epilog deleted undrained checkpoint bytes"
            assert sorted(p.name for p in (cache / node).iterdir()) == ["ckpt"], \
                "the wipe left the chunk copies"
            said = site.log(job, node).read_text()
            line = next((ln for ln in said.splitlines() if "dlfs.epilog WARNING" in ln), "")
            assert f"job {job} on {node}: checkpoints kept in the node cache: undrained " \
                   f"{tree.parent.name}: " in line, said[-3000:]
            assert stat.S_IMODE(site.log(job, node).stat().st_mode) == 0o640
            assert imitator.poll() is None, "the epilog killed the user's process"
            assert not mount.exists() and not site.job_dirs(job, node)[1].exists()
            assert [d for p, d in daemons_under(site.base).items() if p != imitator.pid] == []
        finally:
            site.conf()
            if imitator is not None:
                os.killpg(imitator.pid, signal.SIGKILL)
                imitator.wait()
            if job is not None:
                site.cluster.cmd("scancel", job, check=False)
                site.cluster.wait_finished(job)
                if store is not None:
                    while any(mp == str(store) for mp in mounts_by_path()):
                        subprocess.run(["umount", str(store)], capture_output=True)
                for mp in [mp for mp in mounts_by_path() if f"/mnt/{job}" in mp]:
                    force_unmount(Path(mp))
                shutil.rmtree(site.base / "mnt" / job, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)


def test_a_taken_peer_port_leads_to_the_jobs_next_port_on_every_node(site):
    """Something holds node2's port of the next job (bound, as by a daemon not yet gone
    or another service). node2's prolog mounts on the job's next port of the span, and
    node1 and node3 find it there by the same rule: the job completes, reads right,
    and no node gives up on node2."""
    cache = _node_cache_conf(site)
    squatter = socket.socket()
    job = None
    try:
        job = site.cluster.sbatch("-N3", "--hold", "--comment=dlfs",
                                  f"--output={site.out('%j.out')}",
                                  str(_read_script(site, "taken.sh", _wait_staged_step(site))))
        slots = 6400 // SHARED_HOST_STRIDE
        first = PORT_BASE + (int(job) % slots) * SHARED_HOST_STRIDE + 1  # node2: position 1
        squatter.bind(("127.0.0.1", first))
        site.cluster.scontrol("release", job)
        assert site.cluster.wait_finished(job) == "COMPLETED", \
            site.out(f"{job}.out").read_text()
        expected = _source_sums(site.source)
        for node in SIM_NODES:
            assert site.out(f"{job}-{node}.sums").read_text() == expected, node
        nxt = PORT_BASE + ((int(job) + 1) % slots) * SHARED_HOST_STRIDE + 1
        log2 = site.log(job, "node2").read_text()
        assert f"peer port 127.0.0.1:{first} is taken" in log2, log2[-3000:]
        assert f"peer port 127.0.0.1:{nxt}" in log2 and "listening on the job's next port" \
            in log2, log2[-3000:]
        for node in ("node1", "node3"):
            log = site.log(job, node).read_text()
            assert "peer node2" not in log, log[-3000:]  # never marked down
        _assert_cleaned(site, job, SIM_NODES)
    finally:
        squatter.close()
        site.conf()
        if job is not None:
            site.cluster.cmd("scancel", job, check=False)
            site.cluster.wait_finished(job)
        shutil.rmtree(cache, ignore_errors=True)


RESUME_JOB = r'''
import hashlib, json, os, subprocess, sys, time
from pathlib import Path
from dlfs.order.sampler import DLFSSampler

base, job, node = Path(sys.argv[1]), os.environ["SLURM_JOB_ID"], os.environ["SLURMD_NODENAME"]
run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
rank = int(os.environ["SLURM_PROCID"])
mount = base / "mnt" / job / node
deadline = time.monotonic() + 60  # a step may start before its node's mount answers
while not (mount / "ds").is_dir() and time.monotonic() < deadline:
    time.sleep(0.1)
paths = sorted(str(p) for p in (mount / "ds").rglob("*") if p.is_file())
sampler = DLFSSampler(paths, mount=mount, seed=7)
state_file = mount / "ckpt" / "sampler.json"
if run:  # requeued: the state the first run saved through its mount, now on the store
    sampler.load_state_dict(json.loads(state_file.read_text()))
half = len(sampler) // 2
with open(base / "out" / f"{job}-run{run}-rank{rank}.sums", "w") as out:
    for n, index in enumerate(sampler):
        rel = os.path.relpath(paths[index], mount)
        out.write(hashlib.sha256(Path(paths[index]).read_bytes()).hexdigest() + "  " + rel + "\n")
        if not run and n + 1 == half:
            out.flush()
            deadline = time.monotonic() + 90  # this node's share staged: a requeue onto
            while time.monotonic() < deadline:  # the same node reuses it (node cache)
                got = subprocess.run([sys.argv[2], "status", str(mount), "--json"],
                                     capture_output=True, text=True).stdout
                staging = json.loads(got)["datasets"][0]["staging"] if got else {}
                if staging and staging["staged_chunks"] == staging["owned_chunks"]:
                    break
                time.sleep(0.2)
            if rank == 0:
                state_file.write_text(json.dumps(sampler.state_dict()))
            (base / "out" / f"{job}-half-rank{rank}").touch()
            time.sleep(3600)  # the scheduler requeues the job here
'''


def test_a_requeued_job_resumes_its_epoch_from_the_sampler_state_in_ckpt(site):
    """Two ranks read half an epoch, rank 0 saves the sampler's state into MOUNT/ckpt/;
    the job is requeued (`scontrol requeue`): the epilog drains ckpt/ to the job's
    checkpoint store, the job starts again with the same id, its new mount shows the
    state, and the ranks read the rest: both runs together read the epoch once
    (DistributedSampler's padding included), byte-exact; a node the requeued job lands
    on again reuses the chunks it staged (the node cache outlives the job)."""
    cache = _node_cache_conf(site, DLFS_CKPT_STORE=f"{site.base}/ckstore/%j",
                             DLFS_CKPT_FLUSH_TIMEOUT="60")
    try:
        program = site.out("resume_job.py")
        program.write_text(RESUME_JOB)
        script = site.out("resume.sh")
        script.write_text("#!/bin/bash\n"
                          f"srun -n2 --ntasks-per-node=1 {sys.executable} {program} "
                          f"{site.base} {DLFS[0]}\n")
        job = site.cluster.sbatch("-N2", "--requeue", "--comment=dlfs",
                                  f"--output={site.out('%j.out')}", "--open-mode=append",
                                  str(script))
        for rank in (0, 1):
            _wait_for(site.out(f"{job}-half-rank{rank}"), site, job, timeout=120)
        site.cluster.scontrol("requeue", job)
        # A requeued job waits out a begin time (Slurm 22.05: about two minutes); the
        # test need not, once the first run's epilogs are done on every node (the
        # requeued run mounts at the same paths the epilog unmounts and removes: its
        # mount dirs gone, no mount or daemon left)
        deadline = time.monotonic() + 120
        while (site.cluster.job_state(job) != "PENDING"
               or any("comp" in state for state in site.cluster.node_states().values())
               or any(site.mount(job, node).exists() for node in SIM_NODES)
               or site.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # slurmd reports the epilog's end a moment after it exits
        site.cluster.scontrol("update", f"jobid={job}", "starttime=now", check=False)
        assert site.cluster.wait_finished(job, timeout=300) == "COMPLETED", \
            site.out(f"{job}.out").read_text() + "".join(
                site.log(job, n).read_text()[-3000:] for n in SIM_NODES
                if site.log(job, n).exists())
        lines = [line for run in (0, 1) for rank in (0, 1)
                 for line in site.out(f"{job}-run{run}-rank{rank}.sums").read_text()
                 .splitlines()]
        expected = {f"{digest}  ds/{rel[2:]}"  # ./REL in the source, ds/REL in the mount
                    for digest, rel in (line.split("  ", 1)
                                        for line in _source_sums(site.source).splitlines())}
        assert set(lines) == expected, "a sample was lost or read wrong"
        padded = 2 * -(-len(expected) // 2)
        assert len(lines) == padded, f"{len(lines)} reads of an epoch of {padded}"
        assert (site.base / "ckstore" / job / "sampler.json").exists()
        runs = {node: re.findall(r"\((\d+) staged chunks reused\)",
                                 site.log(job, node).read_text())
                for node in SIM_NODES if site.log(job, node).exists()}
        if sorted(n for n, mounts in runs.items() if len(mounts) == 2) == \
                sorted(n for n, mounts in runs.items() if mounts):  # the same nodes again
            assert sum(int(mounts[1]) for mounts in runs.values()) == \
                Store(site.store).open("ds").chunk_count, runs
        assert site.leftovers() == [], "left after the epilog"
    finally:
        site.conf()
        shutil.rmtree(cache, ignore_errors=True)
