/*
 * byte_ring.pml -- the byte-stream ring of `strait run`'s TCP connections and its
 * sleep/wake doorbell.
 *
 * Models, as of the commit that added it:
 *   crates/strait-shm/src/stream.rs
 *     ByteRing::writable      producer: room = size - (tail - head), head loaded
 *                             (Acquire), positions checked (Corrupt if impossible)
 *     ByteRing::write_at      copies the bytes at tail (wrapping at the end)
 *     ByteRing::publish_to    stores the new tail (Release)
 *     ByteRing::readable      consumer: tail - head bytes waiting, checked
 *     ByteRing::read_at       copies them out
 *     ByteRing::consume_to    stores the new head (Release): the space goes back
 *   crates/strait-shm/src/ring.rs announce_sleep / peer_needs_wake (flag, SeqCst
 *     fence, load, swap)
 *   crates/strait-preload/src/conn.rs
 *     Conn::send              room; copy_in; publish; wake_if(RSLEEP); when full:
 *                             Conn::wait(tx) -> announce(WSLEEP), re-check room,
 *                             poll on the eventfd, drain it
 *     Conn::recv              avail; copy_out; consume; wake_if(WSLEEP); when empty:
 *                             Conn::wait(rx) -> announce(RSLEEP), re-check, poll,
 *                             drain
 *
 * One direction of one connection. Writes and reads take 1 or 2 bytes at a time,
 * chosen non-deterministically (any split is legal for a byte stream), through a
 * ring of SIZE = 3 bytes (not a power of two: the code allows any size), M = 6
 * bytes in all, so runs wrap twice. A sleeper blocks until its eventfd counter is
 * non-zero (the peer's doorbell increments it), then drains it and loops, as
 * Conn::wait does. PROMELA is sequentially consistent, which the SeqCst fences of
 * the flag handshake give; the Release/Acquire publication of the bytes is the loom
 * model's job (crates/strait-shm/tests/loom_stream.rs).
 *
 * Properties (safety run: assertions and invalid end states)
 *   B1 stream   every byte arrives once, intact, in order, all M of them
 *   B2 honest   neither side ever finds impossible positions (never Corrupt)
 *   B3 no lost wake-up: no run ends with a side asleep forever (an invalid end
 *               state: the consumer waiting for bytes that were published, or the
 *               producer waiting for room that was handed back)
 *
 * Broken variants (each must be rejected by spin)
 *   -DBROKEN_PUBLISH_BEFORE_FILL  the tail is stored before the bytes   -> B1 fails
 *   -DBROKEN_RELEASE_BEFORE_COPY  the head is stored before the copy    -> B1 fails
 *   -DBROKEN_NO_RECHECK_DATA      the consumer sleeps without re-checking for
 *                                 bytes after announcing                -> B3 fails
 *   -DBROKEN_NO_RECHECK_ROOM      the producer sleeps without re-checking for room
 *                                                                       -> B3 fails
 */

#ifndef SIZE
#define SIZE 3
#endif
#ifndef M
#define M 6
#endif

byte data[SIZE];     /* the ring's bytes: byte k of the stream is k + 1 */
byte tail;           /* producer position (shared) */
byte head;           /* consumer position (shared) */
bit flagC;           /* RSLEEP: the consumer sleeps waiting for bytes */
bit flagP;           /* WSLEEP: the producer sleeps waiting for room */
byte evC, evP;       /* the two ends' eventfd counters */

/* wake_if: peer_needs_wake (fence; load; swap) then the eventfd write */
inline wake_if(flag, ev) {
    if
    :: flag != 0 ->
        atomic {
            if
            :: flag != 0 -> flag = 0; ev++
            :: else -> skip
            fi
        }
    :: else -> skip
    fi
}

active proctype Producer() {
    byte sent = 0, t, h, room, n, i;
    do
    :: sent == M -> break
    :: sent < M ->
        t = tail;
        h = head;
        assert(t >= h && t - h <= SIZE);           /* B2 */
        room = SIZE - (t - h);
        if
        :: room == 0 ->
            /* Conn::wait(tx): announce, re-check, sleep, drain */
            flagP = 1;
#ifndef BROKEN_NO_RECHECK_ROOM
            if
            :: SIZE - (tail - head) > 0 -> flagP = 0
            :: else ->
#endif
                evP > 0;
                evP = 0;
#ifndef BROKEN_NO_RECHECK_ROOM
            fi
#endif
        :: room > 0 ->
            if
            :: n = 1
            :: room >= 2 && M - sent >= 2 -> n = 2
            fi;
#ifdef BROKEN_PUBLISH_BEFORE_FILL
            tail = t + n;
#endif
            i = 0;
            do
            :: i < n -> data[(t + i) % SIZE] = sent + i + 1; i++
            :: else -> break
            od;
#ifndef BROKEN_PUBLISH_BEFORE_FILL
            tail = t + n;
#endif
            sent = sent + n;
            wake_if(flagC, evC)
        fi
    od
}

active proctype Consumer() {
    byte got = 0, t, h, avail, n, i, v;
    do
    :: got == M -> break
    :: got < M ->
        h = head;
        t = tail;
        assert(t >= h && t - h <= SIZE);           /* B2 */
        avail = t - h;
        if
        :: avail == 0 ->
            /* Conn::wait(rx): announce, re-check, sleep, drain */
            flagC = 1;
#ifndef BROKEN_NO_RECHECK_DATA
            if
            :: tail - head > 0 -> flagC = 0
            :: else ->
#endif
                evC > 0;
                evC = 0;
#ifndef BROKEN_NO_RECHECK_DATA
            fi
#endif
        :: avail > 0 ->
            if
            :: n = 1
            :: avail >= 2 -> n = 2
            fi;
#ifdef BROKEN_RELEASE_BEFORE_COPY
            head = h + n;
            wake_if(flagP, evP);
#endif
            i = 0;
            do
            :: i < n ->
                v = data[(h + i) % SIZE];
                assert(v == got + i + 1);          /* B1 */
                i++
            :: else -> break
            od;
#ifndef BROKEN_RELEASE_BEFORE_COPY
            head = h + n;
            wake_if(flagP, evP);
#endif
            got = got + n
        fi
    od;
    assert(got == M)                               /* B1: all of them */
}
