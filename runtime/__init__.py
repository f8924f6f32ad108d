"""chunkring: stream MoE token chunks into expert-parallel dispatch through an NVSHMEM ring of slots.

Start here: ``rt = chunkring.init()`` (a collective under mpirun, or a single process), then the ring
and layer APIs; ``rt.close()`` at the end.
"""

from .bringup import Runtime, current, init
from .errors import ChunkringError, ChunkringRuntimeError, ChunkringUsageError, NoGpuError
from .moe_layer import ChunkedMoE, MoEConfig, MoELayer
from .partition import SmPartition
from .ranks import RankInfo
from .ring import Ring
from .ring_io import GatherOutputs, gather, publish_chunk
from .ring_spec import PayloadFormat, RingSpec

__all__ = [
    "ChunkedMoE",
    "ChunkringError",
    "ChunkringRuntimeError",
    "ChunkringUsageError",
    "GatherOutputs",
    "MoEConfig",
    "MoELayer",
    "NoGpuError",
    "PayloadFormat",
    "RankInfo",
    "Ring",
    "RingSpec",
    "Runtime",
    "SmPartition",
    "current",
    "gather",
    "init",
    "publish_chunk",
]
