"""Per-peer transport choice (runtime/chunkring/ring/transport.py): DIRECT where the host's nvshmem_ptr is not null,
RMA elsewhere or everywhere when forced; the mask the descriptor carries; the mode's validation (argument,
CHUNKRING_TRANSPORT, MoEConfig). nvshmem_ptr is faked: no GPU, no NVSHMEM."""

import numpy as np
import pytest

from chunkring import MoEConfig
from chunkring.env import transport_mode
from chunkring.errors import ChunkringUsageError
from chunkring.ring.layout import DESC_FIELDS, RingLayout
from chunkring.ring.spec import PayloadFormat, RingSpec
from chunkring.ring.transport import (
    Transport,
    check_transport_mode,
    choose_transports,
    describe_transports,
    rma_mask,
)

D, R = Transport.DIRECT, Transport.RMA


def two_nodes_of_four(me: int):
    """nvshmem_ptr as on a 2 x 4-GPU job: a window for the PEs of my node, null for the other node's."""
    return lambda pe: 0x7F00_0000_0000 + pe if pe // 4 == me // 4 else 0


def test_auto_is_direct_where_nvshmem_maps_the_peer_and_rma_elsewhere():
    assert choose_transports(two_nodes_of_four(1), 8, "auto") == (D, D, D, D, R, R, R, R)
    assert choose_transports(two_nodes_of_four(6), 8, "auto") == (R, R, R, R, D, D, D, D)


def test_rma_is_forced_for_every_peer_including_self():
    calls = []
    transports = choose_transports(lambda pe: calls.append(pe) or 1, 3, "rma")
    assert transports == (R, R, R) and calls == []  # nothing asked: the answer cannot change it


def test_mask_sets_one_bit_per_rma_peer():
    assert rma_mask((D, D, D, D, R, R, R, R)) == 0xF0
    assert rma_mask((D,)) == 0
    assert rma_mask((R,) * 64) == (1 << 64) - 1


def test_describe_names_ranges():
    assert describe_transports(1, (D, D, D, D, R, R, R, R), "auto") == \
        "PE 1 (transport auto): direct to PEs 0-3, RMA to PEs 4-7"
    assert describe_transports(0, (R,), "rma") == "PE 0 (transport rma): RMA to PE 0"
    assert describe_transports(2, (D, R, D, D), "auto") == "PE 2 (transport auto): direct to PEs 0, 2-3, RMA to PE 1"


def test_the_descriptor_carries_the_mask():
    spec = RingSpec(8, 2, 4, 256, PayloadFormat.FP8_E4M3, 2, 16)
    layout = RingLayout(spec)
    mask = DESC_FIELDS.index("rma_peers")
    words = layout.descriptor(my_pe=1, base=0, timeout_ns=1, rma_peers=0xF0)
    assert int(words[mask]) == 0xF0
    assert int(layout.descriptor(my_pe=1, base=0, timeout_ns=1)[mask]) == 0  # default: every peer direct
    wide = RingLayout(RingSpec(64, 1, 1, 128, PayloadFormat.BF16, 1, 64))
    assert wide.descriptor(my_pe=0, base=0, timeout_ns=1, rma_peers=(1 << 64) - 1)[mask] == np.uint64((1 << 64) - 1)


@pytest.mark.parametrize("mask", [-1, 1 << 8, True, 1.0])
def test_the_descriptor_refuses_a_mask_outside_the_world(mask):
    layout = RingLayout(RingSpec(8, 2, 4, 256, PayloadFormat.FP8_E4M3, 2, 16))
    with pytest.raises(ChunkringUsageError) as info:
        layout.descriptor(my_pe=0, base=0, timeout_ns=1, rma_peers=mask)
    assert info.value.field == "rma_peers"


def test_mode_from_the_environment(monkeypatch):
    monkeypatch.delenv("CHUNKRING_TRANSPORT", raising=False)
    assert transport_mode() == "auto" and check_transport_mode(None) == "auto"
    monkeypatch.setenv("CHUNKRING_TRANSPORT", "rma")
    assert transport_mode() == "rma" and check_transport_mode(None) == "rma"
    assert check_transport_mode("auto") == "auto"  # an explicit mode wins over the environment


@pytest.mark.parametrize("bad", ["RMA", "direct", "", "ib"])
def test_a_bad_environment_value_is_a_usage_error(monkeypatch, bad):
    monkeypatch.setenv("CHUNKRING_TRANSPORT", bad)
    with pytest.raises(ChunkringUsageError) as info:
        transport_mode()
    assert info.value.field == "CHUNKRING_TRANSPORT"


@pytest.mark.parametrize("bad", ["RMA", "nvlink", 1, ""])
def test_a_bad_mode_argument_is_a_usage_error(bad):
    with pytest.raises(ChunkringUsageError) as info:
        check_transport_mode(bad)
    assert info.value.field == "transport"
    with pytest.raises(ChunkringUsageError) as info:
        choose_transports(lambda pe: 1, 2, bad)


def test_the_layer_config_takes_a_mode_or_none():
    base = dict(num_experts=8, hidden=256, intermediate=256, topk=2, max_tokens_per_rank=16)
    assert MoEConfig(**base).transport is None
    assert MoEConfig(**base, transport="rma").transport == "rma"
    assert MoEConfig(**base, transport="rma") != MoEConfig(**base)  # ranks must agree on it
    with pytest.raises(ChunkringUsageError) as info:
        MoEConfig(**base, transport="fast")
    assert info.value.field == "transport"
