/*
 * chunkring -- SPIN model of the incremental expert blocks of the MoE
 * consumer (RFC dispatch option 2; docs/PROTOCOL.md "Incremental expert
 * blocks").  Driven by scripts/check_model.py (configurations named blk_*,
 * bugblk_*) and pinned by tests/model/test_spin_blocks.py.
 *
 * One destination rank, one call (NINV=2: two calls of the same layer).  The
 * ring itself is abstracted: the rows of every source's chunks reach the
 * pull in any interleaving across sources (a source's own rows in chunk
 * order), which covers every order consume_invocation can produce and more.
 *
 * Rows (NR = 4, one (token, k) choice each; row i's tag in call c is
 * c * NR + i + 1, 0 = never written):
 *   row  source  chunk    pull block   expert (fixed; -DROUTE_ANY: any of E)
 *    0     0     0          0            0
 *    1     0     0          1            1
 *    2     0     1 (eos)    0            0
 *    3     1     0 (eos)    1            0
 * so with fixed routing expert 0 gets three rows (one full block of BM = 2
 * and a partial block of 1) and expert 1 one row (a partial block), from two
 * sources that end at different times.  -DROUTE_ANY lets every row name
 * either expert (chosen when the pull reads it): every routing of R = 4 rows
 * to E = 2 experts, the pool bound's tight case (3 + 1) included.
 *
 * Processes:
 *   Pull(b), b < NPULL (= 2): moe_pull's blocks.  For each of its rows
 *     (sources interleaved in any order), RESERVE: r = atomicAdd(reserve[e], 1),
 *     block j = r / BM, offset r % BM; the row whose offset is 0 ALLOCATES a
 *     pool block (id = atomicAdd(pool_next, 1), publishes block_of[e][j] =
 *     id + 1 and labels it with e, both relaxed: modelled in the order no
 *     fence keeps, label last); any other row WAITS for block_of[e][j]
 *     (relaxed: it needs only the id); then STORES its payload (one abstract value:
 *     x, x_sf and the row's source/token/k/weight) into pool row
 *     id * BM + offset, then LANDS [release]: old = atomicAdd(landed[id], 1);
 *     the lander that makes it BM [acquire] SEALS the block (state := SEALED,
 *     count BM, [release]).  After its last row of source s (none: at once)
 *     it ARRIVES at the end count: old = atomicAdd(ended, 1); the arrival
 *     that makes it W * NPULL (every source ended at every pull block: every
 *     reservation is final and landed) [acquire] is the FINISHER: for every
 *     expert e with c = reserve[e] not a multiple of BM it seals the partial
 *     block (e, c / BM) with count c % BM (asserting its landed count is
 *     exactly that), then sets sealed_all [release].
 *   Cons(k), k < NCONS (= 2): the L1 side (persistent consumer blocks, or
 *     fixed launches: each is a Cons that may find nothing).  CLAIMS any
 *     SEALED block with one CAS SEALED -> CLAIMED [acquire], adds 1 to
 *     claimed, then reads its count rows (one step: the block's GEMM input)
 *     and COMPUTES them.  Exits when sealed_all and claimed == pool_next.
 *   init: per call, the host's stream-ordered reset (every counter, state
 *     and list entry zeroed; the pool's rows are NOT zeroed: the previous
 *     call's rows stay as stale tags), runs the processes, waits for all of
 *     them, then checks the end state.
 *
 * Spin interleaves sequentially consistently: "[release]" is the program
 * order "payload store before the landed increment" (a __syncwarp and
 * fence.acq_rel.gpu on the GPU) and "[acquire]" the order "state observed
 * before the rows are read" (fence.acq_rel.gpu after the CAS; the GEMMs
 * read the claimed rows in a later kernel, ordered by the stream).  Every atomic / d_step is one device
 * operation (an atomicAdd with its returned value, a CAS, one store, one
 * load) plus ghost bookkeeping and the assertions on what was observed; the
 * consumer's read of a whole block is one step (a read of every row at one
 * instant is caught whenever a read of any row at its own instant is).
 *
 * Properties (hidden constants carry the name into "assertion violated
 * (NAME&&...)"):
 *   NO_READ_BEFORE_LANDED  every row a consumer reads holds this call's tag of
 *                          a row of the block's expert (no unlanded or stale
 *                          row is ever read); the finisher finds the partial
 *                          block's landed count equal to its final count
 *   COMPUTED_ONCE          no row is computed twice
 *   ALL_COMPUTED           at the end of each call: every row computed
 *                          exactly once, every allocated block claimed, the
 *                          pool holds exactly sum_e ceil(c_e / BM) blocks
 *   NO_OVERFLOW            every block index j < JMAX = ceil(R / BM) and pool
 *                          id < POOL_CAP = g + (R - g) / BM, g = min(E, R)
 *                          (runtime/chunkring/moe/_engine/dispatch.py padded_rows_bound / BM)
 *   COMPLETION             pan's invalid-end-state check: no process is left
 *                          waiting.  Every loop is bounded, so every maximal
 *                          run ends; with no invalid end state and
 *                          ALL_COMPUTED, every row is eventually computed
 *
 * Bug variants and the property their first counterexample breaks:
 *   BUG_SEAL_ON_RESERVE      the reservation of a block's last row seals it
 *                            (landed ignored)       -> NO_READ_BEFORE_LANDED
 *   BUG_LAND_BEFORE_STORE    landed incremented (and the block sealed) before
 *                            the payload store      -> NO_READ_BEFORE_LANDED
 *   BUG_SEAL_AT_SOURCE_EOS   partial blocks sealed when ONE source has ended
 *                            at every pull block (their landed count equal to
 *                            the reservation then): a later source's row is
 *                            reserved into the sealed block -> COMPUTED_ONCE
 *   BUG_CLAIM_NO_CAS         claim = load SEALED, then store CLAIMED: two
 *                            consumers take one block -> COMPUTED_ONCE
 *   BUG_EXIT_BEFORE_SEAL     a consumer exits when every source has ended and
 *                            no block is SEALED, before the finisher sealed
 *                            the partial blocks     -> ALL_COMPUTED
 *   BUG_SMALL_POOL           pool sized ceil(R / BM) blocks (no per-expert
 *                            padding) -> NO_OVERFLOW (needs ROUTE_ANY or the
 *                            fixed 3 + 1 routing)
 */

#ifndef NPULL
#define NPULL 2
#endif
#ifndef NCONS
#define NCONS 2
#endif
#ifndef NINV
#define NINV 1
#endif
#define W   2        /* sources */
#define E   2        /* local experts */
#define BM  2        /* block_m */
#define NR  4        /* rows (token, k choices) reaching this rank per call */

#define G_     (E < NR -> E : NR)
#define JMAX   ((NR + BM - 1) / BM)            /* block list length per expert */
#ifdef BUG_SMALL_POOL
#define POOL_CAP ((NR + BM - 1) / BM)
#else
#define POOL_CAP (G_ + (NR - G_) / BM)         /* padded_rows_bound / block_m */
#endif
#define POOLA  4                               /* array size: >= any pool id */

#define EMPTY   0
#define SEALED  1
#define CLAIMED 2

/* the row table (init) */
byte rsrc[NR];
byte rpull[NR];
byte rfix[NR];

/* the device words of one call (zeroed by the host before the pull) */
byte reserve[E];
byte pool_next;
byte block_of[E * JMAX];      /* pool id + 1; 0 = not allocated yet */
byte bexp[POOLA];             /* the expert of a pool block (its row labels) */
byte landed[POOLA];
byte state[POOLA];            /* with bcount: one state word on the device */
byte bcount[POOLA];
byte ended;                   /* (source, pull block) pairs past their eos */
#ifdef BUG_SEAL_AT_SOURCE_EOS
byte ended_src[W];
#endif
bool sealed_all;
byte claimed;
/* the pool's rows: never zeroed */
byte data[POOLA * BM];

/* ghosts */
byte call;
byte rexp[NR];                /* the expert row i named this call */
byte computed[NR];
byte running;                 /* processes of this call still running */

hidden byte NO_READ_BEFORE_LANDED = 1;
hidden byte COMPUTED_ONCE = 1;
hidden byte ALL_COMPUTED = 1;
hidden byte NO_OVERFLOW = 1;
#define CHECK(P, c) assert(P && (c))

inline seal(id, n) {
  d_step { state[id] = SEALED; bcount[id] = n }
}

/* the finisher: every reservation is final and landed [acquire by the arrival] */
inline seal_partials() {
  e = 0;
  do
  :: e < E ->
     c = reserve[e];
     if
     :: c % BM != 0 ->
        d_step {
          id = block_of[e * JMAX + c / BM] - 1;
          CHECK(NO_READ_BEFORE_LANDED, landed[id] == c % BM);
        }
        seal(id, c % BM)
     :: else -> skip
     fi;
     e++
  :: else -> break
  od
}

proctype Pull(byte b) {
  byte pos[W];
  bool fin[W];
  byte s, i, e, r, j, off, id, old, c;
  do
  :: !fin[0] || !fin[1] ->
     if
     :: !fin[0] -> s = 0
     :: !fin[1] -> s = 1
     fi;
     d_step {   /* local: the next row of source s in this block's share */
       do
       :: pos[s] < NR && !(rsrc[pos[s]] == s && rpull[pos[s]] == b) -> pos[s]++
       :: else -> break
       od
     }
     if
     :: pos[s] < NR ->
        i = pos[s]; pos[s]++;
        /* the row's routing, read from the chunk */
#ifdef ROUTE_ANY
        if :: rexp[i] = 0 :: rexp[i] = 1 fi;
#else
        rexp[i] = rfix[i];
#endif
        e = rexp[i];
        d_step { r = reserve[e]; reserve[e]++ }           /* RESERVE */
        j = r / BM; off = r % BM;
        CHECK(NO_OVERFLOW, j < JMAX);
        if
        :: off == 0 ->                                     /* ALLOCATE */
           d_step { id = pool_next; pool_next++ }
           CHECK(NO_OVERFLOW, id < POOL_CAP);
           block_of[e * JMAX + j] = id + 1;                /* relaxed */
           bexp[id] = e      /* the label after the id: no fence orders them (blocks.cuh); it reaches the
                                claimant through this lane's LAND of row 0, not through block_of */
        :: else ->
           d_step { block_of[e * JMAX + j] != 0 -> id = block_of[e * JMAX + j] - 1 }
        fi;
#ifdef BUG_SEAL_ON_RESERVE
        if :: off == BM - 1 -> seal(id, BM) :: else -> skip fi;
#endif
#ifdef BUG_LAND_BEFORE_STORE
        d_step { old = landed[id]; landed[id]++ }
        if :: old + 1 == BM -> seal(id, BM) :: else -> skip fi;
        data[id * BM + off] = call * NR + i + 1;
#else
        data[id * BM + off] = call * NR + i + 1;           /* STORE */
        d_step { old = landed[id]; landed[id]++ }         /* LAND [release] */
#ifndef BUG_SEAL_ON_RESERVE
        if :: old + 1 == BM -> seal(id, BM) :: else -> skip fi   /* [acquire] */
#endif
#endif
     :: else ->                                            /* END of source s */
        fin[s] = true;
#ifdef BUG_SEAL_AT_SOURCE_EOS
        d_step { old = ended_src[s]; ended_src[s]++ }
        if
        :: old + 1 == NPULL ->     /* source s ended at every pull block */
           e = 0;
           do
           :: e < E ->
              c = reserve[e];
              if
              :: c % BM != 0 ->
                 id = block_of[e * JMAX + c / BM];
                 if
                 :: id != 0 && landed[id - 1] == c % BM -> seal(id - 1, c % BM)
                 :: else -> skip
                 fi
              :: else -> skip
              fi;
              e++
           :: else -> break
           od
        :: else -> skip
        fi;
        atomic { old = ended; ended++ }   /* atomic: a jump target */
        if :: old + 1 == W * NPULL -> sealed_all = true :: else -> skip fi
#else
        d_step { old = ended; ended++ }                    /* ARRIVE */
        if
        :: old + 1 == W * NPULL ->                         /* FINISHER */
           seal_partials();
           sealed_all = true                               /* [release] */
        :: else -> skip
        fi
#endif
     fi
  :: else -> break
  od;
  running--
}

/* the block's GEMM input: its count rows, read after the claim [acquire] */
inline compute() {
  d_step { claimed++ }
  d_step {
    n = bcount[id];
    o = 0;
    do
    :: o < n ->
       v = data[id * BM + o];
       CHECK(NO_READ_BEFORE_LANDED, v > call * NR && v <= call * NR + NR);
       row = v - call * NR - 1;
       CHECK(NO_READ_BEFORE_LANDED, rexp[row] == bexp[id]);
       CHECK(COMPUTED_ONCE, computed[row] == 0);
       computed[row] = 1;
       o++
    :: else -> break
    od;
    n = 0; o = 0; v = 0; row = 0
  }
}

#ifdef BUG_CLAIM_NO_CAS
#define TAKE(K) :: state[K] == SEALED -> id = K; state[id] = CLAIMED; compute()
#else
#define TAKE(K) :: d_step { state[K] == SEALED -> state[K] = CLAIMED; id = K }; compute()
#endif

proctype Cons(byte k) {
  byte id, n, o, v, row;
  do
  TAKE(0)
  TAKE(1)
  TAKE(2)
  TAKE(3)
#ifdef BUG_EXIT_BEFORE_SEAL
  :: d_step { ended == W * NPULL && state[0] != SEALED && state[1] != SEALED &&
              state[2] != SEALED && state[3] != SEALED } -> break
#else
  :: d_step { sealed_all && claimed == pool_next } -> break
#endif
  od;
  running--
}

init {
  byte i, e, blocks;
  d_step {
    rsrc[0] = 0; rpull[0] = 0; rfix[0] = 0;
    rsrc[1] = 0; rpull[1] = 1; rfix[1] = 1;
    rsrc[2] = 0; rpull[2] = 0; rfix[2] = 0;
    rsrc[3] = 1; rpull[3] = 1; rfix[3] = 0;
  }
  do
  :: call < NINV ->
     d_step {   /* the host's reset, stream-ordered before the pull and after
                 * the previous call's consumers: every word but the rows */
       i = 0;
       do :: i < E -> reserve[i] = 0; i++ :: else -> break od;
       i = 0;
       do :: i < E * JMAX -> block_of[i] = 0; i++ :: else -> break od;
       i = 0;
       do :: i < POOLA -> landed[i] = 0; state[i] = EMPTY; bcount[i] = 0; bexp[i] = 0; i++
          :: else -> break od;
       i = 0;
       do :: i < NR -> computed[i] = 0; rexp[i] = 0; i++ :: else -> break od;
#ifdef BUG_SEAL_AT_SOURCE_EOS
       ended_src[0] = 0; ended_src[1] = 0;
#endif
       pool_next = 0; ended = 0; sealed_all = false; claimed = 0;
       running = NPULL + NCONS
     }
     atomic {
       i = 0;
       do :: i < NPULL -> run Pull(i); i++ :: else -> break od;
       i = 0;
       do :: i < NCONS -> run Cons(i); i++ :: else -> break od
     }
     running == 0;
     d_step {   /* the end of the call */
       blocks = 0;
       e = 0;
       do :: e < E -> blocks = blocks + (reserve[e] + BM - 1) / BM; e++ :: else -> break od;
       CHECK(ALL_COMPUTED, pool_next == blocks);
       i = 0;
       do
       :: i < NR -> CHECK(ALL_COMPUTED, computed[i] == 1); i++
       :: else -> break
       od;
       i = 0;
       do
       :: i < pool_next -> CHECK(ALL_COMPUTED, state[i] == CLAIMED); i++
       :: else -> break
       od;
       call++
     }
  :: else -> break
  od
}
