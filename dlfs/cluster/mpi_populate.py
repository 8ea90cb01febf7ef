"""`mpirun -n N dlfs populate ...`: the ranks share the copying, rank 0 publishes.

Rank 0 scans the source and lays out the dataset exactly as a serial
populate would (dlfs.store.populate.plan_populate), creates the temporary
directory and broadcasts the plan. The chunk layout is pure arithmetic, so
each rank writes its own contiguous, byte-balanced range of chunks into the
shared temporary directory and reports the checksums of its extents. Rank 0
combines them, writes the manifest and publishes with one rename. Any rank's
failure is shared with all ranks before anything is published: rank 0 prints
one line naming the rank and removes the temporary directory, so the result
is either a dataset identical to a serial populate's or nothing.

mpi4py is imported only here (optional dependency: pip install dlfs[mpi]).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from dlfs.errors import DlfsError, ReportedElsewhere
from dlfs.store.directory import SampleDirectory, chunk_lengths
from dlfs.store.populate import (
    PopulateOptions,
    PopulatePlan,
    default_jobs,
    interrupted_outcome,
    plan_populate,
    publish_dataset,
    start_temp_dir,
    store_error,
    write_chunks,
)
from dlfs.store.store import Dataset, Store

# Set by mpirun/mpiexec (Open MPI, MPICH/Hydra) and srun --mpi=pmi2/pmix.
WORLD_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def launched_by_mpi(env: Mapping[str, str]) -> bool:
    """True when a launcher started several ranks of us (then populate goes parallel)."""
    for var in WORLD_SIZE_VARS:
        value = env.get(var, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False


def chunk_owners(lengths: np.ndarray, ranks: int) -> np.ndarray:
    """Rank that writes each chunk: contiguous ranges with about equal bytes.

    Contiguous, because chunks follow the file order, so each rank reads its
    own part of the source tree; balanced by bytes, because the last chunk
    (and any chunk of a dataset with huge files) may be short.
    """
    lengths = np.asarray(lengths, dtype=np.uint64)
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int64)
    total = int(lengths.sum())
    starts = np.concatenate(([0], np.cumsum(lengths, dtype=np.uint64)[:-1])).astype(np.float64)
    if total == 0:
        return np.zeros(len(lengths), dtype=np.int64)
    return np.minimum((starts * ranks / total).astype(np.int64), ranks - 1)


def _comm():
    try:
        from mpi4py import MPI
    except ImportError:
        raise DlfsError("MPI populate needs mpi4py: pip install 'dlfs[mpi]' "
                        "(and an MPI library such as openmpi)") from None
    return MPI, MPI.COMM_WORLD


def mpi_populate(source: Path, store: Store, name: str,
                 options: PopulateOptions) -> Dataset | None:
    """Run one rank's part; rank 0 returns the published dataset, the others None.

    Raises DlfsError on rank 0 and ReportedElsewhere on the others when any rank failed.
    """
    mpi, comm = _comm()
    rank = comm.Get_rank()
    if rank != 0:
        options = replace(options, progress=False)  # one progress bar: rank 0's share
    # Ranks that may run on the same cores share them for the copy; the scan is rank
    # 0's alone (the others wait for the plan asleep, see _shared), so it gets all of
    # its cores.
    scan_options = options
    if options.jobs is None:
        scan_options = replace(options, jobs=default_jobs())
        options = replace(options, jobs=default_jobs(_ranks_sharing_my_cores(mpi, comm)))

    made: list[PopulatePlan] = []  # rank 0: the plan whose temporary directory it makes
    try:
        plan = _unpack_plan(_shared(comm, lambda: _plan_on_rank0(source, store, name,
                                                                 scan_options, made)))
        return _write_and_publish(mpi, comm, source, store, plan, options)
    except KeyboardInterrupt:  # mpirun/srun pass Ctrl-C and scancel's SIGTERM to every rank
        if rank != 0 or not made:
            raise
        shutil.rmtree(made[0].tmp, ignore_errors=True)
        raise KeyboardInterrupt(interrupted_outcome(store, made[0])) from None


def _ranks_sharing_my_cores(mpi, comm) -> int:
    """How many ranks of this node (this one included) may run on a core this one may
    run on. Unbound ranks share the node's cores; ranks bound to their own cores (what
    mpirun does by default for a few ranks: --bind-to core) share nothing, and their
    workers stay on their rank's cores (sched_getaffinity), so mpirun --bind-to none
    gives a node's ranks the whole node."""
    local = comm.Split_type(mpi.COMM_TYPE_SHARED)
    try:
        mine = os.sched_getaffinity(0)
        everyone = local.allgather(sorted(mine))
    finally:
        local.Free()
    return sum(1 for cores in everyone if mine.intersection(cores))


def _write_and_publish(mpi, comm, source: Path, store: Store, plan: PopulatePlan,
                       options: PopulateOptions) -> Dataset | None:
    rank, size = comm.Get_rank(), comm.Get_size()
    name = plan.name
    checksums, error = _write_share(source, plan, options, rank, size, store)
    errors = comm.allgather(error)
    combined = np.zeros_like(checksums) if rank == 0 else None
    comm.Reduce(checksums, combined, op=mpi.BOR, root=0)  # each extent set by one rank only
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        if rank == 0:
            shutil.rmtree(plan.tmp, ignore_errors=True)
        _raise(rank, *failed[0], len(failed))

    def publish() -> Dataset:
        try:
            publish_dataset(store, plan, combined, options)
        except OSError as err:
            raise store_error(err, store) from None
        finally:
            shutil.rmtree(plan.tmp, ignore_errors=True)  # gone after a successful rename
        return store.open(name)

    dataset = _shared(comm, publish, broadcast=False)
    return dataset if rank == 0 else None


def _plan_on_rank0(source: Path, store: Store, name: str, options: PopulateOptions,
                   made: list[PopulatePlan]) -> dict:
    """Plan and make the temporary directory; `made` gets the plan first, so that an
    interrupt from here on (even before every rank has the plan) removes that directory."""
    plan = plan_populate(source, store, name, options)
    made.append(plan)
    try:
        start_temp_dir(plan)
    except OSError as err:
        raise store_error(err, store) from None
    return _pack_plan(plan)


def _pack_plan(plan: PopulatePlan) -> dict:
    """The plan as plain picklable data: the directory in its manifest form (raw arrays)."""
    return {**plan.__dict__, "directory": plan.directory.to_manifest()}


def _unpack_plan(data: dict) -> PopulatePlan:
    return PopulatePlan(**{**data, "directory": SampleDirectory.from_manifest(data["directory"])})


def _shared(comm, work, broadcast: bool = True):
    """Run `work` on rank 0 and tell every rank how it went: its result (if
    `broadcast`) or its error, raised on every rank."""
    result, error = None, None
    if comm.Get_rank() == 0:
        try:
            result = work()
        except DlfsError as err:
            error = str(err)
        except BaseException as err:  # tell the others before going down
            _wait_for_all(comm)
            comm.bcast((None, f"rank 0 failed: {err!r}"), root=0)
            raise
    _wait_for_all(comm)
    shared, error = comm.bcast((result if broadcast else None, error), root=0)
    if error is not None:
        _raise(comm.Get_rank(), 0, error, 1)
    return result if comm.Get_rank() == 0 else shared


def _wait_for_all(comm, nap: float = 0.002) -> None:
    """A barrier that sleeps while it waits. A rank blocked in an MPI collective spins
    on its core (Open MPI polls), so the ranks waiting for rank 0's scan took CPU
    from its scan workers on a shared node; each rank calls this right before the
    broadcast that follows rank 0's work."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(nap)


def _write_share(source: Path, plan: PopulatePlan, options: PopulateOptions, rank: int,
                 size: int, store: Store) -> tuple[np.ndarray, str | None]:
    """Write this rank's chunks; returns (checksums with only ours set, error line or None)."""
    owners = chunk_owners(chunk_lengths(plan.directory), size)
    checksums = np.zeros(plan.directory.extent_count, dtype=np.uint64)
    try:
        checksums = write_chunks(source, plan.tmp, plan.directory, plan.dataset_uuid, options,
                                 chunks=owners == rank)
    except DlfsError as err:
        return checksums, str(err)
    except OSError as err:
        return checksums, str(store_error(err, store))
    return checksums, None


def _raise(rank: int, failed_rank: int, message: str, count: int) -> None:
    others = f" (and {count - 1} more ranks)" if count > 1 else ""
    line = f"rank {failed_rank} of the MPI populate{others}: {message}"
    if rank == 0:
        raise DlfsError(line)
    raise ReportedElsewhere(line)
