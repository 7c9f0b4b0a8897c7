//! The native messaging API between two real processes over the shm device: every
//! size class, both rendezvous modes, polling and blocking waits, and the faults a
//! peer can cause (death mid-rendezvous, malformed frames).
//!
//! The test binary re-executes itself as the peer: `STRAIT_TEST_ROLE` selects the
//! child's role in the `child` test, which does nothing in a normal run.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use strait_core::{Completion, Config, Device, EpId, MemoryRegion, OpKind, RndvMode, Status, Worker};
use strait_shm::{ShmConfig, ShmDevice, ShmListener};
use strait_sys::pattern;

type W = Worker<ShmDevice>;

const SIZES: &[usize] =
    &[0, 1, 8, 40, 41, 64, 1000, 4096, 8192, 8193, 32_768, 32_769, 65_536, 65_537, 300_000, 1 << 20, 4 << 20];

fn cfg(mode: RndvMode, spin: Duration) -> Config {
    Config {
        rndv_mode: mode,
        spin,
        chunk_size: 16 * 1024,
        pipeline_threshold: 64 * 1024,
        ..Config::default()
    }
}

fn mode_name(m: RndvMode) -> &'static str {
    match m {
        RndvMode::Auto => "auto",
        RndvMode::RemoteRead => "remote-read",
        RndvMode::Copy => "copy",
        RndvMode::Split => "split",
    }
}

fn spawn_child(role: &str, name: &str, mode: RndvMode, spin: Duration) -> Child {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env("STRAIT_TEST_ROLE", role)
        .env("STRAIT_TEST_NAME", name)
        .env("STRAIT_TEST_MODE", mode_name(mode))
        .env("STRAIT_TEST_SPIN_US", spin.as_micros().to_string());
    // SAFETY: prctl in the child between fork and exec is async-signal-safe; it makes
    // the child die with the test process instead of lingering.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().expect("spawn child")
}

fn unique(tag: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    format!("test-{}-{}-{}", tag, std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// Connects a child playing the hostile `role` and posts one 64-byte receive: the
/// connection and the completion the receive ends with (within 5 s).
fn receive_from_hostile(tag: &str, role: &str) -> (Conn, Completion) {
    let mut conn = connect_child(tag, role, RndvMode::Auto, Duration::ZERO, Duration::ZERO);
    let mut inbox = MemoryRegion::new(64).unwrap();
    conn.w.post_recv(conn.ep, &mut inbox, 0..64, 0, 0, 1).unwrap();
    let c = conn.w.wait(Some(Duration::from_secs(5))).expect("an error completion");
    (conn, c)
}

/// One `#[test]` per rendezvous mode, `$remote_read`, `$copy` and `$split`, each
/// running `$run(mode, $args...)`: the tests that differ only in the mode are
/// written once.
macro_rules! test_per_mode {
    ($remote_read:ident, $copy:ident, $split:ident: $run:ident $(, $arg:expr)*) => {
        #[test]
        fn $remote_read() {
            $run(RndvMode::RemoteRead $(, $arg)*);
        }

        #[test]
        fn $copy() {
            $run(RndvMode::Copy $(, $arg)*);
        }

        #[test]
        fn $split() {
            $run(RndvMode::Split $(, $arg)*);
        }
    };
}

/// A worker with one endpoint connected to a child process playing `role`, over a
/// fresh name tagged `tag`. The listener stays open (tests connect more peers).
struct Conn {
    w: W,
    ep: EpId,
    child: Child,
    listener: ShmListener,
    name: String,
}

/// Binds a fresh name, starts the child (spinning `child_spin`), and accepts it on a
/// worker spinning `spin`.
fn connect_child(tag: &str, role: &str, mode: RndvMode, child_spin: Duration, spin: Duration) -> Conn {
    let name = unique(tag);
    let listener = ShmListener::bind(&name).unwrap();
    let child = spawn_child(role, &name, mode, child_spin);
    let mut w = W::new(cfg(mode, spin)).unwrap();
    let ep = w.attach(listener.accept(w.notifier()).unwrap());
    Conn { w, ep, child, listener, name }
}

fn wait_for(w: &mut W, op: OpKind, polling: bool) -> Completion {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let c = if polling {
            match w.poll() {
                Some(c) => c,
                None => {
                    assert!(Instant::now() < deadline, "timed out polling for {op:?}");
                    continue;
                }
            }
        } else {
            w.wait(Some(Duration::from_secs(20))).expect("wait")
        };
        if c.op == op {
            return c;
        }
    }
}

/// Echo peer: receives every size in turn and sends it back.
fn echo(w: &mut W, ep: EpId, polling: bool) {
    for (i, &len) in SIZES.iter().enumerate() {
        let mut mr = MemoryRegion::new(len).unwrap();
        w.post_recv(ep, &mut mr, 0..len, i as u64, u64::MAX, 0).unwrap();
        let c = wait_for(w, OpKind::Recv, polling);
        assert_eq!((c.status, c.len, c.tag), (Status::Ok, len, i as u64));
        w.post_send(ep, &mr, 0..len, i as u64 + 1000, 0).unwrap();
        let c = wait_for(w, OpKind::Send, polling);
        assert_eq!(c.status, Status::Ok);
    }
}

fn echo_roundtrip(mode: RndvMode, polling: bool) {
    let spin = if polling { Duration::from_micros(100) } else { Duration::ZERO };
    let Conn { mut w, ep, mut child, listener: _listener, .. } =
        connect_child("echo", if polling { "echo-poll" } else { "echo-block" }, mode, spin, spin);
    for (i, &len) in SIZES.iter().enumerate() {
        let data = pattern(i as u64, len);
        let mut out = MemoryRegion::new(len).unwrap();
        out.write_at(0, &data).unwrap();
        // Receive a bit more than sent: the completion must report the true length.
        let mut back = MemoryRegion::new(len + 16).unwrap();
        w.post_recv(ep, &mut back, 0..len + 16, i as u64 + 1000, u64::MAX, 0).unwrap();
        w.post_send(ep, &out, 0..len, i as u64, 0).unwrap();
        let mut got = [false; 2];
        while !(got[0] && got[1]) {
            let c = if polling { w.poll() } else { Some(w.wait(Some(Duration::from_secs(20))).unwrap()) };
            let Some(c) = c else { continue };
            assert_eq!(c.status, Status::Ok, "size {len}: {c:?}");
            got[(c.op == OpKind::Recv) as usize] = true;
            if c.op == OpKind::Recv {
                assert_eq!(c.len, len);
            }
        }
        assert_eq!(&back.bytes().unwrap()[..len], &data[..], "size {len} came back different");
    }
    let st = w.stats(ep).unwrap();
    assert!(st.eager_sent > 0 && st.rndv_sent > 0, "{st:?}");
    if mode == RndvMode::Split && polling {
        // Both ends poll: the large messages coming back were split (this side read
        // one part, the child wrote the other into our buffers).
        assert!(st.rndv_split > 0 && st.device.remote_reads > 0, "{st:?}");
    }
    assert!(child.wait().unwrap().success(), "child failed");
}

test_per_mode!(
    every_size_class_polling_remote_read,
    every_size_class_polling_pipelined_copy,
    every_size_class_polling_split: echo_roundtrip,
    true
);

test_per_mode!(
    every_size_class_blocking_remote_read,
    every_size_class_blocking_pipelined_copy,
    every_size_class_blocking_split: echo_roundtrip,
    false
);

/// The sender's peer dies after it got the RTS: the sender's outstanding send must
/// end with an error completion within a second, for either rendezvous mode.
fn receiver_dies_mid_rendezvous(mode: RndvMode) {
    let Conn { mut w, ep, mut child, listener: _listener, .. } =
        connect_child("die-recv", "stall-then-die", mode, Duration::ZERO, Duration::from_micros(50));
    let len = 64 << 20;
    let out = MemoryRegion::new(len).unwrap();
    w.post_send(ep, &out, 0..len, 1, 7).unwrap();
    // The child tells us (with a tiny message) that it has the RTS and is about to
    // stall; then we kill it mid-transfer.
    let mut note = MemoryRegion::new(8).unwrap();
    w.post_recv(ep, &mut note, 0..8, 2, u64::MAX, 8).unwrap();
    let c = wait_for(&mut w, OpKind::Recv, false);
    assert_eq!(c.status, Status::Ok);
    child.kill().unwrap();
    let killed = Instant::now();
    let c = w.wait(Some(Duration::from_secs(5))).expect("an error completion, not a hang");
    assert_eq!((c.op, c.ctx), (OpKind::Send, 7));
    assert_eq!(c.status, Status::PeerGone);
    assert!(killed.elapsed() < Duration::from_secs(1), "took {:?}", killed.elapsed());
    child.wait().unwrap();
}

test_per_mode!(
    receiver_dies_mid_rendezvous_remote_read,
    receiver_dies_mid_rendezvous_pipelined_copy,
    receiver_dies_mid_rendezvous_split: receiver_dies_mid_rendezvous
);

/// The receiver has matched an RTS but the sender died: the receive fails with an
/// error completion (remote read finds no process; copy mode sees the hang-up).
fn sender_dies_mid_rendezvous(mode: RndvMode) {
    let Conn { mut w, ep, mut child, listener: _listener, .. } =
        connect_child("die-send", "send-big-then-die", mode, Duration::ZERO, Duration::from_micros(50));
    // Wait until the RTS is here (it lands in the unexpected queue), then kill.
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.stats(ep).unwrap().unexpected == 0 {
        w.progress();
        assert!(Instant::now() < deadline, "RTS never arrived");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    let len = 64 << 20;
    let mut inbox = MemoryRegion::new(len).unwrap();
    w.post_recv(ep, &mut inbox, 0..len, 1, u64::MAX, 3).unwrap();
    let c = w.wait(Some(Duration::from_secs(5))).expect("an error completion, not a hang");
    assert_eq!((c.op, c.ctx), (OpKind::Recv, 3));
    assert!(matches!(c.status, Status::PeerGone | Status::RemoteReadFailed), "{c:?}");
    assert!(killed.elapsed() < Duration::from_secs(1), "took {:?}", killed.elapsed());
}

test_per_mode!(
    sender_dies_mid_rendezvous_remote_read,
    sender_dies_mid_rendezvous_pipelined_copy,
    sender_dies_mid_rendezvous_split: sender_dies_mid_rendezvous
);

/// A child of the peer, made by fork, sends a large message through the connection
/// it inherited: its bytes arrive, not its parent's stale copy at the same address
/// (the device reaches the process that connected: a fork child's announcement
/// carries no address, so the bytes come through the ring).
fn a_forked_sender_is_read_from_itself(mode: RndvMode) {
    let Conn { mut w, ep, mut child, listener: _listener, .. } =
        connect_child("fork-send", "fork-send", mode, Duration::ZERO, Duration::from_micros(50));
    let len = 1 << 20;
    let mut inbox = MemoryRegion::new(len).unwrap();
    w.post_recv(ep, &mut inbox, 0..len, 1, u64::MAX, 0).unwrap();
    let c = wait_for(&mut w, OpKind::Recv, false);
    assert_eq!((c.status, c.len), (Status::Ok, len), "{c:?}");
    let b = inbox.bytes().unwrap();
    let stale = b.iter().filter(|&&x| x != 0xbb).count();
    assert_eq!(stale, 0, "{stale} bytes are not the forked sender's (0xaa: its parent's)");
    assert!(child.wait().unwrap().success(), "the peer failed");
}

test_per_mode!(
    a_forked_sender_is_read_from_itself_remote_read,
    a_forked_sender_is_read_from_itself_pipelined_copy,
    a_forked_sender_is_read_from_itself_split: a_forked_sender_is_read_from_itself
);

/// A peer that speaks the device protocol correctly but sends a malformed protocol
/// header: the frame is rejected, counted, the endpoint fails with `Corrupt`, and
/// this process carries on.
#[test]
fn malformed_protocol_frame_is_rejected() {
    let (Conn { w, ep, mut child, listener: _listener, .. }, c) = receive_from_hostile("garbage", "garbage");
    assert_eq!(c.status, Status::Corrupt);
    let st = w.stats(ep).unwrap();
    assert!(st.frames_rejected >= 1);
    let (status, why) = w.endpoint_error(ep).unwrap();
    assert_eq!(status, Status::Corrupt);
    assert!(why.unwrap().contains("unknown frame kind"));
    child.wait().unwrap();
    // This process still works: a fresh connection carries traffic.
    echo_roundtrip(RndvMode::Auto, true);
}

const TRUNC_SIZES: &[usize] = &[100, 40_000, 300_000];

/// Receive buffers smaller than the messages: each receive completes `Truncated`
/// with the full message length, the accepted prefix is right, and not one byte
/// past the posted range is written.
fn truncation(mode: RndvMode) {
    let Conn { mut w, ep, mut child, listener: _listener, .. } =
        connect_child("trunc", "send-trunc", mode, Duration::ZERO, Duration::from_micros(50));
    for (i, &len) in TRUNC_SIZES.iter().enumerate() {
        let take = len / 2;
        let mut mr = MemoryRegion::new(len + 4096).unwrap();
        mr.bytes_mut().unwrap().fill(0xee);
        w.post_recv(ep, &mut mr, 0..take, i as u64, u64::MAX, 0).unwrap();
        let c = wait_for(&mut w, OpKind::Recv, false);
        assert_eq!((c.status, c.len), (Status::Truncated, len), "size {len}: {c:?}");
        let b = mr.bytes().unwrap();
        assert_eq!(&b[..take], &pattern(i as u64, len)[..take], "size {len}: prefix differs");
        assert!(b[take..].iter().all(|&x| x == 0xee), "size {len}: bytes written past the buffer");
    }
    assert!(child.wait().unwrap().success(), "sender failed (its sends must complete too)");
}

test_per_mode!(truncation_remote_read, truncation_pipelined_copy, truncation_split: truncation);

/// The shared memory is handed only to the two ends of a connection: a second
/// process connecting to the same name gets a connection of its own and never sees
/// the first one's traffic, and nothing is created in the filesystem or /dev/shm.
#[test]
fn a_process_without_the_memfd_cannot_reach_the_ring() {
    let Conn { mut w, ep, child: mut owner, listener, name } =
        connect_child("isolation", "echo-block", RndvMode::Auto, Duration::ZERO, Duration::ZERO);
    let mut intruder = spawn_child("intruder", &name, RndvMode::Auto, Duration::ZERO);
    let ep2 = w.attach(listener.accept(w.notifier()).unwrap());
    // Traffic on the first connection while the intruder listens on its own.
    for (i, &len) in SIZES.iter().enumerate() {
        let data = pattern(i as u64, len);
        let mut out = MemoryRegion::new(len).unwrap();
        out.write_at(0, &data).unwrap();
        let mut back = MemoryRegion::new(len).unwrap();
        w.post_recv(ep, &mut back, 0..len, i as u64 + 1000, u64::MAX, 0).unwrap();
        w.post_send(ep, &out, 0..len, i as u64, 0).unwrap();
        let mut got = 0;
        while got < 2 {
            let c = w.wait(Some(Duration::from_secs(20))).unwrap();
            assert_eq!((c.ep, c.status), (ep, Status::Ok), "{c:?}");
            got += 1;
        }
        assert_eq!(back.bytes().unwrap(), &data[..]);
    }
    assert!(owner.wait().unwrap().success());
    // The intruder saw nothing of it (it fails if anything arrives), and there is no
    // shared-memory object anyone else could open.
    assert!(intruder.wait().unwrap().success(), "the intruder received something");
    assert_eq!(w.stats(ep2).unwrap().device.frames_received, 0);
    let leaked: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten().map(|e| e.file_name()).filter(|n| n.to_string_lossy().contains("strait")).collect()
        })
        .unwrap_or_default();
    assert!(leaked.is_empty(), "shared memory visible in /dev/shm: {leaked:?}");
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(maps.lines().filter(|l| l.contains("strait-shm")).all(|l| l.contains("memfd:")), "{maps}");
}

/// A sender that sleeps on a full ring is woken by a receiver that only polls (it
/// never sleeps and never sends, so only its hand-back of ring room can wake the
/// sender): a copy-mode transfer many times the ring's size completes.
#[test]
fn a_polling_receiver_wakes_a_sender_sleeping_on_a_full_ring() {
    let Conn { mut w, ep, mut child, listener: _listener, .. } =
        connect_child("poll-only", "poll-recv-only", RndvMode::Copy, Duration::ZERO, Duration::ZERO);
    let len = 16 << 20;
    let mut out = MemoryRegion::new(len).unwrap();
    out.write_at(0, &pattern(9, len)).unwrap();
    for i in 0..3 {
        w.post_send(ep, &out, 0..len, i, 0).unwrap();
        let c = w.wait(Some(Duration::from_secs(10))).expect("the sender was never woken");
        assert_eq!((c.op, c.status), (OpKind::Send, Status::Ok));
    }
    assert!(w.stats(ep).unwrap().device.frames_sent > 3 * (len / (1 << 20)) as u64);
    assert!(child.wait().unwrap().success());
}

/// A hostile peer that writes garbage straight into the shared ring (not through the
/// device): the frame is rejected, counted, the endpoint fails `Corrupt` with the
/// reason, and this process carries on.
#[test]
fn garbage_written_into_the_ring_is_rejected() {
    let (Conn { w, ep, mut child, listener: _listener, .. }, c) =
        receive_from_hostile("ring-garbage", "scribble-ring");
    assert_eq!((c.status, c.ctx), (Status::Corrupt, 1));
    assert!(w.stats(ep).unwrap().device.frames_rejected >= 1);
    let (_, why) = w.endpoint_error(ep).unwrap();
    assert!(why.unwrap_or_default().contains("bad frame header"));
    assert!(child.wait().unwrap().success());
    echo_roundtrip(RndvMode::Copy, true);
}

/// Child roles; a no-op unless `STRAIT_TEST_ROLE` is set.
#[test]
fn child() {
    let Ok(role) = std::env::var("STRAIT_TEST_ROLE") else { return };
    let name = std::env::var("STRAIT_TEST_NAME").unwrap();
    let mode = match std::env::var("STRAIT_TEST_MODE").unwrap().as_str() {
        "copy" => RndvMode::Copy,
        "remote-read" => RndvMode::RemoteRead,
        "split" => RndvMode::Split,
        _ => RndvMode::Auto,
    };
    let spin = Duration::from_micros(std::env::var("STRAIT_TEST_SPIN_US").unwrap().parse().unwrap());
    let mut w = W::new(cfg(mode, spin)).unwrap();
    let dev = ShmDevice::connect(&name, &ShmConfig::default(), w.notifier()).unwrap();
    match role.as_str() {
        "echo-poll" | "echo-block" => {
            let ep = w.attach(dev);
            echo(&mut w, ep, role == "echo-poll");
        }
        "stall-then-die" => {
            let ep = w.attach(dev);
            // Wait for the RTS to arrive (unexpected), tell the parent, and in copy
            // mode let the transfer start; then stall until killed.
            while w.stats(ep).unwrap().unexpected == 0 {
                w.progress();
            }
            let len = 64 << 20;
            let mut inbox = MemoryRegion::new(len).unwrap();
            if mode == RndvMode::Copy {
                // Answer with CTS so the parent starts pushing, take a few chunks,
                // then stop draining the ring.
                w.post_recv(ep, &mut inbox, 0..len, 1, u64::MAX, 0).unwrap();
                for _ in 0..100 {
                    w.progress();
                }
            }
            let note = MemoryRegion::new(8).unwrap();
            w.post_send(ep, &note, 0..8, 2, 0).unwrap();
            w.progress();
            std::thread::sleep(Duration::from_secs(30));
        }
        "fork-send" => {
            // The connection is used by a child this process forks: at the address of
            // this process's buffer the child's copy holds other bytes.
            let ep = w.attach(dev);
            let len = 1 << 20;
            let mut out = MemoryRegion::new(len).unwrap();
            out.write_at(0, &vec![0xaa; len]).unwrap();
            // SAFETY: fork in a test process; the child touches only its own copy of
            // this thread's state (glibc keeps malloc usable across fork) and leaves
            // with _exit.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork");
            if pid == 0 {
                out.write_at(0, &vec![0xbb; len]).unwrap();
                w.post_send(ep, &out, 0..len, 1, 0).unwrap();
                let c = wait_for(&mut w, OpKind::Send, false);
                // SAFETY: leaves the forked child at once.
                unsafe { libc::_exit(if c.status == Status::Ok { 0 } else { 1 }) };
            }
            let mut st = 0;
            // SAFETY: waits for the child just made.
            assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
            assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "the forked sender failed: {st}");
            // The connection is the child's now: this process's worker state is from
            // before the fork (its ring positions are stale), so it must not close
            // the endpoint (a Close frame at a stale position would overwrite the
            // child's frames). Leave without dropping it.
            // SAFETY: ends this test process at once with success.
            unsafe { libc::_exit(0) };
        }
        "send-big-then-die" => {
            let ep = w.attach(dev);
            let len = 64 << 20;
            let out = MemoryRegion::new(len).unwrap();
            w.post_send(ep, &out, 0..len, 1, 0).unwrap();
            std::thread::sleep(Duration::from_secs(30));
        }
        "send-trunc" => {
            let ep = w.attach(dev);
            for (i, &len) in TRUNC_SIZES.iter().enumerate() {
                let mut out = MemoryRegion::new(len).unwrap();
                out.write_at(0, &pattern(i as u64, len)).unwrap();
                w.post_send(ep, &out, 0..len, i as u64, 0).unwrap();
                let c = wait_for(&mut w, OpKind::Send, false);
                // An eager send is done once it left; a rendezvous sender learns of
                // the truncation from the receiver.
                let expect =
                    if len > Config::default().eager_threshold { Status::Truncated } else { Status::Ok };
                assert_eq!(c.status, expect, "send of {len}");
            }
        }
        "intruder" => {
            let ep = w.attach(dev);
            let mut inbox = MemoryRegion::new(1 << 20).unwrap();
            w.post_recv(ep, &mut inbox, 0..1 << 20, 0, 0, 0).unwrap();
            let deadline = Instant::now() + Duration::from_millis(500);
            while Instant::now() < deadline {
                assert!(w.poll().is_none(), "the intruder received a completion");
            }
            assert_eq!(w.stats(ep).unwrap().device.frames_received, 0);
        }
        "poll-recv-only" => {
            let ep = w.attach(dev);
            let len = 16 << 20;
            let mut inbox = MemoryRegion::new(len).unwrap();
            for i in 0..3 {
                w.post_recv(ep, &mut inbox, 0..len, i, u64::MAX, 0).unwrap();
                let c = wait_for(&mut w, OpKind::Recv, true);
                assert_eq!((c.status, c.len), (Status::Ok, len));
            }
            assert_eq!(inbox.bytes().unwrap(), &pattern(9, len)[..]);
        }
        "scribble-ring" => {
            // Find our own mapping of the connection's memory, as any code in this
            // process could, and write a bogus header word into the first cell of the
            // ring we produce (ring 0, after the 4 KiB control page).
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            let line = maps.lines().find(|l| l.contains("memfd:strait-shm")).expect("the ring mapping");
            let start = usize::from_str_radix(line.split('-').next().unwrap(), 16).unwrap();
            // SAFETY: a deliberate hostile write into our own shared mapping (the
            // test's point); the address is inside the mapping found above.
            unsafe { std::ptr::write_volatile((start + 4096) as *mut u64, 0xdead_beef_0bad_f00d) };
            let _dev = dev;
            std::thread::sleep(Duration::from_millis(300));
        }
        "garbage" => {
            let mut dev = dev;
            let frame = [0xffu8; 24];
            assert!(dev.send_frame(frame.len(), &mut |fw| fw.write(0, &frame)).unwrap());
            dev.doorbell().unwrap();
            std::thread::sleep(Duration::from_millis(500));
        }
        other => panic!("unknown role {other}"),
    }
}
