"""Programmatic dependent launches (device/include/chunkring/ptx/dependent_launch.cuh) are safe only by its rules,
checked here statically, without a GPU:

* every launch with ``pdl=True`` names a kernel that waits for the kernel ahead of it (``wait_prior_grid``) before
  it touches anything the call's kernels write or read: as its first statement, or - the decode GEMMs - after
  reading only its expert's row count and the weights, with every block that ends before waiting going through
  ``finish_idle`` (block 0 waits all the same);
* a kernel releases its dependents (``release_dependents``) right after its wait, or at its start if it is never
  launched with pdl, so a kernel's launch implies that every kernel two or more ahead of it has completed - which
  is what makes the decode GEMMs' early read of the row counts final;
* the kernels that release are exactly those that wait for nothing outside their own grid, named here with the
  reason."""

import ast
import re
from pathlib import Path

from chunkring.jit import kernel_sources
from chunkring.jit.compiler import KERNEL_DIR
from chunkring.jit.signatures import parse_kernels
from tests.helpers.kernel_args import kernel_bodies, mirrors
from tests.helpers.launch_sites import launch_calls

REPO = Path(__file__).resolve().parents[2]
WAIT, RELEASE = "ptx::wait_prior_grid();", "ptx::release_dependents();"
#: The kernels that release their dependents: each runs to its end without waiting for anything but its own
#: stream (no ring wait, no count to poll) - or, the persistent consumer, for its own blocks, every one of them
#: started by the time a dependent may be placed - so a dependent's waiting blocks cannot hold it up.
RELEASING = {"moe_plan_count", "moe_plan_scatter", "moe_decode_l1", "moe_decode_l2", "moe_combine_push",
             "moe_local_route", "moe_local_scatter", "moe_persistent_gemm"}
#: The kernels that read before their wait, and the parameters they may touch there: the weights (no kernel writes
#: them), the row counts (final once the kernel ahead let them start), scalars; the one-rank scatter's call extent
#: (descriptors and the caller's count, written before the route ahead of it started).
EARLY_READS = {"moe_decode_l1": {"w13", "w13_sf", "counts", "hidden", "inter", "sf_stride"},
               "moe_decode_l2": {"w2", "w2_sf", "counts", "hidden", "inter", "sf_stride"},
               "moe_local_scatter": {"desc", "stage", "n_tokens", "valid_tokens"}}
#: What a kernel that waits on another rank or grid calls (protocol/ring.cuh, status.cuh, moe/blocks.cuh).
SPINS = re.compile(r"\b(spin_until|consume_invocation|begin_chunk|poll_acked|wait_chunk|drain)\s*\(")


def kernel_params() -> dict[str, set[str]]:
    """Each kernel's parameter names, as the launches check them; an argument struct's fields in its place (the
    kernel unpacks them into locals of their names, tests/unit/test_kernel_args.py)."""
    fields = {name: {field.name for field in mirror.fields} for name, (_, mirror) in mirrors().items()}
    params = {}
    for source in kernel_sources():
        path = KERNEL_DIR / f"{source}.cu"
        for name, ps in parse_kernels(path.read_text(), path.name).items():
            params[name] = set().union(*(fields[p.struct] if p.struct else {p.name} for p in ps))
    return params


def pdl_launches() -> set[str]:
    """The kernels launched with ``pdl=True`` anywhere in the package or the benchmarks."""
    found = set()
    for path in [*(REPO / "runtime").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        for name, call in launch_calls(ast.parse(path.read_text())):
            if any(k.arg == "pdl" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in call.keywords):
                found.add(name)
    return found


def statements(body: str) -> list[str]:
    """The body's lines, stripped, comments and blank lines left out."""
    lines = (line.split("//")[0].strip() for line in body.splitlines())
    return [line for line in lines if line]


def before_wait(body: str) -> str:
    return body[:body.index(WAIT)] if WAIT in body else body


def test_every_dependent_launch_waits_for_the_kernel_ahead_before_touching_what_it_writes():
    bodies, params, launched = kernel_bodies(), kernel_params(), pdl_launches()
    assert launched == {"moe_plan_scatter", "moe_combine_push", "moe_decode_l1", "moe_decode_l2", "moe_ack_held",
                        "moe_combine_reduce", "moe_local_scatter", "moe_persistent_gemm"}, launched
    for name in launched - EARLY_READS.keys():
        assert statements(bodies[name])[0] == WAIT, (name, statements(bodies[name])[:2])
    for name, allowed in EARLY_READS.items():
        early = "\n".join(statements(before_wait(bodies[name])))  # the code, not its comments
        assert WAIT in bodies[name], name
        touched = {p for p in params[name] if re.search(rf"\b{p}\b", early)}
        assert touched <= allowed, f"{name} touches {sorted(touched - allowed)} before its wait"
        if not name.startswith("moe_decode"):
            assert "return" not in early, f"{name} ends before its wait"
            continue
        assert "rows_of(counts" in early and not re.search(r"\bcounts\s*\[", early), \
            f"{name}: the counts are read early only by rows_of's relaxed GPU-scope load"
        returns = [m.start() for m in re.finditer(r"\breturn\b", early)]
        assert returns, f"{name}: a block of an idle expert ends early (the case finish_idle covers)"
        for at in returns:
            assert early[:at].rstrip().endswith("finish_idle();"), f"{name} ends a block early without finish_idle"
    finish_idle = re.search(r"void finish_idle\(\) \{(.*?)\n\}", (KERNEL_DIR / "moe_decode.cu").read_text(), re.S)
    assert finish_idle and statements(finish_idle.group(1)) == ["if (blockIdx.x == 0) ptx::wait_prior_grid();"]


def test_a_kernel_releases_its_dependents_only_after_its_own_wait():
    bodies, launched = kernel_bodies(), pdl_launches()
    releasing = {name for name, body in bodies.items() if "release_dependents()" in body}
    assert releasing == RELEASING
    for name in releasing:
        lines = statements(bodies[name])
        if name in launched:
            assert lines[lines.index(WAIT) + 1] == RELEASE and lines.count(RELEASE) == 1, name
        else:  # not a dependent launch: its launch already followed the kernel ahead's completion
            assert lines[0] == RELEASE and WAIT not in lines, name


def test_only_kernels_that_never_spin_release_their_dependents():
    bodies = kernel_bodies()
    # Not vacuous: the kernels that do wait are recognised as such.
    assert all(SPINS.search(bodies[name]) for name in ("moe_pull", "moe_pull_blocks", "moe_ack_held", "moe_drain",
                                                        "moe_wave_claim", "ring_publish_open", "moe_produce_chunk"))
    for name in RELEASING:
        assert not SPINS.search(bodies[name]), f"{name} spins: a dependent's waiting blocks could hold it up"
