"""A drop-in chunkring MoE block for Hugging Face transformers models (Qwen3-MoE, DeepSeek-V3).

:func:`replace_moe_blocks` walks a model and puts a :class:`ChunkringMoEBlock` in the place of each sparse
MoE block it knows, over one :class:`~chunkring.moe.layer.MoELayer` per distinct block shape:

* the router is the block's own ``gate`` module, kept and called exactly as the block calls it, so the
  top-k experts and weights are the model's: Qwen3-MoE's softmax over the experts, top-k, renormalised
  if ``norm_topk_prob``, rounded to the model's dtype; DeepSeek-V3's fp32 sigmoid scores, the
  ``e_score_correction_bias`` for the choice only, group-limited top-k (``n_group``, ``topk_group``),
  renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``. Its indices and weights go to
  :meth:`MoELayer.run`, through the ``chunkring::moe_run`` operator (:func:`chunkring.moe.op.moe_run`) like any
  torch caller's, as int32 / float32 - the float32 weights are the router's values, widened exactly;
* the hidden states go as bfloat16 rows (bf16 payload), or quantised per 1x128 to FP8 e4m3 with float32
  scales (:func:`~chunkring.moe.routing.quantize_rows_fp8`, FP8 payload);
* this rank's experts (``[rank * E / W, (rank + 1) * E / W)``) are read from the block's own weights
  through :func:`chunkring.load_experts`, Hugging Face's per-expert names (:func:`expert_state_dict`): in
  this transformers (5.x) the experts are fused 3-D parameters, ``experts.gate_up_proj`` [E, 2I, H]
  (gate rows, then up rows: the block's ``chunk(2)`` takes the first half as gate) and
  ``experts.down_proj`` [E, H, I], which is already chunkring's w13 / w2 layout (transformers 4.x's
  per-expert ``nn.ModuleList`` is refused: its blocks lack the fused parameters);
* DeepSeek-V3's shared experts stay the block's own module, added to the routed output as the block
  adds them (routed + shared, in the model's dtype).

Every check runs on the host before any layer is built (:func:`plan_moe_blocks`), and every rank runs
the same checks on the same model, so a refused model fails every rank alike - never one rank inside a
collective. What is refused, as :class:`~chunkring.errors.ChunkringUsageError`: a model with no MoE block
chunkring knows, a module that looks like another MoE block (it has ``gate`` and ``experts``: Mixtral,
Qwen2-MoE's gated shared expert, ...), an activation other than SiLU, experts with biases, transposed or
interleaved weights, expert weights that are not bfloat16, shapes the payload cannot carry
(``moe_intermediate_size`` or ``hidden_size`` not a multiple of 128 for FP8), experts that do not split
evenly over the ranks.

``transformers`` is an optional dependency (``pip install chunkring[hf]``): imported when a function here
is called, never by ``import chunkring``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from chunkring.errors import ChunkringUsageError
from chunkring.moe.checkpoint import load_experts
from chunkring.moe.config import MoEConfig
from chunkring.moe.layer import MoELayer
from chunkring.moe.op import moe_run
from chunkring.moe.routing import quantize_rows_fp8
from chunkring.moe.weights import Fp8Weight
from chunkring.ring.spec import FP8_SCALE_BLOCK, PayloadFormat

if TYPE_CHECKING:
    from chunkring.runtime import Runtime

__all__ = ["SUPPORTED_BLOCKS", "ChunkringMoEBlock", "HfMoEBlock", "chunkring_blocks", "expert_state_dict",
           "find_moe_blocks", "plan_moe_blocks", "replace_moe_blocks", "route"]

#: The transformers classes replaced, by architecture.
SUPPORTED_BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE"}


def _block_classes() -> dict[str, type[nn.Module]]:
    """Architecture -> the installed transformers' MoE block class (imported here, not at module import)."""
    try:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError as exc:
        raise ChunkringUsageError(f"needs Hugging Face transformers with Qwen3-MoE and DeepSeek-V3 (pip install "
                                  f"'chunkring[hf]'): {exc}", field="transformers") from None
    return {"qwen3_moe": Qwen3MoeSparseMoeBlock, "deepseek_v3": DeepseekV3MoE}


@dataclass(frozen=True)
class HfMoEBlock:
    """One sparse MoE block of a model, checked: its dotted ``name`` in the model, the ``module``, its
    ``architecture`` (a key of :data:`SUPPORTED_BLOCKS`) and shapes - E routed experts, top-k, H, I - and
    whether it has shared experts (DeepSeek-V3)."""

    name: str
    module: nn.Module
    architecture: str
    num_experts: int
    topk: int
    hidden: int
    intermediate: int
    shared_experts: bool


def find_moe_blocks(model: nn.Module) -> list[HfMoEBlock]:
    """Every sparse MoE block of ``model`` chunkring can replace, in module order, its structure checked
    (activation, weight layout; :func:`plan_moe_blocks` adds dtypes and shapes). Host-only. A model
    without one, or with a module that looks like an MoE block of another kind (it has both ``gate`` and
    ``experts``), raises ``ChunkringUsageError``."""
    if not isinstance(model, nn.Module):
        raise ChunkringUsageError(f"expected a torch.nn.Module, got {type(model).__name__}", field="model")
    classes = _block_classes()
    found: list[HfMoEBlock] = []
    inside: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        arch = next((a for a, cls in classes.items() if isinstance(module, cls)), None)
        if arch is not None:
            found.append(_describe(name, module, arch))
            inside += (name,)
        elif isinstance(module, ChunkringMoEBlock):
            raise ChunkringUsageError("holds a ChunkringMoEBlock already: replace a model's blocks once",
                                      field=name or "model")
        elif hasattr(module, "gate") and hasattr(module, "experts"):
            raise ChunkringUsageError(f"{type(module).__name__} looks like an MoE block chunkring does not "
                                      f"support (supported: {', '.join(SUPPORTED_BLOCKS.values())})",
                                      field=name or "model")
    if not found:
        raise ChunkringUsageError(f"{type(model).__name__} has no MoE block chunkring supports "
                                  f"({', '.join(SUPPORTED_BLOCKS.values())})", field="model")
    return found


def _describe(name: str, block: nn.Module, arch: str) -> HfMoEBlock:
    """The block's shapes, or a ``ChunkringUsageError`` naming ``name.<attribute>`` for what chunkring's
    layer cannot compute as the block does."""
    experts, gate = block.experts, block.gate
    act_fn = getattr(experts, "act_fn", None)
    if not (isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"):
        raise ChunkringUsageError(f"the experts' activation is {type(act_fn).__name__}; chunkring's experts compute "
                                  "SiLU(gate) * up", field=f"{name}.experts.act_fn")
    for flag, wanted in (("has_bias", False), ("is_transposed", False), ("has_gate", True),
                         ("is_concatenated", True), ("has_post_expert_norm", False)):
        if getattr(experts, flag, wanted) != wanted:
            raise ChunkringUsageError(f"is {not wanted}: chunkring's experts take gate-then-up weights [2I, H] "
                                      "and [H, I], without biases or norms", field=f"{name}.experts.{flag}")
    num_experts = int(getattr(gate, "num_experts", 0))
    topk = int(getattr(gate, "top_k", 0))
    hidden = int(getattr(gate, "hidden_dim", 0))
    inter = int(getattr(experts, "intermediate_dim", 0))
    if min(num_experts, topk, hidden, inter) < 1:
        raise ChunkringUsageError(f"{type(block).__name__} without the router's num_experts / top_k / hidden_dim "
                                  "or the experts' intermediate size: a transformers version this adapter does "
                                  "not know", field=name)
    shared = getattr(block, "shared_experts", None)
    if (arch == "deepseek_v3") != (shared is not None):
        raise ChunkringUsageError("a DeepSeek-V3 block has shared experts and a Qwen3-MoE block none",
                                  field=f"{name}.shared_experts")
    return HfMoEBlock(name, block, arch, num_experts, topk, hidden, inter, shared is not None)


def _check_weights(block: HfMoEBlock) -> None:
    """Every routed expert's weights bfloat16 of the block's shapes - so that no rank's
    :func:`chunkring.load_experts` can refuse its share after other ranks built their layers."""
    inter, hidden = block.intermediate, block.hidden
    for key, weight in expert_state_dict(block.module).items():
        want = (inter, hidden) if key.endswith(("gate_proj.weight", "up_proj.weight")) else (hidden, inter)
        if tuple(weight.shape) != want or weight.dtype != torch.bfloat16:
            raise ChunkringUsageError(f"expected bfloat16 {want}, got {weight.dtype} {tuple(weight.shape)}: "
                                      "chunkring loads bfloat16 experts (model.to(torch.bfloat16) first)",
                                      field=f"{block.name}.{key}")


def expert_state_dict(block: nn.Module) -> dict[str, torch.Tensor]:
    """The block's routed experts under Hugging Face's per-expert names, ``experts.{e}.gate_proj.weight``
    [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I] (:data:`chunkring.moe.HF_EXPERT_KEYS` with an empty
    prefix): views of the fused ``gate_up_proj`` [E, 2I, H] (gate = rows [0, I), up = rows [I, 2I), as the
    block's ``chunk(2)`` splits them) and ``down_proj`` [E, H, I]. Detached views: nothing is copied until
    :func:`chunkring.load_experts` copies a rank's share."""
    experts = block.experts
    out: dict[str, torch.Tensor] = {}
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        raise ChunkringUsageError("expected fused experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]",
                                  field="experts")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        out[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inter].detach()
        out[f"experts.{e}.up_proj.weight"] = gate_up[e, inter:].detach()
        out[f"experts.{e}.down_proj.weight"] = down[e].detach()
    return out


def route(block: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's own routing of ``rows`` [n, H]: its ``gate`` called as the block calls it, giving topk_idx
    int32 [n, K] and topk_weights float32 [n, K] - the router's weights (model dtype for Qwen3-MoE, float32
    for DeepSeek-V3) widened to float32, which is exact. Detached: the layer computes no gradients."""
    _, weights, indices = block.get_submodule("gate")(rows)
    return indices.detach().to(torch.int32).contiguous(), weights.detach().to(torch.float32).contiguous()


def plan_moe_blocks(model: nn.Module, *, world_size: int, max_tokens_per_rank: int,
                    payload: PayloadFormat | str = PayloadFormat.FP8_E4M3, streaming: bool | str = False,
                    stream_slots: int | None = None,
                    stream_slot_tokens: int | None = None) -> list[tuple[HfMoEBlock, MoEConfig]]:
    """Host-only, every check :func:`replace_moe_blocks` makes: each MoE block of ``model``
    (:func:`find_moe_blocks`) with the :class:`MoEConfig` of its layer on ``world_size`` ranks. A streaming
    ring is configured when ``streaming`` is not False or ``stream_*`` are given (the default ring,
    :meth:`MoEConfig.with_default_ring`, unless both ``stream_*`` are)."""
    payload = PayloadFormat.checked(payload)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ChunkringUsageError(f"must be a positive int, got {world_size!r}", field="world_size")
    if not (streaming is True or streaming is False or streaming == "auto"):
        raise ChunkringUsageError(f"expected True, False or 'auto', got {streaming!r}", field="streaming")
    plan = []
    for block in find_moe_blocks(model):
        _check_weights(block)
        if payload.has_scales:
            for field, hf_field, value in (("intermediate", "moe_intermediate_size", block.intermediate),
                                           ("hidden", "hidden_size", block.hidden)):
                if value % FP8_SCALE_BLOCK:
                    raise ChunkringUsageError(
                        f"{hf_field} = {value} is not a multiple of {FP8_SCALE_BLOCK}: the FP8 payload carries one "
                        f"scale per 1x{FP8_SCALE_BLOCK} block of activations ({field}); use payload='bf16'",
                        field=f"{block.name}.{field}")
        try:
            config = MoEConfig(num_experts=block.num_experts, hidden=block.hidden, intermediate=block.intermediate,
                               topk=block.topk, max_tokens_per_rank=max_tokens_per_rank, payload=payload,
                               stream_slots=stream_slots, stream_slot_tokens=stream_slot_tokens)
            if streaming is not False and not config.streaming:
                config = config.with_default_ring()
            config.check_world_size(world_size)
        except ChunkringUsageError as exc:
            raise ChunkringUsageError(f"{exc} (MoE block {block.name})", field=exc.field) from None
        plan.append((block, config))
    return plan


class ChunkringMoEBlock(nn.Module):
    """A transformers sparse MoE block computed by a :class:`MoELayer`: ``forward(hidden_states)`` takes
    [..., H] in the model's dtype and returns the same shape and dtype, like the block it replaced.

    Holds the original block's ``gate`` (and ``shared_experts``, DeepSeek-V3) as submodules, so the
    model's router-logit recording and ``.to()`` reach them; this rank's experts (``w13``, ``w2``, in the
    layer's format, on its device) are plain attributes, not parameters or buffers, so ``model.to(dtype)``
    cannot re-cast them. ``streaming`` (True, False or "auto") is what each call passes to
    :meth:`MoELayer.run`; set it between calls to switch. Each forward calls the layer through the
    ``chunkring::moe_run`` operator, so ``torch.compile`` traces it as one op and, like every entry point, it
    raises an error an earlier call recorded on the device (:meth:`MoELayer.raise_if_failed`).

    Every forward is a collective: every rank calls every block's forward the same number of times, each
    with at most ``max_tokens_per_rank`` tokens (0 is fine). Inference only: no gradients.
    """

    gate: nn.Module
    shared_experts: nn.Module | None
    w13: torch.Tensor | Fp8Weight
    w2: torch.Tensor | Fp8Weight

    def __init__(self, block: HfMoEBlock, layer: MoELayer, *, streaming: bool | str = False) -> None:
        super().__init__()
        self.architecture, self.hidden = block.architecture, block.hidden
        self.gate = block.module.get_submodule("gate")
        self.shared_experts = block.module.get_submodule("shared_experts") if block.shared_experts else None
        self.layer = layer
        self.streaming = streaming
        self.w13, self.w2 = load_experts(expert_state_dict(block.module), layer.config, first_expert=layer.first_expert,
                                         count=layer.experts_per_rank, device=layer.runtime.torch_device,
                                         rank=layer.runtime.rank)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape, dtype = hidden_states.shape, hidden_states.dtype
        rows = hidden_states.reshape(-1, self.hidden)
        topk_idx, topk_weights = route(self, rows)
        x = rows.detach().to(torch.bfloat16).contiguous()
        x_sf = None
        if self.layer.config.payload.has_scales:
            x, x_sf = quantize_rows_fp8(x)
        out = moe_run(self.layer, x, x_sf, topk_idx, topk_weights, self.w13, self.w2, streaming=self.streaming)
        routed = out.to(dtype).reshape(shape)
        shared = self.shared_experts
        if shared is not None:
            return routed + shared(hidden_states)
        return routed

    def extra_repr(self) -> str:
        return f"{self.architecture}, {self.layer!r}, streaming={self.streaming!r}"


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def replace_moe_blocks(model: nn.Module, runtime: Runtime, *, max_tokens_per_rank: int,
                       payload: PayloadFormat | str = PayloadFormat.FP8_E4M3, streaming: bool | str = False,
                       stream_slots: int | None = None, stream_slot_tokens: int | None = None,
                       timeout_s: float | None = None, decode: bool | str = False,
                       eager_graphs: bool = False) -> dict[str, nn.Module]:
    """Put a :class:`ChunkringMoEBlock` in the place of every sparse MoE block of ``model`` (Qwen3-MoE's
    ``Qwen3MoeSparseMoeBlock``, DeepSeek-V3's ``DeepseekV3MoE``), each over the :class:`MoELayer` of its
    shape, shared by every block of that shape, and holding this rank's share of its own experts, loaded from
    the block's weights. A collective: every rank passes the same model (same weights) and arguments.

    Args:
        model: a transformers model; the experts may live anywhere (load it on the CPU, replace, then move what
            remains with ``model.to(runtime.torch_device)``); each call runs on ``runtime``'s device.
        runtime: this process's :class:`chunkring.Runtime`.
        max_tokens_per_rank: tokens per rank and call, at most.
        payload: "fp8" / "bf16" or a :class:`PayloadFormat`.
        streaming: each block's call mode (False, True, "auto").
        stream_slots, stream_slot_tokens: the streaming ring (as :func:`plan_moe_blocks` says).
        timeout_s: the layers' watchdog limit.
        decode, eager_graphs: each layer's expert GEMMs of small calls and its replayed eager calls, as
            :class:`MoELayer` takes them (benchmarks/bench_model.py times a model with and without).

    Returns:
        The replaced blocks by name, in module order: the model no longer refers to them, so dropping the
        result frees every expert this rank does not own.

    Raises:
        ChunkringUsageError: a refused model or setting (:func:`plan_moe_blocks`: every check runs first, on the
            host), on every rank, before any layer is built.
    """
    plan = plan_moe_blocks(model, world_size=runtime.world_size, max_tokens_per_rank=max_tokens_per_rank,
                           payload=payload, streaming=streaming, stream_slots=stream_slots,
                           stream_slot_tokens=stream_slot_tokens)
    # One layer per distinct shape, shared by the blocks of that shape: a layer holds no weights, and a
    # model's blocks run one after another on one stream, so their calls are ordered (docs/INTEGRATION.md).
    layers: dict[MoEConfig, MoELayer] = {}
    built: list[tuple[str, ChunkringMoEBlock]] = []
    try:
        for block, config in plan:
            if config not in layers:
                layers[config] = MoELayer(runtime, config, timeout_s=timeout_s, decode=decode,
                                          eager_graphs=eager_graphs)
            built.append((block.name, ChunkringMoEBlock(block, layers[config], streaming=streaming)))
    except BaseException:
        for layer in layers.values():
            layer.close()
        raise
    replaced: dict[str, nn.Module] = {}
    for (block, _), (name, new) in zip(plan, built, strict=True):
        parent, attr = _parent(model, name)
        setattr(parent, attr, new)
        replaced[name] = block.module
    return replaced


def chunkring_blocks(model: nn.Module) -> Iterator[tuple[str, ChunkringMoEBlock]]:
    """The :class:`ChunkringMoEBlock` modules of ``model`` by name (e.g. to set ``streaming`` or close
    their layers: ``block.layer.close()`` is a collective; blocks of one shape share a layer, and
    closing it again does nothing)."""
    for name, module in model.named_modules():
        if isinstance(module, ChunkringMoEBlock):
            yield name, module
