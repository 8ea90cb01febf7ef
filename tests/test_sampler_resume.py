"""DLFSSampler.state_dict / load_state_dict: an epoch stopped anywhere and resumed on any
world size reads what the uninterrupted epoch would have read.

No torch and no mount here: the locality a mount would report is given by the test
(GivenClient, as in test_sampler.py). The same with real torch, DataLoader workers,
torchdata's StatefulDataLoader and a real mount is in test_sampler_torch.py.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sampler import GivenClient, torch_sizes

from dlfs.order.ranks import block_nodes
from dlfs.order.sampler import DLFSSampler, Locality, write_order


@pytest.fixture(autouse=True)
def _no_job_environment(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


def paths(n: int) -> list[str]:
    return [f"/mnt/dlfs/ds/c{i % 7}/{i:05d}.jpg" for i in range(n)]


def chunks_of(n: int, seed: int) -> np.ndarray:
    """Each sample's chunk (a property of the store: every mount reports it alike)."""
    rng = np.random.default_rng(seed)
    sample_chunk = np.sort(rng.integers(0, max(1, n // 5) + 1, n)).astype(np.int64)
    sample_chunk[rng.random(n) < 0.05] = -1
    return sample_chunk


def job(n: int, world: int, mode: str, sample_chunk: np.ndarray, nodes: int, place: int,
        listing: list[str] | None = None, **kw) -> list[DLFSSampler]:
    """One sampler per rank, as a job on `nodes` nodes would make them: the nodes' mounts
    report the same chunks, their own placement of chunks on nodes."""
    rng = np.random.default_rng(place)
    chunk_node = rng.integers(0, nodes, int(sample_chunk.max(initial=-1)) + 1).astype(np.int32)
    out = []
    for rank in range(world):
        node = int(block_nodes(world, nodes)[rank])
        client = GivenClient(Locality(sample_chunk, chunk_node, nodes, node))
        out.append(DLFSSampler(listing or paths(n), rank=rank, world_size=world, mode=mode,
                               client=client, **kw))
    return out


def read_in_lockstep(ranks: list[DLFSSampler], steps: int | None) -> list[list[int]]:
    """Each rank takes `steps` indices (all, if None) from its iterator, step by step."""
    iterators = [iter(s) for s in ranks]
    got: list[list[int]] = [[] for _ in ranks]
    step = 0
    while steps is None or step < steps:
        batch = [next(it, None) for it in iterators]
        if all(i is None for i in batch):
            break
        assert None not in batch, "ranks out of lockstep"
        for mine, i in zip(got, batch, strict=True):
            mine.append(i)
        step += 1
    return got


piece = st.tuples(st.integers(1, 9), st.floats(0, 1), st.sampled_from(["random", "locality"]),
                  st.integers(1, 4))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 250), pieces=st.lists(piece, min_size=1, max_size=3),
       drop_last=st.booleans(), seed=st.integers(0, 2**31), epoch=st.integers(0, 20),
       via=st.integers(0, 8))
def test_an_epoch_in_pieces_reads_what_one_uninterrupted_epoch_reads(
        n, pieces, drop_last, seed, epoch, via):
    """W1 -> W2 -> W3, cut anywhere, either mode, any rank's state: every sample of the
    epoch exactly as often as DistributedSampler's rules allow; the same world size
    throughout gives the uninterrupted order, index for index."""
    sample_chunk = chunks_of(n, seed)
    reads: list[list[int]] = []  # per piece, all ranks
    per_rank: list[list[list[int]]] = []
    state = None
    replanned = []  # worlds of the pieces dealt anew
    ref = 0  # the piece whose world plans the epoch
    for k, (world, cut, mode, nodes) in enumerate(pieces):
        ranks = job(n, world, mode, sample_chunk, nodes, seed + k, seed=seed + 1,
                    drop_last=drop_last, window=3)
        for s in ranks:
            if state is None:
                s.set_epoch(epoch)
            else:
                s.load_state_dict(json.loads(json.dumps(state)))  # plain JSON
                s.set_epoch(epoch)  # the usual loop does: the resume stays
        if state is not None and world != state["world_size"]:
            if len(state["pieces"]) == 1 and state["consumed"] == 0:
                ref = k  # nothing read yet: the epoch as planned for this world
            else:
                replanned.append(world)
        last = k == len(pieces) - 1
        left = len(ranks[0])
        assert [len(s) for s in ranks] == [left] * world
        got = read_in_lockstep(ranks, None if last else int(cut * left))
        reads.append([i for mine in got for i in mine])
        per_rank.append(got)
        state = ranks[via % world].state_dict()
        assert state["epoch"] == epoch and state["world_size"] == world
        # bytes, not per sample: a locality piece adds ~300 B and a few per chunk
        assert len(json.dumps(state)) < 400 + 350 * len(state["pieces"]) + 30 * n // 5
    counts = np.bincount(np.concatenate([np.asarray(r, dtype=np.int64) for r in reads]),
                         minlength=n)
    world1, _, mode1, nodes1 = pieces[ref]
    first = job(n, world1, mode1, sample_chunk, nodes1, seed + ref, seed=seed + 1,
                drop_last=drop_last, window=3)
    whole = [s.order(epoch).tolist() for s in first]
    uninterrupted = np.bincount(np.asarray([i for o in whole for i in o], dtype=np.int64),
                                minlength=n)
    if not replanned:
        assert [[i for p in per_rank[ref:] for i in p[r]] for r in range(world1)] == whole
        assert counts.tolist() == uninterrupted.tolist()
        return
    total1, _ = torch_sizes(n, world1, drop_last)
    if drop_last:  # each sample at most once; only the last piece's cut is lost
        assert counts.max(initial=0) <= 1 and (counts <= uninterrupted).all()
        assert int((uninterrupted - counts).sum()) <= replanned[-1] - 1
    else:  # each sample at least once; only padding is read twice
        assert counts.min() >= 1
        assert int(counts.sum()) - n <= (total1 - n) + sum(w - 1 for w in replanned)


def test_a_state_of_another_sample_list_is_refused_in_one_line():
    s = DLFSSampler(paths(50), rank=0, world_size=2)
    state = s.state_dict()
    for other in (paths(51), paths(50)[::-1], [p.replace(".jpg", ".png") for p in paths(50)]):
        with pytest.raises(ValueError, match="another sample list") as err:
            DLFSSampler(other, rank=0, world_size=3).load_state_dict(state)
        assert "\n" not in str(err.value) and "same files in the same order" in str(err.value)
    with pytest.raises(ValueError, match="not a DLFSSampler state"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="valid 'pieces'"):
        s.load_state_dict({k: v for k, v in state.items() if k != "pieces"})


def test_the_list_digest_ignores_where_the_dataset_is_mounted():
    """Another node mounts the store elsewhere: the same list, relative to its root."""
    here = DLFSSampler([f"/mnt/node1/ds/{i}.bin" for i in range(20)], world_size=1)
    there = DLFSSampler([f"/scratch/dlfs-node2/ds/{i}.bin" for i in range(20)], world_size=1)
    there.load_state_dict(here.state_dict())


def test_consumed_counts_what_the_loop_took_while_workers_run_ahead():
    s = DLFSSampler(paths(100), rank=1, world_size=2, seed=3)
    s.set_epoch(2)
    it = iter(s)
    taken = [next(it) for _ in range(30)]  # a DataLoader's workers asked for 30
    assert s.state_dict()["consumed"] == 30
    state = s.state_dict(consumed=12)  # the training loop has 12 of them
    assert (state["consumed"], state["job_consumed"]) == (12, 24)
    resumed = DLFSSampler(paths(100), rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert resumed.epoch == 2 and resumed.seed == 3 and len(resumed) == 38
    rest = list(resumed)
    assert taken[:12] + rest == s.order(2).tolist()
    # after a resume, consumed counts from the resumed position
    again = DLFSSampler(paths(100), rank=0, world_size=2)
    again.load_state_dict(state)
    it = iter(again)
    [next(it) for _ in range(5)]
    assert again.state_dict(consumed=5)["consumed"] == 17
    for bad in (-1, 39, 1.5, True):
        with pytest.raises(ValueError, match=r"consumed must be an integer in 0\.\.38"):
            again.state_dict(consumed=bad)


def test_only_the_rest_is_announced_and_iterators_are_lazy():
    """The daemon reads ahead from the resumed position; an iterator made and dropped
    before the state is loaded (torchdata does so) announces nothing."""
    sample_chunk = chunks_of(90, 1)
    first = job(90, 3, "locality", sample_chunk, 3, 1)
    read_in_lockstep(first, 10)
    second = job(90, 2, "locality", sample_chunk, 2, 2)
    for s in second:
        dropped = iter(s)  # never started
        s.load_state_dict(first[0].state_dict())
        del dropped
        assert s.client.announced == []
        rest = list(s)
        assert len(s.client.announced) == 1
        epoch, announced = s.client.announced[0]
        assert epoch == 0 and announced.tolist() == rest and len(rest) == 30


def test_a_resumed_epoch_then_goes_on_to_whole_epochs():
    ranks = [DLFSSampler(paths(40), rank=r, world_size=2, seed=1) for r in range(2)]
    read_in_lockstep(ranks, 7)
    state = ranks[0].state_dict()
    resumed = [DLFSSampler(paths(40), rank=r, world_size=4) for r in range(4)]
    for s in resumed:
        s.load_state_dict(state)
    assert [len(s) for s in resumed] == [7] * 4  # 26 left, padded to 28
    read_in_lockstep(resumed, None)
    assert [len(s) for s in resumed] == [10] * 4
    for s in resumed:
        s.set_epoch(1)
    fresh = [DLFSSampler(paths(40), rank=r, world_size=4, seed=1) for r in range(4)]
    for s in fresh:
        s.set_epoch(1)
    assert read_in_lockstep(resumed, None) == read_in_lockstep(fresh, None)
    assert resumed[0].state_dict()["pieces"] == [
        {"world_size": 4, "mode": "random", "consumed": 10}]


def test_set_epoch_to_another_epoch_drops_a_loaded_state():
    s = DLFSSampler(paths(30), rank=0, world_size=1)
    it = iter(s)
    [next(it) for _ in range(10)]
    resumed = DLFSSampler(paths(30), rank=0, world_size=1)
    resumed.load_state_dict(s.state_dict())
    resumed.set_epoch(1)
    assert len(list(resumed)) == 30 and resumed.state_dict()["consumed"] == 30


def test_a_locality_state_needs_the_same_chunk_layout(caplog):
    sample_chunk = chunks_of(60, 5)
    first = job(60, 2, "locality", sample_chunk, 2, 5)
    read_in_lockstep(first, 4)
    state = first[1].state_dict()
    assert state["mode"] == "locality" and "chunk_nodes" in state["pieces"][0]["layout"]
    with pytest.raises(ValueError, match="no chunk layout") as err:
        DLFSSampler(paths(60), rank=0, world_size=2).load_state_dict(state)
    assert "DLFS mount" in str(err.value)
    other = sample_chunk.copy()
    other[0] = other[-1]
    with pytest.raises(ValueError, match="another chunk layout"):
        job(60, 2, "locality", other, 2, 5)[0].load_state_dict(state)
    # with the same layout a random-mode sampler goes on in the saved locality order
    same = job(60, 2, "random", sample_chunk, 3, 9)
    with caplog.at_level(logging.INFO, logger="dlfs.sampler"):
        same[1].load_state_dict(state)
    assert list(same[1]) == first[1].order(0).tolist()[4:]
    assert "resuming epoch 0 at 4 of 30" in caplog.text


def test_the_state_stays_small():
    """Bytes, not per sample: a million samples in random mode; locality adds bytes per
    chunk (here 10,000 chunks) and per rank."""
    n = 1_000_000
    s = DLFSSampler(range(n), rank=0, world_size=64)
    assert len(json.dumps(s.state_dict(consumed=100))) < 400
    sample_chunk = np.arange(n, dtype=np.int64) // 100
    client = GivenClient(Locality(sample_chunk, (np.arange(10_000) % 8).astype(np.int32), 8, 0))
    loc = DLFSSampler(range(n), rank=0, world_size=64, mode="locality", client=client)
    size = len(json.dumps(loc.state_dict(consumed=100)))
    assert size < 2_000 + 64 * 4 + 10_000 // 2, size


def test_write_order_writes_the_rest_of_a_resumed_epoch(tmp_path):
    s = DLFSSampler(paths(50), rank=0, world_size=2, seed=8)
    state = s.state_dict(consumed=20)
    resumed = DLFSSampler(paths(50), rank=1, world_size=3)
    resumed.load_state_dict(state)
    assert write_order(resumed, tmp_path / "rest.txt") == 4  # 2 x 20 read, 10 left: 3 x 4
    ranks = [DLFSSampler(paths(50), rank=r, world_size=3) for r in range(3)]
    for r in ranks:
        r.load_state_dict(state)
    rest = Counter(i for r in ranks for i in r.order().tolist())
    done = Counter(i for r in range(2) for i in
                   DLFSSampler(paths(50), rank=r, world_size=2, seed=8).order(0)[:20].tolist())
    assert sorted(set(rest) | set(done)) == list(range(50)) and not set(rest) & set(done)
