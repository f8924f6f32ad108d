"""The package's import graph is one-way (read from the sources with ``ast``, nothing imported): no
circle anywhere, and each layer imports only those below it -

    chunkring's process runtime (_lazy, _version, bringup, env, errors, hostcomm, partition, ranks, runtime)
    <- chunkring.jit <- chunkring.ring <- chunkring.moe <- chunkring.integrations <- chunkring.testing
    <- benchmarks/ and scripts/ <- chunkring_launch

so the protocol core never pulls in the MoE layer, the MoE layer never a framework adapter, library code
never the launcher, the test helpers or the benchmarks, and benchmarks and scripts never the launcher.
Every import counts, also one inside a function (a lazy import is still a circle when the two modules
need each other) and one under ``if TYPE_CHECKING:`` (where a package facade that imports its names at first
use - chunkring._lazy - names them for type checkers); a package's ``__init__`` is a module of its own, and
importing ``a.b.c`` is not counted as importing ``a`` or ``a.b`` (Python runs those first, but they are the
facade, not a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.source_tree import ENGINE, ENGINE_BENCHMARKS, ROOTS, from_module, import_statements, module_files

#: Layers, lowest first: a module may import (directly or through others) only its own layer and those below.
LAYERS = [
    ("runtime", ("chunkring._lazy", "chunkring._version", "chunkring.bringup", "chunkring.env", "chunkring.errors",
                 "chunkring.hostcomm", "chunkring.partition", "chunkring.ranks", "chunkring.runtime")),
    ("jit", ("chunkring.jit",)),
    ("ring", ("chunkring.ring",)),
    ("moe", ("chunkring.moe",)),
    ("integrations", ("chunkring.integrations",)),
    ("testing", ("chunkring.testing",)),
    ("benchmarks", ("benchmarks", "scripts")),
    ("launcher", ("chunkring_launch",)),
]
#: Outside the layers: the package facade (``import chunkring`` gives the whole library).
UNLAYERED = ("chunkring",)

def _known(name: str, modules) -> str | None:
    """``name`` or its longest prefix that is a module of ours; None for anything else (torch, os...)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (anywhere in its file)."""
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in import_statements(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = from_module(node, name, is_package)
                # "from pkg import mod" imports the module pkg.mod; "from mod import name" imports mod.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            edges |= {t for t in (_known(t, modules) for t in targets) if t is not None and t != name}
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a closed path of modules) per strongly connected group of more than one module."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(v):  # Tarjan, iterative (no recursion limit on long chains)
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.add(w)
                        if w == node:
                            break
                    if len(group) > 1:
                        groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_in(graph, group) for group in groups]


def _circle_in(graph, group: set[str]) -> list[str]:
    start = min(group)
    path = _path(graph, start, lambda m: start in graph.get(m, ()) and m in group, within=group)
    return path + [start]


def _path(graph, source: str, goal, within=None) -> list[str] | None:
    """The shortest import path from ``source`` to a module for which ``goal`` holds, or None."""
    parent, frontier = {source: None}, [source]
    while frontier:
        nxt = []
        for m in frontier:
            if goal(m):
                path = [m]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return path[::-1]
            for w in sorted(graph.get(m, ())):
                if w not in parent and (within is None or w in within):
                    parent[w] = m
                    nxt.append(w)
        frontier = nxt
    return None


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """For every module of a layer, an import path (possibly through other modules, the facade
    included) to a module of a higher layer."""
    out = []
    for module in sorted(graph):
        mine = layer_of(module)
        if mine is None:
            continue
        path = _path(graph, module, lambda m, mine=mine: (layer_of(m) or 0) > mine)
        if path:
            out.append(f"{module} ({LAYERS[mine][0]}) reaches {path[-1]} ({LAYERS[layer_of(path[-1])][0]}): "
                       + " -> ".join(path))
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph(module_files())


def test_the_graph_is_read(graph):
    # Not vacuous: the layers are all there, and known edges (absolute, relative, lazy) are seen.
    assert all(any(layer_of(m) == rank for m in graph) for rank in range(len(LAYERS))), sorted(graph)
    assert all(m in graph for m in UNLAYERED)
    assert "chunkring.moe.layer" in graph["chunkring.moe"]                      # package re-export
    assert "chunkring_launch.jobs.bench" in graph["chunkring_launch.jobs"]  # from . import bench
    assert "chunkring_launch.worker" in graph["chunkring_launch.cli"]       # lazy, in main()
    assert "chunkring.testing.bench_moe" in graph["chunkring_launch.jobs.bench"]
    assert "chunkring.ring.ring" in graph["chunkring.moe.layer"]
    assert "chunkring.moe.layer" in graph["chunkring.integrations.transformers"]
    assert "chunkring.bringup" in graph["chunkring"]                           # a facade's TYPE_CHECKING names
    assert "chunkring.moe.config" in graph["chunkring.moe"]
    assert {"chunkring.hostcomm", "chunkring.runtime"} <= graph["chunkring.bringup"]


def test_an_import_graph_tool_sees_the_same_edges(graph, monkeypatch):
    """grimp (import-linter's engine), pointed at the checkout's folders, finds exactly these edges."""
    grimp = pytest.importorskip("grimp", reason="grimp is in the test extra")
    for root in sorted({str(r) for r in ROOTS.values()}):
        monkeypatch.syspath_prepend(root)
    tool = grimp.build_graph(*ROOTS, include_external_packages=False, cache_dir=None)
    # benchmarks and scripts are folders of modules, not packages: grimp names the folder too, which imports nothing.
    seen = {m: set(tool.find_modules_directly_imported_by(m)) for m in tool.modules
            if m not in ("benchmarks", "scripts")}
    assert seen == graph


def test_no_import_circles(graph):
    circles = find_cycles(graph)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_each_layer_imports_only_those_below(graph):
    assert not (bad := layer_violations(graph)), "imports against the layering:\n" + "\n".join(bad)


@pytest.mark.parametrize("low,high", [
    ("chunkring.ring", "chunkring.moe"),
    ("chunkring.jit", "chunkring.moe"),
    ("chunkring.jit", "chunkring.ring"),
    ("chunkring.ring", "chunkring.testing"),
    ("chunkring.moe", "chunkring.testing"),
    ("chunkring.bringup", "chunkring_launch"),
    ("chunkring.runtime", "chunkring.bringup"),
    ("chunkring.hostcomm", "chunkring.runtime"),
    ("chunkring.moe", "chunkring_launch"),
    ("benchmarks", "chunkring_launch"),
    ("scripts", "chunkring_launch"),
    ("chunkring.testing", "chunkring_launch"),
    ("chunkring.moe", "benchmarks"),
    ("chunkring.moe", "chunkring.integrations"),
    ("chunkring.integrations", "chunkring.testing"),
])
def test_named_rules(graph, low, high):
    """The rules issue 16 names, spelled out (the layering above implies each)."""
    def inside(m, prefix):
        return m == prefix or m.startswith(prefix + ".")

    for module in (m for m in graph if inside(m, low)):
        path = _path(graph, module, lambda m: inside(m, high))
        assert path is None, " -> ".join(path)


def engine_importers(graph: dict[str, set[str]]) -> set[str]:
    """Every module outside :mod:`chunkring.moe` that imports a module of the MoE engine."""
    def engine(m):
        return m == ENGINE or m.startswith(ENGINE + ".")

    return {m for m, edges in graph.items()
            if not (m == "chunkring.moe" or m.startswith("chunkring.moe.")) and any(engine(e) for e in edges)}


def test_the_moe_engine_is_private(graph):
    """Nothing outside chunkring.moe imports its engine - the integrations, the launcher, chunkring.testing and the
    package facade use the public face (the layer, routing, gemm, kernels, calibration) - but the benchmarks that
    time one of its parts alone (tests/helpers/source_tree.py names each with that part)."""
    assert engine_importers(graph) <= set(ENGINE_BENCHMARKS), sorted(engine_importers(graph) - set(ENGINE_BENCHMARKS))
    assert set(ENGINE_BENCHMARKS) <= set(graph), "a listed benchmark is gone: take it off the list"


#: Inside chunkring.moe, lowest first: the engine builds on the first floor and never reaches the public modules
#: above it (the layer and what is built on the layer).
MOE_FLOORS = [
    ("base", ("chunkring.moe.config", "chunkring.moe.weights", "chunkring.moe.routing", "chunkring.moe.gemm",
              "chunkring.moe.kernels", "chunkring.moe.timeline", "chunkring.moe.auto", "chunkring.moe.checkpoint")),
    ("engine", (ENGINE,)),
    ("layer", ("chunkring.moe.layer",)),
    ("on the layer", ("chunkring.moe.module", "chunkring.moe.op", "chunkring.moe.calibration")),
]


def test_the_moe_package_has_floors(graph):
    def floor(m):
        return next((i for i, (_, prefixes) in enumerate(MOE_FLOORS)
                     if any(m == p or m.startswith(p + ".") for p in prefixes)), None)

    moe = [m for m in graph if m.startswith("chunkring.moe.")]
    assert all(floor(m) is not None for m in moe), sorted(m for m in moe if floor(m) is None)
    bad = [f"{m} -> {e}" for m in moe for e in graph[m] if floor(e) is not None and floor(e) > floor(m)]
    assert not bad, "an upward import inside chunkring.moe:\n" + "\n".join(bad)


def test_the_checker_finds_circles_and_layer_breaks():
    fake = {"chunkring_launch.jobs": {"chunkring_launch.jobs.bench"},
            "chunkring_launch.jobs.bench": {"chunkring_launch.worker"},
            "chunkring_launch.worker": {"chunkring_launch.jobs"},
            "chunkring.ring.ring": {"chunkring"}, "chunkring": {"chunkring.moe"}, "chunkring.moe": set(),
            "scripts.x": {"chunkring_launch.doctor"}, "chunkring_launch.doctor": set()}
    assert find_cycles(fake) == [["chunkring_launch.jobs", "chunkring_launch.jobs.bench",
                                  "chunkring_launch.worker", "chunkring_launch.jobs"]]
    bad = layer_violations(fake)
    assert any(b.startswith("chunkring.ring.ring (ring) reaches chunkring.moe") for b in bad)
    assert any(b.startswith("scripts.x (benchmarks) reaches chunkring_launch.doctor") for b in bad)
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"]]


def test_relative_and_lazy_imports_are_resolved(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n    from .sub.b import g\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\nimport torch\nif TYPE_CHECKING:\n    from p import c\n")
    (pkg / "c.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    modules = {"p": pkg / "__init__.py", "p.a": pkg / "a.py", "p.sub": pkg / "sub" / "__init__.py",
               "p.sub.b": pkg / "sub" / "b.py", "p.c": pkg / "c.py"}
    graph = import_graph(modules)
    assert graph == {"p": {"p.a"}, "p.a": {"p.sub.b"}, "p.sub": set(), "p.sub.b": {"p.a", "p.c"}, "p.c": set()}
    assert find_cycles(graph) == [["p.a", "p.sub.b", "p.a"]]
