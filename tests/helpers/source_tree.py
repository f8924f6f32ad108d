"""Our source trees as files and statements, read with ``ast`` and never imported: every module of chunkring,
chunkring_launch, benchmarks/ and scripts/ with its file, and every import statement of a parsed file. What the
source-reading tests share (tests/unit/test_import_graph.py, test_host_comm.py, test_test_hygiene.py)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Where each importable tree lives: the folder that holds it, as ``sys.path`` would name it (the packages'
#: folders are named as imported; benchmarks/ and scripts/ run from the repository's root, ``python -m``).
ROOTS = {"chunkring": REPO / "runtime", "chunkring_launch": REPO / "launcher", "benchmarks": REPO,
         "scripts": REPO}


#: The MoE layer's private engine, and who besides :mod:`chunkring.moe` itself may import it: the engine's own tests
#: (everything under tests/, which test its parts as units) and the benchmarks that time one of its parts alone,
#: which no public call isolates - each with that part.
ENGINE = "chunkring.moe._engine"
ENGINE_BENCHMARKS = {
    "benchmarks.bench_decode": "the decode kernels alone, against DeepGEMM's GEMMs on the same plan",
    "benchmarks.bench_consumer_breakdown": "a batch-ready call's consumer steps (plan, GEMMs, push, reduce) alone",
    "benchmarks.probe_producer": "the fused producer kernel alone, per chunk and grid",
    "benchmarks.bench_input_checks": "the pull kernel alone, with and without its input checks",
    "benchmarks.bench_overlap": "the producers alone (P): the router GEMM and the fused producer per chunk",
    "benchmarks.bench_persistent": "the persistent decode consumer alone, against the decode kernels on the same plan",
}


def module_files() -> dict[str, Path]:
    """Every module (``a.b`` for a/b.py, ``a`` for a/__init__.py) of each tree of :data:`ROOTS`, with its file."""
    modules: dict[str, Path] = {}
    for top, root in ROOTS.items():
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "__pycache__" not in parts:
                modules[".".join(parts).removesuffix(".__init__")] = path
    return modules


def import_statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it stands: inside functions, and under ``if TYPE_CHECKING:`` (an
    import for annotations is still an edge a reader and every import-graph tool follow)."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def from_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` statement of ``module`` (a package's ``__init__`` if ``is_package``)
    imports from, its relative dots resolved."""
    base = node.module or ""
    if not node.level:
        return base
    anchor = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        anchor = anchor.rpartition(".")[0]
    return f"{anchor}.{base}" if base else anchor
