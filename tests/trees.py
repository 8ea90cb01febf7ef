"""Edge-case source trees for the real-mount and CLI tests, and a way to describe any tree.

`make_edge_tree` writes a tree with everything a packer and a FUSE server tend
to get wrong: thousands of small files in nested directories, files larger
than a chunk and files ending exactly on chunk/extent boundaries, empty files
and an empty directory, names that are not UTF-8 (and spaces, newlines,
unicode, 255-byte names), a depth-20 directory chain, symlinks (relative,
absolute to outside the tree, dangling, self-loop), varied permission bits,
nanosecond mtimes (one before 1970) and a fifo (which must be skipped).

`describe_tree` walks any tree (a source or a mounted dataset) with bytes
paths, without following links, into {relpath: Node}; the tests compare two
descriptions instead of hard-coding what the tree contains.
"""

from __future__ import annotations

import hashlib
import os
import random
import stat
from dataclasses import dataclass, field
from pathlib import Path

KIB = 1 << 10
MIB = 1 << 20
TEST_CHUNK_SIZE = 256 * KIB  # tests populate with --chunk-size 256K
DEEP_DEPTH = 20

# Names that are not valid UTF-8 (latin-1 bytes, stray continuation bytes).
BAD_FILE = b"names/bad\xff\xfename"
BAD_DIR = b"names/dir\xe9latin1"


@dataclass(frozen=True)
class Node:
    """What one entry looks like to lstat (+ readlink / sha256 of the content)."""

    mode: int
    size: int | None  # None for directories: their st_size is file-system specific
    mtime_ns: int
    link: bytes | None = None
    sha256: str | None = None

    @property
    def kind(self) -> int:
        return stat.S_IFMT(self.mode)


@dataclass
class EdgeTree:
    root: Path
    chunk_size: int
    specials: list[bytes] = field(default_factory=list)  # fifos: must be skipped
    big_files: list[bytes] = field(default_factory=list)  # relpaths of files > chunk size
    boundary_files: list[bytes] = field(default_factory=list)  # sizes on chunk boundaries
    outside_target: Path | None = None

    def __fspath__(self) -> str:  # usable wherever a path is: os.fspath(tree), open(...)
        return os.fspath(self.root)

    def __truediv__(self, other: str) -> Path:
        return self.root / other

    @property
    def broot(self) -> bytes:
        return os.fsencode(self.root)

    def path(self, rel: bytes) -> bytes:
        return os.path.join(self.broot, rel)


def _write(path: bytes, data: bytes, mode: int | None = None) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    if mode is not None:
        os.chmod(path, mode)


def make_edge_tree(root: Path, chunk_size: int = TEST_CHUNK_SIZE, small_files: int = 3000,
                   seed: int = 0, fifo: bool = True) -> EdgeTree:
    """Write the edge-case tree under `root` (created; must not exist or be empty)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    tree = EdgeTree(root=root, chunk_size=chunk_size)
    b = tree.broot
    pool = rng.randbytes(4 * MIB)

    def data(n: int) -> bytes:
        start = rng.randrange(0, len(pool) - n + 1)
        return pool[start : start + n]

    # Thousands of small files across nested directories, some empty.
    for i in range(small_files):
        rel = b"small/g%02d/h%d/f%05d.bin" % (i % 30, (i // 30) % 4, i)
        size = 0 if i % 397 == 0 else rng.randrange(1, 3000)
        _write(os.path.join(b, rel), data(size))

    # Files larger than a chunk, and files ending exactly on chunk/extent boundaries
    # (with --chunk-size 256K the extent size is 256K too).
    sizes = {
        b"big/one_mib.bin": MIB,
        b"big/one_mib_odd.bin": MIB + 12345,
        b"big/two_chunks.bin": 2 * chunk_size,
        b"big/chunk_exact.bin": chunk_size,
        b"big/chunk_minus_1.bin": chunk_size - 1,
        b"big/chunk_plus_1.bin": chunk_size + 1,
        b"big/page.bin": 4096,
    }
    for rel, size in sizes.items():
        _write(os.path.join(b, rel), data(size))
        if size > chunk_size:
            tree.big_files.append(rel)
        if size % chunk_size in (0, 1, chunk_size - 1):
            tree.boundary_files.append(rel)

    # Empty files and an empty directory.
    _write(os.path.join(b, b"empty.txt"), b"")
    _write(os.path.join(b, b"empties/zero_a"), b"")
    _write(os.path.join(b, b"empties/zero_b"), b"")
    os.makedirs(os.path.join(b, b"empty_dir"))

    # Awkward names.
    _write(os.path.join(b, BAD_FILE), b"not utf-8 name\n")
    _write(os.path.join(b, BAD_DIR, b"inner\x80.txt"), data(777))
    for name in ("with space.txt", " leading space", "trailing space ",
                 "ünïcødé-файл-日本語.txt", "emoji-😀.bin", "-dash", "back\\slash",
                 "new\nline", "x" * 255):
        _write(os.path.join(b, b"names", os.fsencode(name)), data(rng.randrange(0, 500)))

    # A depth-20 directory chain.
    deep = os.path.join(b, b"deep", *(b"d%02d" % i for i in range(1, DEEP_DEPTH + 1)))
    _write(os.path.join(deep, b"leaf.txt"), b"bottom\n")

    # Hard links: two names for one source file; both are packed as files.
    os.link(os.path.join(b, b"big/page.bin"), os.path.join(b, b"big/page_hardlink.bin"))

    # Symlinks: relative, relative to a directory, absolute outside, dangling, loop.
    outside = root.parent / f"{root.name}-outside-target.txt"
    outside.write_bytes(b"outside the tree\n")
    tree.outside_target = outside
    links = os.path.join(b, b"links")
    os.makedirs(links)
    os.symlink(b"../small/g00/h0/f00000.bin", os.path.join(links, b"rel"))
    os.symlink(b"../deep", os.path.join(links, b"rel_dir"))
    os.symlink(os.fsencode(outside), os.path.join(links, b"abs_outside"))
    os.symlink(b"does/not/exist", os.path.join(links, b"dangling"))
    os.symlink(b"loop", os.path.join(links, b"loop"))
    os.symlink(b"../" + BAD_FILE, os.path.join(links, b"to_bad\xfe"))

    # Varied permission bits (directories get theirs at the end).
    for mode in (0o600, 0o755, 0o444, 0o640, 0o000, 0o4755):
        _write(os.path.join(b, b"modes", b"m%04o" % mode), data(100), mode)
    os.makedirs(os.path.join(b, b"modes", b"dir0700", b"sub"))
    os.makedirs(os.path.join(b, b"modes", b"dir0555"))
    _write(os.path.join(b, b"modes", b"dir0555", b"in_ro_dir"), b"x")

    # A fifo: cannot be packed, must be skipped with one warning.
    if fifo:
        os.makedirs(os.path.join(b, b"specials"))
        os.mkfifo(os.path.join(b, b"specials", b"fifo"))
        tree.specials.append(b"specials/fifo")
        _write(os.path.join(b, b"specials", b"regular_next_to_fifo"), b"keep me\n")

    _set_mtimes(b, rng)
    os.chmod(os.path.join(b, b"modes", b"dir0700"), 0o700)
    os.chmod(os.path.join(b, b"modes", b"dir0555"), 0o555)
    return tree


def _set_mtimes(broot: bytes, rng: random.Random) -> None:
    """Distinct nanosecond mtimes on everything; directories last, deepest first."""
    dirs: list[bytes] = []
    others: list[bytes] = []
    for dirpath, dirnames, filenames in os.walk(broot):
        dirs.append(dirpath)
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or not os.path.isdir(full):
                others.append(full)
    base = 1_600_000_000 * 10**9
    for i, path in enumerate(sorted(others)):
        # Never a multiple of 1000: catches a loss of precision to micro/seconds.
        ns = base + i * 1_000_003_001 + rng.randrange(1, 999) * 1000 + 7
        if path.endswith(b"/empty.txt"):
            ns = -123_456_789_012  # before 1970
        os.utime(path, ns=(ns, ns), follow_symlinks=False)
    for i, path in enumerate(sorted(dirs, key=lambda p: p.count(b"/"), reverse=True)):
        ns = base - 10**12 + i * 777_777_777 + 13
        os.utime(path, ns=(ns, ns))


def describe_tree(root: Path | bytes, hashes: bool = True) -> dict[bytes, Node]:
    """{relpath: Node} of every entry under root (b"" is root itself), links not followed.

    Sockets, fifos and devices are left out (see `special_files`).
    """
    broot = os.fsencode(root)
    out: dict[bytes, Node] = {b"": _node(broot, hashes)}
    for dirpath, dirnames, filenames in os.walk(broot):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            node = _node(full, hashes)
            if node is not None:
                out[os.path.relpath(full, broot)] = node
    return out


def special_files(root: Path | bytes) -> list[bytes]:
    """Relpaths of entries that are neither files, directories nor symlinks."""
    broot = os.fsencode(root)
    found = []
    for dirpath, _dirnames, filenames in os.walk(broot):
        for name in filenames:
            full = os.path.join(dirpath, name)
            mode = os.lstat(full).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode) or stat.S_ISDIR(mode)):
                found.append(os.path.relpath(full, broot))
    return found


def _node(path: bytes, hashes: bool) -> Node | None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        return Node(st.st_mode, None, st.st_mtime_ns)
    if stat.S_ISLNK(st.st_mode):
        return Node(st.st_mode, st.st_size, st.st_mtime_ns, link=os.readlink(path))
    if stat.S_ISREG(st.st_mode):
        digest = sha256_file(path) if hashes else None
        return Node(st.st_mode, st.st_size, st.st_mtime_ns, sha256=digest)
    return None


def sha256_file(path: bytes | str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def regular_files(nodes: dict[bytes, Node]) -> list[bytes]:
    return sorted(rel for rel, node in nodes.items() if node.kind == stat.S_IFREG)


def file_bytes(nodes: dict[bytes, Node]) -> int:
    return sum(node.size or 0 for node in nodes.values() if node.kind == stat.S_IFREG)


def make_small_tree(root: Path, files: int = 40, seed: int = 1, prefix: str = "f") -> None:
    """A quick tree of a few dozen files in two directories (for CLI and lifecycle tests)."""
    rng = random.Random(seed)
    for i in range(files):
        rel = Path(f"d{i % 2}") / f"{prefix}{i:03d}.bin"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(rng.randrange(1, 5000)))
