"""A real Slurm cluster on this machine for tests: munge, slurmctld, and slurmd for this
host plus simulated nodes node[1-3], all on 127.0.0.1 (see shared SLURM-NOTES).

`SlurmCluster.start()` writes a slurm.conf under a scratch dir and starts the
daemons; `stop()` stops exactly the daemons it started (by pid file), also
after a failure. Ports 7490-7494 (ours by convention on shared test machines).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
CTLD_PORT = 7490
HOST_NODE_PORT = 7491
SIM_NODES = ["node1", "node2", "node3"]
SIM_PORTS = "7492-7494"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class SlurmUnavailable(Exception):
    """Slurm cannot be installed or started here (the caller decides: skip or fail)."""


def install_packages() -> None:
    """apt-get install the Slurm and munge packages if any binary is missing (~15 s)."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and apt-get (as root) is unavailable; "
                               f"install {' '.join(PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: "
                                   f"{result.stderr.strip()[-300:]}")


def _wait(condition, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _pid_from(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stop_pids(pids: list[int | None], timeout: float = 10.0) -> None:
    """SIGTERM all of them at once, wait up to `timeout` for all, SIGKILL the rest. At
    once: each Slurm daemon takes ~2 s to exit, and one after another the six of a
    cluster took 12 s."""
    left = {pid for pid in pids if pid is not None}
    for pid in list(left):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            left.discard(pid)
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        for pid in list(left):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                left.discard(pid)
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class SlurmCluster:
    """Scratch dir `base` holds conf, state, spool, pid files and logs."""

    base: Path
    prolog: Path
    epilog: Path
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    started_munge: bool = False

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def nodes(self) -> list[str]:
        return [self.host, *SIM_NODES]

    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def slurmd_log(self, node: str) -> Path:
        return self.base / f"slurmd-{node}.log"

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        install_packages()
        self.base.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool"):
            (self.base / sub).mkdir(exist_ok=True)
        self.conf.write_text(self._conf_text())
        self._start_munge()
        self._run(["slurmctld", "-i"])
        _wait(lambda: "UP" in self.scontrol("ping", check=False), 15, "slurmctld to answer")
        self._run(["slurmd"])
        for node in SIM_NODES:
            self._run(["slurmd", "-N", node])
        _wait(lambda: self.node_states() and set(self.node_states().values()) == {"idle"}, 30,
              "every node to be idle")

    def stop(self) -> None:
        """Stop what start() started; never raises (runs in a fixture's finally)."""
        with contextlib.suppress(Exception):
            jobs = self.cmd("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
            if jobs:
                self.cmd("scancel", *jobs, check=False, timeout=10)
                for job in jobs:
                    self.wait_finished(job, timeout=30)
        pids = [_pid_from(self.base / f"slurmd-{node}.pid") for node in self.nodes]
        pids.append(_pid_from(self.base / "slurmctld.pid"))
        if self.started_munge:
            pids.append(_pid_from(Path("/run/munge/munged.pid")))
        _stop_pids(pids)

    def _start_munge(self) -> None:
        if self._munge_works():
            return  # someone's munged already serves this host: share it
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        result = subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--force"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise SlurmUnavailable(f"munged did not start: {result.stderr.strip()}")
        self.started_munge = True
        _wait(self._munge_works, 10, "munged")

    @staticmethod
    def _munge_works() -> bool:
        if shutil.which("munge") is None:
            return False
        return subprocess.run(["munge", "-n"], stdin=subprocess.DEVNULL,
                              capture_output=True).returncode == 0

    def _run(self, argv: list[str]) -> None:
        result = subprocess.run(argv, env=self.env(), capture_output=True, text=True,
                                timeout=30)
        if result.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(argv)} failed: {result.stderr.strip()}")

    def _conf_text(self) -> str:
        b, cpus = self.base, os.cpu_count() or 1
        return "\n".join([
            "ClusterName=dlfstest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={CTLD_PORT}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SlurmdParameters=config_overrides",
            "SchedulerParameters=batch_sched_delay=0",
            "SelectType=select/cons_tres",
            "PrologFlags=Alloc", f"Prolog={self.prolog}", f"Epilog={self.epilog}",
            "PrologEpilogTimeout=120", "MailProg=/bin/true", "ReturnToService=2",
            f"StateSaveLocation={b}/state", f"SlurmdSpoolDir={b}/spool/%n",
            f"SlurmctldPidFile={b}/slurmctld.pid", f"SlurmdPidFile={b}/slurmd-%n.pid",
            f"SlurmctldLogFile={b}/slurmctld.log", f"SlurmdLogFile={b}/slurmd-%n.log",
            f"NodeName={self.host} NodeAddr=127.0.0.1 Port={HOST_NODE_PORT} CPUs={cpus} "
            "RealMemory=1000 Feature=dlfs",
            f"NodeName=node[1-3] NodeHostname={self.host} NodeAddr=127.0.0.1 "
            f"Port=[{SIM_PORTS}] CPUs={cpus} RealMemory=1000 Feature=dlfs",
            f"PartitionName=one Nodes={self.host} MaxTime=INFINITE State=UP",
            "PartitionName=sim Nodes=node[1-3] Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    # -- client commands ---------------------------------------------------------
    def cmd(self, *argv: str, check: bool = True, user: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        full = [*argv] if user is None else ["runuser", "-u", user, "--", "env",
                                             f"SLURM_CONF={self.conf}", *argv]
        result = subprocess.run(full, env=self.env(), capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(full)} exited {result.returncode}: "
                                 f"{result.stderr.strip()}")
        return result

    def scontrol(self, *argv: str, check: bool = True) -> str:
        return self.cmd("scontrol", *argv, check=check).stdout

    def sbatch(self, *argv: str, user: str | None = None) -> str:
        """Submit; returns the job id."""
        return self.cmd("sbatch", "--parsable", *argv, user=user).stdout.strip().split(";")[0]

    def node_states(self) -> dict[str, str]:
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def job_state(self, job: str) -> str:
        """The job's state; '' once slurmctld no longer knows it."""
        out = self.cmd("squeue", "-h", "-j", job, "-t", "all", "-o", "%T", check=False).stdout
        return out.strip()

    def wait_running(self, job: str, timeout: float = 60) -> None:
        _wait(lambda: self.job_state(job) == "RUNNING", timeout, f"job {job} to run", 0.1)

    def wait_finished(self, job: str, timeout: float = 120) -> str:
        """Wait until the job and its epilogs are done (srun/sbatch --wait return before
        the epilog ends): final job state and no node still completing."""
        def done() -> bool:
            state = self.job_state(job)
            return (state in FINAL_STATES or state == "") and not any(
                "comp" in s for s in self.node_states().values())
        _wait(done, timeout, f"job {job} and its epilog to finish", 0.1)
        return self.job_state(job)

    def resume(self, node: str) -> None:
        self.scontrol("update", f"nodename={node}", "state=resume")
        _wait(lambda: self.node_states().get(node) == "idle", 30, f"{node} to be idle")
