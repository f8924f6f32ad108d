"""The overlap bench's method (benchmarks.bench_overlap) without a GPU: the bound, the per-chunk
cost, which records it reports, which chunk sizes it measures, its arguments, and its result file."""

import json

import pytest

from benchmarks import bench_overlap
from benchmarks.bench_overlap import (
    RECORD_KEYS,
    chunk_sizes,
    overlap_bound,
    parse_args,
    per_chunk_cost_us,
    pick_records,
    shape_record,
)
from chunkring.testing import records as record_file


def test_bound_is_the_longer_side_plus_one_chunk_of_the_shorter():
    assert overlap_bound(P=1.0, Q=8.0, chunks=4) == 8.25
    assert overlap_bound(P=8.0, Q=1.0, chunks=4) == 8.25  # symmetric: a producer-bound pipeline alike
    assert overlap_bound(P=2.0, Q=3.0, chunks=1) == 5.0   # one chunk: nothing overlaps, P + Q


@pytest.mark.parametrize("P,Q,chunks", [(1.0, 2.0, 0), (-1.0, 2.0, 2), (1.0, -0.1, 2)])
def test_bound_refuses_impossible_inputs(P, Q, chunks):
    with pytest.raises(ValueError):
        overlap_bound(P, Q, chunks)


def test_per_chunk_cost_is_the_time_beyond_the_bound_per_chunk():
    assert per_chunk_cost_us(streamed_ms=9.0, bound_ms=8.5, chunks=4) == pytest.approx(125.0)
    assert per_chunk_cost_us(streamed_ms=8.5, bound_ms=8.5, chunks=16) == 0.0  # perfect overlap costs nothing
    with pytest.raises(ValueError):
        per_chunk_cost_us(1.0, 1.0, 0)


def test_record_carries_the_required_keys_and_derived_figures():
    record = shape_record("flash", 2048, 512, {"batch_ms": 9.0, "streamed_ms": 8.9, "P_ms": 2.0, "Q_ms": 8.0,
                                               "producer_sms": 32, "waves": 4})
    assert set(RECORD_KEYS) - {"chunk_kind"} <= set(record)
    assert record["chunks"] == 4 and record["bound_ms"] == 8.5 and record["producer_sms"] == 32
    assert record["waves"] == 4
    assert record["per_chunk_cost_us"] == pytest.approx(100.0)
    assert record["streamed_over_batch"] == pytest.approx(8.9 / 9.0)
    assert record["streamed_over_bound"] == pytest.approx(8.9 / 8.5)
    assert shape_record("flash", 2047, 512, record)["chunks"] == 4  # a partial last chunk counts


def _by_chunk(streamed: dict[int, float]) -> dict[int, dict]:
    return {c: shape_record("flash", 2048, c, {"batch_ms": 9.0, "streamed_ms": s, "P_ms": 1.0, "Q_ms": 8.0,
                                               "waves": 1})
            for c, s in streamed.items()}


def test_reports_the_default_ring_and_the_fastest_chunk():
    default, best = pick_records(_by_chunk({128: 9.6, 256: 9.2, 1024: 9.1}), default_chunk=128)
    assert (default["chunk_kind"], default["chunk"]) == ("default", 128)
    assert (best["chunk_kind"], best["chunk"]) == ("best", 1024)


def test_default_ring_is_also_the_best_when_nothing_beats_it_and_ties_go_to_the_smaller_chunk():
    records = pick_records(_by_chunk({128: 9.0, 512: 9.3}), default_chunk=128)
    assert [(r["chunk_kind"], r["chunk"]) for r in records] == [("default", 128), ("best", 128)]
    assert pick_records(_by_chunk({128: 9.5, 256: 9.1, 512: 9.1}), 128)[1]["chunk"] == 256


def test_measures_the_default_chunk_and_the_extra_ones_up_to_the_batch():
    assert chunk_sizes(128, [256, 512, 1024], tokens=2048) == [128, 256, 512, 1024]
    assert chunk_sizes(128, [256, 512, 1024], tokens=512) == [128, 256, 512]
    assert chunk_sizes(512, [512, 4096], tokens=2048) == [512]


def test_arguments_are_parsed_and_checked():
    args = parse_args(["--shapes", "flash", "--tokens", "1024,2048", "--chunks", "256", "--waves", "1,4"])
    assert (args.shapes, args.tokens, args.chunks, args.waves) == (["flash"], [1024, 2048], [256], [1, 4])
    assert parse_args([]).shapes == ["flash", "v3"] and parse_args([]).waves == [1]
    for bad in (["--shapes", "mixtral"], ["--tokens", "2k"], ["--chunks", "0"], ["--iterations", "0"],
                ["--waves", "9"], ["--waves", "0"], ["--waves", "two"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_shapes_are_one_ranks_share():
    # bench_vs_megamoe.py's flash shape (the FP8 consumer issue's), and V3's width and top-k at 32 experts per
    # rank: 8 ranks route over V3's 256 experts.
    from benchmarks.bench_vs_megamoe import SHAPES as MEGAMOE_SHAPES

    assert bench_overlap.SHAPES["flash"] == MEGAMOE_SHAPES["flash"]
    assert bench_overlap.SHAPES["v3"]["experts"] * 8 == 256
    assert (bench_overlap.SHAPES["v3"]["hidden"], bench_overlap.SHAPES["v3"]["topk"]) == (7168, 8)


def test_result_file_holds_the_summary_fields_records_and_files(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "test GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CHUNKRING_COMMIT", "abc1234")
    monkeypatch.setenv("CHUNKRING_TREE_MODIFIED", "1")
    record = {**pick_records(_by_chunk({128: 9.6}), 128)[0]}
    path = tmp_path / "abc1234-overlap.json"
    record_file.write(str(path), suite="overlap", world_size=1, figures={"x": 1.0}, records=[record],
                          files=["t.png"])
    summary = json.loads(path.read_text())
    for key in ("commit", "gpu", "gpus", "ranks", "suite", "command", "passed", "failed", "skipped", "figures"):
        assert key in summary, key
    assert summary["commit"] == "abc1234" and summary["suite"] == "overlap"
    assert summary["tree_modified"] is True  # the tree that ran was not exactly that commit
    assert summary["records"] == [record] and summary["files"] == ["t.png"]
    # Without records the file is what every other bench writes.
    monkeypatch.delenv("CHUNKRING_TREE_MODIFIED")
    record_file.write(str(path), suite="s", world_size=2, figures={})
    plain = json.loads(path.read_text())
    assert "records" not in plain and plain["tree_modified"] is None  # nobody said


def test_bench_is_not_started_without_a_gpu_by_a_bad_argument(monkeypatch):
    # parse_args runs before chunkring.init(): a typo never costs a device session its bring-up.
    monkeypatch.setattr("chunkring.init", lambda: pytest.fail("init before the arguments were checked"))
    with pytest.raises(SystemExit):
        bench_overlap.main(["--shapes", "nope"])
