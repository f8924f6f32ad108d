"""Every command README.md and docs/LAUNCHER.md show runs on the GPU at HEAD and ends with the status the documents
give it: the gpu_suite.sh `commands` part. tests/helpers/doc_commands.py lists them and says how each runs - a small
preset, at one rank and at 4 ranks under the launcher's own MPS daemon; here each runs in a folder of its own (holding
the hostfile ``hosts`` the dry runs name), no MPS daemon may outlive it, and its time is a figure of the record."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

import pytest

from tests.helpers.doc_commands import COMMANDS, REPO
from tests.helpers.processes import live_mps_daemons

#: Seconds a command may take (scripts/bench.sh runs five benchmark jobs and the input-check benchmark).
LIMIT_S = {"scripts/bench.sh": 900}
DEFAULT_LIMIT_S = 300



def cases() -> list:
    """Each command at each of its rank settings; a run the same as an earlier one (``bringup`` and ``--np 4 --mps
    bringup`` are the same at one rank) runs once."""
    out, seen = [], set()
    for command in COMMANDS:
        for variant in command.variants or (None,):
            run = (tuple(command.argv(variant)), command.env)
            if run not in seen:
                seen.add(run)
                out.append(pytest.param(command, variant, id=f"{command.name}-{variant or 'once'}"))
    return out


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.mark.gpu
@pytest.mark.parametrize("command, variant", cases())
def test_a_documented_command_ends_as_the_docs_say(command, variant, tmp_path, record_testsuite_property, capsys):
    if command.skip:
        pytest.skip(command.skip)
    argv = command.argv(variant)
    if argv[0].startswith("scripts/"):
        argv[0] = str(REPO / argv[0])
    (tmp_path / "hosts").write_text("localhost slots=16\n")
    # A small preset's benchmark records stay out of the results the benchmarks keep.
    env = {**os.environ, **dict(command.env), "BENCH_RESULTS": str(tmp_path / "bench")}
    limit = LIMIT_S.get(command.shown, DEFAULT_LIMIT_S)
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # chunkring-launch forwards it to every rank and stops its MPS daemon
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{shlex.join(argv)} ran past {limit} s:\n{tail(out)}")
    seconds = round(time.monotonic() - start, 1)
    record_testsuite_property(f"{command.name}_{variant or 'once'}_s", seconds)
    with capsys.disabled():  # at once, uncaptured: the log of a run cut short still says what ended, and when
        print(f"\n{shlex.join(argv)}: status {proc.returncode} in {seconds} s", flush=True)
    print(out)
    assert proc.returncode == command.status, (f"{shlex.join(argv)} ended with status {proc.returncode}; the docs "
                                               f"say {command.status}:\n{tail(out)}")
    deadline = time.monotonic() + 10  # a daemon told to quit may take a moment to exit
    while live_mps_daemons() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_mps_daemons() == [], f"an MPS daemon outlived {shlex.join(argv)}"
