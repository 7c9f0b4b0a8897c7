/*
 * credits.pml -- credit-based flow control with delayed (piggybacked) credit returns.
 *
 * Models crates/strait-core/src/engine.rs (as of commit 40e404f):
 *   EpState::new               credits = window = cfg.credits, credits_owed = 0
 *   EpState::on_frame          every header returns `h.credits()`: credits += returned
 *                              (a return beyond the window is rejected); an Eager frame
 *                              that matches a posted receive completes it and owes one
 *                              credit (credits_owed += 1); an unmatched one is parked in
 *                              the unexpected queue and owes nothing yet
 *   EpState::post_recv         a receive that matches a parked message completes it
 *                              and owes its credit then
 *   EpState::tx_pending        ctrlq non-empty || (msgq non-empty && credits > 0)
 *   Endpoint::progress         an idle pass skips progress_tx unless tx_work(), which
 *                              includes credits_owed >= window.div_ceil(2)
 *   Endpoint::progress_tx step 3  queue a standalone Ctrl::Credit when
 *                              credits_owed >= window.div_ceil(2) && !tx_pending()
 *   Endpoint::flush            Ctrl::Credit carries credits_owed (dropped if 0);
 *                              a message goes only while credits > 0, carries
 *                              credits_owed, then credits -= 1, credits_owed -= carried
 * Worker::post_send / post_recv are the application's non-deterministic actions (since
 * 3d63c79 a post_recv runs no progress pass, so a credit it makes owed goes out on a
 * later pass: here, any later step).
 *
 * Two endpoints, each sending M messages to the other (so credits ride on data frames
 * in both directions) over a FIFO link per direction. Rendezvous RTS frames take
 * credits exactly as Eager frames do, so "message" stands for both. Each endpoint
 * step (receive one frame / post one receive / post one send / send one frame) is
 * atomic; any interleaving of them is explored, which includes every schedule of the
 * real progress() loop. Links hold CAP = 2N+1 frames, one more than the bound below,
 * so that breaking the bound is observed instead of blocked.
 *
 * Parameters (defaults): N = 2 credits (the window; N = 2 makes the 2N bound tight:
 * 2 messages + 2 standalone credit frames of div_ceil(2,2) = 1 credit each),
 * M = 4 messages each way (scripts/test-models also runs N = 3). The whole state
 * space is explored (depth bound -m10000 in scripts/test-models, never reached).
 *
 * Properties
 *   S1 inflight  (assert) a sender never has more than N messages that the peer has
 *                not credited back (ghost counter `inflight`, independent of `credits`)
 *   S2 buffers   (assert) the receiver never needs more than 2N buffers for data and
 *                credit frames together: frames waiting in its inbound ring plus
 *                messages parked in its unexpected queue <= 2N
 *   S3 window    (assert) an honest peer never returns credits beyond the window
 *                (on_frame would reject it as corrupt)
 *   L1 deadlock  (pan safety run: no invalid end state) an endpoint stops only when it
 *                has sent and received all M messages
 *   L2 delivered (ltl all_delivered) every message is eventually delivered
 *                (both peers live throughout)
 *
 * Broken variants (each must be rejected by spin)
 *   -DBROKEN_NO_DECREMENT      flush does not decrement credits        -> S1 fails
 *   -DBROKEN_OWED_NOT_CLEARED  flush does not subtract the credits a message carried
 *                              from credits_owed, so they are returned twice -> S3 fails
 *   -DBROKEN_CREDIT_ON_ARRIVAL a credit is owed when a frame arrives, even if it
 *                              is only parked in the unexpected queue  -> S2 fails
 *   -DBROKEN_PENDING_IGNORES_CREDITS tx_pending() counts queued messages even when
 *                              no credit lets them go, so both sides wait for a
 *                              piggyback that never leaves              -> L1, L2 fail
 *   -DBROKEN_NO_STANDALONE     a standalone Ctrl::Credit is never sent -> L1, L2 fail
 */

#ifndef N
#define N 2
#endif
#ifndef M
#define M 4
#endif
#define T ((N + 1) / 2)        /* window.div_ceil(2) */
#define CAP (2 * N + 1)

mtype = { EAGER, CREDIT };

/* link[i]: frames travelling into endpoint i: kind, credits carried */
chan link[2] = [CAP] of { mtype, byte };

byte credits[2];    /* credits this side may still spend */
byte owed[2];       /* credits_owed */
byte queued[2];     /* messages the application posted for sending */
byte sent[2];       /* messages sent (left msgq) */
byte posted[2];     /* receives the application posted */
byte postq[2];      /* posted receives waiting for a message */
byte unexp[2];      /* messages parked in the unexpected queue */
byte delivered[2];  /* receives completed */
byte inflight[2];   /* ghost: sent messages not yet credited back */

#ifdef BROKEN_PENDING_IGNORES_CREDITS
#define TX_PENDING(i) (queued[i] > sent[i])
#else
#define TX_PENDING(i) (queued[i] > sent[i] && credits[i] > 0)
#endif

#define BUFFERS(i) (len(link[i]) + unexp[i])

proctype Endpoint(byte me)
{
    byte peer = 1 - me;
    mtype kind;
    byte c;

    do
    /* progress step 1: receive one frame (EpState::on_frame) */
    :: atomic {
        nempty(link[me]) -> link[me]?kind, c;
        credits[me] = credits[me] + c;
        assert(credits[me] <= N);       /* S3: else on_frame rejects the peer */
        inflight[me] = inflight[me] - c;
        if
        :: kind == EAGER ->
            if
            :: postq[me] > 0 -> postq[me]--; delivered[me]++; owed[me]++
            :: else -> unexp[me]++;
#ifdef BROKEN_CREDIT_ON_ARRIVAL
                owed[me]++
#endif
            fi
        :: else -> skip
        fi
       }
    /* the application posts a receive (EpState::post_recv) */
    :: atomic {
        posted[me] < M -> posted[me]++;
        if
        :: unexp[me] > 0 -> unexp[me]--; delivered[me]++;
#ifndef BROKEN_CREDIT_ON_ARRIVAL
            owed[me]++
#endif
        :: else -> postq[me]++
        fi
       }
    /* the application posts a send (EpState::queue_send) */
    :: atomic { queued[me] < M -> queued[me]++ }
    /* flush: a message leaves while credits last, carrying the owed credits */
    :: atomic {
        queued[me] > sent[me] && credits[me] > 0 && nfull(link[peer]) ->
        link[peer]!EAGER, owed[me];
        sent[me]++;
#ifndef BROKEN_OWED_NOT_CLEARED
        owed[me] = 0;
#endif
        inflight[me]++;
#ifndef BROKEN_NO_DECREMENT
        credits[me]--;
#endif
        assert(inflight[me] <= N);      /* S1 */
        assert(BUFFERS(peer) <= 2 * N)  /* S2 */
       }
#ifndef BROKEN_NO_STANDALONE
    /* progress step 3 + flush: a standalone credit frame */
    :: atomic {
        owed[me] >= T && !TX_PENDING(me) && nfull(link[peer]) ->
        link[peer]!CREDIT, owed[me];
        owed[me] = 0;
        assert(BUFFERS(peer) <= 2 * N)  /* S2 */
       }
#endif
    /* the application is done: everything sent and received */
    :: atomic { sent[me] == M && delivered[me] == M -> break }
    od
}

init {
    atomic {
        credits[0] = N;
        credits[1] = N;
        run Endpoint(0);
        run Endpoint(1)
    }
}

ltl all_delivered { <> (delivered[0] == M && delivered[1] == M) }
