"""What a filled DevicePlan must hold (the docstring of chunkring.moe._engine.experts.DevicePlan), checked against the
choices it should carry, and the float64 layer the expert work on it must compute: shared by the emulation tests of the
kernels that fill a plan (moe_plan_scatter: tests/unit/test_moe_plan_emulation.py; moe_wave_gather:
tests/unit/test_moe_wave_emulation.py)."""

from __future__ import annotations

import types

import numpy as np
import torch

from chunkring.moe._engine.decode import DecodeGemm
from chunkring.moe._engine.experts import ExpertCompute
from chunkring.moe.gemm import GROUP_ALIGN
from chunkring.moe.weights import quantize_weight_fp8
from tests.helpers.emulation.machine import E4M3_VALUES

__all__ = ["check_layout", "check_written", "combine_buffers", "dequantised", "expert_compute", "layer_rows",
           "layer_weights", "quantise_rows", "relative_errors", "written_slots"]


def check_layout(plan, choices: list[list[tuple[int, int, int]]], x: torch.Tensor, sf: torch.Tensor,
                 w: torch.Tensor, own_rank: int | None = None) -> np.ndarray:
    """``plan`` against the documented layout for ``choices`` (per local expert, its sorted (source, token, k)):
    counts, each group at the padded prefix sum (GROUP_ALIGN rows a group), group_end = offset + count (psum form),
    each choice once in its group, its payload bytes (``x`` [W, N, ...] any dtype), its scales MN-major
    (rows_sf[j, p] = ``sf`` [W, N, j]) and its weight (``w`` [W, N, K]) bit for bit; src -1 on every other row;
    with ``own_rank``, own_row[t * K + k] = the row of each choice of that source, -1 for every other choice.
    Returns the real rows."""
    counts = np.array([len(c) for c in choices], np.int64)
    offsets = np.concatenate([[0], np.cumsum(-(-counts // GROUP_ALIGN) * GROUP_ALIGN)])[:-1]
    assert plan.counts.tolist() == counts.tolist()
    assert plan.group_end.tolist() == (offsets + counts).tolist(), "group_end: the psum form"
    real = np.concatenate([np.arange(o, o + c) for o, c in zip(offsets, counts, strict=True)]).astype(np.int64)
    for e, (o, c) in enumerate(zip(offsets, counts, strict=True)):
        got = sorted(zip(plan.src[o:o + c].tolist(), plan.token[o:o + c].tolist(), plan.k[o:o + c].tolist(),
                         strict=True))
        assert got == choices[e], f"group {e}: each choice of the expert exactly once"
    s, t, k = plan.src[real].long(), plan.token[real].long(), plan.k[real].long()
    assert torch.equal(plan.rows[real], x.view(torch.uint8).view(*x.shape[:2], -1)[s, t]), "each row's payload"
    assert torch.equal(plan.rows_sf[:, real], sf[s, t].T), "scales MN-major: rows_sf[j, p]"
    assert torch.equal(plan.weight[real].view(torch.int32), w[s, t, k].view(torch.int32)), "each row's weight"
    pad = np.setdiff1d(np.arange(plan.src.shape[0]), real)
    assert (plan.src[pad] == -1).all(), "src -1 on every other row"
    if own_rank is not None:
        want = torch.full_like(plan.own_row, -1)
        own = real[(s == own_rank).numpy()]
        want[plan.token[own].long() * w.shape[2] + plan.k[own].long()] = torch.from_numpy(own).int()
        assert torch.equal(plan.own_row, want), "own_row: each own choice's row, -1 for every other choice"
    return real


def check_written(memory, plan, real: np.ndarray, src_stores: np.ndarray) -> None:
    """Only the real rows of the plan's row tensors hold anything (they come from torch.empty), and the filling
    launch stored src (``src_stores``: its per-byte store counts) on those rows only, once each."""
    P = plan.src.shape[0]
    for name in ("rows", "token", "k", "weight"):
        valid = memory.find(getattr(plan, name)).valid.reshape(P, -1)
        assert valid[real].all() and valid.sum() == len(real) * valid.shape[1], f"{name}: exactly the real rows"
    if plan.rows_sf.numel():
        valid = memory.find(plan.rows_sf).valid.reshape(plan.rows_sf.shape[0], P, 4)
        assert valid[:, real].all() and valid.sum() == valid[:, real].size, "rows_sf: exactly the real rows"
    stored = src_stores.reshape(P, 4)
    assert (stored[real] == 1).all() and stored.sum() == stored[real].size, "src: stored on the real rows only"


def dequantised(weight) -> np.ndarray:
    """float64 [E, N, K] of an Fp8Weight: e4m3 value times its 128x128 block's scale, exactly."""
    return E4M3_VALUES[weight.data.view(torch.uint8).numpy()] * weight.scale.double().numpy().repeat(
        128, 1).repeat(128, 2)


def layer_rows(choices: list[list[tuple[int, int, int]]], x: torch.Tensor, sf: torch.Tensor, w: torch.Tensor, w13,
               w2) -> dict[tuple[int, int], np.ndarray]:
    """float64 of the whole layer at this rank, per (source, combine slot token * K + k): the FP8 row ``x``
    [W, N, H] dequantised with ``sf``, w13[e] (rounded to bf16, as gate_up is), SwiGLU, the activation quantised
    per 1x128 as the recipe says (amax / 448, e4m3), w2[e], times the choice's weight ``w`` [W, N, K]."""
    K, inter = w.shape[2], w13.data.shape[1] // 2
    w13, w2 = dequantised(w13), dequantised(w2)
    x = E4M3_VALUES[x.view(torch.uint8).numpy()] * sf.double().numpy().repeat(128, -1)
    out = {}
    for e, of_expert in enumerate(choices):
        for s, t, k in of_expert:
            h = torch.from_numpy(w13[e] @ x[s, t]).to(torch.bfloat16).double().numpy()  # gate_up is bf16
            v = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
            amax = np.abs(v).reshape(-1, 128).max(axis=1)
            scale = np.where(amax > 0, amax / 448, 1.0).repeat(128)
            act = torch.from_numpy(v / scale).to(torch.float8_e4m3fn).double().numpy() * scale
            out[s, t * K + k] = (w2[e] @ act) * float(w[s, t, k])
    return out


def relative_errors(combine: list[torch.Tensor], want: dict) -> list[float]:
    """Per expected combine row, |got - want| / |want| (L2)."""
    return [float(np.linalg.norm(combine[s][slot].double().numpy() - ref) / np.linalg.norm(ref))
            for (s, slot), ref in want.items()]


def layer_weights(memory, experts: int, hidden: int, inter: int, seed: int = 1):
    """FP8 w13 [E, 2I, H] and w2 [E, H, I] (unit-variance outputs), registered in ``memory`` as the device holds
    them."""
    gen = torch.Generator().manual_seed(seed)
    w13 = quantize_weight_fp8(torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5)
    w2 = quantize_weight_fp8(torch.randn(experts, hidden, inter, generator=gen) / inter**0.5)
    for name, t in (("w13", w13.data), ("w13_sf", w13.scale), ("w2", w2.data), ("w2_sf", w2.scale)):
        memory.add(t, name)
    return w13, w2


def combine_buffers(memory, sources: int, slots: int, hidden: int, *,
                    initialised: bool = True) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each source's combine buffer [slots, H] bf16, NaN until written, and peer_combine (their addresses).
    ``initialised=False``: the emulated memory also holds nothing readable in a row until a kernel writes it."""
    combine = [torch.full((slots, hidden), float("nan"), dtype=torch.bfloat16) for _ in range(sources)]
    for s, c in enumerate(combine):
        memory.add(c, f"combine[{s}]", initialised=initialised)
    peer_combine = torch.tensor([c.data_ptr() for c in combine], dtype=torch.int64)
    memory.add(peer_combine, "peer_combine")
    return combine, peer_combine


def written_slots(combine: list[torch.Tensor]) -> set[tuple[int, int]]:
    """(source, slot) of every combine row not all NaN."""
    return {(s, slot) for s, c in enumerate(combine) for slot in torch.nonzero(~c.isnan().all(-1)).flatten().tolist()}


def expert_compute(config, sources: int, rank: int, experts: int, library, monkeypatch, *,
                   decode: object = None) -> ExpertCompute:
    """The host's ExpertCompute of ``rank`` on ``library`` (emulated or recording), with no GPU. ``decode``: its
    decode path's engine; None: for FP8 the decode kernels on ``library`` (which need no DeepGEMM)."""
    # No GPU: ExpertCompute asks only for the SM count (its grids: 8 blocks per SM) and the current stream.
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=1))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    if decode is None and config.payload.has_scales:
        decode = DecodeGemm(library, config, experts)
    return ExpertCompute(config, sources, rank * experts, experts, library, torch.device("cpu"), decode=decode)


def quantise_rows(x: torch.Tensor):
    """1x128 e4m3 rows as the producers make them: scale = amax / 448 (1 for a zero block)."""
    blocks = x.view(*x.shape[:-1], -1, 128)
    scale = blocks.abs().amax(-1) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (blocks / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(x.shape), scale
