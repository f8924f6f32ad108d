"""What the host pays to launch one MoE layer call's CUDA graph: torch's ``CUDAGraph.replay()`` against the driver's
``cuGraphLaunch`` of the same graph, and both against a graph of as many plain kernels on one stream.

    python -m benchmarks.probe_graph_launch [--shape flash] [--tokens 1] [--samples 50] [--max-tokens 128] [--json PATH]

One rank. An eager call replayed from the layer's graph (``MoELayer(eager_graphs=True)``) spends about half its host
time in ``graph.replay()`` (a cProfile of bench_eager): this says whether that is the graph's own launch cost - its
node count, its branches over the call's streams, its node types - or torch's wrapper around it. Sides, each the
median host time of ``--samples`` launches, every launch enqueued behind a device-side delay (nothing of it runs
while the host issues it, and the launch queue never fills):

* ``layer_torch_us``: ``graph.replay()`` of ``MoELayer.run`` (batch-ready, pre-routed FP8 input) captured by torch;
* ``layer_driver_us``: ``cuGraphLaunch`` of the same captured graph, instantiated and uploaded by the driver here;
* ``plain_torch_us`` / ``plain_driver_us``: the same two launches of a graph of as many one-block torch kernels as the
  layer's graph has kernel nodes, one after another on one stream; ``plain2_*``: the same kernels on two streams
  forked from the capturing stream and joined back (a layer call's shape);
* ``run_replayed_us``: the whole eager ``MoELayer.run`` as a caller makes it, replayed from the layer's own graph;
* ``layer_patched_driver_us``: ``cuGraphLaunch`` after setting the publish's and the reduction's node parameters
  in the instantiated graph (their own again): the launch of a replay that would point the graph at a call's inputs
  and output instead of copying them;
* ``replay_ops_us``: the torch work such a call issues around its graph's launch, made here on buffers of the same
  shapes - its four input copies into the first rows of ``--max-tokens``-row buffers, the token count's fill and the
  output's clone - so ``run_replayed_us`` minus this and ``layer_torch_us`` is the layer's Python;
* ``run_replayed_after_barrier_us`` / ``run_replayed_after_idle_us``: ``run_replayed_us`` with each sample after a
  ranks' barrier (bench_eager's settle before each of its samples) / after the host slept ``GATE_MS``: whether the
  state a sample starts from, not the call, makes bench_eager's host issue several times this probe's;
* ``<side>_again_us``: a launch right after an untimed one of the same graph, which still waits behind the delay:
  about the delay (``GATE_MS``) where the driver makes a launch wait for the graph's previous one, as the calls back
  to back of bench_eager's profile suggest at 128 tokens.

``green_publish_sets`` (``--green``): which ways the driver lets a replay set the publish nodes of a streamed call
whose later chunks publish on the partition's stream (a green context's), the nodes the eager replay cannot rebind
today (``CUDA_ERROR_INVALID_VALUE``, so such a graph copies): a streamed ``run`` of ``--max-tokens`` tokens in chunks
of a quarter slot captured, each publish node set in the instantiated graph to its own captured parameters through
``cuGraphExecKernelNodeSetParams`` as captured (``kernel``), with the parameters' context cleared (``kernel_no_ctx``),
and through ``cuGraphExecNodeSetParams`` (``node``); per node its context, whether it names a function or a library
kernel, and each way's status (the context cleared first, so that a way that succeeds after it puts the node back).
The graph's replay must then equal the eager call bit for bit.

The record also counts the layer graph's nodes by type, its dependency edges, its kernel nodes' parameter bytes
(DeepGEMM's kernels and the persistent consumer take tensor maps by value) and how many contexts they run in
(``contexts``: a batch-ready call runs on two ordinary streams, so 1 unless a kernel runs elsewhere). Both layer
launches must give the eager call's output bit for bit (``bitwise``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import chunkring
from benchmarks.bench_eager import Gate, host_issue_sample
from benchmarks.bench_overlap import SHAPES, Shape
from chunkring.jit.graph_nodes import kernel_nodes, named_kernel_nodes, node_types, ok, root_nodes
from chunkring.testing import records as result_records

GATE_MS = 5.0
#: The nodes a replay would point at a call's own tensors, one of each group: the publish reads the inputs and the
#: row count (one kernel for a small batch, else its copy kernel between an open and a close), the reduction writes
#: the output.
PATCHED_NODES = (("ring_publish_tensors", "ring_publish_copy"), ("moe_combine_reduce",))


def host_us(launch: Callable[[], object], gate: Callable[[], Callable[[], bool]], samples: int, *,
            again: bool = False, before: Callable[[], object] | None = None) -> float:
    """The median host time of ``launch()`` (bench_eager's :func:`host_issue_sample`), each sample behind a
    device-side delay (``gate``, a :class:`Gate`), the device idle between samples. ``again``: time a second launch
    right after an untimed first, while the first still waits behind the delay (a launch that waits for the graph's
    previous launch to finish takes about the delay). ``before``: called ahead of each sample, the device idle."""

    def gated() -> Callable[[], bool]:
        ran_out = gate()
        if again:
            launch()
        return ran_out

    times = []
    for _ in range(samples):
        if before is not None:
            before()
        ms, _ = host_issue_sample(launch, gated)
        times.append(ms * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def captured(call: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``call`` captured by torch, kept as a graph (torch's instance, instantiated) and its output."""
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = call()
    graph.instantiate()
    return graph, out


class DriverGraph:
    """A torch-captured graph instantiated and uploaded by the driver, launched with ``cuGraphLaunch`` on torch's
    current stream. The torch graph keeps the memory its nodes use: keep it alive, and never launch both at once."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.graph = driver.CUgraph(graph.raw_cuda_graph())
        self.exec = ok(driver.cuGraphInstantiate(self.graph, 0))
        self.stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        ok(driver.cuGraphUpload(self.exec, self.stream))

    def launch(self) -> None:
        ok(self.driver.cuGraphLaunch(self.exec, self.stream))

    def patched_launch(self, groups: tuple[tuple[str, ...], ...]) -> Callable[[], None]:
        """A launch that first sets the parameters of one kernel node of each group of names in the instantiated
        graph (``cuGraphExecKernelNodeSetParams``, each node's captured parameters again): what a replay that points
        the graph at a call's own inputs and output instead of copying them would pay on top of the launch."""
        nodes = []
        for names in groups:
            found = named_kernel_nodes(int(self.graph), names)
            if len(found) != 1:
                raise RuntimeError(f"expected one kernel node of {names} in the graph, found {len(found)}")
            nodes.append((found[0][1], ok(self.driver.cuGraphKernelNodeGetParams(found[0][1]))))

        def launch() -> None:
            for node, params in nodes:
                ok(self.driver.cuGraphExecKernelNodeSetParams(self.exec, node, params))
            ok(self.driver.cuGraphLaunch(self.exec, self.stream))

        return launch

    def shape(self) -> dict[str, int | str]:
        """The graph's nodes by type (``nodes_<type>``), its dependency edges (``edges``), the bytes of its kernel
        nodes' parameters (``param_bytes``, the largest ``param_bytes_max``; -1 where the driver does not say), the
        contexts its kernels run in and its root nodes (``roots``: a layer call's publish and consumer reset, unless
        one waits for the other)."""
        handle = int(self.graph)
        types = node_types(handle)
        kernels = kernel_nodes(handle)
        param_bytes = [node.param_bytes for node in kernels]
        try:
            edges = int(ok(self.driver.cuGraphGetEdges(self.graph, 0))[-1])
        except (RuntimeError, TypeError, ValueError) as error:  # the count is context, not the probe's point
            print(f"probe_graph_launch: no edge count ({error!r}); recorded as -1", flush=True)
            edges = -1
        return {"nodes": sum(types.values()), **{f"nodes_{kind}": n for kind, n in types.items()},
                "param_bytes": -1 if -1 in param_bytes else sum(param_bytes),
                "param_bytes_max": max(param_bytes, default=0), "edges": edges,
                "contexts": len({node.ctx for node in kernels}), "roots": ",".join(root_nodes(handle))}

    def close(self) -> None:
        ok(self.driver.cuGraphExecDestroy(self.exec))


def plain_graph(kernels: int, branches: int = 1) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of ``kernels`` one-element increments, split over ``branches`` streams forked from and joined to the
    capturing stream (as a layer call's producer and consumer streams are), and the tensor they add to."""
    cells = torch.zeros(branches, dtype=torch.int32, device="cuda")
    cells[0].add_(1)  # load the kernel the capture records, outside it
    streams = [torch.cuda.Stream() for _ in range(branches)]
    torch.cuda.synchronize()

    def issue() -> None:
        caller = torch.cuda.current_stream()
        for b, stream in enumerate(streams):
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                for _ in range(kernels * (b + 1) // branches - kernels * b // branches):
                    cells[b].add_(1)
        for stream in streams:
            caller.wait_stream(stream)

    graph, _ = captured(issue)
    return graph, cells


def replay_ops(rows: int, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The torch work a replayed eager call issues besides its graph's launch (``CallGraphs.replay``): each input
    copied into the first rows of a buffer of ``rows`` rows, the token count filled in, the output's rows cloned."""
    buffers = [torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in inputs]
    count = torch.zeros(1, dtype=torch.int32, device=out.device)
    fixed_out = torch.empty((rows, *out.shape[1:]), dtype=out.dtype, device=out.device)
    n = out.shape[0]

    def issue() -> torch.Tensor:
        for buffer, t in zip(buffers, inputs, strict=True):
            buffer[:n].copy_(t)
        count.fill_(n)
        return fixed_out[:n].clone()

    return issue


def probe(shape: Shape, tokens: int, samples: int, gate: Gate, barrier: Callable[[], object]) -> dict:
    _, (x, x_sf, idx, w) = shape.inputs(tokens)
    layer = shape.layer

    def run() -> torch.Tensor:
        return layer.run(x, x_sf, idx, w, shape.w13, shape.w2)

    eager = run()  # the mode's first call: warm-up and barrier, then the layer's replay graph captured
    run()  # the first replay
    torch.cuda.synchronize()
    graph, out = captured(run)
    driver_graph = DriverGraph(graph)
    rec: dict = {"tokens": tokens, **driver_graph.shape()}
    try:
        graph.replay()
        torch.cuda.synchronize()
        bitwise = torch.equal(out, eager)
        out.zero_()
        driver_graph.launch()
        torch.cuda.synchronize()
        rec["bitwise"] = bitwise and torch.equal(out, eager)
        layer.check()
        rec["layer_torch_us"] = host_us(graph.replay, gate, samples)
        rec["layer_driver_us"] = host_us(driver_graph.launch, gate, samples)
        rec["layer_torch_again_us"] = host_us(graph.replay, gate, samples, again=True)
        rec["layer_driver_again_us"] = host_us(driver_graph.launch, gate, samples, again=True)
        try:
            patched = driver_graph.patched_launch(PATCHED_NODES)
        except RuntimeError as error:  # the other figures stand without this one
            print(f"probe_graph_launch: no patched launch ({error}); recorded as -1", flush=True)
            rec["layer_patched_driver_us"] = -1.0
        else:
            rec["layer_patched_driver_us"] = host_us(patched, gate, samples)
            out.zero_()
            patched()
            torch.cuda.synchronize()
            rec["bitwise"] = rec["bitwise"] and torch.equal(out, eager)
        rec["run_replayed_us"] = host_us(run, gate, samples)
        # bench_eager's host issue samples each call after the ranks met (its settle) and after the other sides'
        # calls: the same call after a barrier, and after the host idled as long as a gated sample keeps it waiting.
        rec["run_replayed_after_barrier_us"] = host_us(run, gate, samples, before=barrier)
        rec["run_replayed_after_idle_us"] = host_us(run, gate, samples, before=partial(time.sleep, GATE_MS / 1e3))
        rec["replay_ops_us"] = host_us(replay_ops(shape.layer.config.max_tokens_per_rank, (x, x_sf, idx, w), out),
                                       gate, samples)
        layer.check()
    finally:
        driver_graph.close()
    for branches, side in ((1, "plain"), (2, "plain2")):
        plain, cells = plain_graph(rec.get("nodes_kernel", 1), branches)
        plain_driver = DriverGraph(plain)
        try:
            rec[f"{side}_torch_us"] = host_us(plain.replay, gate, samples)
            rec[f"{side}_driver_us"] = host_us(plain_driver.launch, gate, samples)
            rec[f"{side}_torch_again_us"] = host_us(plain.replay, gate, samples, again=True)
        finally:
            plain_driver.close()
        del plain, cells
    return rec


#: The ways ``green_publish_sets`` sets a node, in order: the context cleared first, so that a later way that takes
#: the captured parameters puts the node back in its own context before the replay.
SET_WAYS = ("kernel_no_ctx", "kernel", "node")


def _set_node(way: str, graph_exec: Any, node: Any, params: Any) -> str:
    """Set ``node`` in ``graph_exec`` to ``params`` (its own captured ones) ``way``: "ok" or why not."""
    from cuda.bindings import driver

    try:
        if way == "kernel_no_ctx":
            params.ctx = driver.CUcontext(0)
        if way == "node":
            generic = driver.CUgraphNodeParams()
            generic.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
            for field in ("func", "kern", "ctx", "gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY",
                          "blockDimZ", "sharedMemBytes", "kernelParams", "extra"):
                setattr(generic.kernel, field, getattr(params, field))
            (err,) = driver.cuGraphExecNodeSetParams(graph_exec, node, generic)
        else:
            (err,) = driver.cuGraphExecKernelNodeSetParams(graph_exec, node, params)
    except Exception as error:  # a probe: what the bindings refused is the answer
        return f"{type(error).__name__}: {error}"[:200]
    return "ok" if err == driver.CUresult.CUDA_SUCCESS else str(err)


def green_publish_sets(shape: Shape) -> dict:
    """The ``--green`` probe (the module's docstring): a streamed call of the layer's capacity in chunks of a quarter
    slot, captured; every publish node set each way of :data:`SET_WAYS`; the replay against the eager call."""
    from cuda.bindings import driver

    tokens = shape.layer.config.max_tokens_per_rank
    chunk = max(1, shape.slot // 4)
    _, (x, x_sf, idx, w) = shape.inputs(tokens)

    def run() -> torch.Tensor:
        return shape.layer.run(x, x_sf, idx, w, shape.w13, shape.w2, streaming=True, chunk=chunk)

    eager = run()  # the mode's first call (warm-up and barrier) runs outside the capture
    torch.cuda.synchronize()
    graph, out = captured(run)
    graph_exec = driver.CUgraphExec(graph.raw_cuda_graph_exec())
    nodes = []
    for name, node in named_kernel_nodes(graph.raw_cuda_graph(), ("ring_publish_tensors", "ring_publish_copy")):
        params = ok(driver.cuGraphKernelNodeGetParams(node))
        row = {"name": name, "ctx": int(params.ctx), "func": int(params.func) != 0, "kern": int(params.kern) != 0}
        for way in SET_WAYS:  # each way from the captured parameters again
            row[way] = _set_node(way, graph_exec, node, ok(driver.cuGraphKernelNodeGetParams(node)))
        # Whether the node runs where it was captured at the replay below.
        row["own_context"] = row["kernel_no_ctx"] != "ok" or "ok" in (row["kernel"], row["node"])
        nodes.append(row)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    shape.layer.check()
    contexts = {row["ctx"] for row in nodes}
    rec = {"probe": "green_publish_sets", "tokens": tokens, "chunk": chunk, "publish_nodes": len(nodes),
           "publish_contexts": len(contexts), "bitwise": bool(torch.equal(out, eager)),
           "replayed_in_own_contexts": all(row["own_context"] for row in nodes), "per_node": nodes}
    for way in SET_WAYS:
        rec[f"set_{way}_ok"] = sum(row[way] == "ok" for row in nodes)
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="flash", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="the layer's max_tokens_per_rank (at least the largest --tokens), as bench_eager sizes it")
    parser.add_argument("--green", action="store_true",
                        help="also probe the ways to set a streamed call's publish nodes (green_publish_sets)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    runtime = chunkring.init()
    if runtime.world_size != 1:
        raise SystemExit("probe_graph_launch runs at one rank")
    records: list[dict] = []
    try:
        shape = Shape(args.shape, runtime, max(args.max_tokens, *tokens), eager_graphs=True)
        try:
            gate = Gate(GATE_MS)
            for t in tokens:
                rec = {"shape": args.shape, **probe(shape, t, args.samples, gate, runtime.barrier)}
                records.append(rec)
                print(", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()),
                      flush=True)
            if args.green:
                rec = {"shape": args.shape, **green_publish_sets(shape)}
                records.append(rec)
                print(rec, flush=True)
        finally:
            shape.close()
        if args.json:
            figures = {f"{r['shape']}_{r['tokens']}_{k}": v for r in records for k, v in r.items()
                       if k.endswith(("_us", "_ok")) or k.startswith(("nodes_", "param_bytes", "publish_"))
                       or k in ("nodes", "edges", "contexts")}
            failed = sum(not r["bitwise"] for r in records)
            result_records.write(args.json, suite="graph-launch-1rank", world_size=1, figures=figures,
                                 records=records, passed=len(records) - failed, failed=failed)
    finally:
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
