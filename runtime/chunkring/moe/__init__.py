"""The MoE layer on the ring: its config, the layer and its ``nn.Module``, the producers (router,
top-k, FP8 quantisation), the checkpoint loader, the device dispatch plan, streaming calibration and the timeline.
It imports the ring core (:mod:`chunkring.ring`); the ring core never imports it.
"""

from chunkring.moe.calibrate import StreamingCalibration
from chunkring.moe.checkpoint import HF_EXPERT_KEYS, ExpertKeys, load_experts
from chunkring.moe.config import MoEConfig
from chunkring.moe.layer import ChunkedMoE, MoELayer
from chunkring.moe.timeline import Event, Timeline
from chunkring.moe.weights import Fp8Weight, init_weights, quantize_weight_fp8

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
    "init_weights",
    "load_experts",
    "quantize_weight_fp8",
]
