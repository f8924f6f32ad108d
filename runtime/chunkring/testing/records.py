"""The JSON result file every benchmark script writes: the keys of the committed results
(tests/gpu_results/README.md) and the benchmark's figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: "1" when the tree that ran differed from the commit it names (``CHUNKRING_COMMIT``), "0" when it did not.
#: scripts/gpu_suite.sh and scripts/bench.sh set it from ``git status --porcelain``; a copy without .git (the
#: GPU host's) cannot tell, so its caller passes it. Unset: nobody said, and the record says ``null``.
TREE_MODIFIED_VAR = "CHUNKRING_TREE_MODIFIED"


def tree_modified() -> bool | None:
    """Whether the tree that ran differed from its commit: True, False, or None where nobody said."""
    value = os.environ.get(TREE_MODIFIED_VAR, "").strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    return None


def commit() -> str:
    """The commit that ran: ``CHUNKRING_COMMIT`` where the caller said (the GPU host's copy has no .git), else
    the checkout's HEAD, else "unknown"."""
    said = os.environ.get("CHUNKRING_COMMIT")
    if said:
        return said
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True,
                             timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def header(*, suite: str, ranks: int, command: str, passed: int, failed: int, skipped: int = 0,
           gpu: str | None = None) -> dict[str, object]:
    """The keys every result file starts with (tests/gpu_results/README.md): the commit (:func:`commit`) and
    whether the tree differed from it, the machine (``gpu``: the first GPU's name unless given; "none" where
    torch sees no GPU), and what ran with its counts."""
    import torch

    from chunkring.testing.machine import driver_version

    gpus = torch.cuda.device_count()
    if gpu is None:
        gpu = torch.cuda.get_device_name(0) if gpus else "none"
    else:
        gpus = max(gpus, 1)  # a record written away from its card (a profile summarised elsewhere) names one
    return {"commit": commit(), "tree_modified": tree_modified(),
            "gpu": gpu, "gpus": gpus, "driver": driver_version(), "torch": torch.__version__, "ranks": ranks,
            "suite": suite, "command": command, "passed": passed, "failed": failed, "skipped": skipped}


def write(path: str, *, suite: str, world_size: int, figures: dict, records: list[dict] | None = None,
          files: list[str] | None = None, incomplete: bool = False, passed: int = 1, failed: int = 0,
          gpu: str | None = None) -> None:
    """The summary keys (:func:`header`), ``figures`` (name -> number), and where given ``records`` (one dict
    per measured case, for benchmarks whose results are a table) and ``files`` (names of figures written beside
    it). ``incomplete``: the run is still going (a benchmark that rewrites its record after each row, so a run
    cut short by its time limit leaves what it measured, marked so). ``passed`` / ``failed``: the cases a
    benchmark measured and those it could not (default: one run that completed). ``gpu``: the card that ran, where
    the record is written elsewhere (a profiler's report summarised on another machine)."""
    summary = header(suite=suite, ranks=world_size, command=" ".join(sys.argv), passed=passed, failed=failed, gpu=gpu)
    summary["figures"] = figures
    if records is not None:
        summary["records"] = records
    if files is not None:
        summary["files"] = files
    if incomplete:
        summary["incomplete"] = True
    with open(path, "w") as out:
        json.dump(summary, out, indent=2)


def write_table(path: str | None, *, suite: str, rows: list[dict], incomplete: bool = False) -> None:
    """A table benchmark's record (:func:`write`, one rank): ``rows`` as its records, and every float of a row as
    a figure named ``<shape>_<tokens>_<key>``. Nothing without a ``path``."""
    if path is None:
        return
    write(path, suite=suite, world_size=1, records=rows, incomplete=incomplete,
          figures={f"{r['shape']}_{r['tokens']}_{k}": v for r in rows for k, v in r.items() if isinstance(v, float)})
