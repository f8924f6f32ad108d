"""The MoE layer's producers run whole on the CPU: ``chunkring.moe.routing.router_logits`` launches
``moe_router_logits`` and ``enqueue_produce`` launches ``moe_produce_chunk`` (both emulated as written,
tests/helpers/emulation/produce.py) on a real :class:`chunkring.Ring` over the stand-in runtime, and the layer's
``moe_pull`` (tests/helpers/emulation/pull.py) reads the chunks into a stage, concurrently, blocks in a seeded order.

What it pins: the router's logits within the fp32 bound of a float64 GEMM and bit for bit batch-invariant (a chunk's
rows equal the whole batch's, for several token counts and hidden sizes of 1, 3 and 16 slices); the pulled stage's
routing equal to chunkring.moe.routing.route on the same logits (ties: the lower expert; NaN above every logit,
+inf included, as torch.topk ranks it),
weights within 4 ulps, FP8 rows and scales bit for bit quantize_rows_fp8, bf16 rows as given; grids of one block
and of one block per row (arrivals, left zero), a ring of 2 slots wrapping over 4 chunks, end of stream (the last
chunk held). The broken variant Mutant::kArriveBeforeRows (a block arrives, so the last may publish, before it
stores its rows) is caught under seeded interleavings - a consumer reading slot bytes the chunk has not written, or
a row stored after the publish - while the kernel as written passes every seed tried.
What only a GPU shows: the tensor core's own summation order and precision, expf's last ulps, memory ordering."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import chunkring.moe._engine.producer as producer
import chunkring.moe.routing as routing
from chunkring import PayloadFormat, Ring, RingSpec
from chunkring.moe._engine.producer import enqueue_produce
from chunkring.moe._engine.resources import PULL_BLOCK
from chunkring.moe._engine.stage import Stage
from chunkring.moe.routing import quantize_rows_fp8, route, router_logits, router_slices
from tests.helpers.emulation import produce as produce_emu
from tests.helpers.emulation.library import EmulatedLibrary
from tests.helpers.emulation.machine import DEVICE, EmptyTracker, EmulatedMemoryError, Memory
from tests.helpers.emulation.ring import HeapRuntime, Streams, SymmetricHeap

S, T, H, K, E = 2, 5, 256, 3, 40  # slots, tokens per slot, hidden, topk, experts (two tiles of 32, padded)
SIZES = [5, 3, 5, 2]  # 4 chunks through 2 slots, at and below tokens_per_slot
PRODUCER = "the producer stream"


class OnDevice(torch.Tensor):
    """A CPU tensor router_logits takes for a device one (its GPU path is the one that launches)."""

    @property
    def is_cuda(self) -> bool:
        return True


def bf16(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# ---------------------------------------------------------------- the router GEMM
def emulated_logits(monkeypatch, hidden: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    memory = Memory()
    library = EmulatedLibrary(memory, {"moe_router_logits": produce_emu.router_kernel},
                              sources=("moe_produce.cu",), initialised=EmptyTracker(monkeypatch).initialised)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    logits = router_logits(hidden.clone().as_subclass(OnDevice), router, kernels=library)
    (name, grid, block, _), = library.launches
    assert (name, block) == ("moe_router_logits", 32 * router_slices(hidden.shape[1]))
    return logits.as_subclass(torch.Tensor)


@pytest.mark.parametrize(("hidden", "experts"), [(128, 40), (1040, 40), (8208, 8)])  # 1, 3 and 16 slices
def test_router_logits_are_fp32_sums_and_batch_invariant_bit_for_bit(monkeypatch, hidden, experts):
    batch, router = bf16(40, hidden, seed=hidden), bf16(experts, hidden, seed=1) * 0.05
    whole = emulated_logits(monkeypatch, batch, router)
    exact = batch.double() @ router.double().T
    steps = hidden // 16 + router_slices(hidden)  # one fp32 rounding per MMA step and per slice added
    gamma = steps * 2.0**-24 / (1 - steps * 2.0**-24)
    assert ((whole.double() - exact).abs() <= gamma * (batch.double().abs() @ router.double().abs().T)).all()
    for n, start in ((1, 7), (5, 0), (16, 16), (17, 3), (40, 0)):
        chunk = emulated_logits(monkeypatch, batch[start:start + n], router)
        assert torch.equal(chunk.view(torch.int32), whole[start:start + n].view(torch.int32)), (n, start)


# ---------------------------------------------------------------- the fused producer, pulled
class Producer:
    """One rank's ring and stage on one emulated machine; router_logits and enqueue_produce launch on it."""

    def __init__(self, monkeypatch, payload: PayloadFormat, *, seed: int = 0, rows_first: bool = True,
                 pull_grid: int = 1) -> None:
        heap, self.memory = SymmetricHeap(1), Memory()
        self.streams = Streams(self.memory, seed)
        spec = RingSpec(world_size=1, num_slots=S, tokens_per_slot=T, hidden=H, payload=payload, topk=K,
                        num_experts=E)
        self.ring = Ring(HeapRuntime(heap, 0), spec, timeout_s=5.0, transport="auto")
        self.memory.add(self.ring.buffer, "ring")
        self.fp8, n = payload is PayloadFormat.FP8_E4M3, sum(SIZES)
        x = torch.zeros((1, n, H), dtype=torch.float8_e4m3fn if self.fp8 else torch.bfloat16)
        self.stage = Stage(x, torch.zeros((1, n, H // 128 if self.fp8 else 0)), torch.zeros((1, n, K),
                           dtype=torch.int32), torch.zeros((1, n, K)), expert_lo=0, expert_hi=E)  # every row local
        for name in ("x", "sf", "idx", "w", "held"):
            if getattr(self.stage, name).numel():
                self.memory.add(getattr(self.stage, name), f"stage {name}")
        self.arrivals = torch.zeros(1, dtype=torch.int32)  # the layer's, zero before the first produce
        self.pull_arrivals = torch.zeros((1, S), dtype=torch.int32) if pull_grid > 1 else None
        self.pull_grid, self.keep = pull_grid, []
        tracker = EmptyTracker(monkeypatch)  # from here on torch.empty is the host's uninitialised output
        self.library = produce_emu.ProduceLibrary(
            self.memory, produce_emu.kernels(heap, self.streams, rows_first=rows_first), self.streams,
            tracker.initialised)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: PRODUCER)

    def call(self, hidden: torch.Tensor, router: torch.Tensor, given_logits: torch.Tensor | None = None):
        """The layer's streamed produce: per chunk the router GEMM (or ``given_logits``' rows) and the fused
        producer on one stream; the pull concurrently. Returns the logits every chunk was routed by."""
        base, used = 0, []
        for i, m in enumerate(SIZES):
            chunk = hidden[base:base + m].clone().as_subclass(OnDevice)
            if given_logits is None:
                logits = router_logits(chunk, router, kernels=self.library)
            else:
                logits = given_logits[base:base + m].clone()
            enqueue_produce(self.ring, self.library, logits, chunk, base, i == len(SIZES) - 1, None, None,
                            self.arrivals, PRODUCER)
            self.keep += [chunk, logits]  # alive: a freed address reused would alias the emulated memory
            used.append(logits)
            base += m
        self.stage.idx.fill_(-1)
        self.stage.held.fill_(-1)
        self.library.launch("moe_pull", desc=self.ring.desc, arrivals=self.pull_arrivals, stage=self.stage.desc,
                            grid=self.pull_grid, block=PULL_BLOCK, stream=None, trace=None, trace_capacity=0)
        self.streams.run()
        return torch.cat(used).as_subclass(torch.Tensor)


def expected_order(logits: torch.Tensor) -> torch.Tensor:
    """The kernel's stated top-k order: NaN first, then larger logits, equal ones by the lower expert."""
    rows = [sorted(range(E), key=lambda e, r=r: (not np.isnan(r[e]), -r[e] if not np.isnan(r[e]) else 0, e))[:K]
            for r in logits.tolist()]
    return torch.tensor(rows, dtype=torch.int32)


def check_stage(monkeypatch, p: Producer, hidden: torch.Tensor, logits: torch.Tensor, host_rows) -> None:
    """The pulled stage against the host reference on the same logits; ``host_rows``: rows whose choice is
    route()'s (torch.topk's order of equal logits is its own)."""
    monkeypatch.setattr(routing, "router_logits", lambda h, w: logits)
    idx, w = route(hidden, torch.zeros(E, H, dtype=torch.bfloat16), K)
    got_idx, got_w = p.stage.idx[0], p.stage.w[0]
    assert torch.equal(got_idx, expected_order(logits))
    assert torch.equal(got_idx[host_rows], idx[host_rows])
    ulps = (got_w[host_rows].view(torch.int32) - w[host_rows].view(torch.int32)).abs()
    assert int(ulps.max()) <= 4
    if p.fp8:
        x, sf = quantize_rows_fp8(hidden)
        assert torch.equal(p.stage.x[0].view(torch.uint8), x.view(torch.uint8))
        assert torch.equal(p.stage.sf[0].view(torch.int32), sf.view(torch.int32))
    else:
        assert torch.equal(p.stage.x[0].view(torch.int16), hidden.view(torch.int16))
    assert p.stage.held.tolist() == [len(SIZES) - 1]  # the end-of-stream chunk, held for the combine
    assert p.arrivals.tolist() == [0]


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16])
@pytest.mark.parametrize("multi", [False, True])
def test_produced_chunks_route_and_quantise_as_the_host_reference(monkeypatch, payload, multi):
    if multi:  # one block per row: arrivals decide which block publishes
        monkeypatch.setattr(producer, "PRODUCE_ELEMENTS_PER_BLOCK", 128)
    p = Producer(monkeypatch, payload, seed=3, pull_grid=2 if multi else 1)
    hidden, router = bf16(sum(SIZES), H, seed=5), bf16(E, H, seed=6) * 0.1
    logits = p.call(hidden, router)
    grids = {grid for name, grid, _, _ in p.library.launches if name == "moe_produce_chunk"}
    assert grids == ({3, 5, 2} if multi else {1})
    # A lap-1 produce needs the pull's ack of lap 0: one side waited for the other (which: the seeded order).
    assert any(site in w for w in p.streams.waits_seen for site in ("kWaitReusable", "kWaitRoute"))
    check_stage(monkeypatch, p, hidden, logits, slice(None))


def crafted(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with equal values, NaN and -inf, and hidden rows with a NaN and an all-zero 128-column block."""
    logits = torch.randn(n, E, generator=torch.Generator().manual_seed(9))
    logits[0, [3, 7, 30, 39]] = 5.0  # four equal maxima: experts 3, 7, 30 chosen, in that order
    logits[1, [2, 35]] = float("nan")  # NaN above every number, the lower expert first
    logits[2, :] = 1.0  # all equal: 0, 1, 2
    logits[3, :] = float("-inf")
    logits[3, 33] = 0.0
    logits[4, [36, 4]] = 9.0  # a tie across the two 32-expert tiles
    hidden = bf16(n, H, seed=11)
    hidden[5, 17] = float("nan")
    hidden[6, 128:] = 0.0  # scale 1
    return logits, hidden


@pytest.mark.parametrize("multi", [False, True])
def test_equal_logits_nan_and_zero_blocks(monkeypatch, multi):
    if multi:
        monkeypatch.setattr(producer, "PRODUCE_ELEMENTS_PER_BLOCK", 128)
    p = Producer(monkeypatch, PayloadFormat.FP8_E4M3, seed=1)
    logits, hidden = crafted(sum(SIZES))
    p.call(hidden, None, given_logits=logits)
    idx = p.stage.idx[0].tolist()
    assert (idx[0], idx[1][:2], idx[2], idx[3], idx[4][:2]) == ([3, 7, 30], [2, 35], [0, 1, 2], [33, 0, 1], [4, 36])
    host = torch.ones(sum(SIZES), dtype=torch.bool)
    host[[0, 1, 2, 3, 4]] = False  # equal logits: torch.topk's order is its own
    check_stage(monkeypatch, p, hidden, logits, host)
    assert torch.isnan(p.stage.w[0, 1]).all()  # a NaN chosen: the row's weights are NaN, as torch's softmax


def test_a_nan_ranks_above_an_infinite_logit_as_torch_topk_ranks_it(monkeypatch):
    p = Producer(monkeypatch, PayloadFormat.FP8_E4M3)
    logits, hidden = crafted(sum(SIZES))
    logits[0, 1], logits[0, 20] = float("inf"), float("nan")
    p.call(hidden, None, given_logits=logits)
    assert p.stage.idx[0, 0, :2].tolist() == torch.topk(logits[0], 2).indices.tolist() == [20, 1]


# ---------------------------------------------------------------- the broken variant
def test_the_mutant_is_the_kernel_s_arrive_before_rows_switch():
    """The emulated mutant is the one moe_produce.cu compiles: rows after the arrival under kArriveBeforeRows."""
    source = (DEVICE / "kernels" / "moe_produce.cu").read_text()
    assert "constexpr bool kRowsFirst = kMutant != Mutant::kArriveBeforeRows;" in source
    assert "kArriveBeforeRows = 14," in (DEVICE / "include/chunkring/protocol/mutants.cuh").read_text()


SEEDS = range(8)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_fused_producer_as_written_passes_every_seed(monkeypatch, seed):
    monkeypatch.setattr(producer, "PRODUCE_ELEMENTS_PER_BLOCK", 128)
    p = Producer(monkeypatch, PayloadFormat.FP8_E4M3, seed=seed, pull_grid=1 + seed % 2)
    hidden, router = bf16(sum(SIZES), H, seed=5), bf16(E, H, seed=6) * 0.1
    logits = p.call(hidden, router)
    check_stage(monkeypatch, p, hidden, logits, slice(None))


def test_arrive_before_rows_is_caught(monkeypatch):
    """Mutant::kArriveBeforeRows: under some seeds the pull reads slot bytes the chunk has not written (the last
    block published while others' rows were still to come); under the rest a block stores a row after the publish.
    Every seed catches it."""
    caught = []
    monkeypatch.setattr(producer, "PRODUCE_ELEMENTS_PER_BLOCK", 128)
    for seed in SEEDS:
        with monkeypatch.context() as m:
            p = Producer(m, PayloadFormat.FP8_E4M3, seed=seed, rows_first=False, pull_grid=1 + seed % 2)
            hidden, router = bf16(sum(SIZES), H, seed=5), bf16(E, H, seed=6) * 0.1
            with pytest.raises(EmulatedMemoryError) as error:
                p.call(hidden, router)
            caught.append(str(error.value))
    assert all("uninitialised bytes of ring" in c or "after its publish" in c for c in caught), caught
    assert any("uninitialised bytes of ring" in c for c in caught), caught  # the consumer's side sees it too


def test_rank_keys_order_logits_as_floats_do_with_nan_on_top():
    """rank_key (mirrored by the emulator) orders every float as < does, -0 with +0, NaN of either sign above +inf."""
    values = np.array([-np.inf, -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, np.inf], np.float32)
    keys = produce_emu.rank_keys(values)
    assert (np.diff(keys.astype(np.int64)) > 0).sum() == len(values) - 2 and keys[4] == keys[5]
    nan = produce_emu.rank_keys(np.array([np.nan, -np.nan], np.float32))
    assert (nan > keys[-1]).all()
