"""The eager-call bench's method (benchmarks.bench_eager) without a GPU: its arguments, the interleaved rounds, a
host-issue sample behind its gate, the event timing, the gate's size, how ranks' figures combine, the ratios and
targets a record carries, the table, and the result file."""

import json

import pytest

from benchmarks import bench_eager
from benchmarks.bench_eager import (
    EAGER_OVER_GRAPH_TARGET,
    HOST_ISSUE_TARGET_MS,
    across_ranks,
    events_ms,
    figures_of,
    host_issue_sample,
    host_warm_sample,
    interleaved,
    medians,
    parse_args,
    rotating,
    sleep_cycles,
    table,
    targets,
    tokens_record,
)
from tests.helpers.imports import heavy_modules_after


def measured(peer: bool = True, **overrides) -> dict:
    """One token count's figures (ms) as measure_tokens hands them to tokens_record."""
    sides = {"batch": (0.8, 0.82, 0.8, 0.14), "streamed": (0.9, 0.95, 0.9, 0.15)}
    if peer:
        sides["megamoe"] = (0.02, 0.19, 0.1, 0.09)
    out: dict = {"bitwise": True, "megamoe": "1 rank" if peer else "left out (--no-megamoe)"}
    for side, (host, eager, pipelined, graph) in sides.items():
        out.update({f"{side}_host_issue_ms": host, f"{side}_host_warm_ms": host / 4, f"{side}_eager_ms": eager,
                    f"{side}_pipelined_ms": pipelined, f"{side}_graph_ms": graph, f"{side}_host_gate_held": 1.0})
    return {**out, **overrides}


def test_arguments_default_to_the_issue_sizes_and_are_checked():
    args = parse_args([])
    assert args.shape == "flash" and args.tokens == [1, 8, 32, 128, 512, 2048, 8192]
    assert args.pipeline == 20 and not args.no_megamoe and args.json is None
    assert parse_args(["--tokens", "128,8,8"]).tokens == [8, 128]
    for bad in (["--tokens", "2k"], ["--tokens", "0"], ["--shape", "mixtral"], ["--pipeline", "0"],
                ["--iterations", "0"], ["--warmup", "-1"], ["--gate-ms", "0"], ["--warm-calls", "1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_bad_argument_costs_no_bring_up(monkeypatch):
    monkeypatch.setattr("chunkring.init", lambda: pytest.fail("init before the arguments were checked"))
    with pytest.raises(SystemExit):
        bench_eager.main(["--tokens", "x"])


def test_importing_the_bench_loads_no_torch_or_deepgemm():
    assert heavy_modules_after("import benchmarks.bench_eager", also=("deep_gemm",)) == []


def test_rounds_interleave_with_a_rotating_order_and_drop_the_warmup():
    calls = []

    def sampler(name):
        def sample():
            calls.append(name)
            return len(calls)
        return sample

    settled = []
    samples = interleaved({"a": sampler("a"), "b": sampler("b"), "c": sampler("c")}, iterations=2, warmup=1,
                          before=lambda: settled.append(len(calls)))
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each round starts one further on
    assert settled == list(range(9))  # before every sample
    assert samples == {"a": [6, 8], "b": [4, 9], "c": [5, 7]}  # the warm-up round's samples are not kept


def test_a_host_sample_times_the_call_alone_and_says_whether_the_gate_held():
    ticks = iter([10.0, 10.0025])
    events = []

    def gate():
        events.append("gate")
        return lambda: False  # the delay still running: the call returned behind it

    ms, held = host_issue_sample(lambda: events.append("call"), gate, clock=lambda: next(ticks))
    assert events == ["gate", "call"]  # the delay is enqueued before the clock starts
    assert ms == pytest.approx(2.5) and held
    assert not host_issue_sample(lambda: None, lambda: (lambda: True), clock=iter([0.0, 1.0]).__next__)[1]


def test_a_warm_sample_issues_its_calls_behind_one_gate_and_leaves_the_first_out():
    ticks = iter([0.0, 0.004, 1.0, 1.001, 2.0, 2.002, 3.0, 3.0015])  # the first call 4 ms, then 1, 2, 1.5 ms
    events = []
    ms = host_warm_sample(lambda: events.append("call"), lambda: events.append("gate"), 4, clock=lambda: next(ticks))
    assert events == ["gate", "call", "call", "call", "call"]
    assert ms == pytest.approx(1.5)


def test_a_rotating_call_makes_each_call_in_turn():
    made = []
    call = rotating([lambda: made.append("a") or 1, lambda: made.append("b") or 2, lambda: made.append("c") or 3])
    assert [call() for _ in range(5)] == [1, 2, 3, 1, 2] and made == ["a", "b", "c", "a", "b"]


def test_events_time_the_calls_between_them_per_call():
    log = []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = len(log)

        def synchronize(self):
            log.append("sync")

        def elapsed_time(self, other):
            return float(other.at - self.at) * 2.0  # 2 ms per call recorded between the two

    assert events_ms(lambda: log.append("call"), calls=5, event=FakeEvent) == pytest.approx(2.0)
    assert log == ["call"] * 5 + ["sync"]


def test_the_gate_is_sized_from_its_probe():
    assert sleep_cycles(10.0, probe_cycles=2_000_000, probe_ms=1.0) == 20_000_000
    assert sleep_cycles(1e-9, 2_000_000, 1.0) == 1  # never a zero-cycle delay
    with pytest.raises(ValueError):
        sleep_cycles(10.0, 2_000_000, 0.0)


def test_one_ranks_samples_become_medians_and_the_gates_share():
    host = {"batch": [(1.0, True), (3.0, False), (2.0, True), (9.0, True)]}
    out = medians(host, {"batch": [0.3, 0.1, 0.2]}, {"batch": [0.5, 0.7, 0.6]}, {"batch": [0.4]}, {"batch": 0.2})
    assert out == {"batch_host_issue_ms": 2.5, "batch_host_gate_held": 0.75, "batch_host_warm_ms": 0.2,
                   "batch_eager_ms": 0.6, "batch_pipelined_ms": 0.4, "batch_graph_ms": 0.2}


def test_ranks_combine_into_the_slowest_time_the_lowest_hold_and_every_ranks_flag():
    ranks = [{"batch_eager_ms": 1.0, "batch_host_gate_held": 1.0, "bitwise": True, "megamoe": "1 rank"},
             {"batch_eager_ms": 1.5, "batch_host_gate_held": 0.5, "bitwise": False, "megamoe": "1 rank"}]
    assert across_ranks(ranks) == {"batch_eager_ms": 1.5, "batch_host_gate_held": 0.5, "bitwise": False,
                                   "megamoe": "1 rank"}
    assert across_ranks(ranks[:1]) == ranks[0]  # one rank: its own figures


def test_a_record_carries_every_side_and_the_ratios_the_targets_name():
    record = tokens_record("flash", 2048, 4, 1024, measured())
    assert (record["shape"], record["tokens"], record["ranks"], record["chunk"], record["chunks"]) == \
        ("flash", 2048, 4, 1024, 2)
    assert record["batch_eager_over_graph"] == pytest.approx(0.82 / 0.14)
    assert record["streamed_eager_over_graph"] == pytest.approx(0.95 / 0.15)
    assert record["megamoe_eager_over_graph"] == pytest.approx(0.19 / 0.09)
    assert record["batch_eager_over_megamoe_eager"] == pytest.approx(0.82 / 0.19)
    assert record["streamed_eager_over_megamoe_eager"] == pytest.approx(0.95 / 0.19)
    assert record["batch_host_issue_over_target"] == pytest.approx(0.8 / HOST_ISSUE_TARGET_MS)
    assert "megamoe_host_issue_over_target" not in record  # the target is the layer's
    alone = tokens_record("flash", 1, 1, 1, measured(peer=False))
    assert "batch_eager_over_megamoe_eager" not in alone and alone["chunks"] == 1


def test_targets_take_the_worst_case_over_sizes_and_modes():
    fast = {f"{m}_{f}": v for m in ("batch", "streamed") for f, v in
            (("host_issue_ms", 0.03), ("eager_ms", 0.2), ("graph_ms", 0.19), ("pipelined_ms", 0.19))}
    fast.update({f"megamoe_{f}": 0.25 for f in ("host_issue_ms", "eager_ms", "pipelined_ms", "graph_ms")})
    records = [tokens_record("flash", 8, 1, 8, {**fast, "bitwise": True}),
               tokens_record("flash", 1, 1, 1, measured())]
    out = targets(records)
    assert out["worst_host_issue_ms"] == 0.9 and out["met_host_issue_ms"] == 0
    assert out["worst_eager_over_graph"] == pytest.approx(0.95 / 0.15) and out["met_eager_over_graph"] == 0
    assert out["target_eager_over_graph"] == EAGER_OVER_GRAPH_TARGET
    assert out["worst_eager_over_megamoe_eager"] == pytest.approx(0.95 / 0.19)
    good = targets(records[:1])
    assert good["met_host_issue_ms"] == good["met_eager_over_graph"] == good["met_eager_over_megamoe_eager"] == 1
    # Without MegaMoE in every record its target is not judged.
    assert "worst_eager_over_megamoe_eager" not in targets([tokens_record("flash", 1, 1, 1, measured(peer=False))])


def test_the_table_shows_every_side_and_the_targets():
    records = [tokens_record("flash", 1, 1, 1, measured()),
               tokens_record("flash", 8, 1, 8, measured(peer=False, bitwise=False))]
    text = table(records)
    lines = text.splitlines()
    assert lines[0].startswith("tokens | side")
    assert sum(" | megamoe " in line for line in lines) == 1 and sum(" | batch " in line for line in lines) == 2
    assert "target host issue (ms) <= 0.05: worst 0.900 (not met)" in text
    assert "eager / MegaMoE eager" not in text  # one record lacks MegaMoE
    assert "streamed differs from batch-ready at 8 tokens" in text
    assert "moved" not in text  # no record has the moved figures
    moved = tokens_record("flash", 1, 1, 1, {**measured(), "batch_host_moved_ms": 0.071,
                                             "streamed_host_moved_ms": 0.083})
    assert "1 tokens, host warm with the tensors moved each call: batch 0.071 / streamed 0.083 ms" in table([moved])


def test_the_result_file_holds_the_summary_fields_records_and_figures(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "test GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CHUNKRING_COMMIT", "abc1234")
    monkeypatch.setenv("CHUNKRING_TREE_MODIFIED", "0")
    records = [tokens_record("flash", 1, 4, 1, measured()),
               tokens_record("flash", 8, 4, 8, measured(peer=False, megamoe="not run: rank 2: OSError: no"))]
    path = tmp_path / "abc1234-eager-4rank-mps.json"
    bench_eager.write_results(str(path), 4, records, incomplete=True)
    summary = json.loads(path.read_text())
    for key in ("commit", "gpu", "gpus", "ranks", "suite", "command", "passed", "failed", "skipped", "figures"):
        assert key in summary, key
    assert (summary["commit"], summary["suite"], summary["ranks"], summary["gpu"]) == ("abc1234", "eager", 4,
                                                                                      "test GPU")
    assert (summary["passed"], summary["failed"]) == (1, 1)  # MegaMoE could not run at 8 tokens
    assert summary["incomplete"] is True and summary["records"] == records
    figures = summary["figures"]
    assert figures["flash_1_batch_eager_ms"] == 0.82 and figures["flash_8_streamed_graph_ms"] == 0.15
    assert "flash_1_bitwise" not in figures and "flash_1_tokens" not in figures  # flags and keys are no figures
    assert figures["worst_host_issue_ms"] == 0.9 and figures["met_host_issue_ms"] == 0
    assert figures == figures_of(records)
