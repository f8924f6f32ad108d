/*
 * chunkring -- SPIN model of how the persistent decode consumer's blocks take
 * their units (docs/PROTOCOL.md "The decode path"; device/kernels/
 * moe_persistent.cu, chunkring/moe/persistent_schedule.cuh UnitWalk).
 * Driven by scripts/check_model.py (configurations named claim_*, bugclaim_*)
 * and pinned by tests/model/test_spin_claim.py.
 *
 * One launch of G blocks on a GPU that runs at most R of them at once (an SM
 * each: one block fills an SM; fewer SMs than blocks where ranks share the
 * GPU, a partition's pull spins, or the caller's kernels run beside the
 * layer's).  The work: E = 2 experts, each C1 = 2 L1 units and one L2 unit.
 * The list, every L1 unit first (expert-major), then the L2 units:
 *   unit  0 1 2 3 | 4 5
 *   gemm  L1 ...  | L2 L2
 *   expert 0 0 1 1 | 0 1
 * (-DBUG_L2_FIRST lists the L2 units first.)
 *
 * Processes:
 *   Block(b), b < G: waits for an SM (the hardware starts a block when one is
 *     free), then takes its units into a queue of at most D (the weight
 *     loader claims up to the claim ring's depth ahead of the math) and runs
 *     them in the order taken.  The dynamic claim: one atomicAdd on the
 *     launch's ticket gives the next unit of the list (past the last: done).
 *     -DSTATIC: the strided claim, units b, b + G, b + 2G, ... (the block's
 *     index fixes them).  An L1 unit computes and releases its expert
 *     (done[e]++, the release add on sync[e] after its activation stores); an
 *     L2 unit waits until its expert's every L1 unit released (the token
 *     loader's acquire of sync[e]; -DBUG_NO_WAIT skips it), then computes.
 *     While its queue's first unit waits, the block still claims (its weight
 *     loader does not wait for tokens).  At the end it frees its SM.
 *   init: starts the G blocks, waits for them, checks every unit ran once.
 *
 * Spin interleaves sequentially consistently; each claim and each unit's
 * compute-and-release is one step.  A wait is a blocking guard: a run in
 * which every block that holds an SM waits (and every other waits for an SM)
 * is an invalid end state - the deadlock a static claim meets when R < G.
 *
 * Properties (hidden flags, each asserted with CHECK, or COMPLETION):
 *   COMPUTED_ONCE  no unit runs twice
 *   ORDERED        an L2 unit runs after every L1 unit of its expert
 *   ALL_COMPUTED   when every block ended, every unit ran
 *   COMPLETION     no invalid end state: every launch ends, whatever R
 */

#ifndef G
#define G 3
#endif
#ifndef R
#define R 1
#endif
#ifndef D
#define D 1
#endif
#define E 2
#define C1 2
#define L1_UNITS (E * C1)
#define T (L1_UNITS + E)

hidden byte COMPUTED_ONCE = 1;
hidden byte ORDERED = 1;
hidden byte ALL_COMPUTED = 1;
#define CHECK(P, c) assert(P && (c))

byte ticket;        /* the dynamic claim's ticket (sync[E + 1]) */
byte sms = R;       /* SMs free */
byte done[E];       /* sync[e]: expert e's L1 units released */
byte computed[T];
byte running;

/* Unit u of the list: whether it is an L1 unit, and its expert. */
#ifdef BUG_L2_FIRST
#define IS_L1(u) ((u) >= E)
#define EXPERT(u) (IS_L1(u) -> ((u) - E) / C1 : (u))
#else
#define IS_L1(u) ((u) < L1_UNITS)
#define EXPERT(u) (IS_L1(u) -> (u) / C1 : (u) - L1_UNITS)
#endif

#ifdef BUG_NO_WAIT
#define READY(u) true
#else
#define READY(u) (IS_L1(u) || done[EXPERT(u)] == C1)
#endif

proctype Block(byte b) {
  byte q[D];
  byte head = 0, n = 0, u, next = b;
  bool taken_all = false;
  d_step { sms > 0 -> sms-- };   /* an SM of its own */
  do
  :: !taken_all && n < D ->       /* the weight loader takes the next unit */
#ifdef STATIC
     d_step { u = next; next = next + G };
#else
     d_step { u = ticket; ticket++ };
#endif
     if
     :: u >= T -> taken_all = true
     :: else -> q[(head + n) % D] = u; n++
     fi
  :: n > 0 && READY(q[head]) ->   /* its first unit runs, and releases it */
     d_step {
       u = q[head];
       head = (head + 1) % D;
       n--;
       CHECK(COMPUTED_ONCE, computed[u] == 0);
       CHECK(ORDERED, IS_L1(u) || done[EXPERT(u)] == C1);
       computed[u] = 1;
       if
       :: IS_L1(u) -> done[EXPERT(u)]++
       :: else -> skip
       fi
     }
  :: taken_all && n == 0 -> break
  od;
  atomic { sms++; running-- }
}

init {
  byte i;
  atomic {
    running = G;
    i = 0;
    do :: i < G -> run Block(i); i++ :: else -> break od
  }
  running == 0;
  d_step {
    i = 0;
    do :: i < T -> CHECK(ALL_COMPUTED, computed[i] == 1); i++ :: else -> break od
  }
}
