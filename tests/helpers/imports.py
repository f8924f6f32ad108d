"""What a fresh interpreter imports: the heavy modules (torch, CUDA, NVSHMEM, MPI) a piece of code pulls in.
Shared by the facade, CLI and benchmark tests (tests/unit/test_facades.py, test_cli.py, test_bench_*.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

#: What a CPU box without the GPU packages cannot import, and what makes the CLI slow.
HEAVY = ("torch", "cuda", "nvshmem", "mpi4py")
#: Where the interpreter starts: the repository's root, so that ``benchmarks`` imports.
REPO = Path(__file__).resolve().parents[2]


def heavy_modules_after(code: str, also: tuple[str, ...] = ()) -> list[str]:
    """The heavy modules (:data:`HEAVY`, and the top-level packages ``also`` names) a fresh interpreter in the
    repository's root has imported after running ``code``."""
    probe = (f"{code}\nimport sys\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY + also)!r}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])
