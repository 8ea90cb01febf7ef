"""`dlfs slurm-secret|slurm-ckpt-dir|doctor|demo`: setting up and trying out a node,
before any real dataset is mounted.

slurm-secret is what a Slurm prolog runs to give a job its secret, slurm-ckpt-dir
makes the job's checkpoint directory for its user (by descriptors), doctor says
whether this node can mount at all, demo runs the whole single-node story on
generated data. The work is in dlfs.cluster.slurm, dlfs.cli.doctor and
dlfs.cli.demo; here are their flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dlfs.cli.common import Subparsers, _id, _path, _port, _positive, _size, add_command, node_items
from dlfs.errors import EXIT_OK, UsageError


def register(subs: Subparsers) -> None:
    """Add the setup commands, in the order `dlfs --help` lists them."""
    _add_slurm_secret(subs)
    _add_slurm_ckpt_dir(subs)
    _add_doctor(subs)
    _add_demo(subs)


def _add_slurm_secret(subs: Subparsers) -> None:
    p = add_command(
        subs, "slurm-secret", cmd_slurm_secret,
        "write a job's secret (HMAC of the site key and the job id) 0600 for its user",
        "example (in the prolog, as root):\n"
        "  dlfs slurm-secret --key-file /etc/dlfs/site.key --job-id $SLURM_JOB_ID \\\n"
        "      --out /run/dlfs-slurm/$SLURM_JOB_ID/secret --uid $SLURM_JOB_UID "
        "--gid $SLURM_JOB_GID\n"
        "\nEvery node of a job derives the same secret; no node needs to talk to another.")
    p.add_argument("--key-file", type=_path, required=True,
                   help="site key (root-only, mode 0600)")
    p.add_argument("--job-id", required=True, type=_id, help="the Slurm job id")
    p.add_argument("--out", type=_path, required=True,
                   help="secret file to write (replaced atomically)")
    p.add_argument("--uid", type=_id, help="owner of the secret file (the job's user)")
    p.add_argument("--gid", type=_id, help="group of the secret file")


def cmd_slurm_secret(args: argparse.Namespace) -> int:
    """Run by the prolog on every node: each derives the same secret from
    the site key and the job id, with no node talking to another."""
    from dlfs.cluster.slurm import derive_job_secret, read_site_key, write_secret_file

    secret = derive_job_secret(read_site_key(args.key_file), str(args.job_id))
    write_secret_file(args.out, secret, args.uid, args.gid)
    return EXIT_OK


def _add_slurm_ckpt_dir(subs: Subparsers) -> None:
    p = add_command(
        subs, "slurm-ckpt-dir", cmd_slurm_ckpt_dir,
        "make a job's checkpoint directory 0700 for its user, never following a link",
        "example (in the prolog, as root):\n"
        "  dlfs slurm-ckpt-dir '/lustre/dlfs-ckpt/%j' --job-id $SLURM_JOB_ID \\\n"
        "      --node $SLURMD_NODENAME --uid $SLURM_JOB_UID --gid $SLURM_JOB_GID\n"
        "\nPrints the directory. The part of PATTERN before the first %-code is the site's\n"
        "(resolved, created if missing, owned by root or the user); every directory after\n"
        "it is made (or found, owned by root or the user) by descriptors, a symlink\n"
        "refused, and given to the user 0700.")
    p.add_argument("pattern", help="DLFS_CKPT_STORE: %%j job id, %%n node, %%%% a %%")
    p.add_argument("--job-id", required=True, type=_id, help="the Slurm job id")
    p.add_argument("--node", required=True, help="this node's name (SLURMD_NODENAME)")
    p.add_argument("--uid", type=_id, required=True, help="the job's user")
    p.add_argument("--gid", type=_id, required=True, help="the job's group")


def cmd_slurm_ckpt_dir(args: argparse.Namespace) -> int:
    """Run by the prolog as root (dlfs.cluster.slurm.make_job_dir does the work)."""
    from dlfs.cluster.slurm import make_job_dir

    print(make_job_dir(args.pattern, str(args.job_id), args.node, args.uid, args.gid))
    return EXIT_OK


def _add_doctor(subs: Subparsers) -> None:
    """Each flag adds the checks of one thing a mount would use."""
    p = add_command(
        subs, "doctor", cmd_doctor,
        "check that this node can mount DLFS: FUSE, dependencies, store, cache dir, port",
        "examples:\n  dlfs doctor\n"
        "  dlfs doctor --store /lustre/store --cache-dir /local/nvme/dlfs --port 7000\n"
        "  dlfs doctor --nodes-file nodes.txt --secret-file job.secret\n"
        "\nOne line per check (ok / warn / FAIL with what to do); exit code 1 if any "
        "failed.")
    p.add_argument("--store", type=_path, help="also check this store and every dataset's manifest")
    p.add_argument("--cache-dir", type=_path,
                   help="also check this cache dir is writable with free space")
    p.add_argument("--port", type=_port, help="also check this peer port is free")
    p.add_argument("--port-span", type=_positive, default=0, metavar="N",
                   help="with --port: check the N ports from PORT that Slurm jobs take "
                        "(dlfs.conf DLFS_PORT_BASE/DLFS_PORT_SPAN): how many are in use")
    p.add_argument("--nodes", action="append", metavar="NAME=HOST:PORT,...",
                   help="also check a pool's node list (as for mount): this node is in it, "
                        "its port is free")
    p.add_argument("--nodes-file", type=_path, help="the node list from a file, as for mount")
    p.add_argument("--node", help="this node's NAME in the list (default: the host name)")
    p.add_argument("--secret-file", type=_path,
                   help="also check a pool's secret file (mode 0600, long enough)")


def cmd_doctor(args: argparse.Namespace) -> int:
    """Thin: dlfs.cli.doctor runs the checks the flags ask for."""
    from dlfs.cli.doctor import doctor

    return doctor(args.store, args.cache_dir, args.port, nodes=node_items(args),
                  node=args.node, secret_file=args.secret_file, port_span=args.port_span)


def _add_demo(subs: Subparsers) -> None:
    p = add_command(
        subs, "demo", cmd_demo,
        "generate a dataset, pack it, mount it, read it like a training epoch, unmount",
        "examples:\n  dlfs demo\n  dlfs demo --files 20000 --workers 4 --keep")
    p.add_argument("--files", type=_positive, default=4000, help="samples to generate (4000)")
    p.add_argument("--mean-size", type=_size, default=110 * 1024,
                   help="mean sample size (110K, like ImageNet JPEGs)")
    p.add_argument("--workers", type=_positive, default=4, help="reader processes (4)")
    p.add_argument("--workdir", type=_path,
                   help="make the demo's directory (source, store, mountpoint) in here, and "
                        "remove it at the end (default: /var/tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")


def cmd_demo(args: argparse.Namespace) -> int:
    """Thin: dlfs.cli.demo; --mean-size 0 is refused here, where the flags are."""
    from dlfs.cli.demo import run_demo

    if args.mean_size < 1:
        raise UsageError("--mean-size must be at least 1 byte")

    return run_demo(args.files, args.mean_size, args.workers,
                    Path(args.workdir) if args.workdir else None, args.keep)
