"""DLFSSampler with real torch: DistributedSampler's sizes, DataLoader workers, torch.distributed.

torch is not a dependency of DLFS. These tests run where torch is importable and
skip elsewhere; `DLFS_TORCH_TESTS=1 ./deploy/dev.sh test` installs torch==2.13.0
into the venv and runs them (and .ci/run does), and then a missing torch fails.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

if os.environ.get("DLFS_TORCH_TESTS") == "1":
    import torch  # opted in: a missing torch is a failure, not a skip
else:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed; DLFS_TORCH_TESTS=1 ./deploy/dev.sh test "
                        "installs torch==2.13.0 and runs these")

import torch.distributed as dist
from conftest import run_dlfs
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import dlfs.order.plan
from dlfs.order.sampler import DLFSSampler, Locality


@pytest.fixture(autouse=True)
def _no_job_environment(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


class TorchPermutations:
    """np.random.Generator's permutation, drawn the way DistributedSampler draws it."""

    def __init__(self, seed: int):
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def permutation(self, n: int) -> np.ndarray:
        return torch.randperm(n, generator=self.generator).numpy()


def torch_orders(n: int, world: int, drop_last: bool, seed: int, epoch: int) -> list[list[int]]:
    out = []
    for rank in range(world):
        ds = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True,
                                seed=seed, drop_last=drop_last)
        ds.set_epoch(epoch)
        out.append(list(ds))
    return out


def our_orders(n: int, world: int, drop_last: bool, seed: int, epoch: int) -> list[list[int]]:
    out = []
    for rank in range(world):
        s = DLFSSampler(range(n), rank=rank, world_size=world, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


CASES = [(n, world, drop_last) for n, world, drop_last in
         itertools.product([1, 2, 3, 5, 7, 10, 16, 31, 100, 257], [1, 2, 3, 4, 7, 8, 16],
                           [False, True])]


def test_same_sizes_and_padding_as_distributed_sampler():
    """Lengths per rank and how often each sample is read: equal for every case."""
    for n, world, drop_last in CASES:
        theirs = torch_orders(n, world, drop_last, 3, 1)
        ours = our_orders(n, world, drop_last, 3, 1)
        assert [len(o) for o in ours] == [len(o) for o in theirs], (n, world, drop_last)
        times = [Counter(Counter(i for o in orders for i in o).values())
                 for orders in (theirs, ours)]
        assert times[0] == times[1], (n, world, drop_last)


def test_given_torchs_permutation_the_plan_is_distributed_samplers(monkeypatch):
    """Padding, truncation and slicing are DistributedSampler's, index for index:
    only the permutation comes from numpy instead of torch."""
    monkeypatch.setattr(dlfs.order.plan, "epoch_rng",
                        lambda seed, epoch: TorchPermutations(seed + epoch))
    for (n, world, drop_last), (seed, epoch) in itertools.product(CASES, [(0, 0), (42, 3)]):
        assert our_orders(n, world, drop_last, seed, epoch) == \
            torch_orders(n, world, drop_last, seed, epoch), (n, world, drop_last, seed, epoch)


class Payloads(Dataset):
    """n samples in memory; item i is (i, its bytes)."""

    def __init__(self, n: int):
        self.data = [hashlib.sha256(str(i).encode()).digest() * (1 + i % 3) for i in range(n)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[int, bytes]:
        return i, self.data[i]


def keep_as_list(batch: list) -> list:
    return batch


class GivenClient:
    def __init__(self, loc: Locality):
        self.loc = loc
        self.announced: list[int] = []

    def locality(self) -> Locality:
        return self.loc

    def announce(self, epoch: int, order: np.ndarray) -> None:
        self.announced.append(epoch)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("mode", ["random", "locality"])
def test_dataloader_with_two_workers_reads_every_sample_once_per_epoch(mode):
    """Three ranks' DataLoaders (2 worker processes each) together read the dataset once."""
    n, world = 301, 3
    data = Payloads(n)
    sample_chunk = np.arange(n, dtype=np.int64) // 10
    chunk_node = (np.arange(31) % 3).astype(np.int32)
    loaders, samplers = [], []
    for rank in range(world):
        client = GivenClient(Locality(sample_chunk, chunk_node, 3, rank))
        s = DLFSSampler(data, rank=rank, world_size=world, mode=mode, seed=11, client=client,
                        window=4)
        samplers.append(s)
        loaders.append(DataLoader(data, batch_size=8, sampler=s, num_workers=2,
                                  collate_fn=keep_as_list))
    seen = []
    for epoch in range(2):
        counts = Counter()
        for s, loader in zip(samplers, loaders, strict=True):
            s.set_epoch(epoch)
            got = [item for batch in loader for item in batch]
            assert len(got) == len(s) == 101
            assert all(payload == data.data[i] for i, payload in got)
            assert [i for i, _ in got] == s.order().tolist()
            counts.update(i for i, _ in got)
        assert sorted(counts) == list(range(n))
        assert sorted(counts.values()) == [1] * (n - 2) + [2, 2]  # padded to 303
        seen.append([s.order().tolist() for s in samplers])
    assert seen[0] != seen[1]
    assert [s.client.announced for s in samplers] == [[0, 1]] * world
    assert {s.mode for s in samplers} == {mode}


def test_torch_distributed_gives_rank_world_and_the_node_map(tmp_path):
    """With an initialised process group, rank and world come from it, and locality
    mode gathers each rank's node with all_gather_object (one rank here)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        client = GivenClient(Locality(np.arange(20) // 4, np.zeros(5, dtype=np.int32), 2, 1))
        s = DLFSSampler([f"p{i}" for i in range(20)], mode="locality", client=client)
        assert (s.rank, s.world_size, s.mode) == (0, 1, "locality")
        assert s.layout.rank_nodes.tolist() == [1]
        assert sorted(s) == list(range(20))
    finally:
        dist.destroy_process_group()


# -- three ranks over a real mount ---------------------------------------------------

RANK_PROGRAM = r"""
import hashlib, json, sys
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from dlfs.order.sampler import DLFSSampler

rank, world, init, mount, listing, out = sys.argv[1:]
dist.init_process_group("gloo", init_method=init, rank=int(rank), world_size=int(world))

class Files(Dataset):
    def __init__(self, paths):
        self.samples = [(p, 0) for p in paths]
    def __len__(self):
        return len(self.samples)
    def __getitem__(self, i):
        with open(self.samples[i][0], "rb") as f:
            return i, hashlib.sha256(f.read()).hexdigest()

def keep(batch):
    return batch

data = Files(open(listing).read().splitlines())
sampler = DLFSSampler(data, mount=mount, mode="locality", seed=5)
loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2, collate_fn=keep)
epochs = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    epochs.append([item for batch in loader for item in batch])
with open(out, "w") as f:
    json.dump({"rank": sampler.rank, "world": sampler.world_size, "epochs": epochs,
               "mode": sampler.mode, "announced": sampler.client is not None,
               "plan": sampler.plan(1).tolist()}, f)
dist.barrier()
dist.destroy_process_group()
"""


def test_three_ranks_with_dataloader_workers_read_a_mount_once_per_epoch(
        tmp_path, store_with, mounted, daemon_guard):
    """Three rank processes (gloo), 2 DataLoader workers each, over a real DLFS mount:
    every sample read exactly once per epoch (plus DistributedSampler's padding),
    byte for byte the source (sha256)."""
    src = tmp_path / "src"
    rng = np.random.default_rng(0)
    sizes = {}
    for i in range(61):
        rel = f"class{i % 4}/{i:03d}.bin"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(rng.bytes(int(rng.integers(0, 40_000))))
        sizes[rel] = hashlib.sha256((src / rel).read_bytes()).hexdigest()
    rels = sorted(sizes)
    m = mounted(store_with(src, chunk_size="64K"))
    listing = tmp_path / "paths.txt"
    listing.write_text("".join(f"{m / ('ds/' + r)}\n" for r in rels))
    world = 3
    procs = [subprocess.Popen(
        [sys.executable, "-c", RANK_PROGRAM, str(rank), str(world), f"file://{tmp_path}/pg",
         os.fspath(m), str(listing), str(tmp_path / f"rank{rank}.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, "\n".join(outputs)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [(r["rank"], r["world"]) for r in results] == [(r, world) for r in range(world)]
    assert all(r["plan"] == results[0]["plan"] for r in results)
    # The real order client answered: locality mode held, every epoch was announced.
    assert [(r["mode"], r["announced"]) for r in results] == [("locality", True)] * world
    counters = json.loads(subprocess.run(["cat", os.fspath(m / ".dlfs/stats.json")],
                                         capture_output=True, check=True).stdout)["lookahead"]
    assert counters["announcements"] == world * 2
    for epoch in range(2):
        got = [item for r in results for item in r["epochs"][epoch]]
        assert [len(r["epochs"][epoch]) for r in results] == [21] * world
        counts = Counter(i for i, _ in got)
        assert sorted(counts) == list(range(len(rels)))
        assert sorted(counts.values()) == [1] * 59 + [2, 2]  # 61 padded to 63
        assert all(digest == sizes[rels[i]] for i, digest in got)
    assert results[0]["epochs"][0] != results[0]["epochs"][1]


# -- resuming mid-epoch ----------------------------------------------------------------

def test_statefuldataloader_resumes_on_another_world_size():
    """torchdata's StatefulDataLoader keeps the sampler's state with its own: three ranks
    (2 workers each) stop after 3 batches, two ranks load rank 0's loader state and
    finish the epoch. The sampler's state is exact although the workers ran ahead."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    n, data = 120, Payloads(120)

    def loader(rank: int, world: int) -> tuple[DLFSSampler, StatefulDataLoader]:
        s = DLFSSampler(data, rank=rank, world_size=world, seed=2)
        s.set_epoch(3)
        return s, StatefulDataLoader(data, batch_size=4, sampler=s, num_workers=2,
                                     collate_fn=keep_as_list)

    first = [loader(rank, 3) for rank in range(3)]
    read, states = [], []
    for _, dl in first:
        it = iter(dl)
        read += [i for _ in range(3) for i, _ in next(it)]
        states.append(dl.state_dict())
        del it
    assert len(read) == 36
    second = [loader(rank, 2) for rank in range(2)]
    for s, dl in second:
        dl.load_state_dict(states[0])  # any rank's state describes the job
        got = [i for batch in dl for i, payload in batch if payload == data.data[i]]
        assert s.epoch == 3 and len(got) == 42
        read += got
    assert sorted(read) == list(range(n))  # every sample exactly once
    # the same world size goes on in exactly the uninterrupted order
    again, dl = loader(1, 3)
    dl.load_state_dict(states[1])
    assert [i for batch in dl for i, _ in batch] == again.order(3).tolist()[12:]


RESUME_PROGRAM = r"""
import hashlib, json, os, sys, time
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from dlfs.order.sampler import DLFSSampler

phase, rank, world, init, mount, listing, out = sys.argv[1:]
dist.init_process_group("gloo", init_method=init, rank=int(rank), world_size=int(world))

class Files(Dataset):
    def __init__(self, paths):
        self.samples = [(p, 0) for p in paths]
    def __len__(self):
        return len(self.samples)
    def __getitem__(self, i):
        time.sleep(0.01)  # decoding and augmenting: the look-ahead can get ahead
        with open(self.samples[i][0], "rb") as f:
            return i, hashlib.sha256(f.read()).hexdigest()

def keep(batch):
    return batch

root = os.path.join(mount, "ds")
data = Files([os.path.join(root, line) for line in open(listing).read().splitlines()])
sampler = DLFSSampler(data, mount=mount, mode="locality", seed=5)
loader = DataLoader(data, batch_size=5, sampler=sampler, num_workers=2, collate_fn=keep)
model = torch.nn.Linear(4, 2)
ckpt = os.path.join(mount, "ckpt", "step.pt")
if phase == "first":
    sampler.set_epoch(1)
    got = []
    for step, batch in enumerate(loader):
        got += batch
        model.weight.data += 1.0  # a training step
        if step == 1:  # half the epoch; the workers have fetched more
            state = sampler.state_dict(consumed=len(got))
            if dist.get_rank() == 0:
                torch.save({"model": model.state_dict(), "sampler": state}, ckpt)
            break
else:
    saved = torch.load(ckpt)
    model.load_state_dict(saved["model"])
    sampler.load_state_dict(saved["sampler"])
    got = []
    for epoch in range(sampler.epoch, 2):
        sampler.set_epoch(epoch)
        got += [item for batch in loader for item in batch]
with open(out, "w") as f:
    json.dump({"read": got, "mode": sampler.mode, "weight": model.weight.data.sum().item()}, f)
dist.barrier()
dist.destroy_process_group()
"""


def run_ranks(phase: str, world: int, mount, listing, tmp_path) -> list[dict]:
    procs = [subprocess.Popen(
        [sys.executable, "-c", RESUME_PROGRAM, phase, str(rank), str(world),
         f"file://{tmp_path}/pg-{phase}", os.fspath(mount), str(listing),
         str(tmp_path / f"{phase}{rank}.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, "\n".join(outputs)
    return [json.loads((tmp_path / f"{phase}{r}.json").read_text()) for r in range(world)]


def test_three_ranks_stop_mid_epoch_two_ranks_finish_it_through_a_fresh_mount(
        tmp_path, daemon_guard, store_with, mounted):
    """3 ranks (gloo) x 2 DataLoader workers read half of epoch 1 through a mount and save
    model and sampler state in MOUNT/ckpt/; the mount goes. 2 ranks on a fresh mount (its
    own cache, as another node) load both from MOUNT/ckpt/ and finish the epoch: every
    sample exactly once (sha256), and the look-ahead fetched only the rest, ahead of the
    readers."""
    src = tmp_path / "src"
    rng = np.random.default_rng(3)
    digests = {}
    for i in range(60):
        rel = f"class{i % 3}/{i:03d}.bin"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(rng.bytes(int(rng.integers(1_000, 40_000))))
        digests[rel] = hashlib.sha256((src / rel).read_bytes()).hexdigest()
    rels = sorted(digests)
    store = store_with(src, chunk_size="64K")
    listing = tmp_path / "paths.txt"
    listing.write_text("".join(f"{r}\n" for r in rels))
    ckpt = tmp_path / "ckpt-store"
    ckpt.mkdir()

    first = mounted(store, "--cache-dir", str(tmp_path / "cache1"), "--ckpt-store", str(ckpt))
    before = run_ranks("first", 3, first, listing, tmp_path)
    assert [len(r["read"]) for r in before] == [10] * 3
    assert run_dlfs("flush", first.path, timeout=300).returncode == 0
    assert run_dlfs("umount", first.path, timeout=120).returncode == 0

    second = mounted(store, "--cache-dir", str(tmp_path / "cache2"), "--ckpt-store", str(ckpt),
                     "--store-bandwidth", "4M")
    after = run_ranks("second", 2, second, listing, tmp_path)
    assert [r["mode"] for r in before + after] == ["locality"] * 5
    assert {r["weight"] for r in after} == {before[0]["weight"]} != {0.0}  # the model came back
    assert [len(r["read"]) for r in after] == [15] * 2  # the 30 left, 15 per rank
    read = [item for r in before + after for item in r["read"]]
    assert sorted(i for i, _ in read) == list(range(60))  # every sample exactly once
    assert all(digest == digests[rels[i]] for i, digest in read)
    counters = json.loads(subprocess.run(["cat", os.fspath(second / ".dlfs/stats.json")],
                                         capture_output=True, check=True).stdout)
    ahead, taken = counters["lookahead"], counters["mount"]["lookahead"]
    assert ahead["announcements"] == 2 and ahead["fetch_errors"] == 0
    # Only the rest was announced (the whole epoch would be 60 samples, 30 per rank), and
    # the readers found most of it fetched ahead.
    assert ahead["samples_prefetched"] <= 30, ahead
    assert taken["hits"] >= 20 and taken["hits"] + taken["misses"] >= 30, (ahead, taken)
