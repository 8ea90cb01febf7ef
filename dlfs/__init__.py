"""DLFS core library and the `dlfs` command.

The modules here are the basics every part uses (errors, sizes, config, the
launcher/daemon contract, the runtime dir, /proc); the folders hold the store
(`store`), a job's nodes (`cluster`), what a daemon reports as read back (`obs`),
epoch order (`order`, public as `dlfs.sampler`), generated demo data (`demo`)
and the command line (`cli`). It imports without the daemon's libraries, so
`dlfs populate` runs on login nodes and inside MPI ranks; the daemon is `dlfsd`.
"""

__version__ = "0.1.0"
