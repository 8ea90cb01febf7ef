"""The layers, enforced: a folder is a layer, imports only point down, no cycle.

Every folder of the two packages is a layer (FOLDERS, lowest first), and the
modules at a package's top are the layer of that package's folder: dlfs/'s are
the basics every part uses, daemon/'s the daemon's start-up, above every part
it starts. A module may import modules of its own folder or of a folder below,
never above, whether the import is at the top of a file or inside a function (a
lazy import still ties the two together); there is no cycle between folders,
nor between modules. A new folder fails the test until FOLDERS places it;
docs/ARCHITECTURE.md draws the same picture.

The one kind of module that sits outside its folder's layer: a public name kept
for users (PUBLIC_REEXPORTS), which only re-exports the module it names and
counts as part of that module's folder.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"dlfs": ROOT / "dlfs", "dlfsd": ROOT / "daemon"}

# Lowest first: each folder (as its package's dotted name) may import only itself and
# the folders before it.
FOLDERS: list[str] = [
    "dlfs",  # the basics: errors, sizes, signals, config, launch contract, runtime dir, /proc
    "dlfs.store",  # a dataset on disk: format, populate, open, verify; which mounts use one
    "dlfs.cluster",  # a job's nodes, chunk placement, Slurm and MPI glue
    "dlfs.obs",  # renders what daemons report (the daemon reuses the renderers)
    "dlfs.order",  # epoch order for training jobs: the sampler, its plans, its socket client
    "dlfs.demo",  # generated datasets and an epoch reader: `dlfs demo`, tests, benchmarks
    "dlfsd.base",  # the daemon's basics: process slots, pacing, kernel facts, lineage, access
    "dlfsd.obs",  # what the daemon reports: counters, trace, status, `.dlfs/`
    "dlfsd.pool",  # the chunk pool: staged copies, stager, peers; `dlfs warmup`'s engine
    "dlfsd.core",  # the read core: namespace, reader, extent sources, look-ahead; its values
    "dlfsd.ckpt",  # the writable checkpoint tier and its drain
    "dlfsd.fuse",  # FUSE adapters: both connections' workers, the wire, INIT
    # The daemon's start-up: parse, assemble the parts, mount both connections, fork
    # and watch the workers, run the services, the launcher's commit.
    "dlfsd",
    "dlfs.cli",  # the `dlfs` command (it starts the daemon as a process: dlfs.launch)
]
# Public names users import (README, docs/ORDER.md), kept where they always were; each
# only re-exports the module it names and counts as part of that module's folder.
PUBLIC_REEXPORTS = {"dlfs.sampler": "dlfs.order.sampler",
                    "dlfs.orderclient": "dlfs.order.client"}
# The command line sits above the daemon, but it starts it as a process (dlfs.launch);
# these are its only imports of the daemon's code.
LAUNCHER_MAY_IMPORT = {("dlfs.cli.mountctl", "dlfsd.main"),  # `mount --foreground`
                       # `dlfs warmup` runs the daemon's stager in the foreground, no mount
                       ("dlfs.cli.warmup_cmds", "dlfsd.pool.warmup"),
                       # `dlfs ckpt-audit` reads a checkpoint tier's ledger (the Slurm
                       # epilog asks it before deleting a tier), no mount, no daemon
                       ("dlfs.cli.ckpt_cmds", "dlfsd.ckpt.audit")}


def _module_name(package: str, path: Path) -> str:
    parts = path.relative_to(PACKAGES[package]).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


def all_modules() -> dict[str, Path]:
    return {_module_name(pkg, p): p for pkg, root in PACKAGES.items()
            for p in sorted(root.rglob("*.py"))}


def folder_of(module: str, modules: dict[str, Path] | None = None) -> str:
    """The folder (as a dotted package name) whose layer `module` is in."""
    modules = all_modules() if modules is None else modules
    if module in PUBLIC_REEXPORTS:
        return folder_of(PUBLIC_REEXPORTS[module], modules)
    return module if modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def rank_of(folder: str) -> int:
    assert folder in FOLDERS, f"folder {folder} is no layer: place it in FOLDERS"
    return FOLDERS.index(folder)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports, anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` imports the module pkg.mod, else a name of pkg
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                     else node.module for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES and n != module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def folder_graph(graph: dict[str, set[str]], modules: dict[str, Path]) -> dict[str, set[str]]:
    """Folder -> the other folders its modules import."""
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = folder_of(module, modules)
        folders.setdefault(mine, set()).update(
            f for f in (folder_of(t, modules) for t in targets) if f != mine)
    return folders


def upward_imports(graph: dict[str, set[str]], modules: dict[str, Path]) -> list[str]:
    return [f"{m} ({folder_of(m, modules)}) imports {t} ({folder_of(t, modules)})"
            for m, targets in sorted(graph.items()) for t in sorted(targets)
            if rank_of(folder_of(t, modules)) > rank_of(folder_of(m, modules))]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (node -> nodes it points to), None if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target):], target] if target in path else [target]
            if target not in state:
                cycle = visit(target, [*path, target])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def reexport_extras(module: str, path: Path) -> list[str]:
    """What public re-export `module` holds besides its docstring, imports from the
    module it names, and __all__."""
    target = PUBLIC_REEXPORTS[module]
    extras = []
    for i, node in enumerate(ast.parse(path.read_text(), str(path)).body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and node.module in (target, "__future__"):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] \
                == ["__all__"]:
            continue
        extras.append(f"{module}:{node.lineno}: {ast.unparse(node)[:60]}")
    return extras


def test_every_folder_is_a_layer():
    modules = all_modules()
    folders = {folder_of(m, modules) for m in modules}
    assert sorted(folders - set(FOLDERS)) == [], "place these folders in FOLDERS"
    assert sorted(set(FOLDERS) - folders) == [], "FOLDERS names folders that are gone"


def test_imports_only_point_down():
    assert upward_imports(import_graph(), all_modules()) == []


def test_no_cycle_between_folders():
    """Independent of FOLDERS' order: the folders' own import graph has no cycle."""
    cycle = find_cycle(folder_graph(import_graph(), all_modules()))
    assert cycle is None, " -> ".join(cycle)


def test_public_reexports_only_reexport():
    modules = all_modules()
    for module, target in PUBLIC_REEXPORTS.items():
        assert target in modules
        assert reexport_extras(module, modules[module]) == []


def test_the_daemon_never_imports_the_command_line_and_it_imports_the_daemon_once():
    graph = import_graph()
    across = {(m, t) for m, targets in graph.items() for t in targets
              if m.split(".")[0] == "dlfs" and t.split(".")[0] == "dlfsd"}
    assert across == LAUNCHER_MAY_IMPORT


def test_no_import_cycle():
    """Nor between modules (within a folder too)."""
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_checker_sees_upward_imports_cycles_and_unplaced_folders(tmp_path, monkeypatch):
    """The rules above must be able to fail: a store module that imports the CLI is
    reported, so is a module at dlfs/'s top (the basics) importing the store, a pair of
    folders that import each other (whatever FOLDERS says), a folder FOLDERS does not
    place, and a public re-export that grew code of its own."""
    fake = tmp_path / "dlfs"
    for folder in ("store", "cli", "order", "extra"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "store" / "a.py").write_text("from dlfs.cli import b\n")
    (fake / "cli" / "b.py").write_text("def f():\n    import dlfs.store.a\n")
    (fake / "basic.py").write_text("from dlfs.store import a\n")
    (fake / "order" / "impl.py").write_text("X = 1\n")
    (fake / "pub.py").write_text('"""Doc."""\nfrom dlfs.order.impl import X\nY = 2\n')
    monkeypatch.setitem(PACKAGES, "dlfs", fake)
    monkeypatch.setitem(PACKAGES, "dlfsd", tmp_path / "nothing")
    monkeypatch.setattr(sys.modules[__name__], "FOLDERS", ["dlfs", "dlfs.store", "dlfs.order",
                                                           "dlfs.cli"])
    monkeypatch.setitem(PUBLIC_REEXPORTS, "dlfs.pub", "dlfs.order.impl")
    modules = all_modules()
    graph = {m: g for m, g in import_graph().items() if not m.startswith("dlfs.extra")}
    assert graph["dlfs.store.a"] == {"dlfs.cli.b"}
    assert graph["dlfs.cli.b"] == {"dlfs.store.a"}
    assert folder_of("dlfs.basic", modules) == "dlfs"
    assert folder_of("dlfs.store", modules) == "dlfs.store"  # its __init__: the folder's
    assert folder_of("dlfs.pub", modules) == "dlfs.order"
    assert upward_imports(graph, modules) == [
        "dlfs.basic (dlfs) imports dlfs.store.a (dlfs.store)",
        "dlfs.store.a (dlfs.store) imports dlfs.cli.b (dlfs.cli)"]
    cycle = find_cycle(folder_graph(graph, modules))
    assert cycle is not None and set(cycle) == {"dlfs.cli", "dlfs.store"}
    assert reexport_extras("dlfs.pub", modules["dlfs.pub"]) == ["dlfs.pub:3: Y = 2"]
    with pytest.raises(AssertionError, match=r"dlfs\.extra is no layer"):
        rank_of(folder_of("dlfs.extra", modules))


def test_nothing_imports_pyfuse3():
    """Populate runs on login nodes and MPI ranks, the CLI starts without the daemon's
    libraries, and the daemon mounts and answers INIT itself (dlfsd.fuse.rawsession):
    no module needs pyfuse3 (libfuse) any more (dlfsd.__main__ runs the daemon when
    imported; it imports dlfsd.main, which is checked)."""
    modules = [m for m in all_modules() if m != "dlfsd.__main__"]
    assert "dlfsd.main" in modules and "dlfsd.fuse.session" in modules
    code = ("import sys; sys.modules['pyfuse3'] = None\n"
            + "".join(f"import {m}\n" for m in sorted(modules))
            + "assert 'pyfuse3' not in {k for k, v in sys.modules.items() if v is not None}\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "dlfs.cli.main" in modules and "dlfs.store.populate" in modules
