"""The MoE layer on the ring. Its public face: the config (:mod:`.config`), the layer (:mod:`.layer`) and its
``nn.Module`` (:mod:`.module`), the ``torch.compile`` operators (:mod:`.op`), expert weights and checkpoints
(:mod:`.weights`, :mod:`.checkpoint`), routing and FP8 quantisation of rows (:mod:`.routing`), streaming calibration
and the graph timer (:mod:`.calibration`) and what it decides (:mod:`.auto`), the timeline (:mod:`.timeline`), the
GEMM engine's loader and the plan's size (:mod:`.gemm`) and the layer's kernel libraries (:mod:`.kernels`). Its
engine - what a call enqueues, the buffers a layer holds, the expert work - is private (:mod:`._engine`). It imports
the ring core (:mod:`chunkring.ring`); the ring core never imports it.

The names below are imported at first use (:mod:`chunkring._lazy`): ``MoEConfig`` needs no torch.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chunkring.moe._engine.call import CallMode
    from chunkring.moe.auto import StreamingCalibration
    from chunkring.moe.calibration import calibrate
    from chunkring.moe.checkpoint import HF_EXPERT_KEYS, ExpertKeys, load_experts
    from chunkring.moe.config import MoEConfig
    from chunkring.moe.layer import MoELayer
    from chunkring.moe.module import MoEModule
    from chunkring.moe.routing import quantize_rows_fp8, route, router_logits
    from chunkring.moe.timeline import Event, Timeline
    from chunkring.moe.weights import Fp8Weight, expert_weights, init_weights, quantize_weight_fp8

_EXPORTS = {
    "CallMode": "chunkring.moe._engine.call",
    "StreamingCalibration": "chunkring.moe.auto",
    "calibrate": "chunkring.moe.calibration",
    **dict.fromkeys(("HF_EXPERT_KEYS", "ExpertKeys", "load_experts"), "chunkring.moe.checkpoint"),
    "MoEConfig": "chunkring.moe.config",
    "MoELayer": "chunkring.moe.layer",
    "MoEModule": "chunkring.moe.module",
    **dict.fromkeys(("quantize_rows_fp8", "route", "router_logits"), "chunkring.moe.routing"),
    **dict.fromkeys(("Event", "Timeline"), "chunkring.moe.timeline"),
    **dict.fromkeys(("Fp8Weight", "expert_weights", "init_weights", "quantize_weight_fp8"), "chunkring.moe.weights"),
}

__all__ = [
    "HF_EXPERT_KEYS",
    "CallMode",
    "Event",
    "ExpertKeys",
    "Fp8Weight",
    "MoEConfig",
    "MoELayer",
    "MoEModule",
    "StreamingCalibration",
    "Timeline",
    "calibrate",
    "expert_weights",
    "init_weights",
    "load_experts",
    "quantize_rows_fp8",
    "quantize_weight_fp8",
    "route",
    "router_logits",
]

if not TYPE_CHECKING:
    from chunkring._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
