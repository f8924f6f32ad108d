"""What a captured CUDA graph's nodes hold, read through the driver (cuda.bindings): its nodes by type, its kernel
nodes (the function's name, the context the node runs in, each parameter's bytes as the node keeps them) and the
addresses its copy and memset nodes touch. The replayed eager calls read them to point a graph at a call's own
tensors (:mod:`chunkring.moe._engine.rebind`); a test checks where a captured call's kernels run and a probe times
its launch (benchmarks/probe_graph_launch.py). The graph handle is ``torch.cuda.CUDAGraph.raw_cuda_graph()`` of a
graph captured with ``keep_graph=True``."""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass
from typing import Any

__all__ = ["KernelNode", "graph_nodes", "kernel_arguments", "kernel_nodes", "named_kernel_nodes", "node_type",
           "node_types", "ok", "root_nodes", "touched_addresses"]


def ok(result: tuple) -> Any:
    """The values a cuda.bindings driver call returned after its status (None, one value, or a tuple of them), or a
    ``RuntimeError`` naming a failed status."""
    from cuda.bindings import driver

    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


@dataclass(frozen=True)
class KernelNode:
    """One kernel node: the function's name, the ``CUcontext`` the driver recorded for it (0: none), and the bytes of
    its device-side parameters (the last one's end)."""

    name: str
    ctx: int
    param_bytes: int


def graph_nodes(graph_handle: int) -> list[Any]:
    """Every node of the graph (``CUgraphNode``), in the driver's order."""
    from cuda.bindings import driver

    graph = driver.CUgraph(graph_handle)
    _, count = ok(driver.cuGraphGetNodes(graph, 0))
    nodes, _ = ok(driver.cuGraphGetNodes(graph, count))
    return list(nodes)


def node_type(node: Any) -> str:
    """The node's type as the driver names it, lower case without its prefix: ``kernel``, ``memcpy``, ``memset``,
    ``empty``, ``event_record``, ``wait_event``, ``graph`` (a child graph), ..."""
    from cuda.bindings import driver

    return ok(driver.cuGraphNodeGetType(node)).name.removeprefix("CU_GRAPH_NODE_TYPE_").lower()


def node_types(graph_handle: int) -> dict[str, int]:
    """How many nodes of each type the graph has (``kernel``, ``memset``, ``empty``, ``event_record``, ...)."""
    return dict(Counter(node_type(node) for node in graph_nodes(graph_handle)))


def kernel_nodes(graph_handle: int) -> list[KernelNode]:
    """Every kernel node of the graph, in the driver's order."""
    return [_kernel_node(node) for node in graph_nodes(graph_handle) if node_type(node) == "kernel"]


def named_kernel_nodes(graph_handle: int, names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The graph's kernel nodes whose function's name is one of ``names``, as (name, ``CUgraphNode``) pairs in the
    driver's order: the handles ``cuGraphKernelNodeGetParams`` and ``cuGraphExecKernelNodeSetParams`` take."""
    picked = []
    for node in graph_nodes(graph_handle):
        if node_type(node) == "kernel":
            name = _kernel_node(node).name
            if name in names:
                picked.append((name, node))
    return picked


def root_nodes(graph_handle: int) -> list[str]:
    """The graph's nodes that depend on none: a kernel node by its function's name, any other by its type."""
    from cuda.bindings import driver

    graph = driver.CUgraph(graph_handle)
    _, count = ok(driver.cuGraphGetRootNodes(graph, 0))
    roots, _ = ok(driver.cuGraphGetRootNodes(graph, count))
    return [_kernel_node(node).name if node_type(node) == "kernel" else node_type(node) for node in roots]


def kernel_arguments(node: Any) -> tuple[str, Any, list[bytes]]:
    """A kernel node's function name, its parameters as captured (``CUDA_KERNEL_NODE_PARAMS``, what
    ``cuGraphExecKernelNodeSetParams`` takes back) and each kernel parameter's bytes as the node keeps them. A
    ``RuntimeError`` where the driver does not say (no parameter sizes, or the parameters only as ``extra``)."""
    name, params, layout = _kernel(node)
    if layout is None:
        raise RuntimeError("the bindings cannot ask for a kernel's parameter sizes")
    if layout and not params.kernelParams:
        raise RuntimeError("the node keeps its parameters as `extra` only")
    # The node's own copy of each argument, which the driver keeps until the node's parameters are set again.
    slots = ctypes.cast(params.kernelParams, ctypes.POINTER(ctypes.c_void_p))
    return name, params, [ctypes.string_at(slots[i], size) for i, (_, size) in enumerate(layout)]


def touched_addresses(node: Any) -> list[int]:
    """The device addresses a copy node copies from and to, or a memset node sets from (empty for any other)."""
    from cuda.bindings import driver

    kind = node_type(node)
    if kind == "memcpy":
        copy = ok(driver.cuGraphMemcpyNodeGetParams(node))
        return [int(copy.srcDevice), int(copy.dstDevice), int(copy.srcHost or 0), int(copy.dstHost or 0)]
    if kind == "memset":
        return [int(ok(driver.cuGraphMemsetNodeGetParams(node)).dst)]
    return []


def _kernel(node: Any) -> tuple[str, Any, list[tuple[int, int]] | None]:
    """A kernel node's function name, its parameters (``CUDA_KERNEL_NODE_PARAMS``) and its parameters' layout
    (:func:`_param_layout`)."""
    from cuda.bindings import driver

    params = ok(driver.cuGraphKernelNodeGetParams(node))
    # A library's kernel may be recorded as its CUkernel rather than a CUfunction.
    function, get_name, get_param = ((params.func, driver.cuFuncGetName, driver.cuFuncGetParamInfo)
                                     if int(params.func) else
                                     (params.kern, driver.cuKernelGetName, driver.cuKernelGetParamInfo))
    name = ok(get_name(function))
    return (name.decode() if isinstance(name, bytes) else str(name)), params, _param_layout(get_param, function)


def _kernel_node(node: Any) -> KernelNode:
    name, params, layout = _kernel(node)
    return KernelNode(name, int(params.ctx),
                      -1 if layout is None else max((offset + size for offset, size in layout), default=0))


#: A kernel's parameters take at most this many bytes, so it has at most as many parameters.
_MAX_PARAM_BYTES = 32764


def _param_layout(get_param: Any, function: Any) -> list[tuple[int, int]] | None:
    """Each of ``function``'s parameters as (offset, size), as ``get_param`` (``cuFuncGetParamInfo`` or
    ``cuKernelGetParamInfo``) reports them - it answers a status other than success past the last one; None where
    the bindings cannot ask."""
    from cuda.bindings import driver

    layout: list[tuple[int, int]] = []
    try:
        for index in range(_MAX_PARAM_BYTES + 1):
            err, offset, size = get_param(function, index)
            if err != driver.CUresult.CUDA_SUCCESS:
                return layout
            layout.append((int(offset), int(size)))
    except (TypeError, ValueError, AttributeError):
        return None
    raise RuntimeError(f"the driver reports more than {_MAX_PARAM_BYTES} parameters")
