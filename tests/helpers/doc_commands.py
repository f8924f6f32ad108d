"""Every command README.md and docs/LAUNCHER.md show, and how the GPU suite's ``commands`` part runs each: the one
list (:data:`COMMANDS`) that tests/commands/test_doc_commands.py runs on a GPU and
tests/unit/test_documented_commands.py holds against the documents (a command shown there but missing here fails CI,
and so does an entry no document shows).

What a document shows: each line of its ``bash`` code blocks (its ``# comment`` apart) and each example of
LAUNCHER.md's jobs table; an entry may also name a command shown inline in backticks (``scripts/main.sh --dry-run``).
Each runs at a small preset - keys appended after the command's own, so they win - once with one rank and once
with :data:`MPS_RANKS` ranks sharing the GPU under the launcher's MPS daemon (the command's own ``--np``/``--mps``
replaced), and must end with the status the document gives it (``status 5`` in its comment), else 0."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMMANDS", "DOCS", "MPS_RANKS", "VARIANTS", "DocCommand", "documented_commands", "documented_status",
           "shown_inline"]

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/LAUNCHER.md")
#: Ranks of the variant that shares one GPU under MPS (scripts/gpu_suite.sh's default).
MPS_RANKS = 4
#: The rank settings each command runs with: one rank, and MPS_RANKS ranks under the launcher's own MPS daemon.
VARIANTS = {"1rank": ("--np", "1"), f"{MPS_RANKS}rank-mps": ("--np", str(MPS_RANKS), "--mps")}

#: Small presets by job: each run takes seconds.
RUN_KEYS = ("num_experts=16", "hidden=1024", "intermediate=512", "tokens_per_rank=128", "iterations=2", "warmup=1")
BENCH_KEYS = ("tokens=128", "chunks=128", "trace=", "iterations=2", "warmup=1", "rotate=1")
STRESS_KEYS = ("iterations=12",)  # past the preset's chaos_iteration (10), which the config checks
SOAK_KEYS = ("duration_s=5",)  # the soaks' own iterations=0: a run of duration_s seconds


@dataclass(frozen=True)
class DocCommand:
    """One documented command and how the ``commands`` part runs it.

    ``shown``: as the document shows it. ``keys``: appended at both rank counts; ``keys_1rank``: also at one
    rank. ``status``: what it must end with. ``variants``: the rank settings it runs at (none: it is not a launch,
    or the command sets its own ranks). ``env``: extra environment. ``skip``: why it does not run on the GPU host."""

    shown: str
    keys: tuple[str, ...] = ()
    keys_1rank: tuple[str, ...] = ()
    status: int = 0
    variants: tuple[str, ...] = tuple(VARIANTS)
    env: tuple[tuple[str, str], ...] = ()
    skip: str = ""

    @property
    def name(self) -> str:
        """A short id: the command's words in lower case, joined by underscores."""
        return re.sub(r"[^a-z0-9]+", "_", self.shown.lower()).strip("_")

    def argv(self, variant: str | None) -> list[str]:
        """What runs: the command with ``variant``'s rank options in place of its own, then the small preset."""
        words = shlex.split(self.shown)
        if variant is None:
            return words
        rest, skip_next = [], False
        for word in words[1:]:
            if skip_next:
                skip_next = False
            elif word == "--np":
                skip_next = True
            elif word != "--mps":
                rest.append(word)
        keys = self.keys + (self.keys_1rank if variant == "1rank" else ())
        return [words[0], *VARIANTS[variant], *rest, *keys]


CHAOS_1RANK = ("chaos_rank=0",)  # the preset's rank 1 exists only with several ranks
CPU_RECIPE = "the CPU install recipe: it needs PyPI and PyTorch's CPU index, and the GPU host is offline"

COMMANDS: tuple[DocCommand, ...] = (
    # README, "The two commands" and the text around them
    DocCommand("scripts/main.sh", keys=RUN_KEYS),
    DocCommand("scripts/test.sh", variants=(), skip="the CPU suite: CI runs it (.ci/run); it installs from PyPI"),
    DocCommand("scripts/main.sh --dry-run"),
    DocCommand("scripts/main.sh doctor", variants=()),
    # README, "What a machine needs": installing on a machine without a GPU
    DocCommand("python3 -m venv .venv && . .venv/bin/activate", variants=(), skip=CPU_RECIPE),
    DocCommand("pip install torch --index-url https://download.pytorch.org/whl/cpu", variants=(), skip=CPU_RECIPE),
    DocCommand("pip install -e '.[test]'", variants=(), skip=CPU_RECIPE),
    # README, "Launching jobs"
    DocCommand("chunkring-launch run", keys=RUN_KEYS),
    DocCommand("chunkring-launch --np 4 --mps run topk=8", keys=RUN_KEYS),
    DocCommand("chunkring-launch bench", keys=BENCH_KEYS),
    DocCommand("scripts/bench.sh", variants=(), env=(("BENCH_KEYS", " ".join(BENCH_KEYS)),)),
    DocCommand("chunkring-launch --np 4 --mps stress", keys=STRESS_KEYS),
    DocCommand("chunkring-launch --np 4 --mps stress --config chaos", keys_1rank=CHAOS_1RANK, status=5),
    DocCommand("chunkring-launch bringup"),
    DocCommand("chunkring-launch --np 4 --mps bringup"),
    DocCommand("chunkring-launch bringup rounds=32"),
    DocCommand("chunkring-launch --dry-run --np 16 --hostfile hosts bringup"),
    DocCommand("chunkring-launch doctor", variants=()),
    # docs/LAUNCHER.md, the jobs table
    DocCommand('chunkring-launch --np 4 --mps run topk=8 payload="bf16"', keys=RUN_KEYS),
    DocCommand("chunkring-launch --np 4 --mps stress iterations=0 duration_s=300", keys=SOAK_KEYS),
    DocCommand("chunkring-launch bench tokens=512 chunks=32,64,128,256 trace=512:256",
               keys=("iterations=2", "warmup=1", "rotate=1")),
    # docs/LAUNCHER.md, "stress"
    DocCommand("chunkring-launch --np 4 --mps stress iterations=0 duration_s=600 --timeout 900", keys=SOAK_KEYS),
    DocCommand("chunkring-launch --np 4 --mps stress --config chaos chaos=delay", keys_1rank=CHAOS_1RANK),
    # docs/LAUNCHER.md, "Two nodes"
    DocCommand("chunkring-launch --dry-run --np 16 --hostfile hosts --npernode 8 --ifname eth0 run"),
    DocCommand("chunkring-launch --np 16 --hostfile hosts --npernode 8 --ifname eth0 run", variants=(),
               skip="two nodes of 8 GPUs (docs/LAUNCHER.md: not yet run on two nodes)"),
)


def _doc(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def documented_commands() -> dict[str, list[str]]:
    """Every command the documents show, each with its comments (one per place shown: '' where it has none): the
    lines of their bash code blocks and the examples of LAUNCHER.md's jobs table."""
    found: dict[str, list[str]] = {}
    for name in DOCS:
        for block in re.findall(r"^```bash\n(.*?)^```", _doc(name), re.MULTILINE | re.DOTALL):
            for line in block.splitlines():
                command, _, comment = line.partition(" #")
                if command.strip():
                    found.setdefault(command.strip(), []).append(comment.strip())
    jobs_table = re.findall(r"^\| `\w+` \|.*\| `(chunkring-launch .+)` \|$", _doc("docs/LAUNCHER.md"), re.MULTILINE)
    for command in jobs_table:
        found.setdefault(command, []).append("")
    return found


def documented_status(comment: str) -> int:
    """The exit status a command's comment gives (``status 5``), else 0."""
    match = re.search(r"\bstatus (\d+)\b", comment)
    return int(match[1]) if match else 0


def shown_inline(command: str) -> bool:
    """Whether a document shows ``command`` in backticks."""
    return any(f"`{command}`" in _doc(name) for name in DOCS)
