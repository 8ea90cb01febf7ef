"""`dlfs order`: one epoch as a file list, equal to what DLFSSampler iterates."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from conftest import run_dlfs

from dlfs.order.sampler import DLFSSampler


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "samples"
    for d in ("a", "b"):
        (root / d).mkdir(parents=True)
        for i in range(5):
            (root / d / f"{i}.bin").write_bytes(bytes([i]) * (i + 1))
    return root


def files_under(root) -> list[str]:
    return sorted(os.path.join(top, f) for top, _, files in os.walk(root) for f in files)


def test_the_lists_of_all_ranks_are_the_samplers_orders_and_cover_every_sample(tree, tmp_path):
    lists = []
    for rank in range(3):
        out = tmp_path / f"rank{rank}.txt"
        r = run_dlfs("order", tree, "-o", out, "--seed", "7", "--epoch", "2", "--rank",
                     str(rank), "--world-size", "3")
        assert r.returncode == 0, r.stderr
        lists.append(out.read_text().splitlines())
        paths = files_under(tree)
        sampler = DLFSSampler(paths, seed=7, rank=rank, world_size=3)
        assert lists[-1] == [paths[i] for i in sampler.order(2)]
    counts = Counter(p for lines in lists for p in lines)
    assert set(counts) == set(files_under(tree))  # 10 samples padded to 12
    assert sorted(counts.values()) == [1] * 8 + [2, 2]


def test_a_list_file_is_a_source_too(tree, tmp_path):
    listing = tmp_path / "paths.txt"
    listing.write_text("".join(p + "\n" for p in files_under(tree)))
    r = run_dlfs("order", listing, "-o", tmp_path / "out.txt", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert sorted((tmp_path / "out.txt").read_text().splitlines()) == files_under(tree)


@pytest.mark.parametrize(("args", "message"), [
    (["--rank", "3", "--world-size", "3"], "--rank 3 must be below --world-size 3"),
    (["--window", "0"], "--window"),
])
def test_bad_flags_get_one_line(tree, tmp_path, args, message):
    r = run_dlfs("order", tree, "-o", tmp_path / "out.txt", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out.txt").exists()


def test_a_missing_or_empty_source_gets_one_line(tmp_path):
    r = run_dlfs("order", tmp_path / "nope", "-o", tmp_path / "out.txt")
    assert r.returncode == 1 and "cannot read" in r.stderr and "nope" in r.stderr
    (tmp_path / "empty").mkdir()
    r = run_dlfs("order", tmp_path / "empty", "-o", tmp_path / "out.txt")
    assert r.returncode == 1 and "no samples in" in r.stderr


def test_locality_through_a_mount_keeps_its_mode(mounted, store_with, tree, tmp_path):
    mount = mounted(store_with(tree))
    out = tmp_path / "out.txt"
    r = run_dlfs("order", mount / "ds", "-o", out, "--mode", "locality")
    assert r.returncode == 0 and "WARNING" not in r.stderr, r.stderr
    assert sorted(os.path.relpath(p, mount / "ds") for p in out.read_text().splitlines()) \
        == sorted(os.path.relpath(p, tree) for p in files_under(tree))


def test_resume_writes_the_rest_of_a_stopped_epoch_for_a_new_world(tree, tmp_path):
    """A 2-rank job read 3 samples each of epoch 4; 3 ranks get the rest from the CLI:
    together every sample once (10 samples, 4 left, padded to 6)."""
    paths = files_under(tree)
    first = [DLFSSampler(paths, seed=7, rank=r, world_size=2) for r in range(2)]
    for s in first:
        s.set_epoch(4)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first[1].state_dict(consumed=3)))
    rest = []
    for rank in range(3):
        out = tmp_path / f"rest{rank}.txt"
        r = run_dlfs("order", tree, "-o", out, "--resume", state, "--rank", str(rank),
                     "--world-size", "3")
        assert r.returncode == 0, r.stderr
        assert "wrote 2 paths left of epoch 4, rank" in r.stdout
        rest += out.read_text().splitlines()
    read = [paths[i] for s in first for i in s.order(4)[:3]]
    assert set(read) | set(rest) == set(paths) and not set(read) & set(rest)
    assert len(rest) == 6 and len(set(rest)) == 4


def test_resume_refuses_another_list_or_a_bad_state_in_one_line(tree, tmp_path):
    state = tmp_path / "state.json"
    state.write_text(json.dumps(DLFSSampler(files_under(tree)[1:]).state_dict()))
    r = run_dlfs("order", tree, "-o", tmp_path / "out.txt", "--resume", state)
    assert r.returncode == 1 and "another sample list" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and str(state) in r.stderr
    state.write_text("{not json")
    r = run_dlfs("order", tree, "-o", tmp_path / "out.txt", "--resume", state)
    assert r.returncode == 1 and "is not a JSON sampler state" in r.stderr
    state.write_text(json.dumps(DLFSSampler(files_under(tree)).state_dict()))
    r = run_dlfs("order", tree, "-o", tmp_path / "out.txt", "--resume", state, "--epoch", "3")
    assert r.returncode == 2 and "--epoch 3 is not the epoch 0" in r.stderr
    assert not (tmp_path / "out.txt").exists()
