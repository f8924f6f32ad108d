"""chunkring: stream MoE token chunks into expert-parallel dispatch through an NVSHMEM ring of slots.

Layers, each importing only those below it: the process runtime (this package's top-level modules:
``init``/``Runtime``, host collectives, errors, environment, SM partitions) <- :mod:`chunkring.jit` (kernel
build and launch) <- :mod:`chunkring.ring` (the protocol core) <- :mod:`chunkring.moe` (the MoE layer).
:mod:`chunkring.testing` holds what only tests and benchmarks use.

Start here: ``rt = chunkring.init()`` (a collective under mpirun, or a single process), then the ring
and layer APIs; ``rt.close()`` at the end. The names below are imported at first use (:mod:`chunkring._lazy`):
``import chunkring`` alone imports no torch. ``chunkring.__version__`` is the installed version (pyproject.toml's
in a source tree that is not installed).
"""

import os as _os
from typing import TYPE_CHECKING

from chunkring.env import EAGER_LOADING as _EAGER_LOADING

# Before anything initialises CUDA in this process (env.EAGER_LOADING says why); an explicit setting wins.
for _name, _value in _EAGER_LOADING.items():
    _os.environ.setdefault(_name, _value)

if TYPE_CHECKING:
    from chunkring._version import __version__
    from chunkring.bringup import current, init
    from chunkring.errors import (
        ChunkringDeviceError,
        ChunkringError,
        ChunkringHostTimeoutError,
        ChunkringInputError,
        ChunkringOutOfStepError,
        ChunkringPeerAbortedError,
        ChunkringRuntimeError,
        ChunkringTimeoutError,
        ChunkringUsageError,
        NoGpuError,
    )
    from chunkring.moe import (
        Event,
        ExpertKeys,
        MoEConfig,
        MoELayer,
        MoEModule,
        StreamingCalibration,
        Timeline,
        calibrate,
        expert_weights,
        load_experts,
    )
    from chunkring.partition import SmPartition
    from chunkring.ranks import RankInfo
    from chunkring.ring import GatherOutputs, PayloadFormat, Ring, RingSpec, gather, publish_chunk
    from chunkring.runtime import Runtime

_EXPORTS = {
    "__version__": "chunkring._version",
    "current": "chunkring.bringup",
    "init": "chunkring.bringup",
    **dict.fromkeys(("ChunkringDeviceError", "ChunkringError", "ChunkringHostTimeoutError", "ChunkringInputError",
                     "ChunkringOutOfStepError", "ChunkringPeerAbortedError", "ChunkringRuntimeError",
                     "ChunkringTimeoutError", "ChunkringUsageError", "NoGpuError"),
                    "chunkring.errors"),
    **dict.fromkeys(("MoEModule", "Event", "ExpertKeys", "MoEConfig", "MoELayer", "StreamingCalibration", "Timeline",
                     "calibrate", "expert_weights", "load_experts"), "chunkring.moe"),
    "SmPartition": "chunkring.partition",
    "RankInfo": "chunkring.ranks",
    **dict.fromkeys(("GatherOutputs", "PayloadFormat", "Ring", "RingSpec", "gather", "publish_chunk"),
                    "chunkring.ring"),
    "Runtime": "chunkring.runtime",
}

__all__ = [
    "__version__",
    "MoEModule",
    "ChunkringDeviceError",
    "ChunkringError",
    "ChunkringHostTimeoutError",
    "ChunkringInputError",
    "ChunkringOutOfStepError",
    "ChunkringPeerAbortedError",
    "ChunkringRuntimeError",
    "ChunkringTimeoutError",
    "ChunkringUsageError",
    "Event",
    "ExpertKeys",
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
    "calibrate",
    "current",
    "expert_weights",
    "gather",
    "init",
    "load_experts",
    "publish_chunk",
]

if not TYPE_CHECKING:
    from chunkring._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
