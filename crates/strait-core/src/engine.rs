//! The per-endpoint protocol state machine: eager and rendezvous sends, tag matching,
//! the unexpected-message queue, credit-based flow control with delayed (and
//! piggybacked) credit returns.
//!
//! Everything here is pure logic over a [`Device`]: no system call is made except
//! through the device, so the same engine runs over shared memory, UDP and the
//! simulator.

use std::collections::VecDeque;

use strait_wire::{
    decode, Header, FIN_OK, FIN_REMOTE_READ_FAILED, FIN_TRUNCATED, MAX_HEADER_LEN, PUT_FAILED, PUT_OK,
};

use crate::api::{Completion, EpId, OpKind, Status};
use crate::config::{Config, RndvMode};
use crate::device::{Device, DeviceError, RndvPath, RxFrame};
use crate::region::Buf;
use crate::sansio::EndpointStats;

pub(crate) struct PostedRecv {
    tag: u64,
    mask: u64,
    buf: Buf,
    ctx: u64,
}

enum UnexpectedMsg {
    Eager { tag: u64, data: Vec<u8> },
    Rts { tag: u64, len: u64, msg_id: u32, addr: u64 },
}

/// A message queued for sending that needs a credit.
struct QueuedMsg {
    tag: u64,
    buf: Buf,
    ctx: u64,
    rndv: bool,
}

/// A control frame queued for sending (needs no credit).
#[derive(Clone, Copy)]
enum Ctrl {
    Cts { msg_id: u32, accept: u32 },
    Fin { msg_id: u32, status: u32 },
    Credit,
    Close,
    Put { msg_id: u32, offset: u32, len: u32, addr: u64 },
    PutDone { msg_id: u32, status: u32 },
}

#[derive(PartialEq, Eq)]
enum RndvSendState {
    /// RTS is out; waiting for CTS (copy mode), PUT (split) or FIN (remote read).
    Announced,
    /// Pushing DATA frames: next offset and bytes accepted.
    Pushing { next: usize, accept: usize },
    /// The receiver asked for its part of a split transfer (queued in
    /// `EpState::put_starts`, or written and answered); waiting for FIN.
    PutAsked,
}

/// How the bytes of a matched rendezvous receive arrive.
enum RecvPath {
    /// In DATA frames pushed by the sender (copy mode).
    Pushed,
    /// A split transfer: this side read `[0, cut)` itself (`read_ok` says whether
    /// that worked) and asked the sender to write `[cut, accept)`; `addr` is the
    /// message in the sender's memory (to read the rest if the sender cannot write).
    Split { cut: usize, addr: u64, read_ok: bool, answer: PutAnswer },
}

/// The sender's answer to a split transfer's PUT.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PutAnswer {
    /// Not yet: the sender may be writing into the buffer now.
    Awaited,
    /// It could not write; this side reads the rest (queued in `EpState::split_rests`).
    Refused,
}

/// A PUT to serve: write `[offset, offset + len)` of transfer `msg_id` to `addr` in
/// the peer (the range was checked against the send buffer when the PUT arrived).
struct PutStart {
    msg_id: u32,
    offset: usize,
    len: usize,
    addr: u64,
}

struct RndvSend {
    msg_id: u32,
    tag: u64,
    buf: Buf,
    ctx: u64,
    state: RndvSendState,
}

/// A matched rendezvous message whose bytes are arriving by DATA frames.
struct RndvRecv {
    msg_id: u32,
    tag: u64,
    msg_len: u64,
    buf: Buf,
    accept: usize,
    received: usize,
    ctx: u64,
    path: RecvPath,
}

/// A matched RTS that still needs its data movement started.
struct RndvStart {
    tag: u64,
    msg_len: u64,
    msg_id: u32,
    addr: u64,
    recv: PostedRecv,
}

/// What the frame handler decided; applied after the device releases the frame.
pub(crate) struct EpState {
    pub(crate) id: EpId,
    /// Why the endpoint stopped, if it did.
    pub(crate) failed: Option<Status>,
    /// The peer sent Close: no more messages will arrive.
    peer_closed: bool,
    window: u16,
    /// Credits this side may still spend on messages.
    credits: u16,
    /// Credits freed locally that the peer has not been told about yet.
    credits_owed: u16,
    next_seq: u32,
    expected_seq: u32,
    next_msg_id: u32,
    eager_limit: usize,
    max_payload: usize,
    chunk: usize,
    pipeline_threshold: usize,
    split_threshold: usize,
    mode: RndvMode,
    remote_read_ok: bool,
    /// False once the peer refused a PUT: later transfers are read whole.
    split_ok: bool,
    msgq: VecDeque<QueuedMsg>,
    ctrlq: VecDeque<Ctrl>,
    posted: VecDeque<PostedRecv>,
    unexpected: VecDeque<UnexpectedMsg>,
    spare_bufs: Vec<Vec<u8>>,
    rndv_sends: Vec<RndvSend>,
    rndv_recvs: Vec<RndvRecv>,
    rndv_starts: VecDeque<RndvStart>,
    /// PUTs of the peer to serve (sender side of split transfers).
    put_starts: VecDeque<PutStart>,
    /// Split receives whose rest this side must read (the sender refused the PUT).
    split_rests: VecDeque<u32>,
    /// A frame could not be sent for lack of device room.
    pub(crate) tx_blocked: bool,
    pub(crate) stats: EndpointStats,
    corrupt: Option<String>,
    /// The device's account of why the peer is gone, if it is.
    gone: Option<String>,
}

pub(crate) struct Endpoint<D: Device> {
    pub(crate) dev: D,
    pub(crate) st: EpState,
}

/// Unmatched messages a peer can have waiting: each holds one of its credits until
/// matched, and no credit window exceeds `u16::MAX`, so an honest peer never has
/// more. A peer that ignores credits is stopped here instead of growing the queue
/// without bound.
const MAX_UNEXPECTED: usize = u16::MAX as usize;

fn tag_matches(msg_tag: u64, want: u64, mask: u64) -> bool {
    (msg_tag ^ want) & mask == 0
}

fn complete_recv(
    cq: &mut VecDeque<Completion>,
    ep: EpId,
    r: PostedRecv,
    tag: u64,
    len: usize,
    status: Status,
) {
    let ctx = r.ctx;
    // The hold goes before the completion is visible, so the application can read
    // the bytes as soon as it sees the completion.
    drop(r);
    cq.push_back(Completion { ep, op: OpKind::Recv, ctx, tag, len, status });
    strait_probe::probe!(strait_probe::Stage::CqPushRecv);
}

pub(crate) fn complete_send(
    cq: &mut VecDeque<Completion>,
    ep: EpId,
    buf: Buf,
    ctx: u64,
    tag: u64,
    status: Status,
) {
    let len = buf.len;
    drop(buf);
    cq.push_back(Completion { ep, op: OpKind::Send, ctx, tag, len, status });
}

impl EpState {
    pub(crate) fn new(id: EpId, cfg: &Config, max_frame: usize, credits_hint: Option<u16>) -> Self {
        let max_payload = max_frame.saturating_sub(MAX_HEADER_LEN).max(1);
        // A device's wish raises the default only: a count set on purpose is kept.
        let credits = match credits_hint {
            Some(h) if cfg.credits == Config::default().credits => h.max(cfg.credits),
            _ => cfg.credits,
        };
        EpState {
            id,
            failed: None,
            peer_closed: false,
            window: credits,
            credits,
            credits_owed: 0,
            next_seq: 0,
            expected_seq: 0,
            next_msg_id: 1,
            eager_limit: cfg.eager_threshold.min(max_payload),
            max_payload,
            chunk: cfg.chunk_size.min(max_payload),
            pipeline_threshold: cfg.pipeline_threshold,
            split_threshold: cfg.split_threshold.max(1),
            mode: cfg.rndv_mode,
            remote_read_ok: true,
            split_ok: true,
            msgq: VecDeque::new(),
            ctrlq: VecDeque::new(),
            posted: VecDeque::new(),
            unexpected: VecDeque::new(),
            spare_bufs: Vec::new(),
            rndv_sends: Vec::new(),
            rndv_recvs: Vec::new(),
            rndv_starts: VecDeque::new(),
            put_starts: VecDeque::new(),
            split_rests: VecDeque::new(),
            tx_blocked: false,
            stats: EndpointStats::default(),
            corrupt: None,
            gone: None,
        }
    }

    /// A one-line account of the queues, for diagnostics.
    pub(crate) fn describe(&self) -> String {
        let pushing =
            self.rndv_sends.iter().filter(|s| matches!(s.state, RndvSendState::Pushing { .. })).count();
        format!(
            "credits={} owed={} msgq={} ctrlq={} posted={} unexpected={} rndv_sends={} (pushing {}) rndv_recvs={} \
             rndv_starts={} put_starts={} split_rests={} tx_blocked={} failed={:?}",
            self.credits,
            self.credits_owed,
            self.msgq.len(),
            self.ctrlq.len(),
            self.posted.len(),
            self.unexpected.len(),
            self.rndv_sends.len(),
            pushing,
            self.rndv_recvs.len(),
            self.rndv_starts.len(),
            self.put_starts.len(),
            self.split_rests.len(),
            self.tx_blocked,
            self.failed
        )
    }

    /// True while any operation of this endpoint is unfinished.
    pub(crate) fn outstanding(&self) -> bool {
        !self.msgq.is_empty()
            || !self.posted.is_empty()
            || !self.rndv_sends.is_empty()
            || !self.rndv_recvs.is_empty()
            || !self.rndv_starts.is_empty()
    }

    /// True if a frame that can go now (it does not wait for credits) is queued, so
    /// owed credits will ride on it.
    pub(crate) fn tx_pending(&self) -> bool {
        !self.ctrlq.is_empty()
            || (!self.msgq.is_empty() && self.credits > 0)
            || self.rndv_sends.iter().any(|s| matches!(s.state, RndvSendState::Pushing { .. }))
    }

    /// Why the endpoint was torn down (a corrupt peer's first violation, or the
    /// device's account of the peer's loss), if it was.
    pub(crate) fn last_error(&self) -> Option<&str> {
        self.corrupt.as_deref().or(self.gone.as_deref())
    }

    /// Matches a new receive against the unexpected queue, else queues it.
    pub(crate) fn post_recv(&mut self, recv: PostedRecv, cq: &mut VecDeque<Completion>) {
        let pos = self.unexpected.iter().position(|u| {
            let t = match u {
                UnexpectedMsg::Eager { tag, .. } | UnexpectedMsg::Rts { tag, .. } => *tag,
            };
            tag_matches(t, recv.tag, recv.mask)
        });
        let Some(pos) = pos else {
            self.posted.push_back(recv);
            return;
        };
        match self.unexpected.remove(pos) {
            Some(UnexpectedMsg::Eager { tag, data }) => {
                let n = data.len().min(recv.buf.len);
                // SAFETY: `recv.buf` lies inside its region (checked at post) and the
                // region's in-flight receive count keeps the application out of it.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), recv.buf.ptr(), n) };
                let status = if data.len() > recv.buf.len { Status::Truncated } else { Status::Ok };
                let len = data.len();
                self.spare_bufs.push(data);
                self.credits_owed += 1;
                complete_recv(cq, self.id, recv, tag, len, status);
            }
            Some(UnexpectedMsg::Rts { tag, len, msg_id, addr }) => {
                self.credits_owed += 1;
                self.rndv_starts.push_back(RndvStart { tag, msg_len: len, msg_id, addr, recv });
            }
            None => {}
        }
    }

    /// Removes and returns the oldest posted receive that matches `tag`.
    fn take_posted(&mut self, tag: u64) -> Option<PostedRecv> {
        // The common case, the oldest receive matches, avoids the general removal.
        if self.posted.front().is_some_and(|r| tag_matches(tag, r.tag, r.mask)) {
            return self.posted.pop_front();
        }
        let pos = self.posted.iter().position(|r| tag_matches(tag, r.tag, r.mask))?;
        self.posted.remove(pos)
    }

    /// True if the transmit half of progress has anything to do.
    fn tx_work(&self) -> bool {
        !self.rndv_starts.is_empty()
            || !self.put_starts.is_empty()
            || !self.split_rests.is_empty()
            || self.tx_waiting()
            || self.credits_owed >= self.window.div_ceil(2)
    }

    /// True while a split receive waits for the peer's answer to its PUT: the peer
    /// may be writing into that receive's buffer.
    pub(crate) fn awaiting_puts(&self) -> bool {
        self.rndv_recvs.iter().any(|r| matches!(r.path, RecvPath::Split { answer: PutAnswer::Awaited, .. }))
    }

    /// True if frames wait to go out (for credits, ring room or a peer's answer).
    pub(crate) fn tx_waiting(&self) -> bool {
        !self.msgq.is_empty() || self.tx_pending()
    }

    pub(crate) fn has_rndv_starts(&self) -> bool {
        !self.rndv_starts.is_empty()
    }

    pub(crate) fn queue_send(&mut self, tag: u64, buf: Buf, ctx: u64) {
        let rndv = buf.len > self.eager_limit;
        self.msgq.push_back(QueuedMsg { tag, buf, ctx, rndv });
    }

    pub(crate) fn queue_close(&mut self) {
        self.ctrlq.push_back(Ctrl::Close);
    }

    /// Handles one received frame. Never panics on peer input: a malformed frame is
    /// counted and marks the endpoint corrupt.
    fn on_frame(&mut self, f: &RxFrame<'_>, cq: &mut VecDeque<Completion>) {
        let mut hb = [0u8; MAX_HEADER_LEN];
        let n = f.len().min(MAX_HEADER_LEN);
        if !f.read(0, &mut hb[..n]) {
            return self.reject("frame shorter than it claims".into());
        }
        let (h, hlen) = match decode(&hb[..n]) {
            Ok(x) => x,
            Err(e) => return self.reject(format!("bad header: {e}")),
        };
        let payload = f.len() - hlen;
        let returned = h.credits();
        if returned > 0 {
            match self.credits.checked_add(returned) {
                Some(c) if c <= self.window => self.credits = c,
                _ => return self.reject(format!("peer returned {returned} credits beyond the window")),
            }
        }
        match h {
            Header::Eager { seq, tag, .. } => {
                if !self.check_seq(seq) {
                    return;
                }
                if payload > self.eager_limit {
                    return self.reject(format!("eager payload {payload} above limit {}", self.eager_limit));
                }
                if self.unexpected.len() >= MAX_UNEXPECTED {
                    return self
                        .reject("peer sent more unmatched messages than any credit window allows".into());
                }
                if let Some(r) = self.take_posted(tag) {
                    strait_probe::probe!(strait_probe::Stage::RxMatch);
                    let n = payload.min(r.buf.len);
                    // SAFETY: `r.buf` lies inside its region, which no one else touches
                    // while the receive is in flight; the frame range is bounds-checked.
                    unsafe { f.read_raw(hlen, r.buf.ptr(), n) };
                    strait_probe::probe!(strait_probe::Stage::CopyDone);
                    let status = if payload > r.buf.len { Status::Truncated } else { Status::Ok };
                    self.credits_owed += 1;
                    complete_recv(cq, self.id, r, tag, payload, status);
                } else {
                    let mut data = self.spare_bufs.pop().unwrap_or_default();
                    data.clear();
                    data.resize(payload, 0);
                    f.read(hlen, &mut data);
                    self.stats.unexpected += 1;
                    self.unexpected.push_back(UnexpectedMsg::Eager { tag, data });
                }
            }
            Header::Rts { seq, tag, len, msg_id, addr, .. } => {
                if !self.check_seq(seq) {
                    return;
                }
                if len > u32::MAX as u64 {
                    return self.reject(format!("rendezvous length {len} too large"));
                }
                if self.unexpected.len() >= MAX_UNEXPECTED {
                    return self
                        .reject("peer sent more unmatched messages than any credit window allows".into());
                }
                if let Some(r) = self.take_posted(tag) {
                    strait_probe::probe!(strait_probe::Stage::RxMatch);
                    self.credits_owed += 1;
                    self.rndv_starts.push_back(RndvStart { tag, msg_len: len, msg_id, addr, recv: r });
                } else {
                    self.stats.unexpected += 1;
                    self.unexpected.push_back(UnexpectedMsg::Rts { tag, len, msg_id, addr });
                }
            }
            Header::Cts { msg_id, accept, .. } => {
                let Some(s) = self.rndv_sends.iter_mut().find(|s| s.msg_id == msg_id) else {
                    return self.reject(format!("CTS for unknown transfer {msg_id}"));
                };
                if s.state != RndvSendState::Announced || accept as usize > s.buf.len {
                    return self.reject(format!("CTS for transfer {msg_id} out of place"));
                }
                s.state = RndvSendState::Pushing { next: 0, accept: accept as usize };
            }
            Header::Data { msg_id, offset, .. } => {
                let Some(i) = self.rndv_recvs.iter().position(|r| r.msg_id == msg_id) else {
                    return self.reject(format!("DATA for unknown transfer {msg_id}"));
                };
                let r = &mut self.rndv_recvs[i];
                if !matches!(r.path, RecvPath::Pushed)
                    || offset != r.received as u64
                    || payload > r.accept - r.received
                {
                    return self.reject(format!("DATA for transfer {msg_id} at {offset} out of place"));
                }
                strait_probe::probe!(if r.received + payload == r.accept => strait_probe::Stage::RxLastData);
                // SAFETY: the destination range [received, received+payload) lies
                // within the accepted part of the posted buffer (checked above).
                unsafe { f.read_raw(hlen, r.buf.ptr().add(r.received), payload) };
                r.received += payload;
                if r.received == r.accept {
                    strait_probe::probe!(strait_probe::Stage::CopyDone);
                    let r = self.rndv_recvs.swap_remove(i);
                    let status = if (r.accept as u64) < r.msg_len { Status::Truncated } else { Status::Ok };
                    let recv = PostedRecv { tag: r.tag, mask: 0, buf: r.buf, ctx: r.ctx };
                    complete_recv(cq, self.id, recv, r.tag, r.msg_len as usize, status);
                }
            }
            Header::Put { msg_id, offset, len, addr, .. } => {
                let Some(s) = self.rndv_sends.iter_mut().find(|s| s.msg_id == msg_id) else {
                    return self.reject(format!("PUT for unknown transfer {msg_id}"));
                };
                // The range is the peer's word: it must lie inside this message, or the
                // write would carry other memory of this process to the peer.
                let (offset, len) = (offset as usize, len as usize);
                if s.state != RndvSendState::Announced || len == 0 || offset.saturating_add(len) > s.buf.len {
                    return self.reject(format!("PUT for transfer {msg_id} at {offset}+{len} out of place"));
                }
                s.state = RndvSendState::PutAsked;
                self.put_starts.push_back(PutStart { msg_id, offset, len, addr });
            }
            Header::PutDone { msg_id, status, .. } => {
                let Some(i) = self.rndv_recvs.iter().position(|r| {
                    r.msg_id == msg_id && matches!(r.path, RecvPath::Split { answer: PutAnswer::Awaited, .. })
                }) else {
                    return self.reject(format!("PUT-DONE for transfer {msg_id} out of place"));
                };
                let RecvPath::Split { read_ok, .. } = self.rndv_recvs[i].path else { return };
                if status == PUT_OK || !read_ok {
                    // Both parts are settled: the peer wrote its part (or this side
                    // could not read its own, and then nothing more is tried).
                    let r = self.rndv_recvs.swap_remove(i);
                    let ok = status == PUT_OK && read_ok;
                    self.finish_split(r, ok, cq);
                } else {
                    // The peer could not write: this side reads the rest, and asks no
                    // more PUTs of this peer.
                    self.split_ok = false;
                    if let RecvPath::Split { answer, .. } = &mut self.rndv_recvs[i].path {
                        *answer = PutAnswer::Refused;
                    }
                    self.split_rests.push_back(msg_id);
                }
            }
            Header::Fin { msg_id, status, .. } => {
                let Some(i) = self.rndv_sends.iter().position(|s| s.msg_id == msg_id) else {
                    return self.reject(format!("FIN for unknown transfer {msg_id}"));
                };
                let s = self.rndv_sends.swap_remove(i);
                let st = match status {
                    FIN_OK => Status::Ok,
                    FIN_TRUNCATED => Status::Truncated,
                    _ => Status::RemoteReadFailed,
                };
                complete_send(cq, self.id, s.buf, s.ctx, s.tag, st);
            }
            Header::Credit { .. } => {}
            Header::Close { .. } => self.peer_closed = true,
        }
    }

    /// Keeps a matched rendezvous receive whose bytes come by `path` until they are
    /// all in.
    fn record_recv(&mut self, s: RndvStart, accept: usize, path: RecvPath) {
        let PostedRecv { buf, ctx, .. } = s.recv;
        self.rndv_recvs.push(RndvRecv {
            msg_id: s.msg_id,
            tag: s.tag,
            msg_len: s.msg_len,
            buf,
            accept,
            received: 0,
            ctx,
            path,
        });
    }

    /// Completes a split receive whose parts are all in (`ok`) or one of which
    /// failed, and tells the sender with a FIN.
    fn finish_split(&mut self, r: RndvRecv, ok: bool, cq: &mut VecDeque<Completion>) {
        strait_probe::probe!(strait_probe::Stage::CopyDone);
        let (status, fin) = if !ok {
            (Status::RemoteReadFailed, FIN_REMOTE_READ_FAILED)
        } else if (r.accept as u64) < r.msg_len {
            (Status::Truncated, FIN_TRUNCATED)
        } else {
            (Status::Ok, FIN_OK)
        };
        self.ctrlq.push_back(Ctrl::Fin { msg_id: r.msg_id, status: fin });
        let recv = PostedRecv { tag: r.tag, mask: 0, buf: r.buf, ctx: r.ctx };
        complete_recv(cq, self.id, recv, r.tag, r.msg_len as usize, status);
    }

    fn check_seq(&mut self, seq: u32) -> bool {
        if seq != self.expected_seq {
            self.reject(format!("sequence {seq}, expected {}", self.expected_seq));
            return false;
        }
        self.expected_seq = self.expected_seq.wrapping_add(1);
        true
    }

    fn reject(&mut self, why: String) {
        self.stats.frames_rejected += 1;
        if self.corrupt.is_none() {
            self.corrupt = Some(why);
        }
    }

    /// Fails every unfinished operation with `status` and stops the endpoint.
    pub(crate) fn fail(&mut self, status: Status, cq: &mut VecDeque<Completion>) {
        if self.failed.is_none() {
            self.failed = Some(status);
        }
        let id = self.id;
        for m in self.msgq.drain(..) {
            complete_send(cq, id, m.buf, m.ctx, m.tag, status);
        }
        for s in self.rndv_sends.drain(..) {
            complete_send(cq, id, s.buf, s.ctx, s.tag, status);
        }
        for r in self.rndv_recvs.drain(..) {
            let awaited = matches!(r.path, RecvPath::Split { answer: PutAnswer::Awaited, .. });
            let recv = PostedRecv { tag: r.tag, mask: 0, buf: r.buf, ctx: r.ctx };
            if awaited && status == Status::Canceled {
                // Closed locally while the (live) peer may still be writing its part
                // of a split transfer into this buffer: the receive ends, but the
                // region stays held, so it is never handed back or unmapped under
                // that write ([`crate::sansio::Engine::close`] first waits a bounded
                // number of passes for the answer, so this is the rare case).
                let PostedRecv { tag, buf, ctx, .. } = recv;
                std::mem::forget(buf);
                cq.push_back(Completion { ep: id, op: OpKind::Recv, ctx, tag, len: 0, status });
                continue;
            }
            complete_recv(cq, id, recv, r.tag, 0, status);
        }
        for s in self.rndv_starts.drain(..) {
            complete_recv(cq, id, s.recv, s.tag, 0, status);
        }
        self.put_starts.clear();
        self.split_rests.clear();
        for r in self.posted.drain(..) {
            let tag = r.tag;
            complete_recv(cq, id, r, tag, 0, status);
        }
        if status == Status::Canceled {
            // A local close: FINs still tell the peer how transfers that already
            // moved their data ended; clear-to-sends would invite data for transfers
            // that were just canceled.
            self.ctrlq.retain(|c| !matches!(c, Ctrl::Cts { .. }));
        } else {
            self.ctrlq.clear();
        }
    }

    /// Receives posted after the peer closed can only be served from the
    /// unexpected queue; everything else ends with `PeerGone`.
    fn settle_after_peer_close(&mut self, cq: &mut VecDeque<Completion>) {
        let id = self.id;
        for r in self.posted.drain(..) {
            let tag = r.tag;
            complete_recv(cq, id, r, tag, 0, Status::PeerGone);
        }
        for s in self.rndv_sends.drain(..) {
            complete_send(cq, id, s.buf, s.ctx, s.tag, Status::PeerGone);
        }
        for m in self.msgq.drain(..) {
            complete_send(cq, id, m.buf, m.ctx, m.tag, Status::PeerGone);
        }
        // A peer that closed wrote nothing after its Close (its PUT-DONEs go out
        // before it), so no buffer here is still being written.
        for r in self.rndv_recvs.drain(..) {
            let recv = PostedRecv { tag: r.tag, mask: 0, buf: r.buf, ctx: r.ctx };
            complete_recv(cq, id, recv, r.tag, 0, Status::PeerGone);
        }
        self.put_starts.clear();
        self.split_rests.clear();
        self.failed = Some(Status::PeerGone);
    }

    pub(crate) fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Serves a receive posted after the endpoint stopped, from already-arrived
    /// messages only. Returns the receive back if nothing matches.
    pub(crate) fn post_recv_after_close(
        &mut self,
        recv: PostedRecv,
        cq: &mut VecDeque<Completion>,
    ) -> Result<(), PostedRecv> {
        let pos = self.unexpected.iter().position(|u| match u {
            UnexpectedMsg::Eager { tag, .. } => tag_matches(*tag, recv.tag, recv.mask),
            UnexpectedMsg::Rts { .. } => false,
        });
        match pos.and_then(|p| self.unexpected.remove(p)) {
            Some(UnexpectedMsg::Eager { tag, data }) => {
                let n = data.len().min(recv.buf.len);
                // SAFETY: as in `post_recv`.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), recv.buf.ptr(), n) };
                let status = if data.len() > recv.buf.len { Status::Truncated } else { Status::Ok };
                complete_recv(cq, self.id, recv, tag, data.len(), status);
                Ok(())
            }
            _ => Err(recv),
        }
    }
}

impl PostedRecv {
    pub(crate) fn new(tag: u64, mask: u64, buf: Buf, ctx: u64) -> Self {
        PostedRecv { tag, mask, buf, ctx }
    }

    /// Gives up a receive that was never queued: releases its hold on the region.
    pub(crate) fn into_buf_release(self) {
        drop(self);
    }
}

/// Largest number of frames consumed per endpoint per progress call, so that one
/// busy endpoint cannot starve the others.
const RX_BATCH: usize = 64;

impl<D: Device> Endpoint<D> {
    /// One pass of the engine over this endpoint. Returns the work done.
    pub(crate) fn progress(&mut self, cq: &mut VecDeque<Completion>) -> usize {
        if self.st.failed.is_some() {
            return 0;
        }
        let mut work = 0;
        // 1. Receive.
        let completions_before = cq.len();
        while work < RX_BATCH {
            let st = &mut self.st;
            match self.dev.recv_frame(&mut |f| st.on_frame(f, cq)) {
                Ok(true) => {
                    work += 1;
                    if cq.len() > completions_before {
                        // A completion is ready: hand it to the application now;
                        // further frames (and the device's housekeeping) can wait for
                        // the next poll.
                        break;
                    }
                }
                Ok(false) => break,
                Err(e) => {
                    self.device_failed(e, cq);
                    return work + 1;
                }
            }
            if self.st.corrupt.is_some() {
                // The reason stays in `corrupt` (see `last_error`) rather than on
                // stderr, so a hostile peer cannot flood the log.
                self.st.stats.device = self.dev.stats();
                self.st.fail(Status::Corrupt, cq);
                self.dev.shutdown();
                return work + 1;
            }
        }
        if !self.st.tx_work() && !self.st.peer_closed {
            if work > 0 {
                // Frames arrived but nothing waits to go out: only the doorbell may
                // have something to say (ring room handed back to a sleeping peer).
                if let Err(e) = self.dev.doorbell() {
                    self.device_failed(e, cq);
                }
            }
            // Nothing waits to go out: the idle poll stops here.
            return work;
        }
        work + self.progress_tx(cq, work)
    }

    /// Sends a small message at once when nothing is queued ahead of it and a credit
    /// is free: the common case of a ping-pong or request/response, without the
    /// queues and passes of [`Endpoint::progress_tx`]. `src` is the message's bytes,
    /// borrowed for this call only (the send completes before it returns, so it
    /// takes no hold on the region: two atomic operations fewer per message).
    /// Returns false if the message must be queued instead.
    pub(crate) fn try_send_eager_now(
        &mut self,
        tag: u64,
        src: (*const u8, usize),
        ctx: u64,
        cq: &mut VecDeque<Completion>,
    ) -> bool {
        let st = &self.st;
        if src.1 > st.eager_limit
            || st.credits == 0
            || !st.msgq.is_empty()
            || !st.ctrlq.is_empty()
            || !st.rndv_starts.is_empty()
            || !st.rndv_sends.is_empty()
            || !st.split_rests.is_empty()
            || st.failed.is_some()
        {
            return false;
        }
        strait_probe::probe!(strait_probe::Stage::TxMsg);
        let credits = st.credits_owed;
        let h = Header::Eager { credits, seq: st.next_seq, tag };
        match self.send_header(&h, Some(src)) {
            Ok(true) => {
                let st = &mut self.st;
                st.credits -= 1;
                st.credits_owed -= credits;
                st.next_seq = st.next_seq.wrapping_add(1);
                st.stats.eager_sent += 1;
                cq.push_back(Completion {
                    ep: st.id,
                    op: OpKind::Send,
                    ctx,
                    tag,
                    len: src.1,
                    status: Status::Ok,
                });
                strait_probe::probe!(strait_probe::Stage::DoorbellBegin);
                let rung = self.dev.doorbell();
                strait_probe::probe!(strait_probe::Stage::DoorbellEnd);
                if let Err(e) = rung {
                    self.device_failed(e, cq);
                }
                true
            }
            Ok(false) => false,
            Err(e) => {
                self.device_failed(e, cq);
                false
            }
        }
    }

    /// The transmit half of [`Endpoint::progress`]: starts matched rendezvous
    /// transfers, returns credits, flushes queued frames and rings the doorbell. A
    /// post calls only this, so posting never pays for polling the receive side.
    ///
    /// `received` is how many frames the caller just consumed: the doorbell must ring
    /// after those too, since consuming frees ring room a sleeping sender waits for
    /// (the device makes the ring free when there is nothing to announce).
    pub(crate) fn progress_tx(&mut self, cq: &mut VecDeque<Completion>, received: usize) -> usize {
        if self.st.failed.is_some() {
            return 0;
        }
        let mut work = 0;
        // 2. Serve the peer's PUTs first (it copies its own part meanwhile), then
        // start matched rendezvous transfers and read what refused PUTs left.
        while let Some(p) = self.st.put_starts.pop_front() {
            self.serve_put(p, cq);
            work += 1;
        }
        while let Some(s) = self.st.rndv_starts.pop_front() {
            self.start_rndv_recv(s, cq);
            work += 1;
        }
        while let Some(msg_id) = self.st.split_rests.pop_front() {
            self.read_split_rest(msg_id, cq);
            work += 1;
        }
        if self.st.failed.is_some() {
            return work;
        }
        // 3. Delayed credit return: only when half the window is owed and no
        // outgoing frame will carry it.
        if self.st.credits_owed >= self.st.window.div_ceil(2) && !self.st.tx_pending() {
            self.st.ctrlq.push_back(Ctrl::Credit);
        }
        // 4. Transmit.
        let sent = self.flush(cq);
        work += sent;
        if sent > 0 || work > 0 || received > 0 {
            strait_probe::probe!(strait_probe::Stage::DoorbellBegin);
            let rung = self.dev.doorbell();
            strait_probe::probe!(strait_probe::Stage::DoorbellEnd);
            if let Err(e) = rung {
                self.device_failed(e, cq);
            }
        }
        if self.st.peer_closed && self.st.failed.is_none() {
            self.st.settle_after_peer_close(cq);
            work += 1;
        }
        work
    }

    pub(crate) fn device_failed(&mut self, e: DeviceError, cq: &mut VecDeque<Completion>) {
        let status = match e {
            DeviceError::Corrupt(why) => {
                // Keep the first violation for `Engine::endpoint_error`.
                self.st.corrupt.get_or_insert(why);
                Status::Corrupt
            }
            other => {
                // And why the peer is taken for gone (for the same report).
                self.st.gone.get_or_insert(other.to_string());
                Status::PeerGone
            }
        };
        self.st.stats.device = self.dev.stats();
        self.st.fail(status, cq);
    }

    fn start_rndv_recv(&mut self, s: RndvStart, cq: &mut VecDeque<Completion>) {
        let accept = (s.msg_len as usize).min(s.recv.buf.len);
        let path = match self.st.mode {
            RndvMode::Copy => RndvPath::Copy,
            RndvMode::RemoteRead => RndvPath::RemoteRead,
            RndvMode::Split => RndvPath::Split,
            // What the device measured fastest on this host (see `RndvMode::Auto`).
            RndvMode::Auto => self.dev.preferred_rndv(),
        };
        // An announcement without an address (0) offers no single copy: its sender
        // is not the process the device would read from (a fork child).
        let can_read = s.addr != 0 && self.st.remote_read_ok && self.dev.supports_remote_read();
        if path == RndvPath::Split
            && can_read
            && self.st.split_ok
            && accept >= self.st.split_threshold
            && self.dev.split_now()
        {
            return self.start_split(s, accept, cq);
        }
        if path != RndvPath::Copy && can_read {
            // SAFETY: the destination is the accepted prefix of the posted buffer.
            let r = unsafe { self.dev.remote_read(s.addr, s.recv.buf.ptr(), accept) };
            match r {
                Ok(()) => {
                    let (status, fin) = if (accept as u64) < s.msg_len {
                        (Status::Truncated, FIN_TRUNCATED)
                    } else {
                        (Status::Ok, FIN_OK)
                    };
                    self.st.ctrlq.push_back(Ctrl::Fin { msg_id: s.msg_id, status: fin });
                    complete_recv(cq, self.st.id, s.recv, s.tag, s.msg_len as usize, status);
                    return;
                }
                Err(DeviceError::Unsupported) => self.st.remote_read_ok = false,
                Err(e) => {
                    // The peer may have died (ESRCH) or its buffer may be unreadable;
                    // tell it, fail this receive, and let liveness checks decide the rest.
                    if self.dev.check_peer().is_err() {
                        self.st.rndv_starts.push_front(s);
                        self.device_failed(e, cq);
                        return;
                    }
                    self.st.ctrlq.push_back(Ctrl::Fin { msg_id: s.msg_id, status: FIN_REMOTE_READ_FAILED });
                    complete_recv(
                        cq,
                        self.st.id,
                        s.recv,
                        s.tag,
                        s.msg_len as usize,
                        Status::RemoteReadFailed,
                    );
                    return;
                }
            }
        }
        self.st.ctrlq.push_back(Ctrl::Cts { msg_id: s.msg_id, accept: accept as u32 });
        if accept == 0 {
            let status = if s.msg_len > 0 { Status::Truncated } else { Status::Ok };
            complete_recv(cq, self.st.id, s.recv, s.tag, s.msg_len as usize, status);
        } else {
            self.st.record_recv(s, accept, RecvPath::Pushed);
        }
    }

    /// A split transfer: asks the sender (with a PUT sent at once) to write the
    /// second part of the accepted range into the posted buffer, then reads the first
    /// part itself, so both cores copy at the same time; the receive completes when
    /// the sender's PUT-DONE arrives.
    fn start_split(&mut self, s: RndvStart, accept: usize, cq: &mut VecDeque<Completion>) {
        let cut = split_point(accept);
        let dst = s.recv.buf.ptr();
        self.st.ctrlq.push_back(Ctrl::Put {
            msg_id: s.msg_id,
            offset: cut as u32,
            len: (accept - cut) as u32,
            addr: dst as u64 + cut as u64,
        });
        // The PUT must leave before this side starts copying, or the two copies
        // would not overlap. Until the receive is recorded below, it waits in
        // `rndv_starts`, so a device failure on the way completes it.
        self.st.rndv_starts.push_front(s);
        self.flush_ctrl(cq);
        if self.st.failed.is_some() {
            return;
        }
        if let Err(e) = self.dev.doorbell() {
            return self.device_failed(e, cq);
        }
        // SAFETY: `[0, cut)` is inside the accepted prefix of the posted buffer; the
        // sender writes only `[cut, accept)`.
        let read_ok = match unsafe { self.dev.remote_read(self.st.rndv_starts[0].addr, dst, cut) } {
            Ok(()) => true,
            Err(e) => {
                // A peer the device knows to be gone will never answer the PUT.
                if matches!(e, DeviceError::PeerGone(_)) || self.dev.check_peer().is_err() {
                    return self.device_failed(e, cq);
                }
                if matches!(e, DeviceError::Unsupported) {
                    self.st.remote_read_ok = false;
                }
                false
            }
        };
        let Some(s) = self.st.rndv_starts.pop_front() else { return };
        self.st.stats.rndv_split += 1;
        let path = RecvPath::Split { cut, addr: s.addr, read_ok, answer: PutAnswer::Awaited };
        self.st.record_recv(s, accept, path);
    }

    /// Serves a PUT of the peer: writes the asked part of the message into the
    /// peer's buffer and answers with a PUT-DONE (failed where this device cannot
    /// write into the peer; the peer then reads the part itself).
    fn serve_put(&mut self, p: PutStart, cq: &mut VecDeque<Completion>) {
        let Some(send) = self.st.rndv_sends.iter().find(|s| s.msg_id == p.msg_id) else { return };
        // SAFETY: `[offset, offset + len)` was checked against the send buffer when
        // the PUT arrived, and the buffer stays held until the peer's FIN.
        let src = unsafe { send.buf.ptr().add(p.offset) as *const u8 };
        // (A device without remote writes answers Unsupported: the PUT fails.)
        // SAFETY: `src` is valid for `len` bytes (above).
        let status = match unsafe { self.dev.remote_write(p.addr, src, p.len) } {
            Ok(()) => PUT_OK,
            Err(e) => {
                if self.dev.check_peer().is_err() {
                    return self.device_failed(e, cq);
                }
                PUT_FAILED
            }
        };
        self.st.ctrlq.push_back(Ctrl::PutDone { msg_id: p.msg_id, status });
    }

    /// Reads the part of a split receive that its sender could not write, then
    /// completes it.
    fn read_split_rest(&mut self, msg_id: u32, cq: &mut VecDeque<Completion>) {
        let Some(i) = self.st.rndv_recvs.iter().position(|r| r.msg_id == msg_id) else { return };
        let r = &self.st.rndv_recvs[i];
        let RecvPath::Split { cut, addr, .. } = r.path else { return };
        // SAFETY: `[cut, accept)` lies inside the posted buffer; the sender answered
        // that it writes nothing into it.
        let res = unsafe { self.dev.remote_read(addr + cut as u64, r.buf.ptr().add(cut), r.accept - cut) };
        if let Err(e) = &res {
            if self.dev.check_peer().is_err() {
                let e = DeviceError::PeerGone(e.to_string());
                return self.device_failed(e, cq);
            }
        }
        let r = self.st.rndv_recvs.swap_remove(i);
        self.st.finish_split(r, res.is_ok(), cq);
    }

    /// Sends the queued control frames (they need no credits and never wait behind
    /// messages). Returns how many went, and whether all did.
    fn flush_ctrl(&mut self, cq: &mut VecDeque<Completion>) -> (usize, bool) {
        let mut sent = 0;
        while let Some(&c) = self.st.ctrlq.front() {
            let credits = self.st.credits_owed;
            let h = match c {
                Ctrl::Cts { msg_id, accept } => Header::Cts { credits, msg_id, accept },
                Ctrl::Fin { msg_id, status } => Header::Fin { credits, msg_id, status },
                Ctrl::Credit => {
                    if credits == 0 {
                        self.st.ctrlq.pop_front();
                        continue;
                    }
                    self.st.stats.credit_frames_sent += 1;
                    Header::Credit { credits }
                }
                Ctrl::Close => Header::Close { credits },
                Ctrl::Put { msg_id, offset, len, addr } => Header::Put { credits, msg_id, offset, len, addr },
                Ctrl::PutDone { msg_id, status } => Header::PutDone { credits, msg_id, status },
            };
            match self.send_header(&h, None) {
                Ok(true) => {
                    self.st.ctrlq.pop_front();
                    self.st.credits_owed -= credits;
                    sent += 1;
                }
                Ok(false) => {
                    self.st.tx_blocked = true;
                    return (sent, false);
                }
                Err(e) => {
                    self.device_failed(e, cq);
                    return (sent, false);
                }
            }
        }
        (sent, true)
    }

    /// Sends what can be sent: control frames first (they need no credits and must
    /// never wait behind messages), then rendezvous data, then credited messages.
    fn flush(&mut self, cq: &mut VecDeque<Completion>) -> usize {
        self.st.tx_blocked = false;
        let (mut sent, all) = self.flush_ctrl(cq);
        if !all {
            return sent;
        }
        // Rendezvous data (copy mode), pipelined in chunks.
        let mut i = 0;
        while i < self.st.rndv_sends.len() {
            let RndvSendState::Pushing { next, accept } = self.st.rndv_sends[i].state else {
                i += 1;
                continue;
            };
            // Below the pipelining threshold the message moves as one piece (as far as
            // the device allows): the receiver starts copying only after the sender
            // has written it all (coarse-grained). Above it, chunk k is copied out
            // while chunk k+1 is written in (fine-grained).
            let piece = if accept >= self.st.pipeline_threshold {
                self.st.chunk
            } else {
                accept.clamp(1, self.st.max_payload)
            };
            let mut next = next;
            while next < accept {
                let n = piece.min(accept - next);
                let s = &self.st.rndv_sends[i];
                let h = Header::Data { credits: self.st.credits_owed, msg_id: s.msg_id, offset: next as u64 };
                // SAFETY: [next, next+n) lies inside the send buffer (accept <= len).
                let src = unsafe { (s.buf.ptr().add(next) as *const u8, n) };
                match self.send_header(&h, Some(src)) {
                    Ok(true) => {
                        self.st.credits_owed = 0;
                        next += n;
                        sent += 1;
                    }
                    Ok(false) => {
                        self.st.tx_blocked = true;
                        break;
                    }
                    Err(e) => {
                        self.device_failed(e, cq);
                        return sent;
                    }
                }
            }
            if next >= accept {
                let s = self.st.rndv_sends.swap_remove(i);
                let status = if accept < s.buf.len { Status::Truncated } else { Status::Ok };
                complete_send(cq, self.st.id, s.buf, s.ctx, s.tag, status);
            } else {
                self.st.rndv_sends[i].state = RndvSendState::Pushing { next, accept };
                return sent;
            }
        }
        // Messages, in order, while credits last.
        while self.st.credits > 0 {
            let Some(m) = self.st.msgq.front() else { break };
            strait_probe::probe!(strait_probe::Stage::TxMsg);
            let seq = self.st.next_seq;
            let credits = self.st.credits_owed;
            let res = if m.rndv {
                let msg_id = self.st.next_msg_id;
                // Address 0 offers no single copy (see `Device::peer_reaches_us`).
                let addr = if self.dev.peer_reaches_us() { m.buf.ptr() as u64 } else { 0 };
                let h = Header::Rts { credits, seq, tag: m.tag, len: m.buf.len as u64, msg_id, addr };
                self.send_header(&h, None)
            } else {
                let h = Header::Eager { credits, seq, tag: m.tag };
                let src = (m.buf.ptr() as *const u8, m.buf.len);
                self.send_header(&h, Some(src))
            };
            match res {
                Ok(true) => {
                    let Some(m) = self.st.msgq.pop_front() else { break };
                    self.st.credits -= 1;
                    self.st.credits_owed -= credits;
                    self.st.next_seq = self.st.next_seq.wrapping_add(1);
                    sent += 1;
                    if m.rndv {
                        let msg_id = self.st.next_msg_id;
                        self.st.next_msg_id = self.st.next_msg_id.wrapping_add(1).max(1);
                        self.st.stats.rndv_sent += 1;
                        self.st.rndv_sends.push(RndvSend {
                            msg_id,
                            tag: m.tag,
                            buf: m.buf,
                            ctx: m.ctx,
                            state: RndvSendState::Announced,
                        });
                    } else {
                        self.st.stats.eager_sent += 1;
                        complete_send(cq, self.st.id, m.buf, m.ctx, m.tag, Status::Ok);
                    }
                }
                Ok(false) => {
                    self.st.tx_blocked = true;
                    break;
                }
                Err(e) => {
                    self.device_failed(e, cq);
                    break;
                }
            }
        }
        sent
    }

    /// Writes one frame: header, then `payload` (raw pointer and length) if any.
    fn send_header(&mut self, h: &Header, payload: Option<(*const u8, usize)>) -> Result<bool, DeviceError> {
        let mut hb = [0u8; MAX_HEADER_LEN];
        let hlen = h.encode(&mut hb);
        let plen = payload.map_or(0, |p| p.1);
        self.dev.send_frame(hlen + plen, &mut |w| {
            w.write(0, &hb[..hlen]);
            if let Some((ptr, len)) = payload {
                // SAFETY: the payload pointer/length describe part of a memory region
                // kept alive (and out of the application's hands) by the operation.
                let src = unsafe { std::slice::from_raw_parts(ptr, len) };
                w.write(hlen, src);
            }
        })
    }
}

/// Where a split transfer of `accept` bytes is cut: about half, on a page boundary
/// (the two copies then never share a page or a cache line), and never at 0 when
/// the message spans more than a page.
fn split_point(accept: usize) -> usize {
    let half = (accept / 2) & !4095;
    if half == 0 {
        accept / 2
    } else {
        half
    }
}

#[cfg(test)]
mod split_tests {
    use super::split_point;

    #[test]
    fn the_cut_is_about_half_on_a_page() {
        assert_eq!(split_point(1 << 20), 1 << 19);
        assert_eq!(split_point(100_000), 49_152);
        assert_eq!(split_point(6000), 3000);
        for n in [2usize, 4096, 65_536, 65_537, 1 << 30] {
            let c = split_point(n);
            assert!(c > 0 && c < n, "{n}: {c}");
        }
    }
}
