"""Draw a Chrome trace written by chunkring's ``write_chrome_trace`` as a PNG: one row per (rank, lane),
a bar per span coloured by its family, a tick per instant event, time in microseconds.

    python scripts/plot_timeline.py TRACE.json -o OUT.png [--title T]
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or GPU hosts
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

# Span families (a trace event's "cat") and their colours; drain and reduce are the tail of a call.
SPAN_COLOURS = {
    "produce": "tab:blue",
    "wait": "lightgrey",
    "pull": "tab:orange",
    "experts": "tab:green",
    "combine": "tab:purple",
    "drain": "tab:brown",
    "reduce": "peru",
}
INSTANT_COLOURS = {"ack": "black", "call": "tab:cyan", "unpaired": "red", "unknown": "magenta"}
OTHER_COLOUR = "tab:gray"
BAR_HEIGHT = 0.6


def family_of(event: dict) -> str:
    """The event's family: its "cat", else the first word of its name ("produce 3" -> "produce")."""
    return event.get("cat") or event["name"].split(" ")[0]


def row_labels(events: list[dict]) -> dict[tuple, str]:
    """(pid, tid) -> "rank r / lane", from the process_name and thread_name metadata events; rows
    without metadata keep their ids."""
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    rows = set(lanes) | {(e["pid"], e["tid"]) for e in events if e.get("ph") in ("X", "i")}
    return {row: f"{process.get(row[0], f'pid {row[0]}')} / {lanes.get(row, f'tid {row[1]}')}" for row in sorted(rows)}


def draw(ax, events: list[dict], rows: dict[tuple, str]) -> set[str]:
    """Bars and ticks on ``ax``, one row per entry of ``rows`` (first at the top); returns the families drawn."""
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    drawn = set()
    for event in events:
        if event.get("ph") not in ("X", "i"):
            continue
        family, y = family_of(event), y_of[(event["pid"], event["tid"])]
        if event["ph"] == "X":
            ax.broken_barh([(event["ts"], event["dur"])], (y - BAR_HEIGHT / 2, BAR_HEIGHT),
                           facecolors=SPAN_COLOURS.get(family, OTHER_COLOUR), edgecolor="white", linewidth=0.3)
        else:
            ax.vlines(event["ts"], y - BAR_HEIGHT / 2, y + BAR_HEIGHT / 2,
                      colors=INSTANT_COLOURS.get(family, OTHER_COLOUR), linewidth=0.8)
        drawn.add(family)
    ax.set_yticks([y_of[row] for row in rows], list(rows.values()))
    ax.set_ylim(-0.5 - BAR_HEIGHT / 2, len(rows) - 0.5 + BAR_HEIGHT / 2)
    return drawn


def legend_handles(families: set[str]) -> list:
    """Legend entries in a fixed order: spans first, then instants, then families the plot did not know."""
    handles = [Patch(color=colour, label=name) for name, colour in SPAN_COLOURS.items() if name in families]
    handles += [Line2D([], [], color=colour, label=name) for name, colour in INSTANT_COLOURS.items()
                if name in families]
    handles += [Patch(color=OTHER_COLOUR, label=name) for name in sorted(families - SPAN_COLOURS.keys()
                                                                         - INSTANT_COLOURS.keys())]
    return handles


def plot(trace: dict, out: str, title: str) -> None:
    events = trace.get("traceEvents", [])
    rows = row_labels(events)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.5 * max(len(rows), 1)))
    try:
        families = draw(ax, events, rows)
        ax.set_xlabel("time (µs)")
        ax.set_title(title)
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
        if families:
            ax.legend(handles=legend_handles(families), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        fig.savefig(out, dpi=150, bbox_inches="tight")
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="Chrome trace JSON from chunkring.moe.timeline.write_chrome_trace")
    parser.add_argument("-o", "--out", required=True, help="the PNG to write")
    parser.add_argument("--title", help="plot title (default: the trace's file name)")
    args = parser.parse_args(argv)
    trace = json.loads(Path(args.trace).read_text())
    plot(trace, args.out, args.title or Path(args.trace).name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
