"""The RMA completion rule in the device source (docs/PROTOCOL.md, "Transports"): one `nvshmem_quiet` per
block, between two barriers, never one per thread. One GPU cannot tell the two apart - every peer there is
mapped, so a quiet is a `__threadfence_system` and every get or put a copy by the calling threads - and the
per-thread form cost a proxy round trip per thread off-node. So the shape is pinned here, on the source:
`protocol/transport.cuh` `quiet_block` (barrier, thread 0 quiets, barrier) is the only caller of the quiet,
and `fetch_done` / `put_done`, the block-level calls every RMA consumer and the combine push make, go
through it."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEVICE = REPO / "device"
TRANSPORT = DEVICE / "include" / "chunkring" / "protocol" / "transport.cuh"
RMA = DEVICE / "include" / "chunkring" / "comm" / "rma.cuh"
STATUS = DEVICE / "include" / "chunkring" / "protocol" / "status.cuh"


def code_of(text: str) -> str:
    """``text`` without its // comments."""
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def body(text: str, function: str) -> str:
    """The braces-delimited body of the first definition of ``function`` in ``text`` (comments removed)."""
    code = code_of(text)
    match = re.search(rf"\b{function}\([^)]*\)\s*{{", code)
    assert match, f"no definition of {function}"
    depth, start = 1, match.end()
    for i in range(start, len(code)):
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        if depth == 0:
            return code[start:i]
    raise AssertionError(f"unbalanced braces after {function}")


def statements(block: str) -> list[str]:
    """The simple statements of ``block``, in order (a loop's braces separate them like semicolons)."""
    return [s.strip() for s in re.split(r"[;{}]", " ".join(block.split())) if s.strip()]


def test_quiet_block_is_barrier_one_quiet_barrier():
    assert statements(body(TRANSPORT.read_text(), "quiet_block")) == [
        "__syncthreads()", "if (threadIdx.x == 0) comm::quiet()", "__syncthreads()"]


def test_fetch_done_and_put_done_quiet_once_per_block():
    text = TRANSPORT.read_text()
    assert "quiet_block()" in body(text, "fetch_done") and "quiet()" not in body(text, "fetch_done").replace(
        "quiet_block()", "")
    assert statements(body(text, "put_done")) == ["quiet_block()"]


def test_nothing_else_quiets():
    """Every other quiet in device code would be one per calling thread again - but raise_abort's: the one thread
    that records a rank's first error calls it once, after its notices (protocol/status.cuh)."""
    callers = []
    for path in sorted(DEVICE.rglob("*.cu*")):
        code = code_of(path.read_text())
        if path == RMA:  # the wrapper itself: `quiet() { nvshmem_quiet(); }`
            code = code.replace("nvshmem_quiet()", "", 1)
        if path == TRANSPORT:
            code = code.replace(body(path.read_text(), "quiet_block"), "")
        if path == STATUS:
            abort = body(path.read_text(), "raise_abort")
            assert statements(abort)[-1] == "comm::quiet()", "raise_abort quiets once, last"
            code = code.replace(abort, "")
        callers += [f"{path.relative_to(REPO)}: {m.group(0)}"
                    for m in re.finditer(r"\b(nvshmem\w*_quiet\w*|comm::quiet)\s*\(", code)]
    assert callers == []
