"""Fail closed on the GPU (docs/INTEGRATION.md, "Failing closed"): once a kernel of a layer's ring recorded an error,
the next call of every entry point - ``MoELayer.run`` and ``forward``, the ``chunkring::moe_run`` and
``moe_forward`` operators, ``MoEModule``, the transformers drop-in - raises the typed error naming this rank,
without anyone calling ``check()``; a CUDA graph replay runs no Python, and ``raise_if_failed()`` between
replays raises it instead (it reads a host word, so it may sit inside a capture, where any synchronisation
raises); a reset clears it and calls compute again. And a collective call that fails its argument checks on one
rank alone aborts the ring: its peers, already waiting in the call, stop within a second (not at the watchdog)
with ``ChunkringPeerAbortedError`` naming that rank and ``HOST_USAGE``.

The error is a real one: a gather on the layer's batch-ready ring with a 10 ms watchdog and no producer anywhere,
so every rank's consumer times out (or stops on a peer's abort first). The host learns of it from the failure word
alone: the test waits for that word, bounded, never synchronising first, and the next call must raise.

Run on 1 rank, or under mpirun on several (every rank injects, so every rank's next call raises)."""

import time

import pytest
import torch

from chunkring import ChunkringDeviceError, ChunkringPeerAbortedError, ChunkringUsageError, MoEModule
from chunkring.moe import CallMode
from chunkring.moe.op import moe_forward, moe_run
from chunkring.ring.io import GatherOutputs, gather
from chunkring.ring.status import ErrorCode
from tests.gpu.graph_helpers import Batch, make_layer, strict_capture
from tests.gpu.moe_helpers import H

pytestmark = pytest.mark.gpu

WATCHDOG_S = 60.0
INJECTED_TIMEOUT_S = 0.01
#: How long the failure word may take to be set after the injected gather is enqueued: its 10 ms watchdog, the
#: store to host memory, and the GEMM warm-ups of other calls still queued ahead of it.
WORD_SET_WITHIN_S = 10.0
#: Far below WATCHDOG_S: only the abort can stop the peers' wait this soon.
REPORT_WITHIN_S = 1.0


def inject_device_error(layer, mode: CallMode = CallMode.BATCH_READY) -> None:
    """A watchdog on the layer's ring of ``mode``, then wait (bounded, without synchronising) until this rank's
    failure word says so."""
    ring = layer.rings[mode]
    ring.set_timeout(INJECTED_TIMEOUT_S)
    gather(ring, GatherOutputs(ring, 1))
    ring.set_timeout(WATCHDOG_S)
    deadline = time.monotonic() + WORD_SET_WITHIN_S
    while ring.failure.read() == 0:
        assert time.monotonic() < deadline, "the failure word was not set: the host cannot learn of the error"
        time.sleep(1e-3)


def assert_raises_for_this_rank(runtime, call, name: str) -> None:
    with pytest.raises(ChunkringDeviceError) as info:
        call()
    assert f"PE {runtime.rank}" in str(info.value), (name, str(info.value))


def test_every_entry_point_raises_on_the_call_after_a_device_error(runtime):
    layer, experts, _ = make_layer(runtime)
    device, n = runtime.torch_device, 8
    gen = torch.Generator().manual_seed(17 + runtime.rank)
    batch = Batch(runtime, layer.config)
    batch.fill(1)
    hidden = torch.randn(n, H, generator=gen).to(torch.bfloat16).to(device)
    module = MoEModule(layer, generator=torch.Generator().manual_seed(3))
    router = module.router_weight
    calls = {
        "run": lambda: layer.run(*batch.args(), *experts),
        "forward": lambda: layer.forward(hidden, router, *experts, streaming=True),
        "moe_run": lambda: moe_run(layer, *batch.args(), *experts, streaming=True),
        "moe_forward": lambda: moe_forward(layer, hidden, router, *experts),
        "MoEModule": lambda: module(hidden),
    }
    try:
        for name, call in calls.items():
            call()
            torch.cuda.synchronize()
            layer.check()  # the call itself worked
            runtime.barrier()  # on every rank, before any rank's injected error aborts the ring
            inject_device_error(layer)
            assert_raises_for_this_rank(runtime, call, name)
            assert_raises_for_this_rank(runtime, call, name)  # and every call after, until the reset
            layer.reset()
    finally:
        layer.close()


def test_a_replay_leaves_it_to_raise_if_failed(runtime):
    layer, experts, _ = make_layer(runtime)
    batch = Batch(runtime, layer.config)
    try:
        batch.fill(2)
        layer.run(*batch.args(), *experts, streaming=True, num_tokens=batch.count)  # warm-up, outside the capture
        torch.cuda.synchronize()

        # run's entry check reads a host word: it must not synchronise inside the capture (strict_capture raises)
        graph, out = strict_capture(lambda: layer.run(*batch.args(), *experts, streaming=True,
                                                      num_tokens=batch.count))
        graph.replay()
        torch.cuda.synchronize()
        layer.raise_if_failed()
        assert bool(out.any())
        inject_device_error(layer, CallMode.STREAMED)  # the ring the replay's kernels wait in
        graph.replay()  # runs no Python, and its kernels give up: zeros, never the rows the replay before left
        torch.cuda.synchronize()
        assert not bool(out.any()), "a replay whose drain gave up returned rows"
        assert_raises_for_this_rank(runtime, layer.raise_if_failed, "raise_if_failed")
        layer.reset()
        graph.replay()
        torch.cuda.synchronize()
        layer.raise_if_failed()
        layer.check()
    finally:
        layer.close()


def test_the_drop_in_raises_on_the_forward_after_a_device_error(runtime):
    pytest.importorskip("transformers")
    from chunkring.integrations.transformers import chunkring_blocks, replace_moe_blocks
    from chunkring.testing.hf_models import tiny_model

    model = tiny_model("qwen3_moe", seed=11)
    replace_moe_blocks(model, runtime, max_tokens_per_rank=64, payload="bf16", timeout_s=WATCHDOG_S)
    model = model.to(runtime.torch_device)
    layers = {id(block.layer): block.layer for _, block in chunkring_blocks(model)}
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(runtime.rank)).to(runtime.torch_device)
    try:
        with torch.no_grad():
            model(ids)
            torch.cuda.synchronize()
            for layer in layers.values():
                layer.check()
            runtime.barrier()  # every rank's layers checked before any rank's injected error aborts a ring
            for layer in layers.values():
                inject_device_error(layer)
            assert_raises_for_this_rank(runtime, lambda: model(ids), "drop-in")
            for layer in layers.values():
                layer.reset()
            model(ids)
            torch.cuda.synchronize()
    finally:
        for layer in layers.values():
            layer.close()


def test_one_ranks_bad_argument_stops_its_peers_within_a_second(runtime, record_testsuite_property):
    W, rank = runtime.world_size, runtime.rank
    if W < 2:
        pytest.skip("a peer's abort needs two ranks")
    bad = W - 1
    layer, experts, _ = make_layer(runtime)
    batch = Batch(runtime, layer.config)
    batch.fill(3)
    try:
        # A good call first: every rank past the first call's warm-up and host barrier, which a rank raising
        # before it would hold its peers at for FIRST_CALL_BARRIER_S instead.
        layer.run(*batch.args(), *experts)
        torch.cuda.synchronize()
        layer.check()
        runtime.barrier()
        start = time.time()
        if rank == bad:
            with pytest.raises(ChunkringUsageError):
                layer.run(batch.x, batch.sf, batch.idx.long(), batch.w, *experts)  # int64 topk_idx: refused
        else:
            layer.run(*batch.args(), *experts)  # waits for the bad rank's chunk, which never comes
        torch.cuda.synchronize()
        reported = time.time()
        with pytest.raises(ChunkringDeviceError) as info:
            layer.check()
        error = info.value
        if rank == bad:
            assert type(error) is ChunkringDeviceError and error.record.code == ErrorCode.HOST_USAGE, error
        else:
            assert isinstance(error, ChunkringPeerAbortedError), error
            assert (error.origin_rank, error.code) == (bad, ErrorCode.HOST_USAGE), error
        took = reported - runtime.allgather_object(start)[bad]
        took_by_rank = [t for r, t in enumerate(runtime.allgather_object(took)) if r != bad]
        if rank == 0:
            record_testsuite_property("host_usage_abort_ms_max", round(max(took_by_rank) * 1e3, 3))
        assert all(t < REPORT_WITHIN_S for t in took_by_rank), f"peers stopped {took_by_rank} s after the bad call"
        layer.reset()
        layer.run(*batch.args(), *experts)
        torch.cuda.synchronize()
        layer.check()
    finally:
        layer.close()
