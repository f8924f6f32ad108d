"""A model, not a measurement: streamed against batch-ready at 8 ranks on 8 GPUs over NVLink, from the one-GPU
overlap records and published link figures (docs/PERFORMANCE.md, "Past one GPU").

    python -m scripts.streaming_model [benchmarks/results/<commit>-overlap.json] [--ranks 8] [--link-gbs 370]

On one GPU every rank's dispatch is a copy on the same HBM, so only the producers' time could hide. Over NVLink
each rank also waits for its rows to cross the link, and a streamed call can send chunk k while chunk k+1 is
produced. Per shape and token count n per rank, with uniform routing (a share ``(W - 1) / W`` of every row's
top-k copies leaves its GPU):

* ``P``: the producers (router GEMM, top-k, quantisation) of the whole batch - the record's ``P_ms`` at one chunk;
* ``D``: the dispatch, ``n * K * (W - 1) / W`` FP8 rows with their scales over the link;
* ``C``: the combine, as many bf16 rows back;
* ``E``: the expert work, the record's ``Q_ms`` (one GPU: the pull and push are local copies, a small part);
* ``c``: what a chunk costs beyond its work - from the records, ``(P(chunks) - P(1)) / (chunks - 1)`` where a
  record has several chunks, else :data:`DEFAULT_CHUNK_COST_MS`.

batch-ready = P + D + E + C; streamed in m chunks = max(P, D) + min(P, D) / m + c * (m - 1) + E + C (the
producers and the dispatch pipelined; the experts, with one wave, after the last chunk; one chunk is
batch-ready's work). What would confirm it: the
overlap bench on an 8-GPU node (``mpirun -np 8 python -m benchmarks.bench_overlap``), whose records carry the
same fields.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys

#: NVLink 4 per direction per H200 is 450 GB/s; about 370 is what one-way copies reach (public figures).
LINK_GBS = 370.0
#: A chunk's fixed cost where no record measures it: two launches and a ring handshake, about 20 µs.
DEFAULT_CHUNK_COST_MS = 0.020


def row_bytes(hidden: int, fp8: bool = True) -> int:
    """Bytes of one dispatched row: FP8 with one fp32 scale per 128 columns, or bf16."""
    return hidden + 4 * (hidden // 128) if fp8 else 2 * hidden


def link_ms(rows: float, bytes_per_row: int, gbs: float) -> float:
    return rows * bytes_per_row / (gbs * 1e9) * 1e3


def predict(P: float, E: float, D: float, C: float, chunk_cost: float, chunks: int) -> tuple[float, float]:
    """(batch-ready ms, streamed ms) of the model above."""
    if chunks < 1:
        raise ValueError(f"need chunks >= 1, got {chunks}")
    batch = P + D + E + C
    streamed = max(P, D) + min(P, D) / chunks + chunk_cost * (chunks - 1) + E + C
    return batch, streamed


def model_rows(records: list[dict], shapes: dict, ranks: int, gbs: float) -> list[dict]:
    """One row per (shape, tokens) of a one-rank overlap record set: the best chunking's figures."""
    out = []
    for r in (r for r in records if r["chunk_kind"] == "best" and r.get("ranks", 1) == 1):
        spec = shapes[r["shape"]]
        remote = r["tokens"] * spec["topk"] * (ranks - 1) / ranks
        D = link_ms(remote, row_bytes(spec["hidden"]), gbs)
        C = link_ms(remote, row_bytes(spec["hidden"], fp8=False), gbs)
        single = [x for x in records if x["shape"] == r["shape"] and x["tokens"] == r["tokens"] and x["chunks"] == 1]
        P1 = single[0]["P_ms"] if single else r["P_ms"]
        measured = single and r["chunks"] > 1
        cost = max(0.0, (r["P_ms"] - P1) / (r["chunks"] - 1)) if measured else DEFAULT_CHUNK_COST_MS
        chunks = max(1, r["chunks"], min(8, r["tokens"] // 512))  # where the link makes more chunks pay
        batch, streamed = predict(P1, r["Q_ms"], D, C, cost, chunks)
        out.append({"shape": r["shape"], "tokens": r["tokens"], "ranks": ranks, "chunks": chunks, "P_ms": P1,
                    "D_ms": D, "E_ms": r["Q_ms"], "C_ms": C, "chunk_cost_ms": cost, "batch_ms": batch,
                    "streamed_ms": streamed, "streamed_over_batch": streamed / batch})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", nargs="?", help="an overlap record (default: the newest one-rank record)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--link-gbs", type=float, default=LINK_GBS)
    args = parser.parse_args(argv)
    path = args.record
    if path is None:  # the one-rank record measured at the most token counts, of those the newest commit's
        files = {p: json.load(open(p)) for p in glob.glob("benchmarks/results/*-overlap.json")}
        one_rank = [p for p, record in files.items() if record["ranks"] == 1 and "auto_ms" in record["records"][0]]
        if not one_rank:
            parser.error("no one-rank overlap record of this bench under benchmarks/results/")
        from scripts.results_index import git_commit_time

        commit_time = git_commit_time()  # a commit git does not know counts as the oldest
        path = max(one_rank, key=lambda p: (len(files[p]["records"]), commit_time(files[p]["commit"]) or 0))
    from benchmarks.bench_overlap import SHAPES

    rows = model_rows(json.load(open(path))["records"], SHAPES, args.ranks, args.link_gbs)
    print(f"model from {path}: {args.ranks} ranks, {args.link_gbs:g} GB/s per direction")
    keys = ("shape", "tokens", "chunks", "P_ms", "D_ms", "E_ms", "C_ms", "batch_ms", "streamed_ms",
            "streamed_over_batch")
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
