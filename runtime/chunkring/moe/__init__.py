"""The MoE layer on the ring: its config, the layer and its ``nn.Module``, the producers (router,
top-k, FP8 quantisation), the checkpoint loader, the device dispatch plan, streaming calibration and the timeline.
It imports the ring core (:mod:`chunkring.ring`); the ring core never imports it.

The names below are imported at first use (:mod:`chunkring._lazy`): ``MoEConfig`` needs no torch.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chunkring.moe.auto import StreamingCalibration
    from chunkring.moe.calibration import calibrate
    from chunkring.moe.checkpoint import HF_EXPERT_KEYS, ExpertKeys, load_experts
    from chunkring.moe.chunked import ChunkedMoE
    from chunkring.moe.config import MoEConfig
    from chunkring.moe.layer import MoELayer
    from chunkring.moe.timeline import Event, Timeline
    from chunkring.moe.weights import Fp8Weight, expert_weights, init_weights, quantize_weight_fp8

_EXPORTS = {
    "StreamingCalibration": "chunkring.moe.auto",
    "calibrate": "chunkring.moe.calibration",
    **dict.fromkeys(("HF_EXPERT_KEYS", "ExpertKeys", "load_experts"), "chunkring.moe.checkpoint"),
    "ChunkedMoE": "chunkring.moe.chunked",
    "MoEConfig": "chunkring.moe.config",
    "MoELayer": "chunkring.moe.layer",
    **dict.fromkeys(("Event", "Timeline"), "chunkring.moe.timeline"),
    **dict.fromkeys(("Fp8Weight", "expert_weights", "init_weights", "quantize_weight_fp8"), "chunkring.moe.weights"),
}

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

if not TYPE_CHECKING:
    from chunkring._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
