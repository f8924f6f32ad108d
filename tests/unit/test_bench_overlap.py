"""The overlap bench's method (benchmarks.bench_overlap) without a GPU: the bound, the per-chunk
cost, which records it reports, which chunk sizes it measures, its arguments, and its result file."""

import json

import pytest

from benchmarks import bench_overlap
from benchmarks.bench_overlap import RECORD_KEYS, overlap_bound, parse_args, per_chunk_cost_us, shape_record
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
    record = shape_record("flash", 2048, 512, {"batch_ms": 9.0, "streamed_ms": 8.9, "auto_ms": 9.1, "P_ms": 2.0,
                                               "Q_ms": 8.0, "ranks": 4, "chunk_kind": "best", "bitwise": True})
    assert set(RECORD_KEYS) <= set(record)
    assert record["chunks"] == 4 and record["bound_ms"] == 8.5 and record["ranks"] == 4
    assert record["per_chunk_cost_us"] == pytest.approx(100.0)
    assert record["streamed_over_batch"] == pytest.approx(8.9 / 9.0)
    assert record["streamed_over_bound"] == pytest.approx(8.9 / 8.5)
    assert record["auto_over_faster"] == pytest.approx(9.1 / 8.9)  # auto against the faster mode
    assert shape_record("flash", 2047, 512, record)["chunks"] == 4  # a partial last chunk counts


def test_arguments_are_parsed_and_checked():
    args = parse_args(["--shapes", "flash", "--tokens", "2048,1024", "--chunks", "256"])
    assert (args.shapes, args.tokens, args.chunks) == (["flash"], [1024, 2048], [256])
    assert parse_args([]).shapes == ["flash", "v3"] and parse_args([]).tokens == [1, 8, 128, 1024, 2048, 4096, 8192]
    for bad in (["--shapes", "mixtral"], ["--tokens", "2k"], ["--chunks", "0"], ["--iterations", "0"]):
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
    record = shape_record("flash", 2048, 128, {"batch_ms": 9.0, "streamed_ms": 9.6, "auto_ms": 9.0, "P_ms": 1.0,
                                               "Q_ms": 8.0, "ranks": 1, "chunk_kind": "default", "bitwise": True})
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


def test_the_entry_check_is_timed_per_call_and_set_against_the_batch_call():
    calls = []
    assert bench_overlap.entry_check_us(lambda: calls.append(1), calls=50) > 0 and len(calls) == 50
    with pytest.raises(ValueError):
        bench_overlap.entry_check_us(lambda: None, calls=0)
    record = shape_record("flash", 2048, 512, {"batch_ms": 2.0, "streamed_ms": 2.0, "auto_ms": 2.0, "P_ms": 1.0,
                                               "Q_ms": 1.5, "entry_check_us": 0.5})
    assert record["entry_check_us"] == 0.5 and record["entry_check_over_batch"] == pytest.approx(0.5e-3 / 2.0)
