"""The MoE layer on the ring: its config, the layer and its ``nn.Module``, the producers (router,
top-k, FP8 quantisation), the checkpoint loader, the device dispatch plan, streaming calibration and the timeline.
It imports the ring core (:mod:`chunkring.ring`); the ring core never imports it.
"""

from chunkring.moe.auto import StreamingCalibration
from chunkring.moe.calibration import calibrate
from chunkring.moe.checkpoint import HF_EXPERT_KEYS, ExpertKeys, load_experts
from chunkring.moe.chunked import ChunkedMoE
from chunkring.moe.config import MoEConfig
from chunkring.moe.layer import MoELayer
from chunkring.moe.timeline import Event, Timeline
from chunkring.moe.weights import Fp8Weight, expert_weights, init_weights, quantize_weight_fp8

__all__ = [
    "HF_EXPERT_KEYS",
    "ChunkedMoE",
    "Event",
    "ExpertKeys",
    "Fp8Weight",
    "MoEConfig",
    "MoELayer",
    "StreamingCalibration",
    "Timeline",
    "calibrate",
    "expert_weights",
    "init_weights",
    "load_experts",
    "quantize_weight_fp8",
]
