"""A modeled network for pool tests: one network namespace per simulated node, joined
by veth pairs to a bridge in a namespace of its own, with `tc` shaping per node.

Why: loopback has no bandwidth limit, no latency and never drops a packet, so
a test over it cannot show what a partition (packets dropped, no RST) or a slow
link does to the readers. Here each node's daemon runs in its node's namespace
(`Network.inside(i)` while mounting: the daemon inherits the namespace of the
thread that starts it, and the FUSE mount stays in ours), and a node can be cut
off (`cut`: its port on the bridge goes down, so whatever it or others send is
dropped without a word) or shaped (`shape`: tbf for the rate, netem for delay
and loss where the kernel has it).

Addresses are 10.211.0.N/24 inside these namespaces only (nothing outside sees
them); everything is made by `Network.__enter__` and removed by `__exit__`, also
when a test fails; names carry this process's id, so two test runs never meet.
`unavailable()` says why a machine cannot do this (not root, no `ip`/`tc`, no
namespaces), for a skip with that reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
SUBNET = "10.211.0"
_counter = itertools.count()

#: name -> (tbf rate, netem arguments or None): the profiles a node's outgoing link gets.
PROFILES = {
    "10gbit": ("10gbit", "delay 50us"),  # issue 33: 10 Gbit/s, 50 us one way
    "slow": ("10mbit", None),  # a 10 Mbit/s link
    "lossy": ("10gbit", "delay 50us loss 1%"),  # 1% of the packets lost
}


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


@functools.cache
def unavailable() -> str | None:
    """Why namespaces with veth pairs cannot be made here; None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install -y iproute2)"
    name = f"dlfsprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _run("ip", "-n", name, "link", "add", "b0", "type", "bridge")
    except RuntimeError as err:
        return f"cannot make a network namespace with veth pairs and a bridge: {err}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@functools.cache
def netem_missing() -> str | None:
    """Why delay and loss cannot be modeled (no netem in this kernel); None if they can."""
    if unavailable():
        return unavailable()
    name = f"dlfsnetem{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "p0", "root", "netem",
             "delay", "50us")
    except RuntimeError as err:
        return f"tc netem is not available in this kernel ({err})"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class Network:
    """`nodes` namespaces on one bridge; node i has address `address(i)`."""

    def __init__(self, nodes: int) -> None:
        tag = f"{os.getpid()}x{next(_counter)}"
        self.switch = f"dlfs{tag}s"
        self.names = [f"dlfs{tag}n{i}" for i in range(nodes)]
        self._ports = [f"b{i}" for i in range(nodes)]  # the bridge's end, in the switch
        self.made: list[str] = []

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> Network:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        sw = self.switch
        _run("ip", "netns", "add", sw)
        self.made.append(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
            port = self._ports[i]
            _run("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                 "netns", ns)
            _run("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Remove every namespace made (their veth ends go with them). Never raises."""
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()

    @contextlib.contextmanager
    def inside(self, i: int) -> Iterator[None]:
        """Run the block (and the processes it starts) in node i's namespace."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(f"/run/netns/{self.names[i]}", os.O_RDONLY)
        try:
            _setns(there)
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(there)
            os.close(home)

    def shape(self, i: int, profile: str) -> None:
        """Node i's outgoing traffic gets `profile` (PROFILES): tbf for the rate, netem
        in front of it for delay and loss where netem exists (else only the rate)."""
        rate, netem = PROFILES[profile]
        ns = self.names[i]
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True)
        # burst: at least rate / HZ; limit: a queue of ~50 ms at this rate (more is dropped,
        # as a real switch port would)
        burst = "8mb" if rate.endswith("gbit") else "64kb"
        if netem and not netem_missing():
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root",
                 "handle", "1:", "netem", *netem.split())
            parent = ["parent", "1:1", "handle", "10:"]
        else:
            parent = ["root"]
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *parent, "tbf",
             "rate", rate, "burst", burst, "latency", "50ms")

    def cut(self, i: int) -> None:
        """Partition node i: its bridge port goes down, every packet to or from it is
        dropped (no RST, no ICMP), its connections stay open and silent."""
        _run("ip", "-n", self.switch, "link", "set", self._ports[i], "down")

    def heal(self, i: int) -> None:
        _run("ip", "-n", self.switch, "link", "set", self._ports[i], "up")
