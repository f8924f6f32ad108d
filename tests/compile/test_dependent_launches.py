"""Programmatic dependent launches (device/include/chunkring/ptx/dependent_launch.cuh) are safe only by two rules,
checked here statically, without a GPU: every launch with ``pdl=True`` names a kernel whose first statements wait
for the kernel ahead of it (``wait_prior_grid``, after at most a ``release_dependents``), so nothing it reads or
writes races that kernel; and the kernels that let their dependents start early are exactly those that never
spin, named here with the reason."""

import ast
import re
from pathlib import Path

from chunkring.jit import kernel_sources
from chunkring.jit.compiler import KERNEL_DIR
from tests.helpers.launch_sites import launch_calls

REPO = Path(__file__).resolve().parents[2]
#: The kernels that release their dependents at their start: each runs to its end without waiting for anything
#: but its own stream (no ring wait, no count to poll), so a dependent's waiting blocks cannot hold it up.
RELEASING = {"moe_plan_count", "moe_plan_scatter", "moe_decode_l1", "moe_decode_l2", "moe_combine_push"}
#: What a kernel that waits on another rank or grid calls (protocol/ring.cuh, status.cuh, moe/blocks.cuh).
SPINS = re.compile(r"\b(spin_until|consume_invocation|begin_chunk|poll_acked|wait_chunk|drain)\s*\(")


def kernel_bodies() -> dict[str, str]:
    """Each ``extern "C"`` kernel's body (between its braces), by name, from every source."""
    bodies = {}
    for source in kernel_sources():
        text = (KERNEL_DIR / f"{source}.cu").read_text()
        for match in re.finditer(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\s*\(', text):
            start = text.index("{", match.end())
            depth, at = 0, start
            while True:
                depth += {"{": 1, "}": -1}.get(text[at], 0)
                if depth == 0:
                    break
                at += 1
            bodies[match.group(1)] = text[start + 1:at]
    return bodies


def pdl_launches() -> set[str]:
    """The kernels launched with ``pdl=True`` anywhere in the package or the benchmarks."""
    found = set()
    for path in [*(REPO / "runtime").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        for name, call in launch_calls(ast.parse(path.read_text())):
            if any(k.arg == "pdl" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in call.keywords):
                found.add(name)
    return found


def first_statements(body: str) -> list[str]:
    return [line.strip() for line in body.strip().splitlines()[:2]]


def test_every_dependent_launch_waits_for_the_kernel_ahead_before_anything_else():
    bodies, launched = kernel_bodies(), pdl_launches()
    assert launched == {"moe_plan_scatter", "moe_combine_push", "moe_decode_l1", "moe_decode_l2", "moe_ack_held",
                        "moe_combine_reduce"}, launched
    for name in launched:
        head = first_statements(bodies[name])
        assert "ptx::wait_prior_grid();" in head and head[0] in ("ptx::wait_prior_grid();",
                                                                  "ptx::release_dependents();"), (name, head)


def test_only_kernels_that_never_spin_release_their_dependents():
    bodies = kernel_bodies()
    # Not vacuous: the kernels that do wait are recognised as such.
    assert all(SPINS.search(bodies[name]) for name in ("moe_pull", "moe_pull_blocks", "moe_ack_held", "moe_drain",
                                                        "moe_wave_claim", "ring_publish_open", "moe_produce_chunk"))
    releasing = {name for name, body in bodies.items() if "release_dependents()" in body}
    assert releasing == RELEASING
    for name in releasing:
        assert first_statements(bodies[name])[0] == "ptx::release_dependents();", name
        assert not SPINS.search(bodies[name]), f"{name} spins: a dependent's waiting blocks could hold it up"
