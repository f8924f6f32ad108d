"""Write one JSON summary of a GPU suite run from its JUnit XML file(s) and the kernel build reports."""

import argparse
import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

from chunkring.testing import records


def junit_counts(path: str) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in total:
            total[key] += int(suite.get(key, 0))
    failed = total["failures"] + total["errors"]
    return {"passed": total["tests"] - failed - total["skipped"], "failed": failed, "skipped": total["skipped"]}


def junit_figures(path: str) -> dict:
    """Numeric test-suite properties (pytest's ``record_testsuite_property``): figures tests report."""
    figures = {}
    for prop in ET.parse(path).getroot().iter("property"):
        try:
            figures[prop.get("name")] = float(prop.get("value"))
        except (TypeError, ValueError):
            pass
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--suite", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--rc", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--junit", nargs="*", default=[])
    parser.add_argument("--build", nargs="*", default=[])
    parser.add_argument("--command", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from chunkring.jit import nvshmem_version

    per_rank = [junit_counts(p) for p in sorted(args.junit) if Path(p).is_file()]
    counts = per_rank[0] if per_rank else {"passed": 0, "failed": 0, "skipped": 0}
    # Every rank runs the same tests: report rank 0's counts, but any rank's failure counts.
    counts["failed"] = max([c["failed"] for c in per_rank] + [0 if args.rc == 0 else max(1, counts["failed"])])
    figures = {"suite_seconds": args.seconds}
    for path in sorted(args.junit):
        if Path(path).is_file():
            figures.update(junit_figures(path))
    # Each build report (scripts/build_kernels.py --json) as it was, cache_hit included: a "cold" build that
    # found its cubins in the cache timed a cache lookup, not a compile.
    builds = {}
    for path in args.build:
        if Path(path).is_file():
            tag = Path(path).stem
            builds[tag] = {}
            for kernel, info in json.loads(Path(path).read_text()).items():
                figures[f"{tag}_{kernel}_s"] = info["seconds"]
                builds[tag][kernel] = {"seconds": info["seconds"], "cache_hit": info.get("cache_hit")}
    summary = {
        **records.header(suite=args.suite, ranks=args.ranks, command=args.command, **counts),
        "exit_status": args.rc,
        "ranks_reporting": len(per_rank),
        "nvshmem": nvshmem_version(),
        # How the suite's rings reached their peers: "rma" when forced (CHUNKRING_TRANSPORT or pytest
        # --transport rma, also in figures["transport_rma"]), "auto" otherwise.
        "transport": "rma" if figures.get("transport_rma") == 1.0 else os.environ.get("CHUNKRING_TRANSPORT", "auto"),
        "figures": figures,
        "builds": builds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
