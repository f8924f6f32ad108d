"""The bench's method (chunkring.testing.bench_moe) and its launcher entry point, without a GPU: what
follows from one shape's measured times, and what the ``bench`` job hands the method."""

import contextlib

import pytest

from chunkring.testing import bench_moe
from chunkring.testing.bench_moe import EFFICIENCY_FLOOR, Timing, derived_figures


def test_the_overlap_bound_and_the_ratios():
    # 2048 tokens in chunks of 256: 8 chunks; P 1 ms, Q 8 ms -> bound 8 + 1/8.
    out = derived_figures(2048, 256, {"batch_ms": 9.0, "streamed_ms": 8.5, "P_ms": 1.0, "Q_ms": 8.0})
    assert out["chunks_per_call"] == 8
    assert out["bound_ms"] == pytest.approx(8.125)
    assert out["streamed_over_batch"] == pytest.approx(8.5 / 9.0)
    assert out["streamed_over_bound"] == pytest.approx(8.5 / 8.125)
    assert out["gain_possible_ms"] == pytest.approx(0.875) and out["gain_ms"] == pytest.approx(0.5)
    assert out["overlap_efficiency"] == pytest.approx(0.5 / 0.875)
    assert out["streaming_cost_us_per_chunk"] == pytest.approx(-62.5)
    assert "batch_over_peer" not in out  # no peer measured (several ranks)


def test_efficiency_only_where_overlap_could_save_enough():
    # The bound is within EFFICIENCY_FLOOR of batch-ready: the ratio would be noise over noise.
    batch = 10.0
    measured = {"batch_ms": batch, "streamed_ms": 10.2, "P_ms": 0.1, "Q_ms": batch - 0.1}
    out = derived_figures(100, 100, measured)  # one chunk: bound = P + Q = batch
    assert out["gain_possible_ms"] <= EFFICIENCY_FLOOR * batch
    assert "overlap_efficiency" not in out
    assert out["chunks_per_call"] == 1 and out["streaming_cost_us_per_chunk"] == pytest.approx(200.0)


def test_the_peer_ratios_where_the_peer_ran():
    out = derived_figures(7, 4, {"batch_ms": 2.0, "streamed_ms": 3.0, "P_ms": 0.5, "Q_ms": 1.5, "peer_ms": 1.0})
    assert out["chunks_per_call"] == 2  # a partial last chunk counts
    assert (out["batch_over_peer"], out["streamed_over_peer"]) == (2.0, 3.0)


def test_the_job_hands_the_method_its_config(monkeypatch):
    from chunkring_launch.config import from_table, load_table
    from chunkring_launch.jobs import bench

    config = from_table(bench.CONFIG, {**load_table("bench"), "tokens": "16,64", "chunks": "32,64",
                                       "trace": "64:32", "iterations": 7, "warmup": 2, "rotate": 3, "seed": 5},
                        job="bench")
    seen = {}

    def fake_run(runtime, open_layer, **kwargs):
        layers = {}
        for c in kwargs["chunk_sizes"]:
            with open_layer(c) as layer:
                layers[c] = layer
        seen.update(kwargs, layers=layers)
        kwargs["on_shape"](1, "n=16 chunk=32: streamed/batch 1.00")
        return {"c32_auto_streams": 0}

    monkeypatch.setattr(bench_moe, "run", fake_run)
    # The "layer" is its MoEConfig; the transport figures come from it.
    monkeypatch.setattr(bench, "open_layer", lambda runtime, fields, cfg: contextlib.nullcontext(cfg))
    monkeypatch.setattr(bench, "transport_figures", lambda cfg: {"transport_rma": int(cfg.transport == "rma")})
    assert bench.run(type("R", (), {"rank": 1})(), config) == {"c32_auto_streams": 0, "transport_rma": 0}
    assert seen["chunk_sizes"] == (32, 64) and seen["token_counts"] == (16, 64)
    assert seen["timing"] == Timing(iterations=7, warmup=2, rotate=3, seed=5)
    assert seen["trace"] == (64, 32) and seen["trace_out"] == config.trace_out
    assert {c: cfg.stream_slot_tokens for c, cfg in seen["layers"].items()} == {32: 32, 64: 64}
    assert all(cfg.hidden == config.hidden and cfg.topk == config.topk for cfg in seen["layers"].values())
