/*
 * dgram_ring.pml -- the datagram ring of `strait run`'s UDP channels: one producer,
 * two consumers (threads or forked processes sharing the receiving socket).
 *
 * Models, as of the commit that added it:
 *   crates/strait-shm/src/dgram.rs
 *     DgramRing::push    room check (tail - head + waste + record <= size, head
 *                        Acquire); a wrap record at the end when the record does not
 *                        fit before it; payload; header word; tail (Release)
 *     DgramRing::used    head, tail, head again: the pair is used only if the head
 *                        did not move; impossible positions are Corrupt
 *     DgramRing::record  the header at head (Acquire), checked against the tail; a
 *                        failed check is Corrupt only if head has not moved since
 *     DgramRing::take    record at head: a wrap record is skipped with a CAS of head;
 *                        a data record is copied out, then claimed with a CAS of head
 *                        from its position to the next (a lost CAS throws the copy
 *                        away and looks again)
 *   crates/strait-preload/src/udp.rs InChan::take, OutChan::push (one producer per
 *     ring, under the channel's lock)
 *
 * Cells are the ring's 8-byte words: a record is a header cell and 1 or 2 payload
 * cells (chosen non-deterministically per datagram), in a ring of SIZE = 5 cells, so
 * runs need wrap records. M = 4 datagrams. The producer waits for room (the code
 * drops the datagram after a second look; waiting explores more interleavings). A
 * payload cell of datagram k holds k + 1. Each consumer keeps taking until all M
 * were taken (by either).
 *
 * Properties (safety run)
 *   G1 exactly once   every datagram is taken once, whole (both payload cells of one
 *                     datagram), and each consumer takes them in increasing order
 *   G2 honest         a consumer never finds an honest ring Corrupt
 *   no invalid end state (all M taken, everybody done)
 *
 * Broken variants (each must be rejected by spin)
 *   -DBROKEN_CLAIM_BEFORE_COPY  claim with the CAS, then copy: the producer may
 *                               already reuse the space                 -> G1 fails
 *   -DBROKEN_NO_HEAD_RECHECK    a record that does not check out is Corrupt at once:
 *                               another consumer took it and the producer wrote the
 *                               next lap's header there                 -> G2 fails
 *   -DBROKEN_ONE_LOOK           (head, tail) read once, tail first (the code before
 *                               this model and loom_dgram.rs): another consumer
 *                               moves the head past the stale tail     -> G2 fails
 */

#ifndef SIZE
#define SIZE 5
#endif
#ifndef M
#define M 4
#endif

#define DATA 1
#define WRAP 2

byte kind[SIZE];     /* header cell: kind */
byte clen[SIZE];      /* header cell: payload cells */
byte cell[SIZE];     /* payload cells: datagram number + 1 */
byte tail, head;
byte taken[M];       /* ghost: how often each datagram was taken */
byte ntaken;         /* ghost: datagrams taken in all */

active proctype Producer() {
    byte k = 0, t, h, off, waste, rec, at, n, i;
    do
    :: k == M -> break
    :: k < M ->
        if
        :: n = 1
        :: n = 2
        fi;
        rec = 1 + n;
        t = tail;
        off = t % SIZE;
        if
        :: SIZE - off < rec -> waste = SIZE - off
        :: else -> waste = 0
        fi;
        /* room (head Acquire); wait for it */
        h = head;
        do
        :: (t - h) + waste + rec <= SIZE -> break
        :: else -> h = head
        od;
        if
        :: waste > 0 -> kind[off] = WRAP; clen[off] = 0
        :: else -> skip
        fi;
        at = (off + waste) % SIZE;
        i = 0;
        do
        :: i < n -> cell[(at + 1 + i) % SIZE] = k + 1; i++
        :: else -> break
        od;
        clen[at] = n;
        kind[at] = DATA;
        tail = t + waste + rec;
        k++
    od
}

proctype Consumer() {
    byte h, t, h2, off, k, n, v, v2, last = 0;
    bit ok;
    do
    :: ntaken == M -> break
    :: ntaken < M ->
        /* used() */
#ifdef BROKEN_ONE_LOOK
        t = tail;
        h = head;
#else
        h = head;
        t = tail;
        h2 = head;
        if
        :: h2 != h -> goto next
        :: else -> skip
        fi;
#endif
        assert(t >= h && t - h <= SIZE);                     /* G2 */
        if
        :: t == h -> goto next
        :: else -> skip
        fi;
        off = h % SIZE;
        k = kind[off];
        n = clen[off];
#ifdef BROKEN_NO_HEAD_RECHECK
        assert((k == WRAP && t - h >= SIZE - off) || (k == DATA && off + 1 + n <= SIZE && t - h >= 1 + n));  /* G2 */
#else
        /* DgramRing::record: a record that does not check out is Corrupt only if
         * the head did not move meanwhile (else another consumer took it and the
         * producer may be reusing the cell) */
        if
        :: (k == WRAP && t - h >= SIZE - off) || (k == DATA && off + 1 + n <= SIZE && t - h >= 1 + n) -> skip
        :: else ->
            h2 = head;
            assert(h2 != h);                                 /* G2 */
            goto next
        fi;
#endif
        if
        :: k == WRAP ->
            atomic { if :: head == h -> head = h + SIZE - off :: else -> skip fi };
            goto next
        :: else -> skip
        fi;
#ifdef BROKEN_CLAIM_BEFORE_COPY
        atomic { if :: head == h -> head = h + 1 + n; ok = 1 :: else -> ok = 0 fi };
#endif
        v = cell[off + 1];
        if
        :: n == 2 -> v2 = cell[off + 2]
        :: else -> v2 = v
        fi;
#ifndef BROKEN_CLAIM_BEFORE_COPY
        atomic { if :: head == h -> head = h + 1 + n; ok = 1 :: else -> ok = 0 fi };
#endif
        if
        :: ok ->
            assert(v == v2 && v >= 1 && v <= M);             /* G1 whole */
            assert(v > last);                                /* G1 in order */
            last = v;
            atomic { taken[v - 1]++; ntaken++ };
            assert(taken[v - 1] == 1)                        /* G1 once */
        :: else -> skip
        fi;
next:
        skip
    od
}

init {
    atomic { run Consumer(); run Consumer() }
}
