//! The provider driven by real libfabric programs: `fi_info`, `fi_pingpong`, and
//! Open MPI (`--mca pml cm --mca mtl ofi`) running tests/mpi_check.c. Every program
//! runs in its own process group under a time limit: a hang fails the test (and the
//! whole group is killed).
//!
//! Needs Debian's libfabric-bin, libfabric-dev, openmpi-bin and libopenmpi-dev
//! (scripts/install-deps installs them); the namespace tests need root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use strait_testkit::{ensure, run_for_group};

/// A directory holding `libstrait-fi.so` (libfabric loads `*-fi.so` from
/// `FI_PROVIDER_PATH`), linked to the library cargo built with this test.
fn provider_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test binary path");
        let deps = exe.parent().expect("deps dir");
        let lib = [deps.join("libstrait_fi.so"), deps.join("../libstrait_fi.so")]
            .into_iter()
            .find(|p| p.exists())
            .expect("libstrait_fi.so next to the test binary (cargo builds the cdylib with the tests)");
        // In the build's output (not /tmp): runs reuse it instead of leaving a
        // directory each.
        let dir = deps.join("../strait-fi-test");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test dir");
        let link = dir.join("libstrait-fi.so");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(lib.canonicalize().expect("canonical path"), &link).expect("symlink");
        dir
    })
}

/// A directory for one test's files (under the provider's directory).
fn temp_dir(tag: &str) -> PathBuf {
    let d = provider_dir().join(tag);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn text(o: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn fi_command(prog: &str) -> Command {
    let mut c = Command::new(prog);
    c.env("FI_PROVIDER_PATH", provider_dir()).env_remove("FI_PROVIDER").env_remove("LD_PRELOAD");
    c
}

#[test]
fn fi_info_lists_the_provider_and_refuses_what_it_lacks() {
    ensure("fi_info", "libfabric-bin");
    let o = run_for_group(fi_command("fi_info").args(["-p", "strait"]), Duration::from_secs(30))
        .expect("fi_info hung");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("provider: strait") && t.contains("FI_EP_RDM"), "{t}");
    let o = run_for_group(fi_command("fi_info").args(["-p", "strait", "-v"]), Duration::from_secs(30))
        .expect("hung");
    let t = text(&o);
    for cap in
        ["FI_MSG", "FI_TAGGED", "FI_DIRECTED_RECV", "FI_LOCAL_COMM", "FI_REMOTE_COMM", "FI_THREAD_SAFE"]
    {
        assert!(t.contains(cap), "{cap} missing:\n{t}");
    }
    // What it does not do, it does not claim: RMA, atomics, connected endpoints.
    for (flag, val) in [("-c", "FI_RMA"), ("-c", "FI_ATOMIC"), ("-e", "msg"), ("-e", "dgram")] {
        let o =
            run_for_group(fi_command("fi_info").args(["-p", "strait", flag, val]), Duration::from_secs(30))
                .expect("hung");
        assert!(!text(&o).contains("provider: strait"), "strait claimed {flag} {val}:\n{}", text(&o));
    }
}

/// A control port for fi_pingpong: one the kernel just handed out as free (a fixed
/// range collided with ports of earlier runs still in TIME_WAIT, which fi_pingpong's
/// server cannot bind).
fn ctrl_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address").port().to_string()
}

/// Waits (up to 20 s) until a TCP socket listens on `port` (in the namespace
/// `wrap` enters, if any).
fn wait_listening(wrap: &[&str], port: &str, server_ended: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end && !server_ended() {
        let mut c = Command::new(if wrap.is_empty() { "ss" } else { wrap[0] });
        if !wrap.is_empty() {
            c.args(&wrap[1..]).arg("ss");
        }
        let o = c.args(["-Hltn", &format!("sport = :{port}")]).output();
        if o.is_ok_and(|o| !o.stdout.is_empty()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if !server_ended() {
        panic!("fi_pingpong's server never listened on port {port}");
    }
}

/// fi_pingpong server and client, each optionally wrapped (e.g. `ip netns exec`).
fn pingpong(extra: &[&str], server_wrap: &[&str], client_wrap: &[&str], server_addr: &str, want: &str) {
    pingpong_env(extra, server_wrap, client_wrap, server_addr, want, &[]);
}

fn pingpong_env(
    extra: &[&str],
    server_wrap: &[&str],
    client_wrap: &[&str],
    server_addr: &str,
    want: &str,
    env: &[(&str, &str)],
) {
    ensure("fi_pingpong", "libfabric-bin");
    let port = ctrl_port();
    let mk = |wrap: &[&str]| {
        let mut c = if wrap.is_empty() {
            fi_command("fi_pingpong")
        } else {
            let mut c = fi_command(wrap[0]);
            c.args(&wrap[1..]).arg("fi_pingpong");
            c
        };
        c.args(["-p", "strait", "-e", "rdm", "-v", "-I", "50"]).args(extra);
        c.envs(env.iter().copied());
        c
    };
    let mut server = mk(server_wrap);
    server.args(["-B", &port]);
    let srv = std::thread::spawn(move || run_for_group(&mut server, Duration::from_secs(60)));
    // The client does not retry its control connection: wait until the server listens
    // (or ends: its output then says why, below).
    wait_listening(server_wrap, &port, || srv.is_finished());
    if srv.is_finished() {
        let s = srv.join().expect("server thread").expect("fi_pingpong server hung");
        panic!("fi_pingpong's server ended before listening:\n{}", text(&s));
    }
    let mut client = mk(client_wrap);
    client.args(["-P", &port, server_addr]);
    let c = run_for_group(&mut client, Duration::from_secs(60)).expect("fi_pingpong client hung");
    let s = srv.join().expect("server thread").expect("fi_pingpong server hung");
    assert!(c.status.success(), "client failed:\n{}\nserver:\n{}", text(&c), text(&s));
    assert!(s.status.success(), "server failed:\n{}", text(&s));
    // The largest size ran (every size before it did too), with data verification.
    let out = String::from_utf8_lossy(&c.stdout);
    assert!(out.lines().any(|l| l.starts_with(want)), "no {want:?} line:\n{out}");
}

#[test]
fn fi_pingpong_rdm_msg_on_one_host() {
    pingpong(&[], &[], &[], "127.0.0.1", "1m ");
}

#[test]
fn fi_pingpong_rdm_tagged_on_one_host() {
    pingpong(&["-m", "tagged"], &[], &[], "127.0.0.1", "1m ");
}

#[test]
fn fi_pingpong_rdm_large_sizes_on_one_host() {
    // Single-copy rendezvous (process_vm_readv) for every size from 64 KiB.
    pingpong(&["-S", "all"], &[], &[], "127.0.0.1", "6m ");
}

#[test]
fn fi_pingpong_rdm_large_sizes_copied_on_one_host() {
    // The same sizes through the ring, as when the receiver may not read the sender.
    pingpong_env(&["-S", "all"], &[], &[], "127.0.0.1", "6m ", &[("STRAIT_FI_RNDV", "0")]);
}

/// Compiles tests/mpi_check.c with mpicc into a temp dir.
fn mpi_check_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        ensure("mpicc", "libopenmpi-dev");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mpi_check.c");
        let bin = temp_dir("mpi").join("mpi_check");
        let o = run_for_group(
            Command::new("mpicc").args(["-O2", "-o"]).arg(&bin).arg(&src),
            Duration::from_secs(120),
        )
        .expect("mpicc hung");
        assert!(o.status.success(), "mpicc failed:\n{}", text(&o));
        bin
    })
}

fn mpirun(np: usize, extra: &[&str]) -> Command {
    ensure("mpirun", "openmpi-bin");
    let mut c = fi_command("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()])
        // No topology in shared memory (see the run across namespaces).
        .args(["--mca", "rtc_hwloc_vmhole", "none"])
        .args(["--mca", "pml", "cm", "--mca", "mtl", "ofi", "--mca", "mtl_ofi_provider_include", "strait"])
        .args(["--mca", "mtl_base_verbose", "100", "-x", "FI_PROVIDER_PATH"])
        .args(extra);
    c
}

fn check_mpi(o: &Output, want: &[&str]) {
    let t = text(o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("mtl:ofi:provider: strait"), "Open MPI did not select the strait provider:\n{t}");
    for w in want {
        assert!(t.contains(w), "missing {w:?}:\n{t}");
    }
}

#[test]
fn open_mpi_two_ranks_point_to_point_on_one_host() {
    let bin = mpi_check_binary();
    let o = run_for_group(mpirun(2, &[]).arg(bin).arg("p2p"), Duration::from_secs(180)).expect("mpirun hung");
    check_mpi(&o, &["pingpong ok", "probe/any ok", "cancel ok", "nonblocking ok", "all ok"]);
}

#[test]
fn open_mpi_thread_multiple_four_threads_per_rank() {
    let bin = mpi_check_binary();
    let o =
        run_for_group(mpirun(2, &[]).arg(bin).arg("threads"), Duration::from_secs(180)).expect("mpirun hung");
    check_mpi(&o, &["threads ok", "all ok"]);
}

#[test]
fn open_mpi_four_ranks_everything_on_one_host() {
    let bin = mpi_check_binary();
    let o = run_for_group(mpirun(4, &[]).arg(bin).arg("all"), Duration::from_secs(300)).expect("mpirun hung");
    check_mpi(
        &o,
        &["pingpong ok", "probe/any ok", "cancel ok", "nonblocking ok", "collectives ok", "all ok"],
    );
}

#[test]
fn open_mpi_a_killed_rank_ends_the_job_in_bounded_time() {
    let bin = mpi_check_binary();
    let tag = format!("hang-{}", std::process::id());
    // A private copy, so the ranks are found by this exact path and nothing else.
    let mine = temp_dir(&tag).join("mpi_check_hang");
    std::fs::copy(bin, &mine).expect("copy binary");
    let mut c = mpirun(4, &[]);
    c.arg(&mine).arg("hang");
    let path = mine.to_string_lossy().to_string();
    let killer = std::thread::spawn(move || {
        // Wait until all four ranks run, then kill one of them.
        let end = Instant::now() + Duration::from_secs(60);
        while Instant::now() < end {
            let o = Command::new("pgrep").args(["-f", &format!("^{path} hang")]).output();
            let pids: Vec<i32> = o
                .map(|o| {
                    String::from_utf8_lossy(&o.stdout).lines().filter_map(|l| l.trim().parse().ok()).collect()
                })
                .unwrap_or_default();
            if pids.len() == 4 {
                std::thread::sleep(Duration::from_secs(2));
                // SAFETY: signals one MPI rank this test started (found by its private path).
                unsafe { libc::kill(pids[2], libc::SIGKILL) };
                return Instant::now();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the four ranks never started");
    });
    let o = run_for_group(&mut c, Duration::from_secs(120)).expect("the job hung after a rank was killed");
    let killed_at = killer.join().expect("killer");
    let took = killed_at.elapsed();
    assert!(!o.status.success(), "the job succeeded although a rank was killed:\n{}", text(&o));
    assert!(took < Duration::from_secs(60), "the job took {took:?} to end after the kill");
}

/// fi_pingpong between two network namespaces joined by a veth pair: the
/// provider picks the udp device (the peer's boot id matches, its namespace does not).
fn pingpong_across_namespaces(extra: &[&str], want: &str) {
    ensure("ip", "iproute2");
    let pair = strait_udp::netns::VethPair::create().expect("veth pair (needs root)");
    let server_ip = pair.v4[0].to_string();
    let wrap = |i: usize| vec!["ip".to_string(), "netns".into(), "exec".into(), pair.ns[i].clone()];
    let (w0, w1) = (wrap(0), wrap(1));
    let w0: Vec<&str> = w0.iter().map(String::as_str).collect();
    let w1: Vec<&str> = w1.iter().map(String::as_str).collect();
    pingpong(extra, &w0, &w1, &server_ip, want);
}

#[test]
fn fi_pingpong_rdm_msg_across_namespaces() {
    pingpong_across_namespaces(&[], "1m ");
}

#[test]
fn fi_pingpong_rdm_tagged_across_namespaces() {
    pingpong_across_namespaces(&["-m", "tagged", "-S", "4194305"], "4m ");
}

#[test]
fn open_mpi_four_ranks_everything_across_namespaces() {
    ensure("ip", "iproute2");
    let bin = mpi_check_binary();
    let pair = strait_udp::netns::VethPair::create().expect("veth pair (needs root)");
    let dir = temp_dir(&format!("mpi-ns-{}", pair.ns[0]));
    // mpirun starts its daemons through this "rsh": it enters the namespace named
    // as the host. Both namespaces share the host name and /tmp, so without a
    // temporary directory per "host" the two daemons made the same session
    // directory (/tmp/ompi.<host>.<uid>/jf.<job>) at the same moment, and Open MPI's
    // directory creation, which does not expect a racing creator, failed in one of
    // them ("mkdir ... File exists", orte_init failed; once in CI).
    let agent = dir.join("ns-agent.sh");
    let script = format!(
        "#!/bin/sh\nhost=$1; shift\ntmp={}/tmp-$host\nmkdir -p \"$tmp\"\n\
         exec ip netns exec \"$host\" env TMPDIR=\"$tmp\" sh -c \"$*\"\n",
        dir.display()
    );
    std::fs::write(&agent, script).expect("agent");
    std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, format!("{} slots=2\n{} slots=2\n", pair.ns[0], pair.ns[1])).expect("hostfile");
    let mut c = fi_command("ip");
    c.args(["netns", "exec", &pair.ns[0], "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4"])
        // Each namespace is a "node" whose one core-binding would put every rank on
        // core 0.
        .args(["--map-by", "node", "--bind-to", "none", "--hostfile"])
        .arg(&hosts)
        .args(["--mca", "plm_rsh_agent"])
        .arg(&agent)
        // ORTE's routed tree sometimes lost a daemon across namespaces (orted
        // crashed, "ORTE does not know how to route a message"): route directly.
        .args(["--mca", "routed", "direct"])
        // An orted sometimes crashed in hwloc while writing the topology into shared
        // memory at an address it picked (`hwloc_shmem_topology_write`, a segfault
        // with no strait code on the stack, once in three CI runs here): no shared
        // topology (each daemon and rank reads its own, as without the option).
        .args(["--mca", "rtc_hwloc_vmhole", "none"])
        .args(["--mca", "pml", "cm", "--mca", "mtl", "ofi", "--mca", "mtl_ofi_provider_include", "strait"])
        .args(["--mca", "mtl_base_verbose", "100", "-x", "FI_PROVIDER_PATH", "-x", "PATH"])
        .arg(bin)
        .arg("all");
    let o = run_for_group(&mut c, Duration::from_secs(300)).expect("mpirun across namespaces hung");
    // Ranks 0 and 2 run in one namespace, 1 and 3 in the other (--map-by node): the
    // ping-pong between 0 and 1 and every collective cross the veth pair.
    check_mpi(
        &o,
        &["pingpong ok", "probe/any ok", "cancel ok", "nonblocking ok", "collectives ok", "all ok"],
    );
}
