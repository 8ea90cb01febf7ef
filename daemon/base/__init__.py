"""The daemon's basics: what any part of it may use, importing no other part.

Which process this is (`slots`), store pacing (`throttle`), page-cache reads that
never wait (`nowait`), what the running kernel's FUSE does (`kernel`), forked
processes dying with their parent (`lineage`), who the mount is for (`access`),
and the checkpoint subtree's node ids (`nodeids`).
"""
