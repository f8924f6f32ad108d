"""The decode kernels' Nsight Compute record (scripts/decode_ncu_summary.py) reads ncu's raw CSV as decode_ncu writes
it: launches matched to token counts in order, units scaled to the record's, ncu's log lines and other kernels left
out, and a run with more launches than token counts refused rather than mislabelled."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import decode_ncu_summary as summary  # noqa: E402

HEADER = ('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_read.sum.per_second",'
          '"dram__throughput.avg.pct_of_peak_sustained_elapsed","launch__grid_size"\n'
          '"","","ns","byte","byte/s","%",""\n')  # the units ncu 2025 writes


def launch(i, name, us, mb, tbps, pct, grid):
    return f'"{i}","{name}","{us}","{mb}","{tbps}","{pct}","{grid}"\n'


def write_csv(tmp_path, *rows):
    path = tmp_path / "ncu.csv"
    path.write_text("==PROF== Connected to process 1\nprofiled: flash 1 tokens\n" + HEADER + "".join(rows))
    return str(path)


@pytest.mark.parametrize("l1,l2", [("moe_decode_l1", "moe_decode_l2"), ("moe_persistent_gemm", "moe_persistent_gemm")],
                         ids=["decode-kernels", "persistent"])
def test_launches_pair_with_token_counts_in_order(tmp_path, l1, l2):
    """Each token count's L1 then L2 launch, whether the kernels name their step (the decode kernels) or one kernel
    runs both (the persistent consumer as a layer launches it)."""
    path = write_csv(tmp_path,
                     launch(0, l1, "40,500", "100,700,000", "2,490,000,000,000", "51.2", "512"),
                     launch(1, "void deep_gemm::sm90_fp8_gemm_1d2d_impl<...>", "44", "100", "2.2", "46", "132"),
                     launch(2, l2, "20,000", "50,300,000", "2,500,000,000,000", "52", "512"),
                     launch(3, l1, "1,200,500", "436", "3.6", "75", "512"))
    rows = summary.summarise(summary.launches(path), [1, 8], "flash")
    assert [(r["tokens"], r["kernel"]) for r in rows] == [(1, "l1"), (1, "l2"), (8, "l1")]
    first = rows[0]
    assert first["us"] == pytest.approx(40.5) and first["dram_read_mb"] == pytest.approx(100.7)
    assert first["dram_read_tbps"] == pytest.approx(2.49) and first["dram_pct_of_peak"] == pytest.approx(51.2)
    assert rows[2]["us"] == pytest.approx(1200.5)  # thousands separators


def test_more_launches_than_token_counts_is_an_error(tmp_path):
    path = write_csv(tmp_path, launch(0, "moe_decode_l1", "1", "1", "1", "1", "1"),
                     launch(1, "moe_decode_l1", "1", "1", "1", "1", "1"))
    with pytest.raises(ValueError, match="more l1 launches"):
        summary.summarise(summary.launches(path), [1], "flash")


def test_an_unknown_unit_is_an_error(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"","","fortnight"\n"0","moe_decode_l1","3"\n')
    with pytest.raises(ValueError, match="unit 'fortnight'"):
        summary.summarise(summary.launches(str(path)), [1], "flash")


def test_the_record_has_the_result_keys(tmp_path):
    path = write_csv(tmp_path, launch(0, "moe_decode_l1", "40", "100", "2.5e12", "50", "512"),
                     launch(1, "moe_decode_l2", "20", "50", "2.5e12", "50", "512"))
    out = tmp_path / "out.json"
    env = {**os.environ, "CHUNKRING_COMMIT": "abc1234",
           "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(REPO / "scripts/decode_ncu_summary.py"), path, "--tokens", "1",
                    "--json", str(out)], check=True, capture_output=True, env=env)
    record = json.loads(out.read_text())
    for key in ("commit", "gpu", "gpus", "ranks", "suite", "command", "passed", "failed", "figures"):
        assert key in record
    assert record["suite"] == "decode-ncu" and record["passed"] == 2
    assert record["figures"]["flash_1_l1_dram_read_tbps"] == pytest.approx(2.5)
