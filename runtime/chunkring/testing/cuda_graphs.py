"""What a captured CUDA graph holds, read through the driver (cuda.bindings): its nodes by type and its kernel nodes
(the function's name, the context the node runs in, its parameter bytes) - for the test that checks where a captured
call's kernels run and the probe that times its launch (benchmarks/probe_graph_launch.py). The graph handle is
``torch.cuda.CUDAGraph.raw_cuda_graph()`` of a graph captured with ``keep_graph=True``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

__all__ = ["KernelNode", "kernel_nodes", "named_kernel_nodes", "node_types", "ok", "root_nodes"]


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


def _nodes(graph_handle: int) -> list[Any]:
    from cuda.bindings import driver

    graph = driver.CUgraph(graph_handle)
    _, count = ok(driver.cuGraphGetNodes(graph, 0))
    nodes, _ = ok(driver.cuGraphGetNodes(graph, count))
    return list(nodes)


def _type(node: Any) -> str:
    from cuda.bindings import driver

    return ok(driver.cuGraphNodeGetType(node)).name.removeprefix("CU_GRAPH_NODE_TYPE_").lower()


def node_types(graph_handle: int) -> dict[str, int]:
    """How many nodes of each type the graph has (``kernel``, ``memset``, ``empty``, ``event_record``, ...)."""
    return dict(Counter(_type(node) for node in _nodes(graph_handle)))


def kernel_nodes(graph_handle: int) -> list[KernelNode]:
    """Every kernel node of the graph, in the driver's order."""
    return [_kernel_node(node) for node in _nodes(graph_handle) if _type(node) == "kernel"]


def named_kernel_nodes(graph_handle: int, names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The graph's kernel nodes whose function's name is one of ``names``, as (name, ``CUgraphNode``) pairs in the
    driver's order: the handles ``cuGraphKernelNodeGetParams`` and ``cuGraphExecKernelNodeSetParams`` take."""
    picked = []
    for node in _nodes(graph_handle):
        if _type(node) == "kernel":
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
    return [_kernel_node(node).name if _type(node) == "kernel" else _type(node) for node in roots]


def _kernel_node(node: Any) -> KernelNode:
    from cuda.bindings import driver

    params = ok(driver.cuGraphKernelNodeGetParams(node))
    # A library's kernel may be recorded as its CUkernel rather than a CUfunction.
    function, get_name, get_param = ((params.func, driver.cuFuncGetName, driver.cuFuncGetParamInfo)
                                     if int(params.func) else
                                     (params.kern, driver.cuKernelGetName, driver.cuKernelGetParamInfo))
    name = ok(get_name(function))
    return KernelNode(name.decode() if isinstance(name, bytes) else str(name), int(params.ctx),
                      _param_bytes(get_param, function))


#: A kernel's parameters take at most this many bytes, so it has at most as many parameters.
_MAX_PARAM_BYTES = 32764


def _param_bytes(get_param: Any, function: Any) -> int:
    """The end of ``function``'s last parameter as ``get_param`` (``cuFuncGetParamInfo`` or ``cuKernelGetParamInfo``)
    reports it, which answers a status other than success past the last one; -1 where the bindings cannot ask."""
    from cuda.bindings import driver

    end = 0
    try:
        for index in range(_MAX_PARAM_BYTES + 1):
            err, offset, size = get_param(function, index)
            if err != driver.CUresult.CUDA_SUCCESS:
                return end
            end = offset + size
    except (TypeError, ValueError, AttributeError):
        return -1
    raise RuntimeError(f"the driver reports more than {_MAX_PARAM_BYTES} parameters")
