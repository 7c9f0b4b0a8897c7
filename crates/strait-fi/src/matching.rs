//! Receive-side matching across every peer of an endpoint: the posted receives and
//! the unexpected messages, in order, as an RDM endpoint needs (a receive from
//! `FI_ADDR_UNSPEC`, or with ignore bits, matches whichever peer's message comes
//! first; messages from one peer match in the order that peer sent them).
//!
//! Bytes go to exactly two places: a posted receive's buffer, never past the length
//! it was posted with, or a buffer this module allocates as the bytes arrive (so a
//! peer's announced length costs nothing until the bytes are there).

use std::collections::VecDeque;

use strait_core::RxFrame;

use crate::proto::{First, F_DATA, F_TAGGED};

/// libfabric's values, for completions.
pub mod fi {
    /// `FI_MSG`.
    pub const MSG: u64 = 1 << 1;
    /// `FI_TAGGED`.
    pub const TAGGED: u64 = 1 << 3;
    /// `FI_RECV`.
    pub const RECV: u64 = 1 << 10;
    /// `FI_SEND`.
    pub const SEND: u64 = 1 << 11;
    /// `FI_REMOTE_CQ_DATA`.
    pub const REMOTE_CQ_DATA: u64 = 1 << 17;
    /// `FI_PEEK`.
    pub const PEEK: u64 = 1 << 19;
    /// `FI_COMPLETION`.
    pub const COMPLETION: u64 = 1 << 24;
    /// `FI_INJECT`.
    pub const INJECT: u64 = 1 << 25;
    /// `FI_CLAIM`.
    pub const CLAIM: u64 = 1 << 59;
    /// `FI_DISCARD`.
    pub const DISCARD: u64 = 1 << 58;
    /// `FI_ADDR_UNSPEC`.
    pub const ADDR_UNSPEC: u64 = u64::MAX;
    /// `FI_EAGAIN`.
    pub const EAGAIN: i32 = libc::EAGAIN;
    /// `FI_EAVAIL`.
    pub const EAVAIL: i32 = 259;
    /// `FI_ETRUNC`.
    pub const ETRUNC: i32 = 265;
    /// `FI_ENOMSG`.
    pub const ENOMSG: i32 = libc::ENOMSG;
    /// `FI_ECANCELED`.
    pub const ECANCELED: i32 = libc::ECANCELED;
    /// `FI_ECONNRESET`.
    pub const ECONNRESET: i32 = libc::ECONNRESET;
    /// `FI_EHOSTUNREACH`.
    pub const EHOSTUNREACH: i32 = libc::EHOSTUNREACH;
    /// `FI_EIO`.
    pub const EIO: i32 = libc::EIO;
    /// `FI_EPROTO`.
    pub const EPROTO: i32 = libc::EPROTO;
    /// `FI_EINVAL`.
    pub const EINVAL: i32 = libc::EINVAL;
    /// `FI_ENOENT`.
    pub const ENOENT: i32 = libc::ENOENT;
    /// `FI_EMSGSIZE`.
    pub const EMSGSIZE: i32 = libc::EMSGSIZE;
    /// `FI_ETOOSMALL`.
    pub const ETOOSMALL: i32 = 257;
    /// `FI_EOPBADSTATE`.
    pub const EOPBADSTATE: i32 = 258;
}

/// A completion in the shape the C side converts to the CQ's format
/// (`struct sfi_comp` in shim.c).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Comp {
    /// The operation's context pointer.
    pub ctx: usize,
    /// `FI_SEND`/`FI_RECV` | `FI_MSG`/`FI_TAGGED` | `FI_REMOTE_CQ_DATA`.
    pub flags: u64,
    /// Bytes sent or received.
    pub len: u64,
    /// Receive buffer (0 for sends and peeks).
    pub buf: usize,
    /// Remote CQ data.
    pub data: u64,
    /// The message's tag.
    pub tag: u64,
    /// For a truncated receive, the bytes that did not fit.
    pub olen: u64,
    /// 0, or a positive `FI_E*` value (then the completion goes to the error queue).
    pub err: i32,
    /// Padding.
    pub pad: i32,
}

/// An application buffer (from the C API: valid for writes of `cap` bytes until the
/// operation completes, by libfabric's contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UserBuf {
    /// Address.
    pub ptr: usize,
    /// Length.
    pub cap: usize,
}

/// A posted receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recv {
    /// Where the message goes.
    pub buf: UserBuf,
    /// Source address (`FI_ADDR_UNSPEC`: any).
    pub src: u64,
    /// Tag to match.
    pub tag: u64,
    /// Tag bits to ignore.
    pub ignore: u64,
    /// Tagged receive (else untagged).
    pub tagged: bool,
    /// Context.
    pub ctx: usize,
    /// Report a successful completion (errors are always reported).
    pub report: bool,
}

impl Recv {
    fn matches(&self, src: u64, tagged: bool, tag: u64) -> bool {
        self.tagged == tagged
            && (self.src == fi::ADDR_UNSPEC || self.src == src)
            && (!tagged || (tag | self.ignore) == (self.tag | self.ignore))
    }
}

/// Where a rendezvous message waits: which connection, the sender's address and
/// its sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rndv {
    /// The receiving connection's id.
    pub conn: u64,
    /// Address of the message in the sender's memory.
    pub addr: u64,
    /// The sender's sequence number (echoed in the FIN).
    pub seq: u64,
}

/// A rendezvous message to read now: into `recv`, or (`None`) to drop (discarded),
/// answering the sender either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pull {
    /// The receive it goes to.
    pub recv: Option<Recv>,
    /// Its header.
    pub first: First,
    /// Where it is.
    pub rndv: Rndv,
}

/// An unexpected message (arrived before a matching receive).
#[derive(Debug)]
struct Unexp {
    /// A rendezvous message (its bytes are still in the sender's memory).
    rndv: Option<Rndv>,
    id: u64,
    src: u64,
    first: First,
    bytes: Vec<u8>,
    done: bool,
    /// Claimed by `FI_PEEK | FI_CLAIM` with this context.
    claimed: Option<usize>,
    /// A receive that matched it before its last byte arrived.
    attached: Option<Recv>,
    /// Dropped as its bytes arrive (`FI_DISCARD` before the end).
    discard: bool,
}

/// Where an incoming message's bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    /// Straight into a posted receive.
    Posted(Recv),
    /// Into the unexpected queue entry with this id.
    Unexp(u64),
}

/// A message whose frames are arriving on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InMsg {
    /// Destination.
    pub dest: Dest,
    /// Its header.
    pub first: First,
    /// The sender's address.
    pub src: u64,
    /// Bytes received so far.
    pub got: u64,
}

/// The matching state of one endpoint.
#[derive(Debug, Default)]
pub struct Matcher {
    posted: VecDeque<Recv>,
    unexp: VecDeque<Unexp>,
    next_id: u64,
    pulls: Vec<Pull>,
}

fn comp_of(first: &First, r: &Recv, len: u64, olen: u64, err: i32) -> Comp {
    let mut flags = fi::RECV | if first.flags & F_TAGGED != 0 { fi::TAGGED } else { fi::MSG };
    if first.flags & F_DATA != 0 {
        flags |= fi::REMOTE_CQ_DATA;
    }
    Comp { ctx: r.ctx, flags, len, buf: r.buf.ptr, data: first.data, tag: first.tag, olen, err, pad: 0 }
}

/// The error completion of receive `r` that got no message (`err`: no message for
/// a peek, canceled, peer gone).
fn failed(r: &Recv, err: i32) -> Comp {
    let flags = fi::RECV | if r.tagged { fi::TAGGED } else { fi::MSG };
    Comp { ctx: r.ctx, flags, len: 0, buf: 0, data: 0, tag: r.tag, olen: 0, err, pad: 0 }
}

/// The completion of a receive that got a whole message of `total` bytes.
pub fn finished(first: &First, r: &Recv, total: u64) -> Comp {
    let cap = r.buf.cap as u64;
    if total > cap {
        comp_of(first, r, cap, total - cap, fi::ETRUNC)
    } else {
        comp_of(first, r, total, 0, 0)
    }
}

/// Copies `src` into the application buffer at `offset`, clipped to its length.
fn write_user(buf: UserBuf, offset: usize, src: &[u8]) {
    if offset >= buf.cap || src.is_empty() {
        return;
    }
    let n = src.len().min(buf.cap - offset);
    // SAFETY: the application posted `buf` as writable for `cap` bytes until the
    // receive completes (libfabric's contract); `offset + n <= cap`; `src` is
    // our own memory, distinct from the application's buffer.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (buf.ptr as *mut u8).add(offset), n) };
}

impl Matcher {
    /// Number of posted receives (diagnostics).
    pub fn posted_len(&self) -> usize {
        self.posted.len()
    }

    /// Number of unexpected messages held (diagnostics).
    pub fn unexpected_len(&self) -> usize {
        self.unexp.len()
    }

    /// Posts a receive: takes the oldest matching unexpected message, or queues the
    /// receive. Completions go to `out`.
    pub fn post(&mut self, r: Recv, out: &mut Vec<Comp>) {
        let pos = self.unexp.iter().position(|u| {
            u.claimed.is_none()
                && u.attached.is_none()
                && !u.discard
                && r.matches(u.src, u.first.flags & F_TAGGED != 0, u.first.tag)
        });
        match pos {
            Some(i) => self.take_unexp(i, r, out),
            None => self.posted.push_back(r),
        }
    }

    /// Rendezvous messages matched since the last call: the caller reads them.
    pub fn take_pulls(&mut self) -> Vec<Pull> {
        std::mem::take(&mut self.pulls)
    }

    /// True if rendezvous messages wait to be read.
    pub fn has_pulls(&self) -> bool {
        !self.pulls.is_empty()
    }

    /// A rendezvous message from `src` arrived: matched now (a pull), or kept as
    /// unexpected.
    pub fn arrive_rndv(&mut self, src: u64, first: First, rndv: Rndv) {
        let tagged = first.flags & F_TAGGED != 0;
        if let Some(i) = self.posted.iter().position(|r| r.matches(src, tagged, first.tag)) {
            if let Some(r) = self.posted.remove(i) {
                self.pulls.push(Pull { recv: Some(r), first, rndv });
                return;
            }
        }
        let id = self.new_unexp(src, first);
        if let Some(u) = self.unexp.back_mut() {
            if u.id == id {
                u.rndv = Some(rndv);
                u.done = true;
            }
        }
    }

    /// Drops unexpected message `i`; a rendezvous one is answered (as read).
    fn drop_unexp(&mut self, i: usize) {
        if let Some(u) = self.unexp.remove(i) {
            if let Some(rndv) = u.rndv {
                self.pulls.push(Pull { recv: None, first: u.first, rndv });
            }
        }
    }

    fn take_unexp(&mut self, i: usize, r: Recv, out: &mut Vec<Comp>) {
        if let Some(rndv) = self.unexp[i].rndv {
            let first = self.unexp[i].first;
            self.unexp.remove(i);
            self.pulls.push(Pull { recv: Some(r), first, rndv });
            return;
        }
        if self.unexp[i].done {
            let Some(u) = self.unexp.remove(i) else { return };
            write_user(r.buf, 0, &u.bytes);
            let c = finished(&u.first, &r, u.first.total);
            if r.report || c.err != 0 {
                out.push(c);
            }
        } else {
            self.unexp[i].attached = Some(r);
        }
    }

    /// A receive with `FI_CLAIM` (after a claiming peek with the same context):
    /// delivers (or, with `discard`, drops) the claimed message. False if this
    /// context claimed nothing.
    pub fn claim(&mut self, r: Recv, discard: bool, out: &mut Vec<Comp>) -> bool {
        let Some(i) = self.unexp.iter().position(|u| u.claimed == Some(r.ctx)) else { return false };
        self.unexp[i].claimed = None;
        if discard {
            let u = &mut self.unexp[i];
            let c = comp_of(&u.first, &r, 0, 0, 0);
            if u.done {
                self.drop_unexp(i);
            } else {
                u.discard = true;
            }
            if r.report {
                out.push(Comp { buf: 0, ..c });
            }
        } else {
            self.take_unexp(i, r, out);
        }
        true
    }

    /// `FI_PEEK`: reports the oldest matching unexpected message (its length, tag
    /// and data) without receiving it, or `FI_ENOMSG`. With `claim` the message is
    /// reserved for a later `FI_CLAIM` receive with the same context; with `discard`
    /// it is dropped.
    pub fn peek(&mut self, r: Recv, claim: bool, discard: bool, out: &mut Vec<Comp>) {
        let pos = self.unexp.iter().position(|u| {
            u.claimed.is_none()
                && u.attached.is_none()
                && !u.discard
                && r.matches(u.src, u.first.flags & F_TAGGED != 0, u.first.tag)
        });
        let Some(i) = pos else {
            out.push(failed(&r, fi::ENOMSG));
            return;
        };
        let u = &mut self.unexp[i];
        let c = comp_of(&u.first, &r, u.first.total, 0, 0);
        if claim {
            u.claimed = Some(r.ctx);
        } else if discard {
            if u.done {
                self.drop_unexp(i);
            } else {
                u.discard = true;
            }
        }
        out.push(Comp { buf: 0, ..c });
    }

    /// `fi_cancel` of a receive: true (and an `FI_ECANCELED` completion) if a
    /// receive with this context was still waiting for a message.
    pub fn cancel(&mut self, ctx: usize, out: &mut Vec<Comp>) -> bool {
        let r = if let Some(i) = self.posted.iter().position(|r| r.ctx == ctx) {
            self.posted.remove(i)
        } else if let Some(u) = self.unexp.iter_mut().find(|u| u.attached.is_some_and(|r| r.ctx == ctx)) {
            u.attached.take()
        } else {
            None
        };
        let Some(r) = r else { return false };
        out.push(failed(&r, fi::ECANCELED));
        true
    }

    /// Fails every receive posted for `src` (its peer is gone): no message can
    /// arrive for them any more.
    pub fn fail_source(&mut self, src: u64, err: i32, out: &mut Vec<Comp>) {
        self.posted.retain(|r| {
            if r.src != src {
                return true;
            }
            out.push(failed(r, err));
            false
        });
    }

    /// The first frame of a message from `src` arrived: matches it and returns
    /// where its bytes go.
    pub fn arrive(&mut self, src: u64, first: First) -> InMsg {
        let tagged = first.flags & F_TAGGED != 0;
        let dest = match self.posted.iter().position(|r| r.matches(src, tagged, first.tag)) {
            Some(i) => match self.posted.remove(i) {
                Some(r) => Dest::Posted(r),
                None => Dest::Unexp(self.new_unexp(src, first)),
            },
            None => Dest::Unexp(self.new_unexp(src, first)),
        };
        InMsg { dest, first, src, got: 0 }
    }

    fn new_unexp(&mut self, src: u64, first: First) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.unexp.push_back(Unexp {
            rndv: None,
            id,
            src,
            first,
            bytes: Vec::new(),
            done: false,
            claimed: None,
            attached: None,
            discard: false,
        });
        id
    }

    /// Copies `n` payload bytes at `off` in `frame` into the message's destination.
    /// The caller has checked `m.got + n <= m.first.total` and that the range lies
    /// in the frame.
    pub fn deliver(&mut self, m: &mut InMsg, frame: &RxFrame<'_>, off: usize, n: usize) -> bool {
        let at = m.got as usize;
        let ok = match m.dest {
            Dest::Posted(r) => {
                if at < r.buf.cap {
                    let k = n.min(r.buf.cap - at);
                    // SAFETY: the application posted `r.buf` as writable for `cap`
                    // bytes until completion; `at + k <= cap`; `read_raw` checks
                    // that `[off, off + k)` lies in the frame.
                    unsafe { frame.read_raw(off, (r.buf.ptr as *mut u8).add(at), k) }
                } else {
                    true
                }
            }
            Dest::Unexp(id) => match self.unexp.iter_mut().find(|u| u.id == id) {
                Some(u) if !u.discard => {
                    let old = u.bytes.len();
                    u.bytes.resize(old + n, 0);
                    frame.read(off, &mut u.bytes[old..])
                }
                _ => true,
            },
        };
        m.got += n as u64;
        ok
    }

    /// The last byte of `m` arrived: completes its receive, if it has one by now.
    pub fn finish(&mut self, m: &InMsg, out: &mut Vec<Comp>) {
        match m.dest {
            Dest::Posted(r) => {
                let c = finished(&m.first, &r, m.first.total);
                if r.report || c.err != 0 {
                    out.push(c);
                }
            }
            Dest::Unexp(id) => {
                let Some(i) = self.unexp.iter().position(|u| u.id == id) else { return };
                self.unexp[i].done = true;
                if self.unexp[i].discard {
                    self.unexp.remove(i);
                } else if let Some(r) = self.unexp[i].attached.take() {
                    self.take_unexp(i, r, out);
                }
            }
        }
    }

    /// A message stopped arriving (its peer is gone): its receive fails, or its
    /// partial copy is dropped.
    pub fn abort(&mut self, m: &InMsg, err: i32, out: &mut Vec<Comp>) {
        match m.dest {
            Dest::Posted(r) => out.push(comp_of(&m.first, &r, 0, 0, err)),
            Dest::Unexp(id) => {
                if let Some(i) = self.unexp.iter().position(|u| u.id == id) {
                    if let Some(u) = self.unexp.remove(i) {
                        if let Some(r) = u.attached {
                            out.push(comp_of(&u.first, &r, 0, 0, err));
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(buf: &mut [u8], src: u64, tag: u64, ignore: u64, ctx: usize) -> Recv {
        Recv {
            buf: UserBuf { ptr: buf.as_mut_ptr() as usize, cap: buf.len() },
            src,
            tag,
            ignore,
            tagged: true,
            ctx,
            report: true,
        }
    }

    fn first(tag: u64, total: u64) -> First {
        First { flags: F_TAGGED, tag, data: 0, total }
    }

    fn feed(m: &mut Matcher, src: u64, tag: u64, payload: &[u8], out: &mut Vec<Comp>) {
        let mut im = m.arrive(src, first(tag, payload.len() as u64));
        // SAFETY: `payload` is a live slice of its length.
        let f = unsafe { RxFrame::from_raw(payload.as_ptr(), payload.len()) };
        assert!(m.deliver(&mut im, &f, 0, payload.len()));
        m.finish(&im, out);
    }

    #[test]
    fn posted_receive_gets_the_bytes_and_truncation_is_reported() {
        let mut m = Matcher::default();
        let mut out = Vec::new();
        let mut b = [0u8; 4];
        m.post(recv(&mut b, fi::ADDR_UNSPEC, 5, 0, 1), &mut out);
        feed(&mut m, 3, 5, b"abcdef", &mut out);
        assert_eq!(&b, b"abcd");
        assert_eq!((out[0].err, out[0].len, out[0].olen, out[0].ctx), (fi::ETRUNC, 4, 2, 1));
    }

    #[test]
    fn unexpected_messages_match_in_arrival_order_across_peers() {
        let mut m = Matcher::default();
        let mut out = Vec::new();
        feed(&mut m, 1, 7, b"one", &mut out);
        feed(&mut m, 2, 7, b"two", &mut out);
        feed(&mut m, 2, 8, b"eight", &mut out);
        let (mut a, mut b, mut c) = ([0u8; 8], [0u8; 8], [0u8; 8]);
        m.post(recv(&mut a, 2, 0, u64::MAX, 1), &mut out); // from 2, any tag
        m.post(recv(&mut b, fi::ADDR_UNSPEC, 7, 0, 2), &mut out);
        m.post(recv(&mut c, fi::ADDR_UNSPEC, 0, u64::MAX, 3), &mut out);
        assert_eq!((&a[..3], &b[..3], &c[..5]), (&b"two"[..], &b"one"[..], &b"eight"[..]));
        assert_eq!(out.iter().map(|c| c.ctx).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(m.unexpected_len(), 0);
    }

    #[test]
    fn peek_claim_discard_and_cancel() {
        let mut m = Matcher::default();
        let mut out = Vec::new();
        let mut b = [0u8; 8];
        m.peek(recv(&mut b, fi::ADDR_UNSPEC, 1, 0, 9), false, false, &mut out);
        assert_eq!(out.pop().map(|c| c.err), Some(fi::ENOMSG));
        feed(&mut m, 4, 1, b"hey", &mut out);
        m.peek(recv(&mut b, fi::ADDR_UNSPEC, 1, 0, 9), true, false, &mut out);
        assert_eq!(out.pop().map(|c| (c.err, c.len)), Some((0, 3)));
        // Claimed: an ordinary receive no longer sees it.
        m.post(recv(&mut b, fi::ADDR_UNSPEC, 1, 0, 10), &mut out);
        assert!(out.is_empty());
        assert!(m.claim(recv(&mut b, fi::ADDR_UNSPEC, 1, 0, 9), false, &mut out));
        assert_eq!(&b[..3], b"hey");
        assert!(m.cancel(10, &mut out));
        assert_eq!(out.iter().map(|c| (c.ctx, c.err)).collect::<Vec<_>>(), vec![(9, 0), (10, fi::ECANCELED)]);
        assert!(!m.cancel(10, &mut out));
        feed(&mut m, 4, 2, b"drop", &mut out);
        m.peek(recv(&mut b, fi::ADDR_UNSPEC, 2, 0, 11), false, true, &mut out);
        assert_eq!(m.unexpected_len(), 0);
    }

    #[test]
    fn rendezvous_messages_become_pulls_in_order_and_discards_are_answered() {
        let mut m = Matcher::default();
        let mut out = Vec::new();
        let rv = |seq| Rndv { conn: 1, addr: 0x1000, seq };
        m.arrive_rndv(2, first(4, 1 << 20), rv(0));
        m.arrive_rndv(2, first(5, 1 << 20), rv(1));
        assert!(!m.has_pulls());
        let mut b = [0u8; 8];
        m.post(recv(&mut b, fi::ADDR_UNSPEC, 5, 0, 1), &mut out);
        let p = m.take_pulls();
        assert_eq!((p.len(), p[0].rndv.seq, p[0].recv.map(|r| r.ctx)), (1, 1, Some(1)));
        m.peek(recv(&mut b, fi::ADDR_UNSPEC, 4, 0, 2), false, true, &mut out);
        let p = m.take_pulls();
        assert_eq!((p.len(), p[0].rndv.seq, p[0].recv), (1, 0, None));
        assert_eq!(m.unexpected_len(), 0);
        // A receive posted first gets the message at arrival.
        m.post(recv(&mut b, 2, 7, 0, 3), &mut out);
        m.arrive_rndv(2, first(7, 10), rv(2));
        assert_eq!(m.take_pulls().len(), 1);
        assert!(out.iter().all(|c| c.err == 0));
    }

    #[test]
    fn a_receive_posted_mid_message_gets_the_whole_message() {
        let mut m = Matcher::default();
        let mut out = Vec::new();
        let mut im = m.arrive(1, first(3, 6));
        let p = b"abcdef";
        // SAFETY: `p` is a live 6-byte array.
        let f = unsafe { RxFrame::from_raw(p.as_ptr(), 6) };
        assert!(m.deliver(&mut im, &f, 0, 3));
        let mut b = [0u8; 6];
        m.post(recv(&mut b, 1, 3, 0, 1), &mut out);
        assert!(out.is_empty());
        assert!(m.deliver(&mut im, &f, 3, 3));
        m.finish(&im, &mut out);
        assert_eq!(&b, p);
        assert_eq!(out.len(), 1);
    }
}
