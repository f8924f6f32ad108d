"""The weight-read probe's sweep (benchmarks.probe_weight_read) without a GPU: its axes parse and are refused when
wrong, a sweep's grids expand to each case once with command-line axes replacing the sweep's, cases that cannot run
are skipped with the reason, the figures it records, and the constants it shares with
device/kernels/probe_weight_read.cu agree with the kernel's."""

import re
from pathlib import Path

import pytest

from benchmarks import probe_weight_read as probe
from benchmarks.bench_vs_megamoe import SHAPES
from benchmarks.probe_weight_read import Case, case_problem, parse_args, sweep_cases

REPO = Path(__file__).resolve().parents[2]
FLASH = SHAPES["flash"]
H100_SHARED = 232448  # the shared memory a block may opt in to on the H100 and H200


def case(**change):
    fields = dict(experts=26, loader="tma", box_rows=128, box_cols=128, stages=8, claim="strided", sms=132,
                  swizzle="128B")
    return Case(**{**fields, **change})


def test_axes_parse():
    assert probe.parse_box("64x128") == (64, 128)
    assert probe.parse_ints("1,2,16", "stages") == [1, 2, 16]
    assert probe.parse_sms("8,all", 132) == [8, 132]
    assert probe.swizzle_for(128, "auto") == "128B" and probe.swizzle_for(256, "auto") == "none"
    assert probe.swizzle_for(128, "none") == "none"


@pytest.mark.parametrize("call", [
    lambda: probe.parse_box("128"), lambda: probe.parse_box("0x128"), lambda: probe.parse_box("ax1"),
    lambda: probe.parse_ints("2,x", "stages"), lambda: probe.parse_ints("0", "stages"),
    lambda: probe.parse_sms("133", 132), lambda: probe.parse_sms("0", 132),
    lambda: probe.parse_names("tma,dma", probe.LOADERS, "loaders"),
])
def test_bad_axes_are_refused(call):
    with pytest.raises(ValueError):
        call()


def test_the_default_sweep_covers_every_loader_box_and_depth_once():
    cases = sweep_cases("default", {}, 132)
    assert len(cases) == len(set(cases)) and cases == sorted(cases)
    assert {c.loader for c in cases} == {"tma", "flat", "rows"} and {c.experts for c in cases} == {6, 26, 32}
    assert {c.stages for c in cases} >= {1, 2, 4, 8, 16} and {c.claim for c in cases} == {"strided", "blocked",
                                                                                          "atomic"}
    assert {c.sms for c in cases} == {8, 16, 33, 66, 99, 132}
    assert {(c.box_rows, c.box_cols) for c in cases} == {(64, 128), (128, 128), (256, 128), (128, 256)}
    # "auto" swizzles the boxes whose rows fit 128 bytes, as the WGMMA consumer will load them; one grid compares
    assert {c.swizzle for c in cases if c.box_cols > 128} == {"none"}
    assert {c.swizzle for c in cases if c.box_cols <= 128 and c.loader != "tma"} == {"128B"}
    assert {c.swizzle for c in cases if (c.loader, c.box_rows, c.experts, c.stages) == ("tma", 128, 26, 8)} \
        == {"none", "128B"}
    runnable = [c for c in cases if case_problem(c, FLASH, H100_SHARED) is None]
    assert 200 <= len(runnable) <= 300  # a few thousand launches: well under the 5 minutes of its gpu_suite part


def test_an_axis_on_the_command_line_replaces_it_in_every_grid():
    cases = sweep_cases("default", {"experts": "6", "stages": "4"}, 132)
    assert {c.experts for c in cases} == {6} and {c.stages for c in cases} == {4}
    quick = sweep_cases("quick", {"loaders": "flat"}, 132)
    assert {c.loader for c in quick} == {"flat"} and len(quick) == 2 * 2 * 2
    with pytest.raises(ValueError, match="unknown axes"):
        sweep_cases("default", {"depth": "4"}, 132)
    with pytest.raises(ValueError, match="sweep"):
        sweep_cases("full", {}, 132)


@pytest.mark.parametrize("change,reason", [
    ({"experts": 33}, "experts of 32"),
    ({"box_rows": 96}, "does not divide"),
    ({"box_cols": 384, "swizzle": "none"}, "does not divide"),
    ({"box_rows": 512}, "256 x 256"),
    ({"box_cols": 256}, "128-byte swizzling"),
    ({"box_rows": 4, "box_cols": 128}, "whole 1024 bytes"),
    ({"stages": 16}, "over the"),          # 16 x 16 KB
    ({"stages": 33, "box_rows": 8}, "at most 32 stages"),
])
def test_cases_that_cannot_run_are_skipped_with_the_reason(change, reason):
    assert reason in case_problem(case(**change), FLASH, H100_SHARED)


def test_the_largest_rings_that_fit():
    assert case_problem(case(stages=12), FLASH, H100_SHARED) is None  # 192 KB of 16 KB stages
    assert case_problem(case(box_rows=256, stages=6), FLASH, H100_SHARED) is None  # 6 x 32 KB
    assert case_problem(case(box_rows=256, stages=7), FLASH, H100_SHARED) is None  # 224 KB + alignment + static
    assert case_problem(case(box_rows=256, stages=8), FLASH, H100_SHARED) is not None


def test_arguments():
    args = parse_args(["--sweep", "quick", "--stages", "2,4", "--reps", "3"])
    assert (args.sweep, args.overrides, args.reps) == ("quick", {"stages": "2,4"}, 3)
    assert parse_args([]).sweep == "default" and parse_args([]).overrides == {}
    for bad in (["--sweep", "all"], ["--stages", "0"], ["--boxes", "128"], ["--loaders", "dma"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_the_cards_datasheet_bandwidth():
    assert probe.peak_tbps("NVIDIA H200") == 4.8 and probe.peak_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert probe.peak_tbps("NVIDIA A100-SXM4-80GB") is None


def test_figures_are_the_best_verified_case_and_the_baselines_per_expert_set():
    rows = [{"experts": 6, "loader": "tma", "verified": True, "tbps": 2.0, "pct_peak": 60.0},
            {"experts": 6, "loader": "rows", "verified": True, "tbps": 2.5, "pct_peak": 75.0},
            {"experts": 6, "loader": "flat", "verified": False, "tbps": 9.0, "pct_peak": 270.0},
            {"experts": 6, "loader": "plain", "verified": True, "tbps": 2.2, "pct_peak": 66.0},
            {"experts": 6, "loader": "torch_copy", "verified": True, "tbps": 1.4, "pct_peak": 42.0,
             "copy_tbps_read_write": 2.8}]
    assert probe.figures(rows) == {"e6_best_tbps": 2.5, "e6_best_pct_peak": 75.0, "e6_plain_tbps": 2.2,
                                   "e6_copy_read_write_tbps": 2.8}


def kernel_constant(text: str, name: str) -> int:
    return int(re.search(rf"\b{name} = (0x[0-9a-f]+|\d+)", text).group(1), 0)


def test_the_constants_agree_with_the_kernel():
    kernel = (REPO / "device/kernels/probe_weight_read.cu").read_text()
    pipeline = (REPO / "device/include/chunkring/util/stage_pipeline.cuh").read_text()
    assert {name: kernel_constant(kernel, f"k{name.capitalize()}") for name in ("strided", "blocked", "atomic")} \
        == probe.CLAIMS
    assert {"tma": kernel_constant(kernel, "kTensor2d"), "flat": kernel_constant(kernel, "kFlat"),
            "rows": kernel_constant(kernel, "kRows")} == probe.LOADERS
    assert kernel_constant(kernel, "kRecordWords") == probe.RECORD_WORDS
    assert kernel_constant(kernel, "kRecordMark") == probe.RECORD_MARK
    assert kernel_constant(kernel, "kStageAlign") == probe.STAGE_ALIGN
    assert kernel_constant(kernel, "kPlainThreads") == probe.PLAIN_THREADS
    assert kernel_constant(kernel, "kPlainUnroll") * probe.PLAIN_THREADS * 16 == probe.PLAIN_TILE_BYTES
    assert kernel_constant(pipeline, "kMaxStages") == probe.MAX_STAGES
    words = re.search(r"kChecksum = 0, kTiles = 1, kBytes = 2, kSm = 3, kStartNs = 4, kFirstNs = 5, kEndNs = 6, "
                      r"kMark = 7;", kernel)
    assert words and (probe.CHECKSUM, probe.MARK) == (0, 7)
    # 8 consumer warps and the loader's warpgroup
    assert kernel_constant(kernel, "kConsumerWarps") * 32 + 128 == probe.PROBE_THREADS


def test_the_table_prints_from_the_records(capsys):
    from types import SimpleNamespace

    card = SimpleNamespace(name="NVIDIA H100 80GB HBM3", sm_count=132, l2_bytes=50 * 2**20, peak=3.35,
                           expert_bytes=25_165_824)
    rows = []
    for c in sweep_cases("default", {}, 132):
        if case_problem(c, FLASH, H100_SHARED) is None:
            tbps = 0.5 + 0.1 * c.stages + (0.2 if c.loader == "tma" else 0)
            rows.append({**c.__dict__, "verified": True, "tbps": tbps, "pct_peak": 100 * tbps / 3.35,
                         "in_flight_kb": c.stages * c.box_bytes / 1024})
    for e in (6, 26, 32):
        rows += [{"experts": e, "loader": "plain", "verified": True, "tbps": 2.9, "pct_peak": 87.0},
                 {"experts": e, "loader": "torch_copy", "verified": True, "tbps": 1.45, "pct_peak": 43.0,
                  "copy_tbps_read_write": 2.9}]
    rows.append({"experts": 6, "loader": "flat", "verified": False, "problems": "checksum 0x1, torch 0x2"})
    probe.report(card, rows, skipped=68)
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3: 132 SMs" in out and "68 cases skipped" in out
    assert "SMs, tma 128x128 x8: 8: " in out and "claims, tma 128x128 x4, 6 experts: atomic" in out
    assert "26 experts ( 654 MB): best" in out and "best TB/s by KB in flight per SM: 8: " in out
    assert "FAILED flat 6e: checksum 0x1, torch 0x2" in out
    assert len(out.splitlines()) < 40  # short: the device tool returns the output's tail
