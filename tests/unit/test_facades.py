"""The package facades (``chunkring``, ``chunkring.ring``, ``chunkring.moe``) import their names at first use
(chunkring._lazy): ``import chunkring`` and a config check import no torch, CUDA, NVSHMEM or MPI module, and
every public name still resolves to the object its module defines."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tests.helpers.imports import heavy_modules_after

FACADES = ("chunkring", "chunkring.ring", "chunkring.moe")


def test_importing_the_package_and_checking_a_config_imports_no_torch():
    code = ("import chunkring, chunkring.ring, chunkring.moe\n"
            "cfg = chunkring.MoEConfig(num_experts=8, hidden=1024, intermediate=512, topk=2, max_tokens_per_rank=64)\n"
            "cfg.with_default_ring().check_world_size(2)\n"
            "chunkring.RingSpec, chunkring.RankInfo, chunkring.ChunkringUsageError, chunkring.ring.RingLayout")
    assert heavy_modules_after(code) == []


def facade_tables(facade: str) -> tuple[dict[str, str], dict[str, str]]:
    """The facade's two tables as its source spells them (read, not reached through the module): its
    ``_EXPORTS`` (name -> defining module, what chunkring._lazy imports at first use) and the names its
    ``if TYPE_CHECKING:`` block imports (what mypy reads), each name -> module."""
    package = importlib.import_module(facade)
    tree = ast.parse(Path(package.__file__).read_text())
    (table,) = [n.value for n in tree.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in n.targets)]
    exports = eval(compile(ast.Expression(table), package.__file__, "eval"), {"dict": dict})
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"]
    seen = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    return exports, seen


@pytest.mark.parametrize("facade", FACADES)
def test_every_public_name_resolves_to_its_module(facade):
    package = importlib.import_module(facade)
    exports, _ = facade_tables(facade)
    assert sorted(package.__all__) == sorted(exports), "__all__ and _EXPORTS list the same names"
    for name in package.__all__:
        assert getattr(package, name) is getattr(importlib.import_module(exports[name]), name), name
    assert set(package.__all__) <= set(dir(package))


@pytest.mark.parametrize("facade", FACADES)
def test_type_checkers_see_the_same_names(facade):
    """The ``if TYPE_CHECKING:`` imports (what mypy reads) name exactly the exported names, from the same
    modules (a facade of a facade counts: chunkring's MoEConfig comes from chunkring.moe)."""
    exports, seen = facade_tables(facade)
    assert seen == exports


def test_a_missing_name_is_an_attribute_error_and_submodules_resolve():
    import chunkring

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        chunkring.NoSuchThing  # noqa: B018
    assert chunkring.partition is importlib.import_module("chunkring.partition")
    from chunkring import MoEConfig, moe  # a name and a submodule through `from ... import`

    assert MoEConfig is moe.MoEConfig


def test_a_job_without_a_gpu_starts_its_ranks_without_torch(monkeypatch):
    """A rank of a job that needs no GPU (the launcher's ``fault`` job) imports no torch: its ranks start in a
    second or two, which tests/unit/test_launcher_failures.py's 12 s --timeout relies on."""
    monkeypatch.setenv("CHUNKRING_TEST_JOBS", "1")
    code = ("from chunkring_launch import worker\n"
            "from chunkring_launch.jobs import JOBS\n"
            "assert not getattr(JOBS['fault'], 'NEEDS_GPU', True)\n"
            "worker.HostRuntime(worker.RankInfo.from_env()).barrier()\n")
    assert heavy_modules_after(code) == []
