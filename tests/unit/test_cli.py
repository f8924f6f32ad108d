"""`chunkring-launch`: its documented exit statuses hold on a machine without a GPU (no GPU is 3, also for
doctor; a config the ring cannot carry is 2, in one line, before any rank starts), and every job's
``--help`` lists its keys with their preset values."""

import subprocess
import sys

import pytest

from tests.helpers.devices import HAVE_GPU
from tests.helpers.launch_machine import stand_in_machine


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU path")
def test_no_gpu_message():
    proc = subprocess.run([sys.executable, "-m", "chunkring_launch.cli", "bringup"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert "no CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_unknown_job_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "chunkring_launch.cli", "nosuchjob"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def run_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "chunkring_launch.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env, check=False)


# A layer the ring cannot carry is a config error (2) reported in one line before any rank starts, also
# on a machine without a GPU: not "no GPU" (3) and not a rank's failure (1).
def test_topk_past_the_experts_is_a_config_error_without_a_gpu():
    proc = run_cli("run", "topk=100")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "chunkring-launch: topk: must be in [1, 32], got 100 (at most num_experts=32)\n"
    assert proc.stdout == ""


@pytest.mark.parametrize("argv, needle", [
    (["stress", "topk=100"], "topk: must be in [1, 16], got 100"),
    (["bench", "topk=100"], "topk: must be in [1, 32], got 100"),  # 256 experts; the ring takes 32 choices
    (["run", "hidden=100"], "hidden: must be a multiple of 128 (the FP8 scale block"),
    (["run", "hidden=144"], "hidden: must be a multiple of 128 (the FP8 scale block: one fp32 scale per 128 "
                            "channels), got 144"),
    (["run", "max_tokens_per_rank=0"], "max_tokens_per_rank: must be a positive int, got 0"),
    (["run", "max_tokens_per_rank=70000"], "max_tokens_per_rank: must be in [1, 65536], got 70000"),
    (["run", "stream_slots=70000"], "stream_slots: must be in [1, 65536], got 70000"),
    (["--np", "3", "run"], "num_experts: 32 experts do not split evenly over 3 ranks"),
    (["--np", "3", "--dry-run", "run"], "num_experts: 32 experts do not split evenly over 3 ranks"),
    (["--np", "128", "run", "num_experts=128"], "--np: must be in [1, 64], got 128"),
])
def test_a_layer_the_ring_cannot_carry_is_a_config_error(argv, needle, capsys):
    from chunkring_launch import cli

    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count(needle) == 1 and err.strip().count("\n") == 0, err  # one line
    assert out == "" and "Traceback" not in err


def test_the_dry_run_of_a_fitting_rank_count_passes(tmp_path, monkeypatch, capsys):
    from chunkring_launch import cli

    stand_in_machine(monkeypatch, tmp_path, gpus=1)
    assert cli.main(["--np", "4", "--dry-run", "run"]) == 0
    assert "mpirun -np 4" in capsys.readouterr().out


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU path")
def test_doctor_without_a_gpu_is_status_3(monkeypatch, capsys):
    from chunkring_launch import cli, doctor

    # The kernel build and MPI are checked elsewhere (test_launcher); here only the status matters.
    monkeypatch.setattr(doctor, "check_compiler", lambda: doctor.Check("kernel build (NVRTC)", "PASS", "skipped here"))
    monkeypatch.setattr(doctor, "check_mpi", lambda: [doctor.Check("mpirun", "PASS", "skipped here")])
    assert cli.main(["doctor"]) == 3
    lines = capsys.readouterr().out.strip().splitlines()
    assert "[FAIL] GPUs: no CUDA GPU visible (torch.cuda.device_count() == 0)" in lines
    assert lines[-1].startswith("chunkring doctor:")


def test_doctor_status_follows_the_checks():
    from chunkring_launch.doctor import NO_GPU_DETAIL, Check, summarize

    ok, bad = Check("mpirun", "PASS", "here"), Check("mpirun", "FAIL", "missing")
    no_gpu, skip = Check("GPUs", "FAIL", NO_GPU_DETAIL), Check("MPS", "SKIP", "not found")
    quiet = lambda line: None  # noqa: E731
    assert summarize([ok, skip], quiet) == 0
    assert summarize([bad, skip], quiet) == 1
    assert summarize([ok, no_gpu], quiet) == 3
    assert summarize([Check("GPUs", "FAIL", "torch is not importable")], quiet) == 1


def test_doctor_is_status_1_when_more_than_the_gpu_failed():
    """Status 3 says "only the GPU is missing": with another check failed too the status is 1, and the last line
    names the other failures and the missing GPU."""
    from chunkring_launch.doctor import NO_GPU_DETAIL, Check, summarize

    lines: list[str] = []
    checks = [Check("mpirun", "FAIL", "missing"), Check("package cuda-core", "FAIL", "not installed"),
              Check("GPUs", "FAIL", NO_GPU_DETAIL), Check("MPS", "SKIP", "not found")]
    assert summarize(checks, lines.append) == 1
    assert lines == ["chunkring doctor: 1 of 4 checks passed or skipped; failed: mpirun, package cuda-core; "
                     "and no GPU is visible either"]
    lines.clear()
    assert summarize(checks[2:], lines.append) == 3
    assert lines == ["chunkring doctor: 1 of 2 checks passed or skipped; failed: GPUs (no GPU visible)"]


def test_doctor_takes_no_keys(capsys):
    from chunkring_launch import cli

    assert cli.main(["doctor", "rounds=3"]) == 2
    assert "doctor takes no keys" in capsys.readouterr().err


def _help(argv, capsys) -> str:
    from chunkring_launch import cli

    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("job", ["bench", "bringup", "run", "stress"])
def test_every_jobs_help_lists_its_keys_with_the_preset_values(job, capsys):
    import dataclasses

    from chunkring_launch.config import load_table
    from chunkring_launch.jobs import JOBS

    out = _help([job, "--help"], capsys)
    assert f"Keys of the {job} job (values of the preset configs/{job}.toml" in out
    preset = load_table(job)
    for field in dataclasses.fields(JOBS[job].CONFIG):
        value = preset.get(field.name, field.default)
        shown = (f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool)
                 else repr(value))
        assert f"  {field.name} = {shown} " in out, (field.name, shown)


def test_stress_help_from_the_command_line():
    proc = run_cli("stress", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "iterations = 200 " in proc.stdout and "chaos_rank = 1 " in proc.stdout


def test_help_follows_the_config_and_options_may_come_first(capsys):
    out = _help(["--config", "chaos", "--np", "4", "stress", "-h"], capsys)
    assert "values of the preset configs/chaos.toml" in out
    assert 'chaos = "kill"' in out and "iterations = 40 " in out
    assert "every k-th iteration is batch-ready" in out  # the config class's comments


def test_help_without_a_job_and_the_doctors_help(capsys):
    assert "Keys of the" not in _help(["--help"], capsys)
    assert "The doctor job takes no keys." in _help(["doctor", "--help"], capsys)


def test_help_dry_run_and_config_errors_import_no_torch(tmp_path):
    """`chunkring-launch --help`, `JOB --help`, `--dry-run` and a config error answer without importing torch,
    CUDA, NVSHMEM or MPI (each costs seconds): what makes them answer in well under a second."""
    from tests.helpers.imports import heavy_modules_after
    from tests.helpers.launch_machine import stand_in_tools

    bin_dir = stand_in_tools(tmp_path / "bin")  # a dry run looks these up, as a launch does
    code = ("import contextlib, io, os\n"
            "from chunkring_launch import cli\n"
            f"os.environ['PATH'] = {str(bin_dir)!r}\n"
            "cli.driver_gpu_count = lambda: 4  # a dry run counts GPUs from the driver's files, not torch\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    for argv in (['--help'], ['run', '--help'], ['stress', '--help']):\n"
            "        try:\n"
            "            cli.main(argv)\n"
            "        except SystemExit as exit:\n"
            "            assert exit.code == 0, argv\n"
            "    assert cli.main(['--np', '4', '--dry-run', 'run']) == 0\n"
            "    assert cli.main(['--np', '2', '--dry-run', '--mps', 'bringup']) == 0\n"
            "    assert cli.main(['run', 'hidden=1040', 'topk=100']) == 2\n"
            "    assert cli.main(['stress', 'nosuchkey=1']) == 2\n")
    assert heavy_modules_after(code) == []


def test_every_bad_value_of_a_config_is_reported_at_once(capsys):
    """One run names every bad key with its value, one line each, the config's own checks and the layer's."""
    from chunkring_launch import cli

    assert cli.main(["run", "hidden=1040", "topk=100", "num_experts=15", "tolerance=2", "iterations=0", "seed=x",
                     "colour=3"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith("chunkring-launch: ") for line in lines), lines
    fields = [line.removeprefix("chunkring-launch: ").split(":")[0] for line in lines]
    assert fields == ["config", "seed", "tolerance", "hidden", "topk", "iterations"], lines
    assert "tolerance: must be in (0, 1), got 2.0" in lines[2]
    assert "topk: must be in [1, 15], got 100" in lines[4]


def test_a_config_file_that_is_not_utf8_is_status_2(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'job = "bringup"\n# caf\xe9\n')
    proc = run_cli("--dry-run", "--config", str(path), "bringup")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"chunkring-launch: config: cannot read {path}") and "Traceback" not in proc.stderr


def test_the_jobs_examples_of_the_docs_pass_as_dry_runs(tmp_path, monkeypatch, capsys):
    """Each example of docs/LAUNCHER.md's jobs table, split as the shell would (quotes stripped)."""
    import re
    import shlex
    from pathlib import Path

    from chunkring_launch import cli

    doc = (Path(__file__).resolve().parents[2] / "docs" / "LAUNCHER.md").read_text()
    examples = re.findall(r"^\| `\w+` \|.*\| `chunkring-launch (.+)` \|$", doc, re.MULTILINE)
    assert len(examples) == 5, examples
    stand_in_machine(monkeypatch, tmp_path, gpus=1)
    for example in examples:
        if example != "doctor":
            assert cli.main(["--dry-run", *shlex.split(example)]) == 0, (example, capsys.readouterr().err)


def test_a_json_path_that_cannot_be_written_is_refused_before_the_job(tmp_path, monkeypatch, capsys):
    import os

    from chunkring_launch import cli

    stand_in_machine(monkeypatch, tmp_path / "machine", gpus=1)
    locked, real_access = tmp_path / "locked", os.access
    locked.mkdir()
    # As root every folder is writable, so stand in for a folder of someone else's.
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(locked) and real_access(path, mode))
    for path, needle in ((tmp_path / "absent" / "r.json", f"no such directory {tmp_path / 'absent'}"),
                         (tmp_path, "is a directory"), (locked / "r.json", "not writable")):
        with pytest.raises(SystemExit) as info:
            cli.main(["--dry-run", "--json", str(path), "bringup"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"--json {path}" in err and needle in err, err
    assert cli.main(["--dry-run", "--json", str(tmp_path / "r.json"), "bringup"]) == 0


@pytest.mark.parametrize("options", [["--dry-run"], ["--np", "2"], ["--timeout", "600"], ["--mps"],
                                     ["--hostfile", "hosts"], ["--host", "a:2", "--npernode", "2", "--ifname", "eth0"]])
def test_launch_options_are_refused_inside_an_mpi_job(options, monkeypatch, capsys):
    # Under the user's own mpirun the ranks already run: these options would be silently ignored.
    from chunkring_launch import cli

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        cli.main([*options, "bringup"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    named = [option for option in options if option.startswith("--")]
    assert f"{', '.join(named)}: not taken inside an MPI job" in err, err


def test_inside_an_mpi_job_the_job_options_are_taken(monkeypatch):
    from chunkring_launch import cli

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    args = cli.parse_args(["--config", "bringup", "--no-progress", "bringup", "rounds=3"])
    assert (args.config, args.overrides, args.timeout) == ("bringup", ["rounds=3"], 600)
