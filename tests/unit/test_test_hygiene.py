"""Tests stand alone and use the library's public surface (read from the sources of tests/ and benchmarks/ with
``ast``, nothing imported):

* no file imports a test module (``test_*.py``) or a ``conftest.py``: what several test modules share lives in a
  helper module (tests/helpers/, tests/gpu/*_helpers.py) or in chunkring.testing, fixtures in the conftest.py
  files pytest loads itself;
* no file reaches a private name (``_single_underscore``, dunders aside): no ``x._name`` (the object's own
  ``self._name`` aside), no ``from m import _name``, no import of a ``_module``, no ``_name=`` keyword handed to a
  stand-in, no ``"_name"`` or ``"m._name"`` given to getattr/setattr/monkeypatch/mock.patch - but the MoE engine
  (``chunkring.moe._engine``), which its own tests and the benchmarks that time one of its parts alone import
  (tests/helpers/source_tree.py lists those benchmarks; tests/unit/test_import_graph.py holds the rule for code).
  Tests reach our code through public seams (an injectable kernel library, public properties); torch's own private API
  only where torch has no public one, each listed in :data:`TORCH_PRIVATE` with its reason (and checked not to be
  ours);
* every file under tests/ opens with a docstring naming what it pins or holds (STYLE.md item 11).

The checker is shown to catch each kind of offence in a fake file, so a clean run is not vacuous."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.source_tree import ENGINE, ENGINE_BENCHMARKS, REPO, from_module, import_statements

#: Where the rules hold.
CHECKED = ("tests", "benchmarks")
#: Top-level packages of ours: a module of these is never a third party's.
OURS = ("chunkring", "chunkring_launch", "tests", "benchmarks", "scripts")
#: Where our private names are defined (what :func:`our_private_names` reads).
SOURCE_TREES = ("runtime", "launcher", "benchmarks", "scripts", "tests")

#: torch's private API that tests and benchmarks still use, by dotted name (an entry also covers the names below it):
#: each has no public counterpart in the torch versions we support (pyproject: torch>=2.9).
TORCH_PRIVATE = {
    "torch._dynamo.explain": "graph and graph-break counts of a traced model; torch.compiler has no public explain",
    "torch._dynamo.backends.common.aot_autograd": "how a custom torch.compile backend receives AOTAutograd's graph "
                                                  "(torch's custom-backend guide imports it from here)",
    "torch._subclasses.fake_tensor.FakeTensorMode": "FakeTensorMode has no public import path",
    "torch._higher_order_ops.effects._EffectType": "torch's effect registry has no public reader in torch 2.9-2.13; "
                                                   "chunkring.moe.op registers the effect through the same module",
    "torch._higher_order_ops.effects._get_effect": "as _EffectType: the only way to read an op's registered effect",
    "op._schema": "an OpOverload exposes its FunctionSchema only as _schema (test_custom_op's `op`)",
    "torch.cuda._sleep": "the only GPU-side busy wait torch offers (a delay on a stream, no host involved)",
    "torch._inductor.config": "Inductor's deterministic mode (its `deterministic` option, torch 2.10 on) has no "
                              "public switch; torch.use_deterministic_algorithms would change the eager model's ops "
                              "too (benchmarks/bench_model.py's compiled check)",
    "torch.distributed._symmetric_memory": "torch's symmetric memory, which DeepGEMM's mega MoE requires "
                                           "(benchmarks/probe_deepgemm.py); torch exports it nowhere else",
}

#: Calls whose string arguments name an attribute or a dotted path: getattr(x, "_y"), monkeypatch.setattr("m._y", v),
#: mock.patch("m._y"), mock.patch.object(x, "_y").
NAMING_CALLS = ("getattr", "setattr", "hasattr", "delattr", "patch", "object")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def checked_files(root: Path = REPO) -> list[Path]:
    return sorted(p for top in CHECKED for p in (root / top).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def is_test_module(dotted: str) -> bool:
    """A test module or conftest of ours, by its dotted name (also as the bare name pytest's rootdir import allows)."""
    first, _, _ = dotted.partition(".")
    last = dotted.rpartition(".")[2]
    return (last.startswith("test_") or last == "conftest") and (first in OURS or dotted == last)


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) per import target, relative imports resolved against ``module``; for
    ``from pkg import x`` both ``pkg`` and ``pkg.x`` count as imported (x may be a module)."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    base = from_module(node, module, is_package)
    names = [alias.name for alias in node.names]
    return [(base, names), *((f"{base}.{name}", []) for name in names)]


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def allowed(dotted: str, *, parent: bool = False) -> bool:
    """``dotted`` is listed (or lies below an entry); with ``parent``, also a module above an entry (the module
    part of ``from torch._x import Listed``)."""
    keys = tuple(TORCH_PRIVATE)
    return any(dotted == k or dotted.startswith(k + ".") or parent and k.startswith(dotted + ".") for k in keys)


def _private_in(dotted: str) -> bool:
    return any(is_private(part) for part in dotted.split("."))


def may_import_the_engine(module: str) -> bool:
    """Whether ``module`` (a file's dotted name) is one of the MoE engine's own tests or the benchmarks that time one
    of its parts alone (tests/helpers/source_tree.py): they import :data:`ENGINE`'s modules by design."""
    return module.partition(".")[0] == "tests" or module in ENGINE_BENCHMARKS


def _engine(dotted: str) -> bool:
    return dotted == ENGINE or dotted.startswith(ENGINE + ".")


def violations(path: Path, root: Path = REPO) -> list[str]:
    """Every import of a test module or conftest and every reach for a private name in ``path``, in source
    order, as ``file:line: what``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module, is_package = module_name(path, root), path.name == "__init__.py"
    found: list[tuple[int, str]] = []

    def report(node: ast.AST, what: str) -> None:
        found.append((getattr(node, "lineno", 0), what))

    for node in import_statements(tree):
        (first, _), *names = targets = imported_modules(node, module, is_package)
        for target, _ in targets:
            if is_test_module(target):
                report(node, f"imports the test module or conftest {target}")
        engine_ok = may_import_the_engine(module)
        if isinstance(node, ast.ImportFrom) and _private_in(first) and not allowed(first, parent=True) \
                and not (engine_ok and _engine(first)):
            report(node, f"imports the private {first}")  # and so every name it takes
            continue
        for target, _ in targets if isinstance(node, ast.Import) else names:
            if _private_in(target) and not allowed(target) and not (engine_ok and _engine(target)):
                report(node, f"imports the private {target}")
    # Each private attribute is judged by its outermost chain, so that ``torch._dynamo.explain`` matches its entry.
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # an object's own state, inside its class
            outer: ast.AST = node
            while isinstance(parents.get(outer), ast.Attribute):
                outer = parents[outer]
            chain = _dotted(outer) or ast.unparse(node)
            # The engine package itself may be reached (chunkring.moe._engine.call), not a private name inside it.
            if not allowed(chain) and not (engine_ok and node.attr == "_engine" and _engine(chain)):
                report(node, f"reaches the private attribute {ast.unparse(node)}")
        elif isinstance(node, ast.keyword) and node.arg is not None and is_private(node.arg):
            report(node, f"hands a stand-in the private name {node.arg}=")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            for arg in node.args if name in NAMING_CALLS else ():
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                        and all(p.isidentifier() for p in arg.value.split(".")) \
                        and _private_in(arg.value) and not allowed(arg.value):
                    report(node, f"names the private {arg.value!r} in {name}()")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str) and is_private(node.slice.value) \
                and (isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__"
                     or isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                     and node.value.func.id == "vars"):
            report(node, f"reads the private {node.slice.value!r} from an object's __dict__")
    where = path.relative_to(root)
    return [f"{where}:{line}: {what}" for line, what in sorted(found, key=lambda f: f[0])]


def our_private_names(root: Path = REPO) -> set[str]:
    """Every private name our sources define: functions, classes, methods, assigned names and attributes
    (``self._x = ...``), annotated fields, import aliases."""
    names = set()
    for top in SOURCE_TREES:
        for path in (root / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.alias) and node.asname:
                    names.add(node.asname)
    return {n for n in names if is_private(n)}


@pytest.fixture(scope="module")
def found() -> dict[Path, list[str]]:
    return {path: violations(path) for path in checked_files()}


def test_the_files_are_read(found):
    # Not vacuous: the GPU tests, the helpers and the benchmarks are all among the files read.
    read = {str(p.relative_to(REPO)) for p in found}
    assert {"tests/gpu/test_moe_layer.py", "tests/gpu/moe_helpers.py", "tests/helpers/source_tree.py",
            "tests/conftest.py", "benchmarks/bench_overlap.py", "tests/unit/test_test_hygiene.py"} <= read


def test_no_file_imports_a_test_module(found):
    bad = [v for vs in found.values() for v in vs if "test module" in v]
    assert not bad, "move what is shared into a helper module or conftest.py fixture:\n" + "\n".join(bad)


def test_no_file_reaches_a_private_name(found):
    bad = [v for vs in found.values() for v in vs if "test module" not in v]
    assert not bad, "give the library a public seam (or list a torch private with its reason):\n" + "\n".join(bad)


def test_torch_privates_are_not_ours():
    ours = our_private_names()
    assert {"_closed", "_streams"} <= ours  # the collection reads our tree (Runtime, Ring, SmPartition)
    theirs = {key: [p for p in key.split(".") if is_private(p) and p in ours] for key in TORCH_PRIVATE}
    assert not any(theirs.values()), f"listed as torch's but defined in our tree: {theirs}"
    assert all(key.split(".")[0] not in OURS for key in TORCH_PRIVATE)


def test_every_allowance_is_still_needed():
    used = set()
    for path in checked_files():
        tree = ast.parse(path.read_text())
        module, is_package = module_name(path, REPO), path.name == "__init__.py"
        dotted = {_dotted(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in import_statements(tree):
            for target, names in imported_modules(node, module, is_package):
                dotted |= {target, *(f"{target}.{n}" for n in names)}
        used |= {key for key in TORCH_PRIVATE if any(d == key or (d or "").startswith(key + ".")
                                                                 for d in dotted)}
    assert not (stale := set(TORCH_PRIVATE)) - used, f"no longer used: {sorted(stale - used)}"


def test_every_test_file_has_a_docstring():
    missing = [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("*.py")
               if "__pycache__" not in p.parts and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, "say in a docstring which rule the file pins (or what it holds): " + ", ".join(missing)


def test_the_checker_catches_each_offence(tmp_path):
    fake = tmp_path / "tests" / "gpu" / "test_fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text('''"""A fake test module that breaks every rule."""
import tests.gpu.test_moe_layer
from tests.gpu.test_progress import make_ring
from tests.conftest import HAVE_GPU
from tests.gpu import test_ring_host_api
from . import test_abort
from .test_moe_graph import Batch
from test_moe_layer import H
from chunkring.bringup import _init_nvshmem
from chunkring._hidden import thing
import chunkring.ring._private
from tests.gpu.moe_helpers import weights


class Fake:
    def __init__(self):
        self._mine = 1  # its own state: fine

    def read(self):
        return self._mine


def test_it(monkeypatch, ring, rt, ring_io):
    ring._check_alive()
    rt._closed = True
    monkeypatch.setattr(ring_io, "_library", None)
    monkeypatch.setattr("chunkring.ring.io._library", None)
    getattr(rt, "_host")
    stand_in = dict(_check_alive=lambda: None)
    rt.__dict__["_closed"]
    torch.cuda._sleep(100)  # listed: torch's own
    torch._dynamo.config.patch(error_on_recompile=True)  # not listed
    assert rt.__class__ and getattr(rt, "__version__", None) is None  # dunders: fine
''')
    got = [v.split(": ", 1)[1] for v in violations(fake, root=tmp_path)]
    assert got == [
        "imports the test module or conftest tests.gpu.test_moe_layer",
        "imports the test module or conftest tests.gpu.test_progress",
        "imports the test module or conftest tests.conftest",
        "imports the test module or conftest tests.gpu.test_ring_host_api",
        "imports the test module or conftest tests.gpu.test_abort",
        "imports the test module or conftest tests.gpu.test_moe_graph",
        "imports the test module or conftest test_moe_layer",
        "imports the private chunkring.bringup._init_nvshmem",
        "imports the private chunkring._hidden",
        "imports the private chunkring.ring._private",
        "reaches the private attribute ring._check_alive",
        "reaches the private attribute rt._closed",
        "names the private '_library' in setattr()",
        "names the private 'chunkring.ring.io._library' in setattr()",
        "names the private '_host' in getattr()",
        "hands a stand-in the private name _check_alive=",
        "reads the private '_closed' from an object's __dict__",
        "reaches the private attribute torch._dynamo",
    ], got
    clean = tmp_path / "tests" / "gpu" / "helpers.py"
    clean.write_text('"""Clean."""\nfrom tests.gpu.moe_helpers import H\nimport torch\n\ntorch.cuda._sleep(1)\n')
    assert violations(clean, root=tmp_path) == []
