"""chunkring: stream MoE token chunks into expert-parallel dispatch through an NVSHMEM ring of slots.

Start here: ``rt = chunkring.init()`` (a collective under mpirun, or a single process), then the ring
and layer APIs; ``rt.close()`` at the end.
"""

import os as _os

from .env import EAGER_LOADING as _EAGER_LOADING

# Before anything initialises CUDA in this process (env.EAGER_LOADING says why); an explicit setting wins.
for _name, _value in _EAGER_LOADING.items():
    _os.environ.setdefault(_name, _value)

from .bringup import Runtime, current, init  # noqa: E402
from .errors import (
    ChunkringDeviceError,
    ChunkringError,
    ChunkringInputError,
    ChunkringRuntimeError,
    ChunkringTimeoutError,
    ChunkringUsageError,
    NoGpuError,
)
from .moe_calibrate import StreamingCalibration
from .moe_layer import ChunkedMoE, MoEConfig, MoELayer
from .partition import SmPartition
from .ranks import RankInfo
from .ring import Ring
from .ring_io import GatherOutputs, gather, publish_chunk
from .ring_spec import PayloadFormat, RingSpec
from .timeline import Event, Timeline

__all__ = [
    "ChunkedMoE",
    "ChunkringDeviceError",
    "ChunkringError",
    "ChunkringInputError",
    "ChunkringRuntimeError",
    "ChunkringTimeoutError",
    "ChunkringUsageError",
    "Event",
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
    "StreamingCalibration",
    "Timeline",
    "current",
    "gather",
    "init",
    "publish_chunk",
]
