"""A checkpoint's routed experts, mapped onto one rank's experts in the layout :class:`~chunkring.moe.MoELayer` takes.

A checkpoint stores each expert's projections as tensors of their own. The default names are Hugging
Face's, which DeepSeek-V3 and Qwen3-MoE use: ``{prefix}experts.{e}.gate_proj.weight`` [I, H],
``{prefix}experts.{e}.up_proj.weight`` [I, H] and ``{prefix}experts.{e}.down_proj.weight`` [H, I], with
``prefix`` the layer's MLP (``model.layers.3.mlp.``); :class:`ExpertKeys` names others (Mixtral's
``w1``/``w3``/``w2``, say). The layer takes the experts of one rank stacked: w13 [E_local, 2I, H] (gate rows
first, then up rows) and w2 [E_local, H, I], in the format its payload's GEMMs run on
(:func:`chunkring.expert_weights`): :class:`~chunkring.moe.weights.Fp8Weight` for the FP8 payload, bfloat16
tensors for the bf16 payload.

Two checkpoint formats, told apart by the weights' dtype (every weight of the rank's experts must have
the same one):

* bfloat16 weights: stacked; for the FP8 payload then quantised once, by the path
  :func:`chunkring.expert_weights` takes (:func:`~chunkring.moe.weights.payload_weights`).
* FP8 weights as DeepSeek-V3 stores them: ``weight`` float8_e4m3fn [N, K] next to ``weight_scale_inv``
  float32 [ceil(N/128), ceil(K/128)], the factor each 128x128 block is MULTIPLIED by when dequantising -
  despite the name, it is what :class:`Fp8Weight` calls ``scale``. The convention, from the public code:
  DeepSeek-V3's README_WEIGHTS.md ("The dequantization process is performed as: (128x128 weight block) *
  weight_scale_inv") and ``inference/kernel.py`` ``weight_dequant_kernel`` (``y = x * s``, s the block's
  entry of ``weight_scale_inv``); transformers' ``integrations/finegrained_fp8.py`` (``Fp8Quantize`` stores
  ``1 / (448 / absmax)`` as ``weight_scale_inv``, ``Fp8Dequantize`` multiplies by it). For the FP8 payload
  the bytes and scales are kept as stored - no requantisation: gate and up concatenate along N, whole
  blocks each, because the FP8 payload's ``intermediate`` is a multiple of 128 (:class:`MoEConfig`). For the
  bf16 payload each projection is dequantised (fp32 ``data * scale``, rounded to bfloat16).

What is read: the keys of this rank's experts and nothing else - three per expert, plus a scale per FP8
weight - and one membership test (is there an expert past ``config.num_experts``?). Every other key (other
ranks' experts, the router, shared experts, other layers) is left alone on purpose: a state dict holds the
whole model, and each rank takes its share. A key of ours that is missing, mis-shaped or of a wrong dtype
is a :class:`ChunkringUsageError` naming it (``field``), the expert and the rank - never a zero, a skip
or a silent conversion. Every check runs on tensor metadata, before anything is allocated or copied;
then only this rank's experts are copied, one projection at a time, straight into the output on
``device`` (no stack of every expert, on the host or the device).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe.config import MoEConfig
from chunkring.moe.weights import WEIGHT_BLOCK, ExpertWeights, Fp8Weight, payload_weights

__all__ = ["HF_EXPERT_KEYS", "ExpertKeys", "load_experts"]

_PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertKeys:
    """Where a checkpoint keeps one expert's projections: ``gate``, ``up`` and ``down`` are templates of
    the weights' keys, formatted with ``prefix`` and the global expert index ``e``; ``scale`` is the template
    of an FP8 weight's block-scale key, formatted with ``weight`` (that weight's key). The defaults
    (:data:`HF_EXPERT_KEYS`) are Hugging Face's names, as DeepSeek-V3 and Qwen3-MoE checkpoints use them."""

    gate: str = "{prefix}experts.{e}.gate_proj.weight"
    up: str = "{prefix}experts.{e}.up_proj.weight"
    down: str = "{prefix}experts.{e}.down_proj.weight"
    scale: str = "{weight}_scale_inv"

    def __post_init__(self) -> None:
        for name in _PROJECTIONS:
            template = getattr(self, name)
            if not isinstance(template, str):
                raise ChunkringUsageError(f"expected a str template, got {type(template).__name__}", field=name)
            first, second = (_format(name, template, prefix="p.", e=e) for e in (0, 1))
            if first == second:
                raise ChunkringUsageError(f"{template!r} names every expert alike: it needs {{e}}", field=name)
        if len({self.key(name, "p.", 0) for name in _PROJECTIONS}) < len(_PROJECTIONS):
            raise ChunkringUsageError(f"gate, up and down name the same key: {self.gate!r}, {self.up!r}, "
                                      f"{self.down!r}", field="up")
        if not isinstance(self.scale, str):
            raise ChunkringUsageError(f"expected a str template, got {type(self.scale).__name__}", field="scale")
        if _format("scale", self.scale, weight="w") == "w":
            raise ChunkringUsageError(f"{self.scale!r} names the weight itself, not its scale", field="scale")

    def key(self, projection: str, prefix: str, e: int) -> str:
        """The key of expert ``e``'s ``projection`` ("gate", "up" or "down") under ``prefix``."""
        return str(getattr(self, projection)).format(prefix=prefix, e=e)

    def scale_key(self, weight_key: str) -> str:
        """The key of the block scales of the FP8 weight at ``weight_key``."""
        return self.scale.format(weight=weight_key)


def _format(field: str, template: str, **values: object) -> str:
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        allowed = ", ".join("{" + name + "}" for name in values)
        raise ChunkringUsageError(f"{template!r} may use only {allowed}: {exc!r}", field=field) from None


#: Hugging Face's expert names (DeepSeek-V3, Qwen3-MoE): ``{prefix}experts.{e}.{gate,up,down}_proj.weight``,
#: FP8 scales at ``<weight key>_scale_inv``.
HF_EXPERT_KEYS = ExpertKeys()


@dataclass(frozen=True)
class _Projection:
    """One projection of one expert as the checkpoint holds it, checked: ``scale`` None for bfloat16."""

    key: str
    weight: torch.Tensor
    scale: torch.Tensor | None


def load_experts(state_dict: Mapping[str, torch.Tensor], config: MoEConfig, *, first_expert: int, count: int,
                 prefix: str = "", keys: ExpertKeys = HF_EXPERT_KEYS, device: torch.device | str = "cpu",
                 rank: int | None = None) -> ExpertWeights:
    """Experts ``[first_expert, first_expert + count)`` of a checkpoint, as the layer of ``config`` takes them.

    Host-only until the copies: no live layer needed (for a layer's share pass ``layer.first_expert``,
    ``layer.experts_per_rank``, its device and rank). Keys of other experts, and any other key, are ignored.

    Args:
        state_dict: name -> tensor: a ``torch.load`` result, ``safetensors.torch.load_file``, or any mapping
            that loads a tensor when indexed. Weights bfloat16 (quantised here for the FP8 payload), or
            float8_e4m3fn each with its float32 128x128 block scale (DeepSeek-V3's ``weight_scale_inv``: kept
            as is for the FP8 payload, dequantised for the bf16 one).
        config: the layer's config.
        first_expert, count: the global index of this rank's first expert, and how many it owns.
        prefix: the layer's key prefix (``"model.layers.3.mlp."``).
        keys: the key templates (:data:`HF_EXPERT_KEYS`: Hugging Face's), formatted with ``prefix`` and the
            global expert index.
        device: where the stacked experts go.
        rank: labels error messages only.

    Returns:
        (w13 [count, 2I, H] - gate rows, then up rows -, w2 [count, H, I]): two
        :class:`~chunkring.moe.weights.Fp8Weight` for the FP8 payload, two bfloat16 tensors for the bf16 payload
        - what :func:`chunkring.expert_weights` returns, ready for :meth:`MoELayer.run` / :meth:`MoELayer.forward`.

    Raises:
        ChunkringUsageError: (``field``: the key) a missing, mis-shaped or mistyped key of these experts, an FP8
            weight without its scale, a bfloat16 weight with one, experts of mixed formats, or an expert past
            ``config.num_experts`` under ``prefix`` - before anything is allocated.
    """
    if not isinstance(config, MoEConfig):
        raise ChunkringUsageError(f"expected a MoEConfig, got {type(config).__name__}", field="config")
    if not isinstance(state_dict, Mapping):
        raise ChunkringUsageError(f"expected a mapping of names to tensors, got {type(state_dict).__name__}",
                                  field="state_dict")
    if not isinstance(keys, ExpertKeys):
        raise ChunkringUsageError(f"expected an ExpertKeys, got {type(keys).__name__}", field="keys")
    if not isinstance(prefix, str):
        raise ChunkringUsageError(f"expected a str, got {type(prefix).__name__}", field="prefix")
    for name, value, low in (("first_expert", first_expert, 0), ("count", count, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ChunkringUsageError(f"must be an int >= {low}, got {value!r}", field=name)
    if first_expert + count > config.num_experts:
        raise ChunkringUsageError(f"experts [{first_expert}, {first_expert + count}) run past the config's "
                                  f"{config.num_experts}", field="count")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ChunkringUsageError(f"must be a non-negative int or None, got {rank!r}", field="rank")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ChunkringUsageError(f"not a torch device: {exc}", field="device") from None

    owner = f"experts [{first_expert}, {first_expert + count})" + ("" if rank is None else f" of rank {rank}")
    beyond = keys.key("gate", prefix, config.num_experts)
    if beyond in state_dict:
        raise ChunkringUsageError(f"the checkpoint has an expert {config.num_experts} under {prefix!r}, the config "
                                  f"only {config.num_experts} experts (a wrong config or prefix?)", field=beyond)
    H, inter = config.hidden, config.intermediate
    shapes = {"gate": (inter, H), "up": (inter, H), "down": (H, inter)}
    experts = [[_read(state_dict, keys, keys.key(proj, prefix, e), shapes[proj], f"expert {e}'s {proj} weight, "
                      f"wanted by {owner}") for proj in _PROJECTIONS]
               for e in range(first_expert, first_expert + count)]
    reference = experts[0][0]
    for projection in (p for expert in experts for p in expert):
        if (projection.scale is None) != (reference.scale is None):
            raise ChunkringUsageError(f"is {projection.weight.dtype} but {reference.key} is "
                                      f"{reference.weight.dtype}: {owner} mix checkpoint formats", field=projection.key)

    if reference.scale is None:
        w13, w2 = _stack(experts, config, device, lambda p: p.weight)
        return payload_weights(config, w13, w2)
    if not config.payload.has_scales:
        return _stack(experts, config, device, lambda p: _dequantize(p, device))
    return _stack_fp8(experts, config, device)


def _read(state_dict: Mapping[str, torch.Tensor], keys: ExpertKeys, key: str, shape: tuple[int, int],
          what: str) -> _Projection:
    """The projection at ``key`` with its scale if it is FP8, checked against ``shape`` ([N, K])."""
    if key not in state_dict:
        raise ChunkringUsageError(f"missing from the state dict ({what})", field=key)
    weight = state_dict[key]
    if not isinstance(weight, torch.Tensor):
        raise ChunkringUsageError(f"expected a torch.Tensor, got {type(weight).__name__} ({what})", field=key)
    if tuple(weight.shape) != shape:
        raise ChunkringUsageError(f"expected shape {shape}, got {tuple(weight.shape)} ({what})", field=key)
    scale_key = keys.scale_key(key)
    if weight.dtype == torch.bfloat16:
        if scale_key in state_dict:
            raise ChunkringUsageError(f"is the scale of {key}, which is bfloat16, not float8_e4m3fn: dequantised "
                                      f"already, or stored in a wrong dtype? ({what})", field=scale_key)
        return _Projection(key, weight, None)
    if weight.dtype != torch.float8_e4m3fn:
        raise ChunkringUsageError(f"expected dtype bfloat16, or float8_e4m3fn with its scale, got {weight.dtype} "
                                  f"({what})", field=key)
    if scale_key not in state_dict:
        raise ChunkringUsageError(f"is float8_e4m3fn but its scale {scale_key} is missing from the state dict "
                                  f"({what})", field=key)
    scale = state_dict[scale_key]
    blocks = tuple(-(-n // WEIGHT_BLOCK) for n in shape)
    if not isinstance(scale, torch.Tensor):
        raise ChunkringUsageError(f"expected a torch.Tensor, got {type(scale).__name__} ({what})", field=scale_key)
    if tuple(scale.shape) != blocks:
        raise ChunkringUsageError(f"expected shape {blocks} (one scale per {WEIGHT_BLOCK}x{WEIGHT_BLOCK} block of "
                                  f"{shape}), got {tuple(scale.shape)} ({what})", field=scale_key)
    if scale.dtype != torch.float32:
        raise ChunkringUsageError(f"expected dtype torch.float32, got {scale.dtype} ({what})", field=scale_key)
    return _Projection(key, weight, scale)


def _scale(projection: _Projection) -> torch.Tensor:
    """The block scales of an FP8 projection (``_read`` gave it one)."""
    assert projection.scale is not None
    return projection.scale


def _dequantize(projection: _Projection, device: torch.device) -> torch.Tensor:
    """float32 [N, K] on ``device``: the FP8 projection times its block scales (:meth:`Fp8Weight.dequantize`),
    one projection's fp32 copy at a time."""
    one = Fp8Weight(projection.weight.to(device)[None], _scale(projection).to(device)[None])
    return one.dequantize()[0]


def _stack(experts: list[list[_Projection]], config: MoEConfig, device: torch.device,
           value: Callable[[_Projection], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """bfloat16 w13 [E_local, 2I, H] and w2 [E_local, H, I] on ``device``, each projection copied in from
    ``value(projection)`` (rounded to bfloat16 if it is wider)."""
    H, inter = config.hidden, config.intermediate
    w13 = torch.empty((len(experts), 2 * inter, H), dtype=torch.bfloat16, device=device)
    w2 = torch.empty((len(experts), H, inter), dtype=torch.bfloat16, device=device)
    for i, (gate, up, down) in enumerate(experts):
        w13[i, :inter].copy_(value(gate))
        w13[i, inter:].copy_(value(up))
        w2[i].copy_(value(down))
    return w13, w2


def _stack_fp8(experts: list[list[_Projection]], config: MoEConfig,
               device: torch.device) -> tuple[Fp8Weight, Fp8Weight]:
    """The FP8 projections as stored, stacked into two :class:`Fp8Weight` on ``device``. Gate's and up's
    scale rows concatenate like their weight rows: ``intermediate`` is a multiple of 128 for the FP8
    payload, so no 128-row block holds rows of both."""
    H, inter = config.hidden, config.intermediate
    assert inter % WEIGHT_BLOCK == 0, "MoEConfig checks it for the FP8 payload"
    E, ib, hb = len(experts), inter // WEIGHT_BLOCK, -(-H // WEIGHT_BLOCK)
    w13 = Fp8Weight(torch.empty((E, 2 * inter, H), dtype=torch.float8_e4m3fn, device=device),
                    torch.empty((E, 2 * ib, hb), dtype=torch.float32, device=device))
    w2 = Fp8Weight(torch.empty((E, H, inter), dtype=torch.float8_e4m3fn, device=device),
                   torch.empty((E, hb, ib), dtype=torch.float32, device=device))
    for i, (gate, up, down) in enumerate(experts):
        w13.data[i, :inter].copy_(gate.weight)
        w13.data[i, inter:].copy_(up.weight)
        w2.data[i].copy_(down.weight)
        w13.scale[i, :ib].copy_(_scale(gate))
        w13.scale[i, ib:].copy_(_scale(up))
        w2.scale[i].copy_(_scale(down))
    return w13, w2
