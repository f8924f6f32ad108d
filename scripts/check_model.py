#!/usr/bin/env python3
"""Model-check docs/model/ring.pml (the chunkring protocol), docs/model/blocks.pml (the MoE
consumer's incremental expert blocks) and docs/model/claim.pml (how the persistent decode consumer's
blocks take their units) with SPIN.

For every configuration -- the correct model in a few sizes, with and without
the stale epoch-1 injector, interleaved and SERIALIZED, with one consumer block
per rank and with two (-DBLOCKS=2, the multi-block consumer), with the MoE
layer's held end-of-stream ack, combine and drain (-DHELD_ACK), plus one run per
injected bug; and blocks.pml's incremental expert blocks (configurations blk_*
and bugblk_*: reserve, land, seal, claim); and claim.pml's unit claims (claim_*, bugclaim_*: the
dynamic claim ends at any residency) -- this runs ``spin -a`` with the configuration's macros,
compiles ``pan.c`` with gcc and runs ``./pan``, all in a temporary directory
(nothing is written into the repository).

Each configuration is one of three checks:
  * safety: pan compiled with -DSAFETY (assertions + invalid end states);
  * liveness, weakly fair: the model built with -DLIVENESS (busy-wait protocol
    waits and the ltl claim ALL_FINISH, see ring.pml), pan run with ``-a -f``:
    an acceptance cycle is a weakly fair run in which some producer or
    consumer never finishes;
  * liveness, no fairness: the same with ``-a`` alone (every run counts).
Every pan is compiled with -DCOLLAPSE (lossless state compression) and a
-DMEMLIM bound.  No -DBITSTATE / hash compaction: every search is exhaustive.
Compiled pans are kept in a cache ($CHUNKRING_CACHE_DIR/spin, default
~/.cache/chunkring/spin) keyed by the model's text, the macros, the gcc flags and
the spin and gcc versions, so a later run with the same inputs skips spin -a and
gcc (about 1.3 s a configuration) and runs the same search; --no-cache rebuilds.

Expectations:
  * a correct configuration must report ``errors: 0`` from a complete search;
  * a bug variant must report ``errors: >= 1`` and the first counterexample
    must violate the property the bug is expected to break -- for liveness
    ``ALL_FINISH (acceptance cycle)``, so the kind of counterexample counts.
A check fails if pan's output lacks the ``errors:`` line, or reports search
truncation (max search depth too small, memory bound reached).

Usage: check_model.py [--only NAME ...] [--json PATH] [--jobs N] [--keep] [--no-cache] [--list]
Exit status: 0 if every check met its expectation, 1 otherwise, 2 on usage
errors or missing tools.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "docs" / "model"
RING_MODEL = "ring.pml"
BLOCKS_MODEL = "blocks.pml"
CLAIM_MODEL = "claim.pml"

DEPTH = 100_000          # pan -m; the deepest search here is < 1000 steps
MEMLIM_MB = 3072         # pan -DMEMLIM; reaching it counts as truncation
TIMEOUT_S = 300          # per pan run

PASS = "pass"
CEX = "counterexample"
COMPLETION = "COMPLETION"
ALL_FINISH_CYCLE = "ALL_FINISH (acceptance cycle)"

SAFETY = "safety"
LIVE_FAIR = "live-wf"           # liveness under weak fairness: pan -a -f
LIVE_ANY = "live-nofair"        # liveness over every run: pan -a
PAN_FLAGS = {SAFETY: (), LIVE_FAIR: ("-a", "-f"), LIVE_ANY: ("-a",)}


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    macros: tuple[str, ...]
    expect: str                     # PASS or CEX
    prop: str | None = None         # property the counterexample must violate
    why: str = ""
    hashbits: int = 24              # pan -w
    check: str = SAFETY             # SAFETY, LIVE_FAIR or LIVE_ANY
    model: str = RING_MODEL         # the model file, in docs/model

    def defines(self) -> tuple[str, ...]:
        """The spin macros: a liveness check builds the LIVENESS model."""
        return self.macros + (() if self.check == SAFETY else ("LIVENESS",))


CONFIGS: tuple[Config, ...] = (
    # ---- correct model: every property holds, completion included
    Config("w2s1", ("W=2", "S=1"), PASS, why="interleaved, 2 ranks, 1 slot"),
    Config("w2s1_stale", ("W=2", "S=1", "INJECT"), PASS,
           why="stale epoch-1 SETs/acks: never accepted, errors only if stale"),
    Config("w2s2", ("W=2", "S=2"), PASS, why="interleaved, 2 slots"),
    # With one ack word per (slot, destination) the stale ack injector has W times the targets: the
    # two-invocation run (NINV=2, N0=2) reached MEMLIM at 67 M states, so this one is one invocation
    # of 3 chunks from rank 0 - slot 0 still wraps (P1 waits for gen(0) while a stale epoch-1 ack of
    # the same lap field may land in any word) - 21.9 M states, 1.25 GB.
    Config("w2s2_stale", ("W=2", "S=2", "INJECT", "STALE_SEQS=1", "NINV=1", "N0=3"), PASS,
           why="2 slots with stale injection (stale seq 1 only), one invocation of 3 chunks "
               "from rank 0 (wraps slot 0)", hashbits=25),
    Config("w3s1", ("W=3", "S=1"), PASS, why="3 ranks (rank 2: 1 chunk/inv)"),
    Config("serial_w2s1", ("W=2", "S=1", "SERIALIZED"), PASS,
           why="stream-serialized, 1 chunk/source/inv"),
    Config("serial_w2s2", ("W=2", "S=2", "SERIALIZED"), PASS,
           why="stream-serialized, 2 chunks/source/inv"),
    Config("serial_w2s1_stale", ("W=2", "S=1", "SERIALIZED", "INJECT"), PASS,
           why="stream-serialized with stale injection"),
    Config("serial_w3s1", ("W=3", "S=1", "SERIALIZED"), PASS,
           why="stream-serialized, 3 ranks"),
    # ---- bug variants: each must give a counterexample for its own reason
    Config("bug_no_ack_wait", ("W=2", "S=1", "BUG_NO_ACK_WAIT"), CEX,
           "NO_OVERWRITE_BEFORE_EVERY_ACK",
           "P1 skipped: slot rewritten while a destination still reads q-S"),
    Config("bug_publish_before_data", ("W=2", "S=1", "BUG_PUBLISH_BEFORE_DATA"),
           CEX, "NO_READ_BEFORE_PUBLISH",
           "ready SET before the payload store: consumer reads the old payload"),
    Config("bug_no_epoch", ("W=2", "S=1", "INJECT", "BUG_NO_EPOCH"), CEX,
           "STALE_NEVER_ACCEPTED",
           "gen without epoch: late epoch-1 SET accepted as chunk 0"),
    Config("bug_narrow_gen", ("W=2", "S=1", "BUG_NARROW_GEN"), CEX, COMPLETION,
           "1-bit seq wraps: lap 0's gen (seq 1) looks 'newer' than lap 1's "
           "(seq 0) -> spurious ERROR; an ABA acceptance is not reachable"),
    Config("bug_skip_eos_empty", ("W=2", "S=1", "BUG_SKIP_EOS_EMPTY"), CEX,
           COMPLETION, "empty rank publishes nothing: consumers wait forever"),
    Config("bug_untagged_ack", ("W=2", "S=1", "INJECT", "BUG_UNTAGGED_ACK"), CEX,
           "ACKS_RIGHT_GEN",
           "ack words counted whatever generation they hold (kAckAnyGeneration): a late "
           "epoch-1 ack, or the previous lap's, is taken for this chunk's"),
    Config("bug_untagged_ack_lap", ("W=2", "S=1", "BUG_UNTAGGED_ACK"), CEX, "ACKS_RIGHT_GEN",
           "kAckAnyGeneration without stale messages: from lap 2 the owner takes the "
           "previous lap's ack for this one and reuses the slot unread"),
    # ---- liveness (ALL_FINISH): every producer and consumer finishes
    Config("live_w2s1", ("W=2", "S=1"), PASS, check=LIVE_FAIR,
           why="interleaved, rank 1 empty, ring wraps in the call: fair runs finish"),
    Config("live_w2s2", ("W=2", "S=2"), PASS, check=LIVE_FAIR,
           why="interleaved, 2 slots: fair runs finish"),
    Config("live_w2s1_unfair", ("W=2", "S=1"), CEX, ALL_FINISH_CYCLE, check=LIVE_ANY,
           why="interleaved needs fairness: a spinning consumer starves the producers"),
    # serialized passes even without fairness: no wait is ever polled twice
    Config("live_serial_w2s1", ("W=2", "S=1", "SERIALIZED"), PASS, check=LIVE_ANY,
           why="stream-serialized, 1 chunk/source/inv: finishes under any schedule"),
    Config("live_serial_w2s2", ("W=2", "S=2", "SERIALIZED"), PASS, check=LIVE_ANY,
           why="stream-serialized, 2 chunks/source/inv: finishes under any schedule"),
    Config("live_serial_w3s1", ("W=3", "S=1", "SERIALIZED"), PASS, check=LIVE_ANY,
           why="stream-serialized, 3 ranks: finishes under any schedule"),
    Config("live_serial_wrap", ("W=2", "S=1", "SERIALIZED", "N0=2"), CEX,
           ALL_FINISH_CYCLE, check=LIVE_FAIR,
           why="serialized with 2 > S chunks: rank 0 spins on an ack of its own "
               "call, whose consumer cannot start (the guarantee's boundary)"),
    Config("live_bug_skip_eos_empty", ("W=2", "S=1", "BUG_SKIP_EOS_EMPTY"), CEX,
           ALL_FINISH_CYCLE, check=LIVE_FAIR,
           why="empty rank publishes nothing: consumers spin forever, fairly"),
    # ---- multi-block consumer (C3', -DBLOCKS=2): every block of a consumer
    # rank reads every chunk and arrives on a per-(source, slot) counter; the
    # last arrival zeroes it and acks.  NO_OVERWRITE_BEFORE_EVERY_ACK demands
    # every block's read.  Larger runs (S=2 with two invocations, fair
    # liveness) leave the time budget: S=2 runs one invocation with a wrap.
    Config("blk2_w2s1", ("W=2", "S=1", "BLOCKS=2"), PASS,
           why="2 consumer blocks per rank, interleaved, two invocations "
               "(cursors re-read from memory at each kernel start)"),
    Config("blk2_w2s2", ("W=2", "S=2", "BLOCKS=2", "NINV=1", "N0=3"), PASS,
           hashbits=26,
           why="2 blocks, 2 slots (two arrival counters of a source live at "
               "once), one invocation of 3 chunks from rank 0 (wraps slot 0)"),
    Config("blk2_serial_w2s1", ("W=2", "S=1", "BLOCKS=2", "SERIALIZED"), PASS,
           why="2 blocks, stream-serialized, 1 chunk/source/inv"),
    Config("bug_ack_first_arrival", ("W=2", "S=1", "BLOCKS=2", "BUG_ACK_FIRST_ARRIVAL"),
           CEX, "NO_OVERWRITE_BEFORE_EVERY_ACK",
           "the first block to arrive acks: the owner rewrites the slot while "
           "another block of that rank has not read it yet"),
    Config("bug_reset_after_ack", ("W=2", "S=1", "BLOCKS=2", "BUG_RESET_AFTER_ACK"),
           CEX, COMPLETION,
           "the last block zeroes the count after its ack: a block's arrival at "
           "the slot's next chunk is wiped, that chunk is never acked and the "
           "rank's cursor is left behind (re-consumed by the next call)"),
    Config("live_blk2_serial_w2s1", ("W=2", "S=1", "BLOCKS=2", "SERIALIZED"), PASS,
           check=LIVE_ANY,
           why="2 blocks, stream-serialized: finishes under any schedule"),
    # ---- MoE layer (-DHELD_ACK): the consumer holds each source's eos-chunk
    # ack until after its combine write for that source; the owner drains
    # (waits for the last chunk of every slot) and then reduces, asserting
    # COMBINE_BEFORE_REDUCE.  Interleaved only (the layer's two streams run
    # concurrently), one consumer block.
    Config("held_w2s1", ("W=2", "S=1", "HELD_ACK"), PASS,
           why="held eos ack, 2 ranks, 1 slot, 2 chunks from rank 0 (ring wraps "
               "in the call), rank 1 empty, two invocations"),
    Config("held_w2s2", ("W=2", "S=2", "N0=3", "HELD_ACK"), PASS,
           why="held eos ack, 2 slots, 3 chunks from rank 0 (wraps slot 0; the "
               "drain waits on both slots), two invocations"),
    Config("held_w3s1", ("W=3", "S=1", "HELD_ACK"), PASS, hashbits=26,
           why="held eos ack, 3 ranks: every owner's drain needs 3 consumers' combines"),
    Config("held_w2s1_stale", ("W=2", "S=1", "HELD_ACK", "INJECT"), PASS,
           why="held eos ack with stale epoch-1 SETs/acks"),
    Config("bug_ack_held_at_pull", ("W=2", "S=1", "HELD_ACK", "BUG_ACK_HELD_AT_PULL"),
           CEX, "COMBINE_BEFORE_REDUCE",
           "the eos chunk acked at its read (the kNoDeferredAck mutant): the owner's "
           "drain returns and it reduces before a consumer's combine write"),
    Config("live_held_w2s1", ("W=2", "S=1", "HELD_ACK"), PASS, check=LIVE_FAIR,
           why="held eos ack, ring wraps in the call, rank 1 empty: fair runs "
               "finish, drain and held acks included"),
    Config("live_held_w2s2", ("W=2", "S=2", "N0=3", "HELD_ACK"), PASS, check=LIVE_FAIR,
           why="held eos ack, 2 slots, 3 chunks from rank 0: fair runs finish"),
    # ---- the MoE layer as it ships (-DHELD_ACK -DBLOCKS=2): moe_pull's grid
    # shares every chunk, the last block to arrive acks it, and each source's
    # eos chunk is held (no arrival) until moe_ack_held, after the whole pull
    # kernel and the combine; moe_call_reset refills held[] before each pull,
    # and the arrival counts, which no call zeroes, are checked zero there.
    # COMBINE_BEFORE_REDUCE and every block's read (NO_OVERWRITE_BEFORE_EVERY_ACK)
    # together.
    Config("heldblk2_w2s1", ("W=2", "S=1", "BLOCKS=2", "HELD_ACK"), PASS,
           why="2 pull blocks, held eos ack, 2 chunks from rank 0 through 1 slot "
               "(ring wraps in the call), rank 1 empty, two invocations"),
    Config("heldblk2_w2s2", ("W=2", "S=2", "BLOCKS=2", "HELD_ACK", "NINV=1", "N0=3"),
           PASS, hashbits=26,
           why="2 pull blocks, held eos ack, 2 slots, one invocation of 3 chunks "
               "from rank 0 (wraps slot 0; the drain waits on both slots)"),
    Config("heldblk2_w2s1_n3", ("W=2", "S=1", "BLOCKS=2", "HELD_ACK", "NINV=1", "N0=3"),
           PASS, hashbits=26,
           why="2 pull blocks, held eos ack, 3 chunks through 1 slot: two acked "
               "chunks reuse one arrival count inside the call"),
    Config("bug_ack_held_at_pull_blk2",
           ("W=2", "S=1", "BLOCKS=2", "HELD_ACK", "BUG_ACK_HELD_AT_PULL"), CEX,
           "COMBINE_BEFORE_REDUCE",
           "2 pull blocks, the eos chunk acked by its last arrival (kNoDeferredAck): "
           "the owner reduces before a combine write lands"),
    Config("bug_ack_first_arrival_held",
           ("W=2", "S=1", "BLOCKS=2", "HELD_ACK", "BUG_ACK_FIRST_ARRIVAL"), CEX,
           "NO_OVERWRITE_BEFORE_EVERY_ACK",
           "held eos ack, the first pull block to arrive acks a non-eos chunk: the "
           "owner rewrites the slot while the other block has not read it"),
    Config("bug_reset_after_ack_held",
           ("W=2", "S=1", "BLOCKS=2", "HELD_ACK", "NINV=1", "N0=3", "BUG_RESET_AFTER_ACK"),
           CEX, COMPLETION, hashbits=26,
           why="held eos ack, the count zeroed after the ack: an arrival at the "
               "slot's next acked chunk is wiped, that chunk is never acked"),
)

# ---- docs/model/blocks.pml: the MoE consumer's incremental expert blocks (PROTOCOL.md "Incremental
# expert blocks"): pull blocks reserve rows per expert, store them into pool blocks and count them
# landed; the lander that fills a block seals it, the last end-of-stream arrival seals the partial
# blocks; consumer blocks claim sealed blocks with a CAS.  Safety only: every loop is bounded, so no
# invalid end state plus ALL_COMPUTED means every row is eventually computed.
def _blk(name: str, macros: tuple[str, ...], expect: str, prop: str | None, why: str,
         hashbits: int = 24) -> Config:
    return Config(name, macros, expect, prop, why, hashbits=hashbits, model=BLOCKS_MODEL)


BLOCK_CONFIGS: tuple[Config, ...] = (
    _blk("blk_fixed", (), PASS, None,
         "2 pull blocks, 2 consumers, 4 rows from 2 sources ending at different times: expert 0 "
         "one full block and a partial one, expert 1 a partial one"),
    _blk("blk_route_any", ("ROUTE_ANY",), PASS, None, hashbits=25,
         why="every routing of the 4 rows to 2 experts (the pool bound's tight 3 + 1 case included)"),
    _blk("blk_two_calls", ("NINV=2",), PASS, None,
         "two calls: counters reset, the pool's rows left stale (a stale row is never read)"),
    _blk("blk_cons3", ("NCONS=3",), PASS, None, "3 consumer blocks racing for the claims"),
    _blk("bugblk_seal_on_reserve", ("BUG_SEAL_ON_RESERVE",), CEX, "NO_READ_BEFORE_LANDED",
         "a block sealed by the reservation of its last row: read before its rows land "
         "(the kSealOnReserve GPU mutant)"),
    _blk("bugblk_land_before_store", ("BUG_LAND_BEFORE_STORE",), CEX, "NO_READ_BEFORE_LANDED",
         "landed incremented before the payload store: a full block sealed with a row unwritten"),
    _blk("bugblk_seal_at_source_eos", ("BUG_SEAL_AT_SOURCE_EOS",), CEX, "COMPUTED_ONCE",
         "partial blocks sealed at ONE source's end: a later source's row lands in the sealed "
         "block, which is sealed and computed again"),
    _blk("bugblk_claim_no_cas", ("BUG_CLAIM_NO_CAS",), CEX, "COMPUTED_ONCE",
         "claim = load SEALED then store CLAIMED: two consumers compute one block"),
    _blk("bugblk_exit_before_seal", ("BUG_EXIT_BEFORE_SEAL",), CEX, "ALL_COMPUTED",
         "a consumer exits once every source ended and nothing is sealed, before the finisher "
         "sealed the partial blocks: their rows are never computed"),
    _blk("bugblk_small_pool", ("BUG_SMALL_POOL",), CEX, "NO_OVERFLOW",
         "pool of ceil(R / block_m) blocks, without the per-expert padding of padded_rows_bound: "
         "3 + 1 rows need 3 blocks"),
)

# ---- docs/model/claim.pml: how the persistent decode consumer's blocks take their units (PROTOCOL.md "The decode
# path"): G blocks, at most R running at once, L1 units before L2 units in the list, an L2 unit waiting for its
# expert's L1 units. The dynamic claim (a ticket) ends with any R; the strided claim needs every block resident.
def _claim(name: str, macros: tuple[str, ...], expect: str, prop: str | None, why: str) -> Config:
    return Config(name, macros, expect, prop, why, model=CLAIM_MODEL)


CLAIM_CONFIGS: tuple[Config, ...] = (
    _claim("claim_r1", (), PASS, None, "3 blocks, one running at a time: the ticket's order lets each finish"),
    _claim("claim_r2_ahead", ("R=2", "D=2"), PASS, None,
           "3 blocks, 2 at a time, each claiming 2 units ahead of its math"),
    _claim("claim_resident", ("R=3", "D=2"), PASS, None, "every block resident, claiming ahead"),
    _claim("claim_g4_r2", ("G=4", "R=2", "D=2"), PASS, None, "4 blocks on 2 SMs, claiming ahead"),
    _claim("claim_static_resident", ("STATIC", "R=3"), PASS, None,
           "the strided claim with every block resident: the static claims' premise"),
    _claim("bugclaim_static", ("STATIC", "R=2", "D=2"), CEX, COMPLETION,
           "the strided claim on 2 SMs: the running blocks wait for L1 units of a block that cannot start"),
    _claim("bugclaim_l2_first", ("BUG_L2_FIRST",), CEX, COMPLETION,
           "the L2 units listed first: the one running block waits for L1 units no block has taken"),
    _claim("bugclaim_no_wait", ("BUG_NO_WAIT", "R=2"), CEX, "ORDERED",
           "an L2 unit that does not wait for its expert's L1 units reads their activation early"),
)
CONFIGS = CONFIGS + BLOCK_CONFIGS + CLAIM_CONFIGS
BY_NAME = {c.name: c for c in CONFIGS}

#: Seconds each of the larger checks took (spin + gcc + pan, one core, 2026-12-04): the order to start them in,
#: longest first, so that a pool of workers ends together. Any other check takes about 1-4 s.
MEASURED_S = {
    "blk2_w2s2": 38.7, "heldblk2_w2s2": 31.3, "w2s2_stale": 26.0, "held_w2s1_stale": 22.9, "w2s1_stale": 20.2,
    "w3s1": 19.7, "held_w3s1": 16.2, "blk2_w2s1": 11.7, "live_w2s2": 9.7, "blk_cons3": 9.0, "blk_route_any": 8.6,
    "live_held_w2s2": 8.0, "heldblk2_w2s1": 7.9, "blk_two_calls": 6.7, "heldblk2_w2s1_n3": 4.5,
}


def longest_first(configs) -> list[Config]:
    """``configs`` in the order to start them: the longest measured first, then the others as given."""
    return sorted(configs, key=lambda c: -MEASURED_S.get(c.name, 0.0))


@dataclasses.dataclass
class Result:
    name: str
    check: str
    expect: str
    macros: list[str]
    errors: int | None = None
    states: int | None = None
    depth: int | None = None
    seconds: float = 0.0            # spin + gcc + pan wall time
    pan_seconds: float | None = None
    memory_mb: float | None = None  # pan's "total actual memory usage"
    violated: str | None = None     # property of the first counterexample
    expected_property: str | None = None
    truncated: str | None = None    # why the search is incomplete, if it is
    ok: bool = False
    detail: str = ""
    workdir: str | None = None


def tools_missing() -> list[str]:
    return [t for t in ("spin", "gcc") if shutil.which(t) is None]


#: The spin, gcc and pan processes running now (any thread's), so that stop_all() can end them.
_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()


def _run(cmd: list[str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    with subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_all() -> None:
    """Kill every spin, gcc and pan process this module started that is still running (a caller giving up on
    its checks: an interrupted test session)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        proc.kill()


def cache_root() -> Path:
    """Where compiled pans are kept: chunkring's cache folder's ``spin`` (default ~/.cache/chunkring/spin)."""
    from chunkring.env import cache_root as chunkring_cache_root

    return chunkring_cache_root() / "spin"


@functools.lru_cache(maxsize=1)
def _tool_versions() -> str:
    """spin's and gcc's versions: a cached pan is one built by these tools."""
    spin = subprocess.run(["spin", "-V"], capture_output=True, text=True, check=False).stdout.strip()
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return f"{spin}\n{gcc}"


def _gcc_flags(cfg: Config) -> list[str]:
    # -DSAFETY leaves the cycle search out of pan
    return ["-O2", "-w", *(("-DSAFETY",) if cfg.check == SAFETY else ()), "-DCOLLAPSE", f"-DMEMLIM={MEMLIM_MB}"]


def _build_pan(cfg: Config, model: Path, work: str, cache: Path | None) -> str | None:
    """Make ``cfg``'s pan (spin -a, then gcc) in ``work``, or take it from ``cache``; its path, or None with the
    failing step's output in ``work/build.err``."""
    pml = Path(model).name
    shutil.copy(model, os.path.join(work, pml))  # beside pan's trail, to replay it (spin -t) from --keep's folder
    text = Path(model).read_text()
    defs = [f"-D{m}" for m in cfg.defines()]
    key = hashlib.sha256("\n".join([pml, text, *defs, *_gcc_flags(cfg), _tool_versions()]).encode()).hexdigest()[:32]
    cached = cache / f"pan-{key}" if cache is not None else None
    if cached is not None and cached.is_file():
        return str(cached)
    for cmd, tmo in ((["spin", *defs, "-a", pml], 120), (["gcc", *_gcc_flags(cfg), "-o", "pan", "pan.c"], 300)):
        p = _run(cmd, work, tmo)
        if p.returncode != 0:
            Path(work, "build.err").write_text(f"{cmd[0]} failed: {(p.stdout + p.stderr).strip()[-800:]}")
            return None
    built = os.path.join(work, "pan")
    if cached is None:
        return built
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=cached.name, suffix=".tmp")
    os.close(fd)
    shutil.copy2(built, tmp)
    os.replace(tmp, cached)  # whole or absent: several workers may build the same pan at once
    return str(cached)


def parse_pan(out: str) -> dict:
    """Extract errors / states / depth / truncation / violated property."""
    info: dict = {}
    m = re.search(r"\berrors:\s*(\d+)", out)
    info["errors"] = int(m.group(1)) if m else None
    m = re.search(r"([\d.e+]+)\s+states, stored", out)
    info["states"] = int(float(m.group(1))) if m else None
    m = re.search(r"depth reached\s+(\d+)", out)
    info["depth"] = int(m.group(1)) if m else None
    m = re.search(r"pan: elapsed time\s+([\d.e+-]+)", out)
    info["pan_seconds"] = float(m.group(1)) if m else None
    m = re.search(r"([\d.]+)\s+total actual memory usage", out)
    info["memory_mb"] = float(m.group(1)) if m else None
    trunc = []
    if "depth too small" in out:
        trunc.append("max search depth too small")
    if "reached -DMEMLIM bound" in out or "out of memory" in out:
        trunc.append("memory bound reached")
    if "hash table is full" in out:
        trunc.append("hash table full")
    info["truncated"] = "; ".join(trunc) or None
    info["incomplete"] = "Search not completed" in out
    # first counterexample: "pan:1: assertion violated (NAME&&...)",
    # "pan:1: invalid end state" (a deadlock: COMPLETION) or "pan:1:
    # acceptance cycle" (a run violating the claim pan names in its
    # "never claim + (NAME)" line)
    m = re.search(r"^pan:\d+: (assertion violated|invalid end state|acceptance cycle)"
                  r"(?: \((\w+)&&)?", out, re.MULTILINE)
    claim = re.search(r"never claim\s+\+ \((\w+)\)", out)
    if not m:
        info["violated"] = None
    elif m.group(1) == "invalid end state":
        info["violated"] = COMPLETION + " (invalid end state)"
    elif m.group(1) == "acceptance cycle":
        info["violated"] = (claim.group(1) if claim else "UNNAMED_CLAIM") + " (acceptance cycle)"
    else:
        info["violated"] = m.group(2) or "UNNAMED_ASSERTION"
    return info


def run_config(cfg: Config | str, keep: bool = False, model: Path | None = None,
               cache: bool | Path = True) -> Result:
    """Run one configuration; return its Result (``ok`` = expectation met).  ``model`` overrides
    the configuration's model file (docs/model/``cfg.model``); ``cache``: the compiled pans' folder, True for
    :func:`cache_root`'s, False to build pan afresh."""
    if isinstance(cfg, str):
        cfg = BY_NAME[cfg]
    if model is None:
        model = MODEL_DIR / cfg.model
    res = Result(cfg.name, cfg.check, cfg.expect, list(cfg.defines()),
                 expected_property=cfg.prop)
    work = tempfile.mkdtemp(prefix=f"chunkring-spin-{cfg.name}-")
    t0 = time.monotonic()
    try:
        folder = cache_root() if cache is True else (Path(cache) if cache else None)
        pan = _build_pan(cfg, Path(model), work, folder)
        if pan is None:
            res.detail = Path(work, "build.err").read_text()
            return res
        p = _run([pan, *PAN_FLAGS[cfg.check], f"-m{DEPTH}", f"-w{cfg.hashbits}"],
                 work, TIMEOUT_S)
        out = p.stdout + p.stderr
        with open(os.path.join(work, "pan.out"), "w") as f:
            f.write(out)
        info = parse_pan(out)
        res.errors, res.states, res.depth = info["errors"], info["states"], info["depth"]
        res.pan_seconds, res.violated = info["pan_seconds"], info["violated"]
        res.memory_mb = info["memory_mb"]
        res.truncated = info["truncated"]
        if res.errors is None:
            res.detail = "no 'errors:' line in pan output: " + out.strip()[-800:]
        elif res.truncated:
            res.detail = f"search truncated: {res.truncated}"
        elif cfg.expect == PASS:
            if res.errors:
                res.detail = f"unexpected counterexample: {res.violated}"
            elif info["incomplete"]:
                res.detail = "search not completed"
            else:
                res.ok = True
        else:
            if not res.errors:
                res.detail = "bug not detected (0 errors)"
            elif not (res.violated or "").startswith(cfg.prop):
                res.detail = f"counterexample violates {res.violated}, expected {cfg.prop}"
            else:
                res.ok = True
    except subprocess.TimeoutExpired as e:
        res.detail = f"timeout: {' '.join(map(str, e.cmd))}"
    finally:
        res.seconds = round(time.monotonic() - t0, 2)
        if keep:
            res.workdir = work
        else:
            shutil.rmtree(work, ignore_errors=True)
    return res


def print_table(results: list[Result]) -> None:
    cols = ("config", "check", "expected", "errors", "states", "seconds", "MB", "violated",
            "verdict")
    rows = []
    for r in results:
        exp = r.expect if r.expect == PASS else f"cex:{r.expected_property}"
        rows.append((r.name, r.check, exp,
                     "-" if r.errors is None else str(r.errors),
                     "-" if r.states is None else str(r.states),
                     f"{r.seconds:.1f}", "-" if r.memory_mb is None else f"{r.memory_mb:.0f}",
                     r.violated or "-",
                     "OK" if r.ok else "FAIL: " + " ".join(r.detail.split())[:160]))
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    print(fmt.format(*cols))
    print(fmt.format(*("-" * w for w in widths)))
    for row in rows:
        print(fmt.format(*row))
    for r in results:
        if r.workdir:
            print(f"{r.name}: kept {r.workdir}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this configuration (repeatable, or comma-separated)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="parallel pan runs (default: min(2, cpus))")
    ap.add_argument("--keep", action="store_true",
                    help="keep the temp dirs (pan.out, trail) for inspection")
    ap.add_argument("--no-cache", action="store_true",
                    help=f"build every pan afresh (default: reuse those in {cache_root()})")
    ap.add_argument("--list", action="store_true", help="list configurations")
    args = ap.parse_args(argv)

    if args.list:
        for c in CONFIGS:
            exp = c.expect if c.expect == PASS else f"counterexample ({c.prop})"
            print(f"{c.name:26} {c.model:10} {c.check:11} {' '.join('-D' + m for m in c.defines()):50} "
                  f"{exp}: {c.why}")
        return 0
    selected = list(CONFIGS)
    if args.only:
        names = [n for item in args.only for n in item.split(",") if n]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            print(f"unknown configuration(s): {', '.join(unknown)}; "
                  f"known: {', '.join(BY_NAME)}", file=sys.stderr)
            return 2
        selected = [BY_NAME[n] for n in names]
    missing = tools_missing()
    if missing:
        print(f"missing tools on PATH: {', '.join(missing)}", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as ex:
        futs = {c.name: ex.submit(run_config, c, args.keep, None, not args.no_cache) for c in longest_first(selected)}
        results = [futs[c.name].result() for c in selected]
    total = time.monotonic() - t0

    print_table(results)
    bad = [r.name for r in results if not r.ok]
    print(f"\n{len(results) - len(bad)}/{len(results)} checks OK in {total:.1f} s"
          + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    if args.json:
        with open(args.json, "w") as f:
            models = sorted({str((MODEL_DIR / c.model).relative_to(REPO)) for c in selected})
            json.dump({"models": models, "total_seconds": round(total, 2),
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
