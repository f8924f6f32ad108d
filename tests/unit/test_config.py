"""Job configs: presets load; unknown keys, wrong types and out-of-range values are typed errors."""

import pytest

from chunkring.errors import ChunkringUsageError
from chunkring_launch.config import from_table, load_table
from chunkring_launch.jobs import JOBS


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_job_has_a_valid_preset(job):
    config = from_table(JOBS[job].CONFIG, load_table(job), job=job)
    assert isinstance(config, JOBS[job].CONFIG)


def test_unknown_preset_lists_known():
    with pytest.raises(ChunkringUsageError, match="bringup"):
        load_table("no-such-preset")


def test_missing_file(tmp_path):
    with pytest.raises(ChunkringUsageError):
        load_table(str(tmp_path / "absent.toml"))


def test_bad_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("rounds = = 3")
    with pytest.raises(ChunkringUsageError):
        load_table(str(path))


@pytest.mark.parametrize("table,field", [
    ({"rounds": 0}, "rounds"),
    ({"rounds": "8"}, "rounds"),
    ({"rounds": True}, "rounds"),
    ({"words_per_pe": 1 << 27}, "words_per_pe"),
    ({"colour": 1}, "config"),
    ({"job": "other"}, "job"),
])
def test_bringup_rejects(table, field):
    with pytest.raises(ChunkringUsageError) as info:
        from_table(JOBS["bringup"].CONFIG, table, job="bringup")
    assert info.value.field == field


@pytest.mark.parametrize("table,field", [
    ({"payload": "fp4"}, "payload"),
    ({"tokens_per_rank": 2100}, "tokens_per_rank"),  # past max_tokens_per_rank (2,048)
    ({"iterations": 0}, "iterations"),
    ({"tolerance": 1.5}, "tolerance"),
    ({"intermediate": 100}, "intermediate"),  # the layer's own check, before any rank starts
    ({"stream_slot_tokens": 4096}, "stream_slot_tokens"),  # a slot past the batch
    ({"topk": 1.0}, "topk"),
])
def test_run_rejects(table, field):
    with pytest.raises(ChunkringUsageError) as info:
        from_table(JOBS["run"].CONFIG, {**load_table("run"), **table}, job="run")
    assert info.value.field == field


@pytest.mark.parametrize("table,field", [
    ({"tokens": "16,x"}, "tokens"),
    ({"tokens": "0"}, "tokens"),
    ({"tokens": "16384"}, "tokens"),         # above max_tokens_per_rank
    ({"chunks": ""}, "chunks"),
    ({"chunks": "64,16384"}, "chunks"),
    ({"trace": "5:256"}, "trace"),           # not a measured shape
    ({"trace": "2048"}, "trace"),
    ({"rotate": 0}, "rotate"),
    ({"producer_sms": -8}, "producer_sms"),
])
def test_bench_rejects(table, field):
    with pytest.raises(ChunkringUsageError) as info:
        from_table(JOBS["bench"].CONFIG, {**load_table("bench"), **table}, job="bench")
    assert info.value.field == field


def test_every_preset_is_valid_for_its_job():
    from importlib import resources

    folder = resources.files("chunkring_launch") / "configs"
    presets = [p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml")]
    assert {"bench", "bench_v3", "bringup", "run", "stress", "chaos", "prefill_8xh200", "decode_8xh200"} <= set(presets)
    for name in presets:
        table = load_table(name)
        job = table["job"]
        assert isinstance(from_table(JOBS[job].CONFIG, table, job=job), JOBS[job].CONFIG), name


def test_jobs_share_the_layer_fields():
    from chunkring_launch.jobs.moe_workload import LayerFields

    for job in ("bench", "run", "stress"):
        assert issubclass(JOBS[job].CONFIG, LayerFields)
        with pytest.raises(ChunkringUsageError, match="colour"):
            from_table(JOBS[job].CONFIG, {**load_table(job), "colour": 1}, job=job)


def test_the_test_job_is_registered_only_on_request():
    import os
    import subprocess
    import sys

    code = "from chunkring_launch.jobs import JOBS; print(sorted(JOBS))"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={k: v for k, v in os.environ.items() if k != "CHUNKRING_TEST_JOBS"})
    asked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, CHUNKRING_TEST_JOBS="1"))
    assert "fault" not in plain.stdout and "fault" in asked.stdout


def test_an_int_is_taken_for_a_float_but_not_the_reverse():
    config = from_table(JOBS["stress"].CONFIG, {**load_table("stress"), "iterations": 0, "duration_s": 600},
                        job="stress")
    assert config.duration_s == 600.0 and isinstance(config.duration_s, float)
    with pytest.raises(ChunkringUsageError) as info:
        from_table(JOBS["stress"].CONFIG, {**load_table("stress"), "iterations": 10.0}, job="stress")
    assert info.value.field == "iterations"
    with pytest.raises(ChunkringUsageError) as info:
        from_table(JOBS["stress"].CONFIG, {**load_table("stress"), "tolerance": True}, job="stress")
    assert info.value.field == "tolerance"


@pytest.mark.parametrize("value", ["auto", "none", 16])
def test_producer_sms_takes_auto_none_or_a_count(value):
    config = from_table(JOBS["run"].CONFIG, {**load_table("run"), "producer_sms": value}, job="run")
    assert config.producer_sms == value


def test_streamed_calls_get_the_default_partition_unless_a_config_says_otherwise():
    assert from_table(JOBS["run"].CONFIG, load_table("run"), job="run").producer_sms == "auto"


@pytest.mark.parametrize("value", [0, -8, "16", "off", True, 1.5])
def test_producer_sms_refuses_anything_else(value):
    with pytest.raises(ChunkringUsageError) as info:
        from_table(JOBS["run"].CONFIG, {**load_table("run"), "producer_sms": value}, job="run")
    assert info.value.field == "producer_sms"


def test_a_config_reports_every_bad_value_with_its_value():
    with pytest.raises(ChunkringUsageError) as info:
        from_table(JOBS["run"].CONFIG, {**load_table("run"), "max_tokens_per_rank": 0, "tokens_per_rank": 600,
                                        "warmup": 0, "payload": "fp4"}, job="run")
    # tokens_per_rank is measured against max_tokens_per_rank, which is at fault itself: not reported twice
    assert info.value.problems == (("payload", "must be 'fp8' or 'bf16', got 'fp4'"),
                                   ("max_tokens_per_rank", "must be a positive int, got 0"),
                                   ("warmup", "must be in [1, 100000], got 0"))
    assert info.value.field == "payload"


def test_wrong_types_and_bad_values_together():
    with pytest.raises(ChunkringUsageError) as info:
        from_table(JOBS["bringup"].CONFIG, {"rounds": "8", "words_per_pe": 0, "colour": 1}, job="bringup")
    assert [field for field, _ in info.value.problems] == ["config", "rounds", "words_per_pe"]
    assert "got 0" in str(info.value).splitlines()[2]


def test_a_config_for_another_job_names_that_job():
    with pytest.raises(ChunkringUsageError) as info:
        from_table(JOBS["bringup"].CONFIG, {"job": "stress"}, job="bringup")
    assert "config is for job 'stress', not 'bringup'" in str(info.value)


def test_a_config_that_is_not_utf8_is_a_usage_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'job = "bringup"\n# caf\xe9\n')
    with pytest.raises(ChunkringUsageError) as info:
        load_table(str(path))
    assert info.value.field == "config" and "cannot read" in str(info.value)


def test_a_config_that_cannot_be_read_is_a_usage_error(tmp_path, monkeypatch):
    import pathlib

    path = tmp_path / "locked.toml"
    path.write_text('job = "bringup"\n')

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "read_text", refuse)  # as root, chmod 000 would not stop the read
    with pytest.raises(ChunkringUsageError) as info:
        load_table(str(path))
    assert info.value.field == "config" and "Permission denied" in str(info.value)


@pytest.mark.parametrize("item", ["tokens=512", 'tokens="512"'])  # what the shell passes for tokens="512" / '...'
def test_a_str_key_takes_the_text_as_written(item):
    from chunkring_launch.config import parse_overrides

    cls = JOBS["bench"].CONFIG
    overrides = parse_overrides([item, "chunks=64", "trace=512:64"], cls)
    assert overrides == {"tokens": "512", "chunks": "64", "trace": "512:64"}
    assert from_table(cls, {**load_table("bench"), **overrides}, job="bench").tokens == "512"


def test_a_typed_key_still_takes_a_toml_value():
    from chunkring_launch.config import parse_overrides

    cls = JOBS["run"].CONFIG
    assert parse_overrides(["topk=8", "producer_sms=16", "tolerance=0.1", "payload=bf16"], cls) == {
        "topk": 8, "producer_sms": 16, "tolerance": 0.1, "payload": "bf16"}
    assert parse_overrides(["seed=x"], cls) == {"seed": "x"}  # refused later, by from_table
