"""FUSE adapters: translate kernel requests to Namespace calls and answers back; decide nothing.

`session` mounts the datasets and answers their INIT with `rawsession` (as the
checkpoint directory's connection is set up), `wireworker` is the
adapter: the forked workers that serve every other request, speaking the kernel
protocol themselves (`fusewire` layouts, `listing` and `splicer` for bulk
replies); `errnomap` is the one exception -> errno table.
"""
