"""A name imported only under ``if TYPE_CHECKING:`` exists for the type checker, not at run time: used outside an
annotation it raises NameError - on the GPU only, where the code path first runs (a ring's constructor once did).
mypy cannot see it (to mypy the import is real), so this test reads every module: each use of such a name must
be an annotation, or sit in a function that imports the name itself."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imported(nodes) -> set[str]:
    return {(alias.asname or alias.name).split(".")[0]
            for node in nodes if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}


def type_checking_only(tree: ast.Module) -> set[str]:
    """Names a module imports under ``if TYPE_CHECKING:`` and nowhere at its top level."""
    checking = [node for node in tree.body  # `if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`, not `if not ...`
                if isinstance(node, ast.If) and ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING"]
    at_run_time = _imported(tree.body) | {node.name for node in tree.body
                                          if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    return _imported(sub for node in checking for sub in ast.walk(node)) - at_run_time


class RunTimeUses(ast.NodeVisitor):
    """Loads of ``names`` evaluated at run time: not annotations, not in a function that imports them."""

    def __init__(self, names: set[str]) -> None:
        self.names, self.local, self.found = names, [set()], []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for expr in [*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d)]:
            self.visit(expr)  # evaluated when the function is defined
        self.local.append(_imported(ast.walk(node)))
        for statement in node.body:
            self.visit(statement)
        self.local.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.names and isinstance(node.ctx, ast.Load) and not any(node.id in s for s in self.local):
            self.found.append((node.lineno, node.id))


def test_no_name_imported_for_type_checking_is_used_at_run_time():
    problems, modules = [], 0
    for folder in ("runtime", "launcher", "benchmarks", "scripts", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = type_checking_only(tree)
            if not names:
                continue
            modules += 1
            uses = RunTimeUses(names)
            uses.visit(tree)
            problems += [f"{path.relative_to(REPO)}:{line}: {name}" for line, name in uses.found]
    assert not problems, "used at run time but imported only under TYPE_CHECKING:\n" + "\n".join(problems)
    assert modules > 20  # the search itself works: the library's modules that import for type checking


def test_the_check_finds_such_a_use():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n\n"
                     "def word() -> torch.Tensor:\n    return torch.zeros(1)\n")
    uses = RunTimeUses(type_checking_only(tree))
    uses.visit(tree)
    assert uses.found == [(6, "torch")]
