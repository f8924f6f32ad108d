"""A real :class:`chunkring.MoELayer` over host-only rings, for the fail-closed tests on the CPU
(tests/unit/test_fail_closed_host.py, test_call_failures_host.py): the rings' host side without their buffers
(:class:`HostRing`: the status words and failure word their kernels would write), kernels launched through
``chunkring.ring.io``'s library seam recorded (:class:`Launches`), the layer's schedule replaced by one that counts the
calls it is handed."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import chunkring.moe.layer
import chunkring.ring.io
from chunkring import MoEConfig, MoELayer, MoEModule, PayloadFormat
from chunkring.moe import CallMode
from chunkring.moe.op import moe_forward, moe_run
from chunkring.ring.failure import FailureWord, raise_recorded_failure
from chunkring.ring.layout import DESC_FIELDS, STATUS
from chunkring.ring.status import AbortRecord, ErrorCode, Site, status_error

H, INTER, E, K, N = 256, 128, 8, 2, 16
EPOCH = 3


class HostRing:
    """A ring's host side without its buffer: the status words and failure word its kernels would write."""

    def __init__(self, runtime: SimpleNamespace) -> None:
        self.runtime = runtime
        self.status = [0] * 32
        self.failure = FailureWord(torch.zeros(1, dtype=torch.int64))
        self.desc = torch.zeros(len(DESC_FIELDS), dtype=torch.int64)
        self.host_epoch = EPOCH
        self.synchronized = 0

    def record(self, code: ErrorCode, site: Site, *, peer: int = 0, abort: int = 0) -> None:
        """What record_error leaves: the record, and in the failure word this rank's abort word (or, for a
        wait a peer's abort stopped, that abort word)."""
        rank = self.runtime.rank
        fields = dict(code=int(code), pe=rank, count=1, site=int(site), peer=peer, observed=abort)
        for name, value in fields.items():
            self.status[STATUS[name]] = value
        word = abort if code == ErrorCode.PEER_ABORTED else AbortRecord.make(EPOCH, rank, code).word
        self.status[STATUS["abort"]] = word
        self.failure.host[0] = word - (1 << 64) if word >> 63 else word

    def reset(self, *, timeout_s: float | None = None) -> None:
        self.status = [0] * 32
        self.failure.clear()
        self.runtime.resets.append("ring")

    def check_alive(self) -> None:
        pass

    def describe_transport(self) -> str:
        return "host-only"

    def check(self) -> None:
        error = status_error(self.status, rank=self.runtime.rank)
        if error is not None:
            raise error

    def raise_if_failed(self) -> None:
        raise_recorded_failure(self.failure.read(), rank=self.runtime.rank, check=self.check,
                               synchronize=self.synchronize)

    def synchronize(self) -> None:
        self.synchronized += 1


class Launches:
    """The kernels launched through chunkring.ring.io's library seam."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def launch(self, name: str, /, *, grid: object = 1, block: object = 128, stream: object = None,
               shared_bytes: object = 0, **args: object) -> None:
        self.calls.append((name, args))


def config(streaming: bool = True) -> MoEConfig:
    ring = dict(stream_slots=2, stream_slot_tokens=8) if streaming else {}
    return MoEConfig(num_experts=E, hidden=H, intermediate=INTER, topk=K, max_tokens_per_rank=N,
                     payload=PayloadFormat.BF16, **ring)


def record_launches(monkeypatch) -> Launches:
    """Point ``chunkring.ring.io``'s library seam at a recorder (each test module's ``launches`` fixture)."""
    recorded = Launches()
    monkeypatch.setattr(chunkring.ring.io, "kernel_library", lambda runtime: recorded)
    return recorded


def host_layer(monkeypatch, cfg: MoEConfig, *, rank: int = 0) -> MoELayer:
    """A real MoELayer over host-only rings (one per call mode of ``cfg``), its schedule replaced by one that
    counts the calls it is handed (``layer.schedule.calls``) and returns zeros."""
    runtime = SimpleNamespace(rank=rank, world_size=1, torch_device=torch.device("cpu"), gpu_ranks=1,
                              allgather_object=lambda value: [value], abandoned=0, resets=[])
    runtime.abandon_barrier = lambda: setattr(runtime, "abandoned", runtime.abandoned + 1)
    modes = (CallMode.BATCH_READY, CallMode.STREAMED) if cfg.streaming else (CallMode.BATCH_READY,)
    rings = {mode: HostRing(runtime) for mode in modes}
    resources = SimpleNamespace(rings=rings, experts_per_rank=E, first_expert=0, transports=(),
                                close=lambda limit: None,
                                kernels=SimpleNamespace(produce=None), produce_arrivals=dict.fromkeys(modes),
                                spinning_produce_blocks=None, zero_counts=lambda: runtime.resets.append("counts"),
                                decode_for=lambda n: False, config=cfg)
    monkeypatch.setattr(chunkring.moe.layer, "LayerResources", lambda *args, **kwargs: resources)
    monkeypatch.setattr(chunkring.moe.layer, "module_loading_is_eager", lambda: True)
    layer = MoELayer(runtime, cfg)
    schedule = SimpleNamespace(calls=0, warm=set(), met_barrier=False)
    schedule.is_warm = lambda mode: mode in schedule.warm
    schedule.begin_call = lambda: setattr(schedule, "met_barrier", False)
    schedule.owes_first_barrier = lambda mode: mode not in schedule.warm and not schedule.met_barrier

    def enqueue(call):
        schedule.calls += 1
        return torch.zeros(call.n, H, dtype=torch.bfloat16)

    schedule.enqueue = enqueue
    layer.schedule = schedule
    return layer


def weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    router = torch.randn(E, H, generator=gen).to(torch.bfloat16)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(E, H, INTER, generator=gen).to(torch.bfloat16)
    return router, w13, w2


def routed(gen: torch.Generator, n: int = 5) -> dict:
    return dict(x=torch.randn(n, H, generator=gen).to(torch.bfloat16), x_sf=None,
                topk_idx=torch.randint(0, E, (n, K), generator=gen, dtype=torch.int32),
                topk_weights=torch.rand(n, K, generator=gen))


def entry_points(layer: MoELayer) -> dict:
    """Each entry point as a call of one batch on ``layer``."""
    gen = torch.Generator().manual_seed(0)
    router, w13, w2 = weights(gen)
    batch, hidden = routed(gen), torch.randn(5, H, generator=gen).to(torch.bfloat16)
    module = MoEModule(layer, weights=(router, w13, w2))
    return {
        "run": lambda: layer.run(**batch, w13=w13, w2=w2),
        "forward": lambda: layer.forward(hidden, router, w13, w2, streaming=True),
        "moe_run": lambda: moe_run(layer, **batch, w13=w13, w2=w2, streaming=True),
        "moe_forward": lambda: moe_forward(layer, hidden, router, w13, w2),
        "MoEModule": lambda: module(hidden),
    }


ENTRY_POINTS = ("run", "forward", "moe_run", "moe_forward", "MoEModule")
