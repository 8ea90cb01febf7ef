"""FUSE adapters: translate kernel requests to Namespace calls and answers back; decide nothing.

`session` mounts and answers INIT through pyfuse3 (libfuse), `wireworker` is the
adapter: the forked workers that serve every other request, speaking the kernel
protocol themselves (`fusewire` layouts, `listing` and `splicer` for bulk
replies); `errnomap` is the one exception -> errno table.
"""
