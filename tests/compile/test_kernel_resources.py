"""Every kernel fits the largest block it is launched with, as ptxas builds it (NVRTC, sm_90, the build's
options, its report on): registers are allocated per warp in units of 256, and a block whose warps need more
than the SM's 65,536 fails its launch ("too many resources requested") - on the GPU host, not here, unless this
test reads the report first. The block sizes come from the launch sites, statically (a literal, or a module
constant the launch names). The decode kernels (device/kernels/moe_decode.cu) also keep their operands in
registers (their weight stream's copies in flight are in shared memory): no stack frame and no spills, or each
k block's fragments would become local-memory traffic that only a GPU profile would show."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from chunkring.jit import kernel_sources, parse_kernels
from chunkring.jit.compiler import KERNEL_DIR
from chunkring.moe.routing import ROUTER_MAX_SLICES
from tests.helpers.launch_sites import launch_calls
from tests.helpers.nvrtc import ptxas_report

REPO = Path(__file__).resolve().parents[2]
REGISTERS_PER_SM = 65536
#: ptxas gives each warp registers in units of 256 (8 per thread).
REGISTER_UNIT = 8
#: The largest block of a kernel whose launch computes it: the router GEMM's warps are its hidden size's slices.
COMPUTED_BLOCK = {"moe_router_logits": 32 * ROUTER_MAX_SLICES}
#: Where ExpertCompute._launch (chunkring.moe._engine.experts) takes its block size: every launch through it.
WRAPPER_BLOCK = {"_launch": ("runtime/chunkring/moe/_engine/experts.py", "_BLOCK")}


@dataclasses.dataclass(frozen=True)
class Resources:
    registers: int
    stack_frame: int
    spill_bytes: int


@pytest.fixture(scope="module")
def resources() -> dict[str, Resources]:
    """Each kernel's registers, stack frame and spill bytes (stores + loads) as ptxas reports them."""
    found = {}
    for name in kernel_sources():
        report = ptxas_report(name)
        for kernel in parse_kernels((KERNEL_DIR / f"{name}.cu").read_text(), f"{name}.cu"):
            section = report[re.search(rf"Function properties for {kernel}\b", report).start():]
            frame, stores, loads = map(int, re.search(
                r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", section).groups())
            found[kernel] = Resources(int(re.search(r"Used (\d+) registers", section).group(1)), frame, stores + loads)
    return found


def module_constants(path: Path) -> dict[str, int]:
    """The module-level ``NAME = <int>`` assignments of ``path``."""
    constants = {}
    for node in ast.parse(path.read_text()).body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(value, ast.Constant) and type(value.value) is int:
            constants.update({t.id: value.value for t in targets if isinstance(t, ast.Name)})
    return constants


def block_of(call: ast.Call, path: Path, constants: dict[Path, dict[str, int]],
             anywhere: dict[str, set[int]]) -> int | None:
    """The block size a launch gives, where a literal or a module constant says it; None otherwise."""
    if call.func.attr in WRAPPER_BLOCK:  # type: ignore[attr-defined] - launch_calls yields attribute calls
        home, name = WRAPPER_BLOCK[call.func.attr]  # type: ignore[attr-defined]
        return constants[REPO / home][name]
    block = next((k.value for k in call.keywords if k.arg == "block"), None)
    if isinstance(block, ast.Constant) and type(block.value) is int:
        return block.value
    if isinstance(block, ast.Name) and block.id in constants[path]:
        return constants[path][block.id]
    if isinstance(block, ast.Name) and len(anywhere.get(block.id, ())) == 1:
        return next(iter(anywhere[block.id]))  # imported from the one module that defines it
    return None


def launched_blocks() -> tuple[dict[str, dict[int, list[str]]], list[str]]:
    """Per kernel, each block size a launch site gives it (with the sites), and the sites whose block size is
    neither a literal, nor a constant this can resolve, nor in :data:`COMPUTED_BLOCK`."""
    files = [path for folder in ("runtime", "launcher", "benchmarks", "scripts", "tests")
             for path in (REPO / folder).rglob("*.py")]
    constants = {path: module_constants(path) for path in files}
    anywhere: dict[str, set[int]] = {}
    for table in constants.values():
        for name, value in table.items():
            anywhere.setdefault(name, set()).add(value)
    blocks: dict[str, dict[int, list[str]]] = {}
    unresolved = []
    for path in files:
        for kernel, call in launch_calls(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{call.lineno}"
            value = COMPUTED_BLOCK.get(kernel) or block_of(call, path, constants, anywhere)
            if value is None:
                unresolved.append(f"{where}: {kernel}")
            else:
                blocks.setdefault(kernel, {}).setdefault(value, []).append(where)
    return blocks, unresolved


def registers_for(threads: int, registers: int) -> int:
    warps = -(-threads // 32)
    return warps * 32 * -(-registers // REGISTER_UNIT) * REGISTER_UNIT


def test_every_kernel_fits_the_largest_block_it_is_launched_with(resources):
    blocks, unresolved = launched_blocks()
    problems = []
    for kernel, sizes in sorted(blocks.items()):
        if kernel not in resources:
            continue  # test_kernel_signatures reports a launch of an unknown kernel
        for threads, sites in sizes.items():
            need = registers_for(threads, resources[kernel].registers)
            if threads > 1024 or need > REGISTERS_PER_SM:
                problems.append(f"{kernel}: {threads} threads x {resources[kernel].registers} registers need {need} "
                                f"of {REGISTERS_PER_SM} ({', '.join(sites)})")
    assert not problems, "\n".join(problems)
    # The search itself works: the library's own launches resolve, and few sites pass a computed block.
    assert {"moe_pull", "moe_pull_blocks", "ring_gather", "ring_publish_tensors", "moe_produce_chunk",
            "moe_combine_push", "moe_decode_l1"} <= blocks.keys()
    assert not unresolved, f"a launch whose block size this cannot read: {unresolved}"


@pytest.mark.parametrize("kernel", ["moe_decode_l1", "moe_decode_l2"])
def test_the_decode_kernels_do_not_spill(resources, kernel):
    used = resources[kernel]
    assert (used.stack_frame, used.spill_bytes) == (0, 0), f"{kernel}: stack frame / spills {used}"
    assert registers_for(256, used.registers) <= REGISTERS_PER_SM  # one 256-thread block per SM: the launch bounds
