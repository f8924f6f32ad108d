"""What an eager ``MoELayer.run`` costs against its CUDA-graph replay and DeepGEMM's MegaMoE, per token count.

    python -m benchmarks.bench_eager [--shape flash] [--tokens 1,8,32,128,512,2048,8192] [--iterations 20]
        [--host-iterations 50] [--pipeline 20] [--gate-ms 10] [--no-megamoe] [--json OUT]
    mpirun -np N python -m benchmarks.bench_eager ...      (N ranks, e.g. sharing one GPU under MPS)

Keep NVLink multicast off (``NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1``;
scripts/gpu_suite.sh sets them). The shape is one rank's share (:data:`benchmarks.bench_overlap.SHAPES`; ``flash``:
DeepGEMM's per-rank shape, 32 local experts, hidden 4096, intermediate 2048, top-6, FP8), its layer built as a
caller builds it (:class:`benchmarks.bench_overlap.Shape`: ``MoEConfig(...).with_default_ring()`` for the largest
token count, default partition). Per token count, five sides on one routed FP8 batch: ``batch`` and
``streamed`` (``MoELayer.run(..., streaming=False / True)``, the streamed call in the slot's chunks; eager calls
replayed from CUDA graphs: ``MoELayer(eager_graphs=True)``), ``batch_launched`` and ``streamed_launched`` (the same
calls of a layer that launches every kernel from Python, ``eager_graphs=False``, the default: the other way to issue
them) and ``megamoe``
(``deep_gemm.fp8_mega_moe`` with its input staging, as benchmarks/bench_vs_megamoe.py calls it), each timed four ways:

* ``host_issue_ms``: host wall time from the call to its return, no sync; each sample's call is enqueued behind a
  device-side delay of ``--gate-ms`` (``torch.cuda._sleep``), so nothing of the call runs and the launch queue never
  fills while the host issues it. ``<side>_host_gate_held``: the share of samples whose delay had not run out when
  the call returned (below 1: the call outlived the delay - it waited on the device, or issuing took that long);
* ``host_warm_ms``: the same host time in a serving loop's steady state: ``--warm-calls`` calls issued back to back
  behind one such delay, the median of all but the first (which pays for the host's cold start: a sample's call
  follows the device's idle and the ranks' meeting, and the host slept through the previous gated sample);
* ``host_moved_ms`` (``run`` calls of the replayed layer only): ``host_warm_ms`` with each call's tensors at other
  addresses than the call before's (:data:`MOVED_COPIES` copies of the batch, called in turn), so a replay sets the
  graph's nodes that read them, as a caller whose tensors move between calls makes it;
* ``eager_ms``: CUDA events around one call, device idle and ranks met before it;
* ``pipelined_ms``: events around ``--pipeline`` calls back to back, divided by their number;
* ``graph_ms``: the call captured in a CUDA graph, one replay between events, device idle and ranks met before it
  (:func:`chunkring.moe.calibration.replay_medians_ms`, burst 1): the same single call as ``eager_ms`` without
  its host launch cost. Not the bursts of benchmarks/bench_vs_megamoe.py, which hide the idle GPU's ramp.

Every figure is the median of its samples, the sides interleaved in rounds (the order rotating) after ``--warmup``
rounds; at several ranks every rank measures and the slowest rank's figure is kept (``host_gate_held``: the
lowest). MegaMoE runs on a one-rank process group of each process: at N ranks sharing a GPU, N such instances, each
on a batch of as many tokens routed over its own 32 experts, beside one another as the layer's ranks are (NCCL takes
no two ranks of one GPU in a group); its record key ``megamoe`` says how it ran, or why not.

Each record (one per token count) holds those figures per side, ``bitwise`` (streamed equals batch-ready bit for
bit, on every rank, first calls), ``replayed_bitwise`` (after the timings, when the layer replays its graphs: one more
call of every side, all equal bit for bit on every rank), ``call_graphs`` (the graphs the layer holds;
``call_graphs_rebound`` of them replayed over each call's own tensors), and the
ratios the eager-call targets name: ``<mode>_eager_over_graph`` (target at most
:data:`EAGER_OVER_GRAPH_TARGET`), ``<mode>_eager_over_megamoe_eager`` (at most 1), ``<mode>_host_issue_over_target``
(the issue time over :data:`HOST_ISSUE_TARGET_MS`). Rank 0 writes the JSON after every token count (a run cut short
keeps what it measured, marked incomplete), and prints the table last.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TypeVar

from benchmarks.bench_overlap import SHAPES, Shape

T = TypeVar("T")

DEFAULT_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
#: The layer's two call modes (its eager calls replayed from CUDA graphs: ``MoELayer(eager_graphs=True)``), the same
#: calls of a layer that launches every kernel of every call (``eager_graphs=False``, the default), then the peer.
MODES = ("batch", "streamed")
LAUNCHED = ("batch_launched", "streamed_launched")
PEER = "megamoe"
#: Copies of a batch that ``host_moved_ms`` calls in turn: each call's tensors at other addresses than the last's.
MOVED_COPIES = 4
#: How each side is timed, in the order the table prints them.
FIGURES = ("host_issue_ms", "host_warm_ms", "eager_ms", "pipelined_ms", "graph_ms")
#: The eager-call targets: the host's issue time per call, an eager call against its graph replay, against
#: MegaMoE's eager call.
HOST_ISSUE_TARGET_MS = 0.05
EAGER_OVER_GRAPH_TARGET = 1.15
EAGER_OVER_MEGAMOE_TARGET = 1.0
#: Cycles of the device delay timed to size the gate (about a millisecond).
GATE_PROBE_CYCLES = 2_000_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="flash", choices=sorted(SHAPES), help="one rank's share")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                        help="tokens per rank (comma-separated)")
    parser.add_argument("--iterations", type=int, default=20, help="timed rounds of eager_ms and graph_ms")
    parser.add_argument("--host-iterations", type=int, default=50, help="timed rounds of host_issue_ms")
    parser.add_argument("--warm-calls", type=int, default=8,
                        help="calls back to back per host_warm_ms sample (at least 2: the first is not kept)")
    parser.add_argument("--pipelined-iterations", type=int, default=5, help="timed rounds of pipelined_ms")
    parser.add_argument("--pipeline", type=int, default=20, help="calls back to back per pipelined sample")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before the timed ones")
    parser.add_argument("--gate-ms", type=float, default=10.0,
                        help="the device-side delay each host_issue_ms sample's call is enqueued behind")
    parser.add_argument("--partition", default="auto", choices=("auto", "none"), help="the layer's partition=")
    parser.add_argument("--call", default="run", choices=("run", "forward"),
                        help="run: MoELayer.run on the routed batch (MegaMoE's contract); forward: the layer with its "
                             "own producers (MoEModule, as the main job calls it; MegaMoE, which routes nothing, left "
                             "out)")
    parser.add_argument("--no-megamoe", action="store_true", help="leave DeepGEMM's MegaMoE out")
    parser.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                        help="after each token count's timings, CALLS more replayed batch-ready calls under cProfile "
                             "(every rank calls; rank 0 prints where the host's time goes)")
    parser.add_argument("--json", default=None, help="the result file (rank 0 writes it)")
    args = parser.parse_args(argv)
    try:
        args.tokens = sorted({int(t) for t in args.tokens.split(",") if t})
    except ValueError:
        parser.error("--tokens takes comma-separated integers")
    if not args.tokens or args.tokens[0] < 1:
        parser.error("token counts must be positive")
    if min(args.iterations, args.host_iterations, args.pipelined_iterations, args.pipeline) < 1 or args.warmup < 0:
        parser.error("--iterations, --host-iterations, --pipelined-iterations and --pipeline must be >= 1, "
                     "--warmup >= 0")
    if not args.gate_ms > 0:
        parser.error("--gate-ms must be positive")
    if args.warm_calls < 2:
        parser.error("--warm-calls must be >= 2")
    return args


# ---------------------------------------------------------------------------------------------------- the method


def interleaved(samplers: Mapping[str, Callable[[], T]], *, iterations: int, warmup: int,
                before: Callable[[], object] | None = None) -> dict[str, list[T]]:
    """Each sampler's samples: ``warmup + iterations`` rounds, every round one sample of each in turn (the order
    rotating by one a round, so drift falls on every side alike), ``before()`` ahead of each sample; the first
    ``warmup`` rounds are not kept."""
    names = list(samplers)
    samples: dict[str, list[T]] = {name: [] for name in names}
    for round_ in range(warmup + iterations):
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if before is not None:
                before()
            sample = samplers[name]()
            if round_ >= warmup:
                samples[name].append(sample)
    return samples


def host_issue_sample(call: Callable[[], object], gate: Callable[[], Callable[[], bool]],
                      clock: Callable[[], float] = time.perf_counter) -> tuple[float, bool]:
    """(host ms from ``call()`` to its return, whether the gate still held then). ``gate()`` enqueues the device
    delay the call waits behind and returns what tells whether that delay has run out."""
    ran_out = gate()
    start = clock()
    call()
    ms = (clock() - start) * 1e3
    return ms, not ran_out()


def host_warm_sample(call: Callable[[], object], gate: Callable[[], Callable[[], bool]], calls: int,
                     clock: Callable[[], float] = time.perf_counter) -> float:
    """The median host ms of ``calls`` calls of ``call`` issued back to back behind one device delay (``gate()``),
    the first left out: what each call costs the host once it is issuing steadily."""
    gate()
    times = []
    for _ in range(calls):
        start = clock()
        call()
        times.append((clock() - start) * 1e3)
    return statistics.median(times[1:])


def rotating(calls: list[Callable[[], T]]) -> Callable[[], T]:
    """One call that makes each of ``calls`` in turn, the first again after the last."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def events_ms(call: Callable[[], object], calls: int = 1, event: Callable[..., Any] | None = None) -> float:
    """Milliseconds per call of ``calls`` calls back to back between two timing events (``torch.cuda.Event``
    unless ``event`` is given), waiting for the second."""
    if event is None:
        import torch

        event = torch.cuda.Event
    start, stop = event(enable_timing=True), event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / calls


def sleep_cycles(gate_ms: float, probe_cycles: int, probe_ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` for a delay of ``gate_ms``, from a probe of ``probe_cycles`` that took
    ``probe_ms``."""
    if probe_ms <= 0 or probe_cycles < 1:
        raise ValueError(f"need a positive probe, got {probe_cycles} cycles in {probe_ms} ms")
    return max(1, math.ceil(gate_ms * probe_cycles / probe_ms))


def medians(host: Mapping[str, list[tuple[float, bool]]], warm: Mapping[str, list[float]],
            eager: Mapping[str, list[float]], pipelined: Mapping[str, list[float]],
            graph: Mapping[str, float]) -> dict[str, float]:
    """One rank's figures per side (``<side>_<figure>``) from its samples (the graph's already medians)."""
    out: dict[str, float] = {}
    for side, samples in host.items():
        out[f"{side}_host_issue_ms"] = statistics.median(ms for ms, _ in samples)
        out[f"{side}_host_gate_held"] = sum(held for _, held in samples) / len(samples)
        out[f"{side}_host_warm_ms"] = statistics.median(warm[side])
        out[f"{side}_eager_ms"] = statistics.median(eager[side])
        out[f"{side}_pipelined_ms"] = statistics.median(pipelined[side])
        out[f"{side}_graph_ms"] = graph[side]
    return out


def across_ranks(everyone: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's figures as one (all ranks hold the same keys): a time the slowest rank's, a gate's hold the
    lowest, a flag true only where it is true on every rank, anything else rank 0's."""
    out = dict(everyone[0])
    for key, value in everyone[0].items():
        values = [figures[key] for figures in everyone]
        if isinstance(value, bool):
            out[key] = all(values)
        elif key.endswith("_ms"):
            out[key] = max(values)
        elif key.endswith("_gate_held"):
            out[key] = min(values)
    return out


def tokens_record(shape: str, tokens: int, ranks: int, chunk: int, measured: Mapping[str, Any]) -> dict[str, Any]:
    """One token count's record: ``measured`` (every side's figures, ``bitwise``, ``megamoe``) and the ratios the
    targets name, for the sides measured."""
    record = {"shape": shape, "tokens": tokens, "ranks": ranks, "chunk": chunk, "chunks": -(-tokens // chunk),
              **measured}
    peer = f"{PEER}_eager_ms" in measured
    for side in (*MODES, *LAUNCHED, PEER):
        if f"{side}_eager_ms" in measured:
            record[f"{side}_eager_over_graph"] = measured[f"{side}_eager_ms"] / measured[f"{side}_graph_ms"]
    for mode in MODES:
        record[f"{mode}_host_issue_over_target"] = measured[f"{mode}_host_issue_ms"] / HOST_ISSUE_TARGET_MS
        if peer:
            record[f"{mode}_eager_over_megamoe_eager"] = measured[f"{mode}_eager_ms"] / measured[f"{PEER}_eager_ms"]
    return record


def targets(records: list[dict[str, Any]]) -> dict[str, float]:
    """Each target's worst case over the records and both modes, the target, and whether it is met (1 or 0);
    the MegaMoE target only where every record has MegaMoE's figures."""
    out: dict[str, float] = {}
    checks = [("host_issue_ms", "host_issue_ms", HOST_ISSUE_TARGET_MS),
              ("eager_over_graph", "eager_over_graph", EAGER_OVER_GRAPH_TARGET)]
    if records and all(f"{PEER}_eager_ms" in r for r in records):
        checks.append(("eager_over_megamoe_eager", "eager_over_megamoe_eager", EAGER_OVER_MEGAMOE_TARGET))
    for name, key, target in checks:
        worst = max((r[f"{mode}_{key}"] for r in records for mode in MODES), default=math.nan)
        out[f"worst_{name}"], out[f"target_{name}"], out[f"met_{name}"] = worst, target, int(worst <= target)
    return out


def figures_of(records: list[dict[str, Any]]) -> dict[str, float]:
    """Every finite number of the records as ``<shape>_<tokens>_<key>``, then the targets' summary."""
    out = {f"{r['shape']}_{r['tokens']}_{k}": v for r in records for k, v in r.items()
           if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
           and k not in ("tokens", "ranks")}
    return {**out, **targets(records)}


def table(records: list[dict[str, Any]]) -> str:
    """The figures per token count and side, the ratios to the targets, and whether each target is met."""
    lines = ["tokens | side              | host issue ms | host warm ms | eager ms | pipelined ms | graph ms | "
             "eager/graph | eager/MegaMoE"]
    for r in records:
        for side in (*MODES, *LAUNCHED, PEER):
            if f"{side}_eager_ms" not in r:
                continue
            cells = " | ".join(f"{r[f'{side}_{f}']:{len(h)}.3f}" for f, h in
                               zip(FIGURES, ("host issue ms", "host warm ms", "eager ms", "pipelined ms", "graph ms"),
                                   strict=True))
            versus = r.get(f"{side}_eager_over_megamoe_eager")
            lines.append(f"{r['tokens']:6d} | {side:17s} | {cells} | {r[f'{side}_eager_over_graph']:11.2f} | "
                         + (f"{versus:13.2f}" if versus is not None else f"{'-':>13s}"))
    summary = targets(records)
    for name, what in (("host_issue_ms", "host issue (ms)"), ("eager_over_graph", "eager / graph"),
                       ("eager_over_megamoe_eager", "eager / MegaMoE eager")):
        if f"worst_{name}" in summary:
            met = "met" if summary[f"met_{name}"] else "not met"
            lines.append(f"target {what} <= {summary[f'target_{name}']:g}: worst {summary[f'worst_{name}']:.3f} "
                         f"({met})")
    for r in records:
        if all(f"{mode}_host_moved_ms" in r for mode in MODES):
            lines.append(f"{r['tokens']:6d} tokens, host warm with the tensors moved each call: " + " / ".join(
                f"{mode} {r[f'{mode}_host_moved_ms']:.3f}" for mode in MODES) + " ms")
    if any(not r["bitwise"] for r in records):
        lines.append("streamed differs from batch-ready at " + ", ".join(str(r["tokens"]) for r in records
                                                                          if not r["bitwise"]) + " tokens")
    if any(not r.get("replayed_bitwise", True) for r in records):
        lines.append("a replayed call differs from a launched one at " + ", ".join(
            str(r["tokens"]) for r in records if not r.get("replayed_bitwise", True)) + " tokens")
    return "\n".join(lines)


def write_results(path: str, world_size: int, records: list[dict[str, Any]], *, incomplete: bool = False) -> None:
    """The result file (:mod:`chunkring.testing.records`): suite ``eager``, the records and their figures; a token
    count counts as passed where every side was measured and every output agreed, as failed where MegaMoE could not
    run or an output differed (``bitwise``, ``replayed_bitwise``)."""
    from chunkring.testing import records as record_file

    failed = sum(1 for r in records if str(r.get(PEER, "")).startswith("not run") or not r.get("bitwise", True)
                 or not r.get("replayed_bitwise", True))
    record_file.write(path, suite="eager", world_size=world_size, figures=figures_of(records), records=records,
                      incomplete=incomplete, passed=len(records) - failed, failed=failed)


# ---------------------------------------------------------------------------------------------------- on the GPU


class Gate:
    """A device-side delay of about ``ms`` on torch's current stream (``torch.cuda._sleep``), sized once against
    the clock the device runs now; calling it enqueues one and returns what tells whether it has run out."""

    def __init__(self, ms: float) -> None:
        import torch

        torch.cuda._sleep(GATE_PROBE_CYCLES)  # the first launch loads the kernel
        torch.cuda.synchronize()
        probe = statistics.median(events_ms(partial(torch.cuda._sleep, GATE_PROBE_CYCLES)) for _ in range(3))
        self.cycles = sleep_cycles(ms, GATE_PROBE_CYCLES, probe)

    def __call__(self) -> Callable[[], bool]:
        import torch

        torch.cuda._sleep(self.cycles)
        ran_out = torch.cuda.Event()
        ran_out.record()
        return ran_out.query


class MegaMoE:
    """DeepGEMM's ``fp8_mega_moe`` on a one-rank process group of this process, over this rank's FP8 experts (the
    layer's own, transformed for it), its symmetric buffer sized for ``max_tokens``."""

    def __init__(self, shape: Shape, max_tokens: int) -> None:
        import deep_gemm  # the layer's constructor loaded it, its JIT cache under chunkring's

        from benchmarks.probe_deepgemm import one_rank_group
        from chunkring.moe import Fp8Weight

        w13, w2 = shape.w13, shape.w2
        if not (isinstance(w13, Fp8Weight) and isinstance(w2, Fp8Weight)):
            raise TypeError(f"MegaMoE takes FP8 experts; the layer's payload is {shape.config.payload.name}")
        spec = SHAPES[shape.name]
        self.dg, self.shape, self.spec = deep_gemm, shape, spec
        self.l1, self.l2 = deep_gemm.transform_weights_for_mega_moe_sm90((w13.data, w13.scale), (w2.data, w2.scale))
        self.buffer = deep_gemm.get_symm_buffer_for_mega_moe(one_rank_group()[0], spec["experts"], max_tokens,
                                                             spec["topk"], spec["hidden"], spec["intermediate"])

    def staged(self, t: int, hidden: Any, batch: tuple) -> Callable[[], object]:
        """The call with its input staging on ``t`` tokens: the layer's routed ``batch`` (x, x_sf, idx, w) at one
        rank; at several, a batch of ``t`` tokens routed over this rank's experts alone."""
        import torch

        from benchmarks.bench_vs_megamoe import routed_batch
        from benchmarks.probe_deepgemm import mega_moe_calls

        shape = self.shape
        if shape.runtime.world_size > 1:
            hidden, idx, w, x, x_sf = routed_batch(t, self.spec, shape.router[:self.spec["experts"]], shape.gen,
                                                   shape.runtime.torch_device)
            batch = (x, x_sf, idx, w)
        x, x_sf, idx, w = batch
        y = torch.empty(t, self.spec["hidden"], dtype=torch.bfloat16, device=shape.runtime.torch_device)
        inputs = {"xq": x, "xsf": x_sf, "idx": idx, "w": w, "x": hidden}
        return mega_moe_calls(self.dg, self.buffer, inputs, t, y, self.l1, self.l2)[1]

    def close(self) -> None:
        self.buffer.destroy()  # DeepGEMM names its free destroy


def open_megamoe(shape: Shape, max_tokens: int) -> tuple[MegaMoE | None, str]:
    """(MegaMoE, how it runs) where every rank could set it up, else (None, why not: each failed rank's error) -
    every rank alike, so the ranks' timed rounds pair up."""
    runtime = shape.runtime
    mine: MegaMoE | None = None
    why = ""
    try:
        mine = MegaMoE(shape, max_tokens)
    except Exception as error:  # reported in the record and the log, and the layer's figures still measured
        why = f"{type(error).__name__}: {error}"
    failed = [f"rank {rank}: {w}" for rank, w in enumerate(runtime.allgather_object(why)) if w]
    if failed:
        if mine is not None:
            mine.close()
        return None, "not run: " + "; ".join(failed)
    ranks = runtime.world_size
    return mine, "1 rank" if ranks == 1 else f"a 1-rank group in each of the {ranks} ranks' processes"


def measure_tokens(shape: Shape, launched: Any, t: int, args: argparse.Namespace, gate: Gate,
                   megamoe: MegaMoE | None, megamoe_setup: str) -> dict[str, Any]:
    """One token count's record (the module says what is measured and how)."""
    import torch

    from chunkring.moe.calibration import replay_medians_ms

    runtime, layer = shape.runtime, shape.layer
    hidden, batch = shape.inputs(t)
    x, x_sf, idx, w = batch
    if args.call == "forward":  # the layer with its own producers, as MoEModule (and the main job) call it
        module = partial(layer.forward, hidden, shape.router, shape.w13, shape.w2)
        module_launched = partial(launched.forward, hidden, shape.router, shape.w13, shape.w2)
    else:
        module = partial(layer.run, x, x_sf, idx, w, shape.w13, shape.w2)
        module_launched = partial(launched.run, x, x_sf, idx, w, shape.w13, shape.w2)
    modes = {mode: partial(module, streaming=mode == "streamed") for mode in MODES}
    modes.update({side: partial(module_launched, streaming=side.startswith("s")) for side in LAUNCHED})
    sides: dict[str, Callable[[], object]] = dict(modes)
    if megamoe is not None:
        sides[PEER] = megamoe.staged(t, hidden, batch)
    # Each side's first calls (kernels built, each mode's warm-up barrier) outside the timings.
    outputs = {mode: call() for mode, call in modes.items()}
    for call in sides.values():
        call()
    torch.cuda.synchronize()
    layer.check()
    mine: dict[str, Any] = {"bitwise": all(torch.equal(outputs["batch"], out) for out in outputs.values())}

    def settle() -> None:  # the device idle and the ranks met before each sample
        torch.cuda.synchronize()
        runtime.barrier()

    host = interleaved({s: partial(host_issue_sample, call, gate) for s, call in sides.items()},
                       iterations=args.host_iterations, warmup=args.warmup, before=settle)
    warm = interleaved({s: partial(host_warm_sample, call, gate, args.warm_calls) for s, call in sides.items()},
                       iterations=max(1, args.host_iterations // args.warm_calls), warmup=args.warmup, before=settle)
    if args.call == "run":  # a replayed call whose tensors moved since the last: its graph's nodes set again
        copies = [(x.clone(), None if x_sf is None else x_sf.clone(), idx.clone(), w.clone())
                  for _ in range(MOVED_COPIES)]
        moved = {mode: rotating([partial(layer.run, *copy, shape.w13, shape.w2, streaming=mode == "streamed")
                                 for copy in copies]) for mode in MODES}
        moved_warm = interleaved({m: partial(host_warm_sample, call, gate, args.warm_calls)
                                  for m, call in moved.items()},
                                 iterations=max(1, args.host_iterations // args.warm_calls), warmup=args.warmup,
                                 before=settle)
        mine.update({f"{m}_host_moved_ms": statistics.median(samples) for m, samples in moved_warm.items()})
    eager = interleaved({s: partial(events_ms, call) for s, call in sides.items()}, iterations=args.iterations,
                        warmup=args.warmup, before=settle)
    pipelined = interleaved({s: partial(events_ms, call, args.pipeline) for s, call in sides.items()},
                            iterations=args.pipelined_iterations, warmup=args.warmup, before=settle)
    graph = replay_medians_ms(sides, iterations=args.iterations, warmup=args.warmup, barrier=runtime.barrier)
    # Calls of a kind the layer has captured replay now: each side once more, all equal bit for bit.
    again = {mode: call() for mode, call in modes.items()}
    torch.cuda.synchronize()
    mine["replayed_bitwise"] = all(torch.equal(again["batch"], out) for out in again.values())
    stats = layer.stats()
    mine["call_graphs"], mine["call_graphs_rebound"] = stats["call_graphs"], stats["call_graphs_rebound"]
    layer.check()
    launched.check()
    mine.update(medians(host, warm, eager, pipelined, graph))
    if args.host_profile:
        profile_host(modes["batch"], args.host_profile, runtime.rank == 0, f"{t} tokens, batch-ready, replayed")
    measured = {**across_ranks(runtime.allgather_object(mine)), PEER: megamoe_setup}
    return tokens_record(shape.name, t, runtime.world_size, min(t, shape.slot), measured)


def profile_host(call: Callable[[], object], calls: int, show: bool, what: str) -> None:
    """``calls`` calls of ``call`` back to back under cProfile (the device keeping up: synchronised every 10);
    where ``show``, the 25 functions with the most time of their own and the callers of the ten first."""
    import cProfile
    import pstats

    import torch

    profiler = cProfile.Profile()
    for i in range(calls):
        profiler.enable()
        call()
        profiler.disable()
        if i % 10 == 9:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    if show:
        print(f"host profile: {calls} calls, {what}", flush=True)
        stats = pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime")
        stats.print_stats(25)
        stats.print_callers(10)  # who calls the ten costliest: where a stall inside one is entered from
        sys.stdout.flush()


def progress(r: dict[str, Any]) -> str:
    return f"{r['tokens']:6d} tokens | " + " | ".join(
        f"{side} " + " / ".join(f"{r[f'{side}_{f}']:.3f}" for f in FIGURES)
        for side in (*MODES, *LAUNCHED, PEER)
        if f"{side}_eager_ms" in r) + " ms (host issue / eager / pipelined / graph)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before any GPU work: a typo costs no bring-up
    import chunkring

    # Why a graph copies rather than replaying over each call's own tensors (chunkring.moe._engine.rebind).
    logging.basicConfig(format="%(name)s: %(levelname)s: %(message)s")
    logging.getLogger("chunkring").setLevel(logging.INFO)

    runtime = chunkring.init()
    records: list[dict[str, Any]] = []
    try:
        shape = Shape(args.shape, runtime, max(args.tokens), partition=args.partition, eager_graphs=True)
        from chunkring import MoELayer

        launched = MoELayer(runtime, shape.config, partition=args.partition, eager_graphs=False)
        megamoe: MegaMoE | None = None
        try:
            if args.no_megamoe or args.call == "forward":
                megamoe, setup = None, "left out (--no-megamoe)" if args.no_megamoe else "left out (--call forward)"
            else:
                megamoe, setup = open_megamoe(shape, max(args.tokens))
            if runtime.rank == 0:
                print(f"{args.shape}, {runtime.world_size} rank(s), slot {shape.slot} tokens; MegaMoE: {setup}",
                      flush=True)
            gate = Gate(args.gate_ms)
            for done, t in enumerate(args.tokens, 1):
                records.append(measure_tokens(shape, launched, t, args, gate, megamoe, setup))
                if runtime.rank == 0:
                    print(progress(records[-1]), flush=True)
                    if args.json:
                        write_results(args.json, runtime.world_size, records, incomplete=done < len(args.tokens))
        finally:
            if megamoe is not None:
                megamoe.close()
            launched.close()
            shape.close()
    finally:
        runtime.close()
    if runtime.rank == 0:
        print("\n" + table(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
