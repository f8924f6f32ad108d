"""Write benchmarks/results/README.md and tests/gpu_results/README.md from the JSON records beside them.

    python scripts/results_index.py            # rewrite both indexes
    python scripts/results_index.py --check    # exit 1 when an index differs from what the records give

Each index is a fixed preamble (what the records are, how to reproduce them) and one table row per record.
The records are the history: the index only lists them, so it cannot say more than they do. Standard
library only: it runs where torch does not.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python scripts/results_index.py"

#: Figures worth a column, in order: the first four a record has are shown. One pattern per figure name.
HEADLINES = [
    # the main job, launcher stress, bring-up
    r"rank0_batch_ms", r"rank0_streamed_ms", r"rank0_streamed_over_batch", r"rank0_batch_rel_error",
    r"rank0_max_rel_error", r"rank0_pingpong_rtt_us", r"rank0_ring_pass_ms_per_round",
    # ring latency, ack cost, input checks
    r"raw_signal_one_way_us", r"publish_observe_us", r"slot_round_trip_us",
    r"ack_swap_mean_us", r"ack_swap_max_us", r"owner_ack_wait_us", r"round_trip_us",
    r"pull_checked_us", r"pull_unchecked_us", r"checks_us_per_step", r"checks_share_of_pull",
    # test suites
    r"mutants_caught", r"mutants_xfail", r"(litmus_violations_no_acquire_fence|no_acquire_fence_litmus_violations)",
    r"abort_report_ms_max", r"fuzz_cases_per_run", r"stuck_source", r"stuck_seq", r"watchdog_s",
    r"lifetime_device_free_drift_mib_rank0", r"lifetime_heap_bytes_after_rank0", r"device_streamed_report_ms_rank0",
    # chunkring-launch bench (2,048 tokens), the overlap bench, the producer probe
    r"rank0_n2048_c\d+_batch_ms", r"rank0_n2048_c(256|512|1024)_streamed_over_batch",
    r"flash_n2048_(w1_)?default_batch_ms", r"flash_n2048_(w1_)?default_streamed_ms",
    r"flash_n2048_(w1_)?best_streamed_ms", r"flash_n2048_w4_default_streamed_ms",
    r"gemm_fp32_us_chunk128", r"gemm_bf16_us_chunk128", r"produce_us_e4096_chunk128",
    r"produce_us_all_slots_chunk128",
    # against MegaMoE, the consumer's breakdown
    r"flash_1024_chunkring_over_megamoe", r"flash_8192_chunkring_over_megamoe", r"flash_8192_chunkring_ms",
    r"flash_8192_megamoe_ms", r"8192_call_ms", r"8192_experts_ms", r"8192_plan_ms",
    # the weight-read probe (its best case at 6 and 26 experts, and the plain loads beside it)
    r"e6_best_tbps", r"e26_best_tbps", r"e26_best_pct_peak", r"e26_plain_tbps",
    # eager calls (1 token: replayed against its graph and MegaMoE's eager call), the persistent consumer (8 tokens)
    r"flash_1_batch_host_issue_ms", r"flash_1_batch_eager_over_graph", r"flash_1_batch_eager_over_megamoe_eager",
    r"8_persistent_ms", r"8_persistent_pct_peak", r"8_persistent_over_deepgemm",
]
MAX_HEADLINES = 4
WALL_KEYS = ("suite_seconds", "suite_seconds_max_rank", "job_seconds", "rank0_wall_s")

FLAGS = """Newest commit first. Flags:
- `tree: modified`: the record says the tree that ran differed from its commit.
- `commit: not in this history`: the commit is not an ancestor of the indexed commit (a measured branch that did
  not land, or a tree no branch keeps); its note says which.
- `cold build: cache hit`: every "cold" kernel build found its cubin in the cache; its seconds time a lookup.
- `build cache_hit: not recorded`: the record predates `builds`; its cold build seconds may be lookups (0 s ones are).
- `incomplete`: the run was cut before its end.
- `see note`: the record's `note` changes how it reads."""



#: Each index's folder and its preamble: what the records are and how to reproduce them (reference, not history).
PREAMBLES = Path(__file__).resolve().parent / "results_preambles"
INDEXES = {"benchmarks/results": PREAMBLES / "benchmarks_results.md",
           "tests/gpu_results": PREAMBLES / "tests_gpu_results.md"}


def is_shallow(repo: Path = REPO) -> bool:
    """Whether ``repo`` is a shallow clone: it lacks the history that says which records' commits are HEAD's."""
    out = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=repo, capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "true"


def git_commit_time(repo: Path = REPO) -> Callable[[str], int | None]:
    """``commit -> committer time``, or None when the commit is not an ancestor of ``repo``'s HEAD.

    Only HEAD's history counts, so that the index is the same in every clone of one commit: a clean clone
    holds no other branch, and a record of a measured branch must read the same there as here.
    """
    cache: dict[str, int | None] = {}

    def commit_time(commit: str) -> int | None:
        if commit not in cache:
            ref = f"{commit}^{{commit}}"
            known = subprocess.run(["git", "merge-base", "--is-ancestor", ref, "HEAD"], cwd=repo,
                                   capture_output=True).returncode == 0
            out = subprocess.run(["git", "show", "-s", "--format=%ct", ref], cwd=repo, capture_output=True,
                                 text=True) if known else None
            cache[commit] = int(out.stdout.strip()) if out is not None and out.returncode == 0 else None
        return cache[commit]

    return commit_time


def load(folder: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """The records (JSON objects with a ``commit``) by file name, and every other file's name."""
    records, others = [], []
    for path in sorted(folder.iterdir()):
        if path.name == "README.md" or not path.is_file():
            continue
        data = json.loads(path.read_text()) if path.suffix == ".json" else None
        if isinstance(data, dict) and "commit" in data:
            records.append((path.name, data))
        else:
            others.append(path.name)
    return records, others


def number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def headlines(figures: dict) -> list[tuple[str, float]]:
    numeric = {k: v for k, v in sorted(figures.items()) if isinstance(v, int | float) and not isinstance(v, bool)}
    chosen: list[tuple[str, float]] = []
    for pattern in HEADLINES:
        name = next((k for k in numeric if re.fullmatch(pattern, k) and k not in dict(chosen)), None)
        if name is not None:
            chosen.append((name, numeric[name]))
        if len(chosen) == MAX_HEADLINES:
            break
    return chosen


def flags(record: dict, commit_known: bool) -> list[str]:
    out = []
    if record.get("tree_modified") is True:
        out.append("tree: modified")
    elif "tree_modified" not in record:
        out.append("tree: not recorded")  # written before records kept it: the commit alone may not be the tree
    if not commit_known:
        out.append("commit: not in this history")
    cold = [info.get("cache_hit") for tag, kernels in record.get("builds", {}).items() if "cold" in tag
            for info in kernels.values()]
    if cold and all(hit is True for hit in cold):
        out.append("cold build: cache hit")
    elif any(hit is True for hit in cold):
        out.append(f"cold build: {sum(hit is True for hit in cold)} of {len(cold)} cached")
    elif "builds" not in record and any(k.startswith("build_") for k in record.get("figures", {})):
        out.append("build cache_hit: not recorded")
    if record.get("incomplete"):
        out.append("incomplete")
    if record.get("note"):
        out.append("see note")
    return out


def row(name: str, record: dict, commit_known: bool) -> str:
    figures = record.get("figures", {})
    wall = next((number(figures[k]) for k in WALL_KEYS if isinstance(figures.get(k), int | float)), "")
    counts = " / ".join(str(record.get(k, "")) for k in ("passed", "failed", "skipped"))
    heads = "; ".join(f"`{k}` {number(v)}" for k, v in headlines(figures))
    cells = [f"`{name}`", str(record["commit"]), str(record.get("suite", "")), str(record.get("ranks", "")),
             str(record.get("gpu", "")), counts, wall, heads, ", ".join(flags(record, commit_known))]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def render(folder: Path, preamble: str, commit_time: Callable[[str], int | None]) -> str:
    """The index of ``folder``: the preamble, then its records, newest commit first (unknown commits last)."""
    records, others = load(folder)
    times = {name: commit_time(str(rec["commit"])) for name, rec in records}
    records.sort(key=lambda item: (times[item[0]] is None, -(times[item[0]] or 0), item[0]))
    lines = [preamble.split("\n", 1)[0], "",
             f"<!-- Generated by `{COMMAND}` from the JSON files in this folder; do not edit. -->", "",
             preamble.split("\n", 1)[1].strip(), "", "## Records", "",
             FLAGS, "",
             "| file | commit | suite | ranks | gpu | passed / failed / skipped | wall s | headline figures | flags |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [row(name, rec, times[name] is not None) for name, rec in records]
    if others:
        lines += ["", "Beside them (no record): " + ", ".join(f"`{name}`" for name in others) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if an index is stale")
    args = parser.parse_args(argv)
    if is_shallow():
        print("results_index: a shallow clone cannot tell which commits are in HEAD's history; fetch the whole "
              "history (git fetch --unshallow) and run again", file=sys.stderr)
        return 2
    commit_time = git_commit_time()
    stale = []
    for folder, preamble in INDEXES.items():
        index = REPO / folder / "README.md"
        text = render(REPO / folder, preamble.read_text(), commit_time)
        if index.is_file() and index.read_text() == text:
            continue
        stale.append(str(index.relative_to(REPO)))
        if not args.check:
            index.write_text(text)
    verb = "stale" if args.check else "written"
    for name in stale:
        print(f"{name}: {verb}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
