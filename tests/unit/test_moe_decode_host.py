"""The decode path's host side (chunkring.moe._engine.decode) and the design of its kernels (device/kernels/
moe_decode.cu, chunkring/moe/decode_gemm.cuh), without a GPU:

* the fragment k order is a permutation of each 128-wide k block, and the Python mirror agrees with the
  header's pinned values;
* a lane-by-lane emulation of one warp - the loads the header describes (two 16-byte parts per row and k
  block), the PTX fragment tables of mma.m16n8k32 and the per-k-block scale promotion - computes
  W @ X^T of the dequantised operands: the data flow the kernels follow is a GEMM;
* the rule that picks the path, the config and argument checks;
* DecodeGemm's launches name every kernel parameter with a tensor of the right dtype (checked against the
  signatures parsed from the .cu), on the grids the kernels assume.

What only a GPU can show (tests/gpu/test_moe_decode.py): that the kernels do what the emulation does."""

import functools
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from chunkring import MoEConfig, MoELayer, PayloadFormat
from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine.decode import (
    DECODE_MAX_ROWS,
    DECODE_PASS_ROWS,
    DECODE_SHARED_BYTES,
    DECODE_THREADS,
    DecodeGemm,
    check_decode_config,
    decode_fits,
    fragment_k,
    mean_rows_per_expert,
)
from chunkring.moe._engine.experts import DevicePlan, ExpertCompute
from chunkring.moe.weights import Fp8Weight
from tests.helpers.recording_library import RecordingLibrary, small_weights

DEVICE = Path(__file__).resolve().parents[2] / "device"
HEADER = DEVICE / "include/chunkring/moe/decode_gemm.cuh"


def test_fragment_k_is_a_permutation_of_the_k_block():
    ks = [fragment_k(s, t, h, b) for s in range(4) for t in range(4) for h in range(2) for b in range(4)]
    assert sorted(ks) == list(range(128))


def test_the_shared_memory_is_the_headers():
    """The kernels index their warps' weight rings in the block's dynamic shared memory: the launch must give all of
    it (kWarps x kStages k blocks of kMTiles x 2 x 2 x 32 16-byte vectors)."""
    text = HEADER.read_text()
    value = {name: int(re.search(rf"constexpr u32 {name} = (\d+);", text).group(1))
             for name in ("kWarps", "kStages", "kMTiles")}
    assert re.search(r"constexpr u32 kStageVectors = kMTiles \* 2 \* 2 \* kWarp;", text)
    assert re.search(r"constexpr u32 kSharedBytes = kWarps \* kStages \* kStageVectors \* 16;", text)
    assert DECODE_SHARED_BYTES == value["kWarps"] * value["kStages"] * value["kMTiles"] * 2 * 2 * 32 * 16


def test_the_pass_is_the_headers():
    """An expert's rows per pass (the host's DECODE_PASS_ROWS, which the GPU tests use to force several passes) are
    the header's kTokenTiles token tiles of kTileTokens."""
    text = HEADER.read_text()
    tiles, tokens = (int(re.search(rf"constexpr u32 {name} = (\d+);", text).group(1))
                     for name in ("kTokenTiles", "kTileTokens"))
    assert re.search(r"constexpr u32 kPassRows = kTokenTiles \* kTileTokens;", text)
    assert DECODE_PASS_ROWS == tiles * tokens


def test_the_block_size_is_the_headers():
    """The kernels index per-warp state by threadIdx.x / 32 for kWarps warps: the launch must use exactly that."""
    text = HEADER.read_text()
    warps = int(re.search(r"constexpr u32 kWarps = (\d+);", text).group(1))
    assert re.search(r"constexpr u32 kThreads = kWarps \* kWarp;", text)
    assert DECODE_THREADS == warps * 32


def test_fragment_k_mirrors_the_header():
    pinned = re.findall(r"fragment_k\((\d+), (\d+), (\d+), (\d+)\) == (\d+)", HEADER.read_text())
    assert len(pinned) >= 5
    for *args, k in pinned:
        assert fragment_k(*map(int, args)) == int(k)


def test_each_lane_loads_two_16_byte_runs_per_row_and_k_block():
    # Steps 0-1 read bytes [16t, 16t + 16) of the k block, steps 2-3 [64 + 16t, 64 + 16t + 16): a warp's load
    # of one part covers 64 contiguous bytes of a row (whole 32-byte sectors).
    for t in range(4):
        for part in range(2):
            ks = sorted(fragment_k(s, t, h, b) for s in (2 * part, 2 * part + 1) for h in range(2) for b in range(4))
            assert ks == list(range(64 * part + 16 * t, 64 * part + 16 * t + 16))


def words(part: np.ndarray) -> list[np.ndarray]:
    return [part[4 * i:4 * i + 4] for i in range(4)]  # u32 word i: bytes 4i..4i+3, lowest k first


#: Where byte i of register half h of lane t sits along the MMA's k (0..31): the PTX ISA's table for 8-bit
#: m16n8k32 ("ptx": 4t + i, then 16 further), and another order seen described for it ("paired": 8t + i, then 4
#: further). The kernels rely only on what both share - A's half h and B's half h of one lane hold the same k
#: in the same byte - so the emulation below must compute the same GEMM under either.
K_ORDERS = {"ptx": lambda t, h: 4 * t + 16 * h, "paired": lambda t, h: 8 * t + 4 * h}


def mma_m16n8k32(c, a, b, k_order="ptx"):
    """mma.m16n8k32 .row.col on per-lane fragments (lists of 32 lanes): a[lane] 4 words of 4 values, b[lane]
    2 words, c[lane] 4 floats; rows and columns as the PTX ISA's tables (g = lane // 4, t = lane % 4), k as
    ``k_order`` says."""
    at = K_ORDERS[k_order]
    A, B = np.zeros((16, 32)), np.zeros((32, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for h in range(2):
            k = at(t, h)
            A[g, k:k + 4], A[g + 8, k:k + 4] = a[lane][2 * h], a[lane][2 * h + 1]
            B[k:k + 4, g] = b[lane][h]
    C = A @ B
    for lane in range(32):
        g, t = divmod(lane, 4)
        c[lane] += np.array([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])


def emulate_warp_tile(w, w_sf, x, x_sf, k_order="ptx"):
    """One m tile (w [16, K] values, w_sf [K / 128] its scale row) and one token tile (x [8, K], x_sf [8, K / 128])
    as decode_gemm.cuh's warp_gemm computes it: per k block, each lane's two 16-byte parts of its rows and its
    token, the four MMA steps' fragments (mma_stage), the block's sum times both scales. Returns C [16, 8]."""
    acc = [np.zeros(4) for _ in range(32)]
    for kb in range(w.shape[1] // 128):
        part = [np.zeros(4) for _ in range(32)]
        for s in range(4):
            a, b = [], []
            for lane in range(32):
                g, t = divmod(lane, 4)
                start = kb * 128 + 64 * (s // 2) + 16 * t
                row_g, row_g8, tok = (words(m[start:start + 16]) for m in (w[g], w[g + 8], x[g]))
                at = (s % 2) * 2
                a.append([row_g[at], row_g8[at], row_g[at + 1], row_g8[at + 1]])
                b.append([tok[at], tok[at + 1]])
            mma_m16n8k32(part, a, b, k_order)
        for lane in range(32):
            t = lane % 4
            for c in range(4):
                acc[lane][c] += part[lane][c] * w_sf[kb] * x_sf[2 * t + c % 2, kb]
    out = np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        out[g, 2 * t], out[g, 2 * t + 1], out[g + 8, 2 * t], out[g + 8, 2 * t + 1] = acc[lane]
    return out


@pytest.mark.parametrize("k_order", sorted(K_ORDERS))
def test_the_warp_data_flow_computes_the_block_scaled_gemm(k_order):
    gen = torch.Generator().manual_seed(7)
    K = 384  # three k blocks
    w = torch.randn(16, K, generator=gen).to(torch.float8_e4m3fn).double().numpy()
    x = torch.randn(8, K, generator=gen).to(torch.float8_e4m3fn).double().numpy()
    w_sf = torch.rand(K // 128, generator=gen).double().numpy() + 0.5
    x_sf = torch.rand(8, K // 128, generator=gen).double().numpy() + 0.5
    got = emulate_warp_tile(w, w_sf, x, x_sf, k_order)
    want = (w * np.repeat(w_sf, 128)) @ (x * np.repeat(x_sf, 128, axis=1)).T
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
    # Not vacuous: the same flow with the hi part taken from the lo part's place is wrong.
    shifted = x.copy()
    shifted[:, 64:128] = x[:, 0:64]
    assert not np.allclose(emulate_warp_tile(w, w_sf, shifted, x_sf, k_order), want)


def config(**changes):
    base = dict(num_experts=32, hidden=4096, intermediate=2048, topk=6, max_tokens_per_rank=8,
                payload=PayloadFormat.FP8_E4M3)
    return MoEConfig(**{**base, **changes})


def test_the_rule_picks_decode_while_mean_rows_per_expert_are_at_most_the_bound():
    assert mean_rows_per_expert(config(), 1) == 8 * 6 / 32
    assert decode_fits(config(), 1, max_rows=8)
    bound_tokens = 8 * 32 // 6  # 42 tokens: 7.9 rows per expert
    assert decode_fits(config(max_tokens_per_rank=bound_tokens), 1, max_rows=8)
    assert not decode_fits(config(max_tokens_per_rank=bound_tokens + 1), 1, max_rows=8)
    assert not decode_fits(config(max_tokens_per_rank=64), 8, max_rows=8)  # 8 ranks' tokens reach every rank's experts
    assert decode_fits(config(max_tokens_per_rank=64), 8, max_rows=96)
    assert decode_fits(config(max_tokens_per_rank=16), 1, max_rows=3)
    assert not decode_fits(config(max_tokens_per_rank=17), 1, max_rows=3)


def test_the_default_bound_is_the_largest_measured_size_the_decode_path_won():
    """DECODE_MAX_ROWS is 32 mean rows per expert: the V3 width's 128 tokens at one rank (32 experts, top-8), where
    the layer on the persistent consumer last measured faster than on DeepGEMM's path; 64 rows measured slower, and
    everything past 32 rows goes to DeepGEMM's - on the flash shape (top-6) past 170 tokens."""
    assert DECODE_MAX_ROWS == 32
    v3 = config(max_tokens_per_rank=8192, num_experts=32, topk=8)
    assert decode_fits(v3, 1, tokens=128) and not decode_fits(v3, 1, tokens=129)
    flash = config(max_tokens_per_rank=8192, num_experts=32, topk=6)
    assert all(decode_fits(flash, 1, tokens=n) for n in (0, 1, 8, 32, 128, 170))
    assert not any(decode_fits(flash, 1, tokens=n) for n in (171, 256, 512, 2048, 8192))
    assert not decode_fits(flash, 8, tokens=32)  # 8 ranks' tokens reach every rank's experts: 48 rows


def test_per_call_the_rule_counts_the_calls_tokens_not_the_layers_capacity():
    """decode="auto" asks per call (LayerResources.decode_for): a layer sized for 8,192 tokens per rank still
    takes the decode path for a call of a few tokens, and DeepGEMM's for a call past the bound."""
    big = config(max_tokens_per_rank=8192)
    bound_tokens = 8 * 32 // 6
    fits = functools.partial(decode_fits, max_rows=8)
    assert not fits(big, 1)
    assert mean_rows_per_expert(big, 4, tokens=2) == 2 * 4 * 6 / 32
    assert fits(big, 1, tokens=1) and fits(big, 1, tokens=bound_tokens) and fits(big, 1, tokens=0)
    assert not fits(big, 1, tokens=bound_tokens + 1)
    assert fits(big, 4, tokens=bound_tokens // 4) and not fits(big, 4, tokens=bound_tokens // 4 + 1)


@pytest.mark.parametrize("tokens", [-1, True, 1.5])
def test_the_rule_refuses_a_bad_token_count(tokens):
    with pytest.raises(ChunkringUsageError) as info:
        decode_fits(config(), 1, tokens=tokens)
    assert info.value.field == "tokens"


def test_the_rule_declines_a_layer_without_fp8_and_leaves_shapes_to_the_engine():
    """A bf16 layer never takes the decode path; a shape the decode kernels refuse (hidden not a multiple of 256)
    is no longer the rule's to decline: the layer's decode path is the persistent consumer, which takes it, and the
    layer settles once whether its engine can run the layer (resources.auto_decode)."""
    assert not decode_fits(config(payload=PayloadFormat.BF16), 1, max_rows=10**6)
    wide = config(hidden=1152)
    assert decode_fits(wide, 1, max_rows=10**6)
    with pytest.raises(ChunkringUsageError) as info:
        check_decode_config(wide)  # the decode kernels' own rule, for DecodeGemm
    assert info.value.field == "hidden"


@pytest.mark.parametrize("max_rows", [-1, True, 2.5])
def test_the_rule_refuses_a_bad_bound(max_rows):
    with pytest.raises(ChunkringUsageError) as info:
        decode_fits(config(), 1, max_rows=max_rows)
    assert info.value.field == "max_rows"


def cpu_plan(P, E, H):
    counts = torch.zeros(E, dtype=torch.int32)
    return DevicePlan(counts=counts, group_end=torch.zeros(E, dtype=torch.int32),
                      src=torch.full((P,), -1, dtype=torch.int32), token=torch.zeros(P, dtype=torch.int32),
                      k=torch.zeros(P, dtype=torch.int32), weight=torch.zeros(P),
                      rows=torch.zeros((P, H), dtype=torch.uint8), rows_sf=torch.ones((H // 128, P)),
                      own_row=torch.full((P,), -1, dtype=torch.int32))  # read by no decode kernel


def test_the_launches_name_every_parameter_on_the_kernels_grids():
    E, H, inter, P = 3, 512, 256, 384
    library = RecordingLibrary("moe_decode")
    gemm = DecodeGemm(library, config(num_experts=E, hidden=H, intermediate=inter, topk=2), E)
    w13, w2 = small_weights(E, H, inter)
    out = torch.empty((P, H), dtype=torch.bfloat16)
    gemm(cpu_plan(P, E, H), w13, w2, out)
    first, second = library.launches
    a1, a2 = first["args"], second["args"]
    assert (first["name"], first["grid"], first["block"]) == ("moe_decode_l1", E * inter // 128, DECODE_THREADS)
    assert (second["name"], second["grid"], second["block"]) == ("moe_decode_l2", E * H // 256, DECODE_THREADS)
    assert gemm.grids() == (first["grid"], second["grid"])
    assert [launch["shared_bytes"] for launch in library.launches] == [DECODE_SHARED_BYTES] * 2, \
        "both kernels' warps keep their weight rings"
    assert a1["act"] is a2["act"] and a1["act_sf"] is a2["act_sf"], "L2 reads what L1 wrote"
    assert tuple(a1["act"].shape) == (P, inter) and tuple(a1["act_sf"].shape) == (inter // 128, P)
    assert a1["sf_stride"] == a2["sf_stride"] == P and a2["out"] is out
    assert "DecodeGemm(" in repr(gemm)


def misaligned(data):
    """A contiguous copy of ``data`` that starts one byte past an aligned address."""
    flat = torch.zeros(data.numel() + 1, dtype=torch.uint8)
    copy = flat[1:].view(data.shape)
    copy.copy_(data.view(torch.uint8))
    assert copy.is_contiguous() and copy.data_ptr() % 16
    return copy.view(torch.float8_e4m3fn)


def test_bad_arguments_are_refused_before_any_launch():
    E, H, inter, P = 2, 256, 128, 256
    library = RecordingLibrary("moe_decode")
    gemm = DecodeGemm(library, config(num_experts=E, hidden=H, intermediate=inter, topk=2), E)
    w13, w2 = small_weights(E, H, inter)
    plan, out = cpu_plan(P, E, H), torch.empty((P, H), dtype=torch.bfloat16)
    wrong = [
        (dict(w13=torch.zeros(E, 2 * inter, H, dtype=torch.bfloat16)), "w13"),
        (dict(w2=w13), "w2"),
        (dict(out=out.float()), "out"),
        (dict(out=out[:-1]), "out"),
        (dict(plan=cpu_plan(P, E + 1, H)), "plan"),
        (dict(plan=cpu_plan(P, E, 2 * H)), "plan"),
        (dict(w2=Fp8Weight(misaligned(w2.data), w2.scale)), "w2"),
    ]
    for change, field in wrong:
        args = {"plan": plan, "w13": w13, "w2": w2, "out": out, **change}
        with pytest.raises(ChunkringUsageError) as info:
            gemm(args["plan"], args["w13"], args["w2"], args["out"])
        assert info.value.field == field, change
    assert library.launches == []
    for bad in (0, True, "2"):
        with pytest.raises(ChunkringUsageError) as info:
            DecodeGemm(library, config(num_experts=E, hidden=H, intermediate=inter, topk=2), bad)
        assert info.value.field == "experts_per_rank"
    with pytest.raises(ChunkringUsageError) as info:
        DecodeGemm(library, config(payload=PayloadFormat.BF16), 4)
    assert info.value.field == "payload"


def test_expert_compute_takes_only_a_decode_engine():
    with pytest.raises(ChunkringUsageError) as info:
        ExpertCompute(config(), 1, 0, 32, None, torch.device("cpu"), decode=True)
    assert info.value.field == "decode"


@pytest.mark.parametrize("decode,changes,capability,field", [
    ("yes", {}, (9, 0), "decode"), (1, {}, (9, 0), "decode"), (None, {}, (9, 0), "decode"),
    (True, dict(payload=PayloadFormat.BF16), (9, 0), "payload"),
    (True, dict(num_experts=512), (9, 0), "experts_per_rank"),  # more local experts than the consumer holds
    (True, {}, (10, 0), "decode"),  # the decode path's kernel is Hopper's alone
])
def test_the_layer_refuses_a_bad_decode_choice_before_building_anything(decode, changes, capability, field):
    # A stand-in runtime with nothing to build on: the refusal comes first.
    runtime = SimpleNamespace(world_size=1, device=SimpleNamespace(compute_capability=capability))
    with pytest.raises(ChunkringUsageError) as info:
        MoELayer(runtime, config(**changes), decode=decode)
    assert info.value.field == field
