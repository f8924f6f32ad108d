"""How fast this card reads the MoE experts' FP8 weights, against bytes in flight (issue 44, item 4): the weight
loader of the planned persistent decode consumer alone (device/kernels/probe_weight_read.cu), swept over its
run-time parameters in one process, every case's checksum checked against torch.

    python -m benchmarks.probe_weight_read --json OUT [--sweep default|quick] [--experts 6,26,32]
        [--loaders tma,flat,rows] [--boxes 64x128,128x128] [--stages 2,4,8] [--claims strided,blocked,atomic]
        [--sms all,66] [--swizzle auto,none,128B] [--reps 15] [--flush read|write]

The weights: the flash shape's 32 experts (benchmarks.bench_vs_megamoe SHAPES), w13 [32, 4096, 4096] and w2 [32, 4096,
2048] e4m3 of random bytes, 25.2 MB an expert; a case reads the w13 and w2 of ``experts`` of them (6, 26 and 32:
what 1, 8 and 128 tokens touch), a random set drawn once per count. A case (:class:`Case`): how tiles travel
(``loader``: ``tma`` one 2-D tensor-map copy per box, ``flat`` one 1-D bulk copy of as many contiguous bytes,
``rows`` one 1-D bulk copy per row of the box), the box (rows x columns of bytes; ``auto`` swizzle: 128-byte
swizzling where the box row fits it, as the WGMMA consumer will load it), the ring's ``stages`` (bytes in flight
per SM: stages x box), how blocks claim tiles (``strided``, ``blocked``, ``atomic``) and the blocks (``sms``: one per
SM). A sweep is a list of grids, each a cross product of axes (:data:`SWEEPS`); an axis given on the command line
replaces that axis in every grid; cases that cannot run (a box that does not divide the matrices, a ring over the
shared memory) are skipped with the reason.

Method: per case one launch checked (every block's record written, the checksum - the weights' 4-byte words summed
mod 2^32 - equal to torch's, every tile read once, one block per SM), then ``--reps`` timed launches, each after the
L2 is emptied (``--flush read``: a read of twice its size, which leaves clean lines; ``write`` leaves dirty ones,
whose write-back competes with the timed read) - the weights are then read from HBM, as a decode call finds them -
and a device delay long enough for the host to enqueue the launch behind it; CUDA events, the median. Baselines
per expert set: a torch device-to-device copy of as many bytes (its TB/s counts bytes read and written) and
``probe_plain_read`` (16-byte loads, 8 in flight a thread). TB/s here are bytes read over time, against the card's
datasheet bandwidth (:data:`PEAK_TBPS`). The record (``suite`` weight-read) holds every case; a short table prints last.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.bench_vs_megamoe import SHAPES
from chunkring.jit import ArgStruct
from chunkring.testing import records

#: The kernels' constants (device/kernels/probe_weight_read.cu): block sizes, the ring's alignment, stage limit,
#: the loaders' and claims' codes, a block record's words.
PROBE_THREADS = 384
PLAIN_THREADS = 512
STAGE_ALIGN, MAX_STAGES, MAX_BOX_ROWS = 1024, 32, 256
#: An upper bound of probe_weight_read's static shared memory (its barriers and stage tiles: 656 bytes), which
#: counts against the block's limit with the ring.
STATIC_SHARED = 1024
LOADERS = {"tma": 0, "flat": 1, "rows": 2}
CLAIMS = {"strided": 0, "blocked": 1, "atomic": 2}
RECORD_WORDS, RECORD_MARK = 8, 0x7765696768747321
CHECKSUM, TILES, BYTES, SM, START_NS, FIRST_NS, END_NS, MARK = range(RECORD_WORDS)
#: The plain kernel's tile: 512 threads x 8 loads x 16 bytes.
PLAIN_TILE_BYTES = PLAIN_THREADS * 8 * 16
#: Datasheet HBM bandwidth by card name (a substring of torch's name for it), TB/s.
PEAK_TBPS = {"H200": 4.8, "H100 80GB HBM3": 3.35, "H100 SXM": 3.35, "H100 NVL": 3.9, "H100 PCIe": 2.0}
#: How long a stage wait may take before the kernel prints and traps (far beyond a launch).
WAIT_LIMIT_NS = 2_000_000_000


class ProbeWeightReadArgs(ArgStruct):
    """probe_weight_read's arguments after its two tensor maps (device/include/chunkring/moe/probe_args.cuh, field for
    field; tests/unit/test_kernel_args.py compares them)."""

    FIELDS = """const __nv_fp8_e4m3* w13, const __nv_fp8_e4m3* w2, const int* experts, int num_read, long long hidden,
                long long inter, int box_rows, int box_cols, int stages, int loader, int claim,
                CHUNKRING_NULLABLE unsigned* claim_counter, long long wait_limit_ns, unsigned long long* out"""

#: The device delay before each timed launch, in clock cycles (about 200 us at 2 GHz): the host enqueues the launch
#: meanwhile, so the events time the kernel, not the host (each case records its longest enqueue to compare).
DELAY_CYCLES = 400_000
#: How the L2 is emptied before each timed launch (:class:`L2Flush`).
FLUSHES = ("read", "write")

AXES = ("experts", "loaders", "boxes", "stages", "claims", "sms", "swizzle")
#: Named sweeps: grids of axis values (text, as on the command line).
SWEEPS: dict[str, list[dict[str, str]]] = {
    "default": [
        # the map: every loader, box and depth at the three expert sets, all SMs
        {"experts": "6,26,32", "loaders": "tma,flat,rows", "boxes": "64x128,128x128,256x128,128x256",
         "stages": "1,2,3,4,6,8,12,16", "claims": "strided", "sms": "all", "swizzle": "auto"},
        # how blocks claim tiles
        {"experts": "6,26", "loaders": "tma", "boxes": "128x128", "stages": "4,8", "claims": "strided,blocked,atomic",
         "sms": "all", "swizzle": "auto"},
        # bytes in flight against the SMs that read
        {"experts": "26", "loaders": "tma", "boxes": "128x128", "stages": "4,8,12", "claims": "strided",
         "sms": "8,16,33,66,99,all", "swizzle": "auto"},
        # swizzled or not
        {"experts": "26", "loaders": "tma", "boxes": "128x128", "stages": "4,8", "claims": "strided", "sms": "all",
         "swizzle": "none,128B"},
    ],
    "quick": [
        {"experts": "6,26", "loaders": "tma,flat,rows", "boxes": "128x128", "stages": "2,8", "claims": "strided,atomic",
         "sms": "all", "swizzle": "auto"},
    ],
}


@dataclass(frozen=True, order=True)
class Case:
    """One launch configuration of probe_weight_read (the module docstring's terms)."""

    experts: int
    loader: str
    box_rows: int
    box_cols: int
    stages: int
    claim: str
    sms: int
    swizzle: str

    @property
    def box_bytes(self) -> int:
        return self.box_rows * self.box_cols

    @property
    def shared_bytes(self) -> int:
        return self.stages * self.box_bytes + STAGE_ALIGN

    @property
    def name(self) -> str:
        return (f"{self.loader} {self.box_rows}x{self.box_cols} x{self.stages} {self.claim} {self.sms} SMs "
                f"{self.swizzle} {self.experts}e")


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{what}: every value must be >= 1, got {text!r}")
    return values


def parse_box(text: str) -> tuple[int, int]:
    """``"128x256"`` -> (rows, columns) in bytes."""
    rows, sep, cols = text.partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise ValueError(f"boxes: expected ROWSxCOLS, e.g. 128x128, got {text!r}")
    return int(rows), int(cols)


def parse_names(text: str, allowed: dict[str, int] | tuple[str, ...], what: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"{what}: unknown {unknown}; have {list(allowed)}")
    return names


def parse_sms(text: str, sm_count: int) -> list[int]:
    """Block counts: integers and ``all`` (the card's SMs), each in [1, sm_count]."""
    counts = [sm_count if v == "all" else parse_ints(v, "sms")[0] for v in text.split(",")]
    if any(not 1 <= c <= sm_count for c in counts):
        raise ValueError(f"sms: every count must be in [1, {sm_count}] (one block per SM), got {text!r}")
    return counts


def swizzle_for(box_cols: int, swizzle: str) -> str:
    """``auto``: 128-byte swizzling where a box row fits it (<= 128 bytes), else none."""
    if swizzle == "auto":
        return "128B" if box_cols <= 128 else "none"
    return swizzle


def grid_cases(grid: dict[str, str], sm_count: int) -> list[Case]:
    """Every case of one grid (its axes' cross product)."""
    experts = parse_ints(grid["experts"], "experts")
    loaders = parse_names(grid["loaders"], LOADERS, "loaders")
    boxes = [parse_box(b) for b in grid["boxes"].split(",")]
    stages = parse_ints(grid["stages"], "stages")
    claims = parse_names(grid["claims"], CLAIMS, "claims")
    sms = parse_sms(grid["sms"], sm_count)
    swizzles = parse_names(grid["swizzle"], ("auto", "none", "128B"), "swizzle")
    return [Case(e, loader, rows, cols, s, claim, n, swizzle_for(cols, sw))
            for e, loader, (rows, cols), s, claim, n, sw
            in itertools.product(experts, loaders, boxes, stages, claims, sms, swizzles)]


def sweep_cases(sweep: str, overrides: dict[str, str], sm_count: int) -> list[Case]:
    """The cases of a named sweep, each axis in ``overrides`` replacing that axis in every grid; sorted, each once."""
    if sweep not in SWEEPS:
        raise ValueError(f"sweep: unknown {sweep!r}; have {sorted(SWEEPS)}")
    unknown = set(overrides) - set(AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; have {list(AXES)}")
    cases = {case for grid in SWEEPS[sweep] for case in grid_cases({**grid, **overrides}, sm_count)}
    return sorted(cases)


def case_problem(case: Case, shape: dict[str, int], shared_limit: int) -> str | None:
    """Why ``case`` cannot run on ``shape`` with ``shared_limit`` bytes of shared memory a block, or None."""
    hidden, inter, experts = shape["hidden"], shape["intermediate"], shape["experts"]
    if case.experts > experts:
        return f"{case.experts} experts of {experts}"
    if any(rows % case.box_rows for rows in (2 * inter, hidden)) or any(c % case.box_cols for c in (hidden, inter)):
        return (f"box {case.box_rows}x{case.box_cols} does not divide w13 [{2 * inter}, {hidden}] and w2 "
                f"[{hidden}, {inter}]")
    if case.box_rows > MAX_BOX_ROWS or case.box_cols > MAX_BOX_ROWS or case.box_cols % 16:
        return "a box is at most 256 x 256 and its rows whole 16 bytes"
    if case.swizzle == "128B" and case.box_cols > 128:
        return "128-byte swizzling takes box rows of at most 128 bytes"
    if case.box_bytes % STAGE_ALIGN:
        return f"a stage must be whole {STAGE_ALIGN} bytes"
    if case.stages > MAX_STAGES:
        return f"at most {MAX_STAGES} stages"
    if case.shared_bytes + STATIC_SHARED > shared_limit:
        return f"ring of {case.shared_bytes} bytes over the {shared_limit - STATIC_SHARED} a block may take"
    return None


def peak_tbps(name: str) -> float | None:
    """The datasheet bandwidth of the card torch names ``name`` (:data:`PEAK_TBPS`), or None for another card."""
    return next((tbps for key, tbps in PEAK_TBPS.items() if key in name), None)


class L2Flush:
    """Empties the L2 before a timed launch, so that it reads its operands from HBM: ``read`` sums a buffer of twice
    the L2's size (the lines left are clean), ``write`` fills it (dirty lines, whose write-back then competes with the
    timed read for HBM)."""

    def __init__(self, device: torch.device, l2_bytes: int, mode: str = "read") -> None:
        self.mode = mode
        self.buffer = torch.full((2 * l2_bytes // 4,), 7, dtype=torch.int32, device=device)

    def __call__(self, i: int = 0) -> None:
        """One flush (``i``: the value a ``write`` flush fills with, varied so that every one writes)."""
        if self.mode == "write":
            self.buffer.fill_(i)
        else:
            torch.sum(self.buffer, dtype=torch.int64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="the record (benchmarks/results/<commit>-weight-read.json)")
    parser.add_argument("--sweep", default="default", choices=sorted(SWEEPS))
    for axis in AXES:
        parser.add_argument(f"--{axis}", default=None, help=f"replaces the sweep's {axis} axis")
    parser.add_argument("--reps", type=int, default=15, help="timed launches per case (the median is kept)")
    parser.add_argument("--flush", default="read", choices=FLUSHES,
                        help="empty the L2 before each timed launch by reading twice its size, or writing it")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    args.overrides = {axis: getattr(args, axis) for axis in AXES if getattr(args, axis) is not None}
    try:
        sweep_cases(args.sweep, args.overrides, sm_count=1024)  # the axes parse (the SM count is checked later)
    except ValueError as exc:
        parser.error(str(exc))
    return args


class Probe:
    """The card, the weights, the kernels and the buffers every case shares."""

    def __init__(self, runtime: Any, flush: str) -> None:
        from chunkring.jit import library_for

        self.runtime, self.device = runtime, runtime.torch_device
        props = runtime.device.properties
        self.name = torch.cuda.get_device_name(self.device)
        self.sm_count, self.l2_bytes = int(props.multiprocessor_count), int(props.l2_cache_size)
        self.shared_limit = int(props.max_shared_memory_per_block_optin)
        self.peak = peak_tbps(self.name)
        self.lib = library_for(runtime, "probe_weight_read")
        shape = SHAPES["flash"]
        self.shape = shape
        E, H, inter = shape["experts"], shape["hidden"], shape["intermediate"]
        gen = torch.Generator(device=self.device)
        gen.manual_seed(0)
        self.w13 = torch.randint(0, 256, (E, 2 * inter, H), dtype=torch.uint8, device=self.device, generator=gen)
        self.w2 = torch.randint(0, 256, (E, H, inter), dtype=torch.uint8, device=self.device, generator=gen)
        self.expert_bytes = self.w13[0].numel() + self.w2[0].numel()
        # Each expert's words summed once; a set's checksum is the sum of its experts' mod 2^32.
        self.expert_sums = [int(self.w13[e].view(torch.int32).sum(dtype=torch.int64))
                            + int(self.w2[e].view(torch.int32).sum(dtype=torch.int64)) for e in range(E)]
        self.empty_l2 = L2Flush(self.device, self.l2_bytes, flush)
        self.copy_dst = torch.empty(E * self.expert_bytes, dtype=torch.uint8, device=self.device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.out = torch.empty((max(self.sm_count, self.plain_grid()), RECORD_WORDS), dtype=torch.int64,
                               device=self.device)
        self.sets: dict[int, torch.Tensor] = {}
        self.maps: dict[tuple[int, int, str], tuple[Any, Any]] = {}

    def card(self) -> dict[str, float]:
        found = {"sm_count": float(self.sm_count), "l2_mib": self.l2_bytes / 2**20}
        if self.peak:
            found["datasheet_tbps"] = self.peak
        return found

    def experts(self, count: int) -> torch.Tensor:
        """The ``count`` experts a case reads: drawn once per count, in random order."""
        if count not in self.sets:
            gen = torch.Generator()
            gen.manual_seed(1000 + count)
            order = torch.randperm(self.shape["experts"], generator=gen)[:count]
            self.sets[count] = order.to(torch.int32).to(self.device)
        return self.sets[count]

    def tensor_maps(self, case: Case) -> tuple[Any, Any]:
        from chunkring.jit import encode_tiled

        key = (case.box_rows, case.box_cols, case.swizzle)
        if key not in self.maps:
            E, H, inter = self.shape["experts"], self.shape["hidden"], self.shape["intermediate"]
            box = (case.box_rows, case.box_cols)
            self.maps[key] = (encode_tiled(self.w13.view(E * 2 * inter, H), box, swizzle=case.swizzle),
                              encode_tiled(self.w2.view(E * H, inter), box, swizzle=case.swizzle))
        return self.maps[key]

    def launch(self, case: Case) -> None:
        w13_map, w2_map = self.tensor_maps(case)
        self.lib.launch("probe_weight_read", w13_map=w13_map, w2_map=w2_map, args=ProbeWeightReadArgs(
            w13=self.w13.view(torch.float8_e4m3fn), w2=self.w2.view(torch.float8_e4m3fn),
            experts=self.experts(case.experts), num_read=np.int32(case.experts), hidden=np.int64(self.shape["hidden"]),
            inter=np.int64(self.shape["intermediate"]), box_rows=np.int32(case.box_rows),
            box_cols=np.int32(case.box_cols), stages=np.int32(case.stages), loader=np.int32(LOADERS[case.loader]),
            claim=np.int32(CLAIMS[case.claim]), claim_counter=self.counter if case.claim == "atomic" else None,
            wait_limit_ns=np.int64(WAIT_LIMIT_NS), out=self.out),
            grid=case.sms, block=PROBE_THREADS, shared_bytes=case.shared_bytes)

    def plain_grid(self) -> int:
        return self.sm_count * self.lib.resident_blocks_per_sm("probe_plain_read", PLAIN_THREADS)

    def launch_plain(self, experts: int) -> None:
        self.lib.launch("probe_plain_read", w13=self.w13.view(torch.float8_e4m3fn),
                        w2=self.w2.view(torch.float8_e4m3fn), experts=self.experts(experts),
                        num_read=np.int32(experts), hidden=np.int64(self.shape["hidden"]),
                        inter=np.int64(self.shape["intermediate"]), out=self.out, grid=self.plain_grid(),
                        block=PLAIN_THREADS)

    def copy(self, experts: int) -> None:
        """A device-to-device copy of as many bytes as ``experts`` experts hold (w13's part, then w2's)."""
        n13, n2 = experts * self.w13[0].numel(), experts * self.w2[0].numel()
        self.copy_dst[:n13].copy_(self.w13.view(-1)[:n13])
        self.copy_dst[n13:n13 + n2].copy_(self.w2.view(-1)[:n2])

    def reference(self, experts: int) -> int:
        return sum(self.expert_sums[int(e)] for e in self.experts(experts).tolist()) % (1 << 32)

    def check(self, grid: int, experts: int, tiles: int, one_per_sm: bool) -> dict[str, Any]:
        """The block records of the launch just run (``grid`` blocks that read ``tiles`` tiles of ``experts``
        experts): whether they are complete and right, and the device times they hold."""
        rec = self.out[:grid].cpu().numpy().astype(np.uint64)
        problems = []
        if not (rec[:, MARK] == np.uint64(RECORD_MARK)).all():
            problems.append(f"{int((rec[:, MARK] != np.uint64(RECORD_MARK)).sum())} blocks wrote no record")
        checksum = int(rec[:, CHECKSUM].astype(object).sum()) % (1 << 32)
        if checksum != self.reference(experts):
            problems.append(f"checksum {checksum:#x}, torch {self.reference(experts):#x}")
        if int(rec[:, TILES].sum()) != tiles or int(rec[:, BYTES].sum()) != experts * self.expert_bytes:
            problems.append(f"read {int(rec[:, TILES].sum())} tiles / {int(rec[:, BYTES].sum())} bytes, expected "
                            f"{tiles} / {experts * self.expert_bytes}")
        if one_per_sm and len(set(rec[:, SM].tolist())) != grid:
            problems.append(f"{grid} blocks on {len(set(rec[:, SM].tolist()))} SMs")
        start = rec[:, START_NS].astype(np.int64)
        return {"verified": not problems, "problems": "; ".join(problems),
                "tiles_min": int(rec[:, TILES].min()), "tiles_max": int(rec[:, TILES].max()),
                "device_span_us": float(rec[:, END_NS].astype(np.int64).max() - start.min()) / 1e3,
                "first_stage_us": float(np.median(rec[:, FIRST_NS].astype(np.int64) - start)) / 1e3,
                "end_spread_us": float(np.ptp(rec[:, END_NS].astype(np.int64))) / 1e3}

    def timed_ms(self, run: Any, before: Any, reps: int) -> tuple[float, float]:
        """The median time of ``run`` over ``reps`` launches, each after ``before``, the L2 flush and the device
        delay; and the longest host enqueue of one (events and launch), in µs, to compare with the delay."""
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        enqueue_us = 0.0
        for i, (start, end) in enumerate(events):
            self.empty_l2(i)
            before()
            torch.cuda._sleep(DELAY_CYCLES)
            t0 = time.perf_counter()
            start.record()
            run()
            end.record()
            enqueue_us = max(enqueue_us, (time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in events), enqueue_us

    def tiles(self, case: Case) -> int:
        H, inter = self.shape["hidden"], self.shape["intermediate"]
        return case.experts * (2 * inter * H + H * inter) // case.box_bytes

    def measure(self, case: Case, reps: int) -> dict[str, Any]:
        row: dict[str, Any] = {**asdict(case), "box_bytes": case.box_bytes,
                               "in_flight_kb": case.stages * case.box_bytes / 1024,
                               "bytes": case.experts * self.expert_bytes, "flush": self.empty_l2.mode}
        self.out.fill_(-1)
        self.counter.zero_()
        self.empty_l2(0)
        self.launch(case)
        torch.cuda.synchronize(self.device)
        row.update(self.check(case.sms, case.experts, self.tiles(case), one_per_sm=True))
        row["ms"], row["enqueue_us_max"] = self.timed_ms(lambda: self.launch(case), self.counter.zero_, reps)
        return self.rates(row)

    def rates(self, row: dict[str, Any]) -> dict[str, Any]:
        row["tbps"] = row["bytes"] / (row["ms"] * 1e-3) / 1e12
        row["pct_peak"] = 100 * row["tbps"] / self.peak if self.peak else None
        return row

    def baselines(self, experts: int, reps: int) -> list[dict[str, Any]]:
        nbytes = experts * self.expert_bytes
        rows = []
        self.out.fill_(-1)
        self.empty_l2(0)
        self.launch_plain(experts)
        torch.cuda.synchronize(self.device)
        grid = self.plain_grid()
        plain = {"loader": "plain", "experts": experts, "sms": grid, "bytes": nbytes, "flush": self.empty_l2.mode,
                 **self.check(grid, experts, nbytes // PLAIN_TILE_BYTES, one_per_sm=False)}
        plain["ms"], plain["enqueue_us_max"] = self.timed_ms(lambda: self.launch_plain(experts), lambda: None, reps)
        rows.append(self.rates(plain))
        copy = {"loader": "torch_copy", "experts": experts, "bytes": nbytes, "flush": self.empty_l2.mode,
                "verified": True}
        copy["ms"], copy["enqueue_us_max"] = self.timed_ms(lambda: self.copy(experts), lambda: None, reps)
        rows.append(self.rates(copy))
        rows[-1]["copy_tbps_read_write"] = 2 * rows[-1]["tbps"]
        return rows


def figures(rows: list[dict[str, Any]], card: dict[str, float] | None = None) -> dict[str, float]:
    """The card's (``card``: SM count, L2 MiB, datasheet TB/s), then per expert set: the best case's TB/s and share
    of the datasheet, the baselines' TB/s."""
    found: dict[str, float] = dict(card or {})
    for experts in sorted({r["experts"] for r in rows}):
        mine = [r for r in rows if r["experts"] == experts and r.get("verified")]
        cases = [r for r in mine if r["loader"] in LOADERS]
        if cases:
            best = max(cases, key=lambda r: r["tbps"])
            found[f"e{experts}_best_tbps"] = best["tbps"]
            if best["pct_peak"] is not None:
                found[f"e{experts}_best_pct_peak"] = best["pct_peak"]
        for r in mine:
            if r["loader"] == "plain":
                found[f"e{experts}_plain_tbps"] = r["tbps"]
            if r["loader"] == "torch_copy":
                found[f"e{experts}_copy_read_write_tbps"] = r["copy_tbps_read_write"]
    return found


def write_results(path: str, rows: list[dict[str, Any]], card: dict[str, float], *, incomplete: bool = False) -> None:
    """The result file (:mod:`chunkring.testing.records`): suite ``weight-read``, every row and the figures; a row
    counts as passed where it was verified."""
    failed = sum(not r["verified"] for r in rows)
    records.write(path, suite="weight-read", world_size=1, figures=figures(rows, card), records=rows,
                  incomplete=incomplete, passed=len(rows) - failed, failed=failed)


def report(probe: Probe, rows: list[dict[str, Any]], skipped: int) -> None:
    """The short table: TB/s by loader, box and stages at 26 experts; SMs; claims; baselines; the best per set."""
    cases = [r for r in rows if r["loader"] in LOADERS and r["verified"]]
    failed = sum(not r["verified"] for r in rows)
    peak = f"{probe.peak} TB/s datasheet" if probe.peak else "datasheet bandwidth unknown"
    print(f"\nweight read, {probe.name}: {probe.sm_count} SMs, L2 {probe.l2_bytes / 2**20:.0f} MiB, {peak}; "
          f"{len(rows) - failed} of {len(rows)} runs verified, {skipped} cases skipped")
    focus = 26 if any(r["experts"] == 26 for r in cases) else (cases[0]["experts"] if cases else 0)
    main = [r for r in cases if r["experts"] == focus and r["sms"] == probe.sm_count and r["claim"] == "strided"]
    stages = sorted({r["stages"] for r in main})
    print(f"TB/s, {focus} experts ({focus * probe.expert_bytes / 1e6:.0f} MB), all SMs, strided claims; columns: "
          "stages")
    print(f"{'loader':7s}{'box':9s}{'swizzle':8s}" + "".join(f"{s:>6d}" for s in stages))
    def row_key(r: dict[str, Any]) -> tuple[str, int, int, str]:
        return r["loader"], r["box_rows"], r["box_cols"], r["swizzle"]

    for key in sorted({row_key(r) for r in main}):
        cells = {r["stages"]: r["tbps"] for r in main if row_key(r) == key}
        swizzle = key[3] if key[0] == "tma" else "-"  # only the tensor map's copies swizzle
        print(f"{key[0]:7s}{f'{key[1]}x{key[2]}':9s}{swizzle:8s}"
              + "".join(f"{cells[s]:6.2f}" if s in cells else "     -" for s in stages))
    by_flight: dict[float, float] = {}
    for r in main:
        by_flight[r["in_flight_kb"]] = max(by_flight.get(r["in_flight_kb"], 0.0), r["tbps"])
    print("best TB/s by KB in flight per SM: " + ", ".join(f"{kb:.0f}: {t:.2f}" for kb, t in sorted(by_flight.items())))
    curve = sorted((r["stages"], r["sms"], r["tbps"]) for r in cases if r["experts"] == focus and r["loader"] == "tma"
                   and (r["box_rows"], r["box_cols"]) == (128, 128) and r["claim"] == "strided"
                   and r["swizzle"] == "128B")
    for s in sorted({c[0] for c in curve}):
        points = [f"{n}: {t:.2f}" for st, n, t in curve if st == s]
        if len(points) > 1:
            print(f"SMs, tma 128x128 x{s}: " + ", ".join(points))
    claims = [r for r in cases if r["loader"] == "tma" and (r["box_rows"], r["box_cols"]) == (128, 128)
              and r["sms"] == probe.sm_count and r["swizzle"] == "128B"]
    for e, s in sorted({(r["experts"], r["stages"]) for r in claims}):
        found = {r["claim"]: r["tbps"] for r in claims if (r["experts"], r["stages"]) == (e, s)}
        if len(found) > 1:
            print(f"claims, tma 128x128 x{s}, {e} experts: "
                  + ", ".join(f"{c} {t:.2f}" for c, t in sorted(found.items())))
    for e in sorted({r["experts"] for r in rows}):
        mine = [r for r in cases if r["experts"] == e]
        base = {r["loader"]: r for r in rows if r["experts"] == e and r["loader"] in ("plain", "torch_copy")}
        line = f"{e:2d} experts ({e * probe.expert_bytes / 1e6:4.0f} MB):"
        if mine:
            best = max(mine, key=lambda r: r["tbps"])
            pct = f" ({best['pct_peak']:.0f} %)" if best["pct_peak"] is not None else ""
            line += f" best {best['tbps']:.2f} TB/s{pct} {best['loader']} {best['box_rows']}x{best['box_cols']} " \
                    f"x{best['stages']} ({best['in_flight_kb']:.0f} KB in flight/SM)"
        if "plain" in base:
            line += f"; plain loads {base['plain']['tbps']:.2f}"
        if "torch_copy" in base:
            line += f"; torch copy {base['torch_copy']['copy_tbps_read_write']:.2f} (read+write)"
        print(line)
    for r in rows:
        if not r["verified"]:
            print(f"FAILED {r.get('loader')} {r.get('experts')}e: {r.get('problems')}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import chunkring

    runtime = chunkring.init()
    rows: list[dict[str, Any]] = []
    try:
        probe = Probe(runtime, args.flush)
        cases = sweep_cases(args.sweep, args.overrides, probe.sm_count)
        runnable = [c for c in cases if case_problem(c, probe.shape, probe.shared_limit) is None]
        skipped = len(cases) - len(runnable)
        print(f"{probe.name}: {len(runnable)} cases ({skipped} skipped: cannot run), {args.reps} timed launches each",
              flush=True)
        started = time.perf_counter()
        for experts in sorted({c.experts for c in runnable}):
            rows += probe.baselines(experts, args.reps)
        for i, case in enumerate(runnable):
            rows.append(probe.measure(case, args.reps))
            if not rows[-1]["verified"]:
                print(f"FAILED {case.name}: {rows[-1]['problems']}", flush=True)
            if i % 25 == 0:
                print(f"[{i + 1}/{len(runnable)}, {time.perf_counter() - started:.0f} s] {case.name}: "
                      f"{rows[-1]['tbps']:.2f} TB/s", flush=True)
                if args.json:
                    write_results(args.json, rows, probe.card(), incomplete=True)
    finally:
        runtime.close()
    if args.json:
        write_results(args.json, rows, probe.card())
    report(probe, rows, skipped)
    return 1 if any(not r["verified"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

