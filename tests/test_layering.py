"""The layers, enforced: imports only point down, no module cycle, libfuse only where needed.

Every module of the tree has a layer (LAYERS, lowest first). A module may import
modules of its own layer or below, never above, and the module import graph has
no cycle, whether an import is at the top of a file or inside a function: a
lazy import still ties the two modules together. A new module that no layer
claims fails the test until it is given one; docs/ARCHITECTURE.md draws the
same picture.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"dlfs": ROOT / "dlfs", "dlfsd": ROOT / "daemon"}

# Lowest first. A module belongs to the longest prefix that names it.
LAYERS: list[tuple[str, list[str]]] = [
    ("basics", ["dlfs"]),  # errors, sizes, signals, mountinfo, launch contract, pipes...
    ("store", ["dlfs.store"]),  # on-disk datasets; which mounts use them
    ("job", ["dlfs.config", "dlfs.cluster"]),  # a mount's settings, its nodes
    ("readers", ["dlfs.obs"]),  # renders what daemons report (the daemon reuses the renderers)
    # epoch order for training jobs: the sampler, its plans, its client to the daemon
    ("training order", ["dlfs.order", "dlfs.sampler", "dlfs.orderclient"]),
    ("demo data", ["dlfs.demo"]),  # generated datasets and an epoch reader: demo, tests, benchmarks
    ("daemon basics", ["dlfsd", "dlfsd.base"]),
    ("daemon observability", ["dlfsd.obs"]),
    ("chunk pool", ["dlfsd.pool"]),
    # the read core: namespace, reader, where an extent's bytes come from, look-ahead
    ("read core", ["dlfsd.core"]),
    # the writable checkpoint subtree: a passthrough onto the node cache, and its drain
    ("checkpoint tier", ["dlfsd.ckpt"]),
    ("fuse adapters", ["dlfsd.fuse"]),
    # The main process above the workers it forks: watching them and the stop signals,
    # the launcher's commit, the services it runs; the checkpoint connection's start-up
    # (it mounts with dlfsd.fuse.rawsession and forks dlfsd.fuse.ckptworker).
    ("main process", ["dlfsd.supervise", "dlfsd.commit", "dlfsd.services",
                      "dlfsd.ckptconnect"]),
    # Each part of the daemon built from its own settings (reads MountConfig)
    ("assembly", ["dlfsd.assemble"]),
    ("daemon lifecycle", ["dlfsd.main", "dlfsd.__main__"]),
    # The command line: shared helpers, then the command families (any other
    # dlfs.cli module, so a new family <name>_cmds.py needs no entry here), then
    # the shell that registers them.
    ("command line helpers", ["dlfs.cli.common", "dlfs.cli.mountctl", "dlfs.cli.doctor",
                              "dlfs.cli.demo"]),
    ("command families", ["dlfs.cli"]),
    ("command line shell", ["dlfs.cli.main"]),
]
# The launcher sits above the daemon it launches, but it starts it as a process
# (dlfs.launch); the one import across is `mount --foreground` becoming the daemon.
LAUNCHER_MAY_IMPORT = {("dlfs.cli.mountctl", "dlfsd.main"),
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


def layer_of(module: str) -> int:
    best, rank = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank is not None, f"{module} belongs to no layer: add it to LAYERS"
    return rank


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


def test_every_module_has_a_layer():
    for module in all_modules():
        layer_of(module)


def test_imports_only_point_down():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in import_graph().items() for t in sorted(targets)
              if layer_of(t) > layer_of(m)]
    assert upward == []


def test_the_daemon_never_imports_the_command_line_and_it_imports_the_daemon_once():
    graph = import_graph()
    across = {(m, t) for m, targets in graph.items() for t in targets
              if m.split(".")[0] == "dlfs" and t.split(".")[0] == "dlfsd"}
    assert across == LAUNCHER_MAY_IMPORT


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target):], target] if target in path else [target]
            if target not in state:
                cycle = visit(target, [*path, target])
                if cycle:
                    return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            assert cycle is None, " -> ".join(cycle)


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    """The rules above must be able to fail: a core module that imports the CLI is
    reported, and so is a pair that imports each other."""
    fake = tmp_path / "dlfs"
    (fake / "store").mkdir(parents=True)
    (fake / "cli").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "store" / "__init__.py").write_text("")
    (fake / "cli" / "__init__.py").write_text("")
    (fake / "store" / "a.py").write_text("from dlfs.cli import b\n")
    (fake / "cli" / "b.py").write_text("def f():\n    import dlfs.store.a\n")
    monkeypatch.setitem(PACKAGES, "dlfs", fake)
    monkeypatch.setitem(PACKAGES, "dlfsd", tmp_path / "nothing")
    graph = import_graph()
    assert graph["dlfs.store.a"] == {"dlfs.cli.b"}
    assert graph["dlfs.cli.b"] == {"dlfs.store.a"}
    assert layer_of("dlfs.cli.b") > layer_of("dlfs.store.a")


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
