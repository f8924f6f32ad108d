"""How this rank reaches each peer's ring buffer, decided once, when a ring is built.

``DIRECT``: NVSHMEM maps the peer's symmetric heap into this GPU's address space (``nvshmem_ptr`` is not
null: the same GPU, or a GPU over NVLink/PCIe peer access), and kernels read its slots and write its
combine rows with ordinary loads and stores. ``RMA``: they move the same bytes with NVSHMEM get/put
(``nvshmemx_getmem_*``, ``nvshmemx_putmem_nbi_block``), which work over every transport NVSHMEM has,
IB and EFA included. Signals and acks already go through NVSHMEM calls and need no choice.

The choice travels to the device as one bit per PE (``RingDesc.rma_peers``); device code branches on it
in one place (``protocol/ring.cuh``: ``fetch_*``, ``put_rows_*``). ``CHUNKRING_TRANSPORT=rma`` (or a
ring's / layer's ``transport="rma"``) takes the RMA path for every peer, this rank included, so one GPU
can run the whole RMA data path; ``auto`` (the default) takes it only where NVSHMEM has no mapping.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from chunkring.env import transport_mode
from chunkring.errors import ChunkringUsageError

__all__ = ["TRANSPORT_MODES", "Transport", "check_transport_mode", "choose_transports", "describe_transports",
           "rma_mask"]

#: What a ring's ``transport`` may say: ``auto`` (per peer, as NVSHMEM maps it) or ``rma`` (every peer).
TRANSPORT_MODES = ("auto", "rma")


class Transport(enum.IntEnum):
    """How one peer's ring buffer is reached (its bit in ``RingDesc.rma_peers``: DIRECT 0, RMA 1)."""

    DIRECT = 0
    RMA = 1


def check_transport_mode(value: object, *, field: str = "transport") -> str:
    """``value`` if it is one of :data:`TRANSPORT_MODES`; ``None`` reads ``CHUNKRING_TRANSPORT``."""
    if value is None:
        return transport_mode()
    if value not in TRANSPORT_MODES:
        raise ChunkringUsageError(f"must be one of {TRANSPORT_MODES}, got {value!r}", field=field)
    return str(value)


def choose_transports(peer_address: Callable[[int], int], world_size: int, mode: str) -> tuple[Transport, ...]:
    """Each PE's transport: RMA where ``mode`` is ``rma`` or ``peer_address(pe)`` (the host's
    ``nvshmem_ptr`` of this rank's buffer on ``pe``) is 0, DIRECT otherwise."""
    mode = check_transport_mode(mode)
    if mode == "rma":
        return tuple(Transport.RMA for _ in range(world_size))
    return tuple(Transport.DIRECT if peer_address(pe) else Transport.RMA for pe in range(world_size))


def rma_mask(transports: Sequence[Transport]) -> int:
    """``RingDesc.rma_peers``: bit ``pe`` set for each RMA peer."""
    return sum(1 << pe for pe, t in enumerate(transports) if t is Transport.RMA)


def describe_transports(rank: int, transports: Sequence[Transport], mode: str) -> str:
    """One line: which PEs this rank reaches directly and which by RMA, e.g.
    ``PE 2 (transport auto): direct to PEs 0-3, RMA to PEs 4-7``."""
    parts = []
    for kind, word in ((Transport.DIRECT, "direct"), (Transport.RMA, "RMA")):
        pes = [pe for pe, t in enumerate(transports) if t is kind]
        if pes:
            parts.append(f"{word} to {'PE' if len(pes) == 1 else 'PEs'} {_ranges(pes)}")
    return f"PE {rank} (transport {mode}): {', '.join(parts)}"


def _ranges(pes: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[tuple[int, int]] = []
    for pe in pes:
        if spans and pe == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], pe)
        else:
            spans.append((pe, pe))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
