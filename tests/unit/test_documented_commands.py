"""The GPU suite's ``commands`` part runs what the documents show (tests/helpers/doc_commands.py, run by
tests/commands/): every command of README.md's and docs/LAUNCHER.md's bash blocks and jobs table is in its list,
nothing in the list is shown nowhere, each is expected to end with the status its comment gives, and each run it
makes - the command at one rank and at 4 under MPS, with its small preset - passes the launcher's checks here (a
dry run on a stand-in machine), so a bad key fails CI, not a GPU run."""

from __future__ import annotations

import re

import pytest

from tests.helpers.doc_commands import (
    COMMANDS,
    DOCS,
    REPO,
    DocCommand,
    documented_commands,
    documented_status,
    shown_inline,
)
from tests.helpers.launch_machine import stand_in_machine

LISTED = {command.shown: command for command in COMMANDS}


def test_every_documented_command_is_listed():
    documented = documented_commands()
    assert len(documented) >= 15 and "chunkring-launch --np 4 --mps stress --config chaos" in documented
    missing = sorted(set(documented) - set(LISTED))
    assert not missing, f"shown in {DOCS} but not run by the commands part (tests/helpers/doc_commands.py): {missing}"


def test_every_listed_command_is_documented():
    documented = documented_commands()
    stale = [shown for shown in LISTED if shown not in documented and not shown_inline(shown)]
    assert not stale, f"listed but shown in no document: {stale}"
    assert len(LISTED) == len(COMMANDS), "a command listed twice"


@pytest.mark.parametrize("shown, comment", sorted((shown, comment) for shown, comments in
                                                   documented_commands().items() for comment in comments))
def test_each_command_ends_as_its_comment_says(shown, comment):
    assert LISTED[shown].status == documented_status(comment), comment


def test_the_chaos_kill_is_expected_to_end_with_status_5():  # not vacuous: the comments do name statuses
    assert {c.shown: c.status for c in COMMANDS if c.status} == {
        "chunkring-launch --np 4 --mps stress --config chaos": 5}


def launches() -> list:
    """Each run of a launcher command (chunkring-launch, or scripts/main.sh, which hands it its arguments) the part
    makes, but the doctor's (which takes no keys and checks this machine) and those not run on the GPU host."""
    out = []
    for command in COMMANDS:
        for variant in command.variants or (None,):
            argv = command.argv(variant)
            if not command.skip and argv[0] in ("chunkring-launch", "scripts/main.sh") and "doctor" not in argv:
                out.append(pytest.param(argv[1:], id=f"{command.name}-{variant or 'once'}"))
    return out


@pytest.mark.parametrize("args", launches())
def test_each_run_passes_the_launchers_checks(args, tmp_path, monkeypatch, capsys):
    from chunkring_launch import cli

    stand_in_machine(monkeypatch, tmp_path, gpus=1)
    status = cli.main(["--dry-run", *args])
    assert status == 0, capsys.readouterr().err


@pytest.mark.parametrize("preset", ["bench", "bench_v3"])
def test_bench_sh_takes_the_small_preset(preset, tmp_path, monkeypatch, capsys):
    """scripts/bench.sh hands BENCH_KEYS to each of its runs, last: they must fit its presets."""
    from chunkring_launch import cli

    (bench_sh,) = [c for c in COMMANDS if c.shown == "scripts/bench.sh"]
    keys = dict(bench_sh.env)["BENCH_KEYS"].split()
    assert "${BENCH_KEYS:-}" in (REPO / "scripts" / "bench.sh").read_text()
    assert f"--config {preset}" in (REPO / "scripts" / "bench.sh").read_text()
    stand_in_machine(monkeypatch, tmp_path, gpus=1)
    assert cli.main(["--dry-run", "--np", "4", "--mps", "bench", "--config", preset, *keys]) == 0, \
        capsys.readouterr().err


def test_the_gpu_suite_runs_the_part():
    text = (REPO / "scripts" / "gpu_suite.sh").read_text()
    parts = re.search(r"^all_parts=\((.*?)\)$", text, re.MULTILINE | re.DOTALL)[1].split()
    assert {"commands", "commands_1rank", "commands_4rank"} <= set(parts)
    assert re.search(r"^commands_part\(\) \{.*python3 -m pytest tests/commands ", text, re.MULTILINE | re.DOTALL)


def test_a_variant_replaces_the_commands_own_ranks():
    command = DocCommand("chunkring-launch --np 4 --mps stress --config chaos", keys=("a=1",), keys_1rank=("b=2",))
    assert command.argv("1rank") == ["chunkring-launch", "--np", "1", "stress", "--config", "chaos", "a=1", "b=2"]
    assert command.argv("4rank-mps") == ["chunkring-launch", "--np", "4", "--mps", "stress", "--config", "chaos",
                                         "a=1"]
    assert command.argv(None) == ["chunkring-launch", "--np", "4", "--mps", "stress", "--config", "chaos"]
