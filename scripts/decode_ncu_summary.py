"""The decode path's Nsight Compute record: the raw CSV of scripts/gpu_suite.sh part ``decode_ncu`` (ncu --csv --page
raw over ``benchmarks.bench_decode --profile-once``) as a result file - per L1 and L2 launch, its time, DRAM bytes
read and achieved DRAM bandwidth, against the card's peak.

    python scripts/decode_ncu_summary.py CSV --tokens 1,8,32,128 --shape flash --json OUT.json [--gpu NAME]

The profiled script runs each token count's decode path once, L1 then L2, in the order of ``--tokens``: the n-th
L1 launch is the n-th token count's (DeepGEMM's path, which it also runs, does not match the kernel filter). The
persistent consumer, as a layer runs it, launches one kernel twice a call (L1, then L2); the decode kernels name
their steps (moe_decode_l1, moe_decode_l2).
"""

from __future__ import annotations

import argparse
import csv
import sys

#: The CSV's metrics (decode_ncu's --metrics) and the record's names for them, with the factor to the record's unit.
METRICS = {"gpu__time_duration.sum": ("us", 1e-3),  # ns
           "dram__bytes_read.sum": ("dram_read_mb", 1e-6),  # bytes
           "dram__bytes_read.sum.per_second": ("dram_read_tbps", 1e-12),  # bytes/s
           "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("dram_pct_of_peak", 1.0),
           "sm__warps_active.avg.pct_of_peak_sustained_active": ("warps_active_pct", 1.0),
           "launch__registers_per_thread": ("registers", 1.0),
           "launch__grid_size": ("grid", 1.0)}
#: What the units row may say for each metric: its scale to the unit METRICS assumes (ncu picks a readable unit).
UNITS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "nsecond": 1.0, "usecond": 1e3, "msecond": 1e6,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9,
         "byte/s": 1.0, "Kbyte/s": 1e3, "Mbyte/s": 1e6, "Gbyte/s": 1e9, "Tbyte/s": 1e12,
         "byte/second": 1.0, "Kbyte/second": 1e3, "Mbyte/second": 1e6, "Gbyte/second": 1e9, "Tbyte/second": 1e12,
         "%": 1.0, "register/thread": 1.0, "block": 1.0, "": 1.0}


def launches(path: str) -> list[dict[str, str]]:
    """The CSV's launch rows (the header row, a units row, then one row per launch), each with a ``units`` entry;
    ncu's own log lines (==PROF==, the profiled script's output) are left out."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    if not rows:
        return []
    units, data = rows[0], rows[1:]
    return [dict(row, units=units) for row in data]


def number(row: dict, metric: str) -> float:
    value = row[metric].replace(",", "")
    unit = row["units"].get(metric, "")
    if unit not in UNITS:
        raise ValueError(f"{metric}: unit {unit!r} not known")
    return float(value) * UNITS[unit]


#: The decode kernels' names -> their step; the persistent consumer's launches alternate L1, L2.
STEPS = {"moe_decode_l1": "l1", "moe_decode_l2": "l2"}
PERSISTENT = "moe_persistent_gemm"


def summarise(rows: list[dict[str, str]], tokens: list[int], shape: str) -> list[dict]:
    """One record per profiled launch: shape, tokens, kernel (its step: l1 or l2) and the METRICS in the record's
    units."""
    seen = {"l1": 0, "l2": 0}
    out = []
    for row in rows:
        name = row["Kernel Name"]
        if PERSISTENT in name:
            step: str | None = "l1" if seen["l1"] == seen["l2"] else "l2"
        else:
            step = next((s for kernel, s in STEPS.items() if kernel in name), None)
        if step is None:
            continue
        n = seen[step]
        seen[step] += 1
        if n >= len(tokens):
            raise ValueError(f"more {step} launches than token counts {tokens}")
        record = {"shape": shape, "tokens": tokens[n], "kernel": step}
        for metric, (name, factor) in METRICS.items():
            if metric in row:
                record[name] = number(row, metric) * factor
        out.append(record)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--tokens", default="1,8,32,128")
    parser.add_argument("--shape", default="flash")
    parser.add_argument("--json", required=True)
    parser.add_argument("--gpu", default=None, help="the card that ran (default: this machine's first GPU)")
    args = parser.parse_args()
    records_ = summarise(launches(args.csv), [int(t) for t in args.tokens.split(",")], args.shape)
    for r in records_:
        print(r)
    from chunkring.testing import records

    figures = {f"{r['shape']}_{r['tokens']}_{r['kernel']}_{k}": v for r in records_ for k, v in r.items()
               if isinstance(v, float)}
    records.write(args.json, suite="decode-ncu", world_size=1, figures=figures, records=records_,
                  passed=len(records_), failed=0 if records_ else 1, gpu=args.gpu)
    return 0 if records_ else 1


if __name__ == "__main__":
    sys.exit(main())
