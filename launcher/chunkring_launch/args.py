"""The command line of ``chunkring-launch``: its options, their checks, and ``JOB --help``'s table of the
job's keys. Reading it imports no torch, CUDA, NVSHMEM or MPI module, so ``--help`` and a usage error
answer at once."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from chunkring.errors import ChunkringError

from .config import load_table
from .jobs import JOBS

__all__ = ["DESCRIPTION", "EPILOG", "job_keys_help", "parse_args", "under_mpi"]

#: --timeout when not given (seconds).
DEFAULT_TIMEOUT_S = 600
#: The job of a command line that names none (scripts/main.sh's, README's "main job").
DEFAULT_JOB = "run"
#: Options of the launch itself (mpirun, MPS, the deadline): inside an MPI job there is none to shape.
LAUNCH_OPTIONS = ("--np", "--mps", "--hostfile", "--host", "--npernode", "--ifname", "--timeout", "--dry-run")

DESCRIPTION = "Start a chunkring job on the local GPUs, one process per rank, through mpirun."

EPILOG = """\
    chunkring-launch run                              # the MoE layer, checked and timed (one rank per GPU)
    chunkring-launch --np 4 --mps stress iterations=0 duration_s=60   # 4 ranks on one GPU (MPS), randomised calls
    chunkring-launch --np 4 --mps stress --config chaos  # one rank killed on purpose: must end with status 5
    chunkring-launch bringup rounds=32                # override config keys (typed, checked)
    chunkring-launch --dry-run --np 8 --hostfile hosts bringup   # print the mpirun command and environment
    chunkring-launch --np 16 --hostfile hosts --npernode 8 --ifname eth0 run   # two nodes of 8 GPUs
    chunkring-launch doctor                           # check GPUs, driver, packages, compiler, MPI, MPS

Jobs: bringup (NVSHMEM signals/atomics check), run (the MoE layer, batch-ready and streamed, checked and
timed; the job of a command line that names none), stress (many randomised calls, each checked; optional
delays and chaos), doctor (this machine).
`chunkring-launch JOB --help` lists the job's keys with their preset values; docs/LAUNCHER.md explains them.
Inside an existing MPI job (``mpirun ... chunkring-launch JOB``) it runs the job directly in each rank;
the launch options (--np, --mps, --hostfile, --host, --npernode, --ifname, --timeout, --dry-run) are refused
there (status 2): give mpirun its own.

A failing rank's diagnostic is printed once (the first rank to fail; the others' are kept in a job
directory the launcher names). Ctrl-C (or SIGTERM) is forwarded to every rank, SIGHUP (the terminal
closed) and SIGQUIT as SIGTERM; after a grace period what is left is killed; a --mps daemon is always
stopped. Exit status: 0 passed, 1 a rank failed (its diagnostic printed), 2 bad usage, config or setup
(no mpirun, no MPS daemon, no --hostfile; reported once, before any rank starts), 3 no GPU, 4 the job ran
past --timeout, 5 a rank died without reporting (killed by a signal, e.g. SIGKILL, or exited on its own), 130
interrupted by SIGINT (143 by SIGTERM, 129 SIGHUP, 131 SIGQUIT). --dry-run makes a launch's checks and exits
with its status (3 without a GPU, after showing the command when --np gives the rank count). doctor: 0 every
check passed or was skipped, 3 no GPU visible and nothing else failed (every other check still runs), 1
another check failed.
"""


def _parser(*, add_help: bool = True, job_help: str = "") -> argparse.ArgumentParser:
    """The command line; ``job_help`` (a job's keys) goes before the general epilog."""
    parser = _ArgumentParser(prog="chunkring-launch", description=DESCRIPTION, add_help=add_help,
                             formatter_class=argparse.RawDescriptionHelpFormatter,
                             epilog=f"{job_help}\n\n{EPILOG}" if job_help else EPILOG)
    # Optional (the main job, `run`, when none is named); its choices are checked in parse_args, where a first
    # key=value (`chunkring-launch topk=8`) is taken as run's override instead.
    parser.add_argument("job", nargs="?", default=None, metavar="{" + ",".join(_job_names()) + "}",
                        help=f"what to run (default: {DEFAULT_JOB}; 'doctor' checks this machine)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override keys of the job's config (TOML values; a str key takes the text as written; "
                             "checked before any rank starts)")
    parser.add_argument("--config", default=None,
                        help="preset name in configs/ or a .toml path (default: the job's name)")
    parser.add_argument("--np", type=int, default=None, help="number of ranks (default: number of local GPUs)")
    parser.add_argument("--mps", action="store_true",
                        help="run a private MPS daemon for the job, so ranks sharing a GPU run concurrently; "
                             "always stopped afterwards")
    parser.add_argument("--hostfile", default=None, help="Open MPI hostfile for a multi-node job")
    parser.add_argument("--host", default=None, help="Open MPI host list, e.g. node1:8,node2:8")
    parser.add_argument("--npernode", type=int, default=None,
                        help="ranks per node of a --hostfile/--host job (mpirun --map-by ppr:N:node): one per GPU")
    parser.add_argument("--ifname", default=None,
                        help="network interface NVSHMEM's UID bootstrap uses between nodes "
                             "(NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME), e.g. eth0")
    parser.add_argument("--timeout", type=int, default=None,  # None: not given (refused inside an MPI job)
                        help="wall-clock limit of the whole job in seconds (mpirun --timeout; default 600); "
                             "past it every rank is ended and the status is 4")
    parser.add_argument("--json", default=None,
                        help="write rank 0's results to this JSON file (its folder must exist and be writable)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is drawn only when stderr is a terminal)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mpirun command and environment, run nothing (a launch's checks and exit "
                             "status)")
    return parser


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but without help a parse error raises (to find the job of ``JOB --help`` quietly)."""

    def error(self, message: str) -> NoReturn:
        if self.add_help:
            super().error(message)
        raise _NoJob(message)


class _NoJob(Exception):
    pass


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed command line; a usage error (or ``--help``) exits as argparse does (status 2, or 0)."""
    argv = list(argv)
    job_help = ""
    if "-h" in argv or "--help" in argv:
        try:  # `chunkring-launch stress --help`: that job's keys too
            known, _ = _parser(add_help=False).parse_known_intermixed_args(argv)
            if known.job in _job_names():  # a job named (the general help alone otherwise)
                job_help = job_keys_help(known.job, known.config)
        except _NoJob:
            pass
    parser = _parser(job_help=job_help)
    args = parser.parse_intermixed_args(argv)  # key=value may come before or after the options
    if args.job is None or "=" in args.job:  # no job named: the main job, a first key=value its override
        args.overrides[:0] = [args.job] if args.job else []
        args.job = DEFAULT_JOB
    if args.job not in _job_names():
        parser.error(f"argument job: invalid choice: {args.job!r} (choose from {', '.join(_job_names())})")
    problems = [problem for problem in _option_problems(args) if problem]
    if problems:
        parser.error("; ".join(problems))
    if args.timeout is None:
        args.timeout = DEFAULT_TIMEOUT_S
    return args


def _job_names() -> list[str]:
    return sorted(JOBS) + ["doctor"]


def under_mpi() -> bool:
    """Whether this process is already a rank of an MPI job (started by the user's own mpirun)."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def _option_problems(args: argparse.Namespace) -> list[str]:
    """Every bad option value at once, each naming the option and its value."""
    problems = []
    if args.np is not None and not 1 <= args.np <= 1024:
        problems.append(f"--np must be in [1, 1024], got {args.np}")
    if args.timeout is not None and args.timeout <= 0:
        problems.append(f"--timeout must be positive, got {args.timeout}")
    if args.hostfile and args.host:
        problems.append("give --hostfile or --host, not both")
    if args.hostfile and not under_mpi() and not Path(args.hostfile).is_file():  # else mpirun fails, less clearly
        problems.append(f"--hostfile {args.hostfile}: no such file")
    if args.npernode is not None and not (args.hostfile or args.host):
        problems.append("--npernode places ranks on the nodes of --hostfile or --host; give one")
    if args.npernode is not None and not 1 <= args.npernode <= 64:
        problems.append(f"--npernode must be in [1, 64], got {args.npernode}")
    if args.json:
        problems.append(_json_problem(args.json))
    if under_mpi():  # the ranks are started already: these would silently do nothing
        given = [option for option in LAUNCH_OPTIONS
                 if getattr(args, option[2:].replace("-", "_")) not in (None, False)]
        if given:
            problems.append(f"{', '.join(given)}: not taken inside an MPI job (your mpirun started the ranks); "
                            "leave out, or give mpirun its own options")
    return problems


def _json_problem(path: str) -> str:
    """Why rank 0 could not write ``--json PATH`` ('' if it can): found now, not after the whole job ran,
    when the write would fail and take the results with it."""
    target, folder = Path(path), Path(path).parent
    if target.is_dir():
        return f"--json {path} is a directory"
    if not folder.is_dir():
        return f"--json {path}: no such directory {folder}"
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"--json {path}: not writable"
    return ""


def job_keys_help(job: str, config: str | None = None) -> str:
    """The keys of ``job``'s config with their values in its preset (``config``, default the job's own;
    the config class's defaults where the preset cannot be read) and their types and comments."""
    if job == "doctor":
        return "The doctor job takes no keys."
    cls = JOBS[job].CONFIG
    name = config or job
    try:
        preset = load_table(name)
        source = f"values of {name}" if name.endswith(".toml") else f"values of the preset configs/{name}.toml"
    except ChunkringError:
        preset, source = {}, "default values"
    comments = _field_comments(cls)
    rows = []
    for field in dataclasses.fields(cls):
        value = preset.get(field.name, field.default)
        type_name = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        rows.append((f"{field.name} = {_toml_value(value)}", type_name, comments.get(field.name, "")))
    width, type_width = max(len(row[0]) for row in rows), max(len(row[1]) for row in rows)
    lines = [f"Keys of the {job} job ({source}; override any with key=value, checked before a rank starts):"]
    lines += [f"  {left:<{width}}  {type_name:<{type_width}}  {comment}".rstrip() for left, type_name, comment in rows]
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _field_comments(cls: type) -> dict[str, str]:
    """``{key: comment}`` from ``key: type = default  # comment`` lines of ``cls`` and its bases."""
    comments = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for match in re.finditer(r"^\s+(\w+):[^=\n]*=[^#\n]*#\s*(.+)$", source, re.MULTILINE):
            comments[match[1]] = match[2].strip()
    return comments
