/*
 * rendezvous.pml -- the rendezvous protocol, with a peer that dies at any step.
 *
 * Models crates/strait-core/src/engine.rs (as of commit 40e404f):
 *   Endpoint::flush            RTS leaves as a credited message (RndvSendState::Announced);
 *                              in the Pushing state DATA chunks follow, and the send
 *                              completes (Ok) once the last chunk is in the device
 *   EpState::on_frame          Rts matches a posted receive (-> rndv_starts) or is parked
 *                              in the unexpected queue; Cts -> Pushing; Data must arrive
 *                              at offset `received` and completes the receive when all
 *                              accepted bytes are in; Fin completes the send with the
 *                              FIN status (FIN_OK -> Ok, else RemoteReadFailed);
 *                              Close -> peer_closed
 *   EpState::post_recv         a receive matching a parked RTS starts the transfer;
 *   EpState::post_recv_after_close  after the endpoint stopped it fails (Err(Closed))
 *   Endpoint::start_rndv_recv  in RndvMode::RemoteRead on a device that supports it, a
 *                              remote read: success -> FIN_OK
 *                              and Ok; Unsupported (EPERM) -> fall back to CTS (copy
 *                              mode); any other error -> check_peer(): if it fails,
 *                              device_failed (PeerGone), else FIN_REMOTE_READ_FAILED and
 *                              RemoteReadFailed. Copy mode (also what Auto
 *                              now means): CTS, then DATA arrives.
 *   EpState::settle_after_peer_close  at the end of the progress pass that saw Close:
 *                              posted receives, rndv sends/receives end PeerGone
 *   Endpoint::device_failed / EpState::fail  everything outstanding ends PeerGone
 *   Worker::close              the application closes: fail(Canceled) (which clears
 *                              ctrlq), a best-effort Close frame, then shutdown
 * and crates/strait-shm/src/device.rs:
 *   remote_read                re-checks the hang-up after reading -> PeerGone
 *   check_peer                 fails only if the peer hung up AND nothing it published
 *                              is left to read
 * and crates/strait-core/src/worker.rs Worker::sleep / check_liveness: the sleeping
 *   worker polls the peer's socket (POLLRDHUP), and check_liveness runs check_peer for
 *   every endpoint with outstanding work or a blocked send.
 *
 * The shm rings are abstracted as FIFO channels of RING frames each way (their
 * internals are models/shm_ring.pml). A peer death is either a crash (the kernel
 * closes the socket: the survivor sees a hang-up, no Close frame) or an application
 * close (Close frame if the ring had room, then shutdown's hang-up); it can happen
 * between any two engine steps of either side, at most once per run. The receiver's
 * data movement is chosen non-deterministically: remote read (RemoteRead mode on a
 * device that supports it) or copy mode (Copy, Auto); a remote read may succeed, fail
 * (EFAULT-like) or be refused (EPERM, falls back to copy mode).
 *
 * Parameters: K = 3 DATA chunks, RING = 2 frames per direction (so a push can block
 * on a full ring). The whole state space is explored (depth bound -m10000 in
 * scripts/test-models, never reached).
 *
 * Properties
 *   R1 no-hang     (safety run: no invalid end state) neither side ever waits forever
 *   R2 completes   (assert at each surviving side's end, and ltl `completes`) a side
 *                  that does not die always ends its operation with a completion:
 *                  success or an error
 *   R3 published   (assert) frames a peer published before it died are still
 *                  delivered: if the FIN_OK (or every DATA chunk) reached the ring,
 *                  the survivor ends Ok
 *   R4 agree       (assert) when nobody dies, both sides report the same outcome
 *
 * Broken variants (each must be rejected by spin)
 *   -DBROKEN_NO_HUP_WATCH      the survivor does not watch the peer's hang-up (no
 *                              liveness check)                          -> R1, R2 fail
 *   -DBROKEN_SETTLE_KEEPS_SENDS settle_after_peer_close forgets rndv_sends -> R2 fails
 *   -DBROKEN_CHECK_PEER_IGNORES_DATA check_peer fails even with frames still to
 *                              read                                      -> R3 fails
 *   -DBROKEN_FIN_STATUS_IGNORED the sender takes any FIN as success     -> R4 fails
 */

#ifndef K
#define K 3
#endif
#ifndef RING
#define RING 2
#endif

#define S 0
#define R 1

/* completion statuses */
#define NONE      0
#define OK        1
#define RRFAILED  2   /* Status::RemoteReadFailed */
#define GONE      3   /* Status::PeerGone */
#define CANCELED  4   /* Status::Canceled (own application closed) */
#define CLOSEDERR 5   /* post_recv refused: PostError::Closed */

/* FIN statuses */
#define FIN_OK   0
#define FIN_FAIL 1

mtype = { RTS, CTS, DATA, FIN, CLOSE };

chan s2r = [RING] of { mtype, byte };
chan r2s = [RING] of { mtype, byte };

bool hup[2];         /* side i's socket hung up / CLOSED word set */
bool gone[2];        /* ghost: side i died (crash or close) */
bool died;           /* at most one side dies per run */
byte st[2];          /* completion status of side i's operation */
bool fin_ok_out;     /* ghost: a FIN_OK frame reached the ring */
bool all_data_out;   /* ghost: every DATA chunk reached the ring */

/* sender states */
#define SQUEUED    0  /* RTS in msgq */
#define SANNOUNCED 1
#define SPUSHING   2
#define SDONE      3

/* receiver states */
#define RIDLE  0      /* nothing matched yet */
#define RSTART 1      /* matched RTS in rndv_starts */
#define RCOPY  2      /* rndv_recvs: waiting for DATA */
#define RDONE  3

/* receiver's pending control frame (ctrlq holds at most one here) */
#define NOCTRL  0
#define CCTS    1
#define CFINOK  2
#define CFINBAD 3

#ifdef BROKEN_CHECK_PEER_IGNORES_DATA
#define NOTHING_TO_READ(c) true
#define UNREAD(c) false
#else
#define NOTHING_TO_READ(c) empty(c)
#define UNREAD(c) nempty(c)
#endif

proctype Sender()
{
    byte state = SQUEUED, next = 0, v;
    bool peer_closed = false, failed = false;
    mtype t;

    do
    /* flush: the RTS (credits assumed available: see credits.pml) */
    :: atomic { !failed && state == SQUEUED && nfull(s2r) -> s2r!RTS, 0; state = SANNOUNCED }
    /* progress step 1: one received frame */
    :: atomic {
        !failed && nempty(r2s) -> r2s?t, v;
        if
        :: t == CTS -> assert(state == SANNOUNCED); state = SPUSHING
        :: t == FIN -> assert(state == SANNOUNCED); state = SDONE;
#ifdef BROKEN_FIN_STATUS_IGNORED
            st[S] = OK
#else
            if
            :: v == FIN_OK -> st[S] = OK
            :: else -> st[S] = RRFAILED
            fi
#endif
        :: t == CLOSE -> peer_closed = true
        fi
       }
    /* flush: DATA chunks, in order */
    :: atomic {
        !failed && state == SPUSHING && nfull(s2r) -> s2r!DATA, next; next++;
        if
        :: next == K -> state = SDONE; st[S] = OK; all_data_out = true
        :: else -> skip
        fi
       }
    /* end of the progress pass: settle_after_peer_close */
    :: atomic {
        !failed && peer_closed ->
#ifndef BROKEN_SETTLE_KEEPS_SENDS
        if
        :: state != SDONE -> st[S] = GONE; state = SDONE
        :: else -> skip
        fi;
#endif
        failed = true
       }
#ifndef BROKEN_NO_HUP_WATCH
    /* ppoll saw the hang-up -> check_liveness -> check_peer fails -> device_failed */
    :: atomic {
        !failed && state != SDONE && hup[R] && NOTHING_TO_READ(r2s) ->
        st[S] = GONE; state = SDONE; failed = true
       }
#endif
    /* this side dies: a crash ... */
    :: atomic { !died -> died = true; gone[S] = true; hup[S] = true; goto dead }
    /* ... or the application closes the endpoint */
    :: atomic {
        !died -> died = true; gone[S] = true;
        if
        :: !failed && state != SDONE -> st[S] = CANCELED
        :: else -> skip
        fi;
        if
        :: !failed && nfull(s2r) -> s2r!CLOSE, 0
        :: true -> skip      /* no room, or close()'s progress pass hit a rejected frame */
        fi;
        hup[S] = true;
        goto dead
       }
    /* the operation is over */
    :: state == SDONE || failed -> break
    od;
    assert(st[S] != NONE);                        /* R2 */
    assert(!fin_ok_out || st[S] == OK);           /* R3 */
    assert(died || st[S] == st[R] || st[R] == NONE);  /* R4 (checked again at the receiver) */
dead:
    skip
}

proctype Receiver()
{
    byte state = RIDLE, recvd = 0, ctrl = NOCTRL, v;
    bool posted = false, parked = false, peer_closed = false, failed = false, read_ok;
    mtype t;

    /* RndvMode::RemoteRead on a device with remote reads, or copy mode (Copy, Auto) */
    if
    :: read_ok = true
    :: read_ok = false
    fi;

    do
    /* the application posts the receive */
    :: atomic {
        !posted && !gone[R] -> posted = true;
        if
        :: failed -> st[R] = CLOSEDERR; state = RDONE
        :: !failed && parked -> parked = false; state = RSTART
        :: !failed && !parked -> skip
        fi
       }
    /* progress step 1: one received frame */
    :: atomic {
        !failed && nempty(s2r) -> s2r?t, v;
        if
        :: t == RTS ->
            if
            :: posted && state == RIDLE -> state = RSTART
            :: else -> parked = true
            fi
        :: t == DATA -> assert(state == RCOPY && v == recvd); recvd++;
            if
            :: recvd == K -> st[R] = OK; state = RDONE
            :: else -> skip
            fi
        :: t == CLOSE -> peer_closed = true
        fi
       }
    /* progress step 2: start_rndv_recv */
    :: atomic {
        !failed && state == RSTART ->
        if
        :: read_ok ->
            if
            :: hup[S] ->      /* remote_read: hang-up after the read -> PeerGone */
                if
                :: UNREAD(s2r) -> ctrl = CFINBAD; st[R] = RRFAILED; state = RDONE
                :: NOTHING_TO_READ(s2r) -> st[R] = GONE; state = RDONE; failed = true
                fi
            :: else ->
                if
                :: ctrl = CFINOK; st[R] = OK; state = RDONE        /* read succeeded */
                :: ctrl = CFINBAD; st[R] = RRFAILED; state = RDONE /* read failed, peer alive */
                :: read_ok = false; ctrl = CCTS; state = RCOPY     /* EPERM: copy mode */
                fi
            fi
        :: else -> ctrl = CCTS; state = RCOPY
        fi
       }
    /* flush: the control frame */
    :: atomic {
        !failed && ctrl != NOCTRL && nfull(r2s) ->
        if
        :: ctrl == CCTS -> r2s!CTS, 0
        :: ctrl == CFINOK -> r2s!FIN, FIN_OK; fin_ok_out = true
        :: ctrl == CFINBAD -> r2s!FIN, FIN_FAIL
        fi;
        ctrl = NOCTRL
       }
    /* end of the progress pass: settle_after_peer_close (rndv_starts were started first) */
    :: atomic {
        !failed && peer_closed && state != RSTART ->
        if
        :: state == RCOPY || (posted && state == RIDLE) -> st[R] = GONE; state = RDONE
        :: else -> skip
        fi;
        failed = true
       }
#ifndef BROKEN_NO_HUP_WATCH
    /* ppoll saw the hang-up -> check_liveness (outstanding work or a blocked send) */
    :: atomic {
        !failed && hup[S] && NOTHING_TO_READ(s2r) &&
        ((posted && state != RDONE) || (ctrl != NOCTRL && full(r2s))) ->
        if
        :: state != RDONE -> st[R] = GONE; state = RDONE
        :: else -> skip
        fi;
        failed = true
       }
#endif
    /* this side dies: a crash ... */
    :: atomic { !died -> died = true; gone[R] = true; hup[R] = true; goto dead }
    /* ... or the application closes the endpoint (fail(Canceled) clears ctrlq) */
    :: atomic {
        !died -> died = true; gone[R] = true;
        if
        :: !failed && posted && state != RDONE -> st[R] = CANCELED
        :: else -> skip
        fi;
        if
        :: !failed && nfull(r2s) -> r2s!CLOSE, 0
        :: true -> skip
        fi;
        hup[R] = true;
        goto dead
       }
    /* the operation is over and its control frame is out (or the endpoint stopped) */
    :: state == RDONE && (ctrl == NOCTRL || failed) -> break
    od;
    assert(st[R] != NONE);                        /* R2 */
    assert(!all_data_out || st[R] == OK);         /* R3 */
    assert(died || st[R] == st[S] || st[S] == NONE);  /* R4 (checked again at the sender) */
dead:
    skip
}

init {
    atomic {
        run Sender();
        run Receiver()
    }
}

/* R2: every side that does not die completes its operation */
ltl completes { <> ((st[S] != NONE || gone[S]) && (st[R] != NONE || gone[R])) }
