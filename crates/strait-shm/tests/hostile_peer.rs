//! A hostile peer: it completes the real handshake (as the connector, so it owns the
//! shared memory as much as the victim does), then writes chosen and random values
//! into every part of the mapping (control words, ring cells, well-formed frames with
//! random protocol headers) while the victim worker posts sends and receives and
//! waits. The victim must never write outside its buffers, never complete a receive
//! `Ok` with more bytes than posted, never wait past its timeout, and end with error
//! completions or a clean close, not a crash. Many seeds via proptest
//! (`HOSTILE_CASES=n` for more; `HOSTILE_DEBUG=1` prints how each case ended).

mod common;

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use proptest::prelude::*;
use strait_core::{Config, MemoryRegion, OpKind, RndvMode, Status, Worker};
use strait_shm::{ShmConfig, ShmDevice, ShmListener};
use strait_wire::Header;

const RING: usize = 64 << 10;
const TOTAL: usize = HEADER_BYTES + 2 * RING;
const GUARD: usize = 256;
const KIND_FRAME: u64 = 0x5346;
const KIND_PAD: u64 = 0x5350;
/// The value the victim's setup probe looks for at the address the hello names: with
/// it, the victim believes remote reads work and follows rendezvous addresses.
static PROBE: u64 = 0x4542_4f52_5054_5253;
/// Memory the attacker's rendezvous announcements may honestly point at.
static SOURCE: [u8; 1 << 16] = [0x5a; 1 << 16];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn header_word(kind: u64, pos: u64, len: u64) -> u64 {
    let lap = (pos >> RING.trailing_zeros()) & 0xffff;
    (kind << 48) | (lap << 32) | (len & 0xffff_ffff)
}

/// A value an attacker would pick for a word: edge cases, plausible positions and
/// header words, or noise.
fn chosen(r: &mut Rng, pos: u64) -> u64 {
    match r.below(12) {
        0 => 0,
        1 => 1,
        2 => u64::MAX,
        3 => 1 << 63,
        4 => RING as u64,
        5 => pos + 64 * r.below(4096),
        6 => pos.wrapping_sub(64 * r.below(64)),
        7 => header_word(KIND_FRAME, pos, r.below(RING as u64)),
        8 => header_word(KIND_FRAME, pos, u32::MAX as u64),
        9 => header_word(KIND_PAD, pos, r.below(64)),
        10 => header_word(KIND_FRAME, pos + RING as u64, 8),
        _ => r.next(),
    }
}

/// Protocol headers an attacker would send: mostly the shape of a real
/// conversation (sequence numbers in order, data for the transfer it announced, at
/// the offset the victim expects or near it), with lies in lengths, offsets,
/// addresses, credits and ids.
struct Talk {
    seq: u32,
    msg_id: u32,
    offset: u64,
}

impl Talk {
    /// The next header; `plen` is the payload length (the attacker may change it).
    /// Each lie is rare, so that conversations get deep before one is caught.
    fn next(&mut self, r: &mut Rng, plen: &mut usize) -> Header {
        let lie = |r: &mut Rng| r.below(48) == 0;
        let credits = if lie(r) { r.next() as u16 } else { 0 };
        let seq = if lie(r) { r.next() as u32 } else { self.seq };
        let id = |r: &mut Rng, mine: u32| if lie(r) { r.next() as u32 } else { mine };
        match r.below(12) {
            0..=2 => {
                self.seq = self.seq.wrapping_add(1);
                *plen = (*plen).min(8000);
                Header::Eager { credits, seq, tag: r.below(4) }
            }
            3 | 4 => {
                self.seq = self.seq.wrapping_add(1);
                self.msg_id = self.msg_id.wrapping_add(1);
                self.offset = 0;
                *plen = 0;
                let len = if lie(r) {
                    [1 << 32, u64::MAX, r.next()][r.below(3) as usize]
                } else {
                    [0, 1, 100, 20_000, 300_000, 2_000_000][r.below(6) as usize]
                };
                let src = SOURCE.as_ptr() as u64;
                let addr = [0, u64::MAX, u64::MAX - 8, 1 << 47, 0x1000, r.next(), src, src, src + 60_000]
                    [r.below(9) as usize];
                Header::Rts { credits, seq, tag: r.below(4), len, msg_id: self.msg_id, addr }
            }
            5..=9 if self.msg_id > 0 => {
                let offset = if lie(r) {
                    [r.next(), u64::MAX - r.below(4), 0, self.offset + 1][r.below(4) as usize]
                } else {
                    self.offset
                };
                *plen = [1, 63, 64, 65, 100, 1000, 16_000][r.below(7) as usize];
                self.offset = offset.wrapping_add(*plen as u64);
                Header::Data { credits, msg_id: id(r, self.msg_id), offset }
            }
            10 => {
                *plen = 0;
                let accept = if lie(r) {
                    [u32::MAX, (1 << 20) + 1][r.below(2) as usize]
                } else {
                    r.below(1 << 20) as u32
                };
                match r.below(4) {
                    0 => Header::Cts { credits, msg_id: id(r, 1), accept },
                    1 => Header::Fin { credits, msg_id: id(r, 1), status: r.below(4) as u32 },
                    // A split transfer's frames: a PUT whose range and address the
                    // victim must check (it may only ever write its own message's
                    // bytes, and never into itself), and unasked PUT-DONEs.
                    2 => {
                        let (offset, len) = if lie(r) {
                            (r.next() as u32, r.next() as u32)
                        } else {
                            (r.below(1 << 20) as u32, 1 + r.below(1 << 20) as u32)
                        };
                        let addr = [0, u64::MAX - 8, SOURCE.as_ptr() as u64, r.next()][r.below(4) as usize];
                        Header::Put { credits, msg_id: id(r, 1), offset, len, addr }
                    }
                    _ => Header::PutDone { credits, msg_id: id(r, 1), status: r.below(3) as u32 },
                }
            }
            _ => {
                *plen = 0;
                match r.below(32) {
                    0 => Header::Close { credits },
                    1 => Header::Credit { credits: 1 + r.next() as u16 % 64 },
                    _ => Header::Eager {
                        credits,
                        seq: {
                            self.seq = self.seq.wrapping_add(1);
                            seq
                        },
                        tag: 0,
                    },
                }
            }
        }
    }
}

/// The attacker's loop over the shared mapping at `base` until `stop`.
fn scribble(base: usize, seed: u64, style: u8, stop: &AtomicBool, bell: i32) {
    let mut r = Rng(seed | 1);
    let overrun = r.below(8) == 0;
    let word = |off: usize| {
        // SAFETY: `off` is 8-aligned and below TOTAL: a word of our own mapping.
        unsafe { &*((base + off) as *const AtomicU64) }
    };
    let ctl = |ring: usize, at: usize| 1024 + ring * 1024 + at;
    let data0 = HEADER_BYTES; // ring 0: connector (us) -> acceptor (victim)
    let mut tail = 0u64;
    let mut talk = Talk { seq: 0, msg_id: 0, offset: 0 };
    let mut pause = false;
    while !stop.load(Ordering::Relaxed) {
        // Style 3 speaks the protocol, with a little noise; the others mix freely.
        let pick = if style == 3 { 3 + r.below(400) } else { r.below(10) };
        match (style, pick) {
            // Noise anywhere in the mapping.
            (0, _) | (_, 0) => {
                let off = (r.below(TOTAL as u64 / 8) * 8) as usize;
                word(off).store(r.next(), Ordering::Relaxed);
            }
            // Chosen values in the control words of both rings.
            (1, _) | (_, 1) => {
                let at = [256, 512, 768][r.below(3) as usize];
                word(ctl(r.below(2) as usize, at)).store(chosen(&mut r, tail), Ordering::Relaxed);
            }
            // Chosen values in ring cells (either ring).
            (2, _) | (_, 2) => {
                let k = r.below(2) as usize;
                let cell = r.below((RING / 64) as u64) as usize * 64;
                word(HEADER_BYTES + k * RING + cell)
                    .store(chosen(&mut r, tail + cell as u64), Ordering::Relaxed);
            }
            // A well-formed frame with a random protocol header at our tail.
            _ => {
                let mut plen = if r.below(3) == 0 {
                    r.below(RING as u64 / 4 - 64) as usize
                } else {
                    r.below(64) as usize
                };
                let h = talk.next(&mut r, &mut plen);
                let mut buf = [0u8; 64];
                let hlen = h.encode(&mut buf);
                let plen = plen.min(RING / 4 - 64);
                let len = hlen + plen;
                let span = (8 + len).div_ceil(64) as u64 * 64;
                let off = (tail % RING as u64) as usize;
                // Mostly respect the victim's consumer position (else every frame
                // would just be a stale lap); sometimes run over it.
                let head = word(ctl(0, 256)).load(Ordering::Acquire);
                if tail + span + 64 > head + RING as u64 && !(overrun && r.below(16) == 0) {
                    std::thread::yield_now();
                    continue;
                }
                if off as u64 + span > RING as u64 {
                    word(data0 + off).store(header_word(KIND_PAD, tail, 0), Ordering::Release);
                    tail += RING as u64 - off as u64;
                    continue;
                }
                for (i, c) in buf[..hlen].chunks(8).enumerate() {
                    let mut w = [0u8; 8];
                    w[..c.len()].copy_from_slice(c);
                    word(data0 + off + 8 + i * 8).store(u64::from_le_bytes(w), Ordering::Relaxed);
                }
                let mut p = hlen.div_ceil(8) * 8;
                while p < len {
                    word(data0 + off + 8 + p).store(r.next(), Ordering::Relaxed);
                    p += 8;
                }
                word(data0 + off).store(header_word(KIND_FRAME, tail, len as u64), Ordering::Release);
                tail += span;
                if matches!(h, Header::Rts { .. }) {
                    // Let the victim match it and start the transfer before any DATA.
                    pause = true;
                }
                // Wake the victim (its doorbell came with the handshake reply).
                let one = 1u64;
                // SAFETY: writes 8 bytes from a local to the victim's eventfd.
                unsafe { libc::write(bell, (&one as *const u64).cast(), 8) };
                // Sometimes wait for the victim, sometimes run over it.
                if r.below(2) == 0 {
                    std::thread::yield_now();
                }
            }
        }
        if std::mem::take(&mut pause) {
            std::thread::sleep(Duration::from_millis(2));
        } else if r.below(64) == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn attack(seed: u64, style: u8, remote_read: bool) {
    let name = unique("hostile");
    let listener =
        ShmListener::bind_with(&name, &ShmConfig { ring_bytes: RING, ..ShmConfig::default() }).unwrap();
    let probe = std::ptr::addr_of!(PROBE) as u64;
    let (sock, memfd, _wake) = raw_hello_probe(&name, (RING / 4096) as u32, TOTAL as u64, probe);
    // With remote reads, half the seeds take the split path (the victim asks the
    // attacker for PUTs and serves the attacker's).
    let mode = match (remote_read, seed % 2) {
        (false, _) => RndvMode::Copy,
        (true, 0) => RndvMode::Split,
        (true, _) => RndvMode::RemoteRead,
    };
    let mut w: Worker<ShmDevice> =
        Worker::new(Config { rndv_mode: mode, spin: Duration::ZERO, ..Config::default() }).unwrap();
    let dev =
        listener.accept_timeout(w.notifier(), Some(Duration::from_secs(5))).unwrap().expect("handshake");
    let mut reply = [0u8; 64];
    let (n, fds) = recv_fds(sock.as_raw_fd(), &mut reply);
    assert_eq!(n, 32);
    // SAFETY: maps the memfd we created, for the attacker's writes.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            TOTAL,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            memfd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    if std::env::var("HOSTILE_DEBUG").is_ok() {
        eprintln!("remote read available: {}", dev.remote_read_available());
    }
    let ep = w.attach(dev);

    // Posted buffers, each with guard bytes on both sides.
    let sizes = [64usize, 16_000, 300_000, 100, 20_000, 300_000, 1 << 20, 64];
    let mut regions: Vec<MemoryRegion> =
        sizes.iter().map(|&s| MemoryRegion::new(s + 2 * GUARD).unwrap()).collect();
    for mr in &mut regions {
        mr.bytes_mut().unwrap().fill(0xee);
    }
    for (i, mr) in regions.iter_mut().enumerate() {
        let len = sizes[i];
        w.post_recv(ep, mr, GUARD..GUARD + len, i as u64, 0, i as u64).unwrap();
    }
    let out = MemoryRegion::new(1 << 20).unwrap();
    let _ = w.post_send(ep, &out, 0..100, 1, 100);
    let _ = w.post_send(ep, &out, 0..(1 << 20), 2, 101);

    let stop = Arc::new(AtomicBool::new(false));
    let t = {
        let stop = stop.clone();
        let base = base as usize;
        let bell = fds[0].as_raw_fd();
        std::thread::spawn(move || scribble(base, seed, style, &stop, bell))
    };
    let timeout = Duration::from_millis(15);
    let end = Instant::now() + Duration::from_millis(120);
    let check = |c: &strait_core::Completion| {
        if std::env::var("HOSTILE_DEBUG").is_ok() {
            eprintln!("completion {:?} {:?} len {}", c.op, c.status, c.len);
        }
        if c.op == OpKind::Recv && c.status == Status::Ok {
            assert!(
                c.ctx < sizes.len() as u64 && c.len <= sizes[c.ctx as usize],
                "receive completed Ok with {} bytes: {c:?}",
                c.len
            );
        }
    };
    while Instant::now() < end {
        let t0 = Instant::now();
        let r = w.wait(Some(timeout));
        let took = t0.elapsed();
        assert!(took < timeout + Duration::from_millis(500), "wait took {took:?} (timeout {timeout:?})");
        match r {
            Ok(c) => check(&c),
            Err(strait_core::WaitError::Idle) => break,
            Err(_) => {}
        }
    }
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap();
    if std::env::var("HOSTILE_DEBUG").is_ok() {
        eprintln!("style {style} rr {remote_read}: {:?} {:?}", w.endpoint_error(ep), w.stats(ep));
    }
    w.close(ep);
    while let Some(c) = w.poll() {
        check(&c);
    }
    for (i, mr) in regions.iter().enumerate() {
        let b = mr.bytes().expect("every receive completed");
        assert!(b[..GUARD].iter().all(|&x| x == 0xee), "seed {seed}: bytes written before buffer {i}");
        assert!(
            b[GUARD + sizes[i]..].iter().all(|&x| x == 0xee),
            "seed {seed}: bytes written past buffer {i}"
        );
    }
    // SAFETY: unmaps the attacker's mapping made above.
    unsafe { libc::munmap(base, TOTAL) };
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("HOSTILE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(384), failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn a_hostile_peer_cannot_break_the_victim(seed in any::<u64>(), style in 0u8..6, remote_read in any::<bool>()) {
        attack(seed, style.min(3), remote_read);
    }
}
