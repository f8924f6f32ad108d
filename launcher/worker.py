"""One rank of a chunkring job: bring up, run the job, report, tear down. Started by ``chunkring-launch``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from chunkring import RankInfo, init
from chunkring.errors import ChunkringError, ChunkringUsageError

from .config import from_table, load_table, parse_overrides
from .jobs import JOBS


def run_job(job: str, config_name: str, overrides=(), *, json_path: str | None = None) -> int:
    """Run ``job`` in this process (one rank); rank 0 prints the table. Returns the exit status."""
    module = JOBS[job]
    try:
        config = from_table(module.CONFIG, {**load_table(config_name), **parse_overrides(overrides)}, job=job)
    except ChunkringUsageError as exc:
        print(f"chunkring-launch: bad config: {exc}", file=sys.stderr)
        return 2
    runtime = None
    try:
        runtime = init()
        figures = module.run(runtime, config)
        all_figures = _gather(runtime, figures)
        if runtime.rank == 0:
            _print_table(job, runtime, all_figures)
            if json_path:
                with open(json_path, "w") as out:
                    json.dump(report(job, config, runtime, all_figures), out, indent=2)
        runtime.close()
        return 0
    except ChunkringError as exc:
        rank = runtime.rank if runtime else RankInfo.from_env().rank
        print(f"chunkring-launch: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
    except Exception:
        traceback.print_exc()
    _abort_others(runtime)
    return 1


def report(job: str, config, runtime, all_figures: list) -> dict:
    """The machine-readable result of a passed job: what ran where, and every rank's figures (keys
    ``rank<r>_<figure>``), in the shape of the committed result files (tests/gpu_results/README.md)."""
    import dataclasses

    import torch

    from chunkring.device import nvshmem_version

    figures = {f"rank{r}_{key}": value for r, f in enumerate(all_figures) for key, value in f.items()}
    return {
        "commit": os.environ.get("CHUNKRING_COMMIT") or _git_commit(),
        "gpu": torch.cuda.get_device_name(runtime.ordinal),
        "gpus": torch.cuda.device_count(),
        "ranks": runtime.world_size,
        "suite": job,
        "command": " ".join(["chunkring-launch", job] + [f"{k}={v!r}" for k, v in dataclasses.asdict(config).items()]),
        "passed": 1,
        "failed": 0,
        "skipped": 0,
        "config": dataclasses.asdict(config),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "nvshmem": nvshmem_version()},
        "figures": figures,
    }


def _git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _gather(runtime, figures: dict) -> list:
    if runtime.world_size == 1:
        return [figures]
    from mpi4py import MPI

    return MPI.COMM_WORLD.gather(figures, root=0)


def _abort_others(runtime) -> None:
    # A rank that fails alone would leave the others waiting in a collective forever - also when it
    # failed before its runtime existed (the others then wait in NVSHMEM's bootstrap).
    world_size = runtime.world_size if runtime is not None else RankInfo.from_env().world_size
    if world_size > 1:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


def _print_table(job: str, runtime, all_figures: list) -> None:
    import torch

    keys = sorted({k for f in all_figures for k in f})
    print(f"chunkring {job}: PASS on {runtime.world_size} rank(s), {torch.cuda.get_device_name(runtime.ordinal)}")
    width = max(len(k) for k in keys) if keys else 0
    print(f"{'figure':<{width}}  " + "  ".join(f"rank {r:<4}" for r in range(len(all_figures))))
    for key in keys:
        cells = []
        for figures in all_figures:
            value = figures.get(key)
            cells.append(f"{value:<9.3f}" if isinstance(value, float) else f"{str(value if value is not None else '-'):<9}")
        print(f"{key:<{width}}  " + "  ".join(cells))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkring.launcher.worker")
    parser.add_argument("job", choices=sorted(JOBS))
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    return run_job(args.job, args.config, args.overrides, json_path=args.json)


if __name__ == "__main__":
    sys.exit(main())
