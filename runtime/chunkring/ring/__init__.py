"""The ring protocol core: the spec of a ring, its symmetric layout and device descriptor, ``Ring``
(allocation, epoch and reset, status and errors) and the stream-ordered publish/gather host API.
Nothing here knows about experts: the MoE layer (:mod:`chunkring.moe`) is built on top of it.

The names below are imported at first use (:mod:`chunkring._lazy`): the spec and layout need no torch.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chunkring.ring.io import GatherOutputs, gather, gather_grid_limit, publish_chunk
    from chunkring.ring.layout import RingLayout
    from chunkring.ring.ring import Ring
    from chunkring.ring.spec import FP8_SCALE_BLOCK, MAX_WORLD_SIZE, PayloadFormat, RingSpec
    from chunkring.ring.status import AbortRecord, ErrorCode, InputField, InputRecord, Site, StatusRecord
    from chunkring.ring.transport import Transport

_EXPORTS = {
    **dict.fromkeys(("GatherOutputs", "gather", "gather_grid_limit", "publish_chunk"), "chunkring.ring.io"),
    "RingLayout": "chunkring.ring.layout",
    "Ring": "chunkring.ring.ring",
    **dict.fromkeys(("FP8_SCALE_BLOCK", "MAX_WORLD_SIZE", "PayloadFormat", "RingSpec"), "chunkring.ring.spec"),
    **dict.fromkeys(("AbortRecord", "ErrorCode", "InputField", "InputRecord", "Site", "StatusRecord"),
                    "chunkring.ring.status"),
    "Transport": "chunkring.ring.transport",
}

__all__ = [
    "AbortRecord",
    "FP8_SCALE_BLOCK",
    "MAX_WORLD_SIZE",
    "ErrorCode",
    "GatherOutputs",
    "InputField",
    "InputRecord",
    "PayloadFormat",
    "Ring",
    "RingLayout",
    "RingSpec",
    "Site",
    "StatusRecord",
    "Transport",
    "gather",
    "gather_grid_limit",
    "publish_chunk",
]

if not TYPE_CHECKING:
    from chunkring._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
