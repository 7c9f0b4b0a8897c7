/*
 * shm_ring.pml -- the shm frame ring and its sleep/wake doorbell.
 *
 * Models, as of commit 40e404f:
 *   crates/strait-shm/src/ring.rs
 *     Producer::reserve        room check against the cached consumer position, reload
 *                              of `head` (Acquire) when short; padding to the next lap
 *                              when a frame would run past the end (Producer::needed)
 *     Producer::commit         stores the frame's header word (Release), THEN the
 *                              padding header that leads to it
 *     Consumer::peek           polls the header word at `head`: 0 = nothing; padding
 *                              (right lap, not at offset 0) skips to the next lap;
 *                              anything but a frame header of the right lap is Corrupt
 *     Consumer::release        moves the consumer's private head only
 *     Consumer::publish        zeroes the first word of every consumed cell, then
 *                              stores `head` (Release): the space goes back
 *     Consumer::has_data       header word at `head` != 0
 *     announce_sleep / withdraw_sleep / peer_needs_wake   the store/fence/load handshake
 *   crates/strait-shm/src/device.rs
 *     send_frame               reserve, fill, commit; tx_dirty
 *     recv_frame               peek, handle, release; publish once publish_batch
 *                              (ring/8) is consumed, setting rx_freed
 *     doorbell                 if tx_dirty: publish; if tx_dirty || rx_freed: ring_peer
 *                              (peer_needs_wake on the peer's flag, eventfd write)
 *     arm_sleep                publish; ring_peer if anything went back (or tx_dirty,
 *                              rx_freed); announce; re-check rx data and, for a blocked
 *                              send, room; withdraw and stay awake if either is there
 *   crates/strait-core/src/engine.rs Endpoint::progress / progress_tx: the doorbell is
 *     rung at the end of a pass that sent frames (or started rendezvous transfers); a
 *     pass that only received frames does not ring it
 *   crates/strait-core/src/worker.rs Worker::wait: polls for the spin budget, then
 *     Worker::sleep: arm_sleep, ppoll on the worker's eventfd, disarm_all,
 *     notifier.drain()
 *
 * One ring, one direction: the producer is the sending worker, which sleeps when the
 * ring is full (its flag is the SLEEP word of its own rx ring, which the consumer's
 * doorbell checks after handing back room); the consumer is the receiving worker, which
 * sleeps when the ring is empty. Sleep = blocking until the worker's eventfd counter,
 * which the peer's doorbell increments, is non-zero. PROMELA executes statements in one
 * sequentially consistent order, which is what the SeqCst fences in announce_sleep and
 * peer_needs_wake provide for the flag handshake; every shared load or store is its own
 * step. (Weak-memory outcomes of the Release/Acquire payload publication are the loom
 * model's job: crates/strait-shm/tests/loom_ring.rs.)
 *
 * Parameters: a ring of SIZE = 8 cells; a frame spans 1 or SIZE/4 = 2 cells
 * (max_payload is a quarter of the ring), chosen non-deterministically per message, so
 * runs wrap and pad; M = 6 messages; BATCH = SIZE/8 = 1 cell (publish_batch; the
 * script also runs BATCH = 3, M = 5 to stress the deferred hand-back). The lap number
 * in header words is kept modulo 4 (16 bits in the code; runs here span fewer than 3
 * laps). The whole state space is explored (depth bound -m10000 in
 * scripts/test-models, never reached).
 *
 * Properties
 *   W1 wake_consumer (ltl) the consumer never sleeps forever while a frame is
 *                    published at its position
 *   W2 wake_producer (ltl) the producer never sleeps forever while the room its
 *                    blocked frame needs has been handed back
 *   D1 fifo          (assert + no invalid end state) every message arrives intact,
 *                    exactly once, in order, and all M arrive
 *   D2 honest        (assert) the consumer never reports an honest producer Corrupt:
 *                    at its position it only ever finds 0, padding of this lap, or a
 *                    valid frame header of this lap (no stale header words)
 * W2 holds for a consumer that waits with Worker::wait (it sleeps when idle, and
 * arm_sleep rings) and, with -DBUSY_POLL, for an application that only calls
 * Worker::poll() and never sleeps: the room it hands back in recv_frame is rung for
 * by the doorbell that ends every progress pass that received frames
 * (Endpoint::progress_tx's `received`). -DBROKEN_NO_RING_AFTER_RX drops that
 * doorbell (a bug these models found in an earlier version): W2 then fails for the
 * busy poller (weak fairness, pan -f) when the idle hand-back of recv_frame is
 * left out too (-DNO_IDLE_HAND_BACK), as it was then.
 *
 * Broken variants (each must be rejected by spin)
 *   -DBROKEN_NO_RECHECK_DATA   arm_sleep does not re-check rx data after announcing
 *                                                                       -> W1 fails
 *   -DBROKEN_NO_RECHECK_ROOM   arm_sleep does not re-check room for a blocked send
 *                                                                       -> W2 fails
 *   -DBROKEN_PUBLISH_BEFORE_FILL commit stores the header word before the payload is
 *                              written                                  -> D1 fails
 *   -DBROKEN_NO_ZERO           publish does not zero consumed cells     -> D2 fails
 */

#ifndef SIZE
#define SIZE 8
#endif
#define MAXSPAN (SIZE / 4)
#ifndef M
#define M 6
#endif
#ifndef BATCH
#define BATCH (SIZE / 8)   /* publish_batch = ring_bytes / 8, in cells */
#endif

/* header words: kind * 16 + (lap mod 4) * 4 + span in cells */
#define KFRAME 1
#define KPAD   2
#define LAP(pos) (((pos) / SIZE) % 4)
#define FRAMEHDR(pos, span) (KFRAME * 16 + LAP(pos) * 4 + (span))
#define PADHDR(pos) (KPAD * 16 + LAP(pos) * 4)
#define PAYLOAD 255    /* payload bytes over the first word of a frame's 2nd cell */

byte hdr[SIZE];        /* first word of each cell */
byte data[SIZE];       /* the payload of a frame whose header is in that cell: seq + 1 */
byte head_sh;          /* the consumer position the producer sees (`head`) */
bit flagC;             /* consumer worker's SLEEP word (control block of this ring) */
bit flagP;             /* producer worker's SLEEP word (control block of its rx ring) */
byte evC, evP;         /* the two workers' eventfd counters */

/* ghosts for the ltl properties */
bool c_asleep, p_asleep;
byte c_head;           /* Consumer::head */
byte c_pub;            /* Consumer::published */
byte p_tail;           /* Producer::tail */
byte p_need;           /* pad + span of the producer's blocked frame */

/* Device::doorbell: peer_needs_wake (fence; load; swap), then the eventfd write */
inline doorbell(flag, ev) {
    if
    :: flag != 0 ->
        atomic {
            if
            :: flag != 0 -> flag = 0; woke = true
            :: else -> skip
            fi
        };
        if
        :: woke -> ev++; woke = false
        :: else -> skip
        fi
    :: else -> skip
    fi
}

proctype Producer()
{
    byte sent = 0, span, pad, hc = 0, at, start;
    bool dirty = false, woke = false;

    do
    :: atomic {
        sent < M ->
        if
        :: span = 1
        :: span = MAXSPAN
        fi
       };
retry:  /* Producer::reserve: local arithmetic, at most one shared load (head) */
        atomic {
            if
            :: (p_tail % SIZE) + span > SIZE -> pad = SIZE - (p_tail % SIZE)
            :: else -> pad = 0
            fi;
            if
            :: p_tail + pad + span - hc <= SIZE -> skip
            :: else ->
                hc = head_sh;                         /* reload_head (Acquire) */
                if
                :: p_tail + pad + span - hc <= SIZE -> skip
                :: else -> goto blocked               /* Ok(None): tx_blocked */
                fi
            fi;
            start = p_tail;
            at = p_tail + pad
        };
#ifdef BROKEN_PUBLISH_BEFORE_FILL
        hdr[at % SIZE] = FRAMEHDR(at, span);
#endif
        /* fill: the payload */
        data[at % SIZE] = sent + 1;
        if
        :: span > 1 -> hdr[(at + 1) % SIZE] = PAYLOAD
        :: else -> skip
        fi;
        /* Producer::commit: the frame, then the padding that leads to it */
#ifndef BROKEN_PUBLISH_BEFORE_FILL
        hdr[at % SIZE] = FRAMEHDR(at, span);
#endif
        if
        :: pad > 0 -> hdr[start % SIZE] = PADHDR(start)
        :: else -> skip
        fi;
        atomic { p_tail = at + span; sent++; dirty = true };
        /* flush may send more frames before progress() rings the doorbell */
        if
        :: skip
        :: doorbell(flagC, evC); dirty = false
        fi
    :: sent == M ->
        if
        :: dirty -> doorbell(flagC, evC); dirty = false
        :: else -> skip
        fi;
        break
    od;
    goto done;

blocked:
    /* the progress pass that hit the full ring still rings for what it sent */
    if
    :: dirty -> doorbell(flagC, evC); dirty = false
    :: else -> skip
    fi;
    p_need = pad + span;
    /* Worker::sleep -> ShmDevice::arm_sleep */
    flagP = 1;                                        /* announce_sleep */
    /* re-check: rx data (nothing flows the other way here), then room */
#ifndef BROKEN_NO_RECHECK_ROOM
    hc = head_sh;                                     /* Producer::has_room */
    if
    :: p_tail + pad + span - hc <= SIZE -> flagP = 0; goto retry
    :: else -> skip
    fi;
#endif
    p_asleep = true;
    atomic { evP > 0 -> p_asleep = false }            /* ppoll returns */
    flagP = 0;                                        /* disarm_all */
    evP = 0;                                          /* notifier.drain() */
    goto retry;

done:
    skip
}

/* ring::Consumer::publish: zero the first word of every consumed cell, then store head */
inline publish() {
    p = c_pub;
    do
    :: p < c_head ->
#ifndef BROKEN_NO_ZERO
        hdr[p % SIZE] = 0;
#endif
        p++
    :: else -> break
    od;
    atomic { c_pub = c_head; head_sh = c_head }       /* Release store */
}

proctype Consumer()
{
    byte expected = 0, at, off, h, span, p;
    bool rx_freed = false, freed, spun = false, woke = false;

    do
    :: expected < M ->
peek:   /* Consumer::peek: one shared load per step, local checks folded in */
        atomic {
            at = c_head;
            off = at % SIZE;
            h = hdr[off];                             /* Acquire load */
            if
            :: h == 0 -> goto idle
            :: h == PADHDR(at) && off != 0 -> at = at + SIZE - off
            :: else -> skip
            fi
        };
        atomic {
            if
            :: at != c_head ->
                h = hdr[at % SIZE];                   /* the frame after the padding */
                if
                :: h == 0 -> goto idle
                :: else -> skip
                fi
            :: else -> skip
            fi;
            span = h % 4;
            assert(h / 16 == KFRAME && (h / 4) % 4 == LAP(at) &&
                   span >= 1 && span <= MAXSPAN && (at % SIZE) + span <= SIZE)   /* D2 */
        };
        /* the engine copies the payload out; Consumer::release only moves head */
        atomic {
            assert(data[at % SIZE] == expected + 1);  /* D1 */
            expected++;
            c_head = at + span;
            spun = false
        };
        /* recv_frame: hand space back once a batch has been consumed */
        if
        :: c_head - c_pub >= BATCH -> publish(); rx_freed = true
        :: else -> skip
        fi;
#ifndef BROKEN_NO_RING_AFTER_RX
        /* Endpoint::progress_tx(cq, received): a pass that received frames ends with
         * the doorbell, which rings when space was handed back */
        if
        :: rx_freed -> doorbell(flagP, evP); rx_freed = false
        :: true -> skip
        fi
#endif
    :: expected == M -> break
    od;
    goto done;

idle:
#ifndef BROKEN_NO_RING_AFTER_RX
    /* the pass that handed space back ends with a doorbell */
    if
    :: rx_freed -> doorbell(flagP, evP); rx_freed = false
    :: else -> skip
    fi;
#endif
#ifndef NO_IDLE_HAND_BACK
    /* ShmDevice::recv_frame found no frame: hand back everything consumed, and ring
     * if the producer sleeps for room (device.rs, the Ok(None) arm) */
    if
    :: c_head != c_pub -> publish(); doorbell(flagP, evP)
    :: else -> skip
    fi;
#endif
#ifdef BUSY_POLL
    /* an application that only calls Worker::poll(): never sleeps */
    goto peek;
#else
    /* Worker::wait spins (polls again) for its budget, then sleeps */
    if
    :: !spun -> spun = true; goto peek
    :: true -> skip
    fi;
    /* ShmDevice::arm_sleep: hand back everything consumed; ring if anything went back */
    freed = (c_head != c_pub);
    if
    :: freed -> publish()
    :: else -> skip
    fi;
    if
    :: freed || rx_freed -> rx_freed = false; doorbell(flagP, evP)
    :: else -> skip
    fi;
    /* arm_sleep_announced */
    flagC = 1;                                        /* announce_sleep */
#ifndef BROKEN_NO_RECHECK_DATA
    if
    :: hdr[c_head % SIZE] != 0 -> flagC = 0; goto peek   /* Consumer::has_data */
    :: else -> skip
    fi;
#endif
    c_asleep = true;
    atomic { evC > 0 -> c_asleep = false }            /* ppoll returns */
    flagC = 0;                                        /* disarm_all */
    evC = 0;                                          /* notifier.drain() */
    goto peek;
#endif

done:
    assert(expected == M)                             /* D1 */
}

init {
    atomic {
        run Producer();
        run Consumer()
    }
}

ltl wake_consumer { [] ((c_asleep && hdr[c_head % SIZE] != 0) -> <> !c_asleep) }
ltl wake_producer { [] ((p_asleep && p_tail + p_need - head_sh <= SIZE) -> <> !p_asleep) }
