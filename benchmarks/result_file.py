"""The JSON result file every benchmark script writes: the keys of the committed results
(tests/gpu_results/README.md) and the benchmark's figures."""

from __future__ import annotations

import json
import os
import sys


def write(path: str, *, suite: str, world_size: int, figures: dict) -> None:
    import torch

    summary = {"commit": os.environ.get("CHUNKRING_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(0),
               "gpus": torch.cuda.device_count(), "ranks": world_size, "suite": suite, "command": " ".join(sys.argv),
               "passed": 1, "failed": 0, "skipped": 0, "figures": figures}
    with open(path, "w") as out:
        json.dump(summary, out, indent=2)
