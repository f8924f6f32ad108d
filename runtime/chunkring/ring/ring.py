"""``Ring``: one chunk ring in the NVSHMEM symmetric heap, shared by every rank of the job.

The ring's buffer, descriptor and epoch live on the device; kernels advance every counter themselves,
so a launch (or a CUDA-graph replay) needs no host-supplied value. The host only resets the ring
between runs (a collective that bumps the epoch) and reads the status record after kernels end.

Every host-side wait on the other ranks is bounded and names who did not come
(:class:`~chunkring.errors.ChunkringHostTimeoutError`), and symmetric memory is zeroed (reset) or freed
(close) only once no kernel of any rank runs and none of their NVSHMEM operations is outstanding
(:meth:`chunkring.Runtime.quiesce`; docs/PROTOCOL.md, "Teardown and reset").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from chunkring.env import check_timeout_s, check_work_queues, watchdog_timeout_s
from chunkring.errors import ChunkringError, ChunkringInputError, ChunkringRuntimeError, ChunkringUsageError
from chunkring.ring.failure import FailureWord, raise_recorded_failure
from chunkring.ring.layout import CONTROL, DESC_FIELDS, STATUS, RingLayout
from chunkring.ring.spec import RingSpec
from chunkring.ring.status import AbortRecord, InputRecord, StatusRecord, describe_words, status_error
from chunkring.ring.transport import Transport, check_transport_mode, choose_transports, describe_transports, rma_mask
from chunkring.rollcall import abandoning_on_failure
from chunkring.runtime import TEARDOWN_WAIT_S

if TYPE_CHECKING:
    from chunkring.runtime import Runtime

__all__ = ["RESET_MARGIN_S", "TEARDOWN_WAIT_S", "Ring", "check_epochs_agree", "check_identical"]

log = logging.getLogger("chunkring")

#: How much longer than the ring's watchdog limit :meth:`Ring.reset` waits for every rank by default: a peer
#: whose kernel waits for a rank that failed comes once its watchdog fires (or at once, by the abort word).
RESET_MARGIN_S = 60.0


class Ring:
    """A ring of ``spec.num_slots`` chunk slots per rank. This is a collective: every rank constructs
    it with an identical ``spec`` (checked; every rank fails alike otherwise).

    Attributes: ``spec``, ``layout``, ``views`` (dict of typed tensors over this rank's buffer: ``x``
    [S, T, H], ``x_sf`` [S, T, H/128] fp32, ``topk_idx`` [S, T, K] int32, ``topk_weights`` [S, T, K] fp32,
    ``meta`` [S, 4] int64, ...), ``desc`` (the device descriptor, a uint64 tensor viewed as int64),
    ``transports`` (per PE: :class:`~chunkring.ring.transport.Transport`, how this rank's kernels reach
    that PE's slots), ``transport_mode``, ``failure`` (the pinned host word this rank's kernels copy their first
    recorded error into: :class:`~chunkring.ring.failure.FailureWord`, read by :meth:`raise_if_failed`).

    ``transport``: ``"auto"`` (loads and stores where NVSHMEM maps a peer, RMA elsewhere) or ``"rma"``
    (RMA for every peer, this rank included); ``None`` reads ``CHUNKRING_TRANSPORT`` (default auto).
    """

    def __init__(self, runtime: Runtime, spec: RingSpec, *, timeout_s: float | None = None,
                 transport: str | None = None) -> None:
        # The argument checks touch nothing of the runtime (they fail alike on every rank given the same
        # arguments, and check_identical compares those next). Each later stretch of this rank's own work
        # before a collective abandons that collective's barrier if it fails, so the peers raise at once,
        # naming this rank, and the ranks' barriers stay numbered alike.
        if not isinstance(spec, RingSpec):
            raise ChunkringUsageError(f"expected a RingSpec, got {type(spec).__name__}", field="spec")
        if spec.world_size != runtime.world_size:
            raise ChunkringUsageError(f"spec is for {spec.world_size} ranks, the job has {runtime.world_size}",
                                      field="world_size")
        check_work_queues()
        timeout_s = watchdog_timeout_s() if timeout_s is None else check_timeout_s(timeout_s, field="timeout_s")
        self.transport_mode = check_transport_mode(transport)
        check_identical(runtime, (spec, timeout_s, self.transport_mode))
        #: This rank's watchdog limit (:meth:`set_timeout` changes it), which bounds :meth:`reset`'s waits.
        self.timeout_s = timeout_s
        self.runtime = runtime
        self.spec = spec
        with abandoning_on_failure(runtime):  # before the allocation's; nothing to free yet
            self.layout = RingLayout(spec)
            self.failure = FailureWord(*runtime.mapped_host_word())
        self.buffer = runtime.alloc(self.layout.total_bytes, torch.uint8)
        try:
            with abandoning_on_failure(runtime):  # before the all-gather's barrier
                self.views = self.layout.views(self.buffer)
                # Decided once, here: a peer NVSHMEM maps into this GPU is read with loads, any other by RMA.
                self.transports: tuple[Transport, ...] = choose_transports(
                    lambda pe: runtime.peer_address(self.buffer, pe), spec.world_size, self.transport_mode)
                log.info("chunkring Ring: %s", self.describe_transport())
                desc = self.layout.descriptor(my_pe=runtime.rank, base=self.buffer.data_ptr(),
                                              timeout_ns=int(timeout_s * 1e9), rma_peers=rma_mask(self.transports),
                                              failure_word=self.failure.device_address)
                self.desc = torch.from_numpy(desc.view("int64")).to(runtime.torch_device)
                self._closed = False
            #: Whether any rank reaches a peer by RMA. Then the local ends of the gets and puts on this ring's rows
            #: (the layer's stage and experts' output, GatherOutputs) must be NVSHMEM-registered memory off-node:
            #: symmetric allocations, which are collectives, so every rank decides alike, once, here.
            self.rma_anywhere: bool = any(runtime.allgather_object(Transport.RMA in self.transports))
            self.reset()
        except BaseException as error:
            self._free_after_failed_construction(error)
            raise

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"epoch {self.epoch}"
        return f"Ring({self.spec}, {self.layout.total_bytes} B/rank, {state})"

    def describe_transport(self) -> str:
        """One line: which PEs this rank reaches with loads and stores, which by RMA."""
        return describe_transports(self.runtime.rank, self.transports, self.transport_mode)

    def check_alive(self) -> None:
        """Raise ``ChunkringUsageError`` if this ring was closed (every method,
        :func:`chunkring.ring.io.publish_chunk` and :func:`chunkring.ring.io.gather` check this first)."""
        if self._closed:
            raise ChunkringUsageError("this Ring was closed")

    @property
    def epoch(self) -> int:
        self.check_alive()
        return int(self.views["control"][CONTROL["epoch"]].item())

    def reset(self, *, timeout_s: float | None = None) -> None:
        """Start a new epoch: zero every generation, ack, cursor and status word (the abort word and notice too)
        and the failure word, and bump the epoch.

        A collective, between kernels. Any signal or ack still in flight from the previous epoch (an
        aborted run) carries the old epoch and can never satisfy a wait of the new one. Every rank must be
        in the same epoch (a rank that missed a reset is not): otherwise every rank raises
        ``ChunkringRuntimeError`` naming each rank's epoch, before anything is zeroed.

        Each wait for the other ranks is bounded by ``timeout_s`` (None: this ring's watchdog limit plus
        :data:`RESET_MARGIN_S` - a peer still inside a kernel comes once its watchdog fires): a rank that does
        not come makes the others raise :class:`~chunkring.errors.ChunkringHostTimeoutError` naming it, with
        nothing zeroed. The order (docs/PROTOCOL.md, "Teardown and reset"): every kernel of every rank has
        ended and every NVSHMEM operation they issued is complete (:meth:`Runtime.quiesce`) before any word
        is zeroed, and every rank has zeroed before any rank returns.
        """
        self.check_alive()
        limit = self.timeout_s + RESET_MARGIN_S if timeout_s is None else self._peer_wait_limit(timeout_s)
        # Every rank's kernels of the old epoch have ended, and their aborts (notices, quieted) have landed.
        self.runtime.quiesce(limit, what="the reset's first barrier")
        epoch = int(self.views["control"][CONTROL["epoch"]].item()) + 1
        # The same list everywhere, so the same verdict everywhere.
        check_epochs_agree(self.runtime.allgather_object(epoch - 1, timeout_s=limit))
        if epoch >= 1 << self.spec.epoch_bits:
            raise ChunkringRuntimeError(f"epoch field exhausted after {epoch - 1} resets; allocate a new Ring")
        for name in ("route_ready", "layout_ready", "ack", "consumed", "cursor", "control", "status", "meta"):
            self.views[name].zero_()
        self.failure.clear()  # no kernel of the old epoch runs (synchronised above) to write it again
        self.views["control"][CONTROL["epoch"]] = epoch
        #: The epoch as the host last set it (the device's copy is ``views["control"]``): what an abort raised from
        #: the host names without reading the device.
        self.host_epoch = epoch
        # Nobody publishes into the new epoch before everyone has zeroed.
        self.runtime.quiesce(limit, what="the reset's second barrier")

    def set_timeout(self, seconds: float) -> None:
        """Change this rank's watchdog limit for every wait of the kernels enqueued after this call on
        the current stream (and on streams that wait for it, as a layer call's do). Stream-ordered and
        graph-capturable: no host synchronisation."""
        self.check_alive()
        seconds = check_timeout_s(seconds, field="seconds")
        self.desc[DESC_FIELDS.index("timeout_ns")].fill_(int(seconds * 1e9))
        self.timeout_s = seconds  # what bounds reset()'s wait for peers from now on

    def status(self) -> StatusRecord:
        """This rank's status record (synchronises the device)."""
        self.check_alive()
        return StatusRecord.from_words(self.views["status"].tolist())

    def input_status(self) -> InputRecord:
        """The first malformed slot value this rank's consumers masked, if any (synchronises the device)."""
        self.check_alive()
        return InputRecord.from_words(self.views["status"].tolist(), self.runtime.rank)

    def abort_status(self) -> AbortRecord:
        """This rank's abort word: the first failed rank of the ring that this rank learned of in this epoch, with
        its error, if any - or, where no kernel of this rank read a notice yet, the notice a failed rank sent
        (synchronises the device)."""
        self.check_alive()
        words = self.views["status"]
        return AbortRecord.from_word(int(words[STATUS["abort"]].item()) or int(words[STATUS["abort_notice"]].item()))

    def check(self) -> None:
        """Raise if any kernel of this rank recorded an error: ``ChunkringTimeoutError`` for a watchdog,
        ``ChunkringDeviceError`` for another protocol error of this rank, ``ChunkringPeerAbortedError``
        when another rank failed first (``origin_rank``, ``code``: raised whether or not a wait of this rank
        saw it) - all three leave the ring to :meth:`reset` - or ``ChunkringInputError`` if a consumer
        masked malformed slot contents (the ring stays usable; the report is cleared once raised). Each
        carries the decoded record as ``.record``."""
        self.check_alive()
        error = status_error(self.views["status"].tolist(), rank=self.runtime.rank, epoch_bits=self.spec.epoch_bits)
        if isinstance(error, ChunkringInputError):
            self.views["status"][STATUS["input_field"]:STATUS["input_count"] + 1].zero_()
            torch.cuda.synchronize(self.runtime.torch_device)
        if error is not None:
            if not isinstance(error, ChunkringInputError):
                error.add_note(f"PE {self.runtime.rank}'s protocol words:\n{self.protocol_words()}")
            raise error

    def raise_if_failed(self) -> None:
        """Raise what :meth:`check` raises if a kernel of this rank recorded an error (a watchdog, a protocol
        error, a peer's abort), at the cost of reading one pinned host word: it synchronises the device only
        when that word is set. Inside a graph capture, where nothing may synchronise, it raises the error the
        word alone names (origin rank, code, epoch). Masked input (``ChunkringInputError``) sets no word: it
        stays :meth:`check`'s. An error surfaces here once the failing kernel has recorded it
        (:mod:`chunkring.ring.failure`)."""
        self.check_alive()
        # A failing kernel ends by its watchdog at the latest - unless it waits on a peer that never answers a
        # remote operation: then the word's own report is raised, with that said (raise_recorded_failure).
        word = self.failure.read()
        if word == 0:  # the common case, every call: one host load and nothing else
            return
        limit = self.timeout_s + RESET_MARGIN_S
        raise_recorded_failure(word, rank=self.runtime.rank, check=self.check,
                               synchronize=lambda: self.runtime.synchronize(limit, what="reading its error record"))

    def protocol_words(self) -> str:
        """This rank's protocol words as text (:func:`chunkring.ring.status.describe_words`): what a failed wait
        waited for, from this side - the producer's and the consumer's positions, the ready and ack words."""
        self.check_alive()
        words = {name: self.views[name].tolist()
                 for name in ("control", "cursor", "route_ready", "layout_ready", "ack")}
        return describe_words(words, num_slots=self.spec.num_slots, world_size=self.spec.world_size,
                              epoch_bits=self.spec.epoch_bits, abort=self.abort_status())

    def close(self, *, timeout_s: float = TEARDOWN_WAIT_S) -> None:
        """Free the ring's symmetric memory. A collective, safe at any moment: it first waits until no kernel
        of any rank runs and no NVSHMEM operation is outstanding (:meth:`Runtime.quiesce`: a peer's kernel may
        still read or write this rank's slots), bounded by ``timeout_s``. A rank that does not come makes the
        others raise :class:`~chunkring.errors.ChunkringHostTimeoutError` naming it, with nothing freed: the
        free is a collective too, which that rank would never join. A second call does nothing."""
        if self._closed:
            return
        timeout_s = self._peer_wait_limit(timeout_s)
        try:
            self.runtime.quiesce(timeout_s, what="the ring's close()")
        except ChunkringError as exc:
            exc.add_note("nothing was freed: every rank must call close() (end the job to reclaim the memory)")
            raise
        self.runtime.free(self.buffer)
        self._closed = True

    def _free_after_failed_construction(self, error: BaseException) -> None:
        """Return the buffer of a ring whose construction failed after its allocation. Each step there fails on
        every rank alike: a rank's own work abandons the all-gather's barrier, so its peers raise at that barrier;
        the all-gather and the reset are collectives that raise everywhere. So every rank comes here, and the free
        - a collective - meets them all. No kernel used the buffer yet. If the free fails too (a peer that never
        comes), the error says so."""
        try:
            self.runtime.free(self.buffer)
        except Exception as failed:
            error.add_note(f"the ring's symmetric buffer could not be freed ({failed!r}): end the job to reclaim it")
        self._closed = True

    def _peer_wait_limit(self, timeout_s: float) -> float:
        """``timeout_s`` checked, for a collective whose first step is a bounded barrier (reset, close). A bad
        value is this rank's own: before raising it, this rank abandons that barrier, so its peers, already
        there or on their way, raise at once naming it instead of waiting out their limit."""
        with abandoning_on_failure(self.runtime):
            return check_timeout_s(timeout_s, field="timeout_s")

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_epochs_agree(epochs: list[int]) -> None:
    """Every rank's ring epoch, in rank order: raise ``ChunkringRuntimeError`` naming them unless all are
    equal (a rank that missed a reset would accept nothing its peers publish, and they nothing of its)."""
    if len(set(epochs)) > 1:
        by_rank = ", ".join(f"rank {rank}: {epoch}" for rank, epoch in enumerate(epochs))
        raise ChunkringRuntimeError(f"ranks disagree on the ring's epoch ({by_rank}): every rank must call "
                                    f"reset() together; allocate a new Ring to recover")


def check_identical(runtime: Runtime, value: object) -> None:
    """Fail every rank alike if the ranks passed different arguments to a collective constructor."""
    everyone = runtime.allgather_object(value)  # [value] in a single process
    if any(v != everyone[0] for v in everyone):
        diff = {rank: v for rank, v in enumerate(everyone) if v != everyone[0]}
        raise ChunkringUsageError(f"ranks disagree (rank 0 has {everyone[0]}, others {diff})", field="spec")
