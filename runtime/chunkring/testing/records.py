"""The JSON result file every benchmark script writes: the keys of the committed results
(tests/gpu_results/README.md) and the benchmark's figures."""

from __future__ import annotations

import json
import os
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


def write(path: str, *, suite: str, world_size: int, figures: dict, records: list[dict] | None = None,
          files: list[str] | None = None, incomplete: bool = False, passed: int = 1, failed: int = 0) -> None:
    """The summary keys, ``figures`` (name -> number), and where given ``records`` (one dict per measured
    case, for benchmarks whose results are a table) and ``files`` (names of figures written beside it).
    ``incomplete``: the run is still going (a benchmark that rewrites its record after each row, so a run cut
    short by its time limit leaves what it measured, marked so). ``passed`` / ``failed``: the cases a
    benchmark measured and those it could not (default: one run that completed)."""
    import torch

    summary: dict[str, object] = {
        "commit": os.environ.get("CHUNKRING_COMMIT", "unknown"), "tree_modified": tree_modified(),
        "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "ranks": world_size,
        "suite": suite, "command": " ".join(sys.argv), "passed": passed, "failed": failed, "skipped": 0,
        "figures": figures}
    if records is not None:
        summary["records"] = records
    if files is not None:
        summary["files"] = files
    if incomplete:
        summary["incomplete"] = True
    with open(path, "w") as out:
        json.dump(summary, out, indent=2)
