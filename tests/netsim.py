"""A modeled network for pool tests: one network namespace per simulated node, joined
by veth pairs to a bridge in a namespace of its own, with `tc` shaping per node.

Why: loopback has no bandwidth limit, no latency and never drops a packet, so
a test over it cannot show what a partition (packets dropped, no RST) or a slow
link does to the readers. Here each node's daemon runs in its node's namespace
(`Network.inside(i)` while mounting: the daemon inherits the namespace of the
thread that starts it, and the FUSE mount stays in ours), and a node can be cut
off (`cut`: its port on the bridge goes down, so whatever it or others send is
dropped without a word) or shaped (`shape`: tbf for the rate; netem for delay and
loss where the kernel has it; else loss alone, by a classic-BPF filter on the
node's bridge port that drops a random share of what the node sends, and no
delay: nothing but netem delays packets, so a kernel without it has no latency).

Addresses are 10.211.0.N/24 inside these namespaces only (nothing outside sees
them); everything is made by `Network.__enter__` and removed by `__exit__`, also
when a test fails; names carry this process's id, so two test runs never meet.
`unavailable()` says why a machine cannot do this (not root, no `ip`/`tc`, no
namespaces), for a skip with that reason; `netem_missing()` why there is no delay,
`loss_missing()` why there is no loss (neither netem nor cls_bpf),
`segmentation_missing()` why a link cannot be made to lose single packets.
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
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
SUBNET = "10.211.0"
_counter = itertools.count()


@dataclass(frozen=True)
class Profile:
    """What a node's outgoing link does: each part is applied on its own, so a kernel
    that lacks one (netem: delay) still gets the others."""

    rate: str  #: tbf rate, as `tc` spells it
    delay: str | None = None  #: netem delay one way ("50us"); only where netem exists
    loss: float = 0.0  #: share of the outgoing packets dropped: netem, else cls_bpf
    #: False: the node's eth0 hands the wire one packet at a time (gso_max_segs 1), so a
    #: loss takes a single 1500-byte packet, as on a real NIC, not a whole GSO burst
    segmentation: bool = True


#: the profiles a node's outgoing link gets, by name
PROFILES = {
    "10gbit": Profile("10gbit", delay="50us"),  # issue 33: 10 Gbit/s, 50 us one way
    "slow": Profile("10mbit"),  # a 10 Mbit/s link
    "lossy": Profile("10gbit", delay="50us", loss=0.01),  # 1% of the packets lost
    # 1% of single 1500-byte packets lost (segmentation off, as on a real NIC): a read
    # whose last packet is lost waits a TCP retransmission timeout (~210 ms). Measured,
    # 110 KiB reads: 0.3% to 2.2% of them waited 208-217 ms (runs differ, with the
    # machine's load), none took 24-100 ms; at 3% loss 5.6% waited, some twice or more
    # (the timeout doubles), and the share rule found the peer slow before the time rule.
    "lossy-packets": Profile("10gbit", delay="50us", loss=0.01, segmentation=False),
}

# The classic-BPF constants loss_bytecode uses (linux/filter.h, linux/pkt_cls.h).
_BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = the 32-bit word at k
_BPF_LD_H_ABS = 0x28  # BPF_LD | BPF_H | BPF_ABS: A = the 16-bit word at k
_BPF_LD_B_ABS = 0x30  # BPF_LD | BPF_B | BPF_ABS: A = the byte at k
_BPF_LD_B_IND = 0x50  # BPF_LD | BPF_B | BPF_IND: A = the byte at X + k
_BPF_LDX_B_MSH = 0xB1  # BPF_LDX | BPF_B | BPF_MSH: X = 4 * (the byte at k & 0xf)
_BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K: if A == k skip jt, else jf instructions
_BPF_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K: if A & k skip jt, else jf instructions
_BPF_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K: if A >= k skip jt, else jf instructions
_BPF_RET_K = 0x06  # BPF_RET | BPF_K: return k
_SKF_AD_RANDOM = (-0x1000 + 56) & 0xFFFFFFFF  # SKF_AD_OFF + SKF_AD_RANDOM: not packet data
_TC_ACT_SHOT = 2  # drop the packet
_TC_ACT_UNSPEC = 0xFFFFFFFF  # -1: no verdict, the packet goes on as without a filter


def loss_bytecode(share: float) -> str:
    """`tc filter ... bpf da bytecode` that drops `share` of the packets at random,
    except ARP and TCP handshakes (a share below 1).

    Classic BPF because the `tc` binary takes it as text, with no compiler, no BPF
    object file and no libbpf at run time; the kernel translates it to eBPF itself.
    In direct-action mode (`da`) the program's return value is the tc verdict; the
    frame starts at its Ethernet header (cls_bpf pushes it back at ingress):

        ldh [12]           the EtherType: ARP (0x0806) to "pass", anything but
        jeq #0x806, +9, +0 IPv4 (0x0800) to the random drop
        jeq #0x800, +0, +5
        ldb [23]           the IP protocol; not TCP (6): to the random drop
        jeq #6, +0, +3
        ldxb 4*([14]&0xf)  X = the IP header's length
        ldb [x+27]         the TCP flags (14 + 13 bytes on)
        jset #0x02, +3, +0 SYN (a SYN or a SYN-ACK): to "pass"
        ld  #random        A = a fresh random 32-bit word for each packet (the
                           ancillary load SKF_AD_RANDOM: prandom, not packet bytes)
        jge #T, +1, +0     A >= T: jump over the next instruction (to "pass")
        ret #2             TC_ACT_SHOT: drop it; taken with probability T / 2**32
        ret #-1            TC_ACT_UNSPEC: no verdict, the packet goes on

    T = share * 2**32, rounded; at least 1 (a tiny share still drops something, not
    nothing). A share of 1 or more is one instruction: drop every packet (a partition).
    Why handshakes pass: a lost SYN or SYN-ACK waits the kernel's initial
    retransmission timeout, a fixed 1 s (a lost ARP request about as long), which no
    loss on an established connection comes near (a lost segment is sent again within
    ~1 ms, or after ~210 ms at the tail of a read); a test's first read over a lossy
    link then took 1.03 s, now and then, where the model is about reads on the
    connections the pool keeps open.
    """
    if not share > 0.0:
        raise ValueError(f"a loss share must be above 0, not {share}")
    if share >= 1.0:
        return f"1,{_BPF_RET_K} 0 0 {_TC_ACT_SHOT}"
    threshold = min(max(round(share * 2**32), 1), 2**32 - 1)
    program = [(_BPF_LD_H_ABS, 0, 0, 12), (_BPF_JEQ_K, 9, 0, 0x0806),
               (_BPF_JEQ_K, 0, 5, 0x0800),
               (_BPF_LD_B_ABS, 0, 0, 23), (_BPF_JEQ_K, 0, 3, 6),
               (_BPF_LDX_B_MSH, 0, 0, 14), (_BPF_LD_B_IND, 0, 0, 27),
               (_BPF_JSET_K, 3, 0, 0x02),
               (_BPF_LD_W_ABS, 0, 0, _SKF_AD_RANDOM), (_BPF_JGE_K, 1, 0, threshold),
               (_BPF_RET_K, 0, 0, _TC_ACT_SHOT), (_BPF_RET_K, 0, 0, _TC_ACT_UNSPEC)]
    return ",".join([str(len(program)), *(" ".join(map(str, op)) for op in program)])


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


def _probe(tag: str, *commands: tuple[str, ...]) -> str | None:
    """Run `tc` commands (without the leading "tc") on a veth end in a namespace made
    for the probe: what failed, None if nothing did."""
    name = f"dlfs{tag}{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        for command in commands:
            _run("ip", "netns", "exec", name, "tc", *command)
    except RuntimeError as err:
        return str(err)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@functools.cache
def netem_missing() -> str | None:
    """Why delay cannot be modeled (no netem in this kernel; loss may still be, see
    loss_missing); None if it can."""
    if unavailable():
        return unavailable()
    err = _probe("netem", ("qdisc", "add", "dev", "p0", "root", "netem", "delay", "50us"))
    return f"tc netem is not available in this kernel ({err})" if err else None


@functools.cache
def loss_missing() -> str | None:
    """Why packet loss cannot be modeled (neither netem nor a cls_bpf filter on a
    clsact hook); None if it can."""
    if unavailable():
        return unavailable()
    if not netem_missing():
        return None
    err = _probe("bpf", ("qdisc", "add", "dev", "p0", "clsact"),
                 ("filter", "add", "dev", "p0", "ingress", "bpf", "da", "bytecode",
                  loss_bytecode(0.5)))
    return f"{netem_missing()}, nor a cls_bpf filter on clsact ({err})" if err else None


@functools.cache
def segmentation_missing() -> str | None:
    """Why segmentation offload cannot be turned off on a node's link (`ip link set
    gso_max_segs`, which this iproute2 or kernel may lack); None if it can."""
    if unavailable():
        return unavailable()
    name = f"dlfsgso{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _run("ip", "-n", name, "link", "set", "dev", "p0", "gso_max_segs", "1")
    except RuntimeError as err:
        return f"cannot turn segmentation offload off on a veth ({err})"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def modeled(profile: str | Profile) -> str:
    """What Network.shape(i, profile) models on this kernel, in words, with what it
    leaves out and why (for a test's or a benchmark's report)."""
    if isinstance(profile, str):
        profile = PROFILES[profile]
    said = [profile.rate]
    if profile.delay:
        said.append(f"no delay ({netem_missing()})" if netem_missing()
                    else f"{profile.delay} one way")
    if profile.loss:
        said.append(f"{profile.loss * 100:g}% loss "
                    + ("(netem)" if not netem_missing() else "(cls_bpf)"))
    if not profile.segmentation:
        said.append("segmentation off (single packets lost)")
    return ", ".join(said)


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

    def shape(self, i: int, profile: str | Profile) -> None:
        """Node i's outgoing traffic gets `profile` (a Profile or a name in PROFILES) in
        place of what it had: tbf for the rate on its eth0; where netem exists, netem in
        front of the tbf for delay and loss; else no delay, and the loss is dropped on
        the wire: by a cls_bpf filter (loss_bytecode) on the clsact ingress hook of
        node i's port on the bridge, so only what node i sends is lost, after its tbf.

        Not on eth0's own egress hook: a drop there is reported to the sending stack
        (the transmit returns NET_XMIT_DROP), and TCP sends the segment again at once,
        with no loss recovery and no wait (measured: 1000 reads of 110 KiB, 17 drops,
        0 retransmissions, none over 1.1 ms). netem hides its drops from the sender,
        which is why it sits on eth0. Either way a GSO packet (up to 64 KiB of a TCP
        stream, one skb through veth) is one packet, lost whole, unless the profile
        turns segmentation off (`segmentation=False`: eth0's gso_max_segs 1, so TCP
        hands it one 1500-byte packet at a time, as a NIC puts them on a real wire).
        A TCP connection takes that limit when it is made: shape a node before its
        peers connect to it.

        Raises when loss is asked for and loss_missing() says why it cannot be had (a
        test would pass on a clean link); a missing delay is left out (netem_missing()
        says why)."""
        if isinstance(profile, str):
            profile = PROFILES[profile]
        if profile.loss and loss_missing():
            raise RuntimeError(f"cannot model {profile.loss:.2%} loss: {loss_missing()}")
        if not profile.segmentation and segmentation_missing():
            raise RuntimeError(f"cannot turn segmentation off: {segmentation_missing()}")
        if not profile.segmentation or not segmentation_missing():
            # 65535: a veth's own default (segments of up to 64 KiB)
            _run("ip", "-n", self.names[i], "link", "set", "dev", "eth0", "gso_max_segs",
                 "65535" if profile.segmentation else "1")
        tc = ("ip", "netns", "exec", self.names[i], "tc")
        wire = ("ip", "netns", "exec", self.switch, "tc")
        port = self._ports[i]
        subprocess.run([*tc, "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
        # the clsact qdisc takes its filter with it
        subprocess.run([*wire, "qdisc", "del", "dev", port, "clsact"], capture_output=True)
        netem: list[str] = []
        if not netem_missing():
            if profile.delay:
                netem += ["delay", profile.delay]
            if profile.loss:
                netem += ["loss", f"{profile.loss * 100:g}%"]
        elif profile.loss:
            _run(*wire, "qdisc", "add", "dev", port, "clsact")
            _run(*wire, "filter", "add", "dev", port, "ingress", "bpf", "da", "bytecode",
                 loss_bytecode(profile.loss))
        if netem:
            _run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem", *netem)
            parent = ["parent", "1:1", "handle", "10:"]
        else:
            parent = ["root"]
        # burst: at least rate / HZ; limit: a queue of ~50 ms at this rate (more is dropped,
        # as a real switch port would)
        burst = "8mb" if profile.rate.endswith("gbit") else "64kb"
        _run(*tc, "qdisc", "add", "dev", "eth0", *parent, "tbf", "rate", profile.rate,
             "burst", burst, "latency", "50ms")

    def cut(self, i: int) -> None:
        """Partition node i: its bridge port goes down, every packet to or from it is
        dropped (no RST, no ICMP), its connections stay open and silent."""
        _run("ip", "-n", self.switch, "link", "set", self._ports[i], "down")

    def heal(self, i: int) -> None:
        _run("ip", "-n", self.switch, "link", "set", self._ports[i], "up")
