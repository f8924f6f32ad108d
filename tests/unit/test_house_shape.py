"""The house stays readable as it grows (the targets of the "one house" work): no Python module over 400 lines and
no function over 80 outside benchmarks/ and scripts/, and no commit hash in the code or the reference docs -
history lives in the commit log and the result files (tests/gpu_results, benchmarks/results)."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80
#: A hexadecimal word of 7 to 40 digits with a letter and a digit: how git names a commit.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
#: A record's path, which starts with its commit: the one place a doc may hold a hash
#: (tests/unit/test_performance_doc.py checks that every record path the performance docs name exists).
RECORD_PATH = re.compile(r"(?:benchmarks/results|tests/gpu_results)/[0-9a-f]{7,40}-[A-Za-z0-9_.+*-]+")
REFERENCE_DOCS = ("README.md", "docs/PROTOCOL.md", "docs/PERFORMANCE.md", "docs/INTEGRATION.md", "docs/LAUNCHER.md",
                  "docs/BUILD.md")


def test_modules_and_functions_stay_small():
    too_big = []
    for path in sorted(p for folder in ("runtime", "launcher", "tests") for p in (REPO / folder).rglob("*.py")):
        text, where = path.read_text(), path.relative_to(REPO)
        if text.count("\n") > MAX_MODULE_LINES:
            too_big.append(f"{where}: {text.count(chr(10))} lines")
        too_big += [f"{where}:{node.lineno}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
                    for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not too_big, "split by job:\n" + "\n".join(too_big)


def test_no_commit_hash_in_the_code_or_the_reference_docs():
    files = [p for folder in ("runtime", "device", "launcher") for p in (REPO / folder).rglob("*")
             if p.suffix in (".py", ".cu", ".cuh", ".md", ".toml") and "__pycache__" not in p.parts]
    files += [REPO / name for name in REFERENCE_DOCS]
    found = [f"{path.relative_to(REPO)}:{number}: {match}" for path in files
             for number, line in enumerate(path.read_text().splitlines(), 1)
             for match in COMMIT.findall(RECORD_PATH.sub("", line))]
    assert not found, "\n".join(found)
    assert COMMIT.findall("landed in 1f2d0a8, not 0xffffffff or 2048") == ["1f2d0a8"]  # the pattern itself
    assert COMMIT.findall(RECORD_PATH.sub("", "1f2d0a8 in `benchmarks/results/1f2d0a8-decode.json`")) == ["1f2d0a8"]
