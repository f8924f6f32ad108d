"""The kernel launches in Python source, found statically (tests/compile reads them against the kernels)."""

import ast

__all__ = ["launch_calls", "refused_on_purpose"]


def refused_on_purpose(tree: ast.AST) -> set[int]:
    """The nodes inside ``with pytest.raises(...)`` blocks: a test's deliberately wrong launches."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
                isinstance(item.context_expr, ast.Call) and isinstance(item.context_expr.func, ast.Attribute)
                and item.context_expr.func.attr == "raises" for item in node.items):
            inside.update(id(sub) for statement in node.body for sub in ast.walk(statement))
    return inside


def launch_calls(tree: ast.AST):
    """Every call of a ``launch`` or ``_launch`` attribute whose first argument is a literal kernel name, but
    those a test expects to be refused."""
    refused = refused_on_purpose(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and id(node) not in refused and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("launch", "_launch") and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value, node
