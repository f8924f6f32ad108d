"""The MoE layer on the ring: its config, the layer and its ``nn.Module``, the producers (router,
top-k, FP8 quantisation), the device dispatch plan, streaming calibration and the timeline.
It imports the ring core (:mod:`chunkring.ring`); the ring core never imports it.
"""

from chunkring.moe.calibrate import StreamingCalibration
from chunkring.moe.config import MoEConfig
from chunkring.moe.layer import ChunkedMoE, MoELayer
from chunkring.moe.timeline import Event, Timeline
from chunkring.moe.weights import init_weights

__all__ = ["ChunkedMoE", "Event", "MoEConfig", "MoELayer", "StreamingCalibration", "Timeline", "init_weights"]
