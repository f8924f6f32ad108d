"""The persistent consumer's benchmark (benchmarks.bench_persistent) without a GPU: its arguments parse and are
refused when wrong, every variant of its sweeps runs on an H100 and H200 (the kernel's checks), the first of each is the
default the timeline is recorded for, and the figures and table come out of the rows it records."""

import pytest

from benchmarks import bench_persistent as bench
from chunkring.moe._engine.persistent import PersistentVariant

SMS, SHARED = 132, 232448  # the H100's SMs; the shared memory a block may opt in to on the H100 and H200


def test_arguments_parse():
    args = bench.parse_args(["--tokens", "1,8", "--sweep", "quick", "--variant", "stages=3,claim=blocked,fused=false"])
    assert args.tokens == [1, 8] and args.reps == 15
    assert args.variants[-1] == ("stages=3,claim=blocked,fused=false", {"stages": 3, "claim": "blocked",
                                                                         "fused": False})
    assert bench.parse_variant("sms=none,tile_cap=16") == ("sms=none,tile_cap=16", {"sms": None, "tile_cap": 16})


@pytest.mark.parametrize("argv", [["--variant", "depth=3"], ["--variant", "stages"], ["--variant", "stages=x"],
                                  ["--tokens", "0"], ["--reps", "0"], ["--sweep", "all"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


@pytest.mark.parametrize("sweep", sorted(bench.SWEEPS))
def test_every_variant_of_a_sweep_runs_and_the_first_is_the_default(sweep):
    variants = bench.SWEEPS[sweep]
    assert variants[0][1] == {} and len({name for name, _ in variants}) == len(variants)
    for _, fields in variants:
        PersistentVariant(**fields).check(SMS, SHARED)


def rows():
    base = dict(shape="flash", weight_bytes=805_000_000, rows_max=40, pct_peak=50.0, rel_err=1e-3, vs_decode=0.0,
                verified=True)
    return [dict(base, tokens=128, path="decode", variant="decode", ms=0.40, tbps=2.0),
            dict(base, tokens=128, path="deepgemm", variant="deepgemm", ms=0.34, tbps=2.4),
            dict(base, tokens=128, path="persistent", variant="s8t4c64", ms=0.30, tbps=2.7, first_stage_us=3.0,
                 last_l1_us=180.0, last_l2_us=290.0, span_us=295.0),
            dict(base, tokens=128, path="persistent", variant="split", ms=0.28, tbps=2.9),
            dict(base, tokens=128, path="persistent", variant="s4t4c64", ms=0.20, tbps=4.0, verified=False),
            dict(shape="flash", tokens=128, path="persistent", variant="w13x16", error="refused", verified=False)]


def test_the_figures_keep_the_fastest_verified_variant():
    found = bench.figures(rows())
    assert found["128_decode_ms"] == 0.40 and found["128_deepgemm_tbps"] == 2.4
    assert found["128_persistent_ms"] == 0.28, "a variant that failed its check is never the best"
    assert found["128_persistent_over_decode"] == pytest.approx(0.7)
    assert found["128_default_last_l2_us"] == 290.0 and found["128_persistent_pct_peak"] == 50.0


def test_the_table_prints_every_row_and_the_timeline(capsys):
    bench.report(rows())
    out = capsys.readouterr().out
    assert out.count("\n   128 |") == 6 and "NO" in out and "last L2 unit 290.0 us" in out
    assert "w13x16     | refused: refused" in out
