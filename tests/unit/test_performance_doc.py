"""docs/PERFORMANCE.md and the README's performance sentences state what a record holds and name it: every
record path they name (a `benchmarks/results/` or `tests/gpu_results/` file, `*` for a set of them) exists, and
the card each named record ran on (its `gpu`) is named beside it, in the same paragraph or table."""

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = ("docs/PERFORMANCE.md", "README.md")
#: A record's path as the docs write it: the folder, then the file name (a `*` stands for several files).
RECORD = re.compile(r"(?:benchmarks/results|tests/gpu_results)/[A-Za-z0-9_.+*-]+\.(?:json|txt|csv|png)")
#: The card's short name in a record's `gpu` ("NVIDIA H100 80GB HBM3" -> "H100").
CARD = re.compile(r"\b[A-Z]\d{2,4}\b")


def blocks(text):
    """Paragraphs, list items and tables split at blank lines; a table goes with the paragraph above it, which
    introduces it."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        is_table = all(line.lstrip().startswith("|") for line in block.strip().splitlines())
        if is_table and out:
            out[-1] += "\n" + block
        else:
            out.append(block)
    return out


def named(text):
    return sorted(set(RECORD.findall(text)))


def test_the_patterns():
    text = "see `benchmarks/results/1ab6fed-decode.json`, H200, and tests/gpu_results/c247571-run-*.json."
    assert named(text) == ["benchmarks/results/1ab6fed-decode.json", "tests/gpu_results/c247571-run-*.json"]
    assert CARD.findall("NVIDIA H100 80GB HBM3") == ["H100"] and CARD.findall("NVIDIA H200") == ["H200"]
    assert blocks("intro\n\n| a |\n| b |\n\nnext") == ["intro\n| a |\n| b |", "next"]


def test_every_record_the_docs_name_exists():
    missing = [f"{doc}: {path}" for doc in DOCS for path in named((REPO / doc).read_text())
               if not list(REPO.glob(path))]
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)
    assert len(named((REPO / "docs/PERFORMANCE.md").read_text())) >= 20  # the figures name their records


def test_each_named_record_has_its_card_beside_it():
    unnamed = []
    for doc in DOCS:
        for block in blocks((REPO / doc).read_text()):
            for path in named(block):
                for record in sorted(REPO.glob(path)):
                    if record.suffix != ".json":
                        continue
                    gpu = json.loads(record.read_text()).get("gpu") or ""
                    cards = CARD.findall(gpu)
                    if cards and not any(card in block for card in cards):
                        unnamed.append(f"{doc}: {record.relative_to(REPO)} ran on {gpu!r}; the text beside it "
                                       f"names no {'/'.join(cards)}")
    assert not unnamed, "\n".join(sorted(set(unnamed)))
