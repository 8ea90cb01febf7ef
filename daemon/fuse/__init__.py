"""FUSE adapters: translate kernel requests to Namespace calls and answers back; decide nothing.

`ops` is the pyfuse3 adapter (`--workers 1`), `wireworker` the forked workers
that speak the kernel protocol themselves (`fusewire` layouts, `listing` and
`splicer` for bulk replies), `errnomap` the one exception -> errno table.
"""
