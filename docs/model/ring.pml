/*
 * chunkring -- SPIN model of the chunk-ring publish / consume / ack protocol
 * as implemented on the GPU.  Driven by scripts/check_model.py and pinned by
 * tests/model/test_spin_model.py.
 *
 * Processes: producer(r) and consumer(d) for every rank, each running NINV
 * invocations (replays) back to back, with no coupling between them except
 * through the protocol words; with -DINJECT two injectors that deliver late
 * messages of an aborted epoch-1 run.  With -DBLOCKS=n (n > 1) rank d's
 * consumer is n block processes consumer(d, b), the multi-block consumer of
 * PROTOCOL.md's edge C3' (finish_chunk / consume_invocation with arrivals):
 * every block waits for every chunk, reads it, then ARRIVES (atomicAdd on
 * the per-(source, slot) count arrivals[r][s] at d); the block whose arrival
 * makes the count n zeroes it and only then acks (the same swap as a single
 * block) and stores d's cursor for r.  Each block keeps its own next_seq,
 * read from d's cursors (cursor_mem) at kernel start; kernel inv of rank d
 * starts after all n blocks of kernel inv-1 finished (stream order).
 * With -DHELD_ACK the processes are the MoE layer's two streams of one call
 * (PROTOCOL.md "The MoE layer on the ring", device/kernels/moe_stream.cu):
 * consumer(d) is moe_pull, then moe_combine_push, then moe_ack_held;
 * producer(r) publishes, then runs moe_drain and reduces its combine rows
 * (see "Held acks" below).  -DHELD_ACK -DBLOCKS=n
 * is the layer as it ships: moe_pull's grid of n blocks shares every chunk,
 * the last block to arrive acks it, and each source's eos chunk is held (no
 * arrival) until moe_ack_held.
 * Spin interleaves sequentially consistently, so "[release]" is the program
 * order "payload store before ready SET" and "[acquire]" is "payload load
 * after the ready load".
 *
 * Atomicity: atomic / d_step wrap only what is one operation in the
 * implementation -- a single store or load (plus ghost bookkeeping and the
 * assertions on what was just observed), the ack swap, an injector's single
 * late message, a block's arrival (one atomicAdd and its returned count) --
 * and the payload store / load of one part (the payload is one abstract
 * value), and a block's read of its cursors at kernel start (no one writes
 * them then: every ack of the kernel needs that block's later arrival).  The
 * last arrival's zeroing of the count, its ack swap and its cursor store are
 * three separate steps, as on the GPU.  WAIT READY polls the route word,
 * then the layout word, as wait_chunk() in
 * device/include/chunkring/protocol/ring.cuh does.
 *
 * Macros (all optional):
 *   -DW=2|3 -DS=1|2  ranks; ring slots per rank
 *   -DNINV=2         invocations (replays) per rank
 *   -DN0=n           chunks per invocation of rank 0 (default 2; S when
 *                    SERIALIZED).  Rank 1 is the EMPTY rank (zero tokens: one
 *                    empty eos chunk); ranks >= 2 publish NOTHER (default 1)
 *   -DSERIALIZED     stream-serialized execution (no overlap); with N0 > S
 *                    the ring wraps inside the call: it cannot finish
 *   -DLIVENESS       busy-wait protocol waits + the ltl claim ALL_FINISH
 *   -DINJECT         stale epoch-1 SET / ack injectors
 *   -DSTALE_SEQS=n   stale values carry seq 1..n (default 2)
 *   -DBLOCKS=n       consumer blocks per rank (default 1: the single-block
 *                    path, arrivals == nullptr, unchanged).  W=2, BLOCKS=2
 *                    is 7 processes: pan -f then needs gcc -DNFAIR=3
 *   -DHELD_ACK       the MoE layer's held end-of-stream ack, combine and
 *                    drain (below); not SERIALIZED; with BLOCKS=n the
 *                    multi-block pull (below)
 *   bug variants and the property their counterexample breaks (W=2, S=1):
 *     BUG_NO_ACK_WAIT          P1 skipped   -> NO_OVERWRITE_BEFORE_EVERY_ACK
 *     BUG_PUBLISH_BEFORE_DATA  P3 reversed  -> NO_READ_BEFORE_PUBLISH
 *     BUG_NO_EPOCH    (INJECT) no epoch     -> STALE_NEVER_ACCEPTED
 *     BUG_NARROW_GEN           1-bit seq    -> COMPLETION (false ERROR, below)
 *     BUG_SKIP_EOS_EMPTY       no empty eos -> COMPLETION (deadlock)
 *     BUG_UNTAGGED_ACK  any nonzero ack word counts (the kAckAnyGeneration
 *                       mutant) -> ACKS_RIGHT_GEN (with INJECT an epoch-1
 *                       ack; without, from lap 2 the previous lap's ack)
 *   and with BLOCKS=2:
 *     BUG_ACK_FIRST_ARRIVAL    the first arrival acks (the last one still
 *                              zeroes the count) -> NO_OVERWRITE_BEFORE_EVERY_ACK
 *                              (the owner rewrites the slot while the other
 *                              block of that rank has not read it).  Paths
 *                              that end in a false ack ERROR instead exist
 *                              too (a block's late arrival is counted for the
 *                              slot's next chunk); the process creation order
 *                              in init makes pan meet the overwrite first
 *     BUG_RESET_AFTER_ACK      count zeroed after the ack -> COMPLETION (a
 *                              block's arrival at the slot's next chunk is
 *                              wiped: never acked, cursor left behind)
 *   and with HELD_ACK:
 *     BUG_ACK_HELD_AT_PULL     the eos chunk is acked at its read like every
 *                              other chunk (the kNoDeferredAck mutant of
 *                              moe_pull; with BLOCKS=2 by its last arrival)
 *                              -> COMBINE_BEFORE_REDUCE (the owner's drain
 *                              returns, and it reduces, before a consumer's
 *                              combine write for it)
 *   and the two BLOCKS=2 bugs above with HELD_ACK too (the held eos chunk
 *   never arrives, so BUG_RESET_AFTER_ACK needs two acked chunks of one slot
 *   in one call: S=1, N0=3)
 *   and under LIVENESS: BUG_SKIP_EOS_EMPTY, and SERIALIZED with N0=2 > S=1
 *   -> ALL_FINISH (an acceptance cycle even under weak fairness)
 *
 * Properties (the hidden constants carry the name into pan's message
 * "assertion violated (NAME&&...)"):
 *   NO_READ_BEFORE_PUBLISH         after WAIT READY the slot holds chunk (r,q)
 *                                  in both parts, with its count and eos
 *   NO_OVERWRITE_BEFORE_EVERY_ACK  slot s is rewritten for q (lap >= 1) only
 *                                  after every destination read q-S -- with
 *                                  BLOCKS > 1, every block of every
 *                                  destination (ghost bit RBIT(d, b))
 *   NO_ABA                         the accepted ready words were published
 *                                  for exactly chunk (r,q)
 *   ACKS_RIGHT_GEN                 every ack word P1 (or the drain) accepts
 *                                  was written by its destination's ack of
 *                                  that very chunk, this epoch (one word per
 *                                  (slot, destination), swapped to gen(q))
 *   STALE_NEVER_ACCEPTED           an epoch-1 value is never accepted
 *   COMPLETION                     every chunk consumed once; no ERROR report
 *                                  without a real stale cause; plus pan's
 *                                  invalid-end-state check (no deadlock);
 *                                  BLOCKS > 1: by every block, and d's cursors
 *                                  in memory are right after the last kernel
 *   COMBINE_BEFORE_REDUCE          (HELD_ACK) when producer r's drain of
 *                                  invocation inv completes, every consumer's
 *                                  combine write for r of inv has landed (and
 *                                  no later write replaced it)
 *   ALL_FINISH (LIVENESS, ltl)     <> every producer and every consumer has
 *                                  finished all NINV invocations (HELD_ACK:
 *                                  producers include drain and reduce,
 *                                  consumers the held acks)
 *
 * Held acks (-DHELD_ACK).  The consumer acks every chunk right after reading
 * it except each source's eos chunk: that one it holds (held[r] = q, the
 * consume_invocation(..., deferred, ...) path; held[] is reset to NO_HELD at
 * each invocation start, as the layer refills stage.held with -1).  Once
 * every source reached its eos, the consumer performs the combine: one
 * store per source, combined[CMB(d, r)] = inv + 1 (ghost: "d's rows for r of
 * invocation inv", one step per source, in rank order), then acks each held
 * chunk with the same swap as every other ack (the moe_ack_held
 * blocks, one per source, all concurrent: the acks go out from a
 * nondeterministic first source in rotation, every order for W = 2; before
 * the swap each reads the held slot's meta, which must still be chunk q:
 * NO_OVERWRITE_BEFORE_EVERY_ACK).  Producer r never clears the rows: the
 * layer's reduction reads only routed choices, each written in the call, so
 * a row still holding an earlier invocation's marker fails the check.  After
 * its last publish it drains
 * (drain(): for every seq in [max(0, q - S), q), the last chunk of each
 * slot, the P1 wait for every ack[s][d] == gen(seq) [acquire]) and then reduces:
 * one step that asserts COMBINE_BEFORE_REDUCE for every consumer.  Abstracted
 * away: rows and their count (every consumer writes one marker for every
 * source, the empty rank included, though a consumer with no row for r
 * writes nothing), the expert work between pull and combine (no protocol
 * word), the release fence of the held ack's swap covering the combine stores
 * of an earlier kernel (program order here), and the cursor store of the
 * held ack with BLOCKS = 1 (cursor[r] is the single block's local next_seq,
 * as without HELD_ACK).
 * With BLOCKS > 1 (moe_pull's grid, as shipped): every block reads every
 * chunk; a chunk other than a source's eos chunk is acked by its last
 * arrival (C3', as without HELD_ACK); the eos chunk gets no arrival at all,
 * block 0 alone records it in held[] (consume_invocation writes deferred[src]
 * from block 0), and moe_ack_held acks it, which stream order starts only
 * after every block of the pull finished (kfin) -- so its ack covers every
 * block's read -- and then stores d's cursor for r, as ack_chunk does.
 * Block 0's process runs the rest of d's consumer stream (combine, held
 * acks, then the next call's moe_call_reset: held[] refilled; the arrival
 * counts, which no call zeroes, asserted zero); the next call's blocks start after it (callfin).
 * Not modelled: the owner's drain waiting for its own consumer stream (the
 * layer's producer.wait_stream(consumer)); leaving it out only adds
 * schedules, and it orders the owner's own rows, never a peer's.  Those the
 * layer's batch plan does not push at all: they stay where the owner's L2
 * wrote them, which precedes its held acks in stream order as the push does;
 * the marker combined[CMB(r, r)] stands for them, so the check here is
 * stronger than the stream order the layer relies on.
 * The producer never waits for a held ack within an invocation
 * (the eos chunk is its last publish); across invocations P1 may wait for
 * the held ack of the previous one, which comes without any further publish.
 *
 * Liveness.  In the safety runs a protocol wait is a blocking guard.  Every
 * loop of the model is bounded, so that state graph has no cycle: there
 * "<> ALL_FINISH" would only restate the invalid-end-state check, and no
 * scheduling question could arise.  On the GPU a wait is a busy-wait, so
 * under LIVENESS it is one: a failed poll is a step (POLL_AGAIN) and the
 * waiter stays enabled.  pan -a then searches for an acceptance cycle of
 * the never claim (the negated formula): an infinite run (a deadlock
 * included, by stuttering) in which someone never finishes.  With pan -f only weakly fair runs
 * count -- every process that stays enabled keeps being scheduled, i.e.
 * every launched block keeps running, the GPU's forward progress for
 * resident blocks.  Weak fairness suffices because every awaited condition
 * is stable: a ready word keeps gen(q) until this consumer's ack (P1), an
 * ack word keeps gen(q) until that destination acks q+S, which P1 orders
 * after the owner's wait; the stream-order counters only grow; a condition that came and went would need strong fairness and
 * would show up as a fair cycle of polls that all miss.  The SERIALIZED
 * stream-order waits stay blocking guards: there the kernel has not been
 * launched yet, it does not spin.  Results (scripts/check_model.py):
 *   - interleaved (rank 1 empty) finishes under weak fairness, and only
 *     under it: without -f a consumer spinning forever starves the
 *     producers (the SM-starvation case: overlap needs both sides running);
 *   - SERIALIZED with <= S chunks per source finishes with no fairness at
 *     all: no wait ever polls twice, no kernel needs another one running;
 *   - SERIALIZED with N0 > S: the producer spins on an ack of its own
 *     invocation, whose consumer cannot start -- a fair cycle, the
 *     guarantee's boundary;
 *   - BUG_SKIP_EOS_EMPTY: the consumers spin forever on the empty rank;
 *   - BLOCKS=2, SERIALIZED: finishes with no fairness (in check_model.py);
 *     HELD_ACK with BLOCKS=2 is checked for safety only (its fair liveness
 *     search is larger than the interleaved BLOCKS=2 one below);
 *     BLOCKS=2 interleaved, NINV=1 (ring wraps in the call): finishes under
 *     weak fairness -- a one-off run, too big for check_model.py: spin
 *     -DW=2 -DS=1 -DBLOCKS=2 -DNINV=1 -DLIVENESS -a; gcc -DNFAIR=3
 *     -DCOLLAPSE -DMEMLIM=10000; ./pan -a -f -w28: with one-swap acks
 *     26.0 M states stored, 0 errors, 309 s, 3.5 GB (27.2 M, 266 s, 3.7 GB
 *     with the earlier tagged-mask acks).  Weak fairness here also means every block of the grid is
 *     resident (the last arrival must come), as a co-resident grid is.
 * No timeout is modelled: a pass means the timeout never has to fire.
 *
 * With one-swap acks (one word per (slot, destination)) every configuration
 * of scripts/check_model.py meets its expectation, 43 of 43 (2 shared CPU
 * cores, --jobs 1, 551 s in all); the largest searches: blk2_w2s2 33.8 M
 * states (119 s, 2.1 GB), heldblk2_w2s2 28.9 M (46 s, 1.9 GB), w2s2_stale
 * 21.9 M (60 s, 1.3 GB; one invocation of 3 chunks, since the
 * per-destination words made the two-invocation run reach -DMEMLIM at
 * 67 M states), held_w2s1_stale 22.2 M, w2s1_stale 18.2 M, w3s1 17.5 M,
 * held_w3s1 15.7 M.  PROTOCOL.md "Evidence" has the table.
 */

/* ------------------------------------------------------------ sizes ---- */
#ifndef W
#define W 2
#endif
#ifndef S
#define S 1
#endif
#ifndef NINV
#define NINV 2
#endif
#ifndef N0
#ifdef SERIALIZED
#define N0 S
#else
#define N0 2
#endif
#endif
#ifndef NOTHER
#define NOTHER 1
#endif
#ifndef STALE_SEQS
#define STALE_SEQS 2
#endif
#ifndef BLOCKS
#define BLOCKS 1          /* consumer blocks per rank; 1 = the single-block path */
#endif
#define EMPTY_RANK 1
#ifdef HELD_ACK
#ifdef SERIALIZED
#error "HELD_ACK: the MoE layer runs its producer and consumer streams concurrently"
#endif
#else
#ifdef BUG_ACK_HELD_AT_PULL
#error "BUG_ACK_HELD_AT_PULL needs HELD_ACK"
#endif
#endif

/* chunks per invocation the consumers expect from r (empty rank: one chunk) */
#define NEXP(r)   ((r) == 0 -> N0 : ((r) == EMPTY_RANK -> 1 : NOTHER))
#ifdef BUG_SKIP_EOS_EMPTY
#define NPUB(r)   ((r) == EMPTY_RANK -> 0 : NEXP(r))  /* BUG: empty rank silent */
#else
#define NPUB(r)   NEXP(r)                            /* chunks r publishes */
#endif
#define TOKENS(r)     ((r) == EMPTY_RANK -> 0 : 1)   /* token count of a chunk */
#define EXP_EOS(r, q) (((q) + 1) % NEXP(r) == 0)     /* last of its invocation */
#define FULL          ((1 << W) - 1)                 /* ack mask of all ranks */
#define CONSUMERS     (W * BLOCKS)                   /* consumer processes */
/* ghost reader bit of block b of rank d; every block of every rank */
#define RBIT(d, b)    (1 << ((d) * BLOCKS + (b)))
#define RFULL         ((1 << CONSUMERS) - 1)

/* ------------------------------------------------------- generations ---- */
/* gen(q) = (epoch << SEQ_BITS) | (lap(q) + 1), 0 = never published;
 * the ack words hold the same value.  The model runs in epoch 2:
 * the collective reset after the aborted epoch-1 run zeroed every word. */
#define EPOCH        2
#define STALE_EPOCH  1
#ifdef BUG_NARROW_GEN
/* BUG: seq field too narrow, wraps mod 2.  While d waits for q, its word can
 * only hold gen(q-S) or gen(q) (P1 keeps the producer within one lap), and
 * one bit still tells adjacent laps apart: no ABA acceptance is reachable.
 * The wrap breaks the "seq larger than expected" rule instead: lap 0's seq 1
 * looks ahead of lap 1's wrapped seq 0, so a consumer reports a false ERROR. */
#define SEQ_BITS 1
#else
#define SEQ_BITS 3            /* here at most NINV*N0/S = 4 laps */
#endif
#define SEQ_MASK ((1 << SEQ_BITS) - 1)
#ifdef BUG_NO_EPOCH
#define MKGEN(ep, sq) ((sq) & SEQ_MASK)                    /* BUG: no epoch */
#else
#define MKGEN(ep, sq) (((ep) << SEQ_BITS) | ((sq) & SEQ_MASK))
#endif
#define GEN(q)       MKGEN(EPOCH, (q) / S + 1)
/* the generation destination d's ack word of slot q % S holds before d acks
 * q: its ack of the slot's previous lap, 0 on lap 0 (rules.cuh ack_prev_gen) */
#define PREVGEN(q)   ((q) >= S -> GEN((q) - S) : 0)
#define EPOCH_OF(g)  ((g) >> SEQ_BITS)
#define SEQ_OF(g)    ((g) & SEQ_MASK)

/* A ready word is a short: low byte = the protocol value (a gen), high byte =
 * GHOST id of its writer: q+1 of the chunk whose publish wrote it, or
 * STALE_GHOST for an injected epoch-1 SET.  The protocol only uses WGEN(). */
#define STALE_GHOST    100
#define WGEN(w)        ((w) & 255)
#define WGHOST(w)      ((w) >> 8)
#define PUBWORD(q, g)  ((((q) + 1) << 8) | (g))
#define STALE_WORD(sq) ((STALE_GHOST << 8) | MKGEN(STALE_EPOCH, sq))
/* WAIT READY error rule: nonzero and (other epoch, or same epoch and a seq
 * larger than expected) */
#define BAD(w, g) (WGEN(w) != 0 && (EPOCH_OF(WGEN(w)) != EPOCH_OF(g) || \
                                    SEQ_OF(WGEN(w)) > SEQ_OF(g)))

/* ------------------------------------------------------------ state ---- */
#define SIX(r, s)    ((r) * S + (s))               /* slot s owned by r */
#define RIX(d, r, s) (((d) * W + (r)) * S + (s))   /* word at d for (r, s) */

short route_ready_gen[W * W * S];   /* at every d, SET remotely by source r */
short layout_ready_gen[W * W * S];
byte  route_pay[W * S];    /* slot payload at owner r: q+1 of the chunk; the */
byte  layout_pay[W * S];   /* metadata (count, eos) goes with the route part */
byte  count[W * S];
bit   eos[W * S];
/* ack[s][d] at owner r: one word per (slot, destination), a short like a
 * ready word (low byte the generation d acked, high byte the ghost: q+1 of
 * the chunk d acked, or STALE_GHOST for an injected epoch-1 swap) */
short ack_word[W * S * W];
#define AIX(j, d)    ((j) * W + (d))               /* j = SIX(r, s) */
byte  consumed_gen[W * S];
bit   error_reported;      /* a consumer reported an ERROR */
#if defined(SERIALIZED) || defined(LIVENESS)
byte  prod_fin, cons_fin;  /* invocations finished by producers / consumer
                            * blocks (BLOCKS per rank):
                            * stream order, and the liveness claim */
#endif
/* ghosts, never read by the protocol */
byte  readers[W * S];      /* RBIT(d, b): block b of destination d finished
                            * reading the slot (BLOCKS = 1: bit d) */
#if BLOCKS > 1
/* multi-block consumer (C3'), all at destination d */
byte  arrivals[W * W * S]; /* RIX(d, r, s): blocks of d done with r's slot s */
byte  cursor_mem[W * W];   /* CIX(d, r): d's cursor for source r, written by
                            * the acking block, read by every block at start */
byte  kfin[W];             /* blocks of d that finished their current kernel:
                            * stream order between d's consumer kernels */
#define CIX(d, r)    ((d) * W + (r))
#endif
#ifdef HELD_ACK
/* the MoE layer's combine buffers, ghost: CMB(d, r) = consumer d's rows in
 * owner r's combine buffer; inv + 1 once d wrote them in invocation inv (0
 * before d's first write) */
byte  combined[W * W];
#define CMB(d, r)    ((d) * W + (r))
#define NO_HELD      255   /* held[r]: no eos chunk of r held (the -1 fill) */
#if BLOCKS > 1
byte  callfin[W];          /* calls of d whose consumer stream finished (pull,
                            * combine, held acks): the next pull starts after */
#endif
#endif

hidden byte NO_READ_BEFORE_PUBLISH = 1;
hidden byte NO_OVERWRITE_BEFORE_EVERY_ACK = 1;
hidden byte NO_ABA = 1;
hidden byte ACKS_RIGHT_GEN = 1;
hidden byte STALE_NEVER_ACCEPTED = 1;
hidden byte COMPLETION = 1;
#ifdef HELD_ACK
hidden byte COMBINE_BEFORE_REDUCE = 1;
#endif
#define CHECK(P, c) assert(P && (c))

#ifdef LIVENESS
/* every producer and consumer finishes all NINV invocations (that the right
 * chunks were consumed is COMPLETION, the safety runs' business: pan stops a
 * path once the claim is satisfied) */
ltl ALL_FINISH { <> (prod_fin == W * NINV && cons_fin == CONSUMERS * NINV) }
#endif

/* A protocol wait (P1 WAIT REUSABLE, WAIT READY) is a do-loop whose options
 * all leave it.  Safety runs: a blocking guard, so a wait that is never
 * satisfied is an invalid end state.  LIVENESS: the GPU's busy-wait -- a
 * failed poll is a step of its own, the waiter stays enabled, and pan -f's
 * weak fairness must keep scheduling it. */
#ifdef LIVENESS
#define POLL_AGAIN :: else
#else
#define POLL_AGAIN
#endif

/* ERROR: the reporting consumer stops; the host then tears the run down, so
 * every other wait may give up (ABORT) and end at its end_abort label.  An
 * error is only legitimate if a stale epoch-1 value caused it (COMPLETION). */
#define REPORT_ERROR(stale_cause) CHECK(COMPLETION, stale_cause); error_reported = 1

/* -------------------------------------------------------- producer ---- */
/* NO_OVERWRITE_BEFORE_EVERY_ACK, checked at the first payload store of chunk
 * q (route or layout, whichever comes first); then the ghost restarts */
inline overwrite_check() {
  if
  :: !first_done ->
     CHECK(NO_OVERWRITE_BEFORE_EVERY_ACK, q < S || readers[j] == RFULL);
     readers[j] = 0; first_done = 1
  :: else
  fi
}
/* P3 route: write route payload (+ count, eos = last chunk of invocation) */
inline write_route() {
  d_step { overwrite_check(); route_pay[j] = q + 1;
           count[j] = TOKENS(r); eos[j] = (k == NPUB(r)) }
}
/* P3 route publish: for each d, route_ready_gen[r][s]@d = g (one remote SET each) */
inline publish_route() {
  for (d : 0 .. W - 1) { route_ready_gen[RIX(d, r, s)] = PUBWORD(q, g) }
}
/* P3 layout: write layout payload */
inline write_layout() {
  d_step { overwrite_check(); layout_pay[j] = q + 1 }
}
/* P3 layout publish: for each d, layout_ready_gen[r][s]@d = g */
inline publish_layout() {
  for (d : 0 .. W - 1) { layout_ready_gen[RIX(d, r, s)] = PUBWORD(q, g) }
}
#ifdef BUG_PUBLISH_BEFORE_DATA   /* BUG: signal before data */
#define ROUTE_PART  publish_route(); write_route()
#define LAYOUT_PART publish_layout(); write_layout()
#else                            /* data; [release]; signal */
#define ROUTE_PART  write_route(); publish_route()
#define LAYOUT_PART write_layout(); publish_layout()
#endif

/* WAIT REUSABLE / drain for chunk qa of slot j: destination by destination,
 * spin until ack[s][d] holds gen(qa) (wait_acked() in ring.cuh); a word of
 * another epoch or a later lap is an ERROR, reported, never accepted.
 * BUG_UNTAGGED_ACK (the kAckAnyGeneration mutant): any nonzero word counts. */
#ifdef BUG_UNTAGGED_ACK
#define ACKED(w, g)   (WGEN(w) != 0)
#define BAD_ACK(w, g) false
#else
#define ACKED(w, g)   (WGEN(w) == (g))
#define BAD_ACK(w, g) BAD(w, g)
#endif
inline wait_acked(qa) {
  for (d : 0 .. W - 1) {
    do
    :: atomic { ACKED(ack_word[AIX(j, d)], GEN(qa)) ->
         CHECK(ACKS_RIGHT_GEN, WGHOST(ack_word[AIX(j, d)]) == qa + 1) }; break
    :: atomic { BAD_ACK(ack_word[AIX(j, d)], GEN(qa)) ->
         REPORT_ERROR(WGHOST(ack_word[AIX(j, d)]) == STALE_GHOST) }; goto end_abort
    :: error_reported -> goto end_abort                      /* ABORT */
    POLL_AGAIN
    od
  }
  d = 0
}

proctype producer(byte r)
{
  byte q = 0;            /* next_seq: persists across invocations */
  byte inv, k, s, g, j, d;
  bit  first_done;

  for (inv : 0 .. NINV - 1) {
#ifdef SERIALIZED
    /* SERIALIZED: start after every consumer of invocation inv-1 finished */
    if :: cons_fin >= CONSUMERS * inv :: error_reported -> goto end_abort fi;
#endif
    /* one invocation: n_r >= 1 chunks, the last with eos=1; the empty rank
     * publishes exactly one empty eos chunk (BUG_SKIP_EOS_EMPTY: none) */
    for (k : 1 .. NPUB(r)) {
      s = q % S; g = GEN(q); j = SIX(r, s);
      /* P1 WAIT REUSABLE (lap >= 1): every ack[s][d] == gen(q-S) [acquire] */
      if
      :: q >= S ->
#ifndef BUG_NO_ACK_WAIT
         wait_acked(q - S);
#endif
         consumed_gen[j] = GEN(q - S)       /* P1: then consumed_gen[s] */
      :: else
      fi;
      /* (no P2: nothing is armed; ack[s][d] already holds gen(q-S)) */
      /* P3: route and layout parts, each written then published, either order */
      first_done = 0;
      if
      :: ROUTE_PART; LAYOUT_PART
      :: LAYOUT_PART; ROUTE_PART
      fi;
      q++
    }
#ifdef HELD_ACK
    /* moe_drain: drain() waits for the last chunk of every slot, seq in
     * [max(0, q - S), q): every ack[s][d] == gen(seq) [acquire] */
    for (k : (q > S -> q - S : 0) .. q - 1) {
      j = SIX(r, k % S);
      wait_acked(k)
    }
    /* reduce: read every consumer's rows of this invocation (atomic: the
     * loop exit may not jump into a d_step) */
    atomic { d = 0;
             do
             :: d < W -> CHECK(COMBINE_BEFORE_REDUCE, combined[CMB(d, r)] == inv + 1); d++
             :: else -> break
             od;
             d = 0; k = 0; j = 0 }
#endif
#if defined(SERIALIZED) || defined(LIVENESS)
    prod_fin++;
#endif
  }
end_abort: skip
}

/* -------------------------------------------------------- consumer ---- */
/* WAIT READY on one word of d's own memory: spin until it holds g; a BAD
 * value seen while waiting is an ERROR: reported, never accepted */
inline wait_ready(word) {
  do
  :: atomic { WGEN(word) == g ->            /* accepted; ghost checks: */
       CHECK(STALE_NEVER_ACCEPTED, WGHOST(word) != STALE_GHOST);
       CHECK(NO_ABA, WGHOST(word) == q + 1) }; break
  :: atomic { BAD(word, g) ->
       REPORT_ERROR(WGHOST(word) == STALE_GHOST) }; goto end_abort
  :: error_reported -> goto end_abort                        /* ABORT */
  POLL_AGAIN
  od
}
/* ACK (C3): one remote swap of r's ack[s][d] := gen(q) (ghost q+1), returning
 * the word it replaced, which must be d's ack of the slot's previous lap,
 * gen(q-S) (0 on lap 0); anything else -- gen(q) itself, a double ack; an
 * epoch-1 value; a missing ack -- is an ERROR (legitimate only with a stale
 * cause).  One atomic step: the remote swap (and the check of what it
 * returned, which touches only d's own registers).  BUG_UNTAGGED_ACK: the
 * consumer's check is gone too (classify_ack in the mutant). */
inline ack_cas() {
  atomic {
    replaced = ack_word[AIX(j, d)];
    ack_word[AIX(j, d)] = PUBWORD(q, g);
#ifndef BUG_UNTAGGED_ACK
    if
    :: WGEN(replaced) == PREVGEN(q)
    :: else -> REPORT_ERROR(WGHOST(replaced) == STALE_GHOST); goto end_abort
    fi;
#endif
    replaced = 0
  }
}

#if BLOCKS > 1
/* C3' (finish_chunk with arrivals): block b of rank d is done reading chunk
 * (r, q).  ARRIVE is atomicAdd(&arrivals[r][s], 1): one atomic step, and its
 * result (got, the count this block made) is the block's own.  The block that
 * makes the count BLOCKS (gridDim) is the last arrival: it zeroes the count
 * (a plain store, a step of its own), then acks (the swap, a step of its own),
 * then stores d's cursor for r (ack_chunk's relaxed store, a step of its
 * own).  The GPU-scope fences around the arrival are the program order here
 * (Spin is sequentially consistent). */
inline arrive() {
  d_step { arrivals[i]++; got = arrivals[i] }      /* atomicAdd */
  if
  :: got == BLOCKS ->                              /* the last arrival */
#ifndef BUG_RESET_AFTER_ACK
     arrivals[i] = 0;                              /* [acquire]; zero count */
#endif
#ifndef BUG_ACK_FIRST_ARRIVAL
     ack_cas();                                    /* then C3 */
     cursor_mem[CIX(d, r)] = q + 1;
#endif
#ifdef BUG_RESET_AFTER_ACK
     arrivals[i] = 0;                              /* BUG: zeroed after the ack */
#endif
     got = 0
#ifdef BUG_ACK_FIRST_ARRIVAL
  :: got == 1 ->                                   /* BUG: the first arrival acks */
     ack_cas();
     cursor_mem[CIX(d, r)] = q + 1;
     got = 0
#endif
  :: else -> got = 0
  fi
}
#endif

/* one chunk step of consumer d (with BLOCKS > 1: of its block b) on active
 * source r */
inline chunk_step() {
  q = cursor[r]; s = q % S; g = GEN(q); i = RIX(d, r, s); j = SIX(r, s);
  /* WAIT READY: route_ready_gen[r][s] == g, then layout_ready_gen[r][s] == g */
  wait_ready(route_ready_gen[i]);
  wait_ready(layout_ready_gen[i]);
  /* [acquire]; read payload and eos from r's slot: route part, layout part
   * (atomic, not d_step: SPIN forbids wait_ready's break to jump into one) */
  atomic { e = eos[j];
           CHECK(NO_READ_BEFORE_PUBLISH, route_pay[j] == q + 1 &&
                 count[j] == TOKENS(r) && e == EXP_EOS(r, q)) }
#if BLOCKS > 1 && defined(HELD_ACK) && !defined(BUG_ACK_HELD_AT_PULL)
  /* the eos chunk: no arrival; block 0 records it in held[] (deferred[src]
   * = seq, written by block 0 only); the ack waits for moe_ack_held, after
   * the whole pull kernel (every block's reads) and the combine */
  d_step { CHECK(NO_READ_BEFORE_PUBLISH, layout_pay[j] == q + 1);
           readers[j] = readers[j] | RBIT(d, b);   /* ghost: block b of d done */
           if :: e && b == 0 -> held[r] = q :: else fi }
  if :: !e -> arrive() :: else fi                  /* every other chunk: C3' */
#elif BLOCKS > 1
  /* (with HELD_ACK: BUG_ACK_HELD_AT_PULL, the eos chunk arrives too) */
  d_step { CHECK(NO_READ_BEFORE_PUBLISH, layout_pay[j] == q + 1);
           readers[j] = readers[j] | RBIT(d, b) }  /* ghost: block b of d done */
  arrive();
#elif defined(HELD_ACK) && !defined(BUG_ACK_HELD_AT_PULL)
  d_step { CHECK(NO_READ_BEFORE_PUBLISH, layout_pay[j] == q + 1);
           readers[j] = readers[j] | (1 << d);     /* ghost: d done reading */
           if :: e -> held[r] = q :: else fi }     /* eos: held, not acked */
  if :: !e -> ack_cas() :: else fi                 /* every other chunk: C3 */
#else
  /* (BUG_ACK_HELD_AT_PULL: the eos chunk is acked here too, before the
   * combine -- the kNoDeferredAck mutant) */
  d_step { CHECK(NO_READ_BEFORE_PUBLISH, layout_pay[j] == q + 1);
           readers[j] = readers[j] | (1 << d) }    /* ghost: d done reading */
  ack_cas();
#endif
  cursor[r]++;
  if :: e -> act[r] = 0; nact-- :: else fi        /* eos: active[r] = 0 */
}

#ifdef HELD_ACK
/* After d's pull of invocation inv: moe_combine_push, d's rows for every
 * source, one store per source; then moe_ack_held: ack each held eos chunk
 * (stream order: after the combine; C3's release fence covers it).  The
 * kernel is one block per source, all concurrent: the acks go out in any
 * order -- here from a nondeterministic first source in rotation (every
 * order for W = 2).  Each block reads the held slot's meta first: the slot is
 * still d's until this ack (read and swap are one step here: no one can
 * rewrite the slot between them).  With BLOCKS > 1, ack_chunk's cursor store
 * follows the swap as a step of its own: the next call's blocks read it. */
inline combine_and_ack_held() {
  for (r : 0 .. W - 1) { combined[CMB(d, r)] = inv + 1 }
  select (i : 0 .. W - 1);                         /* the first ack's source */
  for (k : 1 .. W) {
    r = (i + k) % W;
    if
    :: held[r] != NO_HELD ->
       d_step { q = held[r]; s = q % S; g = GEN(q); j = SIX(r, s) }
       atomic { CHECK(NO_OVERWRITE_BEFORE_EVERY_ACK,
                      route_pay[j] == q + 1 && layout_pay[j] == q + 1 && eos[j]);
                ack_cas() }
#if BLOCKS > 1
       cursor_mem[CIX(d, r)] = q + 1
#endif
    :: else
    fi
  }
  atomic { r = 0; q = 0; s = 0; g = 0; i = 0; j = 0; k = 0 }   /* (atomic: a
                                                    * loop exit may not jump
                                                    * into a d_step) */
}
#endif

#if BLOCKS > 1
proctype consumer(byte d; byte b)   /* block b of rank d's consumer grid */
#else
proctype consumer(byte d)
#endif
{
  byte cursor[W];        /* cursor[r]: next q expected from r (BLOCKS = 1: it
                          * persists; BLOCKS > 1: the block's next_seq) */
  bit  act[W];           /* active[r] */
  byte nact, inv, r, q, s, g, i, j;
  short replaced;        /* the ack word an ack's swap replaced */
  bit  e;
#if BLOCKS > 1
  byte got;              /* the count this block's arrival made */
#endif
#ifdef HELD_ACK
  byte held[W];          /* held[r]: q of r's eos chunk, held (or NO_HELD) */
  byte k;
#endif

  for (inv : 0 .. NINV - 1) {
#ifdef SERIALIZED
    /* SERIALIZED: start after every producer of invocation inv finished */
    if :: prod_fin >= W * (inv + 1) :: error_reported -> goto end_abort fi;
#endif
#if BLOCKS > 1
    /* stream order: kernel inv starts after every block of kernel inv-1 of
     * this rank finished (a blocking guard: the kernel is not launched yet,
     * it does not spin).  Then the block reads d's cursors into its own
     * next_seq: one step, since no one writes them concurrently -- every ack
     * of this kernel needs this block's arrival, which comes later (and if
     * one did, COMPLETION / NO_ABA would see the wrong chunk consumed). */
#ifdef HELD_ACK
    /* ... and after the previous call's combine and held acks (and the
     * call's moe_call_reset: held[] refilled) */
    if :: callfin[d] >= inv :: error_reported -> goto end_abort fi;
#else
    if :: kfin[d] >= BLOCKS * inv :: error_reported -> goto end_abort fi;
#endif
    d_step { r = 0;
             do :: r < W -> cursor[r] = cursor_mem[CIX(d, r)]; r++ :: else -> break od;
             r = 0 }
#endif
    /* active[r] = 1 for all r (HELD_ACK: and held[r] = NO_HELD) */
#ifdef HELD_ACK
    d_step { r = 0;
             do :: r < W -> act[r] = 1; held[r] = NO_HELD; r++ :: else -> break od;
             nact = W; r = 0 }
#else
    d_step { r = 0; do :: r < W -> act[r] = 1; r++ :: else -> break od; nact = W; r = 0 }
#endif
    /* while any active: each active source r in rank order gets a chunk step */
    do
    :: nact > 0 ->
       for (r : 0 .. W - 1) {
         if :: act[r] -> chunk_step() :: else fi
       }
    :: else -> break
    od;
#if defined(HELD_ACK) && BLOCKS > 1
    kfin[d]++;                                     /* this block's pull is done */
    if
    :: b == 0 ->
       /* the rest of d's consumer stream, modelled in block 0's process: the
        * combine kernel starts after every block of the pull (stream order);
        * then moe_ack_held; then the next call's moe_call_reset, which refills
        * held[] (block 0's held[] is the device array: only block 0 writes it)
        * before that call's pull. No call zeroes the arrival counts: each
        * chunk's last arrival does, so they are zero here (checked) */
       if :: kfin[d] >= BLOCKS * (inv + 1) :: error_reported -> goto end_abort fi;
       combine_and_ack_held();
       d_step { i = 0;
                do
                :: i < W * S -> CHECK(COMPLETION, arrivals[d * W * S + i] == 0); i++
                :: else -> break
                od;
                i = 0 }
       callfin[d]++
    :: else
    fi;
#elif defined(HELD_ACK)
    combine_and_ack_held();
#elif BLOCKS > 1
    kfin[d]++;
#endif
#if defined(SERIALIZED) || defined(LIVENESS)
    cons_fin++;
#endif
  }
  /* COMPLETION: every chunk of every source consumed exactly once */
  for (r : 0 .. W - 1) { CHECK(COMPLETION, cursor[r] == NINV * NEXP(r)) }
#if BLOCKS > 1
  /* ... and, once every block is done, d's cursors in memory (where the next
   * call starts) are right too */
  if
  :: b == 0 ->
     if :: kfin[d] == BLOCKS * NINV :: error_reported -> goto end_abort fi;
     for (r : 0 .. W - 1) { CHECK(COMPLETION, cursor_mem[CIX(d, r)] == NINV * NEXP(r)) }
  :: else
  fi;
#endif
end_abort: skip
}

/* --------------------------------------------------- stale injectors ---- */
#ifdef INJECT
/* A late remote SET of the aborted epoch-1 run lands on some destination's
 * route or layout word for some (r, s), at any time after the reset, or
 * never.  The choices are cleared inside the atomic (no state blow-up). */
proctype stale_set()
{
  byte sd, sr, ss, sq;
  if
  :: atomic { select (sd : 0 .. W - 1); select (sr : 0 .. W - 1);
              select (ss : 0 .. S - 1); select (sq : 1 .. STALE_SEQS);
              if
              :: route_ready_gen[RIX(sd, sr, ss)] = STALE_WORD(sq)
              :: layout_ready_gen[RIX(sd, sr, ss)] = STALE_WORD(sq)
              fi;
              sd = 0; sr = 0; ss = 0; sq = 0 }
  :: skip
  fi
}

/* A late ack of the epoch-1 run: the swap of a destination sd of that run,
 * writing its epoch-1 generation (seq sq) into ack[ss][sd] at owner
 * sr; the value it replaces is lost (an ack of this epoch it overwrites is
 * lost with it: the owner then waits, or reports the stale value). */
proctype stale_ack()
{
  byte sd, sr, ss, sq;
  if
  :: atomic { select (sd : 0 .. W - 1); select (sr : 0 .. W - 1);
              select (ss : 0 .. S - 1); select (sq : 1 .. STALE_SEQS);
              ack_word[AIX(SIX(sr, ss), sd)] = STALE_WORD(sq);
              sd = 0; sr = 0; ss = 0; sq = 0 }
  :: skip
  fi
}
#endif

init {
  byte x;
#if BLOCKS > 1
  byte y;
#endif
  atomic {
#if BLOCKS > 1
    /* created in reverse, so that pan's depth-first search, which tries the
     * highest pid first, schedules producer(0) first, then rank 0's blocks
     * in order, ...: a complete search does not depend on the order, only
     * which counterexample of a bug variant is met first (see
     * BUG_ACK_FIRST_ARRIVAL above) */
    x = W;
    do
    :: x > 0 -> x--;
       y = BLOCKS;
       do :: y > 0 -> y--; run consumer(x, y) :: else -> break od;
       run producer(x)
    :: else -> break
    od
#else
    for (x : 0 .. W - 1) { run producer(x); run consumer(x) }
#endif
#ifdef INJECT
    run stale_set(); run stale_ack()
#endif
  }
}
