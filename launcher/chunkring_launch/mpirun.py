"""The commands a launch runs: one rank's worker command, the ``mpirun`` (Open MPI) line that starts every
rank with the variables they need, and the environment checks of a multi-node job."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, MutableMapping

from chunkring.errors import ChunkringUsageError

__all__ = ["FORWARDED_PREFIXES", "mpirun_command", "multi_node_environment", "worker_command"]

#: Variables every rank must see: ours, NVSHMEM's and the MPS pipe (Open MPI forwards only what -x names).
FORWARDED_PREFIXES = ("CHUNKRING_", "NVSHMEM_", "NCCL_", "TORCH_SYMM_MEM_", "CUDA_MPS_", "CUDA_VISIBLE_DEVICES",
                      "CUDA_MODULE_LOADING",
                      "PYTHONPATH")

#: Single-node settings a multi-node job must not carry to its ranks (chunkring.env.SINGLE_NODE_DEFAULTS):
#: with them NVSHMEM would have no network transport and bootstrap on loopback only.
_SINGLE_NODE_ONLY = {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}


def worker_command(args: argparse.Namespace, *, progress: bool = False) -> list[str]:
    """One rank's command: the worker module with the job, its config and overrides."""
    cmd = [sys.executable, "-m", "chunkring_launch.worker", args.job, args.config or args.job, *args.overrides]
    if progress:
        cmd.append("--progress")
    if args.json:
        cmd += ["--json", args.json]
    return cmd


def mpirun_command(args: argparse.Namespace, ranks: int, environ: Mapping[str, str], *,
                   progress: bool = False) -> list[str]:
    """The exact mpirun command line for ``args`` (Open MPI), forwarding every variable ranks need."""
    cmd = ["mpirun", "-np", str(ranks), "--timeout", str(args.timeout)]
    if not (args.hostfile or args.host):
        # Several ranks on this node's GPUs (or one GPU under MPS) may outnumber its cores; across nodes
        # the hostfile's slots say where ranks go, and oversubscribing would hide a wrong one.
        cmd.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
    if args.host:
        cmd += ["--host", args.host]
    if getattr(args, "npernode", None):
        cmd += ["--map-by", f"ppr:{args.npernode}:node"]  # N ranks on each node, in node order
    for name in sorted(environ):
        if name.startswith(FORWARDED_PREFIXES):
            cmd += ["-x", name]
    return cmd + worker_command(args, progress=progress)


def multi_node_environment(args: argparse.Namespace, environ: MutableMapping[str, str]) -> None:
    """For a ``--hostfile``/``--host`` job: set the bootstrap interface from ``--ifname`` and refuse the
    single-node settings (a ``ChunkringUsageError`` naming the variable). NVSHMEM's network transport is
    what its own default picks (``NVSHMEM_REMOTE_TRANSPORT`` unset: IB RC through its proxy) unless the
    caller exported another (``libfabric`` with ``NVSHMEM_LIBFABRIC_PROVIDER=efa`` on EFA); either way it is
    forwarded with every other ``NVSHMEM_`` variable (docs/LAUNCHER.md, "Two nodes")."""
    if args.ifname:
        environ["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = args.ifname
    if environ.get("NVSHMEM_IB_ENABLE_IBGDA", "0").lower() in ("1", "true", "y", "yes"):
        raise ChunkringUsageError("chunkring's kernels are built with NVSHMEM's IBGDA device code compiled out "
                                  "(NVRTC cannot link it: docs/BUILD.md); use the proxy transport (unset it)",
                                  field="NVSHMEM_IB_ENABLE_IBGDA")
    for name, value in _SINGLE_NODE_ONLY.items():
        if environ.get(name) == value:
            raise ChunkringUsageError(f"{name}={value} is a single-node setting; a --hostfile/--host job needs "
                                      f"{'a network transport' if value == 'none' else 'a routable interface'} "
                                      f"(unset it{'; or give --ifname' if value == 'lo' else ''})", field=name)
