//! Turns the stage-probe logs of the two ends of a ping-pong into per-stage times.
//!
//! Both ends run on one machine whose time-stamp counter is invariant and shared by
//! all cores, so stamps of the two ends are on one time line. A message's one-way
//! path is a chain of *milestones*, each a probe on the sending (S) or receiving (R)
//! end; a stage is the interval between two consecutive milestones, and the chain
//! of one direction runs from the sender's `post_send` to the receiver's next
//! `post_send` (its reply), so that the stages of the two directions of one round
//! trip add up to the whole round trip, with no gap and no overlap:
//!
//! | # | from → to | stage | layer |
//! |---|---|---|---|
//! | 1 | S `SendPost` → S `TxMsg` | API post + engine send | protocol send |
//! | 2 | S `TxMsg` → S `DevFilled` | device send: ring reserve + copy in | copy |
//! | 3 | S `DevFilled` → R `RxFound` | ring transfer + peer poll | device/wire |
//! | 4 | R `RxFound` → R `RxMatch` | decode + tag match | protocol receive |
//! | 5r | R `RxMatch` → R `DevFilled` | rendezvous: CTS reply | protocol receive |
//! | 6r | R `DevFilled` → S `RxFound` | rendezvous: CTS transfer + poll | device/wire |
//! | 7r | S `RxFound` → R `RxLastData` | rendezvous: data movement (pipelined) | copy |
//! | 8 | R `RxMatch`/`RxLastData` → R `CopyDone` | copy into the user buffer | copy |
//! | 9 | R `CopyDone` → R `CqPushRecv` | completion queued | protocol receive |
//! | 10 | R `CqPushRecv` → R `PollRecv` | poll returns the completion | protocol receive |
//! | 11 | R `PollRecv` → R `SendPost` | application turnaround (incl. next post_recv) | user |
//!
//! Stages 5r-7r exist only for rendezvous messages (above the eager threshold). The
//! doorbell (S `DoorbellBegin` → `DoorbellEnd`, after the frame is committed) runs
//! while the frame travels, so it is reported beside the chain, not in its sum.
//!
//! Each interval contains the cost of one probe (the end of the first stamp and the
//! start of the second) plus that of every other probe the same end took inside
//! it; [`OneWay`] records how many, and [`summarize`] subtracts them.

use strait_probe::{Stage, Stamp};

/// One stage of the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageDef {
    /// Short name, as in reports.
    pub name: &'static str,
    /// The category it belongs to: `user`, `protocol send`, `protocol receive`,
    /// `OS overhead`, `copy`, `device/wire`.
    pub layer: &'static str,
}

/// Every stage strait's shm path can have, in path order (indices are used below).
pub const STAGES: [StageDef; 11] = [
    StageDef { name: "API post + engine send", layer: "protocol send" },
    StageDef { name: "device send (ring reserve + copy in)", layer: "copy" },
    StageDef { name: "ring transfer + peer poll", layer: "device/wire" },
    StageDef { name: "decode + tag match", layer: "protocol receive" },
    StageDef { name: "rndv: CTS reply", layer: "protocol receive" },
    StageDef { name: "rndv: CTS transfer + poll", layer: "device/wire" },
    StageDef { name: "rndv: data movement (pipelined)", layer: "copy" },
    StageDef { name: "copy into user buffer", layer: "copy" },
    StageDef { name: "completion queued", layer: "protocol receive" },
    StageDef { name: "poll returns completion", layer: "protocol receive" },
    StageDef { name: "application turnaround", layer: "user" },
];

/// The doorbell, measured beside the chain (it overlaps the frame's transfer).
pub const DOORBELL: StageDef = StageDef { name: "doorbell (overlaps transfer)", layer: "device/wire" };

/// Which end of the ping-pong a probe log belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The end that starts each round trip (ping).
    A,
    /// The end that answers (pong).
    B,
}

/// One message's path from one end to the other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OneWay {
    /// The sending end.
    pub from: End,
    /// `(index into STAGES, ticks, probes inside the interval)` in path order.
    pub stages: Vec<(usize, u64, u32)>,
    /// Ticks of the sender's doorbell after the commit, if seen.
    pub doorbell: Option<u64>,
    /// True for a rendezvous message.
    pub rendezvous: bool,
}

impl OneWay {
    /// Raw ticks from the first milestone to the last.
    pub fn total_ticks(&self) -> u64 {
        self.stages.iter().map(|s| s.1).sum()
    }
}

/// A cursor over one end's log.
struct Cursor<'a> {
    log: &'a [Stamp],
    /// Index of the next stamp not yet consumed.
    next: usize,
}

impl Cursor<'_> {
    /// First stamp of `stage` at or after tick `t`; consumes it and what precedes it.
    fn find(&mut self, stage: Stage, t: u64) -> Option<(usize, u64)> {
        let i = self.log[self.next..].iter().position(|s| s.stage == stage && s.tsc >= t)? + self.next;
        self.next = i + 1;
        Some((i, self.log[i].tsc))
    }

    /// The stage of the next stamp after index `i`, if any.
    fn after(&self, i: usize) -> Option<Stage> {
        self.log.get(i + 1).map(|s| s.stage)
    }
}

/// Where the walk stands: the last milestone's end, log index and time.
#[derive(Clone, Copy)]
struct At {
    end: End,
    idx: usize,
    t: u64,
}

struct Walk<'a> {
    a: Cursor<'a>,
    b: Cursor<'a>,
}

impl<'a> Walk<'a> {
    fn cur(&mut self, e: End) -> &mut Cursor<'a> {
        match e {
            End::A => &mut self.a,
            End::B => &mut self.b,
        }
    }

    /// Steps to the next milestone `stage` on end `e`, recording stage `k` in `out`.
    fn step(&mut self, at: &mut At, e: End, stage: Stage, k: usize, out: &mut OneWay) -> Option<()> {
        let (idx, t) = self.cur(e).find(stage, at.t)?;
        // Probes the same end took strictly between the two milestones add their cost.
        let inner = if e == at.end { (idx - at.idx - 1) as u32 } else { 0 };
        out.stages.push((k, t - at.t, inner));
        *at = At { end: e, idx, t };
        Some(())
    }

    /// One direction, from the sender's `SendPost` at `at`; leaves `at` at the
    /// receiver's reply `SendPost`.
    fn one_way(&mut self, at: &mut At) -> Option<OneWay> {
        let s = at.end;
        let r = if s == End::A { End::B } else { End::A };
        let mut w = OneWay { from: s, stages: Vec::with_capacity(11), doorbell: None, rendezvous: false };
        self.step(at, s, Stage::TxMsg, 0, &mut w)?;
        self.step(at, s, Stage::DevFilled, 1, &mut w)?;
        // The doorbell that follows the commit, read without consuming the sender's
        // log (its next milestones may come before it ends).
        let filled = *at;
        let log = self.cur(s).log;
        if let Some(b) = log[filled.idx + 1..].iter().position(|x| x.stage == Stage::DoorbellBegin) {
            let bi = filled.idx + 1 + b;
            if let Some(e) = log[bi + 1..].iter().find(|x| x.stage == Stage::DoorbellEnd) {
                w.doorbell = Some(e.tsc - log[bi].tsc);
            }
        }
        self.step(at, r, Stage::RxFound, 2, &mut w)?;
        self.step(at, r, Stage::RxMatch, 3, &mut w)?;
        if self.cur(r).after(at.idx) == Some(Stage::CopyDone) {
            self.step(at, r, Stage::CopyDone, 7, &mut w)?;
        } else {
            w.rendezvous = true;
            self.step(at, r, Stage::DevFilled, 4, &mut w)?;
            self.step(at, s, Stage::RxFound, 5, &mut w)?;
            self.step(at, r, Stage::RxLastData, 6, &mut w)?;
            self.step(at, r, Stage::CopyDone, 7, &mut w)?;
        }
        self.step(at, r, Stage::CqPushRecv, 8, &mut w)?;
        self.step(at, r, Stage::PollRecv, 9, &mut w)?;
        self.step(at, r, Stage::SendPost, 10, &mut w)?;
        Some(w)
    }
}

/// Walks the logs of end A (the pinging end) and end B from A's first `post_send`,
/// direction after direction. Where a milestone is missing (a dropped stamp, or
/// the end of the batch), the walk resumes at A's next `post_send`: the direction
/// in progress is left out, every complete one is kept.
pub fn walk(a: &[Stamp], b: &[Stamp]) -> Vec<OneWay> {
    let mut w = Walk { a: Cursor { log: a, next: 0 }, b: Cursor { log: b, next: 0 } };
    let mut out = Vec::new();
    let mut from = 0;
    loop {
        w.a.next = from;
        let Some((idx, t)) = w.a.find(Stage::SendPost, 0) else { return out };
        w.b.next = b.partition_point(|s| s.tsc < t);
        let mut at = At { end: End::A, idx, t };
        while let Some(ow) = w.one_way(&mut at) {
            out.push(ow);
        }
        from = idx
            + 1
            + a[idx + 1..].iter().position(|s| s.stage == Stage::SendPost && s.tsc > at.t).unwrap_or(a.len());
        if from >= a.len() {
            return out;
        }
    }
}

/// Which end of one direction a milestone is taken on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The end that sends this message.
    Sender,
    /// The end that receives it (and sends the reply).
    Receiver,
}

/// The stages of `strait run`'s TCP path (the interposer over the byte rings), one
/// direction, in path order: the interval between milestones `k` and `k + 1` of
/// [`RUN_CHAIN`] is stage `k`.
///
/// | # | from → to | stage | layer |
/// |---|---|---|---|
/// | 0 | S application calls `write` → S interposer entered | interposer entry | OS overhead |
/// | 1 | → S connection found | descriptor look-up | protocol send |
/// | 2 | → S tail published | ring copy in + publish | copy |
/// | 3 | → R bytes found | ring transfer + reader's spin or wake-up | device/wire |
/// | 4 | → R bytes copied out, space handed back | ring copy out + consume | copy |
/// | 5 | → R interposer returns from `read` | read return (writer wake check) | protocol receive |
/// | 6 | → R application has the bytes | interposer exit | OS overhead |
/// | 7 | → R application calls `write` (the reply) | application turnaround | user |
///
/// The doorbell (an eventfd write, only when the reader announced that it sleeps)
/// follows the publication inside stage 3, so it is reported beside the chain.
pub const RUN_STAGES: [StageDef; 8] = [
    StageDef { name: "interposer entry", layer: "OS overhead" },
    StageDef { name: "descriptor look-up", layer: "protocol send" },
    StageDef { name: "ring copy in + publish", layer: "copy" },
    StageDef { name: "ring transfer + reader's spin or wake-up", layer: "device/wire" },
    StageDef { name: "ring copy out + consume", layer: "copy" },
    StageDef { name: "read return (writer wake check)", layer: "protocol receive" },
    StageDef { name: "interposer exit", layer: "OS overhead" },
    StageDef { name: "application turnaround", layer: "user" },
];

/// The milestones of [`RUN_STAGES`]' chain: the last is the first of the reply's.
pub const RUN_CHAIN: [(Side, Stage); 9] = [
    (Side::Sender, Stage::AppSend),
    (Side::Sender, Stage::WriteEnter),
    (Side::Sender, Stage::WriteLookup),
    (Side::Sender, Stage::RingPublished),
    (Side::Receiver, Stage::RingFound),
    (Side::Receiver, Stage::RingConsumed),
    (Side::Receiver, Stage::ReadReturn),
    (Side::Receiver, Stage::AppRecvd),
    (Side::Receiver, Stage::AppSend),
];

impl Walk<'_> {
    /// One direction of `chain` from the sender's first milestone at `at`; leaves `at`
    /// at the receiver's last milestone (the reply's first). The doorbell is looked
    /// for after milestone `doorbell_after`, up to the sender's next milestone of
    /// the chain or next bytes found (its own read).
    fn one_way_chain(
        &mut self,
        at: &mut At,
        chain: &[(Side, Stage)],
        doorbell_after: usize,
    ) -> Option<OneWay> {
        let s = at.end;
        let r = if s == End::A { End::B } else { End::A };
        let mut w =
            OneWay { from: s, stages: Vec::with_capacity(chain.len()), doorbell: None, rendezvous: false };
        for (k, &(side, stage)) in chain.iter().enumerate().skip(1) {
            let e = if side == Side::Sender { s } else { r };
            self.step(at, e, stage, k - 1, &mut w)?;
            if k == doorbell_after && e == s {
                let log = self.cur(s).log;
                let stop = |x: &Stamp| x.stage == Stage::RingFound || chain.iter().any(|m| m.1 == x.stage);
                let after = &log[at.idx + 1..];
                let end = after.iter().position(stop).unwrap_or(after.len());
                if let Some(b) = after[..end].iter().position(|x| x.stage == Stage::DoorbellBegin) {
                    if let Some(e) = after[b + 1..end].iter().find(|x| x.stage == Stage::DoorbellEnd) {
                        w.doorbell = Some(e.tsc - after[b].tsc);
                    }
                }
            }
        }
        Some(w)
    }
}

/// Walks the logs of end A (the pinging end) and end B along `chain` (such as
/// [`RUN_CHAIN`]), direction after direction, from A's first milestone; `doorbell_after`
/// is the index of the milestone after which the sender's doorbell stamps are looked
/// for. Where a milestone is missing the walk resumes at A's next first milestone,
/// as [`walk`] does.
pub fn walk_chain(a: &[Stamp], b: &[Stamp], chain: &[(Side, Stage)], doorbell_after: usize) -> Vec<OneWay> {
    let mut out = Vec::new();
    let Some(&(_, first)) = chain.first() else { return out };
    let mut w = Walk { a: Cursor { log: a, next: 0 }, b: Cursor { log: b, next: 0 } };
    let mut from = 0;
    loop {
        w.a.next = from;
        let Some((idx, t)) = w.a.find(first, 0) else { return out };
        w.b.next = b.partition_point(|s| s.tsc < t);
        let mut at = At { end: End::A, idx, t };
        while let Some(ow) = w.one_way_chain(&mut at, chain, doorbell_after) {
            out.push(ow);
        }
        from =
            idx + 1 + a[idx + 1..].iter().position(|s| s.stage == first && s.tsc > at.t).unwrap_or(a.len());
        if from >= a.len() {
            return out;
        }
    }
}

/// Per-stage statistics over many one-way paths, in nanoseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct StageStats {
    /// Index into [`STAGES`], or `None` for the doorbell.
    pub stage: Option<usize>,
    /// Mean over the kept paths (see [`summarize`]), probe cost subtracted.
    pub mean_ns: f64,
    /// Median over all paths, probe cost subtracted.
    pub p50_ns: f64,
    /// 99th percentile over all paths, probe cost subtracted.
    pub p99_ns: f64,
    /// Probes subtracted per path on average.
    pub probes: f64,
}

/// The summary of one size.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Chain stages present, in path order.
    pub stages: Vec<StageStats>,
    /// The doorbell, beside the chain.
    pub doorbell: Option<StageStats>,
    /// Mean one-way time over kept paths with probe costs subtracted (= the sum of
    /// the stages' means).
    pub corrected_ns: f64,
    /// Same, without subtracting probe costs.
    pub raw_ns: f64,
    /// Median of the corrected one-way times.
    pub p50_ns: f64,
    /// Probe cost subtracted per one-way path, ns.
    pub probe_ns: f64,
    /// Paths used / paths walked.
    pub kept: usize,
    /// Paths walked.
    pub paths: usize,
}

/// Fraction of one-way paths kept for the means: the fastest half. Interference
/// (preemption, another program's burst on a 2-core machine) only ever slows a path
/// down, so the fast half is the undisturbed path; the same cut is applied to the
/// unprobed round trips the stage sum is checked against.
pub const KEEP: f64 = 0.5;

/// Summarises paths: ticks become ns with `ticks_per_ns`, and `probe_ticks` is
/// subtracted once per interval plus once per probe inside it. Means use the paths
/// whose corrected total is among the fastest [`KEEP`] (so the stage means add up
/// exactly to the mean one-way time of the same paths); percentiles use all.
pub fn summarize(paths: &[OneWay], ticks_per_ns: f64, probe_ticks: f64) -> Option<Summary> {
    if paths.is_empty() || ticks_per_ns <= 0.0 {
        return None;
    }
    let corr = |ticks: u64, inner: u32| -> f64 {
        ((ticks as f64 - probe_ticks * (1 + inner) as f64) / ticks_per_ns).max(0.0)
    };
    let totals: Vec<f64> = paths.iter().map(|p| p.stages.iter().map(|&(_, t, n)| corr(t, n)).sum()).collect();
    let mut sorted = totals.clone();
    sorted.sort_unstable_by(f64::total_cmp);
    let cut = crate::stats::percentile_sorted(&sorted, KEEP * 100.0).unwrap_or(f64::INFINITY);
    let kept: Vec<&OneWay> = paths.iter().zip(&totals).filter(|(_, t)| **t <= cut).map(|(p, _)| p).collect();
    let nk = kept.len().max(1) as f64;
    let mut stages = Vec::new();
    let n_stages = paths.iter().flat_map(|p| p.stages.iter().map(|s| s.0 + 1)).max().unwrap_or(0);
    for k in 0..n_stages {
        let mut all: Vec<f64> = paths
            .iter()
            .flat_map(|p| p.stages.iter().filter(|s| s.0 == k).map(|&(_, t, n)| corr(t, n)))
            .collect();
        if all.is_empty() {
            continue;
        }
        let kept_vals: Vec<(f64, u32)> = kept
            .iter()
            .flat_map(|p| p.stages.iter().filter(|s| s.0 == k).map(|&(_, t, n)| (corr(t, n), n)))
            .collect();
        let mean_ns = kept_vals.iter().map(|v| v.0).sum::<f64>() / nk;
        let probes = kept_vals.iter().map(|v| (1 + v.1) as f64).sum::<f64>() / nk;
        let s = crate::stats::summarize(&mut all)?;
        stages.push(StageStats { stage: Some(k), mean_ns, p50_ns: s.p50, p99_ns: s.p99, probes });
    }
    let mut db: Vec<f64> = paths
        .iter()
        .filter_map(|p| p.doorbell)
        .map(|t| (t as f64 - probe_ticks).max(0.0) / ticks_per_ns)
        .collect();
    let doorbell = crate::stats::summarize(&mut db).map(|s| StageStats {
        stage: None,
        mean_ns: s.mean,
        p50_ns: s.p50,
        p99_ns: s.p99,
        probes: 1.0,
    });
    let corrected_ns = stages.iter().map(|s| s.mean_ns).sum();
    let raw_ns = kept.iter().map(|p| p.total_ticks() as f64 / ticks_per_ns).sum::<f64>() / nk;
    let probe_ns = stages.iter().map(|s| s.probes).sum::<f64>() * probe_ticks / ticks_per_ns;
    Some(Summary {
        stages,
        doorbell,
        corrected_ns,
        raw_ns,
        p50_ns: crate::stats::percentile_sorted(&sorted, 50.0).unwrap_or(f64::NAN),
        probe_ns,
        kept: kept.len(),
        paths: paths.len(),
    })
}

/// Probes on the path of one direction, on average: one per interval plus those
/// inside intervals.
pub fn probes_per_path(paths: &[OneWay]) -> f64 {
    if paths.is_empty() {
        return 0.0;
    }
    let n: u64 = paths.iter().flat_map(|p| p.stages.iter().map(|s| 1 + u64::from(s.2))).sum();
    n as f64 / paths.len() as f64
}

/// The mean of the fastest [`KEEP`] of `samples` (ns): the same statistic the stage
/// sum uses, for the independent measurement it is checked against.
pub fn kept_mean(samples: &[f64]) -> Option<f64> {
    let mut s = samples.to_vec();
    s.sort_unstable_by(f64::total_cmp);
    let cut = crate::stats::percentile_sorted(&s, KEEP * 100.0)?;
    let kept: Vec<f64> = s.into_iter().filter(|v| *v <= cut).collect();
    Some(kept.iter().sum::<f64>() / kept.len().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(tsc: u64, stage: Stage) -> Stamp {
        Stamp { tsc, stage }
    }

    /// One eager round trip A→B→A and the start of the next, with stray stamps.
    fn eager_logs(t0: u64) -> (Vec<Stamp>, Vec<Stamp>) {
        use Stage::*;
        let a = vec![
            st(t0, RecvPost),
            st(t0 + 10, SendPost),
            st(t0 + 20, TxMsg),
            st(t0 + 30, DevFilled),
            st(t0 + 35, DoorbellBegin),
            st(t0 + 38, DoorbellEnd),
            // B→A arrives.
            st(t0 + 200, RxFound),
            st(t0 + 210, RxMatch),
            st(t0 + 220, CopyDone),
            st(t0 + 225, CqPushRecv),
            st(t0 + 226, DoorbellBegin),
            st(t0 + 227, DoorbellEnd),
            st(t0 + 230, PollRecv),
            st(t0 + 240, RecvPost),
            st(t0 + 250, SendPost),
        ];
        let b = vec![
            st(t0 + 50, RxFound),
            st(t0 + 60, RxMatch),
            st(t0 + 70, CopyDone),
            st(t0 + 75, CqPushRecv),
            st(t0 + 80, PollRecv),
            st(t0 + 90, RecvPost),
            st(t0 + 100, SendPost),
            st(t0 + 110, TxMsg),
            st(t0 + 120, DevFilled),
        ];
        (a, b)
    }

    #[test]
    fn eager_round_trip_telescopes() {
        let (a, b) = eager_logs(1000);
        let p = walk(&a, &b);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p.iter().all(|w| !w.rendezvous));
        // A's SendPost at 1010 to B's SendPost at 1100, then on to A's next at 1250.
        assert_eq!(p[0].total_ticks(), 90);
        assert_eq!(p[1].total_ticks(), 150);
        let ks: Vec<usize> = p[0].stages.iter().map(|s| s.0).collect();
        assert_eq!(ks, vec![0, 1, 2, 3, 7, 8, 9, 10]);
        assert_eq!(p[0].doorbell, Some(3));
        // B→A: the poll interval holds A's two doorbell probes, the turnaround the
        // RecvPost probe.
        let inner: Vec<u32> = p[1].stages.iter().map(|s| s.2).collect();
        assert_eq!(inner, vec![0, 0, 0, 0, 0, 0, 2, 1]);
    }

    /// One `strait run` round trip A→B→A (B's reader slept: A rang the doorbell),
    /// then A's next write, with A's own read stamps between.
    #[test]
    fn run_chain_telescopes_and_finds_the_doorbell() {
        use Stage::*;
        let a = vec![
            st(100, AppSend),
            st(105, WriteEnter),
            st(110, WriteLookup),
            st(130, RingPublished),
            st(131, DoorbellBegin),
            st(140, DoorbellEnd),
            // A's own read of the reply: its bytes found, consumed, returned.
            st(400, RingFound),
            st(410, RingConsumed),
            st(412, ReadReturn),
            st(415, AppRecvd),
            st(420, AppSend),
            st(425, WriteEnter),
        ];
        let b = vec![
            st(90, ReadReturn), // a read of the batch before
            st(200, RingFound),
            st(210, RingConsumed),
            st(214, ReadReturn),
            st(218, AppRecvd),
            st(230, AppSend),
            st(235, WriteEnter),
            st(240, WriteLookup),
            st(260, RingPublished),
        ];
        let p = walk_chain(&a, &b, &RUN_CHAIN, 3);
        assert_eq!(p.len(), 2, "{p:?}");
        assert_eq!(p[0].total_ticks(), 130, "A's write to B's reply");
        assert_eq!(p[1].total_ticks(), 190, "B's reply to A's next write");
        let ks: Vec<usize> = p[0].stages.iter().map(|s| s.0).collect();
        assert_eq!(ks, (0..8).collect::<Vec<_>>());
        assert_eq!(p[0].stages[3].1, 70, "publish to found");
        assert_eq!(p[0].doorbell, Some(9));
        assert_eq!(p[0].stages[3].2, 0, "cross-end interval: no inner probe counted");
        assert_eq!(p[1].doorbell, None, "B's reader did not sleep");
        let s = summarize(&p, 1.0, 0.0).expect("summary");
        assert_eq!(s.stages.len(), 8);
        assert!((s.corrected_ns - s.raw_ns).abs() < 1e-9);
    }

    #[test]
    fn rendezvous_chain_is_recognised() {
        use Stage::*;
        let a = vec![
            st(10, SendPost),
            st(20, TxMsg),
            st(30, DevFilled),
            st(200, RxFound), // CTS
            st(210, DevFilled),
            st(300, DevFilled),
        ];
        let b = vec![
            st(50, RxFound),
            st(60, RxMatch),
            st(100, DevFilled), // CTS
            st(250, RxFound),
            st(260, RxFound),
            st(400, RxLastData),
            st(500, CopyDone),
            st(510, CqPushRecv),
            st(520, PollRecv),
            st(530, SendPost),
        ];
        let p = walk(&a, &b);
        assert_eq!(p.len(), 1);
        assert!(p[0].rendezvous);
        let ks: Vec<usize> = p[0].stages.iter().map(|s| s.0).collect();
        assert_eq!(ks, vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(p[0].total_ticks(), 520);
    }

    #[test]
    fn summary_subtracts_probes_and_adds_up() {
        let (a, b) = eager_logs(1000);
        let p = walk(&a, &b);
        let s = summarize(&p, 2.0, 1.0).expect("summary");
        let sum: f64 = s.stages.iter().map(|x| x.mean_ns).sum();
        assert!((sum - s.corrected_ns).abs() < 1e-9);
        assert!(s.corrected_ns < s.raw_ns);
        // The fastest half of two paths is one (the 90 ticks one): 8 intervals and
        // one inner probe -> 9 probes of 1 tick at 2 ticks/ns.
        assert_eq!(s.kept, 1);
        assert!((s.raw_ns - 45.0).abs() < 1e-9);
        assert!((s.corrected_ns - 40.5).abs() < 1e-9);
        assert!(s.doorbell.is_some());
    }

    #[test]
    fn missing_milestone_skips_one_round_trip() {
        let (a, mut b) = eager_logs(0);
        b.retain(|s| s.stage != Stage::CopyDone);
        assert!(walk(&a, &b).is_empty());
        assert!(walk(&[], &[]).is_empty());
        // Three round trips; the middle one lost a stamp on B.
        let mut a = Vec::new();
        let mut b = Vec::new();
        for k in 0..3u64 {
            let (x, mut y) = eager_logs(1000 + 240 * k);
            // Only the last round trip's final SendPost exists once.
            a.extend(
                x.into_iter().filter(|s| !(s.stage == Stage::SendPost && s.tsc == 1000 + 240 * k + 250)),
            );
            if k == 1 {
                y.retain(|s| s.stage != Stage::RxMatch);
            }
            b.extend(y);
        }
        a.push(st(1000 + 240 * 3 + 10, Stage::SendPost));
        let p = walk(&a, &b);
        assert_eq!(p.len(), 4, "first and last round trips kept: {p:?}");
    }
}
