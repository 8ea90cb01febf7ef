"""The core imports without libfuse: populate must run on login nodes and MPI ranks."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import dlfs

CORE_MODULES = sorted(m.name for m in pkgutil.walk_packages(dlfs.__path__, "dlfs."))
# Everything in the daemon but the FUSE adapter and the lifecycle: storage,
# placement and protocol code never import pyfuse3.
PURE_DAEMON_MODULES = ["dlfsd.namespace", "dlfsd.reader", "dlfsd.pool.peer", "dlfsd.pool.pool",
                       "dlfsd.pool.stager", "dlfsd.pool.chunkcache", "dlfsd.obs.stats",
                       "dlfsd.obs.status",
                       "dlfsd.throttle", "dlfsd.pool.peersync", "dlfsd.pool.peerserver",
                       "dlfsd.fuse.splicer"]


def test_core_and_daemon_internals_import_without_pyfuse3():
    modules = CORE_MODULES + PURE_DAEMON_MODULES
    code = ("import sys; sys.modules['pyfuse3'] = None\n"
            + "".join(f"import {m}\n" for m in modules)
            + "assert 'pyfuse3' not in {k for k, v in sys.modules.items() if v is not None}\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "dlfs.cli.main" in CORE_MODULES and "dlfs.store.populate" in CORE_MODULES
