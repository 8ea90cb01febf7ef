"""The core imports without libfuse: populate must run on login nodes and MPI ranks."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import dlfs

CORE_MODULES = sorted(f"dlfs.{m.name}" for m in pkgutil.iter_modules(dlfs.__path__))
# Everything in the daemon but the FUSE adapter and the lifecycle: storage,
# placement and protocol code never import pyfuse3.
PURE_DAEMON_MODULES = ["dlfsd.namespace", "dlfsd.reader", "dlfsd.peer", "dlfsd.pool",
                       "dlfsd.stager", "dlfsd.chunkcache", "dlfsd.stats", "dlfsd.status",
                       "dlfsd.throttle", "dlfsd.peersync", "dlfsd.peerserver",
                       "dlfsd.splicer"]


def test_core_and_daemon_internals_import_without_pyfuse3():
    modules = CORE_MODULES + PURE_DAEMON_MODULES
    code = ("import sys; sys.modules['pyfuse3'] = None\n"
            + "".join(f"import {m}\n" for m in modules)
            + "assert 'pyfuse3' not in {k for k, v in sys.modules.items() if v is not None}\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "dlfs.cli" in CORE_MODULES and "dlfs.populate" in CORE_MODULES
