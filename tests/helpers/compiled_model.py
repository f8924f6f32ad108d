"""The model the operator tests compile (tests/unit/test_custom_op.py traces it on meta tensors,
tests/gpu/test_custom_op_gpu.py captures and replays it on the GPU): elementwise work and a residual
around two MoE calls."""

import torch


class TwoLayers(torch.nn.Module):
    """What a serving model does around the layer: elementwise work, two MoE calls (the second on the
    first's output), a residual. Each elementwise op reads realised tensors only (the input, an
    operator's output), so however Inductor fuses them each output rounds once, as eager does: x2 is
    exact, and the residual add is one bf16 rounding of an fp32 sum. (``hidden + first(...)`` fed to a
    second add would not be: Inductor may recompute it inside the second add's kernel in fp32, without
    the bf16 rounding between the adds that eager does.)"""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, hidden, streaming=False, num_tokens=None):
        h = self.first(hidden * 2, streaming=streaming, num_tokens=num_tokens)
        return hidden + self.second(h, streaming=streaming, num_tokens=num_tokens)

