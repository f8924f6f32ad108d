"""How a captured call graph is pointed at each call's own tensors (chunkring.moe._engine.rebind), on the CPU with
stand-in graph nodes: the publishes' row fields and the reduction's output move to the same offset in the call's
tensors and the reduction's row count becomes the call's; anything else that holds an address inside a fixed buffer
(another kernel's parameter, a field of a rebound kernel that is not rebound, a copy, a memset) refuses the graph, as
do an unreadable node, a struct this build does not mirror, a buffer that must move and does not, too many nodes, and
a node the driver will not set (each is set once at the capture, to what it holds); a call sets only the nodes whose
struct it changes, and a node the driver refused again.
tests/gpu/test_call_replay_gpu.py replays rebound graphs on the GPU against calls launched kernel by kernel."""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from chunkring.errors import ChunkringRuntimeError
from chunkring.jit.signatures import KERNEL_ARGS_VERSION
from chunkring.moe._engine import rebind
from chunkring.moe._engine.kernel_args import CombineReduceArgs
from chunkring.moe._engine.rebind import MAX_NODES, Move, NotRebindable, moves_in, rebinding
from chunkring.ring.kernel_args import RingPublishArgs

#: Four input buffers and the output, each at its own made-up address range.
BUFFERS = [(0x7F00_0000_0000 + i * 0x10_0000, 0x1000) for i in range(5)]  # (start, bytes)
X, X_SF, IDX, W, OUT = (start for start, _ in BUFFERS)
COUNT, DESC, COMBINE = 0x7E00_0000_0000, 0x7E00_0010_0000, 0x7E00_0020_0000


class Buffer:
    """A fixed buffer stand-in: its address and bytes."""

    def __init__(self, start: int, nbytes: int) -> None:
        self.start, self.nbytes = start, nbytes

    def data_ptr(self) -> int:
        return self.start

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1


def struct_bytes(args: type, **values: int) -> bytes:
    words = [KERNEL_ARGS_VERSION, args.nbytes] + [values.get(name, 0) for name in args.names[2:]]
    return struct.pack(f"<{len(words)}Q", *words)


def publish(base_row: int, row_bytes: int = 0x80) -> bytes:
    return struct_bytes(RingPublishArgs, desc=DESC, x=X + base_row * row_bytes, x_sf=X_SF + base_row * 4,
                        topk_idx=IDX + base_row * 8, topk_weights=W + base_row * 8, n_tokens=8,
                        token_base=base_row, end_of_stream=1, valid_tokens=COUNT, batch_rows=8)


def reduce(rows: int = 8) -> bytes:
    return struct_bytes(CombineReduceArgs, desc=DESC, combine=COMBINE, routing=COMBINE + 0x1000,
                        weights=COMBINE + 0x2000, out=OUT, tokens=rows, topk=4, hidden=128)


@dataclass
class Node:
    kind: str
    name: str = ""
    arguments: list[bytes] = field(default_factory=list)
    touched: list[int] = field(default_factory=list)
    params: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(kernelParams=0))


class Graph:
    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes

    def raw_cuda_graph(self) -> list[Node]:
        return self.nodes

    def raw_cuda_graph_exec(self) -> int:
        return 0x1234


class Driver:
    """Records each parameter set: the node and the struct's words the driver would copy."""

    def __init__(self) -> None:
        self.sets: list[tuple[Node, list[int]]] = []
        self.refuse = ""  # the kernel whose node the driver refuses to set

    def cuGraphExecKernelNodeSetParams(self, graph_exec: int, node: Node, params: SimpleNamespace):  # noqa: N802
        assert int(graph_exec) == 0x1234
        slot = ctypes.c_void_p.from_address(params.kernelParams).value
        words = len(node.arguments[0]) // 8
        if node.name == self.refuse:
            return (1,)
        self.sets.append((node, list((ctypes.c_uint64 * words).from_address(slot))))
        return (0,)


@pytest.fixture
def driver(monkeypatch) -> Driver:
    monkeypatch.setattr(rebind, "graph_nodes", lambda graph: graph)
    monkeypatch.setattr(rebind, "node_type", lambda node: node.kind)
    monkeypatch.setattr(rebind, "touched_addresses", lambda node: node.touched)

    def kernel_arguments(node: Node):
        if node.name == "unreadable":
            raise RuntimeError("the node keeps its parameters as `extra` only")
        return node.name, node.params, node.arguments

    monkeypatch.setattr(rebind, "kernel_arguments", kernel_arguments)

    def ok(result: tuple) -> None:
        if result[0]:
            raise RuntimeError("CUDA driver call failed: <CUresult.CUDA_ERROR_INVALID_VALUE: 1>")

    monkeypatch.setattr(rebind, "ok", ok)
    fake = Driver()
    monkeypatch.setattr(rebind.Rebinding, "__init__", _init_with(fake))
    return fake


def _init_with(fake: Driver):
    real = rebind.Rebinding.__init__

    def init(self, graph_exec: int, patches) -> None:
        real(self, graph_exec, patches)
        self._driver = fake

    return init


def buffers() -> list[Buffer]:
    return [Buffer(start, nbytes) for start, nbytes in BUFFERS]


def call_graph(*extra: Node) -> Graph:
    """A batch-ready call's graph: a publish, torch's and the consumer's kernels, the reduction."""
    count_fill = Node("kernel", "at::native::vectorized_elementwise_kernel", [struct.pack("<QI", COUNT, 7)])
    return Graph([Node("kernel", "ring_publish_tensors", [publish(0)]), count_fill,
                  Node("kernel", "moe_pull", [struct.pack("<Q", DESC), struct.pack("<i", 3)]),
                  Node("event_record"), Node("memset", touched=[COMBINE]), *extra,
                  Node("kernel", "moe_combine_reduce", [reduce()])])


def test_moves_are_the_words_inside_a_buffer_at_their_offsets():
    extents = [(10, 20), (30, 40)]
    assert moves_in([5, 12, 30, 39, 40], extents, {1, 2, 3}) == [Move(1, 0, 2), Move(2, 1, 0), Move(3, 1, 9)]
    with pytest.raises(NotRebindable, match="word 1 holds an address in fixed buffer 0"):
        moves_in([5, 12], extents, {0})


def test_a_call_graph_rebinds_its_publish_and_reduction_to_the_calls_tensors(driver):
    graph = call_graph()
    bound = rebinding(graph, buffers(), 8, must_move=(0, 4))
    assert len(bound) == 2 and bound.buffers == {0, 1, 2, 3, 4}
    captured = [struct.unpack(f"<{len(n.arguments[0]) // 8}Q", n.arguments[0]) for n in graph.nodes if n.name in
                rebind.REBOUND]
    assert [tuple(words) for _, words in driver.sets] == captured, "each node set once to what it holds"
    driver.sets.clear()
    own = [Buffer(0x6000_0000 + i * 0x1000, 0x100) for i in range(5)]
    bound.apply(own, 5)
    (pub_node, pub), (red_node, red) = driver.sets
    assert pub_node.name == "ring_publish_tensors" and red_node.name == "moe_combine_reduce"
    names = RingPublishArgs.names
    assert [pub[names.index(f)] for f in ("x", "x_sf", "topk_idx", "topk_weights")] == [t.start for t in own[:4]]
    assert pub[names.index("valid_tokens")] == COUNT and pub[names.index("n_tokens")] == 8, "the rest as captured"
    assert pub[:2] == [KERNEL_ARGS_VERSION, RingPublishArgs.nbytes]
    names = CombineReduceArgs.names
    assert red[names.index("out")] == own[4].start and red[names.index("tokens")] == 5
    assert red[names.index("combine")] == COMBINE and red[names.index("hidden")] == 128
    # The next call's set holds only its own addresses and rows (each node's struct is rewritten in place).
    driver.sets.clear()
    other = [Buffer(0x5000_0000 + i * 0x1000, 0x100) for i in range(5)]
    bound.apply(other, 3)
    (_, pub), (_, red) = driver.sets
    assert pub[RingPublishArgs.names.index("x")] == other[0].start
    assert (red[names.index("out")], red[names.index("tokens")]) == (other[4].start, 3)


def test_a_node_is_set_only_where_the_call_changes_its_struct(driver):
    bound = rebinding(call_graph(), buffers(), 8, must_move=(0, 4))
    own = [Buffer(0x6000_0000 + i * 0x1000, 0x100) for i in range(5)]
    bound.apply(own, 5)
    driver.sets.clear()
    bound.apply(own, 5)
    assert driver.sets == [], "the graph holds both structs already"
    bound.apply(own, 6)
    assert [node.name for node, _ in driver.sets] == ["moe_combine_reduce"], "only the row count changed"
    driver.sets.clear()
    moved = [*own[:4], Buffer(0x5000_0000, 0x100)]
    bound.apply(moved, 6)
    assert [(node.name, words[CombineReduceArgs.names.index("out")]) for node, words in driver.sets] == [
        ("moe_combine_reduce", 0x5000_0000)]
    driver.sets.clear()
    driver.refuse = "ring_publish_tensors"
    with pytest.raises(ChunkringRuntimeError, match="ring_publish_tensors"):
        bound.apply(buffers(), 6)
    driver.refuse = ""
    bound.apply(buffers(), 6)
    assert [node.name for node, _ in driver.sets] == ["ring_publish_tensors", "moe_combine_reduce"], (
        "the refused node set again, and the one the refusal left unset")
    driver.sets.clear()
    bound.apply(buffers(), 6)
    assert driver.sets == []


def test_a_later_chunk_keeps_its_offset_in_the_calls_rows(driver):
    graph = call_graph(Node("kernel", "ring_publish_copy", [publish(16)]))
    bound = rebinding(graph, buffers(), 8, must_move=(0, 4))
    driver.sets.clear()
    own = [Buffer(0x6000_0000 + i * 0x10_0000, 0x10_0000) for i in range(5)]
    bound.apply(own, 20)
    chunk = next(words for node, words in driver.sets if node.name == "ring_publish_copy")
    names = RingPublishArgs.names
    assert chunk[names.index("x")] == own[0].start + 16 * 0x80 and chunk[names.index("topk_idx")] == own[2].start + 128


@pytest.mark.parametrize("extra, reason", [
    (Node("kernel", "at::native::copy_kernel", [struct.pack("<QQ", 1, X + 64)]), "copy_kernel's parameter 0: word 1"),
    (Node("memcpy", touched=[OUT + 8, COMBINE]), "a memcpy node touches a fixed buffer"),
    (Node("memset", touched=[X_SF]), "a memset node touches a fixed buffer"),
    (Node("kernel", "unreadable"), "cannot be read"),
    (Node("graph"), "a graph node, which is not read"),
    (Node("kernel", "moe_combine_reduce", [struct_bytes(CombineReduceArgs, combine=X)]), "moe_combine_reduce: word 3"),
    (Node("kernel", "ring_publish_tensors", [publish(0)[:-8]]), "not the RingPublishArgs this build mirrors"),
])
def test_anything_else_that_holds_a_fixed_address_refuses_the_graph(driver, extra, reason):
    with pytest.raises(NotRebindable, match=reason):
        rebinding(call_graph(extra), buffers(), 8, must_move=(0, 4))


def test_a_node_the_driver_will_not_set_refuses_the_graph_at_its_capture(driver):
    driver.refuse = "moe_combine_reduce"
    with pytest.raises(NotRebindable, match="setting moe_combine_reduce's node parameters: .*INVALID_VALUE"):
        rebinding(call_graph(), buffers(), 8, must_move=(0, 4))


def test_a_buffer_that_must_move_and_does_not_refuses_the_graph(driver):
    graph = Graph([Node("kernel", "ring_publish_tensors", [publish(0)])])
    with pytest.raises(NotRebindable, match=r"fixed buffers \[4\] are in no rebound field"):
        rebinding(graph, buffers(), 8, must_move=(0, 4))


def test_more_nodes_than_a_parameter_set_is_worth_refuse_the_graph(driver):
    chunks = [Node("kernel", "ring_publish_tensors", [publish(row)]) for row in range(1, MAX_NODES)]
    with pytest.raises(NotRebindable, match=f"{MAX_NODES + 1} nodes to rebind"):
        rebinding(call_graph(*chunks), buffers(), 8, must_move=(0, 4))


def test_a_call_without_a_tensor_a_rebound_node_reads_is_refused_before_any_set(driver):
    bound = rebinding(call_graph(), buffers(), 8, must_move=(0, 4))
    driver.sets.clear()
    own: list = [Buffer(0x6000_0000 + i * 0x1000, 0x100) for i in range(5)]
    own[1] = None
    with pytest.raises(Exception, match="must bring a tensor for each"):
        bound.apply(own, 5)
    assert driver.sets == []


def test_the_real_structs_name_the_fields_rebound():
    for rebound in rebind.REBOUND.values():
        assert rebound.fields <= set(rebound.struct.names)
        assert rebound.rows is None or rebound.rows in rebound.struct.names
