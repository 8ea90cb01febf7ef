"""Checkpoints with real PyTorch into MOUNTPOINT/ckpt/: torch.save of a model, and
torch.distributed.checkpoint from 3 ranks (gloo, CPU, a DTensor sharded over them);
after `dlfs flush` the store's files are byte-identical to what the ranks wrote and
load back (the sharded one into a plain tensor, in one process).

torch is not a dependency of DLFS: these tests skip without it (see
tests/test_sampler_torch.py); DLFS_TORCH_TESTS=1 ./deploy/dev.sh test runs them.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import run_dlfs

if os.environ.get("DLFS_TORCH_TESTS") == "1":
    import torch  # opted in: a missing torch is a failure, not a skip
else:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed; DLFS_TORCH_TESTS=1 ./deploy/dev.sh test "
                        "installs torch==2.13.0 and runs these")

pytestmark = pytest.mark.usefixtures("daemon_guard")

RANKS = 3

DCP_SAVE = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(1)
    full = torch.randn(3000, 257)
    model = torch.nn.Linear(257, 33)
    state = {"weights": distribute_tensor(full, mesh, [Shard(0)]),
             "model": model.state_dict(), "step": torch.tensor(42)}
    dcp.save(state, checkpoint_id=sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()
    # Saved and agreed on: leave without the interpreter's teardown, where gloo's
    # threads once aborted a rank (SIGABRT, "terminate called without an active
    # exception") after all of this had succeeded; what it wrote is checked below.
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_with):
    src = tmp_path_factory.mktemp("ckpt-torch-src")
    (src / "f").write_bytes(b"sample")
    return store_with(src, "ds", "64K")


def digests(top) -> dict[str, str]:
    """relative path -> sha256 of every file under `top`, a store's checksums aside."""
    found = {}
    for directory, dirs, names in os.walk(top):
        if os.fspath(directory) == os.fspath(top):
            dirs[:] = [d for d in dirs if d != ".dlfs-sums"]
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, top)] = hashlib.sha256(f.read()).hexdigest()
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_save_and_three_rank_dcp_reach_the_store_byte_identical_and_load_back(
        mounted, small_store, tmp_path):
    store = tmp_path / "ckstore"
    m = mounted(small_store, "--cache-dir", str(tmp_path / "cache"), "--ckpt-store",
                str(store))
    ckpt = m.path / "ckpt"

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    torch.save(model.state_dict(), ckpt / "model.pt")

    script = tmp_path / "dcp_save.py"
    script.write_text(DCP_SAVE)
    port = str(free_port())
    ranks = []
    for rank in range(RANKS):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen([sys.executable, str(script), str(ckpt / "step-42")],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for proc in ranks:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    shards = [n for n in os.listdir(ckpt / "step-42") if n.endswith(".distcp")]
    assert len(shards) == RANKS, os.listdir(ckpt / "step-42")

    result = run_dlfs("flush", m.path, timeout=300)
    assert result.returncode == 0, result.stderr
    local = digests(ckpt)
    assert digests(store) == local
    assert {"model.pt", "step-42/.metadata"} <= set(local)

    loaded = torch.load(store / "model.pt", weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key

    import torch.distributed.checkpoint as dcp

    torch.manual_seed(1)
    full = torch.randn(3000, 257)
    target = {"weights": torch.zeros(3000, 257),
              "model": torch.nn.Linear(257, 33).state_dict(), "step": torch.tensor(0)}
    dcp.load(target, checkpoint_id=str(store / "step-42"))
    assert torch.equal(target["weights"], full)
    assert int(target["step"]) == 42


def test_torch_save_on_one_node_loads_with_torch_load_on_another(mounted, small_store,
                                                                 tmp_path):
    """Restart on another node: two mounts with their own node cache and one checkpoint
    store; node B loads what node A saved and flushed, through its own mount."""
    store = tmp_path / "ckstore"
    a, b = (mounted(small_store, "--cache-dir", str(tmp_path / f"cache-{n}"),
                    "--ckpt-store", str(store)) for n in "ab")
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 256)).sum().backward()
    optimizer.step()
    assert not os.path.exists(b.path / "ckpt" / "run" / "step-10.pt")  # B looks first
    (a.path / "ckpt" / "run").mkdir()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": 10}, a.path / "ckpt" / "run" / "step-10.pt")
    result = run_dlfs("flush", a.path, timeout=300)
    assert result.returncode == 0, result.stderr

    assert os.listdir(b.path / "ckpt" / "run") == ["step-10.pt"]
    loaded = torch.load(b.path / "ckpt" / "run" / "step-10.pt", weights_only=True)
    assert loaded["step"] == 10
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["model"][key], value), key
    restored = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    restored.load_state_dict(loaded["optimizer"])
    momentum = next(iter(restored.state.values()))["momentum_buffer"]
    assert torch.equal(momentum, next(iter(optimizer.state.values()))["momentum_buffer"])
