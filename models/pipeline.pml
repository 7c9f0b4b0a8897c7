/*
 * pipeline.pml -- the pipelined copy engine (copy-mode rendezvous).
 *
 * Models, as of commit 40e404f:
 *   crates/strait-core/src/engine.rs
 *     Endpoint::flush, the "Rendezvous data (copy mode), pipelined in chunks" loop:
 *       piece = chunk if accept >= pipeline_threshold, else accept.clamp(1, max_payload);
 *       for each piece at offset `next`: send_header(Data { offset: next }, payload)
 *       -> Ok(true): next += n;  Ok(false) (ring full): tx_blocked, keep `next`, retry
 *       on a later pass; the send completes when next >= accept
 *     EpState::new  chunk = cfg.chunk_size.min(max_payload)
 *     EpState::on_frame, Header::Data: the frame must be at offset == received
 *       (else the endpoint is rejected as corrupt); read_raw copies the payload into
 *       the posted buffer at `received`; the receive completes when received == accept
 *   crates/strait-shm/src/device.rs send_frame (reserve, fill = the engine's copy in,
 *     commit) and recv_frame (peek, handle = the engine's copy out, release), over
 *   crates/strait-shm/src/ring.rs Producer::reserve/commit (header word published after
 *     the payload), Consumer::peek/release (release only moves the consumer's own
 *     head) and Consumer::publish (header words of consumed cells zeroed, then `head`
 *     stored), called by recv_frame once publish_batch (ring/8) is consumed and by
 *     arm_sleep before the receiving worker sleeps.
 *
 * The ring is reduced to RSLOTS frame slots (every piece here fits one slot; byte
 * positions, padding and the sleep/wake doorbell are models/shm_ring.pml's subject, so
 * a blocked side here simply waits for its condition). A copy into or out of a slot
 * takes two steps (two halves of the chunk), so that the other side can act in the
 * middle of it. The sender's "writing" interval runs from reserve to commit, the
 * receiver's "reading" interval from peek to release.
 *
 * Parameters (units of chunk_size): ACCEPT = 5 units accepted by the CTS, CHUNK = 1,
 * PIPELINE_THRESHOLD = 4 (so the message is pipelined in 5 chunks), MAXPAYLOAD = 2,
 * RSLOTS = 3 (the ring wraps, slots are reused), PBATCH = 1 slot handed back at a time
 * (ring/8 is one default 128 KiB chunk of the default 1 MiB ring; scripts/test-models
 * also runs PBATCH = 2). -DCOARSE sets PIPELINE_THRESHOLD above
 * ACCEPT and MAXPAYLOAD = ACCEPT: the message moves as one piece. (-DCOARSE
 * -DMAXPAYLOAD=2 shows that a "coarse" message longer than max_payload still moves in
 * max_payload pieces, which overlap.) The whole state space is explored (depth bound
 * -m10000 in scripts/test-models, never reached).
 *
 * Properties
 *   P1 exclusive  (assert, monitor) a slot being written is never being read: sender
 *                 and receiver never work on the same chunk
 *   P2 overlap    (ltl no_overlap, must be VIOLATED) spin finds a run in which the
 *                 sender writes one chunk while the receiver copies an earlier one; with
 *                 -DCOARSE (one piece) the same claim holds, so the check can tell
 *   P3 in_order   (assert + no invalid end state) every chunk arrives once, intact, at
 *                 the expected offset, and the transfer completes on both sides
 *
 * Broken variants (each must be rejected by spin)
 *   -DBROKEN_EARLY_RELEASE  the receiver hands the slot back (publish) before it has
 *                           copied the chunk out                       -> P1 fails
 *   -DBROKEN_SKIP_ON_FULL   on Ok(false) (ring full) the sender advances `next` anyway
 *                                                                      -> P3 fails
 */

#ifndef ACCEPT
#define ACCEPT 5
#endif
#define CHUNK 1
#ifdef COARSE
#define PIPELINE_THRESHOLD (ACCEPT + 1)
#ifndef MAXPAYLOAD
#define MAXPAYLOAD ACCEPT
#endif
#else
#define PIPELINE_THRESHOLD 4
#ifndef MAXPAYLOAD
#define MAXPAYLOAD 2
#endif
#endif
#ifndef RSLOTS
#define RSLOTS 3
#endif
#ifndef PBATCH
#define PBATCH 1      /* publish_batch = ring/8 = one 128 KiB chunk of a 1 MiB ring */
#endif
#define NONE 255

/* Endpoint::flush: the piece size */
#define PIECE (ACCEPT >= PIPELINE_THRESHOLD -> CHUNK : (ACCEPT < MAXPAYLOAD -> ACCEPT : MAXPAYLOAD))

byte hdr[RSLOTS];     /* header word of a slot: 0, or 1 + the frame's offset */
byte plen[RSLOTS];    /* payload length written into the slot's header */
byte d0[RSLOTS];      /* first half of the payload: the offset it was copied from */
byte d1[RSLOTS];      /* second half */
byte head_sh;         /* the consumer position the producer sees */

/* ghosts: what each side is working on */
byte wslot = NONE, rslot = NONE;
byte wchunk = NONE, rchunk = NONE;
bool send_done, recv_done;

proctype Sender()
{
    byte next = 0, n, tail = 0, hc = 0, slot;

again:
    do
    :: next < ACCEPT ->
        atomic {
            n = PIECE;
            if
            :: n > ACCEPT - next -> n = ACCEPT - next
            :: else -> skip
            fi;
            /* Producer::reserve */
            if
            :: tail - hc >= RSLOTS -> hc = head_sh
            :: else -> skip
            fi;
            if
            :: tail - hc < RSLOTS -> slot = tail % RSLOTS; wslot = slot; wchunk = next
            :: else -> goto blocked                   /* Ok(false): tx_blocked */
            fi
        };
        /* fill: the engine copies the piece in */
        d0[slot] = next;
        d1[slot] = next;
        /* Producer::commit: the header word last */
        atomic { plen[slot] = n; hdr[slot] = next + 1; tail++; wslot = NONE; wchunk = NONE };
        next = next + n
    :: next >= ACCEPT -> break
    od;
    send_done = true;                                 /* complete_send(Ok) */
    goto done;

blocked:
#ifdef BROKEN_SKIP_ON_FULL
    next = next + n;
#endif
    /* the pass returns; a later pass retries once the consumer has freed a slot */
    atomic { tail - head_sh < RSLOTS -> hc = head_sh };
    goto again;
done:
    skip
}

/* ring::Consumer::publish: zero the header words of consumed slots, then store head */
inline publish() {
    p = pub;
    do
    :: p < head -> hdr[p % RSLOTS] = 0; p++
    :: else -> break
    od;
    atomic { pub = head; head_sh = head }
}

proctype Receiver()
{
    byte received = 0, head = 0, pub = 0, slot, off, n, v0, v1, p;

    do
    :: received < ACCEPT ->
        /* Consumer::peek: the header word at head */
        atomic {
            hdr[head % RSLOTS] != 0 ->
            slot = head % RSLOTS;
            off = hdr[slot] - 1;
            n = plen[slot];
            rslot = slot;
            rchunk = off
        };
        /* on_frame, Header::Data: offset must be `received` */
        assert(off == received && n >= 1 && n <= ACCEPT - received);   /* P3 */
#ifdef BROKEN_EARLY_RELEASE
        head++;
        publish();
#endif
        /* read_raw: the engine copies the piece out */
        v0 = d0[slot];
        v1 = d1[slot];
        assert(v0 == off && v1 == off);                                 /* P3 */
#ifndef BROKEN_EARLY_RELEASE
        /* Consumer::release (head moves locally), then recv_frame hands the space
           back once PBATCH slots are consumed */
        atomic { received = received + n; head++; rslot = NONE; rchunk = NONE };
        if
        :: head - pub >= PBATCH -> publish()
        :: else -> skip
        fi
#else
        atomic { received = received + n; rslot = NONE; rchunk = NONE }
#endif
    /* nothing to read: Worker::wait goes to sleep, and arm_sleep hands back
       everything consumed first */
    :: atomic { received < ACCEPT && hdr[head % RSLOTS] == 0 && pub != head } -> publish()
    :: received >= ACCEPT -> break
    od;
    assert(received == ACCEPT);                                         /* P3 */
    recv_done = true                                  /* complete_recv(Ok) */
}

/* P1: checked in every reachable state */
active proctype monitor()
{
    assert(!(wslot != NONE && wslot == rslot))
}

init {
    atomic {
        run Sender();
        run Receiver()
    }
}

/* P2: must be violated (a witness of overlap) unless -DCOARSE */
ltl no_overlap { [] !(wchunk != NONE && rchunk != NONE) }
