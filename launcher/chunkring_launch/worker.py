"""One rank of a chunkring job: bring up, run the job, report, tear down. Started by ``chunkring-launch``.

A failing rank writes its diagnostic to the launcher's job directory (``CHUNKRING_JOB_DIR``); only the
first rank to fail also prints it, so the user reads one diagnostic, not one per rank. Then it aborts
the MPI job, so no rank waits in a collective. Without a job directory (run under your own mpirun) every
failing rank prints its own.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from chunkring import RankInfo, Runtime, init
from chunkring.errors import ChunkringError, ChunkringUsageError
from chunkring.hostcomm import HostComm

from . import exitcodes, progress
from .config import job_config
from .jobdir import JOB_DIR_VAR, record_failure, stack_path
from .jobs import JOBS


class HostRuntime(HostComm):
    """What a job that needs no GPU (``NEEDS_GPU = False``) gets instead of :func:`chunkring.init`: the
    job's host collectives (rank, world size, barrier, gather, broadcast: :class:`chunkring.hostcomm.HostComm`)
    and a ``close()`` that has nothing to do."""

    @property
    def comm(self) -> HostComm:
        return self

    def close(self) -> None:
        pass


#: What a job's ``run`` gets: the GPU runtime, or the host-only one of a job with ``NEEDS_GPU = False``.
JobRuntime = Runtime | HostRuntime


def run_job(job: str, config_name: str, overrides: Sequence[str] = (), *, json_path: str | None = None,
            show_progress: bool = False) -> int:
    """Run ``job`` in this process (one rank); rank 0 prints the table. Returns the exit status."""
    module = JOBS[job]
    try:
        config = job_config(module.CONFIG, config_name, overrides, job=job)
    except ChunkringUsageError as exc:
        print("\n".join(f"chunkring-launch: bad config: {line}" for line in str(exc).splitlines()), file=sys.stderr)
        return exitcodes.USAGE
    progress.enable(show_progress)
    _dump_stack_on_sigterm()
    runtime: JobRuntime | None = None
    try:
        runtime = init() if getattr(module, "NEEDS_GPU", True) else HostRuntime(RankInfo.from_env())
        figures = module.run(runtime, config)
        all_figures = runtime.gather_object(figures, root=0)
        if all_figures is not None:  # rank 0
            _print_table(job, runtime, all_figures)
            if json_path:
                with open(json_path, "w") as out:
                    json.dump(report(job, config, runtime, all_figures), out, indent=2)
        runtime.close()
        return exitcodes.PASSED
    except KeyboardInterrupt:  # the launcher forwarded Ctrl-C to a single worker: it reports that itself
        _abort_others(runtime)
        return exitcodes.INTERRUPTED
    except ChunkringError as exc:  # its notes: which ring, and this rank's protocol words (Ring.check)
        _report_failure(runtime, "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])]))
    except Exception:  # noqa: BLE001 - any error of any rank must end the whole job, with its diagnostic
        _report_failure(runtime, traceback.format_exc().rstrip("\n"))
    _abort_others(runtime)
    return exitcodes.FAILED


def _rank(runtime: JobRuntime | None) -> int:
    return runtime.rank if runtime is not None else RankInfo.from_env().rank


def _report_failure(runtime: JobRuntime | None, what: str) -> None:
    rank = _rank(runtime)
    text = f"chunkring-launch: rank {rank}: {what}\n"
    job_dir = os.environ.get(JOB_DIR_VAR)
    if job_dir and not record_failure(job_dir, rank, text):
        return  # another rank failed first and printed its diagnostic; ours is in the job directory
    sys.stderr.write(text)
    sys.stderr.flush()


def _dump_stack_on_sigterm() -> None:
    """When the job is ended from outside (--timeout, Ctrl-C: Open MPI sends SIGTERM first), write this
    rank's Python stack to the job directory, then die as SIGTERM would: where a hung rank waited."""
    job_dir = os.environ.get(JOB_DIR_VAR)
    if not job_dir or not hasattr(signal, "SIGTERM"):
        return
    stack_file = open(stack_path(job_dir, RankInfo.from_env().rank), "w")  # noqa: SIM115 - kept open for the handler
    faulthandler.register(signal.SIGTERM, file=stack_file, all_threads=True, chain=True)


def report(job: str, config: Any, runtime: JobRuntime, all_figures: list[dict[str, Any]]) -> dict[str, Any]:
    """The machine-readable result of a passed job: what ran where, and every rank's figures (keys
    ``rank<r>_<figure>``), in the shape of the committed result files (tests/gpu_results/README.md)."""
    import dataclasses

    import torch

    from chunkring.jit import nvshmem_version
    from chunkring.testing import records

    figures = {f"rank{r}_{key}": value for r, f in enumerate(all_figures) for key, value in f.items()}
    command = " ".join(["chunkring-launch", job] + [f"{k}={v!r}" for k, v in dataclasses.asdict(config).items()])
    return {
        **records.header(suite=job, ranks=runtime.world_size, command=command, passed=1, failed=0,
                         gpu=_device_name(runtime)),
        "config": dataclasses.asdict(config),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "nvshmem": nvshmem_version()},
        "figures": figures,
    }


def _abort_others(runtime: JobRuntime | None) -> None:
    # A rank that fails alone would leave the others waiting in a collective forever - also when it
    # failed before its runtime existed (the others then wait in NVSHMEM's bootstrap).
    comm = runtime.comm if runtime is not None else None
    (comm or HostComm.from_env()).abort(1)


def _device_name(runtime: JobRuntime) -> str:
    if isinstance(runtime, HostRuntime):
        return "host only (no GPU)"
    import torch

    return torch.cuda.get_device_name(runtime.ordinal)


def _print_table(job: str, runtime: JobRuntime, all_figures: list[dict[str, Any]]) -> None:
    keys = sorted({k for f in all_figures for k in f})
    print(f"chunkring {job}: PASS on {runtime.world_size} rank(s), {_device_name(runtime)}")
    width = max(len(k) for k in keys) if keys else 0
    print(f"{'figure':<{width}}  " + "  ".join(f"rank {r:<4}" for r in range(len(all_figures))))
    for key in keys:
        cells = []
        for figures in all_figures:
            value = figures.get(key)
            cells.append(f"{value:<9.3g}" if isinstance(value, float)
                         else f"{value if value is not None else '-'!s:<9}")
        print(f"{key:<{width}}  " + "  ".join(cells))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkring_launch.worker")
    parser.add_argument("job", choices=sorted(JOBS))
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--json", default=None)
    parser.add_argument("--progress", action="store_true", help="rank 0 reports progress to the launcher")
    args = parser.parse_args(argv)
    return run_job(args.job, args.config, args.overrides, json_path=args.json, show_progress=args.progress)


if __name__ == "__main__":
    sys.exit(main())
