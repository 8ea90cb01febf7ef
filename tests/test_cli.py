"""The `dlfs` command line, run as a real subprocess: error lines, ls/info/rm/verify, help.

Every user-caused error must be exactly one stderr line starting with
"dlfs: error:", a non-zero exit code from the documented table, and no traceback.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DLFS, force_unmount, tmpfs_at
from trees import describe_tree, file_bytes, make_small_tree, regular_files

from dlfs import runtime
from dlfs.cli import demo
from dlfs.errors import DlfsError
from dlfs.runtime import status_path
from dlfs.sizes import format_size
from dlfs.store.store import Store

pytestmark = pytest.mark.usefixtures("daemon_guard")

SUBCOMMANDS = ["populate", "ls", "info", "verify", "rm", "mount", "umount"]
EXIT_TABLE = {"0": "success", "1": "error", "2": "usage", "3": "corrupt", "130": "interrupted",
              "141": "pipe was closed"}


def assert_one_line_error(result: subprocess.CompletedProcess, code: int | None = None,
                          mentions: tuple[str, ...] = ()) -> str:
    """The error contract; returns the message line."""
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    assert lines[0].startswith("dlfs: error: "), lines[0]
    assert result.returncode != 0
    if code is not None:
        assert result.returncode == code, (result.returncode, lines[0])
    for text in mentions:
        assert text in lines[0], f"{text!r} not named in {lines[0]!r}"
    return lines[0]


@pytest.fixture(scope="module")
def env(tmp_path_factory, store_with):
    """A small source, a store with dataset 'ds' made from it, a regular file, a directory.

    Shared by the module: tests must leave it as they found it (errors change nothing).
    """
    tmp_path = tmp_path_factory.mktemp("cli")
    src = tmp_path / "src"
    make_small_tree(src, files=20)
    store = store_with(src, "ds", "256K", tmp_path / "store")
    afile = tmp_path / "afile"
    afile.write_bytes(b"not a directory\n")
    adir = tmp_path / "adir"
    adir.mkdir()
    return {"tmp": tmp_path, "src": src, "store": store, "file": afile, "dir": adir}


# name: (argv builder, expected exit code, texts the message must name)
ERROR_CASES = {
    "populate_missing_source": (
        lambda e: ["populate", e["tmp"] / "nosuch", "--store", e["tmp"] / "s2", "--name", "x"],
        1, ("nosuch",)),
    "populate_source_is_a_file": (
        lambda e: ["populate", e["file"], "--store", e["tmp"] / "s2", "--name", "x"],
        1, ("afile",)),
    "populate_store_under_a_file": (
        lambda e: ["populate", e["src"], "--store", e["file"] / "store", "--name", "x"],
        1, ("afile/store",)),
    "populate_store_is_a_file": (
        lambda e: ["populate", e["src"], "--store", e["file"], "--name", "x"],
        1, ("afile", "not a directory")),
    "ls_store_is_a_file": (
        lambda e: ["ls", "--store", e["file"]], 1, ("afile", "not a directory")),
    "mount_log_file_in_a_missing_dir": (
        lambda e: ["mount", e["dir"], "--store", e["store"], "--log-file",
                   e["tmp"] / "nodir" / "x.log"], 1, ("--log-file", "nodir", "does not exist")),
    "mount_summary_file_in_a_missing_dir": (
        lambda e: ["mount", e["dir"], "--store", e["store"], "--summary-file",
                   e["tmp"] / "nodir" / "s.json"], 1, ("--summary-file", "nodir")),
    "mount_empty_dataset_name": (
        lambda e: ["mount", e["dir"], "--store", e["store"], "--dataset", ""], 2,
        ("--dataset",)),
    "mount_huge_trace_capacity": (
        lambda e: ["mount", e["dir"], "--store", e["store"], "--trace-capacity",
                   "99999999999"], 2, ("--trace-capacity",)),
    "populate_existing_name": (
        lambda e: ["populate", e["src"], "--store", e["store"], "--name", "ds"],
        1, ("ds", "--force")),
    "chunk_size_too_small": (
        lambda e: ["populate", e["src"], "--store", e["tmp"] / "s2", "--name", "x",
                   "--chunk-size", "1K"], 2, ("chunk-size",)),
    "chunk_size_zero": (
        lambda e: ["populate", e["src"], "--store", e["tmp"] / "s2", "--name", "x",
                   "--chunk-size", "0"], 2, ("chunk-size",)),
    "chunk_size_too_big": (
        lambda e: ["populate", e["src"], "--store", e["tmp"] / "s2", "--name", "x",
                   "--chunk-size", "3G"], 2, ("chunk-size",)),
    "info_missing_dataset": (
        lambda e: ["info", "--store", e["store"], "nope"], 1, ("nope",)),
    "verify_missing_dataset": (
        lambda e: ["verify", "--store", e["store"], "nope"], 1, ("nope",)),
    "rm_missing_dataset": (
        lambda e: ["rm", "--store", e["store"], "nope"], 1, ("nope",)),
    "info_missing_store": (
        lambda e: ["info", "--store", e["tmp"] / "nostore", "ds"], 1, ("nostore",)),
    "ls_missing_store": (
        lambda e: ["ls", "--store", e["tmp"] / "nostore"], 1, ("nostore",)),
    "mount_missing_mountpoint": (
        lambda e: ["mount", e["tmp"] / "nomp", "--store", e["store"],
                   "--log-file", e["tmp"] / "log"], 1, ("nomp",)),
    "mount_mountpoint_is_a_file": (
        lambda e: ["mount", e["file"], "--store", e["store"],
                   "--log-file", e["tmp"] / "log"], 1, ("afile",)),
    "mount_missing_store": (
        lambda e: ["mount", e["dir"], "--store", e["tmp"] / "nostore",
                   "--log-file", e["tmp"] / "log"], 1, ("nostore",)),
    "mount_store_without_datasets": (
        lambda e: ["mount", e["dir"], "--store", e["dir"],
                   "--log-file", e["tmp"] / "log"], 1, ("adir",)),
    "mount_missing_dataset": (
        lambda e: ["mount", e["dir"], "--store", e["store"], "--dataset", "nope",
                   "--log-file", e["tmp"] / "log"], 1, ("nope",)),
    "mount_negative_cache_timeout": (
        lambda e: ["mount", e["dir"], "--store", e["store"], "--cache-timeout", "-1"],
        2, ("cache-timeout", "-1")),
    "mount_endless_cache_timeout": (
        lambda e: ["mount", e["dir"], "--store", e["store"], "--cache-timeout", "1e20"],
        2, ("cache-timeout",)),
    "umount_not_mounted": (
        lambda e: ["umount", e["dir"]], 1, ("adir",)),
    "umount_missing_dir": (
        lambda e: ["umount", e["tmp"] / "nomp"], 1, ("nomp",)),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_error_is_one_line(dlfs_cli, env, case):
    build, code, mentions = ERROR_CASES[case]
    if case == "populate_store_under_a_file":  # make sure this really fails, even as root
        with pytest.raises(NotADirectoryError):
            os.mkdir(env["file"] / "store")
    assert_one_line_error(dlfs_cli(*build(env)), code, mentions)


@pytest.mark.parametrize("name", ["a/b", ".hidden", "-dash", "x" * 129, "has space", "ü", "",
                                  "x\n"])
def test_bad_dataset_name_is_one_line(dlfs_cli, env, name):
    result = dlfs_cli("populate", env["src"], "--store", env["store"], f"--name={name}")
    assert_one_line_error(result, 2, ("name",))
    assert Store(env["store"]).dataset_names() == ["ds"]


@pytest.mark.parametrize("value", ["abc", "12Q"])
def test_unparsable_chunk_size_is_one_line(dlfs_cli, env, value):
    result = dlfs_cli("populate", env["src"], "--store", env["tmp"] / "s2", "--name", "x",
                      "--chunk-size", value)
    assert_one_line_error(result, 2, ("chunk-size",))


def test_populate_onto_a_full_disk_is_one_line_and_leaves_nothing(dlfs_cli, tmp_path):
    """The disk fills midway through writing chunks: one line, and neither a dataset nor
    a temporary directory is left taking the space."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}.bin").write_bytes(os.urandom(256 << 10))  # 2 MiB in all
    with tmpfs_at(tmp_path / "small", "size=512k") as store:
        result = dlfs_cli("populate", src, "--store", store, "--name", "x",
                          "--chunk-size", "256K")
        assert_one_line_error(result, 1, ("store is full", str(store)))
        assert os.listdir(store) == []


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory on a read-only tmpfs: unwritable even for root."""
    with tmpfs_at(tmp_path / "ro", "ro,size=1m") as path:
        yield path


@pytest.mark.parametrize("sub", [None, "sub"])
def test_populate_into_read_only_store_is_one_line(dlfs_cli, env, readonly_dir, sub):
    store = readonly_dir / sub if sub else readonly_dir
    with pytest.raises(OSError):  # really unwritable, even as root
        (readonly_dir / "probe").write_bytes(b"")
    result = dlfs_cli("populate", env["src"], "--store", store, "--name", "x")
    assert_one_line_error(result, 1, (str(store),))


def test_umount_of_a_non_dlfs_mount_is_one_line(dlfs_cli, readonly_dir):
    assert_one_line_error(dlfs_cli("umount", readonly_dir), 1, (str(readonly_dir),))


# -- populate --force, ls, info, rm, verify ------------------------------------------
def test_existing_name_is_kept_without_force(dlfs_cli, env, tmp_path, store_with):
    store = store_with(env["src"], "ds")
    other = tmp_path / "other"
    make_small_tree(other, files=7, seed=9, prefix="o")
    before = Store(store).open("ds").uuid
    assert dlfs_cli("populate", other, "--store", store, "--name", "ds").returncode == 1
    assert Store(store).open("ds").uuid == before
    assert sorted(os.listdir(store)) == ["ds"]


def test_force_replaces_the_dataset(dlfs_cli, env, tmp_path, store_with):
    store = store_with(env["src"], "ds")
    other = tmp_path / "other"
    make_small_tree(other, files=7, seed=9, prefix="o")
    result = dlfs_cli("populate", other, "--store", store, "--name", "ds", "--force",
                      "--chunk-size", "256K")
    assert result.returncode == 0, result.stderr
    d = Store(store).open("ds")
    assert d.stats["files"] == len(regular_files(describe_tree(other)))
    assert d.directory.resolve(b"d0/o000.bin") >= 0
    assert d.directory.resolve(b"d0/f000.bin") == -1
    assert sorted(os.listdir(store)) == ["ds"], "no .tmp-/.old- leftovers"
    assert dlfs_cli("verify", "--store", store, "ds").returncode == 0


def _table(stdout: str) -> list[dict[str, str]]:
    """Parse `dlfs ls` output by the header's column positions."""
    lines = stdout.splitlines()
    header = lines[0]
    names = header.split()
    starts = [header.index(n) for n in names]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [{n: line[a:b].strip() for n, (a, b) in zip(names, bounds, strict=True)}
            for line in lines[1:]]


@pytest.fixture
def two_dataset_store(tmp_path, store_with):
    store = tmp_path / "store"
    sources = {}
    for i, (name, files) in enumerate((("alpha", 25), ("beta", 60))):
        sources[name] = tmp_path / name
        make_small_tree(sources[name], files=files, seed=i, prefix=name)
        store_with(sources[name], name, "64K", store)
    return store, sources


def test_ls_lists_name_files_bytes_chunks(dlfs_cli, two_dataset_store):
    store, sources = two_dataset_store
    result = dlfs_cli("ls", "--store", store)
    assert result.returncode == 0 and result.stderr == ""
    rows = _table(result.stdout)
    assert [r["NAME"] for r in rows] == sorted(sources)
    for row in rows:
        nodes = describe_tree(sources[row["NAME"]])
        assert row["FILES"] == str(len(regular_files(nodes)))
        assert row["BYTES"] == format_size(file_bytes(nodes))
        assert row["CHUNKS"] == str(len(os.listdir(store / row["NAME"] / "chunks")))
        assert int(row["CHUNKS"]) > 1  # 64K chunks: the sources need several


def test_ls_of_empty_store_lists_nothing(dlfs_cli, tmp_path):
    result = dlfs_cli("ls", "--store", tmp_path)
    assert result.returncode == 0
    assert result.stdout == ""


def test_ls_hides_unfinished_populates(dlfs_cli, two_dataset_store):
    store, _ = two_dataset_store
    (store / ".tmp-gamma.host.1.abc" / "chunks").mkdir(parents=True)
    (store / "not-a-dataset").mkdir()
    # A copy made by hand has a manifest but no valid dataset name: not a dataset.
    shutil.copytree(store / "alpha", store / "alpha copy")
    result = dlfs_cli("ls", "--store", store)
    assert result.returncode == 0, result.stderr
    assert [r["NAME"] for r in _table(result.stdout)] == ["alpha", "beta"]


def test_rm_of_a_linked_dataset_removes_only_the_link(dlfs_cli, two_dataset_store, tmp_path):
    store, _ = two_dataset_store
    other = tmp_path / "other-store"
    other.mkdir()
    (other / "alpha").symlink_to(store / "alpha")
    assert [r["NAME"] for r in _table(dlfs_cli("ls", "--store", other).stdout)] == ["alpha"]
    result = dlfs_cli("rm", "--store", other, "alpha")
    assert result.returncode == 0, result.stderr
    assert os.listdir(other) == []
    assert dlfs_cli("verify", "--store", store, "alpha").returncode == 0


def test_store_path_that_is_not_utf8_prints_on_utf8_stdout(dlfs_cli, env, tmp_path):
    store = os.fsdecode(bytes(tmp_path) + b"/st\xff")
    utf8 = {"PYTHONIOENCODING": "utf-8"}  # what a UTF-8 locale gives Python: a strict stdout
    for argv in (("populate", env["src"], "--store", store, "--name", "a"),
                 ("info", "--store", store, "a"), ("rm", "--store", store, "a")):
        result = dlfs_cli(*argv, env=utf8)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert "st\\udcff" in result.stdout, result.stdout
    assert os.listdir(store) == []


def test_verify_names_a_chunk_whose_header_length_is_wrong(dlfs_cli, env, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(env["store"], store)
    chunk = store / "ds" / "chunks" / "00000000.chunk"
    with open(chunk, "r+b") as f:  # header bytes 16-23: the data length (docs/FORMAT.md)
        f.seek(16)
        f.write((999_999).to_bytes(8, "little"))
    result = dlfs_cli("verify", "--store", store, "ds")
    assert result.returncode == 3, result
    assert "chunk 0: header records 999999 data bytes" in result.stdout + result.stderr


def test_rm_removes_only_that_dataset(dlfs_cli, two_dataset_store):
    store, _ = two_dataset_store
    result = dlfs_cli("rm", "--store", store, "alpha")
    assert result.returncode == 0, result.stderr
    assert [r["NAME"] for r in _table(dlfs_cli("ls", "--store", store).stdout)] == ["beta"]
    assert sorted(os.listdir(store)) == ["beta"]
    assert dlfs_cli("verify", "--store", store, "beta").returncode == 0
    assert_one_line_error(dlfs_cli("info", "--store", store, "alpha"), 1, ("alpha",))


def test_rm_interrupted_midway_names_what_is_left(monkeypatch, capsys, two_dataset_store):
    """Ctrl-C while `dlfs rm` deletes (minutes for many chunks on a PFS): the dataset is
    already unpublished, so the one line says so and names the half-deleted directory
    (which is hidden from `ls`); before, it said only "interrupted"."""
    from dlfs.cli import main as cli
    store, _ = two_dataset_store
    real_rmtree = shutil.rmtree

    def rmtree_then_ctrl_c(path, *args, **kwargs):
        real_rmtree(Path(path) / "chunks")  # part of the work done, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", rmtree_then_ctrl_c)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        assert cli.main(["rm", "--store", str(store), "alpha"]) == 130
    finally:
        monkeypatch.undo()
        for sig, handler in handlers.items():  # main() installs its own
            signal.signal(sig, handler)
    err = capsys.readouterr().err.strip()
    leftovers = [p for p in store.iterdir() if p.name.startswith(".rm-alpha.")]
    assert len(leftovers) == 1 and leftovers[0].is_dir()
    assert err.count("\n") == 0 and str(leftovers[0]) in err, err
    assert "removed from the store" in err and "partly deleted" in err, err
    assert sorted(Store(store).dataset_names()) == ["beta"]


def test_info_counts_match_the_source(dlfs_cli, edge_store, edge_nodes, edge_tree):
    result = dlfs_cli("info", "--store", edge_store, "edge")
    assert result.returncode == 0, result.stderr
    info = dict(re.split(r":\s+", line, maxsplit=1) for line in result.stdout.splitlines())
    kinds = [stat.S_IFMT(n.mode) for rel, n in edge_nodes.items() if rel]
    assert info["files"] == str(kinds.count(stat.S_IFREG))
    assert info["directories"] == str(kinds.count(stat.S_IFDIR) + 1)  # + the dataset root
    assert info["symlinks"] == str(kinds.count(stat.S_IFLNK))
    assert info["bytes"].split()[0] == str(file_bytes(edge_nodes))
    assert info["skipped specials"] == str(len(edge_tree.specials))


def test_verify_of_a_good_dataset_exits_0(dlfs_cli, edge_store):
    result = dlfs_cli("verify", "--store", edge_store, "edge")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "corrupt" not in result.stdout and result.stderr == ""


def test_fifo_is_skipped_with_one_warning(dlfs_cli, edge_tree, tmp_path):
    store = tmp_path / "store"
    result = dlfs_cli("populate", edge_tree.root, "--store", store, "--name", "edge",
                      "--chunk-size", "256K", "--no-fsync")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1, result.stderr
    assert all(os.fsdecode(rel) in warnings[0] for rel in edge_tree.specials)
    d = Store(store).open("edge")
    for rel in edge_tree.specials:
        assert d.directory.resolve(rel) == -1
    assert d.directory.resolve(b"specials/regular_next_to_fifo") >= 0
    assert d.stats["skipped"] == len(edge_tree.specials)


def test_populate_reports_what_it_published(dlfs_cli, env, tmp_path):
    result = dlfs_cli("populate", env["src"], "--store", tmp_path / "s3", "--name", "p")
    assert result.returncode == 0 and result.stderr == ""
    count = len(regular_files(describe_tree(env["src"])))
    assert re.search(rf"\bp\b.*\b{count} files\b", result.stdout), result.stdout


# -- help ------------------------------------------------------------------------------
def _assert_exit_table(text: str) -> None:
    after = text.split("exit codes:", 1)
    assert len(after) == 2, "no exit-code table"
    table = {}
    for line in after[1].splitlines():
        m = re.match(r"\s+(\d+)\s+(.+)", line)
        if m:
            table[m.group(1)] = m.group(2).lower()
    for code, word in EXIT_TABLE.items():
        assert word in table.get(code, ""), f"exit code {code} ({word}) missing: {table}"


def test_main_help_lists_every_subcommand(dlfs_cli):
    result = dlfs_cli("--help")
    assert result.returncode == 0
    for sub in SUBCOMMANDS:
        assert re.search(rf"^\s+{sub}\s", result.stdout, re.M), sub
    _assert_exit_table(result.stdout)


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_help_has_examples_and_exit_codes(dlfs_cli, sub):
    result = dlfs_cli(sub, "--help")
    assert result.returncode == 0 and result.stderr == ""
    assert re.search(r"^examples?:", result.stdout, re.M), result.stdout
    assert re.search(rf"^\s+dlfs {sub} \S", result.stdout, re.M), "no runnable example"
    _assert_exit_table(result.stdout)


def test_help_examples_parse(dlfs_cli):
    """Every `dlfs ...` example line in the help texts uses flags the parser accepts."""
    from dlfs.cli.main import build_parser

    parser = build_parser()
    examples = set()
    for sub in SUBCOMMANDS:
        for line in dlfs_cli(sub, "--help").stdout.splitlines():
            if line.strip().startswith("dlfs "):
                examples.add(line.strip())
    assert len(examples) >= len(SUBCOMMANDS)
    for example in sorted(examples):
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            try:
                parser.parse_args(example.split()[1:])
            except SystemExit as exit_:
                pytest.fail(f"help example does not parse: {example} ({exit_.code})")


def test_runtime_directory_someone_else_made_is_refused(tmp_path):
    """/tmp/dlfs-UID can be made first by anyone: records name pids `dlfs umount`
    signals, so a directory not ours (or a symlink) is refused, and ours made private."""
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 65534, 65534)
    with pytest.raises(DlfsError, match="not a directory of yours"):
        runtime._check_private(other)
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chmod(mine, 0o777)
    runtime._check_private(mine)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    (tmp_path / "link").symlink_to(mine)
    with pytest.raises(DlfsError, match="not a directory of yours"):
        runtime._check_private(tmp_path / "link")


def test_ls_lists_the_other_datasets_when_one_manifest_is_damaged(dlfs_cli, two_dataset_store):
    store, _ = two_dataset_store
    (store / "alpha" / "manifest.dlfs").write_bytes(b"garbage, not a manifest")
    result = dlfs_cli("ls", "--store", store)
    assert result.returncode == 1
    assert [r["NAME"] for r in _table(result.stdout)] == ["beta"]
    line = assert_one_line_error(result)
    assert "alpha" in line


def test_verify_of_a_damaged_manifest_exits_corrupt(dlfs_cli, two_dataset_store):
    store, _ = two_dataset_store
    (store / "alpha" / "manifest.dlfs").write_bytes(b"garbage, not a manifest")
    assert_one_line_error(dlfs_cli("verify", "--store", store, "alpha"), 3,
                          ("manifest",))


def test_rm_and_populate_agree_on_a_directory_that_is_no_dataset(dlfs_cli, env, tmp_path):
    store = tmp_path / "store"
    (store / "half").mkdir(parents=True)
    for argv in (("rm", "--store", store, "half"),
                 ("populate", env["src"], "--store", store, "--name", "half", "--force")):
        assert_one_line_error(dlfs_cli(*argv), 1, ("not a DLFS dataset",))
    assert os.listdir(store) == ["half"]


def test_demo_runs_and_leaves_the_workdir_as_it_found_it(dlfs_cli, tmp_path, sysproc):
    """The README's first command, small: it packs, mounts, reads, compares, unmounts,
    and removes only what it made (the work directory may hold the user's files)."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "mine.txt").write_text("not the demo's")
    result = dlfs_cli("demo", "--files", "300", "--workers", "2", "--workdir", workdir,
                      timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical" in result.stdout and "files/s" in result.stdout
    assert sorted(os.listdir(workdir)) == ["mine.txt"]
    assert (workdir / "mine.txt").read_text() == "not the demo's"
    assert str(workdir) not in Path("/proc/mounts").read_text()


def test_a_ctrl_c_just_as_the_demo_mount_returns_still_unmounts(monkeypatch, tmp_path,
                                                                sysproc):
    """Ctrl-C can land between `mount()` returning and the demo noting that it did: the
    demo must still unmount (it asks the kernel what is mounted) and remove its work."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    mounted_at: list[Path] = []
    real_mount = demo.mount

    def mount_then_interrupt(config, foreground):
        real_mount(config, foreground=foreground)
        mounted_at.append(Path(config.mountpoint))
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "mount", mount_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            demo.run_demo(files=50, mean_size=2000, workers=1, workdir=workdir, keep=False)
        assert len(mounted_at) == 1, "the demo never got to mount"
        assert sysproc.fstype_at(mounted_at[0]) is None
        assert sysproc.daemon_pids_for(mounted_at[0]) == []
        assert os.listdir(workdir) == []
    finally:
        for mountpoint in mounted_at:
            force_unmount(mountpoint)


@pytest.mark.parametrize("argv", [
    ["populate", "SRC", "--store", "S", "--name", "x", "--chunk-size", "9" * 400],
    ["doctor", "--port", "70000"],
    ["stats", "M", "--watch", "--interval", "-1"],
    ["status", "M", "--watch", "--interval", "nan"],
    ["mount", "M", "--store", "S", "--peer-timeout", "0"],
    ["mount", "M", "--store", "S", "--timeout", "-5"],
    ["demo", "--mean-size", "0"],
    ["stats", "M", "--watch", "--interval", "1e10"],
    ["mount", "M", "--store", "S", "--peer-timeout", "1e10"],
    ["mount", "", "--store", "S"],
    ["populate", "SRC", "--store", "", "--name", "x"],
    ["ls", "--store", ""],
    ["mount", "M", "--store", "S", "--read-ahead-kb", "-1"],
    ["mount", "M", "--store", "S", "--uid", "4294967295"],
], ids=["huge_size", "port_out_of_range", "negative_interval", "nan_interval",
        "zero_peer_timeout", "negative_timeout", "zero_mean_size", "huge_interval",
        "huge_peer_timeout", "empty_mountpoint", "empty_store", "empty_store_ls",
        "negative_read_ahead", "uid_minus_one"])
def test_nonsense_numbers_are_one_line_usage_errors(dlfs_cli, tmp_path, argv):
    """Values that used to raise OverflowError, ValueError or 'math domain error', or
    were taken (a peer timeout of 0 sent every read to the store; an empty path meant
    the current directory: `dlfs mount "$UNSET"` covered it; uid 2**32-1 is -1)."""
    args = [str(tmp_path / a) if a in ("SRC", "S", "M") else a for a in argv]
    assert_one_line_error(dlfs_cli(*args), 2)


def test_verify_of_a_manifest_from_another_version_is_no_corruption(dlfs_cli,
                                                                    two_dataset_store):
    """Exit 3 means damaged data (scripts re-populate on it); a manifest written by
    another dlfs version is not damage: exit 1, and the line says to upgrade."""
    store, _ = two_dataset_store
    manifest = store / "alpha" / "manifest.dlfs"
    raw = bytearray(manifest.read_bytes())
    version = int.from_bytes(raw[8:12], "little")
    raw[8:12] = (version + 1).to_bytes(4, "little")
    manifest.write_bytes(raw)
    assert_one_line_error(dlfs_cli("verify", "--store", store, "alpha"), 1,
                          ("version", "upgrade dlfs"))


# -- datasets in use by a mount ---------------------------------------------------------
@pytest.fixture
def mounted_pair(tmp_path, store_with, make_mounter):
    """A store with datasets 'used' and 'spare', and a way to mount some of them."""
    src = tmp_path / "src"
    make_small_tree(src, files=5)
    store = store_with(src, "used", "256K", tmp_path / "store")
    store_with(src, "spare", "256K", store)
    mounter = make_mounter()
    try:
        yield src, store, mounter
    finally:
        mounter.cleanup()


@pytest.mark.parametrize("argv", [
    ["rm", "--store", "STORE", "used"],
    ["populate", "SRC", "--store", "STORE", "--name", "used", "--force"],
], ids=["rm", "populate_force"])
def test_a_mounted_dataset_is_neither_removed_nor_replaced(dlfs_cli, mounted_pair, argv):
    """Before, both went ahead: the mount's readers then got EIO from the workers that
    had not opened the deleted chunk files yet, and the others read the old data."""
    src, store, mounter = mounted_pair
    m = mounter(store)
    before = sorted(os.listdir(m / "used"))
    args = [str({"SRC": src, "STORE": store}.get(a, a)) for a in argv]
    line = assert_one_line_error(dlfs_cli(*args), 1, ("'used'", str(m.path), "dlfs umount"))
    assert "mounted" in line
    assert sorted(os.listdir(m / "used")) == before
    assert Store(store).open("used").chunk_count > 0
    assert dlfs_cli("umount", m.path).returncode == 0
    result = dlfs_cli(*args)
    assert result.returncode == 0, result.stderr


def test_a_dataset_the_mount_does_not_serve_can_be_removed(dlfs_cli, mounted_pair):
    _, store, mounter = mounted_pair
    mounter(store, "--dataset", "used")
    result = dlfs_cli("rm", "--store", store, "spare")
    assert result.returncode == 0, result.stderr


def test_a_dataset_published_after_an_all_datasets_mount_can_be_removed(
        dlfs_cli, mounted_pair, store_with):
    src, store, mounter = mounted_pair
    m = mounter(store)  # all datasets there now: used, spare
    store_with(src, "late", "256K", store)
    assert sorted(os.listdir(m.path)) == ["spare", "used"]
    result = dlfs_cli("rm", "--store", store, "late")
    assert result.returncode == 0, result.stderr
    assert_one_line_error(dlfs_cli("rm", "--store", store, "spare"), 1, (str(m.path),))


def test_a_dataset_mounted_through_a_link_in_another_store_counts(dlfs_cli, mounted_pair,
                                                                  tmp_path):
    """A store may link a dataset published in another one; removing the original
    pulled the files from under that mount."""
    _, store, mounter = mounted_pair
    other = tmp_path / "other-store"
    other.mkdir()
    (other / "shared").symlink_to(store / "used")
    m = mounter(other)
    assert_one_line_error(dlfs_cli("rm", "--store", store, "used"), 1, (str(m.path),))
    assert os.listdir(m / "shared")


def test_a_foreground_mount_counts_too(dlfs_cli, mounted_pair, sysproc, tmp_path):
    """A foreground mount's process is `dlfs mount`, not dlfsd: found by its status file."""
    _, store, _ = mounted_pair
    mp = tmp_path / "fg"
    mp.mkdir()
    proc = subprocess.Popen([*sysproc.dlfs_argv, "mount", str(mp), "--store", str(store),
                             "--foreground"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not status_path(str(mp)).exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        assert_one_line_error(dlfs_cli("rm", "--store", store, "used"), 1, (str(mp),))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True)


def test_a_store_inside_its_source_is_refused(dlfs_cli, tmp_path):
    """Before, the second populate packed the first one's chunk files and manifest."""
    src = tmp_path / "src"
    make_small_tree(src, files=3)
    line = assert_one_line_error(
        dlfs_cli("populate", src, "--store", src / "store", "--name", "x"), 1, (str(src),))
    assert "inside" in line
    assert not (src / "store").exists()


def test_mount_says_where_the_daemon_logs_and_status_shows_it(dlfs_cli, env, tmp_path):
    """A reader who gets EIO needs the log line naming the corrupt file: a successful mount
    names the log, and so does `dlfs status`."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    log = tmp_path / "daemon.log"
    result = dlfs_cli("mount", mp, "--store", env["store"], "--log-file", log)
    assert result.returncode == 0, result.stderr
    try:
        assert result.stdout.strip() == (f"mounted {env['store']} at {mp}; daemon log: {log}")
        status = dlfs_cli("status", mp)
        assert f"log {log}" in status.stdout.splitlines()[0], status.stdout
    finally:
        assert dlfs_cli("umount", mp).returncode == 0


def test_a_closed_output_pipe_stops_quietly(env):
    """`dlfs ls ... | head`: the reader went away. Before: "dlfs: error: Broken pipe",
    exit 1 (and for verify, exit 1 instead of its result)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before dlfs writes a byte
    try:
        # Buffered stdout, as outside this test environment (which may set
        # PYTHONUNBUFFERED): short output is then written at the end of the command.
        child_env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        proc = subprocess.run([*DLFS, "ls", "--store", str(env["store"])], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60, env=child_env)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_ls_of_a_dataset_directory_points_at_its_store(dlfs_cli, env):
    result = dlfs_cli("ls", "--store", env["store"] / "ds")
    assert result.returncode == 0
    assert f"dlfs ls --store {env['store']}" in result.stderr, result.stderr


def test_mounting_over_files_warns_that_they_are_hidden(dlfs_cli, env, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    (mp / "notes.txt").write_text("mine")
    result = dlfs_cli("mount", mp, "--store", env["store"])
    try:
        assert result.returncode == 0, result.stderr
        assert f"mountpoint {mp} is not empty" in result.stderr
    finally:
        assert dlfs_cli("umount", mp).returncode == 0
    assert (mp / "notes.txt").read_text() == "mine"


def test_a_pool_refuses_two_copies_of_one_dataset(dlfs_cli, env, tmp_path):
    """Copies share a uuid, by which a chunk pool keys its staged copies."""
    store = tmp_path / "store"
    shutil.copytree(env["store"], store, symlinks=True)
    shutil.copytree(store / "ds", store / "ds-copy", symlinks=True)
    mp = tmp_path / "mnt"
    mp.mkdir()
    assert_one_line_error(
        dlfs_cli("mount", mp, "--store", store, "--cache-dir", tmp_path / "cache"), 1,
        ("ds-copy", "same uuid", "--dataset"))
    assert dlfs_cli("umount", mp).returncode != 0  # nothing was mounted
