"""The ``extern "C"`` signature in each .cu is the only declaration of a kernel's parameters. Every kernel
of every source parses (an unknown type or a malformed signature fails here, not at a launch on the GPU
host), the parse agrees with what NVRTC compiles (parameter count and widths of each PTX entry point),
and every kernel name launched from Python exists in the source it is launched from. No GPU needed."""

import ast
import re
from pathlib import Path

import pytest

from chunkring.jit import kernel_sources, parse_kernels
from chunkring.jit.compiler import KERNEL_DIR
from tests.helpers.kernel_args import mirrors
from tests.helpers.launch_sites import launch_calls
from tests.helpers.nvrtc import ptx_of

REPO = Path(__file__).resolve().parents[2]
SOURCES = kernel_sources()
#: Bytes each parameter kind takes in the kernel's parameter buffer (an argument struct: its mirror's size).
WIDTH = {"ptr": 8, "i64": 8, "u64": 8, "i32": 4, "u32": 4, "tensormap": 128}
MIRRORS = {name: mirror for name, (_, mirror) in mirrors().items()}
#: One parameter of a PTX entry: its element width in bits and, for a by-value array (a tensor map's
#: `.param .align 64 .b8 name[128]`), its element count.
PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.[bsuf](\d+)\s+\w+(?:\[(\d+)\])?")
#: A kernel launched by name (``lib.launch("moe_pull", ...)``, occupancy queries) and a library loaded by name.
LAUNCHED = re.compile(r"""\.(?:launch|resident_blocks_per_sm)\(\s*["'](\w+)["']""")
LOADED = re.compile(r"""library_for\(\s*[\w.]+\s*,\s*["'](\w+)["']""")


def kernels_of(name: str) -> dict:
    return parse_kernels((KERNEL_DIR / f"{name}.cu").read_text(), f"{name}.cu")


def ptx_entries(name: str) -> dict[str, list[int]]:
    """Each entry point of ``<name>.cu`` as NVRTC compiles it: its parameters' widths in bytes. PTX (a
    virtual target, no ptxas) because its ``.entry`` lines spell each parameter's width out."""
    return {entry.group(1): [int(bits) // 8 * int(count or 1) for bits, count in PTX_PARAM.findall(entry.group(2))]
            for entry in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx_of(name), re.S)}


@pytest.mark.parametrize("name", SOURCES)
def test_every_kernel_signature_parses(name):
    kernels = kernels_of(name)  # raises, naming file and line, on an unknown type or a malformed signature
    assert kernels, f'{name}.cu declares no extern "C" kernel'


@pytest.mark.parametrize("name", SOURCES)
def test_parsed_signatures_match_the_compiled_entry_points(name):
    parsed = {kernel: [MIRRORS[p.struct].nbytes if p.struct else WIDTH[p.kind] for p in params]
              for kernel, params in kernels_of(name).items()}
    assert ptx_entries(name) == parsed


def test_every_kernel_launched_from_python_exists_in_its_source():
    kernels = {name: set(kernels_of(name)) for name in SOURCES}
    anywhere = set().union(*kernels.values())
    launched, missing = set(), []
    for folder in ("runtime", "launcher", "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            text = path.read_text()
            sources = set(LOADED.findall(text))
            for source in sources - kernels.keys():
                missing.append(f"{path.relative_to(REPO)}: loads unknown kernel source {source!r}")
            # A file that loads one source launches that source's kernels; otherwise any source's.
            allowed = kernels.get(next(iter(sources)), set()) if len(sources) == 1 else anywhere
            for kernel in LAUNCHED.findall(text):
                launched.add(kernel)
                if kernel not in allowed:
                    where = f"{sorted(sources)[0]}.cu" if len(sources) == 1 else "any kernel source"
                    missing.append(f"{path.relative_to(REPO)}: launches {kernel!r}, which {where} does not declare")
    assert not missing, "\n".join(missing)
    # The search itself works: the library's own launches are found.
    assert {"ring_publish_tensors", "ring_gather", "moe_pull", "ring_stress"} <= launched


#: What a launch takes besides the kernel's parameters: KernelLibrary.launch's own keywords; the ``_launch``
#: of chunkring.moe._engine.experts.ExpertCompute takes a ``shared`` flag instead and forwards the rest.
LAUNCH_OPTIONS = {"launch": {"grid", "block", "stream", "shared_bytes", "pdl"}, "_launch": {"shared", "pdl"}}


def named_problems(call: ast.Call, expected: set[str], options: set[str], where: str) -> list[str]:
    """A call's arguments against the names it must take: none positional, every keyword one of ``expected`` (or
    ``options``), and all of ``expected`` named unless a ``**`` expansion may supply the rest."""
    problems = []
    if len(call.args) > (1 if options else 0) or any(isinstance(a, ast.Starred) for a in call.args):
        problems.append(f"{where}: positional arguments (name them)")
    named = {k.arg for k in call.keywords if k.arg is not None} - options
    if named - expected:
        problems.append(f"{where}: no parameter {sorted(named - expected)}")
    expanded = any(k.arg is None for k in call.keywords)
    if not expanded and named != expected:
        problems.append(f"{where}: missing {sorted(expected - named)}")
    return problems


def test_every_launch_names_its_arguments_after_the_kernel_parameters():
    """Statically, at every launch site with a literal kernel name: no argument but the name is positional,
    every keyword names a parameter of that kernel, and a launch without ``**`` expansions names them all
    (the expanded ones are checked at run time by KernelLibrary.launch, before anything is enqueued). An argument
    struct built in the launch (``args=PlanScatterArgs(...)``) is held to its mirror's fields the same way."""
    signatures = {kernel: ps for name in SOURCES for kernel, ps in kernels_of(name).items()}
    problems, checked, structs = [], 0, 0
    for folder in ("runtime", "launcher", "benchmarks", "scripts", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for kernel, call in launch_calls(ast.parse(path.read_text())):
                if kernel not in signatures:
                    continue  # test_every_kernel_launched_from_python_exists_in_its_source reports it
                checked += 1
                where = f"{path.relative_to(REPO)}:{call.lineno}: {kernel}"
                problems += named_problems(call, {p.name for p in signatures[kernel]}, LAUNCH_OPTIONS[call.func.attr],
                                           where)
                for param in (p for p in signatures[kernel] if p.struct):
                    built = next((k.value for k in call.keywords if k.arg == param.name), None)
                    if isinstance(built, ast.Call) and getattr(built.func, "id", None) == param.struct:
                        structs += 1
                        problems += named_problems(built, {f.name for f in MIRRORS[param.struct].fields}, set(),
                                                   f"{where}: {param.struct}")
    assert not problems, "\n".join(problems)
    assert structs >= 4  # the structs built in the launches are found
    assert checked >= 15  # the search itself works: the library's launches are found
