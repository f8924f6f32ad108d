"""Multicast stays off whatever the caller set; single-node defaults fill only what is unset."""

import pytest

from chunkring.env import MULTICAST_OFF, apply_process_defaults, watchdog_timeout_s
from chunkring.errors import ChunkringUsageError


def test_multicast_forced_off():
    env = apply_process_defaults({}, single_node=False)
    for name, value in MULTICAST_OFF.items():
        assert env[name] == value
    assert "NVSHMEM_REMOTE_TRANSPORT" not in env


@pytest.mark.parametrize("name", sorted(MULTICAST_OFF))
def test_multicast_on_is_refused(name):
    bad = {"NVSHMEM_DISABLE_NVLS": "0", "NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}[name]
    with pytest.raises(ChunkringUsageError) as info:
        apply_process_defaults({name: bad}, single_node=True)
    assert info.value.field == name


def test_single_node_defaults_do_not_override():
    env = apply_process_defaults({"NVSHMEM_REMOTE_TRANSPORT": "ibrc"}, single_node=True)
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"
    assert env["NVSHMEM_DISABLE_NCCL"] == "1"
    assert env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo"


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "1e9"])
def test_bad_timeout(monkeypatch, raw):
    monkeypatch.setenv("CHUNKRING_TIMEOUT_S", raw)
    with pytest.raises(ChunkringUsageError):
        watchdog_timeout_s()


def test_timeout_default(monkeypatch):
    monkeypatch.delenv("CHUNKRING_TIMEOUT_S", raising=False)
    assert watchdog_timeout_s() == 100.0


@pytest.mark.parametrize("value", [0, -1.0, 86401, float("nan"), True, "10"])
def test_check_timeout_rejects(value):
    from chunkring.env import check_timeout_s

    with pytest.raises(ChunkringUsageError) as info:
        check_timeout_s(value, field="timeout_s")
    assert info.value.field == "timeout_s"
