"""What the ring's buffers and a consumer's stage must hold after publishes, pulls and held acks, computed in plain
torch from the rows the sources published (tests/unit/test_ring_pull_emulation.py compares the emulated kernels'
memory with it byte for byte: every byte the kernels may write is predicted, so any other write shows)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chunkring.ring.layout import CONTROL, STATUS
from tests.helpers.emulation.ring import make_gen

__all__ = ["Batch", "Expected", "SENTINEL"]

SENTINEL = {"x": 0x5A, "sf": -7.0, "w": -3.0}  # the stage before the pull: what a row never pulled keeps


@dataclass
class Batch:
    """One source's rows, published in chunks of ``sizes`` from token 0."""

    x: torch.Tensor  # [n, H] fp8 / bf16
    sf: torch.Tensor | None  # [n, H/128] fp32 (FP8)
    idx: torch.Tensor  # [n, K] int32, global expert ids (some out of range)
    w: torch.Tensor  # [n, K] fp32
    sizes: list[int]

    def chunks(self):
        """(token_base, rows, end_of_stream) of each chunk."""
        base = 0
        for i, m in enumerate(self.sizes):
            yield base, m, i == len(self.sizes) - 1
            base += m


@dataclass
class Expected:
    """The predicted ring buffers (one per rank, from a snapshot) and stages, updated chunk by chunk."""

    rings: list  # chunkring Rings
    stages: list  # chunkring.moe._engine.stage.Stage per rank
    num_experts: int
    buffers: list = field(init=False)
    stage_x: list = field(init=False)
    stage_sf: list = field(init=False)
    stage_idx: list = field(init=False)
    stage_w: list = field(init=False)
    held: list = field(init=False)
    seqs: list = field(init=False)  # per source: chunks published so far

    def __post_init__(self) -> None:
        self.buffers = [r.buffer.clone() for r in self.rings]
        self.stage_x = [s.x.view(torch.uint8).clone() for s in self.stages]
        self.stage_sf = [s.sf.clone() for s in self.stages]
        self.stage_idx = [s.idx.clone() for s in self.stages]
        self.stage_w = [s.w.clone() for s in self.stages]
        self.held = [s.held.clone() for s in self.stages]
        self.seqs = [0] * len(self.rings)

    def views(self, rank: int) -> dict:
        return self.rings[rank].layout.views(self.buffers[rank])

    def gen(self, seq: int) -> int:
        spec, epoch = self.rings[0].spec, self.rings[0].epoch
        return _signed(make_gen(epoch, seq // spec.num_slots, spec.epoch_bits))

    def publish(self, src: int, batch: Batch, base: int, m: int, eos: bool) -> int:
        """Source ``src``'s chunk of rows [base, base + m): its slot, meta, ready words at every rank, cursor."""
        spec, v = self.rings[0].spec, self.views(src)
        seq = self.seqs[src]
        slot = seq % spec.num_slots
        v["x"][slot, :m] = batch.x[base:base + m]
        if batch.sf is not None:
            v["x_sf"][slot, :m] = batch.sf[base:base + m]
        v["topk_idx"][slot, :m] = batch.idx[base:base + m]
        v["topk_weights"][slot, :m] = batch.w[base:base + m]
        v["meta"][slot, :3] = torch.tensor([base, m, int(eos)])
        if seq >= spec.num_slots:
            v["consumed"][slot] = self.gen(seq - spec.num_slots)
        v["control"][CONTROL["next_seq"]] = seq + 1
        for dest in range(spec.world_size):
            for kind in ("route_ready", "layout_ready"):
                self.views(dest)[kind][src, slot] = self.gen(seq)
        self.seqs[src] = seq + 1
        return seq

    def pull(self, dest: int, src: int, batch: Batch, base: int, m: int, seq: int, held: bool) -> None:
        """``dest``'s pull of that chunk into its stage; acknowledged unless ``held``."""
        self.stage_rows(dest, src, batch, base, m)
        if held:
            self.held[dest][src] = seq
        else:
            self.ack(dest, src, seq)

    def stage_rows(self, dest: int, src: int, batch: Batch, base: int, m: int) -> None:
        """Rows [base, base + m) of ``src``'s batch in ``dest``'s stage, as a pull leaves them: the routing
        (:meth:`stage_routing`), the payload of rows with a local choice, non-finite scales zeroed."""
        stage = self.stages[dest]
        idx = self.stage_routing(dest, src, batch, base, m)
        mine = ((idx >= stage.expert_lo) & (idx < stage.expert_hi)).any(dim=1)
        rows = torch.arange(base, base + m)[mine]
        self.stage_x[dest][src, rows] = batch.x[rows].view(torch.uint8)
        if batch.sf is not None:
            sf = batch.sf[rows].clone()
            sf[~torch.isfinite(sf)] = 0.0
            self.stage_sf[dest][src, rows] = sf

    def stage_routing(self, dest: int, src: int, batch: Batch, base: int, m: int) -> torch.Tensor:
        """The routing and weights of rows [base, base + m) of ``src``'s batch in ``dest``'s stage (as a pull, or a
        one-rank call's moe_local_route, leaves them): out-of-range ids masked. Returns the masked ids."""
        idx = batch.idx[base:base + m].clone()
        idx[(idx < -1) | (idx >= self.num_experts)] = -1
        self.stage_idx[dest][src, base:base + m] = idx
        self.stage_w[dest][src, base:base + m] = batch.w[base:base + m]
        return idx

    def ack(self, dest: int, src: int, seq: int) -> None:
        slot = seq % self.rings[0].spec.num_slots
        self.views(src)["ack"][slot, dest] = self.gen(seq)
        self.views(dest)["cursor"][src] = seq + 1

    def check(self, masked_inputs: list[int]) -> None:
        """Every rank's buffer and stage as predicted; ``masked_inputs``: each rank's count of masked values (its
        first record's words are the kernels' choice, checked only for being set)."""
        for rank, ring in enumerate(self.rings):
            status = ring.views["status"]
            assert status[STATUS["code"]] == 0 and status[STATUS["abort"]] == 0, ring.status()
            assert status[STATUS["input_count"]] == masked_inputs[rank]
            assert (status[STATUS["input_field"]] != 0) == (masked_inputs[rank] > 0)
            expected = self.views(rank)
            expected["status"][:] = status  # the input record, checked above
            assert torch.equal(ring.buffer, self.buffers[rank]), f"PE {rank}'s ring buffer: {_diff(ring, expected)}"
            stage = self.stages[rank]
            assert torch.equal(stage.x.view(torch.uint8), self.stage_x[rank]), "stage x"
            assert torch.equal(stage.sf.view(torch.int32), self.stage_sf[rank].view(torch.int32)), "stage sf"
            assert torch.equal(stage.idx, self.stage_idx[rank]), "stage idx"
            assert torch.equal(stage.w.view(torch.int32), self.stage_w[rank].view(torch.int32)), "stage w"
            assert torch.equal(stage.held, self.held[rank]), "held"


def _signed(word: int) -> int:
    return word - 2**64 if word >= 2**63 else word


def _diff(ring, expected: dict) -> str:
    return ", ".join(name for name, view in ring.views.items()
                     if not torch.equal(view.view(torch.uint8), expected[name].view(torch.uint8)))
