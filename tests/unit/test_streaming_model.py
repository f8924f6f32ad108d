"""The streaming model past one GPU (scripts/streaming_model.py): one chunk is batch-ready's work, more chunks
pipeline the producers with the dispatch at a cost per extra chunk, and the link times follow the row bytes."""

import pytest

from scripts.streaming_model import link_ms, model_rows, predict, row_bytes


def test_one_chunk_is_batch_ready_and_more_chunks_hide_the_shorter_side():
    assert predict(P=1.0, E=5.0, D=2.0, C=1.0, chunk_cost=0.1, chunks=1) == (9.0, 9.0)
    batch, streamed = predict(P=1.0, E=5.0, D=2.0, C=1.0, chunk_cost=0.1, chunks=4)
    assert batch == 9.0 and streamed == pytest.approx(2.0 + 0.25 + 0.3 + 6.0)
    with pytest.raises(ValueError):
        predict(1.0, 1.0, 1.0, 1.0, 0.0, 0)


def test_rows_cross_the_link_as_fp8_with_scales_and_come_back_as_bf16():
    assert row_bytes(7168) == 7168 + 224 and row_bytes(7168, fp8=False) == 14336
    assert link_ms(1e6, 1000, 1000.0) == pytest.approx(1.0)  # 1 GB at 1,000 GB/s: 1 ms


def test_the_model_reads_the_best_chunking_and_the_single_chunk_producers():
    records = [{"shape": "s", "tokens": 1024, "ranks": 1, "chunk_kind": kind, "chunks": chunks, "P_ms": P,
                "Q_ms": 1.0} for kind, chunks, P in (("default", 1, 0.2), ("best", 2, 0.24))]
    row, = model_rows(records, {"s": {"hidden": 128, "topk": 2}}, ranks=8, gbs=1.0)
    assert row["P_ms"] == 0.2 and row["chunk_cost_ms"] == pytest.approx(0.04) and row["chunks"] == 2
    assert row["D_ms"] == pytest.approx(1024 * 2 * 7 / 8 * 132 / 1e9 * 1e3)
