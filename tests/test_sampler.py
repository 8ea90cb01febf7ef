"""DLFSSampler and its plans, without torch and without a mount.

The locality a client would report is given by the test (`GivenClient`): it is
an input of the sampler, like the list of paths, not a stand-in for it.
torch's own DistributedSampler is compared in tests/test_sampler_torch.py.
"""

from __future__ import annotations

import itertools
import logging
import math
import subprocess
import sys
import types
from dataclasses import dataclass, field
from math import comb

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import dlfs.order.sampler as sampler_mod
from dlfs.mountinfo import MountEntry
from dlfs.order.plan import Layout, locality_plan, random_plan, shard_sizes
from dlfs.order.randomness import _expected_entropy, entropy_figure, plan_chunk_keys
from dlfs.order.ranks import block_nodes, resolve_rank_world
from dlfs.order.sampler import DLFSSampler, Locality, dataset_paths, dlfs_mount_of, write_order

LOG = "dlfs.sampler"


@dataclass
class GivenClient:
    """An OrderClient whose locality the test chooses; records what it is told."""

    loc: Locality
    fail: Exception | None = None
    announced: list = field(default_factory=list)
    closed: bool = False

    def locality(self) -> Locality:
        return self.loc

    def announce(self, epoch: int, order: np.ndarray) -> None:
        self.announced.append((epoch, np.array(order)))
        if self.fail is not None:
            raise self.fail

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def _no_job_environment(monkeypatch):
    """The CI runner may itself run under Slurm or a launcher: rank/world come from tests."""
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


def torch_sizes(n: int, world: int, drop_last: bool) -> tuple[int, int]:
    """torch.utils.data.DistributedSampler.__init__, transcribed."""
    num = math.ceil((n - world) / world) if drop_last and n % world != 0 else math.ceil(n / world)
    return num * world, num


def synthetic_locality(n: int, seed: int, node_count: int) -> Locality:
    """Chunks of random sizes, a few samples of unknown chunk, a few chunks on no node."""
    rng = np.random.default_rng(seed)
    chunks = int(rng.integers(1, n + 1))
    sample_chunk = np.sort(rng.integers(0, chunks, n)).astype(np.int64)
    sample_chunk[rng.random(n) < 0.05] = -1
    chunk_node = rng.integers(0, node_count, chunks).astype(np.int32)
    chunk_node[rng.random(chunks) < 0.1] = -1
    return Locality(sample_chunk, chunk_node, node_count, 0)


def samplers(n: int, world: int, mode: str, loc: Locality | None = None,
             rank_nodes=None, **kw) -> list[DLFSSampler]:
    """One sampler per rank, each with its own client reporting its own node."""
    out = []
    for rank in range(world):
        client = None
        if loc is not None:
            node = (rank_nodes[rank] if rank_nodes is not None
                    else block_nodes(world, loc.node_count)[rank])
            client = GivenClient(Locality(loc.sample_chunk, loc.chunk_node, loc.node_count,
                                          int(node)))
        out.append(DLFSSampler([f"s{i}" for i in range(n)], rank=rank, world_size=world,
                               mode=mode, client=client, rank_nodes=rank_nodes, **kw))
    return out


def epoch_orders(ranks: list[DLFSSampler], epoch: int) -> list[list[int]]:
    for s in ranks:
        s.set_epoch(epoch)
    return [list(s) for s in ranks]


def check_contract(orders: list[list[int]], n: int, world: int, drop_last: bool) -> None:
    """DistributedSampler's rules: num_samples each; every sample once, plus the padding."""
    total, num = torch_sizes(n, world, drop_last)
    assert [len(o) for o in orders] == [num] * world
    assert all(isinstance(i, int) for o in orders for i in o)
    counts = np.bincount(np.concatenate([np.asarray(o, dtype=np.int64) for o in orders]),
                         minlength=n)
    assert len(counts) == n and counts.sum() == total
    if drop_last:
        assert counts.max(initial=0) <= 1
    else:  # the head of the permuted list is repeated, cyclically if need be
        q, extra = divmod(total, n)
        assert counts.min() >= q and counts.max() <= q + 1
        assert int((counts == q + 1).sum()) == extra


case = st.tuples(st.integers(1, 300), st.integers(1, 9), st.booleans(),
                 st.integers(0, 2**31), st.integers(0, 50), st.integers(1, 4),
                 st.integers(1, 12))


# -- the contract in every mode ------------------------------------------------------

@settings(max_examples=120, deadline=None)
@given(case, st.sampled_from(["random", "locality"]), st.booleans())
def test_every_sample_once_per_epoch_across_ranks(params, mode, explicit_nodes):
    n, world, drop_last, seed, epoch, node_count, window = params
    loc = synthetic_locality(n, seed, node_count)
    rank_nodes = (np.random.default_rng(seed).integers(0, node_count, world)
                  if explicit_nodes else None)
    ranks = samplers(n, world, mode, loc, rank_nodes, seed=seed, drop_last=drop_last,
                     window=window)
    assert {s.mode for s in ranks} == {mode}
    orders = epoch_orders(ranks, epoch)
    check_contract(orders, n, world, drop_last)
    assert [len(s) for s in ranks] == [torch_sizes(n, world, drop_last)[1]] * world


@settings(max_examples=60, deadline=None)
@given(case, st.sampled_from(["random", "locality"]))
def test_same_seed_and_epoch_same_plan_on_every_rank(params, mode):
    """Ranks plan alone: the plan may depend on nothing a rank knows of itself."""
    n, world, drop_last, seed, epoch, node_count, window = params
    loc = synthetic_locality(n, seed, node_count)
    first = samplers(n, world, mode, loc, seed=seed, drop_last=drop_last, window=window)
    again = samplers(n, world, mode, loc, seed=seed, drop_last=drop_last, window=window)
    for s in first + again:
        s.set_epoch(epoch)
    plans = [s.plan() for s in first + again]
    for p in plans[1:]:
        np.testing.assert_array_equal(p, plans[0])
    assert [list(s) for s in first] == [list(s) for s in again] == plans[0].tolist()


@settings(max_examples=60, deadline=None)
@given(case, st.sampled_from(["random", "locality"]))
def test_a_new_order_each_epoch(params, mode):
    n, world, drop_last, seed, epoch, node_count, window = params
    assume(n >= 16)
    s = samplers(n, world, mode, synthetic_locality(n, seed, node_count), seed=seed,
                 drop_last=drop_last, window=window)[0]
    plans = [s.plan(e) for e in (epoch, epoch + 1, epoch + 2)]
    assert not all(np.array_equal(plans[0], p) for p in plans[1:])


def test_random_plan_is_distributed_samplers_rule():
    """pool = permutation padded with its own head (np.resize), rank r takes pool[r::world]."""
    for n, world, drop_last in itertools.product([1, 2, 7, 10, 11], [1, 3, 4, 12],
                                                 [False, True]):
        plan = random_plan(n, world, 5, 3, drop_last)
        total, num = torch_sizes(n, world, drop_last)
        assert plan.shape == (world, num)
        pool = plan.T.ravel()
        perm = np.random.default_rng(5 + 3).permutation(n)
        expected = perm[:total] if drop_last else np.resize(perm, total)
        np.testing.assert_array_equal(pool, expected)


def test_shard_sizes_match_distributed_sampler():
    for n, world in itertools.product(range(1, 40), range(1, 12)):
        for drop_last in (False, True):
            assert shard_sizes(n, world, drop_last) == torch_sizes(n, world, drop_last)


# -- locality ------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(2, 20), st.integers(1, 5),
       st.integers(0, 2**31), st.integers(1, 8))
def test_balanced_placement_reads_only_its_own_node(nodes, per_node, chunks, size6, seed,
                                                      window):
    """Each node holds as many samples as its ranks read: nothing needs to cross nodes."""
    size = 6 * size6  # divisible by every ranks-per-node count: no padding
    n = nodes * chunks * size
    rng = np.random.default_rng(seed)
    chunk_node = rng.permutation(np.repeat(np.arange(nodes), chunks)).astype(np.int32)
    loc = Locality(np.repeat(np.arange(nodes * chunks), size), chunk_node, nodes, 0)
    ranks = samplers(n, nodes * per_node, "locality", loc, seed=seed, window=window)
    for s in ranks:
        assert s.randomness is None
        list(s)
        assert s.randomness["local_fraction"] == 1.0
    check_contract([list(s) for s in ranks], n, nodes * per_node, False)


@settings(max_examples=80, deadline=None)
@given(case)
def test_locality_reads_as_much_from_its_own_node_as_the_quotas_allow(params):
    """Every node keeps min(its samples, its quota) of its own: the most any plan can."""
    n, world, drop_last, seed, epoch, node_count, window = params
    loc = synthetic_locality(n, seed, node_count)
    rank_nodes = np.random.default_rng(seed + 1).integers(0, node_count, world)
    layout = Layout(loc.sample_chunk, loc.chunk_node.astype(np.int64), rank_nodes, node_count)
    plan = locality_plan(layout, world, seed, epoch, drop_last, window)
    holder = np.where(loc.sample_chunk >= 0, loc.chunk_node[np.maximum(loc.sample_chunk, 0)], -1)
    local = sum(int((holder[row] == rank_nodes[r]).sum()) for r, row in enumerate(plan))
    quota = np.bincount(rank_nodes, minlength=node_count) * plan.shape[1]
    pool_holders = holder[plan.ravel()]
    own = np.array([(pool_holders == node).sum() for node in range(node_count)])
    assert local == int(np.minimum(own, quota).sum())


@settings(max_examples=60, deadline=None)
@given(case)
def test_a_rank_reads_at_most_window_chunks_at_once(params):
    n, world, drop_last, seed, epoch, node_count, window = params
    loc = synthetic_locality(n, seed, node_count)
    layout = Layout(loc.sample_chunk, loc.chunk_node.astype(np.int64),
                    block_nodes(world, node_count), node_count)
    for row in locality_plan(layout, world, seed, epoch, drop_last, window):
        chunks = loc.sample_chunk[row]
        known = np.flatnonzero(chunks >= 0)
        if len(known) == 0:
            continue
        keys = chunks[known]
        first = {k: known[np.argmax(keys == k)] for k in np.unique(keys)}
        last = {k: known[len(keys) - 1 - np.argmax(keys[::-1] == k)] for k in np.unique(keys)}
        open_at = np.zeros(len(row) + 1, dtype=np.int64)
        for k in first:
            open_at[first[k]] += 1
            open_at[last[k] + 1] -= 1
        assert np.cumsum(open_at).max() <= window


def test_surplus_spills_whole_chunks_to_nodes_under_quota():
    """Node 0 holds everything; node 1's rank gets whole chunks of node 0, not a scatter."""
    loc = Locality(np.repeat(np.arange(10), 10), np.zeros(10, dtype=np.int32), 2, 0)
    ranks = samplers(100, 2, "locality", loc, rank_nodes=[0, 1], window=10)
    orders = epoch_orders(ranks, 0)
    check_contract(orders, 100, 2, False)
    assert sorted(len(set(loc.sample_chunk[o].tolist())) for o in orders) == [5, 5]
    assert ranks[0].randomness["local_fraction"] == 1.0
    assert ranks[1].randomness["local_fraction"] == 0.0


def test_nodes_without_ranks_and_samples_of_unknown_chunk_are_still_read():
    sample_chunk = np.array([0, 0, 1, 1, 2, 2, -1, -1, 3, 3], dtype=np.int64)
    chunk_node = np.array([2, 2, -1, 0], dtype=np.int32)  # node 2 runs no rank
    loc = Locality(sample_chunk, chunk_node, 3, 0)
    for drop_last in (False, True):
        ranks = samplers(10, 3, "locality", loc, rank_nodes=[0, 1, 1], drop_last=drop_last)
        for epoch in range(3):
            check_contract(epoch_orders(ranks, epoch), 10, 3, drop_last)


def test_locality_changes_which_chunks_a_rank_reads_each_epoch():
    loc = Locality(np.repeat(np.arange(40), 5), np.repeat(np.arange(2), 20).astype(np.int32),
                   2, 0)
    s = samplers(200, 4, "locality", loc)[0]
    chunk_sets = [frozenset(loc.sample_chunk[s.order(e)].tolist()) for e in range(4)]
    assert len(set(chunk_sets)) > 1
    assert all(c <= set(range(20)) for c in chunk_sets)  # always node 0's chunks


# -- randomness ----------------------------------------------------------------------

def test_expected_entropy_is_the_exact_expectation():
    """Against brute force over every subset of a small multiset."""
    for counts, size in [([2, 1, 1], 2), ([3, 3], 3), ([1, 1, 1, 1], 4), ([5, 2, 1], 3),
                         ([4], 2), ([2, 2, 2], 1)]:
        items = np.repeat(np.arange(len(counts)), counts)
        total = 0.0
        subsets = list(itertools.combinations(range(len(items)), size))
        for subset in subsets:
            _, c = np.unique(items[list(subset)], return_counts=True)
            p = c / size
            total += float(-(p * np.log(p)).sum())
        assert comb(len(items), size) == len(subsets)
        assert _expected_entropy(np.array(counts), size) == pytest.approx(total / len(subsets))


@settings(max_examples=60, deadline=None)
@given(case, st.sampled_from(["random", "locality"]), st.integers(1, 64))
def test_randomness_figures_are_in_range(params, mode, batch_size):
    n, world, drop_last, seed, epoch, node_count, window = params
    ranks = samplers(n, world, mode, synthetic_locality(n, seed, node_count), seed=seed,
                     drop_last=drop_last, window=window, batch_size=batch_size)
    s = ranks[-1]
    for e in (epoch, epoch + 1):
        s.set_epoch(e)
        list(s)
        r = s.randomness
        assert r["epoch"] == e and r["mode"] == mode and r["batch_size"] == batch_size
        assert 0.0 <= r["entropy"] <= 1.0
        if r["local_fraction"] is not None:
            assert 0.0 <= r["local_fraction"] <= 1.0
    if r["epoch_correlation"] is not None:
        assert -1.0 <= r["epoch_correlation"] <= 1.0
    if r["same_rank"] is not None:
        assert 0.0 <= r["same_rank"] <= 1.0


@pytest.mark.parametrize("world", [1, 3, 4])
def test_random_mode_scores_about_one_and_locality_knows_its_cost(world):
    n = 6000
    loc = Locality(np.arange(n) // 20, (np.arange(n // 20) % 3).astype(np.int32), 3, 0)
    random_ = samplers(n, world, "random", loc, seed=1)[0]
    small = samplers(n, world, "locality", loc, seed=1, window=2)[0]
    large = samplers(n, world, "locality", loc, seed=1, window=200)[0]
    for s in (random_, small, large):
        for epoch in range(2):
            s.set_epoch(epoch)
            list(s)
    assert random_.randomness["entropy"] > 0.97
    assert abs(random_.randomness["epoch_correlation"]) < 0.1
    assert small.randomness["entropy"] < 0.5 < large.randomness["entropy"]
    assert large.randomness["entropy"] > 0.9
    if world == 3:  # one rank per node: locality keeps each node's samples on its rank
        assert small.randomness["local_fraction"] == 1.0
        assert large.randomness["same_rank"] == 1.0
        assert random_.randomness["same_rank"] < 0.5


def test_reading_chunk_after_chunk_scores_near_zero():
    keys = np.repeat(np.arange(100), 32)[None, :]
    assert entropy_figure(keys, 32) < 0.05
    shuffled = np.random.default_rng(0).permutation(keys[0])[None, :]
    assert entropy_figure(shuffled, 32) > 0.97


def test_randomness_needs_no_chunk_layout():
    s = DLFSSampler(list("abcdefgh"), rank=0, world_size=2)
    s.set_epoch(1)
    list(s)
    assert s.randomness["entropy"] is None and s.randomness["local_fraction"] is None
    assert s.randomness["same_rank"] is not None


def test_randomness_is_logged_once_per_epoch(caplog):
    s = DLFSSampler([f"p{i}" for i in range(50)], rank=0, world_size=1)
    with caplog.at_level(logging.INFO, logger=LOG):
        list(s)
        list(s)
        s.set_epoch(1)
        list(s)
    lines = [r.getMessage() for r in caplog.records if "randomness" in r.getMessage()]
    assert len(lines) == 2 and "epoch 0" in lines[0] and "epoch 1" in lines[1]


def test_plan_chunk_keys_make_unknown_samples_their_own_chunk():
    keys = plan_chunk_keys(np.array([[0, 1, 2, 2]]), np.array([0, -1, -1], dtype=np.int64))
    assert keys.tolist() == [[0, 2, 3, 3]]


# -- the client ----------------------------------------------------------------------

def test_announces_this_ranks_order_once_per_iteration():
    loc = synthetic_locality(100, 3, 2)
    ranks = samplers(100, 2, "locality", loc, seed=3)
    for epoch in (0, 1):
        orders = epoch_orders(ranks, epoch)
        for s, order in zip(ranks, orders, strict=True):
            assert s.client.announced[-1][0] == epoch
            assert s.client.announced[-1][1].tolist() == order
    assert [len(s.client.announced) for s in ranks] == [2, 2]


@pytest.mark.parametrize("error", [OSError(32, "Broken pipe"), RuntimeError("daemon gone")])
def test_a_failing_announcement_warns_and_the_epoch_goes_on(caplog, error):
    client = GivenClient(synthetic_locality(20, 1, 1), fail=error)
    s = DLFSSampler([f"p{i}" for i in range(20)], rank=0, world_size=1, client=client)
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert sorted(s) == list(range(20))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(error) in warnings[0].getMessage()


def test_a_client_passed_in_stays_open_one_connected_is_closed(monkeypatch):
    given_client = GivenClient(synthetic_locality(10, 1, 1))
    with DLFSSampler([f"p{i}" for i in range(10)], client=given_client):
        pass
    assert not given_client.closed
    made = GivenClient(synthetic_locality(10, 1, 1))
    fake = types.ModuleType("dlfs.order.client")
    fake.connect = lambda paths, mount=None: made
    monkeypatch.setitem(sys.modules, "dlfs.order.client", fake)
    with DLFSSampler([f"p{i}" for i in range(10)], mount="/mnt/x") as s:
        assert s.client is made
    assert made.closed and s.client is None


def test_paths_in_a_dlfs_mount_connect_with_the_paths_and_the_mount(monkeypatch):
    seen = {}

    def connect(paths, mount=None):
        seen.update(paths=paths, mount=mount)
        return GivenClient(synthetic_locality(len(paths), 2, 1))

    fake = types.ModuleType("dlfs.order.client")
    fake.connect = connect
    monkeypatch.setitem(sys.modules, "dlfs.order.client", fake)
    monkeypatch.setattr(sampler_mod, "find_mount",
                        lambda p: MountEntry("0:99", "fuse.dlfs") if p == "/mnt/d" else None)
    paths = [f"/mnt/d/train/{i}.jpg" for i in range(5)]
    s = DLFSSampler(paths, mode="locality")
    assert seen == {"paths": paths, "mount": "/mnt/d"} and s.mode == "locality"


def test_dlfs_mount_of_asks_the_nearest_mount(monkeypatch):
    table = {"/": "ext4", "/mnt/d": "fuse.dlfs", "/mnt/d/other": "tmpfs", "/data": "xfs"}
    monkeypatch.setattr(sampler_mod, "find_mount",
                        lambda p: MountEntry("0:1", table[p]) if p in table else None)
    assert dlfs_mount_of("/mnt/d/ds/a/b.jpg") == "/mnt/d"
    assert dlfs_mount_of("/mnt/d") == "/mnt/d"
    assert dlfs_mount_of("/mnt/d/other/x") is None
    assert dlfs_mount_of("/data/x") is None
    assert dlfs_mount_of("/home/x") is None


def test_a_path_outside_dlfs_is_a_plain_sampler(tmp_path, caplog):
    paths = [str(tmp_path / f"{i}") for i in range(6)]
    with caplog.at_level(logging.INFO, logger=LOG):
        s = DLFSSampler(paths)
    assert s.client is None and sorted(s) == list(range(6))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOG):
        s = DLFSSampler(paths, mode="locality")
    assert s.mode == "random" and sorted(s) == list(range(6))
    [warning] = caplog.records
    assert "is not inside a DLFS mount" in warning.getMessage()


def test_a_mount_that_is_no_dlfs_mount_warns_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=LOG):  # the real client refuses it
        s = DLFSSampler(["a", "b", "c"], mount=tmp_path)
        list(s)
        s.set_epoch(1)
        list(s)
    [warning] = caplog.records
    assert "is not a DLFS mountpoint" in warning.getMessage() and s.client is None


@pytest.mark.parametrize("outcome", [None, OSError(111, "Connection refused"),
                                     RuntimeError("unknown paths")])
def test_a_refused_connection_is_a_plain_sampler(monkeypatch, caplog, outcome):
    def connect(paths, mount=None):
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    fake = types.ModuleType("dlfs.order.client")
    fake.connect = connect
    monkeypatch.setitem(sys.modules, "dlfs.order.client", fake)
    with caplog.at_level(logging.WARNING, logger=LOG):
        s = DLFSSampler(["a", "b", "c"], mount="/mnt/dlfs", mode="locality")
    assert s.client is None and s.mode == "random"
    [warning] = caplog.records
    assert "/mnt/dlfs" in warning.getMessage()


def test_unusable_locality_falls_back_to_random_with_one_warning(caplog):
    bad = [Locality(np.zeros(3, dtype=np.int64), np.zeros(1, dtype=np.int32), 1, 0),  # 3 != 5
           Locality(np.full(5, 4, dtype=np.int64), np.zeros(2, dtype=np.int32), 1, 0),
           Locality(np.zeros(5, dtype=np.int64), np.array([3], dtype=np.int32), 2, 0),
           Locality(np.zeros(5, dtype=np.int64), np.zeros(1, dtype=np.int32), 1, 1)]
    for loc in bad:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOG):
            s = DLFSSampler(list("abcde"), mode="locality", client=GivenClient(loc))
        assert s.mode == "random" and sorted(s) == list(range(5))
        [warning] = caplog.records
        assert "locality is unusable" in warning.getMessage()


def test_a_plain_sized_dataset_samples_at_random_and_says_why_once(caplog):
    class Sized:
        def __len__(self):
            return 7

    assert DLFSSampler(Sized()).paths is None
    with caplog.at_level(logging.WARNING, logger=LOG):
        s = DLFSSampler(Sized(), mode="locality")
        for epoch in range(3):
            s.set_epoch(epoch)
            assert sorted(s) == list(range(7))
    [warning] = caplog.records
    assert "no paths" in warning.getMessage()
    with pytest.raises(ValueError, match="no paths"):
        write_order(s, "/nonexistent/list.txt")


def test_block_placement_that_disagrees_with_the_mount_warns_once(caplog):
    loc = synthetic_locality(40, 1, 2)
    with caplog.at_level(logging.WARNING, logger=LOG):
        s = DLFSSampler([f"p{i}" for i in range(40)], rank=0, world_size=4, mode="locality",
                        client=GivenClient(Locality(loc.sample_chunk, loc.chunk_node, 2, 1)))
        list(s)
    assert s.mode == "locality"
    [warning] = caplog.records
    assert "rank_nodes=" in warning.getMessage()


class GatheringDist:
    """torch.distributed as the sampler uses it, with the other ranks' answers given."""

    def __init__(self, rank: int, others: list):
        self.rank, self.others = rank, others

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return len(self.others)

    def all_gather_object(self, out: list, item) -> None:
        out[:] = [item if r == self.rank else o for r, o in enumerate(self.others)]


def test_under_torch_distributed_the_node_map_is_gathered(monkeypatch):
    loc = synthetic_locality(60, 4, 2)
    digest = sampler_mod._digest(loc)
    dist = GatheringDist(1, [(1, digest), (0, digest), (1, digest)])
    monkeypatch.setattr(sampler_mod, "torch_distributed", lambda: dist)
    monkeypatch.setattr("dlfs.order.ranks.torch_distributed", lambda: dist)
    s = DLFSSampler([f"p{i}" for i in range(60)], mode="locality",
                    client=GivenClient(Locality(loc.sample_chunk, loc.chunk_node, 2, 0)))
    assert (s.rank, s.world_size, s.mode) == (1, 3, "locality")
    assert s.layout.rank_nodes.tolist() == [1, 0, 1]


@pytest.mark.parametrize("other", ["none", "different"])
def test_under_torch_distributed_ranks_fall_back_together(monkeypatch, caplog, other):
    loc = synthetic_locality(60, 4, 2)
    theirs = None if other == "none" else (1, "another layout")
    dist = GatheringDist(0, [None, theirs])
    monkeypatch.setattr(sampler_mod, "torch_distributed", lambda: dist)
    monkeypatch.setattr("dlfs.order.ranks.torch_distributed", lambda: dist)
    with caplog.at_level(logging.WARNING, logger=LOG):
        s = DLFSSampler([f"p{i}" for i in range(60)], mode="locality",
                        client=GivenClient(loc))
    assert s.mode == "random"
    [warning] = caplog.records
    assert ("no locality" if other == "none" else "different chunk layouts") \
        in warning.getMessage()


# -- input ---------------------------------------------------------------------------

def test_dataset_objects_give_their_paths(tmp_path):
    class ImageFolderLike:
        def __init__(self):
            self.samples = [(str(tmp_path / f"c{i % 2}/{i}.jpg"), i % 2) for i in range(4)]
            self.imgs = self.samples

    class Files:
        def __init__(self):
            self.files = [tmp_path / "a", b"/b", "c"]

    assert dataset_paths(ImageFolderLike()) == ([p for p, _ in ImageFolderLike().samples], 4)
    assert dataset_paths(Files()) == ([str(tmp_path / "a"), "/b", "c"], 3)
    assert dataset_paths(("x", "y")) == (["x", "y"], 2)
    assert dataset_paths(np.array(["x", "y"])) == (["x", "y"], 2)
    assert dataset_paths(range(5)) == (None, 5)

    class Subset:  # torch.utils.data.Subset's shape
        def __init__(self, dataset, indices):
            self.dataset, self.indices = dataset, indices

        def __len__(self):
            return len(self.indices)

    assert dataset_paths(Subset(Files(), [2, 0])) == (["c", str(tmp_path / "a")], 2)
    assert dataset_paths(Subset(range(9), [3, 4, 5])) == (None, 3)
    with pytest.raises(ValueError, match="not one path"):
        dataset_paths("/mnt/dlfs/ds")
    with pytest.raises(ValueError, match="no length"):
        dataset_paths(iter([1, 2]))


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 2, "world_size": 2}, "rank 2 is not in 0..1"),
    ({"rank": -1, "world_size": 2}, "rank -1"),
    ({"world_size": 0}, "world_size must be at least 1"),
    ({"mode": "sequential"}, "mode must be one of random, locality"),
    ({"window": 0}, "window must be an integer >= 1"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"batch_size": 0}, "batch_size"),
    ({"rank": "one", "world_size": 2}, "rank must be an integer"),
])
def test_bad_arguments_are_clear_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DLFSSampler(["a", "b", "c"], **kwargs)


def test_an_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="empty"):
        DLFSSampler([])


def test_bad_rank_nodes_and_epochs_are_refused():
    client = GivenClient(synthetic_locality(10, 1, 2))
    with pytest.raises(ValueError, match="one node index per rank"):
        DLFSSampler(list("abcdefghij"), world_size=2, rank=0, mode="locality", client=client,
                    rank_nodes=[0])
    with pytest.raises(ValueError, match=r"must lie in 0\.\.1"):
        DLFSSampler(list("abcdefghij"), world_size=2, rank=0, mode="locality", client=client,
                    rank_nodes=[0, 2])
    s = DLFSSampler(list("abc"))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="epoch"):
            s.set_epoch(bad)
        with pytest.raises(ValueError, match="epoch"):
            s.order(bad)


def test_rank_and_world_come_from_the_job_environment(monkeypatch):
    assert resolve_rank_world(None, None, {}) == (0, 1)
    assert resolve_rank_world(None, None, {"RANK": "2", "WORLD_SIZE": "4"}) == (2, 4)
    assert resolve_rank_world(None, None, {"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}) == (5, 8)
    both = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}
    assert resolve_rank_world(None, None, both) == (1, 2)
    assert resolve_rank_world(None, None, {"SLURM_PROCID": "0"}) == (0, 1)  # half a pair
    assert resolve_rank_world(3, None, {"RANK": "1", "WORLD_SIZE": "4"}) == (3, 4)
    with pytest.raises(ValueError, match="from RANK/WORLD_SIZE"):
        resolve_rank_world(None, None, {"RANK": "x", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match=r"rank 4 is not in 0\.\.3"):
        resolve_rank_world(None, None, {"RANK": "4", "WORLD_SIZE": "4"})
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    s = DLFSSampler([f"p{i}" for i in range(10)])
    assert (s.rank, s.world_size, len(s)) == (1, 3, 4)


# -- output --------------------------------------------------------------------------

def test_write_order_writes_this_ranks_epoch_as_a_file_list(tmp_path):
    paths = [f"/mnt/dlfs/ds/{i:03d} é.jpg" for i in range(30)]
    s = DLFSSampler(paths, rank=1, world_size=4, seed=9)
    s.set_epoch(2)
    out = tmp_path / "list.txt"
    assert write_order(s, out) == len(s)
    assert out.read_text().splitlines() == [paths[i] for i in s.order()]
    assert write_order(s, out, epoch=3) == len(s)
    assert out.read_text().splitlines() == [paths[i] for i in s.order(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.txt"]
    with pytest.raises(ValueError, match="newline"):
        write_order(DLFSSampler(["a\nb"]), tmp_path / "bad.txt")


def test_importing_the_sampler_imports_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from dlfs.order.sampler import DLFSSampler\n"
            "s = DLFSSampler(['a', 'b', 'c'], rank=0, world_size=1)\n"
            "assert sorted(s) == [0, 1, 2]\n"
            "del sys.modules['torch']\n"
            "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_public_names_stay_importable():
    """README and docs/ORDER.md name `dlfs.sampler` and `dlfs.orderclient`: re-exports of
    dlfs.order.sampler and dlfs.order.client, the same objects."""
    import dlfs.order.client
    import dlfs.order.sampler
    import dlfs.orderclient
    from dlfs.sampler import DLFSSampler, write_order

    assert DLFSSampler is dlfs.order.sampler.DLFSSampler
    assert write_order is dlfs.order.sampler.write_order
    assert dlfs.orderclient.connect is dlfs.order.client.connect
