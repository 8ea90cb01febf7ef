"""`dlfs order`: one epoch as a file list, equal to what DLFSSampler iterates."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from conftest import run_dlfs

from dlfs.sampler import DLFSSampler


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
