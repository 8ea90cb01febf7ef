"""The store: a dataset's on-disk form (chunk files + manifest), and making, opening, checking it;
which live mounts use a dataset (inuse).

Pure file and numpy code: no daemon, no cluster, no FUSE; login nodes and MPI
ranks import it to populate.
"""
