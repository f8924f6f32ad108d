"""One-off probe of DeepGEMM (sgl-deep-gemm 0.1.5) on the H200: its SM90 FP8 grouped GEMMs as the expert
engine and its SM90 MegaMoE as the benchmark anchor, at DeepGEMM's per-rank shape (E=32 local experts,
hidden 4096, intermediate 2048, top-6). docs/notes_deepgemm.md says what the API needs and why.

    python benchmarks/probe_deepgemm.py --json OUT.json [--quick] [--tokens 8,128,1024,8192]
        [--sections versions,contig,masked,mega,extras] [--budget-s 540] [--replays 50]
    python benchmarks/probe_deepgemm.py --cpu-selftest      (no GPU: checks the layout builders and references)

Sections (each in its own try/except; the JSON is rewritten after every figure, so a time-out keeps
what was measured):
  versions  deep_gemm / tvm_ffi / torch / CUDA / nvcc versions, alignment, TMA-aligned sizes, and whether
            transform_sf_into_required_layout passes our pre-laid scales through untouched (same pointer).
  contig    m_grouped_fp8_fp4_gemm_nt_contiguous, L1 [M,4096]x[E,4096,4096] and L2 [M,2048]x[E,4096,2048]:
            per-row m_indices (-1 padding) at exact capacity with scales already in the required layout
            (req) or plain row-major (plain), at worst-case capacity (worst: trailing all -1 blocks), and
            the psum layout (cumulative ends, same rows) at worst-case capacity; errors against fp32 on the
            dequantised operands; CUDA-graph replays (median); first-call time (JIT compile).
  masked    m_grouped_fp8_fp4_gemm_nt_masked, same shapes, expected_m = tokens*6/E; timing + L1 error.
  mega      fp8_mega_moe on a one-rank process group (symmetric buffer, transformed weights), staging of
            the inputs into the buffer timed with the call (copy of pre-quantised x, or the fused bf16
            pre-dispatch kernel); eager and, if capture works, CUDA graph; error vs fp64 reference.
  extras    contiguous layout with set_mk_alignment_for_contiguous_layout(64) (less padding per expert).

JIT: every new kernel configuration compiles at first use (NVCC by default, cached in DG_JIT_CACHE_DIR, default
chunkring's cache, CHUNKRING_CACHE_DIR/deep_gemm, as the layer's: chunkring.moe.gemm.load_deep_gemm); a cold run can
spend minutes compiling. Run it again on the same warm machine to
get the rest (sections in the order given) if the budget runs out.
"""

from __future__ import annotations

import os

# NVLink multicast stays off (KINDS.md); set before torch loads NCCL / NVSHMEM / symmetric memory.
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"  # DeepGEMM's JIT finds nvcc / headers here

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import traceback

import torch

from chunkring.testing import records

E, HIDDEN, INTER, TOPK = 32, 4096, 2048, 6
GRAN = 128  # K granularity of every scale (1x128 activations, 128x128 weights)
ALL_SECTIONS = ("versions", "contig", "masked", "mega", "extras")
DEVICE = "cuda"  # a test harness may point this (and the shape constants above) elsewhere


# ----------------------------------------------------------------------------------------------------
# Small helpers (CPU-safe)
# ----------------------------------------------------------------------------------------------------

def round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def cast_rows_fp8(x: torch.Tensor):
    """Per-row, per-128-column FP8 cast, the same arithmetic as deep_gemm.utils.per_token_cast_to_fp8(
    use_ue8m0=False): sf = max(amax, 1e-4) / 448 (fp32, not rounded), q = fp8(x * (1 / sf))."""
    m, k = x.shape
    assert k % GRAN == 0
    v = x.float().view(m, k // GRAN, GRAN)
    sf = v.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    q = (v * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, k)
    return q, sf


def cast_blocks_fp8(w: torch.Tensor):
    """[G, N, K] -> fp8 [G, N, K] + fp32 [G, N/128, K/128], as deep_gemm.utils.per_block_cast_to_fp8(
    use_ue8m0=False) per expert (N, K multiples of 128 here)."""
    g, n, k = w.shape
    v = w.float().view(g, n // GRAN, GRAN, k // GRAN, GRAN)
    sf = v.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-4) / 448.0
    q = (v * (1.0 / sf)).to(torch.float8_e4m3fn).view(g, n, k)
    return q.contiguous(), sf.view(g, n // GRAN, k // GRAN).contiguous()


def dequant_rows(q: torch.Tensor, sf: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    m, k = q.shape
    return (q.float().to(dtype).view(m, k // GRAN, GRAN) * sf.to(dtype).unsqueeze(2)).view(m, k)


def dequant_block(q: torch.Tensor, sf: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    n, k = q.shape
    v = q.float().to(dtype).view(n // GRAN, GRAN, k // GRAN, GRAN) * sf.to(dtype).view(n // GRAN, 1, k // GRAN, 1)
    return v.view(n, k)


def route(tokens: int, experts: int, topk: int, gen: torch.Generator, device):
    """Random top-k routing: distinct experts per token, softmax weights over the chosen scores."""
    scores = torch.randn(tokens, experts, generator=gen, device=device)
    vals, idx = scores.topk(topk, dim=1)
    return idx.to(torch.int32), torch.softmax(vals, dim=1).float()


def contiguous_plan(topk_idx: torch.Tensor, experts: int, align: int) -> dict:
    """Where every (token, k) assignment lands in DeepGEMM's contiguous layout: experts in order, each
    expert's rows padded to `align`. Returns the row of each assignment (flat token*topk order), the
    per-row expert ids (-1 on padding) for `needed` rows, and the psum layout (cumulative ends)."""
    device = topk_idx.device
    flat = topk_idx.reshape(-1).long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=device) - first[sorted_e]
    pos = torch.empty(n, dtype=torch.long, device=device)
    pos[order] = starts[sorted_e] + rank
    needed = int(padded.sum().item())
    m_indices = torch.full((needed,), -1, dtype=torch.int32, device=device)
    m_indices[pos] = flat.to(torch.int32)
    psum = (starts + counts).to(torch.int32)  # psum[j] = align(psum[j-1], align) + count_j
    return dict(flat=flat, pos=pos, counts=counts, starts=starts, needed=needed, m_indices=m_indices,
                psum=psum, token_of=torch.arange(n, device=device) // topk_idx.shape[1])


def capacity_worst(tokens: int, topk: int, experts: int, align: int) -> int:
    return round_up(tokens * topk + experts * (align - 1), align)


def pad_indices(m_indices: torch.Tensor, capacity: int) -> torch.Tensor:
    out = torch.full((capacity,), -1, dtype=torch.int32, device=m_indices.device)
    out[: m_indices.numel()] = m_indices
    return out


def sf_required_2d(rows: int, kb: int, device, fill: float = 1.0) -> torch.Tensor:
    """[rows, kb] fp32 in the layout the SM90 kernel reads (MN-major, leading dim = TMA-aligned rows):
    strides (1, round_up(rows, 4)). transform_sf_into_required_layout returns such a tensor unchanged."""
    lead = round_up(rows, 4)
    return torch.full((kb, lead), fill, dtype=torch.float32, device=device).t()[:rows]


def sf_required_3d(groups: int, rows: int, kb: int, device, fill: float = 1.0) -> torch.Tensor:
    """[groups, rows, kb] with strides (round_up(rows,4)*kb, 1, round_up(rows,4)) (masked layout's SFA)."""
    lead = round_up(rows, 4)
    return torch.full((groups, kb, lead), fill, dtype=torch.float32, device=device).transpose(1, 2)[:, :rows]


def u8(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors are indexed through a uint8 view (index kernels do not cover float8 everywhere)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, src_rows=None) -> None:
    """dst[rows] = src[src_rows] (src_rows None: all of src), fp8-safe."""
    val = u8(src) if src_rows is None else u8(src)[src_rows]
    u8(dst)[rows] = val


def err_stats(out: torch.Tensor, ref: torch.Tensor) -> dict:
    out, ref = out.double(), ref.double()
    diff = (out - ref).abs()
    ref_max = ref.abs().max().item()
    denom = (out * out + ref * ref).sum().item()
    return {
        "max_rel": diff.max().item() / max(ref_max, 1e-30),  # max |out-ref| / max |ref|
        "fro_rel": (diff.norm() / ref.norm().clamp(min=1e-30)).item(),  # ||out-ref|| / ||ref||
        "calc_diff": 0.0 if denom == 0 else 1.0 - 2.0 * (out * ref).sum().item() / denom,  # DeepGEMM's
        "finite": bool(torch.isfinite(out).all().item()),
    }


def emulate_contiguous(a_deq, w_deq, m_indices, align):
    """Reference semantics of the SM90 contiguous kernel (CPU self-test): every `align`-row block takes
    the expert of its first row; a half-block (64 rows) whose first row is -1 is skipped (zeros)."""
    m = a_deq.shape[0]
    out = torch.zeros(m, w_deq.shape[1], dtype=a_deq.dtype)
    for b0 in range(0, m, align):
        e = int(m_indices[b0])
        for h0 in range(b0, min(b0 + align, m), 64):
            if int(m_indices[h0]) >= 0:
                out[h0:h0 + 64] = a_deq[h0:h0 + 64] @ w_deq[max(e, 0)].t()
    return out


def moe_reference(x_deq, w1_deq_fn, w2_deq_fn, topk_idx, topk_w, experts, inter):
    """out[t] = sum_k w[t,k] * (silu(x W1g^T) * (x W1u^T)) W2^T with gate = rows [0, I) of W1, up = [I, 2I)
    (the layout transform_weights_for_mega_moe_sm90 interleaves). All in x_deq's dtype (fp64 here)."""
    out = torch.zeros(x_deq.shape[0], w2_deq_fn(0).shape[0], dtype=x_deq.dtype, device=x_deq.device)
    flat = topk_idx.reshape(-1).long()
    tok = torch.arange(flat.numel(), device=flat.device) // topk_idx.shape[1]
    wflat = topk_w.reshape(-1).to(x_deq.dtype)
    for e in range(experts):
        sel = (flat == e).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        h = x_deq[tok[sel]] @ w1_deq_fn(e).t()
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok[sel], (act @ w2_deq_fn(e).t()) * wflat[sel].unsqueeze(1))
    return out


# ----------------------------------------------------------------------------------------------------
# Result file (chunkring.testing.records.header's keys), rewritten after every figure
# ----------------------------------------------------------------------------------------------------

class Results:
    def __init__(self, path):
        self.path = path
        self.data = {**records.header(suite="probe_deepgemm", ranks=1, command=" ".join(sys.argv), passed=0,
                                      failed=0), "figures": {}, "errors": []}

    @property
    def fig(self):
        return self.data["figures"]

    def save(self):
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as out:
            json.dump(self.data, out, indent=2, default=str)
        os.replace(tmp, self.path)


class Budget:
    def __init__(self, seconds):
        self.t0, self.seconds = time.time(), seconds

    def left(self):
        return self.seconds - (time.time() - self.t0)

    def ok(self, need=0.0):
        return self.left() > need


# ----------------------------------------------------------------------------------------------------
# GPU timing
# ----------------------------------------------------------------------------------------------------

def first_call(fn):
    """Wall time of the first eager call (includes the JIT compile of new kernel configurations)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def time_graph(fn, replays, warmup=3):
    """Capture fn once in a CUDA graph; median / min ms of individually event-timed replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, stop in ev:
        start.record()
        graph.replay()
        stop.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in ev]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "replays": replays}, graph


def time_eager(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, stop in ev:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in ev]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "iters": iters}


# ----------------------------------------------------------------------------------------------------
# Shared operands (built once: weights are the same in every section)
# ----------------------------------------------------------------------------------------------------

class Operands:
    def __init__(self, seed):
        self.dev = torch.device(DEVICE)
        self.gen = torch.Generator(device=self.dev)
        self.gen.manual_seed(seed)
        g = self.gen
        # Scaled so that x W1^T and act W2^T stay O(1): x ~ N(0,1), W1 ~ N(0, 1/H), W2 ~ N(0, 1/I).
        w1 = torch.randn(E, 2 * INTER, HIDDEN, generator=g, device=self.dev) / math.sqrt(HIDDEN)
        self.w1, self.w1_sf = cast_blocks_fp8(w1.to(torch.bfloat16))  # rows [0, I) gate, [I, 2I) up
        del w1
        w2 = torch.randn(E, HIDDEN, INTER, generator=g, device=self.dev) / math.sqrt(INTER)
        self.w2, self.w2_sf = cast_blocks_fp8(w2.to(torch.bfloat16))
        del w2
        torch.cuda.empty_cache()

    def w1_deq(self, e, dtype=torch.float32):
        return dequant_block(self.w1[e], self.w1_sf[e], dtype)

    def w2_deq(self, e, dtype=torch.float32):
        return dequant_block(self.w2[e], self.w2_sf[e], dtype)

    def tokens(self, t):
        """Routing + FP8 activations for t tokens, and random FP8 L2 inputs per assignment."""
        x = torch.randn(t, HIDDEN, generator=self.gen, device=self.dev).to(torch.bfloat16)
        idx, w = route(t, E, TOPK, self.gen, self.dev)
        xq, xsf = cast_rows_fp8(x)
        x2 = torch.randn(t * TOPK, INTER, generator=self.gen, device=self.dev).to(torch.bfloat16)
        x2q, x2sf = cast_rows_fp8(x2)
        return dict(x=x, idx=idx, w=w, xq=xq, xsf=xsf, x2q=x2q, x2sf=x2sf)


def grouped_reference(a, w_deq_fn, n_out, flat_e):
    """fp32 reference per assignment: a (dequantised rows, flat assignment order) @ W_e^T."""
    out = torch.empty(a.shape[0], n_out, dtype=torch.float32, device=a.device)
    for e in range(E):
        sel = (flat_e == e).nonzero().squeeze(1)
        if sel.numel():
            out[sel] = a[sel] @ w_deq_fn(e).t()
    return out


# ----------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------

def section_versions(dg, res, args):
    import torch.distributed._symmetric_memory as symm_mem
    fig = res.fig.setdefault("versions", {})
    fig["deep_gemm"] = getattr(dg, "__version__", "?")
    fig["deep_gemm_file"] = dg.__file__
    try:
        import tvm_ffi
        fig["tvm_ffi"] = getattr(tvm_ffi, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        fig["tvm_ffi"] = repr(exc)
    fig["torch"] = torch.__version__
    fig["torch_cuda"] = torch.version.cuda
    fig["device"] = torch.cuda.get_device_name(0)
    fig["capability"] = list(torch.cuda.get_device_capability(0))
    fig["num_sms"] = int(dg.get_num_sms())
    fig["env"] = {k: v for k, v in os.environ.items()
                  if k.startswith(("DG_", "CUDA_HOME", "CUDA_PATH", "NVSHMEM_DISABLE_NVLS", "NCCL_NVLS",
                                   "TORCH_SYMM_MEM"))}
    nvcc = os.environ.get("DG_JIT_NVCC_COMPILER") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                                   "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        fig["nvcc"] = [line for line in out.splitlines() if "release" in line][:1]
    except Exception as exc:  # noqa: BLE001
        fig["nvcc"] = repr(exc)
    try:
        gxx = subprocess.run(["g++", "--version"], capture_output=True, text=True, timeout=30).stdout
        fig["host_cxx"] = gxx.splitlines()[:1]
    except Exception as exc:  # noqa: BLE001
        fig["host_cxx"] = repr(exc)
    fig["jit_compiler"] = "NVRTC" if int(os.environ.get("DG_JIT_USE_NVRTC", "0") or 0) else "NVCC"
    fig["mk_alignment_for_contiguous_layout"] = int(dg.get_mk_alignment_for_contiguous_layout())
    fig["theoretical_mk_alignment"] = int(dg.get_theoretical_mk_alignment_for_contiguous_layout())
    fig["tma_aligned_size_fp32"] = {m: int(dg.get_tma_aligned_size(m, 4)) for m in (1, 8, 130, 1024)}
    try:
        fig["symm_mem_backend"] = str(symm_mem.get_backend(torch.device("cuda")))
    except Exception as exc:  # noqa: BLE001
        fig["symm_mem_backend"] = repr(exc)
    res.save()

    # Does the layout transform leave pre-laid scales alone (same pointer), and what does it make of a
    # plain row-major SFA?
    dev = torch.device(DEVICE)
    m, kb = 1024, HIDDEN // GRAN
    plain = torch.rand(m, kb, device=dev) + 0.5
    req = sf_required_2d(m, kb, dev)
    req.copy_(plain)
    t_req = dg.transform_sf_into_required_layout(req, m, HIDDEN, (1, 128, 128), is_sfa=True)
    t_plain = dg.transform_sf_into_required_layout(plain, m, HIDDEN, (1, 128, 128), is_sfa=True)
    t_req, t_plain = (torch.utils.dlpack.from_dlpack(t) if not isinstance(t, torch.Tensor) else t
                      for t in (t_req, t_plain))
    sfb = torch.rand(E, 2 * INTER // GRAN, HIDDEN // GRAN, device=dev)
    t_sfb = dg.transform_sf_into_required_layout(sfb, 2 * INTER, HIDDEN, (1, 128, 128), num_groups=E, is_sfa=False)
    t_sfb = torch.utils.dlpack.from_dlpack(t_sfb) if not isinstance(t_sfb, torch.Tensor) else t_sfb
    torch.cuda.synchronize()
    fig["sf_transform"] = {
        "sfa_required_layout_passthrough": t_req.data_ptr() == req.data_ptr(),
        "sfa_required_strides": list(req.stride()),
        "sfa_plain_passthrough": t_plain.data_ptr() == plain.data_ptr(),
        "sfa_plain_transformed_strides": list(t_plain.stride()),
        "sfa_plain_transformed_equal": bool(torch.equal(t_plain, plain)),
        "sfb_passthrough": t_sfb.data_ptr() == sfb.data_ptr(),
    }
    res.save()


def _contig_buffers(ops, tk, plan, capacity):
    dev = ops.dev
    pos, tok = plan["pos"], plan["token_of"]
    # Padding rows hold fp8 1.0 (0x38) with scale 1: a computed padding row comes out non-zero, a skipped
    # one zero (or untouched), which shows which row ranges the kernel computes.
    a1 = torch.full((capacity, HIDDEN), 0x38, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    a2 = torch.full((capacity, INTER), 0x38, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    scatter_rows(a1, pos, tk["xq"], tok)
    scatter_rows(a2, pos, tk["x2q"])
    s1_plain = torch.ones(capacity, HIDDEN // GRAN, device=dev)
    s2_plain = torch.ones(capacity, INTER // GRAN, device=dev)
    s1_plain[pos] = tk["xsf"][tok]
    s2_plain[pos] = tk["x2sf"]
    s1_req = sf_required_2d(capacity, HIDDEN // GRAN, dev)
    s2_req = sf_required_2d(capacity, INTER // GRAN, dev)
    s1_req.copy_(s1_plain)
    s2_req.copy_(s2_plain)
    d1 = torch.empty(capacity, 2 * INTER, dtype=torch.bfloat16, device=dev)
    d2 = torch.empty(capacity, HIDDEN, dtype=torch.bfloat16, device=dev)
    return dict(a1=a1, a2=a2, s1_plain=s1_plain, s2_plain=s2_plain, s1_req=s1_req, s2_req=s2_req, d1=d1, d2=d2)


def _contig_fns(dg, ops, buf, grouped, psum, expected_m):
    kw = dict(use_psum_layout=True, expected_m_for_psum_layout=expected_m) if psum else {}

    def l1(sf):  # sf: "req" (pre-laid, passes through) or "plain" (row-major: the API relays it out)
        dg.m_grouped_fp8_fp4_gemm_nt_contiguous((buf["a1"], buf[f"s1_{sf}"]), (ops.w1, ops.w1_sf), buf["d1"],
                                                grouped, **kw)

    def l2(sf):
        dg.m_grouped_fp8_fp4_gemm_nt_contiguous((buf["a2"], buf[f"s2_{sf}"]), (ops.w2, ops.w2_sf), buf["d2"],
                                                grouped, **kw)
    return l1, l2


def _padding_rows(d1, plan, exact, align):
    """What the kernel left in D's padding rows (D held 7.0 before the call, padding A rows fp8 1.0):
    rows in a 64-row half (a whole block when align is 64) whose first row is real (inside an expert's
    blocks), rows in a half whose first row is padding, and the trailing rows past the exact capacity."""
    half = min(64, align)
    rows = d1.shape[0]
    real = torch.zeros(rows, dtype=torch.bool, device=d1.device)
    real[plan["pos"]] = True
    mi = pad_indices(plan["m_indices"], rows)
    first = (torch.arange(rows, device=d1.device) // half) * half
    live = mi[first] >= 0
    beyond = torch.arange(rows, device=d1.device) >= exact
    f = d1.float()
    zero, kept = (f == 0).all(dim=1), (f == 7.0).all(dim=1)

    def count(mask):
        return {"rows": int(mask.sum().item()), "zero": int((zero & mask).sum().item()),
                "untouched": int((kept & mask).sum().item()),
                "other": int((mask & ~zero & ~kept).sum().item())}
    return {"in_live_half": count(~real & live & ~beyond), "in_dead_half": count(~real & ~live & ~beyond),
            "past_exact_capacity": count(beyond)}


def _check_contig(buf, plan, ref1, ref2):
    pos = plan["pos"]
    return {"L1": err_stats(buf["d1"][pos].float(), ref1), "L2": err_stats(buf["d2"][pos].float(), ref2)}


def section_contig(dg, res, args, ops, budget, align=None, key="contig"):
    """Contiguous layout at each token count; align=None: the library's default (128)."""
    fig = res.fig.setdefault(key, {})
    align = align or int(dg.get_mk_alignment_for_contiguous_layout())
    fig["alignment"] = align
    for t in args.tokens:
        if key == "contig_align64" and t > args.extras_max_tokens:
            continue
        entry = fig.setdefault(str(t), {})
        if not budget.ok(30):
            entry["skipped"] = "budget"
            res.data["skipped"] += 1
            res.save()
            continue
        try:
            tk = ops.tokens(t)
            plan = contiguous_plan(tk["idx"], E, align)
            exact, worst = plan["needed"], capacity_worst(t, TOPK, E, align)
            expected_m = max(1, t * TOPK // E)
            entry.update(tokens=t, capacity_exact=exact, capacity_worst=worst, real_rows=t * TOPK,
                         max_rows_per_expert=int(plan["counts"].max().item()),
                         empty_experts=int((plan["counts"] == 0).sum().item()),
                         tflop=2.0 * t * TOPK * (2 * INTER * HIDDEN + HIDDEN * INTER) / 1e12)
            flat = plan["flat"]
            ref1 = grouped_reference(dequant_rows(tk["xq"], tk["xsf"])[plan["token_of"]], ops.w1_deq, 2 * INTER, flat)
            ref2 = grouped_reference(dequant_rows(tk["x2q"], tk["x2sf"]), ops.w2_deq, HIDDEN, flat)

            # Worst-case capacity buffers; the exact-capacity variant uses the leading rows (a, d, m_indices
            # slice cleanly; the required-layout scales need their own storage: lead dim = round_up(M, 4)).
            big = _contig_buffers(ops, tk, plan, worst)
            small = dict(big)
            for name in ("a1", "a2", "s1_plain", "s2_plain", "d1", "d2"):
                small[name] = big[name][:exact]
            small["s1_req"] = sf_required_2d(exact, HIDDEN // GRAN, ops.dev)
            small["s2_req"] = sf_required_2d(exact, INTER // GRAN, ops.dev)
            small["s1_req"].copy_(big["s1_plain"][:exact])
            small["s2_req"].copy_(big["s2_plain"][:exact])
            m_exact = plan["m_indices"]
            m_worst = pad_indices(m_exact, worst)

            variants = {
                "req_exact": (small, m_exact, False, "req"),
                "plain_exact": (small, m_exact, False, "plain"),
                "req_worst": (big, m_worst, False, "req"),
                "psum_worst": (big, plan["psum"], True, "req"),
            }
            if args.quick:
                variants.pop("req_worst")
            for name, (buf, grouped, psum, sf) in variants.items():
                if not budget.ok(20):
                    entry[name] = {"skipped": "budget"}
                    res.data["skipped"] += 1
                    continue
                v = entry.setdefault(name, {})
                try:
                    l1, l2 = _contig_fns(dg, ops, buf, grouped, psum, expected_m)
                    buf["d1"].fill_(7.0)
                    buf["d2"].fill_(7.0)
                    v["first_call_L1_s"] = first_call(lambda: l1(sf))
                    v["first_call_L2_s"] = first_call(lambda: l2(sf))
                    v["error"] = _check_contig(buf, plan, ref1, ref2)
                    v["padding_rows"] = _padding_rows(buf["d1"], plan, exact, align)
                    res.save()
                    if name == "plain_exact":
                        # Same output as with pre-laid scales? (the transform is a pure relayout)
                        d1_plain = buf["d1"][plan["pos"]].clone()
                        l1("req")
                        v["L1_bitwise_equal_req"] = bool(torch.equal(d1_plain, buf["d1"][plan["pos"]]))
                    v["graph_L1_L2"], _ = time_graph(lambda: (l1(sf), l2(sf)), args.replays)
                    if name == "req_exact":
                        v["graph_L1"], _ = time_graph(lambda: l1(sf), args.replays)
                        v["graph_L2"], _ = time_graph(lambda: l2(sf), args.replays)
                    v["tflops"] = entry["tflop"] / (v["graph_L1_L2"]["median_ms"] * 1e-3)
                    res.data["passed"] += 1
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    v["exception"] = repr(exc)
                    res.data["failed"] += 1
                    res.data["errors"].append(f"{key}/{t}/{name}: {exc!r}")
                res.save()
                torch.cuda.synchronize()
            del big, small
            torch.cuda.empty_cache()
            med = {n: entry.get(n, {}).get("graph_L1_L2", {}).get("median_ms") for n in variants}
            if med.get("req_exact") is not None:
                for n, label in (("plain_exact", "plain_sfa_minus_req_ms"), ("req_worst", "worst_cap_minus_exact_ms"),
                                 ("psum_worst", "psum_worst_minus_exact_ms")):
                    if med.get(n) is not None:
                        entry[label] = med[n] - med["req_exact"]
            for name in ("req_exact", "plain_exact", "req_worst", "psum_worst"):
                ms = entry.get(name, {}).get("graph_L1_L2", {}).get("median_ms")
                print(f"[{key}] tokens={t:5d} {name:12s} " + (f"{ms:.3f} ms" if ms else "-")
                      + (f"  L1 max_rel={entry[name]['error']['L1']['max_rel']:.2e}"
                         if "error" in entry.get(name, {}) else ""), flush=True)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            entry["exception"] = repr(exc)
            res.data["failed"] += 1
            res.data["errors"].append(f"{key}/{t}: {exc!r}")
        res.save()


def section_masked(dg, res, args, ops, budget):
    fig = res.fig.setdefault("masked", {})
    for t in args.tokens:
        entry = fig.setdefault(str(t), {})
        if not budget.ok(30):
            entry["skipped"] = "budget"
            res.data["skipped"] += 1
            res.save()
            continue
        try:
            tk = ops.tokens(t)
            plan = contiguous_plan(tk["idx"], E, 1)  # rank of each assignment within its expert
            counts, flat = plan["counts"], plan["flat"]
            rank = plan["pos"] - plan["starts"][flat]
            max_m = round_up(max(int(counts.max().item()), 1), 128)
            expected_m = max(1, t * TOPK // E)
            entry.update(tokens=t, max_m=max_m, expected_m=expected_m)
            dev = ops.dev
            a1 = torch.zeros(E, max_m, HIDDEN, dtype=torch.uint8, device=dev)
            a2 = torch.zeros(E, max_m, INTER, dtype=torch.uint8, device=dev)
            a1[flat, rank] = u8(tk["xq"])[plan["token_of"]]
            a2[flat, rank] = u8(tk["x2q"])
            a1, a2 = a1.view(torch.float8_e4m3fn), a2.view(torch.float8_e4m3fn)
            s1 = sf_required_3d(E, max_m, HIDDEN // GRAN, dev)
            s2 = sf_required_3d(E, max_m, INTER // GRAN, dev)
            s1[flat, rank] = tk["xsf"][plan["token_of"]]
            s2[flat, rank] = tk["x2sf"]
            d1 = torch.empty(E, max_m, 2 * INTER, dtype=torch.bfloat16, device=dev)
            d2 = torch.empty(E, max_m, HIDDEN, dtype=torch.bfloat16, device=dev)
            masked_m = counts.to(torch.int32)

            # F821: the `del` at the end of the iteration frees these operands; l1 and l2 only run before it.
            def l1():
                dg.m_grouped_fp8_fp4_gemm_nt_masked((a1, s1), (ops.w1, ops.w1_sf), d1, masked_m, expected_m)  # noqa: F821

            def l2():
                dg.m_grouped_fp8_fp4_gemm_nt_masked((a2, s2), (ops.w2, ops.w2_sf), d2, masked_m, expected_m)  # noqa: F821
            entry["first_call_L1_s"] = first_call(l1)
            entry["first_call_L2_s"] = first_call(l2)
            ref1 = grouped_reference(dequant_rows(tk["xq"], tk["xsf"])[plan["token_of"]], ops.w1_deq, 2 * INTER, flat)
            entry["error_L1"] = err_stats(d1[flat, rank].float(), ref1)
            res.save()
            entry["graph_L1_L2"], _ = time_graph(lambda: (l1(), l2()), args.replays)
            res.data["passed"] += 1
            print(f"[masked] tokens={t:5d} {entry['graph_L1_L2']['median_ms']:.3f} ms  "
                  f"L1 max_rel={entry['error_L1']['max_rel']:.2e}", flush=True)
            del a1, a2, s1, s2, d1, d2
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            entry["exception"] = repr(exc)
            res.data["failed"] += 1
            res.data["errors"].append(f"masked/{t}: {exc!r}")
        res.save()


def one_rank_group():
    """A one-rank torch.distributed group without a launcher (FileStore rendezvous, NCCL; gloo fallback)."""
    import tempfile

    import torch.distributed as dist
    if dist.is_initialized():
        return dist.group.WORLD, "existing"
    store_file = tempfile.mktemp(prefix="dg_probe_pg_")
    for backend in ("nccl", "gloo"):
        try:
            kw = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, init_method=f"file://{store_file}", world_size=1, rank=0, **kw)
            dist.barrier()
            return dist.group.WORLD, backend
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            if dist.is_initialized():
                dist.destroy_process_group()
            store_file = tempfile.mktemp(prefix="dg_probe_pg_")
    raise RuntimeError("no one-rank process group")


def mega_moe_calls(dg, buffer, tk, t, y, l1, l2):
    """The MegaMoE call, and the call with its input staging (bound to this token count's tensors)."""
    idx64 = tk["idx"].long()

    def call():
        dg.fp8_mega_moe(y, l1, l2, buffer, recipe=(128, 128, 128), activation="swiglu",
                        activation_clamp=None, fast_math=True)

    def staged_copy():  # pre-quantised x (per_token_cast_to_fp8 arithmetic) + routing, then the call
        buffer.x[:t].copy_(tk["xq"])
        buffer.x_sf[:t].copy_(tk["xsf"])
        buffer.topk_idx[:t].copy_(idx64)
        buffer.topk_weights[:t].copy_(tk["w"])
        call()

    def staged_predispatch():  # bf16 x: DeepGEMM's fused FP8 cast + staging kernel, then the call
        dg.mega_moe_pre_dispatch_sm90(tk["x"], tk["idx"], tk["w"], buffer.x, buffer.x_sf,
                                      buffer.topk_idx, buffer.topk_weights, t, 128, 1.0)
        call()
    return call, staged_copy, staged_predispatch


def section_mega(dg, res, args, ops, budget):
    fig = res.fig.setdefault("mega", {})
    group, backend = one_rank_group()
    fig["process_group_backend"] = backend
    fig["api"] = {"get_symm_buffer_for_mega_moe": hasattr(dg, "get_symm_buffer_for_mega_moe"),
                  "transform_weights_for_mega_moe_sm90": hasattr(dg, "transform_weights_for_mega_moe_sm90"),
                  "fp8_mega_moe": hasattr(dg, "fp8_mega_moe"),
                  "mega_moe_pre_dispatch_sm90": hasattr(dg, "mega_moe_pre_dispatch_sm90")}
    t0 = time.perf_counter()
    l1, l2 = dg.transform_weights_for_mega_moe_sm90((ops.w1, ops.w1_sf), (ops.w2, ops.w2_sf))
    torch.cuda.synchronize()
    fig["weight_transform_s"] = time.perf_counter() - t0
    max_tokens = max(args.tokens)
    buffer, graph_jobs = None, []
    if not args.mega_per_count_buffer:
        buffer = dg.get_symm_buffer_for_mega_moe(group, E, max_tokens, TOPK, HIDDEN, INTER)
        fig["buffer"] = {"num_max_tokens_per_rank": buffer.num_max_tokens_per_rank,
                         "bytes": buffer.buffer.numel(), "type": type(buffer).__name__,
                         "x": list(buffer.x.shape), "x_sf": [list(buffer.x_sf.shape), list(buffer.x_sf.stride())],
                         "topk_idx": [list(buffer.topk_idx.shape), str(buffer.topk_idx.dtype)],
                         "topk_weights": [list(buffer.topk_weights.shape), str(buffer.topk_weights.dtype)]}
    res.save()
    for t in args.tokens:
        entry = fig.setdefault(str(t), {})
        if not budget.ok(45):
            entry["skipped"] = "budget"
            res.data["skipped"] += 1
            res.save()
            continue
        try:
            if args.mega_per_count_buffer:
                buffer = dg.get_symm_buffer_for_mega_moe(group, E, t, TOPK, HIDDEN, INTER)
                entry["num_max_tokens_per_rank"] = buffer.num_max_tokens_per_rank
            tk = ops.tokens(t)
            y = torch.empty(t, HIDDEN, dtype=torch.bfloat16, device=ops.dev)
            call, staged_copy, staged_predispatch = mega_moe_calls(dg, buffer, tk, t, y, l1, l2)
            y.fill_(7.0)
            entry["first_call_s"] = first_call(staged_copy)
            # fp64 reference on the dequantised operands (x as staged, weights as quantised)
            x_deq = dequant_rows(tk["xq"], tk["xsf"], torch.float64)
            ref = moe_reference(x_deq, lambda e: ops.w1_deq(e, torch.float64), lambda e: ops.w2_deq(e, torch.float64),
                                tk["idx"], tk["w"], E, INTER)
            entry["error"] = err_stats(y.float(), ref)
            res.save()
            entry["eager_stage_copy_and_call"] = time_eager(staged_copy, args.replays)
            entry["eager_call_only"] = time_eager(call, args.replays)
            res.save()
            try:
                entry["first_call_predispatch_s"] = first_call(staged_predispatch)
                xq_pd = buffer.x[:t].clone()
                sf_pd = buffer.x_sf[:t].clone()
                entry["predispatch_x_equal_cast"] = bool(torch.equal(xq_pd.view(torch.uint8),
                                                                     tk["xq"].view(torch.uint8)))
                entry["predispatch_sf_max_rel_diff"] = ((sf_pd - tk["xsf"]).abs() / tk["xsf"]).max().item()
                entry["error_predispatch"] = err_stats(y.float(), moe_reference(
                    dequant_rows(xq_pd, sf_pd, torch.float64), lambda e: ops.w1_deq(e, torch.float64),
                    lambda e: ops.w2_deq(e, torch.float64), tk["idx"], tk["w"], E, INTER))
                entry["eager_predispatch_and_call"] = time_eager(staged_predispatch, args.replays)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                entry["predispatch_exception"] = repr(exc)
            res.data["passed"] += 1
            print(f"[mega] tokens={t:5d} eager staged {entry['eager_stage_copy_and_call']['median_ms']:.3f} ms  "
                  f"rel_fro={entry['error']['fro_rel']:.2e} max_rel={entry['error']['max_rel']:.2e}", flush=True)
            if not args.no_mega_graph:
                graph_jobs.append((t, entry, staged_copy, y, buffer))
            elif args.mega_per_count_buffer:
                buffer.destroy()
                buffer = None
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            entry["exception"] = repr(exc)
            res.data["failed"] += 1
            res.data["errors"].append(f"mega/{t}: {exc!r}")
        res.save()
        torch.cuda.empty_cache()

    # CUDA graphs last: a capture the kernel does not allow must not cost the eager figures above.
    for t, entry, staged_copy, y, _buffer in graph_jobs:
        if not budget.ok(20):
            entry["graph_skipped"] = "budget"
            continue
        try:
            staged_copy()
            torch.cuda.synchronize()
            y_eager = y.clone()
            entry["graph_stage_copy_and_call"], graph = time_graph(staged_copy, args.replays)
            y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            entry["graph_output_equal_eager"] = bool(torch.equal(y_eager, y))
            print(f"[mega] tokens={t:5d} graph staged {entry['graph_stage_copy_and_call']['median_ms']:.3f} ms "
                  f"(output equal eager: {entry['graph_output_equal_eager']})", flush=True)
            del graph
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            entry["graph_exception"] = repr(exc)
            res.data["errors"].append(f"mega graph/{t}: {exc!r}")
        res.save()


def section_extras(dg, res, args, ops, budget):
    """Contiguous layout with 64-row alignment (BLOCK_M = 64 on SM90): less padding per expert."""
    old = int(dg.get_mk_alignment_for_contiguous_layout())
    try:
        dg.set_mk_alignment_for_contiguous_layout(64)
        section_contig(dg, res, args, ops, budget, align=64, key="contig_align64")
    finally:
        dg.set_mk_alignment_for_contiguous_layout(old)


# ----------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------

def summary(res, args):
    f = res.fig

    def ms(d, *keys):
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return "-"
            d = d[k]
        return f"{d:.3f}" if isinstance(d, float) else "-"

    print("\n=== DeepGEMM probe: ms per call (graph replays, median); L1+L2 = both grouped GEMMs ===")
    hdr = (f"{'tokens':>6} | {'contig req':>10} | {'contig plain':>12} | {'worst cap':>9} | {'psum worst':>10} |"
           f" {'align64':>7} | {'masked':>7} | {'mega eager':>10} | {'mega graph':>10} | {'mega err':>8}")
    print(hdr)
    print("-" * len(hdr))
    for t in args.tokens:
        c, m, g, a = (f.get(k, {}).get(str(t), {}) for k in ("contig", "masked", "mega", "contig_align64"))
        err = g.get("error", {}).get("fro_rel")
        print(f"{t:>6} | {ms(c, 'req_exact', 'graph_L1_L2', 'median_ms'):>10} |"
              f" {ms(c, 'plain_exact', 'graph_L1_L2', 'median_ms'):>12} |"
              f" {ms(c, 'req_worst', 'graph_L1_L2', 'median_ms'):>9} |"
              f" {ms(c, 'psum_worst', 'graph_L1_L2', 'median_ms'):>10} |"
              f" {ms(a, 'req_exact', 'graph_L1_L2', 'median_ms'):>7} |"
              f" {ms(m, 'graph_L1_L2', 'median_ms'):>7} |"
              f" {ms(g, 'eager_stage_copy_and_call', 'median_ms'):>10} |"
              f" {ms(g, 'graph_stage_copy_and_call', 'median_ms'):>10} |"
              f" {(f'{err:.2e}' if err is not None else '-'):>8}")
    v = f.get("versions", {})
    print(f"\nalignment={v.get('mk_alignment_for_contiguous_layout')} sf_transform={v.get('sf_transform')}")
    print(f"passed={res.data['passed']} failed={res.data['failed']} skipped={res.data['skipped']}")
    for e in res.data["errors"]:
        print("  error:", e)


# ----------------------------------------------------------------------------------------------------
# CPU self-test of the helpers (no GPU, no deep_gemm)
# ----------------------------------------------------------------------------------------------------

def cpu_selftest():
    """The layout builders, scale layouts, casts and references on small CPU shapes, against a torch
    emulation of the SM90 contiguous kernel's semantics and per-token loops."""
    gen = torch.Generator().manual_seed(0)
    experts, topk, hidden, n_out, inter = 4, 2, 256, 128, 128
    for align in (128, 64):
        for tokens in (1, 5, 100):
            idx, w = route(tokens, experts, topk, gen, "cpu")
            assert all(len(set(r.tolist())) == topk for r in idx)
            plan = contiguous_plan(idx, experts, align)
            pos, flat, tok = plan["pos"], plan["flat"], plan["token_of"]
            assert plan["needed"] % align == 0 and plan["needed"] <= capacity_worst(tokens, topk, experts, align)
            assert len(set(pos.tolist())) == pos.numel()
            # each expert's rows are contiguous from an aligned start, padding (-1) only at its tail
            mi = plan["m_indices"]
            for e in range(experts):
                s0, c = int(plan["starts"][e]), int(plan["counts"][e])
                assert s0 % align == 0
                assert (mi[s0:s0 + c] == e).all() and (mi[s0 + c: s0 + round_up(c, align)] == -1).all()
            # psum: cumulative ends, each group starting at the aligned end of the previous one
            prev = 0
            for e in range(experts):
                assert int(plan["psum"][e]) == round_up(prev, align) + int(plan["counts"][e])
                prev = int(plan["psum"][e])
            x = torch.randn(tokens, hidden, generator=gen)
            xq, xsf = cast_rows_fp8(x)
            assert dequant_rows(xq, xsf).sub(x).abs().max() <= x.abs().max() * 2 ** -3
            wq, wsf = cast_blocks_fp8(torch.randn(experts, n_out, hidden, generator=gen) / 16)
            cap = capacity_worst(tokens, topk, experts, align)
            a = torch.zeros(cap, hidden, dtype=torch.uint8).view(torch.float8_e4m3fn)
            scatter_rows(a, pos, xq, tok)
            sfa = sf_required_2d(cap, hidden // GRAN, "cpu")
            assert sfa.stride() == (1, round_up(cap, 4)) and sfa.shape == (cap, hidden // GRAN)
            sfa[pos] = xsf[tok]
            w_deq = torch.stack([dequant_block(wq[e], wsf[e]) for e in range(experts)])
            out = emulate_contiguous(dequant_rows(a, sfa), w_deq, pad_indices(mi, cap), align)
            ref = grouped_reference_cpu(dequant_rows(xq, xsf)[tok], w_deq, flat)
            st = err_stats(out[pos], ref)
            assert st["max_rel"] < 1e-6, st
            # masked placement: (expert, rank) unique per assignment, rank < count
            p1 = contiguous_plan(idx, experts, 1)
            rank = p1["pos"] - p1["starts"][flat]
            assert (rank >= 0).all() and (rank < p1["counts"][flat]).all()
            assert len(set(zip(flat.tolist(), rank.tolist(), strict=True))) == flat.numel()
        # MoE reference (gate = rows [0, I), up = rows [I, 2I)) against a per-token loop
        w1 = torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=torch.float64) / 16
        w2 = torch.randn(experts, n_out, inter, generator=gen, dtype=torch.float64) / 16
        xd = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
        got = moe_reference(xd, lambda e: w1[e], lambda e: w2[e], idx, w, experts, inter)
        loop = torch.zeros_like(got)
        for ti in range(tokens):
            for k in range(topk):
                e = int(idx[ti, k])
                g, u = w1[e, :inter] @ xd[ti], w1[e, inter:] @ xd[ti]
                loop[ti] += float(w[ti, k]) * (w2[e] @ (g / (1 + torch.exp(-g)) * u))
        assert torch.allclose(got, loop, rtol=1e-10, atol=1e-10)
    s3 = sf_required_3d(3, 130, 32, "cpu")
    assert s3.stride() == (132 * 32, 1, 132) and s3.shape == (3, 130, 32)
    print("cpu self-test passed")


def grouped_reference_cpu(a, w_deq, flat_e):
    return torch.stack([a[i] @ w_deq[int(flat_e[i])].t() for i in range(a.shape[0])])


# ----------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write all figures here (rewritten after every figure)")
    ap.add_argument("--quick", action="store_true", help="tokens 8,1024, 10 replays, no worst-capacity variant")
    ap.add_argument("--tokens", default=None, help="comma list (default 8,128,1024,8192)")
    ap.add_argument("--sections", default=",".join(ALL_SECTIONS), help="comma list, run in this order")
    ap.add_argument("--replays", type=int, default=None, help="graph replays per figure (default 50)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting new work after this many s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extras-max-tokens", type=int, default=1024, help="align-64 variant up to this many tokens")
    ap.add_argument("--mega-per-count-buffer", action="store_true",
                    help="one symmetric buffer per token count (default: one sized for the largest)")
    ap.add_argument("--no-mega-graph", action="store_true", help="MegaMoE eager only")
    ap.add_argument("--cpu-selftest", action="store_true", help="check the helpers on CPU and exit")
    args = ap.parse_args()
    if args.cpu_selftest:
        cpu_selftest()
        return 0
    args.tokens = [int(t) for t in (args.tokens or ("8,1024" if args.quick else "8,128,1024,8192")).split(",")]
    args.replays = args.replays or (10 if args.quick else 50)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(ALL_SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")

    res = Results(args.json)
    budget = Budget(args.budget_s)
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
    t_import = time.perf_counter()
    try:
        from chunkring.moe.gemm import load_deep_gemm

        dg = load_deep_gemm()  # its JIT cache where the layer's is, unless DG_JIT_CACHE_DIR names another
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        res.data["errors"].append(f"import deep_gemm: {exc!r}")
        res.data["failed"] += 1
        res.save()
        return 1
    res.fig["config"] = {"experts": E, "hidden": HIDDEN, "intermediate": INTER, "topk": TOPK,
                         "tokens": args.tokens, "replays": args.replays, "quick": args.quick,
                         "sections": sections, "dg_jit_cache_dir": os.environ["DG_JIT_CACHE_DIR"]}
    res.save()
    res.fig["config"]["import_s"] = time.perf_counter() - t_import

    ops = None
    for name in sections:
        t0 = time.perf_counter()
        print(f"\n--- {name} (budget left {budget.left():.0f} s) ---", flush=True)
        try:
            if name == "versions":
                section_versions(dg, res, args)
            else:
                if ops is None:
                    ops = Operands(args.seed)
                {"contig": lambda: section_contig(dg, res, args, ops, budget),
                 "masked": lambda: section_masked(dg, res, args, ops, budget),
                 "mega": lambda: section_mega(dg, res, args, ops, budget),
                 "extras": lambda: section_extras(dg, res, args, ops, budget)}[name]()
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            res.data["errors"].append(f"{name}: {exc!r}")
            res.data["failed"] += 1
        res.fig.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        res.save()
    try:
        cache = os.path.join(os.environ["DG_JIT_CACHE_DIR"], "cache")
        res.fig["jit_cache_kernels"] = sorted(os.listdir(cache)) if os.path.isdir(cache) else []
    except Exception:  # noqa: BLE001
        pass
    res.save()
    summary(res, args)
    return 0 if res.data["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
