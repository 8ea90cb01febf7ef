"""docs/ARCHITECTURE.md's module map names every module of the two packages, and no
module that is gone: a newcomer reads the map first, and a map that misses modules
(four were missing when issue 31 looked) sends them to the wrong file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "dlfs")
ENTRY = re.compile(r"^( *)(\S+?)(/?)\s{2,}|^( *)(\S+?)(/?)$")


def mapped_paths() -> set[str]:
    """The files and folders the map's tree names, as paths from the repository root."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## Modules", 1)[1].split("```", 2)[1]
    found, stack = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        match = ENTRY.match(line)
        if match is None or line.startswith(" " * 28):  # a description's second line
            continue
        indent, name, slash = (match.group(1), match.group(2), match.group(3)) \
            if match.group(2) else (match.group(4), match.group(5), match.group(6))
        depth = len(indent) // 2
        del stack[depth:]
        path = "/".join([*stack, name])
        found.add(path + slash)
        if slash:
            stack.append(name)
    return found


def package_modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if "__pycache__" not in p.parts}


def test_the_module_map_names_every_module_and_no_gone_one():
    mapped = {p for p in mapped_paths() if p.endswith(".py")}
    modules = package_modules()
    assert not modules - mapped, f"missing from ARCHITECTURE.md's map: {sorted(modules - mapped)}"
    assert not mapped - modules, f"in the map but not in the tree: {sorted(mapped - modules)}"


def test_the_map_reader_sees_the_folders_it_nests_in():
    """The map's parser itself: it must find nested modules, or the test above passes
    on any map."""
    mapped = mapped_paths()
    assert {"daemon/", "daemon/ckpt/", "dlfs/store/"} <= mapped
    assert {"daemon/ckpt/tier.py", "dlfs/store/format.py", "daemon/main.py"} <= mapped
