//! The data path of strait's native API as a benchmark [`Transport`], generic over
//! the device, so every strait device (shm today; udp, xdp later) is measured by the
//! same code.
//!
//! Both ends busy-poll with [`Worker::poll`] inside a batch (the fastest path) and
//! receives are always pre-posted before the matching send can arrive. Between
//! batches the peer blocks on its control pipe, so it never spins while another
//! transport is measured. Streaming keeps a window of sends in flight from ranges
//! of one memory region, and the receiver keeps as many receives posted.

use std::time::{Duration, Instant};

use strait_anatomy::transport::Result;
use strait_anatomy::{BenchError, Transport};
use strait_core::{Completion, Device, EpId, MemoryRegion, OpKind, Status, Worker};

const TAG_PING: u64 = 1;
const TAG_PONG: u64 = 2;
const TAG_DATA: u64 = 3;
const TAG_ACK: u64 = 4;
/// A poll loop gives up (the peer is presumed dead) after this long.
const DEAD: Duration = Duration::from_secs(30);
/// Bytes of messages in flight while streaming (bounded to 2..=64 messages): enough
/// to keep both ends busy, and small enough that the buffers stay in the caches, as
/// they do for the kernel paths (which reuse one buffer) and for `ucx_perftest`.
const WINDOW_BYTES: usize = 4 << 20;

/// One end: a worker with a single endpoint and its memory regions.
pub struct NativeLink<D: Device> {
    name: &'static str,
    w: Worker<D>,
    ep: EpId,
    /// Ping-pong send and receive buffers, and the streaming window.
    tx: MemoryRegion,
    rx: MemoryRegion,
    ack: MemoryRegion,
    win: MemoryRegion,
    /// Message size `win` is laid out for, and its slot count.
    win_size: usize,
    win_slots: usize,
    free: Vec<usize>,
}

/// Counts a busy-poll loop's empty polls and tells when it has waited too long
/// (the clock is read only every 4096th empty poll, and starts at the first look).
#[derive(Default)]
pub(crate) struct Stall {
    spins: u32,
    start: Option<Instant>,
}

impl Stall {
    /// Records one empty poll; whether the wait has now lasted longer than `limit`.
    pub(crate) fn over(&mut self, limit: Duration) -> bool {
        self.spins = self.spins.wrapping_add(1);
        self.spins.is_multiple_of(4096) && self.start.get_or_insert_with(Instant::now).elapsed() > limit
    }
}

fn err(name: &str, what: &str, e: impl std::fmt::Display) -> BenchError {
    BenchError::transport(name, format!("{what}: {e}"))
}

fn region(name: &str, len: usize) -> Result<MemoryRegion> {
    let e = |e: &dyn std::fmt::Display| BenchError::transport(name, format!("memory region: {e}"));
    let mut r = MemoryRegion::new(len.max(8)).map_err(|x| e(&x))?;
    // Touch every page now, so no page fault lands inside a measurement.
    r.bytes_mut().map_err(|x| e(&x))?.fill(0xa5);
    Ok(r)
}

/// Messages in flight while streaming `size`-byte messages.
fn window(size: usize) -> usize {
    (WINDOW_BYTES / size.max(1)).clamp(2, 64)
}

impl<D: Device> NativeLink<D> {
    /// Attaches the connected `dev` to `w`; errors are reported under `name`.
    pub fn new(name: &'static str, mut w: Worker<D>, dev: D) -> Result<NativeLink<D>> {
        let ep = w.attach(dev);
        Ok(NativeLink {
            name,
            w,
            ep,
            tx: region(name, 8)?,
            rx: region(name, 8)?,
            ack: region(name, 8)?,
            win: region(name, 8)?,
            win_size: 0,
            win_slots: 0,
            free: Vec::new(),
        })
    }

    /// Why the endpoint failed, as the engine and device tell it.
    fn why(&self) -> String {
        let stats = if std::env::var_os("STRAIT_BENCH_DEBUG").is_some() {
            format!(" {:?} {}", self.w.stats(self.ep), self.w.describe(self.ep).unwrap_or_default())
        } else {
            String::new()
        };
        match self.w.endpoint_error(self.ep) {
            Some((_, Some(why))) => format!(" ({why}){stats}"),
            _ => stats,
        }
    }

    /// The error of a completion that did not end `Ok`.
    fn failed(&self, c: &Completion) -> BenchError {
        err(self.name, "completion", format!("{:?} ended {:?}{}", c.op, c.status, self.why()))
    }

    /// Polls until `sends` send and `recvs` receive completions arrived; every one
    /// must be `Ok`. Returns the receive lengths summed.
    fn reap(&mut self, mut sends: u32, mut recvs: u32) -> Result<u64> {
        let mut bytes = 0u64;
        let mut stall = Stall::default();
        while sends > 0 || recvs > 0 {
            match self.w.poll() {
                Some(c) => {
                    if c.status != Status::Ok {
                        return Err(self.failed(&c));
                    }
                    match c.op {
                        OpKind::Send => sends = sends.saturating_sub(1),
                        OpKind::Recv => {
                            recvs = recvs.saturating_sub(1);
                            bytes += c.len as u64;
                        }
                    }
                }
                None => {
                    if stall.over(DEAD) {
                        return Err(BenchError::Timeout(DEAD, "strait-shm completions"));
                    }
                }
            }
        }
        Ok(bytes)
    }

    fn post_recv_rx(&mut self, size: usize, tag: u64) -> Result<()> {
        self.w
            .post_recv(self.ep, &mut self.rx, 0..size, tag, u64::MAX, 0)
            .map_err(|e| err(self.name, "post_recv", e))
    }

    fn post_send_tx(&mut self, size: usize, tag: u64) -> Result<()> {
        self.w.post_send(self.ep, &self.tx, 0..size, tag, 0).map_err(|e| err(self.name, "post_send", e))
    }

    fn layout_window(&mut self, size: usize) -> Result<()> {
        if self.win_size != size {
            let slots = window(size);
            self.win = region(self.name, slots * size)?;
            self.win_size = size;
            self.win_slots = slots;
        }
        self.free.clear();
        self.free.extend(0..self.win_slots);
        Ok(())
    }
}

impl<D: Device> Transport for NativeLink<D> {
    fn prepare(&mut self, size: usize) -> Result<()> {
        if self.tx.len() < size {
            self.tx = region(self.name, size)?;
            self.rx = region(self.name, size)?;
        }
        Ok(())
    }

    fn needs_idle(&self) -> bool {
        // Lossy-link devices run timers (acknowledgements, retransmissions).
        self.w.next_timer_ns().is_some()
    }

    fn idle(&mut self) {
        for _ in 0..64 {
            if self.w.progress() == 0 {
                break;
            }
        }
    }

    fn ping(&mut self, size: usize) -> Result<()> {
        self.post_recv_rx(size, TAG_PONG)?;
        self.post_send_tx(size, TAG_PING)?;
        self.reap(1, 1).map(|_| ())
    }

    fn pong(&mut self, size: usize) -> Result<()> {
        self.post_recv_rx(size, TAG_PING)?;
        self.reap(0, 1)?;
        self.post_send_tx(size, TAG_PONG)?;
        self.reap(1, 0).map(|_| ())
    }

    /// Keeps the next ping's receive posted before each pong is sent, and lets a
    /// pong's send completion be reaped together with the next ping.
    fn pong_batch(&mut self, size: usize, iters: u64) -> Result<()> {
        if iters == 0 {
            return Ok(());
        }
        self.post_recv_rx(size, TAG_PING)?;
        let mut pending_send = 0;
        for i in 0..iters {
            self.reap(pending_send, 1)?;
            if i + 1 < iters {
                self.post_recv_rx(size, TAG_PING)?;
            }
            self.post_send_tx(size, TAG_PONG)?;
            pending_send = 1;
        }
        self.reap(pending_send, 0).map(|_| ())
    }

    fn stream_send(&mut self, size: usize, count: u64) -> Result<()> {
        self.layout_window(size)?;
        self.w
            .post_recv(self.ep, &mut self.ack, 0..8, TAG_ACK, u64::MAX, 0)
            .map_err(|e| err(self.name, "post_recv", e))?;
        let (mut posted, mut done) = (0u64, 0u64);
        let mut stall = Stall::default();
        while done < count {
            while posted < count {
                let Some(slot) = self.free.pop() else { break };
                let off = slot * size;
                self.w
                    .post_send(self.ep, &self.win, off..off + size, TAG_DATA, slot as u64)
                    .map_err(|e| err(self.name, "post_send", e))?;
                posted += 1;
            }
            match self.w.poll() {
                Some(c) if c.op == OpKind::Send && c.status == Status::Ok => {
                    self.free.push(c.ctx as usize);
                    done += 1;
                }
                Some(c) if c.status == Status::Ok => {
                    return Err(err(
                        self.name,
                        "stream",
                        format!("unexpected {:?} completion (tag {})", c.op, c.tag),
                    ))
                }
                Some(c) => return Err(self.failed(&c)),
                None => {
                    if stall.over(DEAD) {
                        return Err(BenchError::Timeout(DEAD, "strait-shm send completions"));
                    }
                }
            }
        }
        self.reap(0, 1).map(|_| ())
    }

    fn stream_recv(&mut self, size: usize, count: u64) -> Result<u64> {
        self.layout_window(size)?;
        let mut posted = 0u64;
        while posted < count {
            let Some(slot) = self.free.pop() else { break };
            let off = slot * size;
            self.w
                .post_recv(self.ep, &mut self.win, off..off + size, TAG_DATA, u64::MAX, slot as u64)
                .map_err(|e| err(self.name, "post_recv", e))?;
            posted += 1;
        }
        let (mut got, mut bytes) = (0u64, 0u64);
        let mut stall = Stall::default();
        while got < count {
            match self.w.poll() {
                Some(c) if c.op == OpKind::Recv && c.status == Status::Ok => {
                    got += 1;
                    bytes += c.len as u64;
                    if posted < count {
                        let off = c.ctx as usize * size;
                        self.w
                            .post_recv(self.ep, &mut self.win, off..off + size, TAG_DATA, u64::MAX, c.ctx)
                            .map_err(|e| err(self.name, "post_recv", e))?;
                        posted += 1;
                    }
                }
                Some(c) if c.status == Status::Ok => {}
                Some(c) => return Err(self.failed(&c)),
                None => {
                    if stall.over(DEAD) {
                        return Err(BenchError::Timeout(DEAD, "strait-shm streamed messages"));
                    }
                }
            }
        }
        self.w.post_send(self.ep, &self.ack, 0..8, TAG_ACK, 0).map_err(|e| err(self.name, "post_send", e))?;
        self.reap(1, 0)?;
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_is_bounded() {
        assert_eq!(window(1024), 64);
        assert_eq!(window(1 << 20), 4);
        assert_eq!(window(4 << 20), 2);
        assert_eq!(window(64 << 20), 2);
    }

    /// The native data path over the engine's in-process loopback device, one worker
    /// per thread: ping-pong and streaming at eager and rendezvous sizes.
    fn loopback_exchange(remote_read: bool) {
        use strait_core::loopback::LoopbackDevice;
        use strait_core::{Config, RndvMode};
        let cfg = Config {
            rndv_mode: if remote_read { RndvMode::Auto } else { RndvMode::Copy },
            ..Config::default()
        };
        let (mut a, mut b) = LoopbackDevice::pair_with(1 << 20, remote_read);
        let wa = Worker::new(cfg.clone()).unwrap();
        let wb = Worker::new(cfg).unwrap();
        a.set_wake_fd(std::os::fd::AsRawFd::as_raw_fd(wa.notifier()));
        b.set_wake_fd(std::os::fd::AsRawFd::as_raw_fd(wb.notifier()));
        let sizes = [8usize, 4096, 8193, 100_000, 1 << 20];
        let peer = std::thread::spawn(move || {
            let mut t = NativeLink::new("test", wb, b).unwrap();
            for &s in &sizes {
                t.prepare(s).unwrap();
                t.pong_batch(s, 20).unwrap();
                t.pong(s).unwrap();
            }
            let mut got = 0;
            for &s in &sizes {
                t.prepare(s).unwrap();
                got += t.stream_recv(s, 100).unwrap();
            }
            got
        });
        let mut t = NativeLink::new("test", wa, a).unwrap();
        let clock = strait_anatomy::Clock::monotonic();
        let mut samples = Vec::new();
        for &s in &sizes {
            t.prepare(s).unwrap();
            t.ping_batch(s, 21, &clock, &mut samples).unwrap();
        }
        for &s in &sizes {
            t.prepare(s).unwrap();
            t.stream_send(s, 100).unwrap();
        }
        assert_eq!(samples.len(), 21 * sizes.len());
        assert_eq!(peer.join().unwrap(), 100 * sizes.iter().sum::<usize>() as u64);
    }

    #[test]
    fn loopback_remote_read() {
        loopback_exchange(true);
    }

    #[test]
    fn loopback_pipelined_copy() {
        loopback_exchange(false);
    }
}
