"""The persistent decode consumer's host side (chunkring.moe._engine.persistent) and what it shares with its kernel
(device/kernels/moe_persistent.cu, chunkring/moe/persistent_schedule.cuh), without a GPU:

* the shared-memory layout, the fault word, the variants' codes and the kernel's limits are the header's (its pinned
  static_asserts and constants read from the source);
* w13's 5-D view lands a box as the kernel's math reads it: 8 groups of 8 gate rows then the same columns' 8 up rows;
  through the WGMMA fragment layout, each thread then holds the gate and the up value of the intermediate column
  the L1 epilogue writes (and L2's fragments are the output columns its epilogue writes);
* (the schedule's mirror, block_units: tests/unit/test_persistent_unit_list.py)
* the launches name every kernel parameter with a value its signature takes (one fused launch, or L1 then L2), their
  tensor maps describe the tensors as the kernel indexes them, a second call with the same tensors encodes no map;
* a bad variant, config or argument is refused, naming the field, before anything is launched.

What only a GPU can show (tests/gpu/test_moe_persistent.py): that the kernel computes what the reference does."""

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from chunkring import MoEConfig, PayloadFormat
from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine import persistent
from chunkring.moe._engine.persistent import (
    CLAIMS,
    FAULT_KINDS,
    LAYER_VARIANT,
    MAX_EXPERTS,
    MAX_STAGES,
    MAX_TOKEN_STAGES,
    PERSISTENT_THREADS,
    STATIC_SHARED,
    TILE_TOKENS,
    TIMELINE_WORDS,
    PersistentGemm,
    PersistentVariant,
    check_persistent_config,
    fault_of,
    shared_bytes,
    w13_view,
)
from chunkring.moe.weights import Fp8Weight
from tests.helpers.recording_library import H100, RecordingLibrary, small_weights

DEVICE = Path(__file__).resolve().parents[2] / "device"
SCHEDULE = (DEVICE / "include/chunkring/moe/persistent_schedule.cuh").read_text()
KERNEL = (DEVICE / "kernels/moe_persistent.cu").read_text()


def constant(name, text=SCHEDULE):
    return int(re.search(rf"constexpr (?:u32|int) (?:\w+ = \w+,\s*)*{name} = (\d+)", text).group(1))


def test_the_layout_is_the_headers():
    pinned = re.findall(r"launch_shared_bytes\((\d+), (\d+), (\d+)\) == (\d+)", SCHEDULE)
    assert len(pinned) == 3
    for stages, token_stages, cap, value in pinned:
        assert shared_bytes(int(stages), int(token_stages), int(cap)) == int(value)
    assert PersistentVariant().shared_bytes() + STATIC_SHARED <= H100["max_shared_memory_per_block_optin"]


def test_the_constants_are_the_headers():
    assert PERSISTENT_THREADS == constant("kMathWarps") * 32 + 128
    assert (MAX_TOKEN_STAGES, MAX_EXPERTS) == (constant("kMaxTokenStages"), constant("kMaxExperts"))
    assert MAX_STAGES == constant("kMaxStages", (DEVICE / "include/chunkring/util/stage_pipeline.cuh").read_text())
    assert max(TILE_TOKENS) == constant("kMaxTile") and TILE_TOKENS == (8, 16, 32, 64)
    assert CLAIMS == {"strided_experts": constant("kStridedExperts"), "strided_blocks": constant("kStridedBlocks"),
                      "blocked": constant("kBlocked"), "dynamic": constant("kDynamic")}
    assert TIMELINE_WORDS == constant("kTimelineWords", KERNEL)
    kinds = {"kFaultArguments": 1, "kFaultGroupStart": 2, "kFaultWeightSlot": 3, "kFaultTokenSlot": 4,
             "kFaultWeightStage": 5, "kFaultTokenStage": 6, "kFaultL1Units": 7,
             "kFaultClaimSlot": 9, "kFaultClaim": 10}
    assert {name: constant(name) for name in kinds} == kinds and set(FAULT_KINDS) == set(kinds.values())


def test_the_fault_word_decodes_as_the_header_packs_it():
    (a, want_a), (b, want_b) = [((int(k), int(blk), int(th), int(par), int(what), int(seen)), int(value, 16))
                                for k, blk, th, par, what, seen, value in re.findall(
                                    r"fault_word\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\) == 0x([0-9a-f]+)ull",
                                    SCHEDULE)]
    assert a == (5, 131, 200, 1, 7, 0) and b == (7, 0, 0, 0, 31, 15)
    assert fault_of(want_a) == "block 131 thread 200: math: a weight stage (stage or expert 7, parity 1, seen 0)"
    assert fault_of(want_b) == ("block 0 thread 0: token loader: the expert's L1 units (stage or expert 31, parity 0, "
                                "seen 15)")
    assert fault_of(0) is None


def test_the_w13_view_interleaves_gate_and_up_rows_by_8():
    E, inter, H = 2, 128, 256
    w13 = torch.randint(0, 256, (E, 2 * inter, H), dtype=torch.uint8)
    view = w13_view(w13.view(torch.float8_e4m3fn))
    assert tuple(view.shape) == (E, inter // 8, 2, 8, H)
    assert tuple(view.stride()) == (2 * inter * H, 8 * H, inter * H, H, 1)
    # The box at (k, 0, 0, group, e), 1 x 8 x 2 x 8 x 128, innermost first: tile row 16q + 8h + r holds column
    # 8 (group + q) + r of gate (h = 0) or up (h = 1).
    e, group, k = 1, 0, 128
    tile = view[e, group:group + 8, :, :, k:k + 128].reshape(128, 128)
    for row in range(128):
        q, h, r = row // 16, row // 8 % 2, row % 8
        assert torch.equal(tile[row], w13[e, h * inter + 8 * (group + q) + r, k:k + 128])


def test_sixteen_boxes_of_w13_in_its_own_order_land_as_the_one_box_does():
    """w13_boxes 16: box 2q + gu of the map in w13's own dimension order (monotone strides), 8 rows each, placed at
    1 KB 2q + gu, gives the tile the interleaving map's one box gives."""
    E, inter, H = 2, 128, 256
    w13 = torch.randint(0, 256, (E, 2 * inter, H), dtype=torch.uint8).view(torch.float8_e4m3fn)
    one, own = w13_view(w13, 1), w13_view(w13, 16)
    assert tuple(own.shape) == (E, 2, inter // 8, 8, H)
    assert tuple(own.stride()) == (2 * inter * H, inter * H, 8 * H, H, 1)
    e, group, k = 0, 8, 0
    tile = one[e, group:group + 8, :, :, k:k + 128].reshape(128, 128)
    boxes = torch.cat([own[e, box % 2, group + box // 2, :, k:k + 128] for box in range(16)])
    assert torch.equal(boxes, tile)


def fragments():
    """Every math thread's accumulator fragment of a step (ptx/wgmma.cuh): (warpgroup, warp in it, g, t, j, c) and
    the tile row and token column it holds - 64 rows a warpgroup, 16 a warp."""
    for wg in range(2):
        for in_wg in range(4):
            for g in range(8):
                for t in range(4):
                    for j in range(TOKENS // 8):
                        for c in range(4):
                            row, token = 64 * wg + 16 * in_wg + g + 8 * (c // 2), 8 * j + 2 * t + c % 2
                            yield (wg, in_wg, g, t, j, c), row, token


TOKENS = 16


def test_the_l1_fragments_pair_each_columns_gate_and_up_as_the_epilogue_reads_them():
    """The step's tile (the 5-D box of w13_view) times the tokens, read through the WGMMA fragment layout: a thread's
    c < 2 values are the gate, its c >= 2 values the up projection of intermediate column 128 chunk + 64 h + 32 wg +
    8 in_wg + g for token 8j + 2t + c % 2 - the column quantise writes and the pairing SwiGLU takes."""
    gen = torch.Generator().manual_seed(3)
    E, inter, hidden, e, chunk = 2, 256, 128, 1, 1
    w13 = torch.randn(E, 2 * inter, hidden, generator=gen, dtype=torch.float64)
    x = torch.randn(TOKENS, hidden, generator=gen, dtype=torch.float64)
    view = w13.view(E, 2, inter // 8, 8, hidden).permute(0, 2, 1, 3, 4)  # w13_view's shape, on values
    for h in range(2):
        group = (chunk * 128 + h * 64) // 8
        tile = view[e, group:group + 8].reshape(128, hidden)  # the box, innermost dimension first
        step = tile @ x.t()
        for (wg, in_wg, g, t, j, c), row, token in fragments():
            column = chunk * 128 + 64 * h + 32 * wg + 8 * in_wg + g
            weight_row = column if c < 2 else inter + column
            assert torch.isclose(step[row, token], w13[e, weight_row] @ x[token]), (h, wg, in_wg, g, t, j, c)


def test_the_l2_fragments_are_the_output_columns_store_rows_writes():
    gen = torch.Generator().manual_seed(4)
    E, hidden, inter, e, block = 2, 256, 128, 0, 1
    w2 = torch.randn(E, hidden, inter, generator=gen, dtype=torch.float64)
    act = torch.randn(TOKENS, inter, generator=gen, dtype=torch.float64)
    step = w2.view(E * hidden, inter)[e * hidden + block * 128:][:128] @ act.t()  # w2_map's box
    for (wg, in_wg, g, t, j, c), row, token in fragments():
        column = block * 128 + 64 * wg + 16 * in_wg + g + 8 * (c // 2)
        assert torch.isclose(step[row, token], w2[e, column] @ act[8 * j + 2 * t + c % 2])


@pytest.fixture
def encoded(monkeypatch):
    """The tensor maps the launcher encodes (no driver here): their arguments, in order."""
    seen = []

    def encode(args):
        seen.append(args)
        return bytes(128)

    monkeypatch.setattr(persistent, "encode_arguments", encode)
    return seen


def config(**changes):
    base = dict(num_experts=4, hidden=512, intermediate=256, topk=2, max_tokens_per_rank=8,
                payload=PayloadFormat.FP8_E4M3)
    return MoEConfig(**{**base, **changes})


def cpu_plan(P, E, H):
    return SimpleNamespace(counts=torch.zeros(E, dtype=torch.int32), group_end=torch.zeros(E, dtype=torch.int32),
                           rows=torch.zeros((P, H), dtype=torch.uint8), rows_sf=torch.ones((H // 128, P)))


E, H, INTER = 4, 512, 256


def call_parts(P):
    """A recording library, a PersistentGemm on it, weights, a plan of P rows and an output."""
    library = RecordingLibrary("moe_persistent")
    w13, w2 = small_weights(E, H, INTER)
    return (library, PersistentGemm(library, config(), E), w13, w2, cpu_plan(P, E, H),
            torch.empty((P, H), dtype=torch.bfloat16))


def test_a_fused_launch_names_every_parameter_and_maps_the_tensors_as_the_kernel_reads_them(encoded):
    P, inter = 384, INTER
    library, gemm, w13, w2, plan, out = call_parts(P)
    act, act_sf = gemm(plan, w13, w2, out)
    (launch,) = library.launches
    assert (launch["name"], launch["grid"], launch["block"]) == ("moe_persistent_gemm", 132, PERSISTENT_THREADS)
    # a dependent launch (moe_persistent.cu, "Dependent launch"): it may start while the plan's scatter ends
    assert launch["shared_bytes"] == PersistentVariant().shared_bytes() and launch["pdl"]
    assert int(launch["args"]["phases"]) == 3 and int(launch["args"]["w13_boxes"]) == 1 and launch["args"]["act"] is act
    assert launch["args"]["act_sf"] is act_sf
    assert tuple(act.shape) == (P, inter) and tuple(act_sf.shape) == (inter // 128, P) and launch["args"]["out"] is out
    assert int(launch["args"]["sf_stride"]) == P and int(launch["args"]["fault_record"]) == gemm.fault_word.data_ptr()
    fields = launch["args"]  # every other field, by identity or value: a swap of two alike ones fails here only
    assert fields["w13_sf"] is w13.scale and fields["w2_sf"] is w2.scale and fields["rows_sf"] is plan.rows_sf
    assert fields["counts"] is plan.counts and fields["group_end"] is plan.group_end and fields["sync"] is gemm.sync
    assert [int(fields[k]) for k in ("experts", "hidden", "inter")] == [E, H, inter]
    v = gemm.variant
    assert [int(fields[k]) for k in ("stages", "token_stages", "tile_cap", "claim")] == [
        v.stages, v.token_stages, v.tile_cap, CLAIMS[v.claim]]
    assert int(fields["wait_limit_ns"]) == gemm.wait_limit_ns and fields["timeline"] is None
    w13_map, w2_map, rows_map, act_map = encoded
    assert (w13_map.dims, w13_map.box) == ((H, 8, 2, inter // 8, E), (128, 8, 2, 8, 1))
    assert w13_map.strides == (H, inter * H, 8 * H, 2 * inter * H) and w13_map.address == w13.data.data_ptr()
    assert (w2_map.dims, w2_map.box, w2_map.strides) == ((inter, E * H), (128, 128), (inter,))
    assert (rows_map.dims, rows_map.box, rows_map.address) == ((H, P), (128, 8), plan.rows.data_ptr())
    assert (act_map.dims, act_map.box, act_map.address) == ((inter, P), (128, 8), act.data_ptr())
    assert {m.swizzle for m in encoded} == {"CU_TENSOR_MAP_SWIZZLE_128B"}
    gemm(plan, w13, w2, out)
    assert len(encoded) in (4, 5), "the weights' and the plan's maps come from the cache (act's may move)"
    assert "PersistentGemm(" in repr(gemm)


def test_a_split_call_launches_l1_then_l2_with_one_variant(encoded):
    P = 256
    library, gemm, w13, w2, plan, out = call_parts(P)
    variant = gemm.with_variant(fused=False, stages=3, token_stages=2, tile_cap=16, claim="blocked", sms=66)
    with pytest.raises(ChunkringUsageError, match="overwrite") as info:  # two launches, one record per block
        gemm(plan, w13, w2, out, variant=variant, timeline=torch.zeros((66, TIMELINE_WORDS), dtype=torch.int64))
    assert info.value.field == "timeline" and not library.launches
    gemm(plan, w13, w2, out, variant=variant)
    first, second = library.launches
    assert [int(first["args"]["phases"]), int(second["args"]["phases"])] == [1, 2]
    for launch in (first, second):
        assert launch["grid"] == 66 and launch["shared_bytes"] == shared_bytes(3, 2, 16)
        fields = launch["args"]
        assert (fields["stages"], fields["token_stages"], fields["tile_cap"], fields["claim"]) \
            == (3, 2, 16, CLAIMS["blocked"])
        assert launch["args"]["timeline"] is None
    assert first["args"]["act"] is second["args"]["act"], "L2 reads what L1 wrote"
    gemm(plan, w13, w2, out, variant=gemm.with_variant(w13_boxes=16))
    assert library.launches[-1]["args"]["w13_boxes"] == 16
    w13_map = next(m for m in encoded if m.box == (128, 8, 1, 1, 1))
    assert w13_map.dims == (H, 8, INTER // 8, 2, E) and w13_map.strides == (H, 8 * H, INTER * H, 2 * INTER * H)


@pytest.mark.parametrize("change,field", [
    (dict(stages=0), "stages"), (dict(stages=MAX_STAGES + 1), "stages"), (dict(stages=True), "stages"),
    (dict(token_stages=9), "token_stages"), (dict(tile_cap=128), "tile_cap"), (dict(tile_cap=12), "tile_cap"),
    (dict(claim="atomic"), "claim"), (dict(fused=1), "fused"), (dict(sms=133), "sms"), (dict(sms=0), "sms"),
    (dict(w13_boxes=2), "w13_boxes"), (dict(w13_boxes=True), "w13_boxes"),
    (dict(stages=14), "stages"),  # 14 x 16 KB + the token stages: over the H100's 227 KB
])
def test_a_bad_variant_is_refused(change, field):
    with pytest.raises(ChunkringUsageError) as info:
        PersistentVariant(**change).check(H100["multiprocessor_count"], H100["max_shared_memory_per_block_optin"])
    assert info.value.field == field


def test_bad_arguments_are_refused_before_any_launch(encoded):
    P = 256
    library, gemm, w13, w2, plan, out = call_parts(P)
    wrong = [
        (dict(w13=torch.zeros(E, 2 * INTER, H, dtype=torch.bfloat16)), "w13"),
        (dict(w2=w13), "w2"),
        (dict(w2=Fp8Weight(w2.data[:, :, :128], w2.scale[:, :, :1])), "w2"),
        (dict(out=out.float()), "out"),
        (dict(out=out[:-1]), "out"),
        (dict(plan=cpu_plan(P, E + 1, H)), "plan"),
        (dict(plan=cpu_plan(P, E, 2 * H)), "plan"),
        (dict(plan=cpu_plan(P + 2, E, H)), "plan"),  # P % 4: the scales' rows would not start on 16 bytes
        (dict(timeline=torch.zeros((4, TIMELINE_WORDS), dtype=torch.int64)), "timeline"),
        (dict(variant=PersistentVariant(tile_cap=7)), "tile_cap"),
    ]
    for change, field in wrong:
        args = {"plan": plan, "w13": w13, "w2": w2, "out": out, **change}
        extra = {k: args[k] for k in ("timeline", "variant") if k in args}
        with pytest.raises(ChunkringUsageError) as info:
            gemm(args["plan"], args["w13"], args["w2"], args["out"], **extra)
        assert info.value.field == field, change
    assert library.launches == []


@pytest.mark.parametrize("make,field", [
    (lambda lib: PersistentGemm(lib, config(payload=PayloadFormat.BF16), 4), "payload"),
    (lambda lib: PersistentGemm(lib, config(), MAX_EXPERTS + 1), "experts_per_rank"),
    (lambda lib: PersistentGemm(lib, config(), 0), "experts_per_rank"),
    (lambda lib: PersistentGemm(lib, config(), 4, wait_limit_ns=0), "wait_limit_ns"),
    (lambda lib: PersistentGemm(lib, config(), 4, variant=PersistentVariant(stages=40)), "stages"),
])
def test_a_config_the_kernel_cannot_run_is_refused(make, field):
    with pytest.raises(ChunkringUsageError) as info:
        make(RecordingLibrary("moe_persistent"))
    assert info.value.field == field


def test_a_recorded_fault_is_read_back():
    gemm = PersistentGemm(RecordingLibrary("moe_persistent"), config(), 4)
    assert gemm.fault() is None
    gemm.fault_word[0] = np.int64(0x3CC808305)
    assert gemm.fault() == fault_of(0x3CC808305)


@pytest.mark.parametrize("changes,experts,arch,field", [
    (dict(payload=PayloadFormat.BF16), 4, "sm_90", "payload"),
    (dict(hidden=520), 4, "sm_90", "hidden"),
    (dict(intermediate=200), 4, "sm_90", "intermediate"),
    ({}, MAX_EXPERTS + 1, "sm_90", "experts_per_rank"),
    ({}, 4, "sm_100", "decode"),  # wgmma is Hopper's alone
    ({}, 4, "sm_89", "decode"),
])
def test_a_layer_the_decode_path_cannot_run_is_named_before_any_build(changes, experts, arch, field):
    with pytest.raises(ChunkringUsageError) as info:
        check_persistent_config(config(**changes), experts, arch)
    assert info.value.field == field
    check_persistent_config(config(), MAX_EXPERTS, "sm_90")  # what it takes


def test_a_layer_runs_one_launch_whose_blocks_wait_only_for_running_ones():
    """LAYER_VARIANT: one launch, its units handed out by the dynamic claim - its L2 units wait for L1 units that
    running blocks hold, so it needs no block resident beside another, as a layer that shares its GPU (ranks under
    MPS, a partition's pull, the caller's kernels) cannot have."""
    assert LAYER_VARIANT.fused and LAYER_VARIANT.claim == "dynamic"
    LAYER_VARIANT.check(H100["multiprocessor_count"], H100["max_shared_memory_per_block_optin"])


def test_the_layers_expert_work_takes_the_persistent_consumer_as_its_decode_path(encoded, monkeypatch):
    """ExpertCompute with a PersistentGemm: an FP8 call on the decode path launches the persistent kernel once (L1 and
    L2) on the plan, writing the call's rows."""
    from tests.helpers.emulation.plan_layout import expert_compute

    library = RecordingLibrary("moe_persistent")
    cfg = config(max_tokens_per_rank=8)
    gemm = PersistentGemm(library, cfg, E, variant=LAYER_VARIANT)
    compute = expert_compute(cfg, 1, 0, E, RecordingLibrary("moe_experts"), monkeypatch, decode=gemm)
    assert compute.decode is gemm
    P = compute.capacity
    w13, w2 = small_weights(E, H, INTER)
    out = compute.experts(cpu_plan(P, E, H), w13, w2)
    assert out.shape == (P, H) and out.dtype == torch.bfloat16
    assert [launch["name"] for launch in library.launches] == ["moe_persistent_gemm"]
    assert [launch["args"]["phases"] for launch in library.launches] == [3]  # L1 and L2


def test_on_a_partition_the_persistent_consumer_launches_a_block_per_sm_it_has(encoded, monkeypatch):
    """Expert work on a partition of fewer SMs than the GPU's (the waves' consumer stream): the persistent consumer
    launches as many blocks as the partition has SMs, where one per SM of the GPU would leave the blocks past the
    partition to a second round; on the whole GPU, one per SM."""
    from tests.helpers.emulation.plan_layout import expert_compute

    library = RecordingLibrary("moe_persistent")
    cfg = config(max_tokens_per_rank=8)
    gemm = PersistentGemm(library, cfg, E, variant=LAYER_VARIANT)
    compute = expert_compute(cfg, 1, 0, E, RecordingLibrary("moe_experts"), monkeypatch, decode=gemm)
    w13, w2 = small_weights(E, H, INTER)
    for sms, grid in ((40, 40), (None, gemm.grid()), (gemm.grid(), gemm.grid())):
        library.launches.clear()
        compute.experts(cpu_plan(compute.capacity, E, H), w13, w2, sms=sms)
        assert [launch["grid"] for launch in library.launches] == [grid], sms
        assert [int(launch["args"]["phases"]) for launch in library.launches] == [3]
