//! Protocol-engine tests over the in-memory loopback device: properties over random
//! sizes, tags, masks, posting orders, credit windows and device capacities, plus the
//! edge cases one by one.

use std::collections::HashMap;

use proptest::prelude::*;
use strait_core::loopback::LoopbackDevice;
use strait_core::{Completion, Config, EpId, MemoryRegion, OpKind, PostError, RndvMode, Status, Worker};
use strait_sys::xorshift_bytes;

type W = Worker<LoopbackDevice>;

fn pattern(tag: u64, idx: u64, len: usize) -> Vec<u8> {
    xorshift_bytes(
        tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ idx.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ len as u64,
        len,
    )
}

fn pair(cfg: &Config, cap: usize, remote_read: bool) -> (W, EpId, W, EpId) {
    let (a, b) = LoopbackDevice::pair_with(cap, remote_read);
    let mut wa = Worker::new(cfg.clone()).unwrap();
    let mut wb = Worker::new(cfg.clone()).unwrap();
    let ea = wa.attach(a);
    let eb = wb.attach(b);
    (wa, ea, wb, eb)
}

/// One direction of traffic: what was sent, what was posted, what completed.
#[derive(Default)]
struct Side {
    send_regions: HashMap<u64, MemoryRegion>,
    recv_regions: HashMap<u64, MemoryRegion>,
    done: Vec<Completion>,
}

fn drain(w: &mut W, side: &mut Side) -> usize {
    let mut n = 0;
    while let Some(c) = w.poll() {
        side.done.push(c);
        n += 1;
    }
    n
}

#[derive(Debug, Clone)]
struct Msg {
    tag: u64,
    len: usize,
}

#[derive(Debug, Clone, Copy)]
enum Step {
    SendA,
    SendB,
    RecvA,
    RecvB,
    Progress,
}

/// Runs traffic both ways with exact-tag receives, checks exactly-once delivery,
/// bytes, and per-tag order (the k-th receive posted for tag t gets the k-th message
/// sent with tag t).
fn run_exact(cfg: Config, cap: usize, remote_read: bool, a2b: Vec<Msg>, b2a: Vec<Msg>, steps: Vec<Step>) {
    let (mut wa, ea, mut wb, eb) = pair(&cfg, cap, remote_read);
    let max_len = a2b.iter().chain(&b2a).map(|m| m.len).max().unwrap_or(0);
    // Receives are posted in the same per-tag order but interleaved differently.
    let mut recv_b: Vec<u64> = a2b.iter().map(|m| m.tag).collect();
    let mut recv_a: Vec<u64> = b2a.iter().map(|m| m.tag).collect();
    recv_b.reverse();
    recv_a.reverse();
    let (mut sa, mut sb) = (Side::default(), Side::default());
    let (mut next_sa, mut next_sb, mut next_ra, mut next_rb) = (0usize, 0usize, 0usize, 0usize);
    let post_send = |w: &mut W, ep: EpId, side: &mut Side, msgs: &Vec<Msg>, i: &mut usize| {
        if *i >= msgs.len() {
            return;
        }
        let m = &msgs[*i];
        let mut mr = MemoryRegion::new(m.len).unwrap();
        mr.write_at(0, &pattern(m.tag, *i as u64, m.len)).unwrap();
        w.post_send(ep, &mr, 0..m.len, m.tag, *i as u64).unwrap();
        side.send_regions.insert(*i as u64, mr);
        *i += 1;
    };
    let post_recv = |w: &mut W, ep: EpId, side: &mut Side, tags: &mut Vec<u64>, i: &mut usize| {
        let Some(tag) = tags.pop() else { return };
        let mut mr = MemoryRegion::new(max_len.max(1)).unwrap();
        w.post_recv(ep, &mut mr, 0..max_len, tag, u64::MAX, *i as u64).unwrap();
        side.recv_regions.insert(*i as u64, mr);
        *i += 1;
    };
    for s in &steps {
        match s {
            Step::SendA => post_send(&mut wa, ea, &mut sa, &a2b, &mut next_sa),
            Step::SendB => post_send(&mut wb, eb, &mut sb, &b2a, &mut next_sb),
            Step::RecvA => post_recv(&mut wa, ea, &mut sa, &mut recv_a, &mut next_ra),
            Step::RecvB => post_recv(&mut wb, eb, &mut sb, &mut recv_b, &mut next_rb),
            Step::Progress => {
                drain(&mut wa, &mut sa);
                drain(&mut wb, &mut sb);
            }
        }
    }
    while next_sa < a2b.len() || next_sb < b2a.len() || !recv_a.is_empty() || !recv_b.is_empty() {
        post_send(&mut wa, ea, &mut sa, &a2b, &mut next_sa);
        post_send(&mut wb, eb, &mut sb, &b2a, &mut next_sb);
        post_recv(&mut wa, ea, &mut sa, &mut recv_a, &mut next_ra);
        post_recv(&mut wb, eb, &mut sb, &mut recv_b, &mut next_rb);
    }
    let want = 2 * (a2b.len() + b2a.len());
    for _ in 0..200_000 {
        drain(&mut wa, &mut sa);
        drain(&mut wb, &mut sb);
        if sa.done.len() + sb.done.len() == want {
            break;
        }
    }
    assert_eq!(sa.done.len() + sb.done.len(), want, "not every operation completed");
    check_side(&a2b, &sa, &sb, max_len);
    check_side(&b2a, &sb, &sa, max_len);
}

/// Checks the messages `sent` by `tx` and received by `rx`.
fn check_side(sent: &[Msg], tx: &Side, rx: &Side, max_len: usize) {
    let sends: Vec<&Completion> = tx.done.iter().filter(|c| c.op == OpKind::Send).collect();
    assert_eq!(sends.len(), sent.len());
    for c in &sends {
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert_eq!(c.len, sent[c.ctx as usize].len);
    }
    let mut ctxs: Vec<u64> = sends.iter().map(|c| c.ctx).collect();
    ctxs.sort();
    ctxs.dedup();
    assert_eq!(ctxs.len(), sent.len(), "a send completed twice");
    // Per tag, the k-th receive posted gets the k-th message sent.
    let mut by_tag: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, m) in sent.iter().enumerate() {
        by_tag.entry(m.tag).or_default().push(i);
    }
    let mut recvs: Vec<&Completion> = rx.done.iter().filter(|c| c.op == OpKind::Recv).collect();
    assert_eq!(recvs.len(), sent.len());
    recvs.sort_by_key(|c| c.ctx);
    let mut cursor: HashMap<u64, usize> = HashMap::new();
    for c in recvs {
        assert_eq!(c.status, Status::Ok, "{c:?}");
        let k = cursor.entry(c.tag).or_default();
        let idx = by_tag[&c.tag][*k];
        *k += 1;
        let m = &sent[idx];
        assert_eq!(c.len, m.len, "receive {} got the wrong message", c.ctx);
        let mr = &rx.recv_regions[&c.ctx];
        assert!(mr.len() >= max_len.max(1));
        assert_eq!(&mr.bytes().unwrap()[..m.len], &pattern(m.tag, idx as u64, m.len)[..], "bytes differ");
    }
}

fn any_msg() -> impl Strategy<Value = Msg> {
    (0u64..4, prop_oneof![0usize..64, 64usize..4096, 4096usize..20_000, 20_000usize..200_000])
        .prop_map(|(tag, len)| Msg { tag, len })
}

fn any_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        Just(Step::SendA),
        Just(Step::SendB),
        Just(Step::RecvA),
        Just(Step::RecvB),
        Just(Step::Progress)
    ]
}

fn any_cfg() -> impl Strategy<Value = (Config, usize, bool)> {
    (
        1u16..8,
        prop_oneof![Just(64usize), Just(1024), Just(8192)],
        prop_oneof![
            Just(RndvMode::Auto),
            Just(RndvMode::Copy),
            Just(RndvMode::RemoteRead),
            Just(RndvMode::Split)
        ],
        prop_oneof![Just(1024usize), Just(16384)],
        prop_oneof![Just(0usize), Just(32768)],
        prop_oneof![Just(16usize * 1024), Just(256 * 1024)],
        any::<bool>(),
        prop_oneof![Just(1usize), Just(4096), Just(65536)],
    )
        .prop_map(|(credits, eager, mode, chunk, pipe, cap, rr, split)| {
            let cfg = Config {
                credits,
                eager_threshold: eager,
                rndv_mode: mode,
                chunk_size: chunk,
                pipeline_threshold: pipe,
                split_threshold: split,
                ..Config::default()
            };
            (cfg, cap, rr)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn exactly_once_in_order_right_bytes(
        (cfg, cap, rr) in any_cfg(),
        a2b in proptest::collection::vec(any_msg(), 0..24),
        b2a in proptest::collection::vec(any_msg(), 0..24),
        steps in proptest::collection::vec(any_step(), 0..120),
    ) {
        run_exact(cfg, cap, rr, a2b, b2a, steps);
    }

    /// Wildcard and partial masks: every message is received exactly once, by a
    /// receive whose mask admits it, with the right bytes.
    #[test]
    fn masks_deliver_each_message_once(
        (cfg, cap, rr) in any_cfg(),
        msgs in proptest::collection::vec((0u64..16, 0usize..30_000), 1..30),
        wild in proptest::collection::vec(any::<bool>(), 30),
        recv_first in any::<bool>(),
    ) {
        let (mut wa, ea, mut wb, eb) = pair(&cfg, cap, rr);
        let max_len = msgs.iter().map(|m| m.1).max().unwrap_or(0).max(1);
        let mut regions = Vec::new();
        let mut recvs = HashMap::new();
        // Receives: either "any tag" or "same low two bits as tag t" (mask 0b11).
        let recv_specs: Vec<(u64, u64)> = msgs.iter().enumerate()
            .map(|(i, m)| if wild[i % wild.len()] { (0, 0) } else { (m.0 & 3, 3) })
            .collect();
        let post_recvs = |wb: &mut W, recvs: &mut HashMap<u64, MemoryRegion>| {
            for (i, (t, mask)) in recv_specs.iter().enumerate() {
                let mut mr = MemoryRegion::new(max_len).unwrap();
                wb.post_recv(eb, &mut mr, 0..max_len, *t, *mask, i as u64).unwrap();
                recvs.insert(i as u64, mr);
            }
        };
        if recv_first { post_recvs(&mut wb, &mut recvs); }
        for (i, (tag, len)) in msgs.iter().enumerate() {
            let mut mr = MemoryRegion::new(*len).unwrap();
            mr.write_at(0, &pattern(*tag, i as u64, *len)).unwrap();
            wa.post_send(ea, &mr, 0..*len, *tag, i as u64).unwrap();
            regions.push(mr);
            wa.progress();
            wb.progress();
        }
        if !recv_first { post_recvs(&mut wb, &mut recvs); }
        let mut done = Vec::new();
        for _ in 0..100_000 {
            while let Some(c) = wa.poll() { done.push(c); }
            while let Some(c) = wb.poll() { done.push(c); }
            if done.len() >= 2 * msgs.len() { break; }
        }
        // Every receive must have matched some message; with these masks a greedy
        // assignment may leave a receive whose mask admits no remaining message, so
        // only count what completed and check each for integrity and uniqueness.
        let got: Vec<&Completion> = done.iter().filter(|c| c.op == OpKind::Recv).collect();
        let mut seen = std::collections::HashSet::new();
        for c in &got {
            prop_assert_eq!(c.status, Status::Ok);
            let (t, mask) = recv_specs[c.ctx as usize];
            prop_assert_eq!(c.tag & mask, t & mask);
            let mr = &recvs[&c.ctx];
            let data = &mr.bytes().unwrap()[..c.len];
            let idx = (0..msgs.len()).find(|&i| msgs[i].0 == c.tag && msgs[i].1 == c.len
                && !seen.contains(&i) && data == &pattern(c.tag, i as u64, c.len)[..]);
            prop_assert!(idx.is_some(), "received bytes match no unsent message");
            seen.insert(idx.unwrap());
        }
        // Sends all complete (their messages were all consumed by the receiver).
        let sends = done.iter().filter(|c| c.op == OpKind::Send).count();
        let pending_matchable = got.len() < msgs.len();
        if !pending_matchable {
            prop_assert_eq!(sends, msgs.len());
        }
    }
}

fn cfg_small() -> Config {
    Config {
        credits: 4,
        eager_threshold: 256,
        chunk_size: 1024,
        pipeline_threshold: 1024,
        ..Config::default()
    }
}

fn wait_both(wa: &mut W, wb: &mut W, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    for _ in 0..100_000 {
        while let Some(c) = wa.poll() {
            out.push(c);
        }
        while let Some(c) = wb.poll() {
            out.push(c);
        }
        if out.len() >= n {
            break;
        }
    }
    out
}

#[test]
fn truncation_is_reported_and_nothing_is_written_past_the_buffer() {
    for (len, mode) in [
        (100usize, RndvMode::Auto),
        (5000, RndvMode::Copy),
        (5000, RndvMode::RemoteRead),
        (5000, RndvMode::Split),
    ] {
        let cfg = Config { rndv_mode: mode, split_threshold: 1, ..cfg_small() };
        let (mut wa, ea, mut wb, eb) = pair(&cfg, 1 << 16, true);
        let mut inbox = MemoryRegion::new(64).unwrap();
        inbox.write_at(0, &[0xee; 64]).unwrap();
        // Receive into bytes 8..40 only; the rest must stay untouched.
        wb.post_recv(eb, &mut inbox, 8..40, 1, u64::MAX, 9).unwrap();
        let mut out = MemoryRegion::new(len).unwrap();
        out.write_at(0, &vec![0x11; len]).unwrap();
        wa.post_send(ea, &out, 0..len, 1, 3).unwrap();
        let done = wait_both(&mut wa, &mut wb, 2);
        let r = done.iter().find(|c| c.op == OpKind::Recv).unwrap();
        assert_eq!(r.status, Status::Truncated);
        assert_eq!(r.len, len);
        let s = done.iter().find(|c| c.op == OpKind::Send).unwrap();
        if len > 256 {
            assert_eq!(s.status, Status::Truncated, "sender learns of truncation in rendezvous");
        }
        let b = inbox.bytes().unwrap();
        assert!(b[..8].iter().all(|&x| x == 0xee));
        assert!(b[8..40].iter().all(|&x| x == 0x11));
        assert!(b[40..].iter().all(|&x| x == 0xee), "bytes written past the receive buffer");
    }
}

#[test]
fn unexpected_messages_wait_for_their_receive_and_credits_bound_them() {
    let cfg = cfg_small();
    let (mut wa, ea, mut wb, eb) = pair(&cfg, 1 << 20, false);
    let mut regions = Vec::new();
    for i in 0..10u64 {
        let mut mr = MemoryRegion::new(8).unwrap();
        mr.write_at(0, &i.to_le_bytes()).unwrap();
        wa.post_send(ea, &mr, 0..8, 5, i).unwrap();
        regions.push(mr);
    }
    for _ in 0..10 {
        wa.progress();
        wb.progress();
    }
    // Only `credits` messages may be outstanding at a receiver with nothing posted.
    let sa = wa.stats(ea).unwrap();
    assert_eq!(sa.eager_sent, cfg.credits as u64);
    assert_eq!(wb.stats(eb).unwrap().unexpected, cfg.credits as u64);
    let mut inboxes = Vec::new();
    for i in 0..10u64 {
        let mut mr = MemoryRegion::new(8).unwrap();
        wb.post_recv(eb, &mut mr, 0..8, 5, u64::MAX, i).unwrap();
        inboxes.push(mr);
    }
    let done = wait_both(&mut wa, &mut wb, 20);
    assert_eq!(done.len(), 20);
    for (i, mr) in inboxes.iter().enumerate() {
        assert_eq!(mr.bytes().unwrap(), &(i as u64).to_le_bytes());
    }
}

#[test]
fn credits_are_returned_late_and_piggybacked() {
    let cfg = Config { credits: 8, ..Config::default() };
    let (mut wa, ea, mut wb, eb) = pair(&cfg, 1 << 20, false);
    let mut inboxes: Vec<MemoryRegion> = (0..1000).map(|_| MemoryRegion::new(8).unwrap()).collect();
    let mr = MemoryRegion::new(8).unwrap();
    // One-way stream: credits must come back as stand-alone frames, about one per
    // half window, not one per message.
    for (i, inbox) in inboxes.iter_mut().enumerate().take(400) {
        wb.post_recv(eb, inbox, 0..8, 0, 0, i as u64).unwrap();
    }
    for i in 0..400u64 {
        wa.post_send(ea, &mr, 0..8, 0, i).unwrap();
        wb.progress();
        wa.progress();
    }
    wait_both(&mut wa, &mut wb, 800);
    let frames = wb.stats(eb).unwrap().credit_frames_sent;
    assert!((400 / 4 - 2..=400 / 4 + 2).contains(&frames), "credit frames {frames}");
    // Ping-pong: credits ride on data, no stand-alone credit frame is needed.
    let before = (wa.stats(ea).unwrap().credit_frames_sent, wb.stats(eb).unwrap().credit_frames_sent);
    for (i, inbox) in inboxes[400..].iter_mut().enumerate().take(200) {
        if i % 2 == 0 {
            wb.post_recv(eb, inbox, 0..8, 0, 0, 0).unwrap();
            wa.post_send(ea, &mr, 0..8, 0, 0).unwrap();
        } else {
            wa.post_recv(ea, inbox, 0..8, 0, 0, 0).unwrap();
            wb.post_send(eb, &mr, 0..8, 0, 0).unwrap();
        }
        wait_both(&mut wa, &mut wb, 2);
    }
    let after = (wa.stats(ea).unwrap().credit_frames_sent, wb.stats(eb).unwrap().credit_frames_sent);
    assert_eq!(before, after, "ping-pong traffic needed stand-alone credit frames");
}

#[test]
fn peer_gone_fails_outstanding_operations() {
    let (mut wa, ea, wb, _eb) = pair(&cfg_small(), 1 << 16, false);
    let mut inbox = MemoryRegion::new(16).unwrap();
    wa.post_recv(ea, &mut inbox, 0..16, 0, 0, 1).unwrap();
    let big = MemoryRegion::new(4096).unwrap();
    wa.post_send(ea, &big, 0..4096, 0, 2).unwrap();
    drop(wb);
    let mut done = Vec::new();
    while done.len() < 2 {
        match wa.wait(Some(std::time::Duration::from_secs(2))) {
            Ok(c) => done.push(c),
            Err(e) => panic!("no error completion: {e}"),
        }
    }
    assert!(done.iter().all(|c| c.status == Status::PeerGone), "{done:?}");
    assert!(matches!(wa.post_send(ea, &big, 0..1, 0, 0), Err(PostError::Closed { .. })));
    // The regions are free again.
    assert!(inbox.bytes_mut().is_ok());
}

#[test]
fn messages_sent_before_close_are_still_delivered() {
    let (mut wa, ea, mut wb, eb) = pair(&cfg_small(), 1 << 16, false);
    let mut mr = MemoryRegion::new(4).unwrap();
    mr.write_at(0, b"last").unwrap();
    wa.post_send(ea, &mr, 0..4, 0, 0).unwrap();
    wa.close(ea);
    wb.progress();
    let mut inbox = MemoryRegion::new(4).unwrap();
    wb.post_recv(eb, &mut inbox, 0..4, 0, 0, 0).unwrap();
    let c = wb.poll().unwrap();
    assert_eq!(c.status, Status::Ok);
    assert_eq!(inbox.bytes().unwrap(), b"last");
    let mut again = MemoryRegion::new(4).unwrap();
    assert!(matches!(
        wb.post_recv(eb, &mut again, 0..4, 0, 0, 0),
        Err(PostError::Closed { status: Status::PeerGone, .. })
    ));
}

#[test]
fn regions_refuse_access_while_in_flight() {
    let (mut wa, ea, mut wb, eb) = pair(&cfg_small(), 1 << 16, false);
    let mut inbox = MemoryRegion::new(16).unwrap();
    wb.post_recv(eb, &mut inbox, 0..16, 0, 0, 0).unwrap();
    assert!(inbox.bytes().is_err());
    let mut big = MemoryRegion::new(4096).unwrap();
    wa.post_send(ea, &big, 0..4096, 0, 0).unwrap();
    assert!(big.bytes_mut().is_err(), "rendezvous source must stay untouched");
    assert!(big.bytes().is_ok(), "reading a send buffer is fine");
    let done = wait_both(&mut wa, &mut wb, 2);
    assert_eq!(done.len(), 2);
    assert!(big.bytes_mut().is_ok());
}

#[test]
fn bad_ranges_are_rejected_without_side_effects() {
    let (mut wa, ea, _wb, _eb) = pair(&cfg_small(), 1 << 16, false);
    let mr = MemoryRegion::new(16).unwrap();
    assert!(matches!(wa.post_send(ea, &mr, 8..32, 0, 0), Err(PostError::OutOfBounds { .. })));
    assert!(matches!(wa.post_send(EpId(7), &mr, 0..1, 0, 0), Err(PostError::UnknownEndpoint(_))));
    assert!(!wa.has_outstanding());
}

/// Two workers over a loopback pair, each device ringing the other worker's eventfd
/// (so blocking waits sleep and wake as over a real device).
fn waking_pair(cfg: Config) -> (W, EpId, W, EpId) {
    use std::os::fd::AsRawFd;
    let (mut a, mut b) = LoopbackDevice::pair(1 << 16);
    let mut wa = Worker::new(cfg.clone()).unwrap();
    let mut wb = Worker::new(cfg).unwrap();
    a.set_wake_fd(wa.notifier().as_raw_fd());
    b.set_wake_fd(wb.notifier().as_raw_fd());
    let ea = wa.attach(a);
    let eb = wb.attach(b);
    (wa, ea, wb, eb)
}

#[test]
fn blocking_wait_sleeps_and_is_woken_across_threads() {
    let cfg = Config { spin: std::time::Duration::ZERO, ..cfg_small() };
    let (mut wa, ea, mut wb, eb) = waking_pair(cfg);
    let t = std::thread::spawn(move || {
        let mut inbox = MemoryRegion::new(8).unwrap();
        for i in 0..200u64 {
            wb.post_recv(eb, &mut inbox, 0..8, 0, 0, i).unwrap();
            let c = wb.wait(Some(std::time::Duration::from_secs(5))).unwrap();
            assert_eq!(c.status, Status::Ok);
            wb.post_send(eb, &inbox, 0..8, 0, i).unwrap();
            let c = wb.wait(Some(std::time::Duration::from_secs(5))).unwrap();
            assert_eq!(c.op, OpKind::Send);
        }
    });
    let mut mr = MemoryRegion::new(8).unwrap();
    for i in 0..200u64 {
        mr.write_at(0, &i.to_le_bytes()).unwrap();
        wa.post_send(ea, &mr, 0..8, 0, i).unwrap();
        assert_eq!(wa.wait(Some(std::time::Duration::from_secs(5))).unwrap().op, OpKind::Send);
        wa.post_recv(ea, &mut mr, 0..8, 0, 0, i).unwrap();
        let c = wa.wait(Some(std::time::Duration::from_secs(5))).unwrap();
        assert_eq!(c.op, OpKind::Recv);
        assert_eq!(mr.bytes().unwrap(), &i.to_le_bytes());
    }
    t.join().unwrap();
}

/// A waiter whose peer answers only after 3 ms stops spinning (each spin was
/// wasted); once the peer answers at once again, spinning comes back. Counted by the
/// worker's budget, not by timing the waits.
#[test]
fn a_waiter_stops_spinning_for_a_slow_peer_and_resumes_for_a_fast_one() {
    use std::time::Duration;
    let cfg = Config { spin: Duration::from_micros(200), ..cfg_small() };
    assert!(cfg.spin_adaptive);
    let (mut wa, ea, mut wb, eb) = waking_pair(cfg);
    // The peer echoes 30 messages after 3 ms each, then 200 at once.
    let t = std::thread::spawn(move || {
        let mut inbox = MemoryRegion::new(8).unwrap();
        for i in 0..230u64 {
            wb.post_recv(eb, &mut inbox, 0..8, 0, 0, i).unwrap();
            let c = wb.wait(Some(Duration::from_secs(5))).unwrap();
            assert_eq!(c.status, Status::Ok);
            if i < 30 {
                std::thread::sleep(Duration::from_millis(3));
            }
            wb.post_send(eb, &inbox, 0..8, 0, i).unwrap();
            while wb.wait(Some(Duration::from_secs(5))).unwrap().op != OpKind::Send {}
        }
    });
    let mut mr = MemoryRegion::new(8).unwrap();
    let mut budget_after_slow = None;
    let mut crowded_free = true;
    for i in 0..230u64 {
        if i == 30 {
            budget_after_slow = Some(wa.spin_budget());
        }
        wa.post_send(ea, &mr, 0..8, 0, i).unwrap();
        wa.post_recv(ea, &mut mr, 0..8, 0, 0, i).unwrap();
        let mut got = 0;
        while got < 2 {
            assert_eq!(wa.wait(Some(Duration::from_secs(5))).unwrap().status, Status::Ok);
            got += 1;
        }
        crowded_free &= strait_core::spin::sample_load().is_none_or(|l| l.runnable <= l.cores);
    }
    t.join().unwrap();
    assert_eq!(budget_after_slow, Some(Duration::ZERO), "still spinning for a peer that answers in 3 ms");
    // Unless the machine was crowded meanwhile (then the budget is zero for that).
    if crowded_free {
        assert_eq!(
            wa.spin_budget(),
            Duration::from_micros(200),
            "spinning did not come back for a fast peer"
        );
    }
}

/// A peer that ignores credits and sends unmatched messages without end is stopped
/// (the endpoint fails `Corrupt`) instead of growing the unexpected queue without
/// bound.
#[test]
fn a_peer_ignoring_credits_cannot_grow_the_unexpected_queue_without_bound() {
    use strait_core::Device;
    use strait_wire::{Header, MAX_HEADER_LEN};
    let (mut raw, b) = LoopbackDevice::pair(64);
    let mut w: W = Worker::new(Config::default()).unwrap();
    let ep = w.attach(b);
    let mut inbox = MemoryRegion::new(8).unwrap();
    // A receive for a tag the flood never uses: it sees the failure.
    w.post_recv(ep, &mut inbox, 0..8, 7, u64::MAX, 1).unwrap();
    let mut seq = 0u32;
    while w.endpoint_error(ep).is_none() {
        assert!(seq <= 70_000, "{seq} unmatched messages were queued");
        let mut hb = [0u8; MAX_HEADER_LEN];
        let hlen = Header::Eager { credits: 0, seq, tag: 1 }.encode(&mut hb);
        if raw.send_frame(hlen, &mut |f| f.write(0, &hb[..hlen])).unwrap() {
            seq += 1;
        } else {
            w.progress();
        }
    }
    let (status, why) = w.endpoint_error(ep).unwrap();
    assert_eq!(status, Status::Corrupt);
    assert!(why.unwrap().contains("unmatched messages"));
    assert_eq!(w.poll().map(|c| (c.ctx, c.status)), Some((1, Status::Corrupt)));
}

/// A raw peer's frame: `h` encoded, no payload.
fn send_raw(raw: &mut LoopbackDevice, h: strait_wire::Header) {
    use strait_core::Device;
    let mut hb = [0u8; strait_wire::MAX_HEADER_LEN];
    let hlen = h.encode(&mut hb);
    assert!(raw.send_frame(hlen, &mut |f| f.write(0, &hb[..hlen])).unwrap(), "no room for a raw frame");
}

/// The next frame a raw peer got, decoded.
fn recv_raw(raw: &mut LoopbackDevice, w: &mut W) -> strait_wire::Header {
    use strait_core::Device;
    for _ in 0..10_000 {
        let mut got = None;
        raw.recv_frame(&mut |f| {
            let mut hb = [0u8; strait_wire::MAX_HEADER_LEN];
            let n = f.len().min(hb.len());
            assert!(f.read(0, &mut hb[..n]));
            got = Some(strait_wire::decode(&hb[..n]).unwrap().0);
        })
        .unwrap();
        if let Some(h) = got {
            return h;
        }
        w.progress();
    }
    panic!("the worker sent nothing");
}

/// One split transfer of `len` bytes from a to b; returns (a's and b's stats, the
/// receive's completion). `refuse`: a's device cannot write into b.
fn split_once(
    len: usize,
    refuse: bool,
) -> (strait_core::EndpointStats, strait_core::EndpointStats, Completion) {
    let cfg = Config { rndv_mode: RndvMode::Split, split_threshold: 4096, ..cfg_small() };
    let (mut a, b) = LoopbackDevice::pair_with(1 << 16, true);
    if refuse {
        a.refuse_remote_writes();
    }
    let mut wa: W = Worker::new(cfg.clone()).unwrap();
    let mut wb: W = Worker::new(cfg).unwrap();
    let (ea, eb) = (wa.attach(a), wb.attach(b));
    let want = pattern(5, 0, len);
    let mut inbox = MemoryRegion::new(len).unwrap();
    let mut out = MemoryRegion::new(len).unwrap();
    out.write_at(0, &want).unwrap();
    for round in 0..2u64 {
        inbox.write_at(0, &vec![0u8; len]).unwrap();
        wb.post_recv(eb, &mut inbox, 0..len, 5, u64::MAX, round).unwrap();
        wa.post_send(ea, &out, 0..len, 5, round).unwrap();
        let done = wait_both(&mut wa, &mut wb, 2);
        assert!(done.iter().all(|c| c.status == Status::Ok), "{done:?}");
        assert!(inbox.bytes().unwrap() == &want[..], "round {round}: bytes differ");
    }
    wb.post_recv(eb, &mut inbox, 0..len, 5, u64::MAX, 9).unwrap();
    wa.post_send(ea, &out, 0..len, 5, 9).unwrap();
    let done = wait_both(&mut wa, &mut wb, 2);
    let r = *done.iter().find(|c| c.op == OpKind::Recv).unwrap();
    (wa.stats(ea).unwrap(), wb.stats(eb).unwrap(), r)
}

/// A split transfer: the receiver reads the first half, the sender writes the
/// second into the receiver's buffer; every byte arrives, and the counters show
/// that both sides copied.
#[test]
fn a_split_transfer_has_both_sides_copy_and_every_byte_arrives() {
    let (sa, sb, r) = split_once(1 << 20, false);
    assert_eq!((r.status, r.len), (Status::Ok, 1 << 20));
    assert_eq!(sb.rndv_split, 3, "every transfer was split");
    assert_eq!(sa.device.remote_writes, 3, "the sender wrote its part each time");
    assert_eq!(sb.device.remote_reads, 3, "the receiver read its part each time");
    // Below the threshold the receiver reads the whole message itself.
    let (sa, sb, _) = split_once(4095, false);
    assert_eq!((sb.rndv_split, sa.device.remote_writes, sb.device.remote_reads), (0, 0, 3));
}

/// A sender that cannot write into the receiver answers its PUT failed: the
/// receiver reads that part itself (nothing lost, the message completes `Ok`) and
/// asks this peer for no more splits.
#[test]
fn a_sender_that_cannot_write_leaves_the_rest_to_the_receiver() {
    let (sa, sb, r) = split_once(1 << 18, true);
    assert_eq!(r.status, Status::Ok);
    assert_eq!(sb.rndv_split, 1, "splits went on after a refused PUT");
    assert_eq!(sa.device.remote_writes, 0);
    // First message: its own part, then the rest; then two whole reads.
    assert_eq!(sb.device.remote_reads, 4);
}

/// A receiver's PUT is the peer's word: a range outside the message (which would
/// carry other memory of the sender to the peer), a second PUT for one transfer, or
/// a PUT-DONE nobody asked for ends the endpoint `Corrupt`; nothing is written.
#[test]
fn a_put_outside_the_message_or_out_of_turn_is_refused() {
    use strait_wire::Header;
    type Bad = fn(u32) -> Vec<Header>;
    let cases: [(Bad, &str); 4] = [
        (|id| vec![Header::Put { credits: 0, msg_id: id, offset: 60_000, len: 8192, addr: 8 }], "PUT"),
        (|id| vec![Header::Put { credits: 0, msg_id: id, offset: 0, len: 0, addr: 8 }], "PUT"),
        (
            |id| vec![Header::Put { credits: 0, msg_id: id.wrapping_add(1), offset: 0, len: 8, addr: 8 }],
            "PUT",
        ),
        (|id| vec![Header::PutDone { credits: 0, msg_id: id, status: 0 }], "PUT-DONE"),
    ];
    for (frames, what) in cases {
        let cfg = Config { rndv_mode: RndvMode::Split, split_threshold: 1, ..cfg_small() };
        let (mut raw, a) = LoopbackDevice::pair_with(1 << 16, true);
        let mut wa: W = Worker::new(cfg).unwrap();
        let ea = wa.attach(a);
        let out = MemoryRegion::new(65_536).unwrap();
        wa.post_send(ea, &out, 0..65_536, 1, 1).unwrap();
        let Header::Rts { msg_id, .. } = recv_raw(&mut raw, &mut wa) else { panic!("no RTS") };
        for h in frames(msg_id) {
            send_raw(&mut raw, h);
        }
        for _ in 0..100 {
            wa.progress();
        }
        let (status, why) = wa.endpoint_error(ea).expect("the endpoint went on");
        assert_eq!(status, Status::Corrupt);
        assert!(why.as_deref().unwrap_or("").contains(what), "{why:?}");
        assert_eq!(wa.stats(ea).unwrap().device.remote_writes, 0, "a write was made");
        assert_eq!(wa.poll().map(|c| (c.op, c.status)), Some((OpKind::Send, Status::Corrupt)));
    }
}

/// A receiver closed while its sender may still be writing its part of a split
/// transfer: the receive ends `Canceled`, but the buffer stays held (the region
/// refuses access) rather than being handed back under the peer's write.
#[test]
fn a_close_during_a_split_keeps_the_buffer_from_the_peers_write() {
    use strait_wire::Header;
    let cfg = Config { rndv_mode: RndvMode::Split, split_threshold: 1, ..cfg_small() };
    let (mut raw, b) = LoopbackDevice::pair_with(1 << 16, true);
    let mut wb: W = Worker::new(cfg).unwrap();
    let eb = wb.attach(b);
    let source = vec![7u8; 65_536];
    let mut inbox = MemoryRegion::new(65_536).unwrap();
    wb.post_recv(eb, &mut inbox, 0..65_536, 1, u64::MAX, 4).unwrap();
    send_raw(
        &mut raw,
        Header::Rts { credits: 0, seq: 0, tag: 1, len: 65_536, msg_id: 3, addr: source.as_ptr() as u64 },
    );
    let Header::Put { msg_id: 3, offset, len, .. } = recv_raw(&mut raw, &mut wb) else { panic!("no PUT") };
    assert_eq!((offset, len), (32_768, 32_768));
    // The peer never answers; the receiver closes.
    wb.close(eb);
    let c = wb.poll().expect("no completion");
    assert_eq!((c.op, c.ctx, c.status), (OpKind::Recv, 4, Status::Canceled));
    assert!(inbox.bytes().is_err(), "the buffer was handed back while the peer may write into it");
}
