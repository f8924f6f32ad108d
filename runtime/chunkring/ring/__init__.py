"""The ring protocol core: the spec of a ring, its symmetric layout and device descriptor, ``Ring``
(allocation, epoch and reset, status and errors) and the stream-ordered publish/gather host API.
Nothing here knows about experts: the MoE layer (:mod:`chunkring.moe`) is built on top of it.
"""

from chunkring.ring.io import GatherOutputs, gather, gather_grid_limit, publish_chunk
from chunkring.ring.layout import RingLayout
from chunkring.ring.ring import Ring
from chunkring.ring.spec import FP8_SCALE_BLOCK, MAX_WORLD_SIZE, PayloadFormat, RingSpec
from chunkring.ring.status import AbortRecord, ErrorCode, InputField, InputRecord, Site, StatusRecord
from chunkring.ring.transport import Transport

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
