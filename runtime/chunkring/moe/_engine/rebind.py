"""A call's captured graph pointed at each later call's own tensors (:class:`Rebinding`), so that a replayed eager call
copies nothing: not its inputs into the graph's fixed buffers, not its output out of them.

A routed call's graph reads its inputs only in its publishes (``ring_publish_tensors``, or ``ring_publish_copy`` between
an open and a close; ``moe_local_route`` and ``moe_local_scatter`` where a one-rank call plans its rows itself) and
writes its output only in its reduction (``moe_combine_reduce``); each takes an argument struct
(:class:`chunkring.jit.ArgStruct`). At capture, some
of those structs' pointer fields hold addresses inside the fixed buffers. Per call, a rebinding sets each such node's
parameters in the instantiated graph to the same struct with every such address moved to the same offset in the call's
own tensor - the buffers and the call's tensors are contiguous with the same rows, so a chunk's offset is the same in
both - and the reduction's row count to the call's. The publishes read no row at or past the device count the replay
writes first, so the rows past a call's own are never read; the reduction writes exactly the call's rows.
``cuGraphExecKernelNodeSetParams`` changes the launches that follow it, never one already enqueued, so a replay still
running is unaffected; what it sets stays until set again, so a node whose struct a call leaves as it is - a caller
that passes the same tensors, or gets the same blocks back from torch's allocator, call after call - is not set.

Only a graph where those fields are all that holds an address inside the fixed buffers is rebound: any other
kernel parameter (a torch kernel's, a tensor map), copy or memset that does makes :func:`rebinding` refuse
(:class:`NotRebindable`), and the replay copies as before. So does a graph with more rebound nodes than
:data:`MAX_NODES`, whose parameter sets would cost the host more than the copies they save.
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from struct import Struct
from typing import TYPE_CHECKING, Any

from chunkring.errors import ChunkringRuntimeError
from chunkring.jit.graph_nodes import graph_nodes, kernel_arguments, node_type, ok, touched_addresses
from chunkring.jit.signatures import KERNEL_ARGS_VERSION
from chunkring.moe._engine.kernel_args import CombineReduceArgs, LocalRouteArgs, LocalScatterArgs
from chunkring.ring.kernel_args import RingPublishArgs

if TYPE_CHECKING:
    import torch

    from chunkring.jit import ArgStruct

__all__ = ["MAX_NODES", "REBOUND", "Move", "NotRebindable", "Rebinding", "moves_in", "rebinding"]

#: Rebound nodes a graph may have at most: each costs the host a parameter set (a few microseconds) per call.
MAX_NODES = 8


@dataclass(frozen=True)
class Rebound:
    """How a kernel's node is rebound: its argument struct, the fields that may hold an address inside a fixed
    buffer, and the field set to the call's row count (None: none)."""

    struct: type[ArgStruct]
    fields: frozenset[str]
    rows: str | None = None

    def words(self, names: Collection[str]) -> frozenset[int]:
        return frozenset(self.struct.names.index(name) for name in names)


_ROWS = frozenset({"x", "x_sf", "topk_idx", "topk_weights"})
_PUBLISH = Rebound(RingPublishArgs, _ROWS)
#: The kernels whose nodes are rebound, by name.
REBOUND: Mapping[str, Rebound] = {"ring_publish_tensors": _PUBLISH, "ring_publish_copy": _PUBLISH,
                                  "moe_local_route": Rebound(LocalRouteArgs, frozenset({"topk_idx", "topk_weights"})),
                                  "moe_local_scatter": Rebound(LocalScatterArgs, frozenset({"x", "x_sf"})),
                                  "moe_combine_reduce": Rebound(CombineReduceArgs, frozenset({"out"}), "tokens")}


class NotRebindable(Exception):
    """A graph :func:`rebinding` cannot rebind, and why."""


@dataclass(frozen=True)
class Move:
    """Word ``word`` of a struct holds an address ``offset`` bytes into fixed buffer ``buffer``."""

    word: int
    buffer: int
    offset: int


def moves_in(words: Sequence[int], extents: Sequence[tuple[int, int]], allowed: Collection[int]) -> list[Move]:
    """Each of ``words`` that lies in one of ``extents`` (a buffer's [start, end) address), as a :class:`Move`; a
    :class:`NotRebindable` if one that does is not at an index in ``allowed``."""
    moves = []
    for index, word in enumerate(words):
        for buffer, (start, end) in enumerate(extents):
            if start <= word < end:
                if index not in allowed:
                    raise NotRebindable(f"word {index} holds an address in fixed buffer {buffer}")
                moves.append(Move(index, buffer, word - start))
    return moves


def _words(blob: bytes) -> list[int]:
    """The 64-bit little-endian words of ``blob`` (a parameter shorter than a word holds no address)."""
    return list(Struct(f"<{len(blob) // 8}Q").unpack_from(blob)) if len(blob) >= 8 else []


@dataclass(frozen=True)
class _Patch:
    """One rebound node: its kernel's name, its handle, its captured parameters, its struct's captured words, the
    words that move and the word set to the row count (None: none)."""

    name: str
    node: Any
    params: Any
    words: tuple[int, ...]
    moves: tuple[Move, ...]
    rows_word: int | None


class Rebinding:
    """The rebound nodes of one instantiated graph (:func:`rebinding`). ``buffers``: which fixed buffers (by index)
    some node reads or writes: a call must bring a tensor for each."""

    def __init__(self, graph_exec: int, patches: Sequence[_Patch]) -> None:
        from cuda.bindings import driver

        self._driver = driver
        self._exec = driver.CUgraphExec(graph_exec)
        self._patches = tuple(patches)
        self.buffers = frozenset(move.buffer for patch in patches for move in patch.moves)
        # Each node's struct as the captured words, in a buffer of its own that every call rewrites in place (the
        # driver copies it at each parameter set), its one parameter pointing there for good.
        self._structs = [(ctypes.c_uint64 * len(patch.words))(*patch.words) for patch in self._patches]
        self._slots = [ctypes.c_void_p(ctypes.addressof(struct)) for struct in self._structs]
        for patch, slot in zip(self._patches, self._slots, strict=True):
            patch.params.kernelParams = ctypes.addressof(slot)
        # Whether the instantiated graph holds each node's struct as it is now (False until set, and after a set the
        # driver refused: the struct was rewritten, the node not).
        self._in_graph = [False] * len(self._patches)

    def __len__(self) -> int:
        return len(self._patches)

    def apply(self, tensors: Sequence[torch.Tensor | None], rows: int) -> None:
        """Point the graph's next launches at ``tensors`` (one per fixed buffer, in their order; each of
        :attr:`buffers` contiguous, with the buffer's rows) and a call of ``rows`` rows: only the nodes whose
        struct the call changes are set."""
        addresses = [0 if t is None else t.data_ptr() for t in tensors]
        if not all(addresses[buffer] for buffer in self.buffers):  # a null base would move an address to its offset
            raise ChunkringRuntimeError(f"a rebound graph reads fixed buffers {sorted(self.buffers)}: a call must "
                                        "bring a tensor for each")
        for index, (patch, struct) in enumerate(zip(self._patches, self._structs, strict=True)):
            changed = not self._in_graph[index]
            for move in patch.moves:
                address = addresses[move.buffer] + move.offset
                if struct[move.word] != address:
                    struct[move.word], changed = address, True
            if patch.rows_word is not None and struct[patch.rows_word] != rows:
                struct[patch.rows_word], changed = rows, True
            if not changed:
                continue
            self._in_graph[index] = False
            try:
                ok(self._driver.cuGraphExecKernelNodeSetParams(self._exec, patch.node, patch.params))
            except RuntimeError as error:
                raise ChunkringRuntimeError(f"setting {patch.name}'s node parameters: {error}") from None
            self._in_graph[index] = True


def rebinding(graph: torch.cuda.CUDAGraph, buffers: Sequence[torch.Tensor], rows: int, *,
              must_move: Collection[int] = ()) -> Rebinding:
    """The rebinding of ``graph`` (captured with ``keep_graph=True`` over its fixed ``buffers``, contiguous tensors,
    for calls of ``rows`` rows; instantiated); a :class:`NotRebindable` where a node other than a rebound field holds
    an address inside one, where a buffer of ``must_move`` is in no rebound field, past :data:`MAX_NODES` rebound
    nodes, or where the driver refuses to set a rebound node's parameters (tried once, to the captured values)."""
    extents = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in buffers]
    patches = []
    for node in graph_nodes(graph.raw_cuda_graph()):
        kind = node_type(node)
        if kind == "kernel":
            try:
                name, params, arguments = kernel_arguments(node)
            except RuntimeError as error:
                raise NotRebindable(f"a kernel node's parameters cannot be read: {error}") from None
            patch = _patch(name, node, params, arguments, extents)
            if patch is not None:
                patches.append(patch)
        elif kind in ("memcpy", "memset"):
            if any(start <= address < end for address in touched_addresses(node) for start, end in extents):
                raise NotRebindable(f"a {kind} node touches a fixed buffer")
        elif kind not in ("empty", "event_record", "wait_event"):
            raise NotRebindable(f"a {kind} node, which is not read")
    moved = {move.buffer for patch in patches for move in patch.moves}
    if missing := set(must_move) - moved:
        raise NotRebindable(f"fixed buffers {sorted(missing)} are in no rebound field")
    if len(patches) > MAX_NODES:
        raise NotRebindable(f"{len(patches)} nodes to rebind, past {MAX_NODES}")
    bound = Rebinding(graph.raw_cuda_graph_exec(), patches)
    try:  # every node set once to what it holds: a node the driver will not set refuses the graph here, not mid-call
        bound.apply(buffers, rows)
    except ChunkringRuntimeError as error:
        raise NotRebindable(str(error)) from None
    return bound


def _patch(name: str, node: Any, params: Any, arguments: list[bytes],
           extents: Sequence[tuple[int, int]]) -> _Patch | None:
    """A kernel node's patch (None: it holds no address inside a fixed buffer); a :class:`NotRebindable` where it
    holds one anywhere but in its kernel's rebound fields."""
    rebound = REBOUND.get(name)
    if rebound is None or len(arguments) != 1:
        for index, blob in enumerate(arguments):
            try:
                moves_in(_words(blob), extents, ())
            except NotRebindable as error:
                raise NotRebindable(f"{name}'s parameter {index}: {error}") from None
        return None
    words = _words(arguments[0])
    if len(arguments[0]) != rebound.struct.nbytes or words[:2] != [KERNEL_ARGS_VERSION, rebound.struct.nbytes]:
        raise NotRebindable(f"{name}'s parameter is not the {rebound.struct.__name__} this build mirrors")
    try:
        moves = moves_in(words, extents, rebound.words(rebound.fields))
    except NotRebindable as error:
        raise NotRebindable(f"{name}: {error}") from None
    if not moves:
        return None
    rows_word = None if rebound.rows is None else rebound.struct.names.index(rebound.rows)
    return _Patch(name, node, params, tuple(words), tuple(moves), rows_word)
