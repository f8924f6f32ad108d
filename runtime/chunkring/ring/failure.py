"""The failure word: how the host learns, without synchronising, that a ring's kernels recorded an error.

After an error every kernel of the rank returns early (device/include/chunkring/protocol/status.cuh), so a later
call would hand back zeros while the error sat in device memory until someone called ``check()``. Instead, the
device's one error-recording path (``record_error``) also stores the error, as an abort word (origin rank, code,
epoch: :class:`~chunkring.ring.status.AbortRecord`), into a pinned host word mapped into the GPU's address space,
whose device address the ring's descriptor carries (``RingDesc::failure_word``). The host reads that word at the
entry of every call - one load from host memory, no device work and no synchronisation, so it costs the same
inside and outside a graph capture - and only when it is set synchronises and raises the full record
(:func:`raise_recorded_failure`).

When an error surfaces: at the first entry after the failing kernel recorded it (the device's store reaches host
memory microseconds after). The call that was running then, and any enqueued behind it before the store landed,
return what they computed (zeros, where kernels bailed out); the entry after raises. Only this rank's kernels
write its word: a peer's abort that lands while none of them waits sets nothing here until a kernel of this rank
next waits and stops on it (``PEER_ABORTED``) - so that call returns zeros and the one after raises. A CUDA graph
replay runs no Python, so nothing is read at a replay: call ``raise_if_failed()`` (the layer's or the ring's)
between replays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from chunkring.errors import ChunkringRuntimeError
from chunkring.ring.status import failure_error

__all__ = ["FailureWord", "capturing", "raise_recorded_failure"]


class FailureWord:
    """One ring's failure word at this rank: ``host`` (int64 [1] on the CPU, pinned for a real ring) holds 0 until
    the ring's kernels record an error, then the abort word of that error; ``device_address`` is where the GPU
    writes it (0 for a word no device writes: a host-only test's)."""

    def __init__(self, host: torch.Tensor, device_address: int = 0) -> None:
        if host.device.type != "cpu" or host.dtype != torch.int64 or host.numel() != 1:
            raise ChunkringRuntimeError(f"a failure word is one int64 in host memory, got {host.dtype} {host.device}")
        self.host = host
        self.device_address = device_address
        # A numpy view reads the word with one load (a torch index or .item() dispatches an operator).
        self._words = host.numpy().view(np.uint64)

    def read(self) -> int:
        """The word: 0, or the abort word of the first error the ring's kernels recorded since the last reset."""
        return int(self._words[0])

    def set_if_clear(self, word: int) -> None:
        """Set the word to ``word`` (non-zero) unless an error is there already: what the host itself knows of a
        failure it raised (:func:`chunkring.ring.io.raise_abort`), before any kernel could record it."""
        if self._words[0] == 0:
            self._words[0] = word

    def clear(self) -> None:
        """Zero the word (the ring's reset, once no kernel of the old epoch runs)."""
        self._words[0] = 0

    def __repr__(self) -> str:
        return f"FailureWord(0x{self.read():x})"


def capturing() -> bool:
    """Whether torch's current CUDA stream is being captured into a graph (False where torch has not initialised
    CUDA: nothing can capture then). Checked on every call, so it asks torch's flag, not the driver's device count."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def raise_recorded_failure(word: int, *, rank: int, check: Callable[[], None], synchronize: Callable[[], None]) -> None:
    """Raise the error a set failure ``word`` announces: outside a graph capture, ``synchronize()`` then ``check()``
    (the ring's, which raises the typed error with the whole record); if that raised nothing, or inside a
    capture (where nothing may synchronise), the error the word alone describes
    (:func:`chunkring.ring.status.failure_error`). A ``word`` of 0 returns."""
    if word == 0:
        return
    if not capturing():
        try:
            synchronize()
        except ChunkringRuntimeError as stuck:  # the failing kernel has not ended: the word is all there is
            error = failure_error(word, rank=rank)
            error.add_note(str(stuck))
            raise error from stuck
        check()
    raise failure_error(word, rank=rank)
