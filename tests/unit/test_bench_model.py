"""The model-level bench's method (benchmarks.bench_model) without a GPU: its arguments and steps, the model it
builds (a tiny config of the same presets, every layer an MoE block the drop-in takes), the module tree that
shares the own model's weights, the error measure, how ranks' figures combine, the ratios, checks and targets a
record carries, the table, the result file - and the whole eager flow on the CPU with the drop-in stood in for
(its blocks the model's own, its layer a stub), so that the bench's plumbing (KV caches cropped back after each
decode step, hooks, references, records) runs before a GPU does."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks import bench_model
from benchmarks.bench_model import (
    DEFAULT_COMPILE_STEPS,
    Step,
    combine_ranks,
    expert_gib,
    figures_of,
    max_tokens,
    model_overrides,
    parse_args,
    rel_error,
    shared_copy,
    step_record,
    table,
    targets,
)
from tests.helpers.imports import heavy_modules_after

#: A model of the presets' classes at test size (sizes the FP8 payload takes, 8 experts).
TINY = ["--hidden", "256", "--intermediate", "128", "--experts", "8", "--topk", "2", "--vocab", "128"]


def measured(**overrides) -> dict:
    """One step's figures as the bench's phases leave them (ms, checks)."""
    out = {"own_eager_ms": 4.0, "batch_eager_ms": 3.0, "streamed_eager_ms": 3.2, "own_compiled_ms": 2.0,
           "batch_compiled_ms": 1.5, "streamed_compiled_ms": 1.6, "own_compile_s": 30.0, "batch_compile_s": 28.0,
           "bitwise": True, "bitwise_compiled": True, "blocks_vs_reference": 0.011, "blocks_vs_own": 0.05,
           "logits_vs_own": 0.08, "tolerance": 0.04, "model": "qwen3_moe: 4 MoE layers"}
    return {**out, **overrides}


def test_arguments_default_to_the_issue_steps_and_are_checked():
    args = parse_args([])
    assert [s.name for s in args.steps] == ["prefill_1x2048", "prefill_8x512", "decode_1", "decode_8", "decode_64"]
    assert args.compile_steps == DEFAULT_COMPILE_STEPS.split(",") == ["prefill_1x2048", "decode_8"]
    assert (args.arch, args.layers, args.payload, args.own_experts, args.context) == ("qwen3_moe", 4, "fp8",
                                                                                      "grouped_mm", 512)
    assert args.compile_mode == "default" and args.fullgraph and args.json is None
    assert parse_args(["--compile-steps", "all"]).compile_steps == [s.name for s in args.steps]
    assert parse_args(["--compile-steps", "none"]).compile_steps == []
    decode = parse_args(["--prefill", "", "--decode", "4,8,4"])
    assert [s.name for s in decode.steps] == ["decode_4", "decode_8"] and decode.compile_steps == ["decode_8"]
    for bad in (["--prefill", "2048"], ["--prefill", "0x8"], ["--decode", "-1"], ["--decode", "x"],
                ["--prefill", "", "--decode", ""], ["--compile-steps", "decode_3"], ["--layers", "0"],
                ["--context", "0"], ["--iterations", "0"], ["--warmup", "-1"], ["--experts", "0"],
                ["--arch", "mixtral"], ["--payload", "int4"], ["--compile-mode", "fast"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_bad_argument_costs_no_bring_up(monkeypatch):
    monkeypatch.setattr("chunkring.init", lambda: pytest.fail("init before the arguments were checked"))
    with pytest.raises(SystemExit):
        bench_model.main(["--decode", "one"])


def test_importing_the_bench_loads_no_torch_or_transformers():
    assert heavy_modules_after("import benchmarks.bench_model", also=("transformers",)) == []


def test_steps_name_their_shape_and_size_the_layer():
    steps = parse_args(["--prefill", "1x2048,8x512", "--decode", "64"]).steps
    assert [(s.kind, s.batch, s.seq, s.tokens) for s in steps] == [("prefill", 1, 2048, 2048),
                                                                  ("prefill", 8, 512, 4096), ("decode", 64, 1, 64)]
    assert max_tokens(steps) == 4096  # the layer's max_tokens_per_rank: the largest step


def test_the_presets_and_flags_make_the_config():
    args = parse_args([])
    qwen = model_overrides(args)
    assert (qwen["hidden_size"], qwen["num_experts"], qwen["moe_intermediate_size"], qwen["num_experts_per_tok"],
            qwen["num_hidden_layers"], qwen["vocab_size"]) == (2048, 128, 768, 8, 4, 151936)
    assert expert_gib(args) == pytest.approx(4 * 128 * 3 * 2048 * 768 * 2 / 2**30)  # 4.5 GiB of bf16 experts
    deepseek = model_overrides(parse_args(["--arch", "deepseek_v3", "--experts", "32", "--layers", "6"]))
    assert (deepseek["n_routed_experts"], deepseek["num_experts_per_tok"], deepseek["first_k_dense_replace"],
            deepseek["num_hidden_layers"]) == (32, 6, 0, 6)
    assert "num_experts" not in deepseek  # each architecture's own field
    long = model_overrides(parse_args(["--prefill", "1x40000", "--decode", ""]))
    assert long["max_position_embeddings"] == 40000


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_tiny_model_of_the_preset_has_every_layer_moe_and_the_drop_in_takes_it(arch):
    pytest.importorskip("transformers")
    from chunkring.integrations.transformers import plan_moe_blocks
    from chunkring.testing.hf_models import tiny_model

    args = parse_args(["--arch", arch, *TINY, "--layers", "4"])
    model = tiny_model(arch, device="cpu", **model_overrides(args))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # built in bf16, no float32 copy
    plan = plan_moe_blocks(model, world_size=4, max_tokens_per_rank=max_tokens(args.steps), payload=args.payload,
                           streaming=True)
    assert [block.name for block, _ in plan] == [f"model.layers.{i}.mlp" for i in range(4)]
    assert {(c.num_experts, c.hidden, c.intermediate, c.topk) for _, c in plan} == {(8, 256, 128, 2)}


def test_the_shared_copy_has_its_own_modules_over_the_same_weights():
    pytest.importorskip("transformers")
    from chunkring.testing.hf_models import tiny_model

    model = tiny_model("qwen3_moe")
    twin = shared_copy(model)
    assert twin is not model and twin.model.layers[0].mlp is not model.model.layers[0].mlp
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert a is b, name
    assert all(a is b for a, b in zip(model.buffers(), twin.buffers(), strict=True))
    twin.model.layers[0].mlp = torch.nn.Identity()  # what the drop-in does to its blocks
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"


def test_the_error_is_relative_and_a_nan_is_infinite():
    ref = torch.tensor([3.0, 4.0])
    assert rel_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert rel_error(ref.to(torch.bfloat16), ref) == 0.0
    assert rel_error(torch.tensor([math.nan, 4.0]), ref) == math.inf


def test_ranks_combine_into_every_ranks_flag_the_largest_number_and_rank_0s_text():
    ranks = [{"batch_eager_ms": 1.0, "blocks_vs_reference": 0.02, "bitwise": True, "model": "a"},
             {"batch_eager_ms": 1.5, "blocks_vs_reference": 0.01, "bitwise": False, "model": "b"}]
    assert combine_ranks(ranks) == {"batch_eager_ms": 1.5, "blocks_vs_reference": 0.02, "bitwise": False,
                                    "model": "a"}
    assert combine_ranks(ranks[:1]) == ranks[0]


def test_a_record_carries_the_ratios_and_whether_its_checks_held():
    record = step_record(Step("decode", 8, 1), 4, measured())
    assert (record["step"], record["kind"], record["tokens"], record["ranks"]) == ("decode_8", "decode", 8, 4)
    assert record["batch_eager_over_own"] == pytest.approx(0.75)
    assert record["streamed_eager_over_own"] == pytest.approx(0.8)
    assert record["batch_compiled_over_own"] == pytest.approx(0.75)
    assert record["streamed_compiled_over_own"] == pytest.approx(0.8)
    assert record["passed"]
    eager_only = step_record(Step("decode", 1, 1), 1, {k: v for k, v in measured().items() if "compile" not in k})
    assert "batch_compiled_over_own" not in eager_only and eager_only["passed"]
    for bad in ({"bitwise": False}, {"bitwise_compiled": False}, {"blocks_vs_reference": 0.05},
                {"blocks_vs_reference": math.inf}, {"batch_compile_error": "Unsupported: x"}):
        assert not step_record(Step("decode", 8, 1), 1, measured(**bad))["passed"], bad
    assert not step_record(Step("decode", 8, 1), 1, {"own_eager_ms": 1.0})["passed"]  # nothing checked


def test_targets_take_the_worst_decode_eager_and_compiled_prefill():
    records = [step_record(Step("decode", 1, 1), 1, measured(batch_eager_ms=4.4)),
               step_record(Step("decode", 8, 1), 1, measured()),
               step_record(Step("prefill", 1, 2048), 1, measured(batch_compiled_ms=2.0)),
               step_record(Step("prefill", 8, 512), 1, measured(batch_eager_ms=9.0))]
    out = targets(records)
    assert out["worst_decode_eager_over_own"] == pytest.approx(1.1) and out["met_decode_eager_over_own"] == 0
    assert out["target_decode_eager_over_own"] == 1.0
    # A compiled prefill as fast as the own experts' is not faster: the target is strict.
    assert out["worst_prefill_compiled_over_own"] == pytest.approx(1.0) and out["met_prefill_compiled_over_own"] == 0
    good = targets(records[1:2] + records[3:])
    assert good["met_decode_eager_over_own"] == 1 and good["met_prefill_compiled_over_own"] == 1
    assert targets([step_record(Step("decode", 1, 1), 1, {"own_eager_ms": 1.0})]) == {}  # nothing to judge


def test_the_table_shows_every_side_the_checks_and_the_targets():
    records = [step_record(Step("prefill", 1, 2048), 1, measured()),
               step_record(Step("decode", 8, 1), 1, measured(bitwise=False)),
               step_record(Step("decode", 64, 1), 1, {k: v for k, v in measured().items() if "compile" not in k})]
    text = table(records)
    lines = text.splitlines()
    assert lines[0].startswith("step ") and len(lines[1].split("|")) == len(lines[0].split("|"))
    assert lines[1].startswith("prefill_1x2048 ") and lines[1].endswith("| ok")
    assert "streamed != batch" in lines[2]
    assert lines[3].count(" - ") == 4  # nothing compiled: three times and a ratio
    assert "compile s (first compiled call): prefill_1x2048 own 30.0 / batch 28.0" in text
    assert "target drop-in eager decode / own <= 1: worst 0.750 (met)" in text
    assert "target drop-in compiled prefill / own < 1: worst 0.750 (met)" in text


def test_the_result_file_holds_the_summary_fields_records_and_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "test GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CHUNKRING_COMMIT", "abc1234")
    monkeypatch.setenv("CHUNKRING_TREE_MODIFIED", "0")
    records = [step_record(Step("prefill", 1, 2048), 4, measured()),
               step_record(Step("decode", 8, 1), 4, measured(bitwise=False))]
    path = tmp_path / "abc1234-model-4rank-mps.json"
    bench_model.write_results(str(path), 4, records, {"model_setup_s": 12.5}, incomplete=True)
    summary = json.loads(path.read_text())
    for key in ("commit", "gpu", "gpus", "ranks", "suite", "command", "passed", "failed", "skipped", "figures"):
        assert key in summary, key
    assert (summary["commit"], summary["suite"], summary["ranks"], summary["gpu"]) == ("abc1234", "model", 4,
                                                                                      "test GPU")
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (1, 1, 0)
    assert summary["incomplete"] is True and summary["records"] == records
    figures = summary["figures"]
    assert figures["prefill_1x2048_batch_eager_ms"] == 3.0 and figures["decode_8_batch_eager_over_own"] == 0.75
    assert figures["model_setup_s"] == 12.5 and figures["met_decode_eager_over_own"] == 1
    assert not any(k.endswith(("_bitwise", "_tokens", "_passed", "_model")) for k in figures)  # no flags or text
    assert figures == {**figures_of(records), "model_setup_s": 12.5}


class StandInLayer:
    """What the bench asks of a drop-in block's layer: its payload, check() and close()."""

    def __init__(self, destroyed: list) -> None:
        from chunkring.ring.spec import PayloadFormat

        self.config = SimpleNamespace(payload=PayloadFormat.BF16)
        self.destroyed = destroyed

    def check(self) -> None:
        pass

    def close(self) -> None:
        self.destroyed.append(self)


class StandInBlock(torch.nn.Module):
    """A drop-in block computing as the block it replaced (the same modules): bf16, like the bf16 payload."""

    def __init__(self, block: torch.nn.Module, layer: StandInLayer) -> None:
        super().__init__()
        self.block, self.layer, self.streaming = block, layer, True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.block(hidden_states)


@pytest.fixture
def stood_in(monkeypatch):
    """The bench's GPU side stood in for on the CPU: the drop-in's blocks compute as the blocks they replace, every
    sample takes 1-3 ms by the count of samples; (runtime, the layers closed, the samples taken)."""
    pytest.importorskip("transformers")
    from chunkring.integrations import transformers as dropin
    from chunkring.integrations.transformers import find_moe_blocks

    destroyed: list = []
    calls: list = []

    def replace(model, runtime, *, max_tokens_per_rank, payload, streaming, timeout_s, decode, eager_graphs):
        # The drop-in as the benchmark builds it by default: the decode path where it fits, eager calls replayed.
        assert (max_tokens_per_rank, payload, streaming, decode, eager_graphs) == (12, "bf16", True, "auto", True)
        layer, replaced = StandInLayer(destroyed), {}
        for block in find_moe_blocks(model):
            parent, _, attr = block.name.rpartition(".")
            setattr(model.get_submodule(parent), attr, StandInBlock(block.module, layer))
            replaced[block.name] = block.module
        return replaced

    def timed(call):
        calls.append(call.args[:1])
        call()
        return 1.0 + len(calls) % 3  # ms

    monkeypatch.setattr(dropin, "replace_moe_blocks", replace)
    monkeypatch.setattr(dropin, "chunkring_blocks", lambda model: ((n, m) for n, m in model.named_modules()
                                                                   if isinstance(m, StandInBlock)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench_model, "events_ms", timed)
    runtime = SimpleNamespace(rank=0, world_size=1, torch_device=torch.device("cpu"), barrier=lambda: None,
                              allgather_object=lambda obj: [obj])
    return runtime, destroyed, calls


def test_the_eager_flow_runs_on_the_cpu_with_the_drop_in_stood_in_for(stood_in, tmp_path):
    runtime, destroyed, calls = stood_in
    args = parse_args([*TINY, "--layers", "2", "--payload", "bf16", "--prefill", "2x6", "--decode", "3",
                       "--context", "5", "--compile-steps", "none", "--iterations", "2", "--warmup", "0",
                       "--json", str(tmp_path / "model.json")])
    records: list = []
    with torch.no_grad():
        bench_model.run(args, runtime, records)
    assert [r["step"] for r in records] == ["prefill_2x6", "decode_3"]
    assert len(calls) == 2 * 3 * 2  # steps x sides x rounds
    for r in records:
        assert r["passed"] and r["bitwise"], r
        assert r["blocks_vs_reference"] < 1e-2  # bf16 blocks against the fp32 reference of their math
        assert r["blocks_vs_own"] == 0.0 and r["logits_vs_own"] == 0.0  # the stand-in is the own block
        assert {f"{side}_eager_ms" for side in ("own", "batch", "streamed")} <= set(r)
        assert not any("compiled" in key for key in r)
    assert len(destroyed) == 1  # the layer, once, at the end
    saved = json.loads((tmp_path / "model.json").read_text())
    assert saved["suite"] == "model" and "incomplete" not in saved and saved["passed"] == 2
    assert saved["figures"]["model_layers"] == 2


def test_the_compiled_flow_judges_the_modes_compiled_again_under_inductors_deterministic_mode(stood_in, monkeypatch):
    # torch.compile stood in for by the model itself, recording the Inductor mode each compilation's first call ran
    # under: the timed compilations free to time their reductions' configs, the checking ones not.
    runtime, _, _ = stood_in
    modes: list[bool] = []

    def compile_(model, **options):
        assert options["fullgraph"] is True and options["dynamic"] is False
        called = False

        def compiled(*args, **kwargs):
            nonlocal called
            if not called:  # the call that would compile
                modes.append(bool(torch._inductor.config.deterministic))
                called = True
            return model(*args, **kwargs)

        return compiled

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(torch.compiler, "reset", lambda: None)
    args = parse_args([*TINY, "--layers", "2", "--payload", "bf16", "--prefill", "2x6", "--decode", "",
                       "--compile-steps", "prefill_2x6", "--iterations", "1", "--warmup", "0"])
    records: list = []
    with torch.no_grad():
        bench_model.run(args, runtime, records)
    (r,) = records
    assert modes == [False, False, False, True, True], "own, batch, streamed timed; batch, streamed checked"
    assert r["bitwise_compiled"] is True and r["bitwise_compiled_autotuned"] is True and r["passed"], r
    assert {f"{side}_compiled_ms" for side in ("own", "batch", "streamed")} <= set(r)
