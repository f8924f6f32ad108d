"""A transformers MoE model timed end to end: its own experts against chunkring's drop-in, batch-ready and streamed.

    python -m benchmarks.bench_model [--arch qwen3_moe] [--layers 4] [--payload fp8] [--layer-decode auto]
        [--no-eager-graphs] [--prefill 1x2048,8x512]
        [--decode 1,8,64] [--context 512] [--compile-steps prefill_1x2048,decode_8] [--compile-mode default]
        [--iterations 20] [--warmup 3] [--json OUT]
    mpirun -np N python -m benchmarks.bench_model ...      (N ranks, e.g. sharing one GPU under MPS)

Keep NVLink multicast off (``NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1``;
scripts/gpu_suite.sh sets them). The model (:func:`chunkring.testing.hf_models.tiny_model` at real sizes, random
weights, bfloat16, built on the GPU; :data:`PRESETS`): ``qwen3_moe`` has Qwen3-30B-A3B's layers - hidden 2048, 128
experts of intermediate 768, top-8, 32 query and 4 key-value heads of 128, a 151,936-token vocabulary - ``--layers``
of them, every one MoE; ``deepseek_v3`` DeepSeek-V2-Lite's shapes in DeepSeek-V3's classes (64 experts of 1408,
top-6, 2 shared experts, MLA). Three sides, one model's weights:

* ``own``: the model as transformers runs it, its experts by ``--own-experts`` (transformers' default
  ``grouped_mm``: torch's grouped GEMM over every expert, bf16);
* ``batch`` and ``streamed``: a second module tree sharing every weight (:func:`shared_copy`) whose MoE blocks
  :func:`chunkring.integrations.transformers.replace_moe_blocks` replaced (``payload``, a streaming ring, one
  ``MoELayer`` for the blocks, by default built with ``decode="auto"`` and ``eager_graphs=True``: ``--layer-decode
  off`` and ``--no-eager-graphs`` time the layer's defaults), every block's ``streaming`` False or True for the call.

Steps: ``prefill_BxS`` is ``model(ids [B, S], use_cache=False, logits_to_keep=1)`` - a prompt's forward and its last
token's logits, as ``generate`` computes them, no KV cache written; ``decode_B`` is ``model(ids [B, 1], cache=...,
logits_to_keep=1)``, B sequences one new token each, over a transformers ``StaticCache`` holding ``--context`` tokens
(filled once by the own model's prefill of random tokens) and cropped back by the step's token after each call (not
timed), so every call sees the same context. Token ids are random, seeded by rank.

Timing, per step and side: the median of CUDA events around one step, the device idle and the ranks met before each
(eager at one token per sequence the device waits on the host, so the figure holds the host's issue time).
``eager``: the sides interleaved in rounds, the order rotating (:func:`benchmarks.bench_eager.interleaved`), after
``--warmup`` rounds; each side's first call of each step (kernel builds, each mode's warm-up barrier) before them.
``compiled``: ``torch.compile(model, fullgraph=True, dynamic=False, mode=--compile-mode)`` for the steps
``--compile-steps`` names, one side at a time after ``torch.compiler.reset()`` (its steps are separate graphs);
``<side>_compile_s`` is the wall time of a step's first compiled call (compilation and one step), not in the
medians. A side whose compilation fails with fullgraph is compiled again without it: ``<side>_fullgraph`` false and
``<side>_fullgraph_error`` say so; ``<side>_compile_error`` where it fails without too.

Checks, per step on every rank, from the eager first calls: ``bitwise`` - the streamed logits equal batch-ready's
bit for bit; ``bitwise_compiled`` likewise compiled, both modes compiled once more under Inductor's deterministic
mode (``torch._inductor.config.deterministic``), their first calls compared. The timed compilations do not decide
it: Inductor may benchmark a reduction's configs on the device while it compiles, and a reduction's block size sets
its summation order, so two compilations of one model may round its other layers differently
(``bitwise_compiled_autotuned``: the timed compilations' first calls, reported, not judged);
``blocks_vs_reference`` - the worst drop-in block's output
against chunkring's fp32 reference of the block's math on the same input
(:func:`chunkring.testing.hf_models.block_reference`: the block's own routing, its experts as the payload carries
them, the FP8 recipe) relative to it, held to ``tolerance`` (:func:`chunkring.testing.reference.reference_tolerance`:
1e-2 bf16, 4e-2 FP8), as tests/gpu/test_hf_dropin_model.py holds it. Reported, not judged: ``blocks_vs_own`` (the
same inputs through the own block, bf16 weights and activations: for FP8 the payload's own error) and
``logits_vs_own`` (the models' logits; routing choices near a tie flip between them after the first MoE layer).

Ratios (``<side>_<mode>_over_own``) and the model-level targets of issue 43: the drop-in's eager decode step at least
as fast as the own experts' (``worst_decode_eager_over_own`` <= 1, batch-ready), its compiled prefill faster
(``worst_prefill_compiled_over_own`` < 1). At several ranks each rank runs the whole model on its own tokens: the own
side is a replica with every expert, the drop-in's experts are split over the ranks and each block's call is a
collective; a time is the slowest rank's, an error the worst rank's, a flag true where it is true on every rank.
Rank 0 writes the JSON after each phase (a run cut short keeps what it measured, marked incomplete) and prints the
table last; the exit status is 1 where a step failed its checks.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks.bench_eager import events_ms, interleaved

#: The sides timed: the model's own experts, then the drop-in's two call modes.
SIDES = ("own", "batch", "streamed")
DROPIN = ("batch", "streamed")
MODES = ("eager", "compiled")
#: Each architecture's model: one released model's layer shapes (transformers config fields), ``--layers`` layers.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {  # Qwen3-30B-A3B
        "hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
        "vocab_size": 151936, "max_position_embeddings": 32768, "norm_topk_prob": True},
    "deepseek_v3": {  # DeepSeek-V2-Lite's shapes, DeepSeek-V3's routing (sigmoid, correction bias)
        "hidden_size": 2048, "moe_intermediate_size": 1408, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "n_shared_experts": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 10944,
        "vocab_size": 102400, "max_position_embeddings": 32768, "first_k_dense_replace": 0},
}
#: The config field of the routed experts' count.
EXPERTS_FIELD = {"qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts"}
#: Size flags and the config fields they set.
SIZE_FLAGS = (("hidden", "hidden_size"), ("intermediate", "moe_intermediate_size"), ("topk", "num_experts_per_tok"),
              ("vocab", "vocab_size"))
DEFAULT_COMPILE_STEPS = "prefill_1x2048,decode_8"
#: The model-level targets: the drop-in's eager decode step at most the own experts' time, its compiled prefill less.
DECODE_EAGER_TARGET = 1.0
PREFILL_COMPILED_TARGET = 1.0


@dataclass(frozen=True)
class Step:
    """One timed step: a prefill of ``batch`` sequences of ``seq`` tokens, or a decode of one token for each of
    ``batch`` sequences."""

    kind: str
    batch: int
    seq: int

    @property
    def name(self) -> str:
        return f"prefill_{self.batch}x{self.seq}" if self.kind == "prefill" else f"decode_{self.batch}"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--arch", default="qwen3_moe", choices=sorted(PRESETS), help="the model's classes and sizes")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers, every one MoE")
    for flag, field in (*SIZE_FLAGS, ("experts", "routed experts")):
        parser.add_argument(f"--{flag}", type=int, default=None, help=f"{field} (default: the preset's)")
    parser.add_argument("--payload", default="fp8", choices=("fp8", "bf16"), help="the drop-in's payload")
    parser.add_argument("--layer-decode", default="auto", choices=("auto", "off"),
                        help="the drop-in layers' decode= (auto: small calls' expert GEMMs on the decode path)")
    parser.add_argument("--no-eager-graphs", dest="eager_graphs", action="store_false",
                        help="the drop-in layers launch eager calls kernel by kernel (default: replayed from their "
                             "own CUDA graphs, eager_graphs=True)")
    parser.add_argument("--own-experts", default="grouped_mm",
                        help="transformers' experts_implementation for the own side")
    parser.add_argument("--prefill", default="1x2048,8x512", help="prefill steps, BATCHxSEQ (comma-separated)")
    parser.add_argument("--decode", default="1,8,64", help="decode steps, sequences (comma-separated)")
    parser.add_argument("--context", type=int, default=512, help="tokens in the KV cache a decode step reads")
    parser.add_argument("--compile-steps", default=None,
                        help=f"steps also timed under torch.compile: names, 'all' or 'none' (default: "
                             f"{DEFAULT_COMPILE_STEPS}, those of them the run has)")
    parser.add_argument("--compile-mode", default="default",
                        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"))
    parser.add_argument("--no-fullgraph", dest="fullgraph", action="store_false",
                        help="compile without fullgraph=True from the start")
    parser.add_argument("--iterations", type=int, default=20, help="timed rounds per step")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before the timed ones")
    parser.add_argument("--seed", type=int, default=0, help="the model's weights (every rank alike)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="the layer's watchdog: a rank's call waits this long for peers still compiling")
    parser.add_argument("--json", default=None, help="the result file (rank 0 writes it)")
    args = parser.parse_args(argv)
    try:
        args.steps = steps_of(args.prefill, args.decode)
    except ValueError as error:
        parser.error(str(error))
    if not args.steps:
        parser.error("no step: give --prefill or --decode")
    names = [step.name for step in args.steps]
    if args.compile_steps is None:
        args.compile_steps = [name for name in DEFAULT_COMPILE_STEPS.split(",") if name in names]
    elif args.compile_steps == "all":
        args.compile_steps = names
    elif args.compile_steps == "none":
        args.compile_steps = []
    else:
        args.compile_steps = [name for name in args.compile_steps.split(",") if name]
        unknown = sorted(set(args.compile_steps) - set(names))
        if unknown:
            parser.error(f"--compile-steps names no step of this run: {unknown} (steps: {names})")
    if args.layers < 1 or args.context < 1 or args.iterations < 1 or args.warmup < 0:
        parser.error("--layers, --context and --iterations must be >= 1, --warmup >= 0")
    if any(value is not None and value < 1 for value in (args.hidden, args.intermediate, args.topk, args.vocab,
                                                         args.experts)):
        parser.error("sizes must be positive")
    return args


def steps_of(prefill: str, decode: str) -> list[Step]:
    """The steps ``--prefill`` (``BxS,...``) and ``--decode`` (``B,...``) name, prefill first, each once."""
    steps: list[Step] = []
    for item in filter(None, prefill.split(",")):
        batch, sep, seq = item.partition("x")
        if not (sep and batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
            raise ValueError(f"--prefill takes BATCHxSEQ with positive integers, got {item!r}")
        steps.append(Step("prefill", int(batch), int(seq)))
    for item in filter(None, decode.split(",")):
        if not (item.isdigit() and int(item) > 0):
            raise ValueError(f"--decode takes positive integers, got {item!r}")
        steps.append(Step("decode", int(item), 1))
    return list(dict.fromkeys(steps))


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields of the benchmark's model (:func:`chunkring.testing.hf_models.tiny_config` overrides): the
    architecture's preset, ``--layers`` layers, the size flags given, positions enough for every step."""
    out = dict(PRESETS[args.arch], num_hidden_layers=args.layers)
    for flag, field in (*SIZE_FLAGS, ("experts", EXPERTS_FIELD[args.arch])):
        if getattr(args, flag) is not None:
            out[field] = getattr(args, flag)
    longest = max([step.seq for step in args.steps if step.kind == "prefill"] + [args.context + 1])
    out["max_position_embeddings"] = max(out["max_position_embeddings"], longest)
    return out


def describe_model(args: argparse.Namespace) -> str:
    fields = model_overrides(args)
    return (f"{args.arch}: {args.layers} MoE layers, hidden {fields['hidden_size']}, "
            f"{fields[EXPERTS_FIELD[args.arch]]} experts of intermediate {fields['moe_intermediate_size']}, "
            f"top-{fields['num_experts_per_tok']}, vocab {fields['vocab_size']}; own experts {args.own_experts}, "
            f"drop-in {args.payload}, decode {args.layer_decode}, eager graphs {args.eager_graphs}")


def expert_gib(args: argparse.Namespace) -> float:
    """The routed experts' bfloat16 weights of the whole model, GiB (each rank's own side holds them all)."""
    fields = model_overrides(args)
    per_expert = 3 * fields["hidden_size"] * fields["moe_intermediate_size"] * 2
    return args.layers * fields[EXPERTS_FIELD[args.arch]] * per_expert / 2**30


def max_tokens(steps: list[Step]) -> int:
    """The drop-in layer's ``max_tokens_per_rank``: the largest step's tokens."""
    return max(step.tokens for step in steps)


def shared_copy(model: Any) -> Any:
    """A second module tree of ``model`` holding the very same parameter and buffer tensors: its modules (and their
    small state, the config) are copies, so replacing its MoE blocks leaves ``model``'s in place, and no weight is
    copied."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def rel_error(out: Any, ref: Any) -> float:
    """Relative Frobenius error of ``out`` against ``ref`` (tensors of as many elements, e.g. [B, S, H] against
    [B * S, H]), inf where ``out`` holds a NaN."""
    out, ref = out.float().reshape(-1), ref.float().reshape(-1)
    if bool(out.isnan().any()):
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def combine_ranks(everyone: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's figures as one (all ranks hold the same keys): a flag true only where it is true on every rank,
    a number the largest (every number here is a time or an error), anything else rank 0's."""
    out = dict(everyone[0])
    for key, value in everyone[0].items():
        values = [figures[key] for figures in everyone]
        if isinstance(value, bool):
            out[key] = all(values)
        elif isinstance(value, int | float):
            out[key] = max(values)
    return out


def step_record(step: Step, ranks: int, measured: Mapping[str, Any]) -> dict[str, Any]:
    """One step's record: ``measured`` (every side's figures and the checks), each drop-in mode's time over the own
    experts' in the same mode, and ``passed``: streamed equal to batch-ready bit for bit, every block within the
    tolerance, every side compiled that was to be."""
    record: dict[str, Any] = {"step": step.name, "kind": step.kind, "batch": step.batch, "seq": step.seq,
                              "tokens": step.tokens, "ranks": ranks, **measured}
    for mode in MODES:
        for side in DROPIN:
            if f"{side}_{mode}_ms" in measured and f"own_{mode}_ms" in measured:
                record[f"{side}_{mode}_over_own"] = measured[f"{side}_{mode}_ms"] / measured[f"own_{mode}_ms"]
    record["passed"] = (measured.get("bitwise") is True and measured.get("bitwise_compiled") is not False
                        and measured.get("blocks_vs_reference", math.inf) <= measured.get("tolerance", 0.0)
                        and not any(key.endswith("_compile_error") for key in measured))
    return record


def targets(records: list[dict[str, Any]]) -> dict[str, float]:
    """The model-level targets over the records measured: the worst batch-ready eager decode step over the own
    experts' (at most 1) and the worst compiled prefill (below 1), each with its target and whether it is met."""
    out: dict[str, float] = {}
    for name, kind, key, target, met in (
            ("decode_eager_over_own", "decode", "batch_eager_over_own", DECODE_EAGER_TARGET, lambda w, t: w <= t),
            ("prefill_compiled_over_own", "prefill", "batch_compiled_over_own", PREFILL_COMPILED_TARGET,
             lambda w, t: w < t)):
        ratios = [r[key] for r in records if r["kind"] == kind and key in r]
        if ratios:
            worst = max(ratios)
            out[f"worst_{name}"], out[f"target_{name}"], out[f"met_{name}"] = worst, target, int(met(worst, target))
    return out


def figures_of(records: list[dict[str, Any]]) -> dict[str, float]:
    """Every finite number of the records as ``<step>_<key>``, then the targets' summary."""
    keys = ("batch", "seq", "tokens", "ranks")
    out = {f"{r['step']}_{k}": v for r in records for k, v in r.items()
           if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and k not in keys}
    return {**out, **targets(records)}


def _cell(record: Mapping[str, Any], key: str, width: int, digits: int = 3) -> str:
    value = record.get(key)
    return f"{value:{width}.{digits}f}" if isinstance(value, int | float) else f"{'-':>{width}s}"


def table(records: list[dict[str, Any]]) -> str:
    """Per step the ms of every side eager and compiled, the drop-in over the own experts, the checks; then the
    compile times and the targets."""
    head = ("step           | own eager | batch eager | streamed eager | own comp | batch comp | streamed comp | "
            "batch/own eager | batch/own comp | checks")
    lines = [head]
    for r in records:
        failed = [what for what, bad in (
            ("streamed != batch", r.get("bitwise") is not True),
            ("compiled streamed != batch", r.get("bitwise_compiled") is False),
            (f"block error {r.get('blocks_vs_reference', math.inf):.3g} > {r.get('tolerance', 0):g}",
             not r.get("blocks_vs_reference", math.inf) <= r.get("tolerance", 0.0)),
            ("compile error", any(k.endswith("_compile_error") for k in r))) if bad]
        lines.append(f"{r['step']:14s} | " + " | ".join(
            _cell(r, f"{side}_{mode}_ms", width) for mode, widths in (("eager", (9, 11, 14)), ("compiled", (8, 10, 13)))
            for side, width in zip(SIDES, widths, strict=True))
            + f" | {_cell(r, 'batch_eager_over_own', 15, 2)} | {_cell(r, 'batch_compiled_over_own', 14, 2)} | "
            + ("ok" if not failed else "; ".join(failed)))
    compiled = [f"{r['step']} " + " / ".join(f"{side} {r[f'{side}_compile_s']:.1f}" for side in SIDES
                                            if f"{side}_compile_s" in r)
                for r in records if any(f"{side}_compile_s" in r for side in SIDES)]
    if compiled:
        lines.append("compile s (first compiled call): " + "; ".join(compiled))
    summary = targets(records)
    for name, what, rel in (("decode_eager_over_own", "drop-in eager decode / own", "<="),
                            ("prefill_compiled_over_own", "drop-in compiled prefill / own", "<")):
        if f"worst_{name}" in summary:
            met = "met" if summary[f"met_{name}"] else "not met"
            lines.append(f"target {what} {rel} {summary[f'target_{name}']:g}: worst {summary[f'worst_{name}']:.3f} "
                         f"({met})")
    return "\n".join(lines)


def write_results(path: str, world_size: int, records: list[dict[str, Any]], model: Mapping[str, float], *,
                  incomplete: bool = False) -> None:
    """The result file (:mod:`chunkring.testing.records`): suite ``model``, a record per step, its figures and
    ``model``'s (sizes, set-up time); a step counts as passed where its checks held."""
    from chunkring.testing import records as record_file

    passed = sum(1 for r in records if r["passed"])
    record_file.write(path, suite="model", world_size=world_size, figures={**figures_of(records), **model},
                      records=records, incomplete=incomplete, passed=passed, failed=len(records) - passed)


# ---------------------------------------------------------------------------------------------------- on the GPU


@dataclass
class StepInputs:
    """A step's token ids [B, S] on the device, and for a decode step its filled KV cache."""

    ids: Any
    cache: Any = None


class Bench:
    """The own model and the drop-in's (one tree sharing its weights), every step's inputs; the measurements."""

    def __init__(self, args: argparse.Namespace, runtime: Any) -> None:
        import torch

        from chunkring.integrations.transformers import chunkring_blocks, replace_moe_blocks
        from chunkring.testing.hf_models import tiny_model

        self.args, self.runtime = args, runtime
        start = time.perf_counter()
        own: Any = tiny_model(args.arch, seed=args.seed, device=runtime.torch_device, **model_overrides(args))
        own.set_experts_implementation(args.own_experts)
        dropin = shared_copy(own)
        # The original blocks, kept: they share the own model's weights, and the checks run them.
        self.replaced = replace_moe_blocks(dropin, runtime, max_tokens_per_rank=max_tokens(args.steps),
                                           payload=args.payload, streaming=True, timeout_s=args.timeout_s,
                                           decode="auto" if args.layer_decode == "auto" else False,
                                           eager_graphs=args.eager_graphs)
        self.blocks = dict(chunkring_blocks(dropin))
        self.layers = list({id(b.layer): b.layer for b in self.blocks.values()}.values())
        self.models = {"own": own, "batch": dropin, "streamed": dropin}
        self.compiled_logits: dict[tuple[str, str], Any] = {}
        self.fullgraph: dict[str, bool] = {}  # per side, what its timed compilation ended with
        try:
            self.inputs = {step.name: self.step_inputs(step, index) for index, step in enumerate(args.steps)}
            torch.cuda.synchronize()
        except BaseException:
            self.close()
            raise
        self.setup_s = time.perf_counter() - start

    def step_inputs(self, step: Step, index: int) -> StepInputs:
        import torch
        from transformers import StaticCache

        own = self.models["own"]
        gen = torch.Generator().manual_seed(1_000_003 * self.runtime.rank + 1_009 * index + self.args.seed)
        vocab, device = own.config.vocab_size, self.runtime.torch_device
        ids = torch.randint(0, vocab, (step.batch, step.seq), generator=gen).to(device)
        if step.kind == "prefill":
            return StepInputs(ids)
        cache = StaticCache(config=own.config, max_cache_len=self.args.context + 1)
        context = torch.randint(0, vocab, (step.batch, self.args.context), generator=gen).to(device)
        own(input_ids=context, cache=cache, logits_to_keep=1)
        return StepInputs(ids, cache)

    def settle(self) -> None:  # the device idle and the ranks met before each sample
        import torch

        torch.cuda.synchronize()
        self.runtime.barrier()

    def check_layers(self) -> None:
        import torch

        torch.cuda.synchronize()
        for layer in self.layers:
            layer.check()

    def set_streaming(self, side: str) -> None:
        if side in DROPIN:
            for block in self.blocks.values():
                block.streaming = side == "streamed"

    def call(self, side: str, step: Step, model: Callable[..., Any] | None = None) -> Any:
        """One step of ``side`` (through ``model``, its compiled form, where given): the last token's logits."""
        model = self.models[side] if model is None else model
        inputs = self.inputs[step.name]
        if inputs.cache is None:
            return model(input_ids=inputs.ids, use_cache=False, logits_to_keep=1).logits
        return model(input_ids=inputs.ids, cache=inputs.cache, logits_to_keep=1).logits

    def after(self, step: Step) -> None:
        """Undo a decode step's write: its cache back at ``--context`` tokens."""
        cache = self.inputs[step.name].cache
        if cache is not None:
            cache.crop(-1)

    def sample(self, side: str, step: Step, model: Callable[..., Any] | None = None) -> float:
        self.set_streaming(side)
        ms = events_ms(partial(self.call, side, step, model))
        self.after(step)
        return ms

    def first_calls(self, step: Step) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
        """Each side's first call of ``step`` (logits by side), and each drop-in block's input and output in the
        batch-ready call."""
        io: dict[str, tuple[Any, Any]] = {}

        def keep(name: str, module: Any, args: tuple, out: Any) -> None:
            io[name] = (args[0].detach(), out.detach())

        outputs = {}
        for side in SIDES:
            hooks = [b.register_forward_hook(partial(keep, n)) for n, b in self.blocks.items()] if side == "batch" \
                else []
            try:
                self.set_streaming(side)
                outputs[side] = self.call(side, step).clone()
                self.after(step)
            finally:
                for hook in hooks:
                    hook.remove()
        self.check_layers()
        return outputs, io

    def checks(self, outputs: Mapping[str, Any], io: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
        import torch

        from chunkring.testing.hf_models import block_reference
        from chunkring.testing.reference import reference_tolerance

        payload = self.layers[0].config.payload
        vs_reference, vs_own = [], []
        for name, (x, y) in io.items():
            original = self.replaced[name]
            vs_reference.append(rel_error(y, block_reference(original, x, payload)))
            vs_own.append(rel_error(y, original(x)))
        return {"bitwise": bool(torch.equal(outputs["batch"], outputs["streamed"])),
                "blocks_vs_reference": max(vs_reference), "blocks_vs_own": max(vs_own),
                "logits_vs_own": rel_error(outputs["batch"], outputs["own"]),
                "tolerance": reference_tolerance(payload)}

    def measure_eager(self, step: Step) -> dict[str, Any]:
        outputs, io = self.first_calls(step)
        mine = self.checks(outputs, io)
        del outputs, io
        samples = interleaved({side: partial(self.sample, side, step) for side in SIDES},
                              iterations=self.args.iterations, warmup=self.args.warmup, before=self.settle)
        self.check_layers()
        mine.update({f"{side}_eager_ms": statistics.median(samples[side]) for side in SIDES})
        return combine_ranks(self.runtime.allgather_object(mine))

    def compile(self, side: str, fullgraph: bool) -> Callable[..., Any]:
        import torch

        torch.compiler.reset()
        return torch.compile(self.models[side], fullgraph=fullgraph, dynamic=False, mode=self.args.compile_mode)

    def first_compiled_call(self, side: str, step: Step, state: dict[str, Any], mine: dict[str, Any]) -> bool:
        """The step's first call of the compiled side (its compilation), timed into ``mine``; where compiling with
        fullgraph fails, the side compiled again without (``state``: the compiled model, whether fullgraph).
        False where it does not compile."""
        import torch

        from chunkring import ChunkringError

        while True:
            self.settle()
            start = time.perf_counter()
            try:
                logits = self.call(side, step, state["compiled"]).clone()
                torch.cuda.synchronize()
            except ChunkringError:
                raise
            except Exception as error:  # a compilation failure: recorded, and the side compiled without fullgraph
                why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"[:300]
                if not state["fullgraph"]:
                    mine[f"{side}_compile_error"] = why
                    return False
                mine[f"{side}_fullgraph_error"] = why
                state.update(fullgraph=False, compiled=self.compile(side, fullgraph=False))
                continue
            mine[f"{side}_compile_s"] = time.perf_counter() - start
            mine[f"{side}_fullgraph"] = self.fullgraph[side] = state["fullgraph"]
            self.after(step)
            self.compiled_logits[side, step.name] = logits
            return True

    def measure_compiled(self, side: str, steps: list[Step]) -> dict[str, dict[str, Any]]:
        """Every step of ``steps`` through ``side`` compiled (one compilation per step), by step name."""
        self.set_streaming(side)
        state = {"fullgraph": self.args.fullgraph, "compiled": self.compile(side, self.args.fullgraph)}
        out = {}
        for step in steps:
            mine: dict[str, Any] = {}
            if self.first_compiled_call(side, step, state, mine):
                samples = interleaved({side: partial(self.sample, side, step, state["compiled"])},
                                      iterations=self.args.iterations, warmup=self.args.warmup, before=self.settle)
                mine[f"{side}_compiled_ms"] = statistics.median(samples[side])
            self.check_layers()
            out[step.name] = combine_ranks(self.runtime.allgather_object(mine))
        return out

    def bitwise_compiled(self, steps: list[Step]) -> dict[str, dict[str, Any]]:
        """Per step of ``steps``: ``bitwise_compiled`` (the two drop-in modes compiled under Inductor's deterministic
        mode, their first calls' logits equal) and ``bitwise_compiled_autotuned`` (the timed compilations' first
        calls), each where both modes compiled; the module's docstring says why only the first is judged. A torch
        without the deterministic mode (before 2.10) gets only the second."""
        import torch

        compiled_here = all(side in self.fullgraph for side in DROPIN)
        if not all(self.runtime.allgather_object(compiled_here)):  # a mode did not compile: nothing to compare
            return {step.name: {} for step in steps}
        deterministic: dict[tuple[str, str], Any] = {}
        if hasattr(torch._inductor.config, "deterministic"):
            with torch._inductor.config.patch(deterministic=True):
                for side in DROPIN:
                    self.set_streaming(side)
                    compiled = self.compile(side, self.fullgraph[side])
                    for step in steps:
                        self.settle()
                        deterministic[side, step.name] = self.call(side, step, compiled).clone()
                        self.after(step)
            self.check_layers()
        out = {}
        for step in steps:
            mine = {}
            if deterministic:
                mine["bitwise_compiled"] = bool(torch.equal(*(deterministic[side, step.name] for side in DROPIN)))
            batch, streamed = (self.compiled_logits.get((side, step.name)) for side in DROPIN)
            if batch is not None and streamed is not None:
                mine["bitwise_compiled_autotuned"] = bool(torch.equal(batch, streamed))
            out[step.name] = combine_ranks(self.runtime.allgather_object(mine))
        return out

    def close(self) -> None:
        import torch

        torch.compiler.reset()
        for layer in self.layers:  # a collective; blocks of one shape share a layer
            layer.close()


def progress_eager(step: Step, m: Mapping[str, Any]) -> str:
    return (f"{step.name}: eager " + " / ".join(f"{side} {m[f'{side}_eager_ms']:.3f}" for side in SIDES)
            + f" ms; bitwise {m['bitwise']}; blocks {m['blocks_vs_reference']:.4f} of {m['tolerance']:g} "
            f"(vs own {m['blocks_vs_own']:.4f}); logits vs own {m['logits_vs_own']:.4f}")


def progress_compiled(side: str, out: Mapping[str, Mapping[str, Any]]) -> str:
    return f"compiled {side}: " + "; ".join(
        f"{name} {m[f'{side}_compiled_ms']:.3f} ms (compile {m[f'{side}_compile_s']:.1f} s"
        + ("" if m.get(f"{side}_fullgraph", True) else ", not fullgraph") + ")"
        if f"{side}_compiled_ms" in m else f"{name} {m.get(f'{side}_compile_error', 'not measured')}"
        for name, m in out.items())


def run(args: argparse.Namespace, runtime: Any, records: list[dict[str, Any]]) -> None:
    """Every phase, ``records`` rewritten (and the JSON) after each."""
    bench = Bench(args, runtime)
    rank0 = runtime.rank == 0
    model = {"model_setup_s": bench.setup_s, "model_expert_gib_bf16": expert_gib(args), "model_layers": args.layers}
    measured: dict[str, dict[str, Any]] = {step.name: {"model": describe_model(args)} for step in args.steps}
    compiled_steps = [step for step in args.steps if step.name in args.compile_steps]

    def publish(incomplete: bool) -> None:
        records[:] = [step_record(step, runtime.world_size, measured[step.name]) for step in args.steps]
        if rank0 and args.json:
            write_results(args.json, runtime.world_size, records, model, incomplete=incomplete)

    try:
        if rank0:
            print(f"{describe_model(args)}; {runtime.world_size} rank(s); set up in {bench.setup_s:.1f} s", flush=True)
        for step in args.steps:
            measured[step.name].update(bench.measure_eager(step))
            if rank0:
                print(progress_eager(step, measured[step.name]), flush=True)
            publish(incomplete=True)
        mode = f"torch.compile mode {args.compile_mode}, fullgraph {args.fullgraph}, dynamic False"
        for side in SIDES if compiled_steps else ():
            out = bench.measure_compiled(side, compiled_steps)
            for name, figures in out.items():
                measured[name].update(figures, compile=mode)
            if rank0:
                print(progress_compiled(side, out), flush=True)
            publish(incomplete=True)
        if compiled_steps:
            for name, figures in bench.bitwise_compiled(compiled_steps).items():
                measured[name].update(figures)
            if rank0:
                print("compiled, deterministic Inductor: streamed == batch " + "; ".join(
                    f"{step.name} {measured[step.name].get('bitwise_compiled', 'not compared')}"
                    for step in compiled_steps), flush=True)
        publish(incomplete=False)
    finally:
        bench.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before any GPU work: a typo costs no bring-up
    import torch

    import chunkring

    runtime = chunkring.init()
    records: list[dict[str, Any]] = []
    try:
        with torch.no_grad():
            run(args, runtime, records)
    finally:
        runtime.close()
    if runtime.rank == 0:
        print("\n" + table(records), flush=True)
    return 0 if all(r["passed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
