"""The progress bar: rank 0's marker lines round-trip, reporting is off unless enabled and on rank 0,
updates are throttled, and the launcher's bar stays below other output."""

import io

from chunkring_launch import progress
from chunkring_launch.progress import Progress, TerminalBar, parse_marker, render


def test_marker_lines_round_trip():
    out = io.StringIO()
    Progress("stress", total=10, stream=out, min_interval_s=0).update(3, "max rel err 1e-3")
    state = parse_marker(out.getvalue())
    assert (state["label"], state["done"], state["total"], state["note"]) == ("stress", 3, 10, "max rel err 1e-3")
    assert parse_marker("Traceback (most recent call last):\n") is None
    assert parse_marker(progress.MARKER + "{not json\n") is None


def test_reports_only_when_enabled_and_on_rank_zero(capsys):
    progress.enable(False)
    progress.progress("x", 0, total=2).close(2)
    progress.enable(True)
    try:
        progress.progress("x", 1, total=2).close(2)
        assert capsys.readouterr().err == ""
        progress.progress("x", 0, total=2).close(2)
        assert parse_marker(capsys.readouterr().err)["done"] == 2
    finally:
        progress.enable(False)


def test_updates_are_throttled_but_close_always_reports():
    out = io.StringIO()
    bar = Progress("x", total=100, stream=out, min_interval_s=3600)
    for done in range(1, 100):
        bar.update(done)
    bar.close(100)
    assert [parse_marker(line)["done"] for line in out.getvalue().splitlines()] == [1, 100]


def test_render_by_count_and_by_duration():
    line = render({"label": "stress", "done": 5, "total": 20, "elapsed_s": 2.0})
    assert line.startswith("stress [") and " 25%" in line and "5/20" in line and "eta 6 s" in line
    timed = render({"label": "soak", "done": 7, "duration_s": 10.0, "elapsed_s": 5.0})
    assert " 50%" in timed and "7 it" in timed
    assert "100%" in render({"done": 30, "total": 20, "elapsed_s": 1.0})  # never past full


def test_terminal_bar_keeps_other_output_above_it():
    out = io.StringIO()
    bar = TerminalBar(out)
    bar.draw({"label": "x", "done": 1, "total": 2, "elapsed_s": 0.1})
    bar.write_above("a rank's line\n")
    bar.finish()
    text = out.getvalue()
    assert "a rank's line\n" in text and text.endswith("\n")
    assert text.count("x [") == 2  # drawn, then redrawn below the line
