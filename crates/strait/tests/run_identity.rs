//! Servers that change who they are (issue 15), both ends under `strait run`: each
//! test program reproduces a pattern with the system calls in the order real
//! daemons make them, then moves a hashed stream both ways and checks that the
//! connection stayed accelerated.

use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::Duration;

mod common;
use common::{ensure, run_for, strait_run};
use strait_testkit::stat;

/// Debian's python3 (a python under root's home cannot run once the program has
/// become another user).
const PYTHON: &str = "/usr/bin/python3";

use strait_testkit::root_or_skip;

fn script(tag: &str, body: &str) -> PathBuf {
    strait_testkit::script("identity", tag, body)
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// The stream both ways: `MIB` MiB of a seeded pattern each way, written and read
/// at once (two threads), SHA-256 of what was read printed; `connect(port)` makes a
/// client's connection to the loopback, `accept_one(port)` a server's (and its
/// listener).
const STREAM: &str = r#"
import hashlib, os, threading
MIB = int(os.environ.get('STRAIT_IDENTITY_MIB', '64'))
def pattern(seed):
    h = hashlib.sha256(seed)
    block = b''.join(hashlib.sha256(h.digest() + i.to_bytes(2, "little")).digest() for i in range(2048))
    return block  # 64 KiB
def pump(rfd, wfd, seed_out):
    out = pattern(seed_out)
    def writer():
        for _ in range(MIB * 16):
            view = memoryview(out)
            while view:
                n = os.write(wfd, view)
                view = view[n:]
    t = threading.Thread(target=writer)
    t.start()
    h = hashlib.sha256()
    left = MIB << 20
    while left:
        b = os.read(rfd, min(left, 1 << 20))
        if not b:
            break
        h.update(b)
        left -= len(b)
    t.join()
    return h.hexdigest(), (MIB << 20) - left
def expected(seed):
    h = hashlib.sha256()
    p = pattern(seed)
    for _ in range(MIB * 16):
        h.update(p)
    return h.hexdigest()
def connect(port):
    import socket
    c = socket.create_connection(('127.0.0.1', port), timeout=60)
    c.settimeout(None)
    return c
def accept_one(port):
    import socket
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(('127.0.0.1', port))
    l.listen(8)
    print('LISTENING', flush=True)
    c, _ = l.accept()
    return c, l
"#;

/// The privilege-separated server of the issue: accept; fork; in the child dup2
/// the connection onto 0, 1 and 2 and close the rest; a raw clone(CLONE_NEWNET |
/// SIGCHLD) (no fork handlers run); in the grandchild chroot into an empty
/// directory, drop to nobody, then serve the stream on stdin/stdout. The process
/// that accepted and the one between exit at once.
const PRIVSEP_SERVER: &str = r#"
import ctypes, os, socket, struct, sys
exec(open(sys.argv[3]).read())
port, jail, variant = int(sys.argv[1]), sys.argv[2], sys.argv[4]
libc = ctypes.CDLL(None, use_errno=True)
SYS_clone, SYS_clone3, SYS_pivot_root, SIGCHLD = 56, 435, 155, 17
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
c, l = accept_one(port)
pid = os.fork()
if pid == 0:
    for fd in (0, 1, 2):
        os.dup2(c.fileno(), fd)
    c.close()
    l.close()
    if variant == 'clone3':
        # struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal, stack,
        # stack_size, tls (no stack: the child runs on a copy, as after fork).
        args = struct.pack('<8Q', CLONE_NEWNET, 0, 0, 0, SIGCHLD, 0, 0, 0)
        buf = ctypes.create_string_buffer(args)
        r = libc.syscall(SYS_clone3, buf, len(args))
    else:
        flags = CLONE_NEWNET | SIGCHLD | (CLONE_NEWPID | CLONE_NEWNS if variant in ('newpid', 'pivot') else 0)
        r = libc.syscall(SYS_clone, flags, 0, 0, 0, 0)
    if r < 0:
        os._exit(3)
    if r == 0:
        if variant == 'pivot':
            # A root of its own: a private tmpfs, pivot_root into it, the old root
            # detached.
            libc.mount(b'none', b'/', None, 0x40000 | 0x4000, None)  # MS_REC | MS_PRIVATE
            if libc.mount(b'tmpfs', jail.encode(), b'tmpfs', 0, None) != 0:
                os._exit(5)
            os.mkdir(jail + '/old')
            if libc.syscall(SYS_pivot_root, jail.encode(), (jail + '/old').encode()) != 0:
                os._exit(6)
            os.chdir('/')
            libc.umount2(b'/old', 2)  # MNT_DETACH
        elif variant == 'exec':
            os.chroot('/')
        else:
            os.chroot(jail)
            os.chdir('/')
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        if variant == 'exec':
            # inetd style: a program whose stdin and stdout are the connection.
            os.execv(sys.executable, [sys.executable, sys.argv[5], sys.argv[3]])
        got, n = pump(0, 1, b'server')
        ok = got == expected(b'client')
        os._exit(0 if ok else 4)
    # The middle process lets go of its copies and exits, as a daemon's monitor
    # that handed the session on does.
    for fd in (0, 1, 2):
        os.close(fd)
    os._exit(0)
c.close()
l.close()
os.waitpid(pid, 0)
"#;

/// The program an inetd-style server execs: the stream on its stdin and stdout.
const STDIO_STREAM: &str = r#"
import os, sys
exec(open(sys.argv[1]).read())
got, n = pump(0, 1, b'server')
sys.exit(0 if got == expected(b'client') else 4)
"#;

const STREAM_CLIENT: &str = r#"
import os, socket, sys
exec(open(sys.argv[2]).read())
c = connect(int(sys.argv[1]))
got, n = pump(c.fileno(), c.fileno(), b'client')
ok = got == expected(b'server')
print('STREAM', 'ok' if ok else 'BAD', n, flush=True)
c.shutdown(socket.SHUT_WR)
sys.exit(0 if ok else 1)
"#;

/// Fails the test unless the client run `out` succeeded and printed `want`, and
/// the server, whose status and stderr are `server`, succeeded too; returns the
/// client's stderr.
fn both_ok(out: &Output, want: &str, (sok, serr): (bool, &str)) -> String {
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success() && text.contains(want), "client: {text}\n{err}\nserver: {serr}");
    assert!(sok, "server: {serr}");
    err
}

/// Fork, dup2 onto 0/1/2, raw clone into a new network namespace, chroot, setuid;
/// the acceptor and the middle process exit: the connection keeps working,
/// accelerated, with 64 MiB each way hashed.
#[test]
fn a_privilege_separated_server_keeps_its_connection_after_clone_chroot_and_setuid() {
    privsep("clone");
}

/// The same with clone3 (the newer system call, no fork handlers either).
#[test]
fn the_privilege_separated_pattern_with_clone3() {
    privsep("clone3");
}

/// The same with new PID and mount namespaces as well (the grandchild is pid 1 of
/// its own namespace).
#[test]
fn the_privilege_separated_pattern_in_a_new_pid_namespace() {
    privsep("newpid");
}

/// The same, with pivot_root into a fresh tmpfs (the old root detached) instead of
/// chroot.
#[test]
fn the_privilege_separated_pattern_with_pivot_root() {
    privsep("pivot");
}

/// After all of it (fork, dup2 onto 0/1/2, clone into a new network namespace,
/// chroot, setuid), an exec of a program that serves on its stdin and stdout, as
/// inetd starts services.
#[test]
fn the_privilege_separated_pattern_ending_in_an_inetd_style_exec() {
    privsep("exec");
}

/// An empty directory to chroot into, named with `tag`, for a test that needs root
/// and python3; `None` (the test skipped) when not root.
fn root_jail(tag: &str) -> Option<PathBuf> {
    if !root_or_skip("needs root (chroot, setuid, namespaces)") {
        return None;
    }
    ensure(PYTHON, "python3");
    let jail = std::env::temp_dir().join(format!("strait-identity-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&jail).expect("jail");
    Some(jail)
}

fn privsep(variant: &str) {
    let Some(jail) = root_jail(&format!("jail-{variant}")) else { return };
    let port = free_port();
    let stream = script(&format!("stream-{variant}"), STREAM);
    let srv = script(&format!("privsep-server-{variant}"), PRIVSEP_SERVER);
    let stdio = script(&format!("stdio-stream-{variant}"), STDIO_STREAM);
    let cli = script(&format!("stream-client-{variant}"), STREAM_CLIENT);
    let (p, j, st) = (port.to_string(), jail.display().to_string(), stream.display().to_string());
    let sd = stdio.display().to_string();
    let mut server = spawn_waiting(
        &mut strait_run(&["--", PYTHON, srv.to_str().expect("path"), &p, &j, &st, variant, &sd]),
        "LISTENING",
    );
    let out = run_for(
        &mut strait_run(&["--stats", "--", PYTHON, cli.to_str().expect("path"), &p, &st]),
        Duration::from_secs(240),
    )
    .expect("client finished in time");
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&jail);
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("STREAM ok"), "{variant}: client: {text}\n{err}");
    assert_eq!(stat(&err, "accelerated"), 1, "{variant}: the connection stayed accelerated: {err}");
}

/// In the same process, after the connection exists: new network, mount and IPC
/// namespaces, chroot into an empty directory, then a drop to www-data (server) and
/// to nobody (client): both ends end up as different users, neither as root.
const UNSHARE_SERVER: &str = r#"
import ctypes, os, socket, sys
exec(open(sys.argv[3]).read())
port, jail = int(sys.argv[1]), sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
c, l = accept_one(port)
l.close()
if libc.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC) != 0:
    sys.exit(3)
os.chroot(jail)
os.chdir('/')
os.setgroups([])
os.setgid(33)
os.setuid(33)
got, n = pump(c.fileno(), c.fileno(), b'server')
sys.exit(0 if got == expected(b'client') else 4)
"#;

const SETUID_CLIENT: &str = r#"
import os, socket, sys
exec(open(sys.argv[2]).read())
c = connect(int(sys.argv[1]))
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
got, n = pump(c.fileno(), c.fileno(), b'client')
ok = got == expected(b'server')
print('STREAM', 'ok' if ok else 'BAD', n, flush=True)
sys.exit(0 if ok else 1)
"#;

#[test]
fn both_ends_unshare_chroot_and_become_different_users_after_connecting() {
    let Some(jail) = root_jail("jail2") else { return };
    let port = free_port();
    let stream = script("stream2", STREAM);
    let srv = script("unshare-server", UNSHARE_SERVER);
    let cli = script("setuid-client", SETUID_CLIENT);
    let (p, j, st) = (port.to_string(), jail.display().to_string(), stream.display().to_string());
    let mut server = spawn_waiting(
        &mut strait_run(&["--stats", "--", PYTHON, srv.to_str().expect("path"), &p, &j, &st]),
        "LISTENING",
    );
    let out = run_for(
        &mut strait_run(&["--stats", "--", PYTHON, cli.to_str().expect("path"), &p, &st]),
        Duration::from_secs(240),
    )
    .expect("client finished in time");
    let status = server.wait().expect("server");
    let mut serr = String::new();
    if let Some(mut e) = server.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut serr);
    }
    let _ = std::fs::remove_dir_all(&jail);
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("STREAM ok"), "client: {text}\n{err}");
    assert!(status.success(), "server: {serr}");
    assert_eq!(stat(&err, "accelerated"), 1, "client: {err}");
    assert_eq!(stat(&serr, "accelerated"), 1, "server: {serr}");
}

/// A daemon that confines itself at start: closes every descriptor above stderr
/// (`close_range`, as daemons do), listens, chroots into an empty directory (no
/// `/proc` there), drops to www-data, and only then makes its epoll set and
/// accepts, echoing every connection.
const CHROOTED_EPOLL_SERVER: &str = r#"
import os, selectors, socket, sys
port, jail, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.closerange(3, 1 << 20)
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(('127.0.0.1', port))
l.listen(64)
os.chroot(jail)
os.chdir('/')
os.setgroups([])
os.setgid(33)
os.setuid(33)
sel = selectors.EpollSelector()
sel.register(l, selectors.EVENT_READ)
print('LISTENING', flush=True)
done = 0
while done < n:
    for k, _ in sel.select(timeout=60):
        if k.fileobj is l:
            c, _ = l.accept()
            sel.register(c, selectors.EVENT_READ)
        else:
            d = k.fileobj.recv(1 << 16)
            if d:
                k.fileobj.sendall(d)
            else:
                sel.unregister(k.fileobj)
                k.fileobj.close()
                done += 1
print('SERVED', done, flush=True)
"#;

/// A client that streams through `n` connections one after another, each echoed
/// back whole, and chroots into an empty directory half way.
const CHROOTED_CLIENT: &str = r#"
import encodings.idna, os, socket, sys
exec(open(sys.argv[2]).read())
port, jail, n = int(sys.argv[1]), sys.argv[3], int(sys.argv[4])
for i in range(n):
    if i == n // 2:
        os.chroot(jail)
        os.chdir('/')
    c = connect(port)
    got, m = pump(c.fileno(), c.fileno(), b'client')
    if got != expected(b'client'):
        print('STREAM BAD', i, m, flush=True)
        sys.exit(1)
    c.close()
print('STREAM ok', n, flush=True)
"#;

/// Both ends chroot into a tree without `/proc` (a daemon confines itself at start:
/// the server sweeps its descriptors with `close_range` and chroots before its
/// first connection, then drops to www-data and makes its epoll set; the client
/// chroots half way through its connections): every connection is accelerated and
/// echoes its stream whole. The library looks `/proc` up through a handle taken
/// when it was loaded, which the sweep steps over; through the path, the server's
/// `epoll_ctl` of an accelerated connection failed with EINVAL (its set was not
/// recognised) and the chrooted client could make no proof of its socket (the
/// kernel path).
#[test]
fn a_server_and_a_client_that_chroot_before_they_connect_stay_accelerated() {
    let Some(jail) = root_jail("jail-early") else { return };
    // (www-data must be able to enter it; it is empty.)
    let _ = std::fs::set_permissions(&jail, std::os::unix::fs::PermissionsExt::from_mode(0o755));
    const CONNS: usize = 8;
    let port = free_port();
    let stream = script("stream-early", STREAM);
    let srv = script("chrooted-epoll-server", CHROOTED_EPOLL_SERVER);
    let cli = script("chrooted-client", CHROOTED_CLIENT);
    let (p, j, st, n) =
        (port.to_string(), jail.display().to_string(), stream.display().to_string(), CONNS.to_string());
    let server = spawn_waiting(
        &mut strait_run(&["--stats", "--", PYTHON, srv.to_str().expect("path"), &p, &j, &n]),
        "LISTENING",
    );
    let out = run_for(
        strait_run(&["--stats", "--", PYTHON, cli.to_str().expect("path"), &p, &st, &j, &n])
            .env("STRAIT_IDENTITY_MIB", "4"),
        Duration::from_secs(120),
    )
    .expect("client finished in time");
    let (sok, serr) = stderr_of(server, Duration::from_secs(30));
    let _ = std::fs::remove_dir_all(&jail);
    let err = both_ok(&out, "STREAM ok", (sok, &serr));
    assert_eq!(stat(&err, "accelerated"), CONNS, "client: {err}");
    assert_eq!(stat(&err, "kernel-fallback"), 0, "client: {err}");
    assert_eq!(stat(&serr, "accelerated"), CONNS, "server: {serr}");
}

/// OpenSSH in its default privilege-separated mode (a fresh sshd per connection by
/// re-exec, the pre-authentication child chrooted into /run/sshd as user sshd with
/// a seccomp sandbox and a descriptor limit of 1), on a test port with a throwaway
/// host key; both ends under `strait run`. `ssh` runs a command, `scp` copies
/// 256 MiB, compared byte for byte; both client connections accelerated.
#[test]
fn openssh_privilege_separated_ssh_and_scp_under_strait() {
    if !root_or_skip("sshd needs root") {
        return;
    }
    for (bin, pkg) in
        [("/usr/sbin/sshd", "openssh-server"), ("ssh", "openssh-client"), ("ssh-keygen", "openssh-client")]
    {
        ensure(bin, pkg);
    }
    let dir = std::env::temp_dir().join(format!("strait-sshd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::create_dir_all("/run/sshd").expect("/run/sshd (privilege separation directory)");
    let d = dir.display().to_string();
    for key in ["hostkey", "userkey"] {
        let st = std::process::Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f", &format!("{d}/{key}")])
            .status()
            .expect("ssh-keygen");
        assert!(st.success());
    }
    std::fs::copy(dir.join("userkey.pub"), dir.join("authorized_keys")).expect("authorized_keys");
    let port = free_port();
    std::fs::write(
        dir.join("sshd_config"),
        format!(
            "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/hostkey\nPidFile {d}/sshd.pid\n\
             AuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\n\
             PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n\
             Subsystem sftp internal-sftp\n"
        ),
    )
    .expect("sshd_config");
    let conf = format!("{d}/sshd_config");
    let log = format!("{d}/sshd.log");
    let started =
        run_for(&mut strait_run(&["--", "/usr/sbin/sshd", "-f", &conf, "-E", &log]), Duration::from_secs(30))
            .expect("sshd started");
    assert!(started.status.success(), "{}", String::from_utf8_lossy(&started.stderr));
    struct Stop(PathBuf);
    impl Drop for Stop {
        fn drop(&mut self) {
            if let Ok(pid) = std::fs::read_to_string(self.0.join("sshd.pid")) {
                let _ = std::process::Command::new("kill").arg(pid.trim()).status();
            }
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _stop = Stop(dir.clone());
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while !dir.join("sshd.pid").exists() && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let key = format!("{d}/userkey");
    let p = port.to_string();
    let opts = [
        "-i",
        &key,
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "BatchMode=yes",
    ];
    let mut ssh_args = vec!["--stats", "--", "ssh", "-p", &p];
    ssh_args.extend(opts);
    ssh_args.extend(["root@127.0.0.1", "echo hello-from-ssh; id -u"]);
    let out = run_for(&mut strait_run(&ssh_args), Duration::from_secs(60)).expect("ssh finished");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    let slog = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(out.status.success() && text == "hello-from-ssh\n0\n", "ssh: {text}\n{err}\nsshd log:\n{slog}");
    assert_eq!(stat(&err, "accelerated"), 1, "ssh: {err}");
    // scp of 256 MiB.
    let src = dir.join("big.bin");
    let body: Vec<u8> =
        (0..(256u32 << 20) / 4).flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()).collect();
    std::fs::write(&src, &body).expect("big file");
    let dst = format!("root@127.0.0.1:{d}/copy.bin");
    let srcs = src.display().to_string();
    let mut scp_args = vec!["--stats", "--", "scp", "-P", &p];
    scp_args.extend(opts);
    scp_args.extend([srcs.as_str(), dst.as_str()]);
    let out = run_for(&mut strait_run(&scp_args), Duration::from_secs(240)).expect("scp finished");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "scp: {err}");
    let copy = std::fs::read(dir.join("copy.bin")).expect("copy");
    assert!(copy == body, "the copy differs ({} of {} bytes)", copy.len(), body.len());
    assert_eq!(stat(&err, "accelerated"), 1, "scp: {err}");
}

/// Hands a socket to another process over a Unix socket (SCM_RIGHTS) and exits:
/// `conn` accepts one TCP connection first and passes it; `listener` passes the
/// listening socket itself (socket activation, a reload's hand-over).
const HANDOFF_SENDER: &str = r#"
import socket, sys
path, mode, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(('127.0.0.1', port))
l.listen(16)
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
u.connect(path)
if mode == 'conn':
    print('LISTENING', flush=True)
    c, _ = l.accept()
    socket.send_fds(u, [b'c'], [c.fileno()])
    c.close()
else:
    socket.send_fds(u, [b'l'], [l.fileno()])
    print('LISTENING', flush=True)
l.close()
u.recv(1)  # the receiver has it
"#;

/// A Python function for the receivers below (put before their text):
/// `take_fd(path)` listens on the Unix socket `path`, says `READY`, accepts one
/// connection and receives up to 4 descriptors on it; returns the connection, the
/// listener and the descriptors.
const PY_TAKE_FD: &str = r#"
import socket
def take_fd(path):
    l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    l.bind(path)
    l.listen(1)
    print('READY', flush=True)
    u, _ = l.accept()
    _, fds, _, _ = socket.recv_fds(u, 16, 4)
    return u, l, fds
"#;

/// Receives one socket over a Unix socket and serves on it: the stream both ways
/// (`conn`), or `n` one-line echoes on connections it accepts (`listener`) (after
/// [`PY_TAKE_FD`]).
const HANDOFF_RECEIVER: &str = r#"
import os, socket, sys
exec(open(sys.argv[3]).read())
path, mode = sys.argv[1], sys.argv[2]
n = int(sys.argv[4]) if len(sys.argv) > 4 else 0
u, s, fds = take_fd(path)
assert len(fds) == 1, fds
u.send(b'k')
got = socket.socket(fileno=fds[0])
if mode == 'conn':
    h, _ = pump(got.fileno(), got.fileno(), b'server')
    sys.exit(0 if h == expected(b'client') else 4)
for _ in range(n):
    c, _ = got.accept()
    c.settimeout(20)
    c.sendall(c.recv(100))
    c.close()
"#;

const LINES_CLIENT: &str = r#"
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    c = socket.create_connection(('127.0.0.1', port), timeout=20)
    m = b'line %d\n' % i
    c.sendall(m)
    assert c.recv(100) == m
    c.close()
print('LINES OK', n, flush=True)
"#;

/// Starts `cmd` with its output piped and waits for its first line to be `want`
/// (its stdout stays open, unread, so later lines never meet a closed pipe).
fn spawn_waiting(cmd: &mut std::process::Command, want: &str) -> std::process::Child {
    let (child, r) = common::spawn_until_line(cmd, want);
    // The rest of its output stays unread, the pipe open.
    std::mem::forget(r);
    child
}

fn stderr_of(mut c: std::process::Child, limit: Duration) -> (bool, String) {
    use std::io::Read;
    let end = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(s) = c.try_wait().expect("wait") {
            break Some(s);
        }
        if std::time::Instant::now() > end {
            let _ = c.kill();
            let _ = c.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut e = String::new();
    if let Some(mut s) = c.stderr.take() {
        let _ = s.read_to_string(&mut e);
    }
    (status.is_some_and(|s| s.success()), e)
}

/// What a handoff test observed: the client's output and the three processes'
/// statistics (stderr).
struct Handoff {
    client: std::process::Output,
    sender: (bool, String),
    receiver: (bool, String),
}

/// For a test of Python programs: makes sure python3 is there; returns a free port
/// and an empty directory named with `tag`.
fn python_port_and_dir(tag: &str) -> (String, PathBuf) {
    ensure(PYTHON, "python3");
    let port = free_port().to_string();
    let dir = std::env::temp_dir().join(format!("strait-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    (port, dir)
}

/// A receiver waiting on a Unix socket, a sender that passes it a socket of kind
/// `mode` (`conn` or `listener`) and exits, and a client (`client` script with
/// `client_args` after the port) under strait.
fn handoff(mode: &str, client: &str, client_args: &[&str], receiver_args: &[&str]) -> Handoff {
    let (port, dir) = python_port_and_dir(&format!("pass-{mode}"));
    let path = dir.join("handoff.sock").display().to_string();
    let snd = script(&format!("pass-send-{mode}"), HANDOFF_SENDER);
    let rcv = script(&format!("pass-recv-{mode}"), &[PY_TAKE_FD, HANDOFF_RECEIVER].concat());
    let cli = script(&format!("pass-cli-{mode}"), client);
    let st = script(&format!("pass-stream-{mode}"), STREAM).display().to_string();
    let mut rargs = vec!["--stats", "--", PYTHON, rcv.to_str().expect("p"), &path, mode, &st];
    rargs.extend_from_slice(receiver_args);
    let receiver = spawn_waiting(&mut strait_run(&rargs), "READY");
    let mut sender = Some(spawn_waiting(
        &mut strait_run(&["--stats", "--", PYTHON, snd.to_str().expect("p"), &path, mode, &port]),
        "LISTENING",
    ));
    // A passed listener's sender exits before the client comes (the harder case:
    // its rendezvous name is gone with it); a passed connection's needs the client.
    let early =
        if mode == "listener" { sender.take().map(|c| stderr_of(c, Duration::from_secs(30))) } else { None };
    let mut cargs = vec!["--stats", "--", PYTHON, cli.to_str().expect("p"), &port];
    cargs.extend_from_slice(client_args);
    // (Every connection set up, however short: what is tested is the hand-over,
    // not the choice of `STRAIT_SETUP`'s default.)
    let client = run_for(strait_run(&cargs).env("STRAIT_SETUP", "always"), Duration::from_secs(240))
        .expect("client finished");
    let sender = match (early, sender) {
        (Some(s), _) => s,
        (None, Some(c)) => stderr_of(c, Duration::from_secs(30)),
        (None, None) => (false, String::from("no sender")),
    };
    let receiver = stderr_of(receiver, Duration::from_secs(60));
    let _ = std::fs::remove_dir_all(&dir);
    Handoff { client, sender, receiver }
}

/// An accepted, accelerated connection handed to another process (which did not
/// make it and never saw it) over a Unix socket; the sender closes its copy and
/// exits. The receiver carries it on, accelerated, 64 MiB hashed each way.
#[test]
fn an_accelerated_connection_passed_over_a_unix_socket_keeps_working() {
    let st = script("pass-stream-conn-client", STREAM).display().to_string();
    let h = handoff("conn", STREAM_CLIENT, &[&st], &[]);
    let text = String::from_utf8_lossy(&h.client.stdout);
    let err = String::from_utf8_lossy(&h.client.stderr);
    let (rerr, serr) = (&h.receiver.1, &h.sender.1);
    assert!(
        h.client.status.success() && text.contains("STREAM ok"),
        "client: {text}\n{err}\nreceiver: {rerr}"
    );
    assert!(h.sender.0 && h.receiver.0, "sender: {serr}\nreceiver: {rerr}");
    assert_eq!(stat(&err, "accelerated"), 1, "client: {err}");
    assert_eq!(stat(serr, "pass-out"), 1, "sender: {serr}");
    assert_eq!(stat(rerr, "pass-in"), 1, "receiver: {rerr}");
}

/// A listening socket handed to another process, the sender closing its copy and
/// exiting: every connection the receiver accepts is accelerated.
#[test]
fn a_listening_socket_passed_over_a_unix_socket_accelerates_its_connections() {
    let h = handoff("listener", LINES_CLIENT, &["20"], &["20"]);
    let text = String::from_utf8_lossy(&h.client.stdout);
    let err = String::from_utf8_lossy(&h.client.stderr);
    let (rerr, serr) = (&h.receiver.1, &h.sender.1);
    assert!(h.client.status.success() && text.contains("LINES OK 20"), "client: {text}\n{err}");
    assert!(h.sender.0 && h.receiver.0, "sender: {serr}\nreceiver: {rerr}");
    assert_eq!(stat(&err, "accelerated"), 20, "client: {err}");
    assert_eq!(stat(rerr, "accelerated"), 20, "receiver: {rerr}");
}

/// A socket-activated service: systemd's socket activator listens, and on the first
/// connection execs the service with the listening socket as descriptor 3
/// (`LISTEN_FDS=1`), as systemd starts socket-activated daemons. Chosen because
/// socket activation is how many Debian services start, and the service never calls
/// `listen` itself: its library must find the listener it inherited. The service
/// starts slowly (half a second before its first `accept`, as a daemon loading its
/// configuration would), and the client starts a fifth of a second after the
/// activator's first connection, so its first connections arrive between the exec
/// and that accept: they are carried only if the service's library took the
/// listener's name back at once (`STRAIT_LISTENERS`, read by its constructor).
const ACTIVATED_SERVER: &str = r#"
import os, socket, sys, time
assert os.environ.get('LISTEN_FDS') == '1', os.environ.get('LISTEN_FDS')
assert 'STRAIT_LISTENERS' not in os.environ, 'the library took its handoff out of the environment'
time.sleep(0.5)
l = socket.socket(fileno=3)
for _ in range(int(sys.argv[1])):
    c, _ = l.accept()
    c.settimeout(20)
    c.sendall(c.recv(100))
    c.close()
"#;

#[test]
fn a_socket_activated_service_accelerates_the_connections_on_its_inherited_listener() {
    ensure(PYTHON, "python3");
    ensure("systemd-socket-activate", "systemd");
    let port = free_port().to_string();
    let (srv, cli) = (script("activated", ACTIVATED_SERVER), script("activated-cli", LINES_CLIENT));
    let listen = format!("127.0.0.1:{port}");
    let server = strait_run(&[
        "--stats",
        "--",
        "systemd-socket-activate",
        "-l",
        &listen,
        PYTHON,
        srv.to_str().expect("p"),
        "20",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("activator");
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect_timeout(&listen.parse().expect("addr"), Duration::from_millis(100))
        .is_err()
    {
        assert!(std::time::Instant::now() < end, "the activator never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    // (That probe was the service's first connection: it is started by it.) The
    // client comes while the service is still starting (see ACTIVATED_SERVER).
    std::thread::sleep(Duration::from_millis(200));
    let out = run_for(
        // (Every one of the short connections set up: see `handoff`.)
        strait_run(&["--stats", "--", PYTHON, cli.to_str().expect("p"), &port, "19"])
            .env("STRAIT_SETUP", "always"),
        Duration::from_secs(120),
    )
    .expect("client finished");
    let (sok, serr) = stderr_of(server, Duration::from_secs(30));
    let err = both_ok(&out, "LINES OK 19", (sok, &serr));
    assert_eq!(stat(&err, "accelerated"), 19, "client: {err}\nservice: {serr}");
}

/// Both ends in C (the signal-handler fork needs real asynchronous signals): the
/// server accepts, then blocks in `poll` on the connection (inside the library);
/// a SIGALRM handler forks there, and the child, from the handler, streams 64 MiB
/// each way (a word pattern both ends compute) and exits; the parent closes its
/// copy and waits. `client` connects, sends its pattern while it checks the
/// server's.
const SIGNAL_FORK_C: &str = r#"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define WORDS (64u << 17) /* 64 MiB of 8-byte words */
static int conn = -1;
static uint64_t next(uint64_t *x) { *x = *x * 6364136223846793005ull + 1442695040888963407ull; return *x; }

static int put(int fd, uint64_t seed) {
    uint64_t x = seed, buf[8192];
    for (uint32_t i = 0; i < WORDS; i += 8192) {
        for (int k = 0; k < 8192; k++) buf[k] = next(&x);
        size_t off = 0;
        while (off < sizeof buf) {
            ssize_t n = write(fd, (char *)buf + off, sizeof buf - off);
            if (n <= 0) return -1;
            off += n;
        }
    }
    return 0;
}

static int check(int fd, uint64_t seed) {
    uint64_t x = seed, buf[8192];
    for (uint32_t i = 0; i < WORDS; i += 8192) {
        size_t off = 0;
        while (off < sizeof buf) {
            ssize_t n = read(fd, (char *)buf + off, sizeof buf - off);
            if (n <= 0) return -1;
            off += n;
        }
        for (int k = 0; k < 8192; k++) if (buf[k] != next(&x)) return -2;
    }
    return 0;
}

static void on_alarm(int sig) {
    (void)sig;
    pid_t p = fork();
    if (p == 0) {
        int a = put(conn, 1), b = check(conn, 2);
        _exit(a == 0 && b == 0 ? 0 : 10 - b);
    }
}

static void *writer(void *arg) { (void)arg; return (void *)(intptr_t)put(conn, 2); }

int main(int argc, char **argv) {
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[2])) };
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (strcmp(argv[1], "server") == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 8)) return 2;
        printf("LISTENING\n");
        fflush(stdout);
        conn = accept(l, NULL, NULL);
        close(l);
        struct sigaction sa = { .sa_handler = on_alarm };
        sigaction(SIGALRM, &sa, NULL);
        alarm(1);
        /* Blocked in the library (poll on the accelerated socket, nothing to read
           until the child writes) when the signal arrives. */
        struct pollfd p = { .fd = conn, .events = POLLPRI };
        poll(&p, 1, 3000);
        close(conn);
        int st = 0;
        wait(&st);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 99;
    }
    conn = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(conn, (struct sockaddr *)&a, sizeof a)) return 2;
    pthread_t t;
    pthread_create(&t, NULL, writer, NULL);
    int r = check(conn, 1);
    void *w;
    pthread_join(t, &w);
    printf("STREAM %s\n", r == 0 && w == 0 ? "ok" : "BAD");
    return r == 0 && w == 0 ? 0 : 1;
}
"#;

#[test]
fn a_child_forked_from_a_signal_handler_carries_the_connection() {
    ensure("gcc", "gcc");
    let dir = std::env::temp_dir().join(format!("strait-sigfork-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let src = dir.join("sigfork.c");
    let bin = dir.join("sigfork");
    std::fs::write(&src, SIGNAL_FORK_C).expect("source");
    let cc = std::process::Command::new("gcc")
        .args(["-O2", "-pthread", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("gcc");
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let port = free_port().to_string();
    let b = bin.display().to_string();
    let server = spawn_waiting(&mut strait_run(&["--stats", "--", &b, "server", &port]), "LISTENING");
    let out = run_for(&mut strait_run(&["--stats", "--", &b, "client", &port]), Duration::from_secs(120))
        .expect("client finished in time");
    let (sok, serr) = stderr_of(server, Duration::from_secs(60));
    let _ = std::fs::remove_dir_all(&dir);
    let err = both_ok(&out, "STREAM ok", (sok, &serr));
    assert_eq!(stat(&err, "accelerated"), 1, "client: {err}");
}

/// A UDP socket that already receives through shared memory is passed to another
/// process, the sender keeping its copy and no longer reading: every datagram sent
/// afterwards reaches the receiver.
const UDP_PASS_SENDER: &str = r#"
import socket, sys, time
path, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(('127.0.0.1', port))
print('BOUND', flush=True)
b, a = s.recvfrom(100)          # the first datagram (shared memory when both run strait)
s.sendto(b, a)
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
u.connect(path)
socket.send_fds(u, [b'u'], [s.fileno()])
u.recv(1)
time.sleep(float(sys.argv[3]))  # keeps its copy, reads nothing
"#;

/// Receives the UDP socket and reads its datagrams (after [`PY_TAKE_FD`]).
const UDP_PASS_RECEIVER: &str = r#"
import socket, sys
path, n = sys.argv[1], int(sys.argv[2])
u, l, fds = take_fd(path)
s = socket.socket(fileno=fds[0])
u.send(b'k')
s.settimeout(10)
for _ in range(n):
    b, a = s.recvfrom(100)
    s.sendto(b, a)
"#;

const UDP_PASS_CLIENT: &str = r#"
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
c.settimeout(5)
c.sendto(b'first', ('127.0.0.1', port))
assert c.recv(100) == b'first'
print('FIRST OK', flush=True)
sys.stdin.readline()            # the socket has been passed
got = 0
for i in range(n):
    m = b'd%d' % i
    c.sendto(m, ('127.0.0.1', port))
    try:
        if c.recv(100) == m:
            got += 1
    except socket.timeout:
        pass
print('ECHOED', got, flush=True)
"#;

#[test]
fn a_udp_socket_passed_to_another_process_gets_every_later_datagram() {
    use std::io::{BufRead, Write};
    let (port, dir) = python_port_and_dir("udppass");
    let path = dir.join("h.sock").display().to_string();
    let (snd, rcv, cli) = (
        script("udppass-send", UDP_PASS_SENDER),
        script("udppass-recv", &[PY_TAKE_FD, UDP_PASS_RECEIVER].concat()),
        script("udppass-cli", UDP_PASS_CLIENT),
    );
    let receiver = spawn_waiting(
        &mut strait_run(&["--stats", "--", PYTHON, rcv.to_str().expect("p"), &path, "20"]),
        "READY",
    );
    let sender = spawn_waiting(
        &mut strait_run(&["--stats", "--", PYTHON, snd.to_str().expect("p"), &path, &port, "8"]),
        "BOUND",
    );
    let mut client = strait_run(&["--stats", "--", PYTHON, cli.to_str().expect("p"), &port, "20"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("client");
    let mut out = std::io::BufReader::new(client.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("FIRST OK");
    assert_eq!(line.trim(), "FIRST OK");
    // The pass happens once the sender answered the first datagram; give it a moment.
    std::thread::sleep(Duration::from_millis(300));
    client.stdin.take().expect("stdin").write_all(b"go\n").expect("go");
    line.clear();
    out.read_line(&mut line).expect("ECHOED");
    let (cok, cerr) = stderr_of(client, Duration::from_secs(60));
    let (rok, rerr) = stderr_of(receiver, Duration::from_secs(30));
    let _ = stderr_of(sender, Duration::from_secs(30));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(cok, "client: {cerr}");
    assert_eq!(line.trim(), "ECHOED 20", "client: {cerr}\nreceiver: {rerr}");
    assert!(rok, "receiver: {rerr}");
    assert!(stat(&cerr, "udp-out") >= 1, "the first datagram went through shared memory: {cerr}");
}

/// A raw clone (no fork handlers) noticed at the child's first library call: the
/// parent closes its copy at once, the child carries the connection, and its
/// statistics say it was noticed (`unseen-forks`).
const RAW_CLONE_SERVER: &str = r#"
import ctypes, os, socket, sys
exec(open(sys.argv[2]).read())
libc = ctypes.CDLL(None, use_errno=True)
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(('127.0.0.1', int(sys.argv[1])))
l.listen(8)
print('LISTENING', flush=True)
c, _ = l.accept()
l.close()
r = libc.syscall(56, 17, 0, 0, 0, 0)  # clone(SIGCHLD): a fork without handlers
if r == 0:
    got, n = pump(c.fileno(), c.fileno(), b'server')
    sys.exit(0 if got == expected(b'client') else 4)
c.close()
_, st = os.waitpid(r, 0)
sys.exit(os.WEXITSTATUS(st))
"#;

#[test]
fn a_raw_clone_is_noticed_at_its_first_call_and_carries_the_connection() {
    ensure(PYTHON, "python3");
    let port = free_port().to_string();
    let (srv, cli, st) = (
        script("rawclone", RAW_CLONE_SERVER),
        script("rawclone-cli", STREAM_CLIENT),
        script("rawclone-stream", STREAM),
    );
    let st = st.display().to_string();
    let server = spawn_waiting(
        strait_run(&["--stats", "--", PYTHON, srv.to_str().expect("p"), &port, &st])
            .env("STRAIT_IDENTITY_MIB", "4"),
        "LISTENING",
    );
    let out = run_for(
        strait_run(&["--stats", "--", PYTHON, cli.to_str().expect("p"), &port, &st])
            .env("STRAIT_IDENTITY_MIB", "4"),
        Duration::from_secs(120),
    )
    .expect("client finished");
    let (sok, serr) = stderr_of(server, Duration::from_secs(30));
    let err = both_ok(&out, "STREAM ok", (sok, &serr));
    assert_eq!(stat(&serr, "unseen-forks"), 1, "the child noticed it was new: {serr}");
    assert_eq!(stat(&err, "accelerated"), 1, "client: {err}");
}

/// The directory of PostgreSQL's server programs (`/usr/lib/postgresql/<version>/bin`,
/// outside PATH), the newest version installed.
fn postgresql_bin() -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.path().join("bin")))
                .filter(|b| b.join("postgres").exists())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs.pop().expect("PostgreSQL's server is missing: run scripts/install-deps (it installs postgresql)")
}

/// Stops a PostgreSQL server (fast shutdown: SIGINT to the postmaster) when
/// dropped, and removes its directory.
struct Postgres {
    child: Option<std::process::Child>,
    dir: PathBuf,
}

impl Postgres {
    /// Stops the server (its backends end first, then the postmaster), at most 30 s;
    /// returns its log (the server's and every process's `--stats` line).
    fn stop(&mut self) -> String {
        if let Some(mut c) = self.child.take() {
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGINT) };
            let end = std::time::Instant::now() + Duration::from_secs(30);
            while c.try_wait().ok().flatten().is_none() && std::time::Instant::now() < end {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// psql (`bin`'s) under strait or not, as root, running `sql` with its answer
/// unaligned; (success, stdout, stderr).
fn psql(bin: &std::path::Path, port: &str, under_strait: bool, sql: &str) -> (bool, String, String) {
    let psql = bin.join("psql");
    let args =
        ["-X", "-h", "127.0.0.1", "-p", port, "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-At", "-c", sql];
    let mut c = if under_strait {
        let mut c = strait_run(&["--stats", "--", psql.to_str().expect("path")]);
        c.args(args);
        c
    } else {
        let mut c = std::process::Command::new(&psql);
        c.args(args).env_remove("LD_PRELOAD");
        c
    };
    let out = run_for(&mut c, Duration::from_secs(60)).expect("psql finished in time");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// PostgreSQL as Debian runs it, a server of its own user: the postmaster (user
/// `postgres`, dropped to by setpriv before it starts) accepts each connection
/// and forks a backend for it, which takes the connection over (the postmaster
/// closes its copy) and sleeps on latches that signals wake. The clients (psql,
/// pgbench) run as root: two users, every connection accelerated, the answers
/// the same through strait as through the kernel, every pgbench transaction
/// done. Chosen beside OpenSSH and the socket-activated service because it is
/// the common database server whose process-per-connection design moves every
/// accepted socket into a forked child.
#[test]
fn postgresql_as_its_own_user_serves_psql_and_pgbench_accelerated() {
    if !root_or_skip("PostgreSQL's server runs as its own user (needs root to switch)") {
        return;
    }
    ensure("setpriv", "util-linux");
    let bin = postgresql_bin();
    let dir = std::env::temp_dir().join(format!("strait-identity-pg-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let owner = |uid: &str| {
        let st = std::process::Command::new("chown").args([uid, dir.to_str().expect("dir")]).status();
        assert!(st.is_ok_and(|s| s.success()), "chown {uid}");
    };
    owner("postgres:postgres");
    let data = dir.join("data");
    let as_postgres = ["--reuid=postgres", "--regid=postgres", "--clear-groups", "--inh-caps=-all"];
    let init = run_for(
        std::process::Command::new("setpriv")
            .args(as_postgres)
            .arg(bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .env_remove("LD_PRELOAD"),
        Duration::from_secs(120),
    )
    .expect("initdb finished in time");
    assert!(init.status.success(), "initdb: {}", String::from_utf8_lossy(&init.stderr));
    let port = free_port().to_string();
    let log = std::fs::File::create(dir.join("server.log")).expect("log");
    let child = strait_run(&["--stats", "--", "setpriv"])
        .args(as_postgres)
        .arg(bin.join("postgres"))
        .args(["-D", data.to_str().expect("data"), "-p", &port, "-k", dir.to_str().expect("dir")])
        .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=20"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("postgres");
    let mut server = Postgres { child: Some(child), dir: dir.clone() };
    let ready = std::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(dir.join("server.log"))
        .unwrap_or_default()
        .contains("ready to accept connections")
    {
        assert!(std::time::Instant::now() < ready, "postgres never got ready: {}", server.stop());
        std::thread::sleep(Duration::from_millis(50));
    }
    // A table written and read through strait, and read again through the kernel:
    // 20,000 rows, their digest and a 640 KB answer.
    let setup = "create table t(i int primary key, s text); \
                 insert into t select g, md5(g::text) from generate_series(1, 20000) g";
    let (ok, _, err) = psql(&bin, &port, true, setup);
    assert!(ok, "{err}");
    let mut clients = err;
    let digest = "select count(*), md5(string_agg(s, ',' order by i)) from t";
    let big = "select string_agg(s, '' order by i) from t";
    for sql in [digest, big] {
        let (ok, via_strait, err) = psql(&bin, &port, true, sql);
        assert!(ok, "{err}");
        clients.push_str(&err);
        let (ok, via_kernel, err) = psql(&bin, &port, false, sql);
        assert!(ok, "{err}");
        assert_eq!(via_strait, via_kernel, "{sql}");
        if sql == digest {
            assert!(via_strait.starts_with("20000|"), "{via_strait}");
        } else {
            assert_eq!(via_strait.trim_end().len(), 20000 * 32);
        }
    }
    // pgbench's own tables, then 4 clients of 250 transactions each (TPC-B-like:
    // updates, an insert and a select per transaction).
    let pgbench = |args: &[&str]| {
        let mut c = strait_run(&["--stats", "--", bin.join("pgbench").to_str().expect("path")]);
        c.args(["-h", "127.0.0.1", "-p", &port, "-U", "postgres"]).args(args).arg("postgres");
        let out = run_for(&mut c, Duration::from_secs(120)).expect("pgbench finished in time");
        let (text, err) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert!(out.status.success(), "pgbench {args:?}: {text}\n{err}");
        (text, err)
    };
    let (_, err) = pgbench(&["-i", "-s", "1", "-q"]);
    clients.push_str(&err);
    let (text, err) = pgbench(&["-c", "4", "-j", "2", "-t", "250"]);
    clients.push_str(&err);
    assert!(text.contains("number of transactions actually processed: 1000/1000"), "{text}");
    assert!(text.contains("number of failed transactions: 0"), "{text}");
    // Every client connection accelerated: 3 psql, pgbench -i's 1 and the run's 4
    // and its first look at the server, none back to the kernel.
    assert!(stat(&clients, "accelerated") >= 9, "{clients}");
    assert_eq!(stat(&clients, "kernel-fallback"), 0, "{clients}");
    // The server's side: each backend counts the connection it was forked for
    // (the postmaster accepted it); every one of the clients' is there.
    let log = server.stop();
    assert!(stat(&log, "accelerated") >= stat(&clients, "accelerated"), "{log}\n{clients}");
    assert_eq!(stat(&log, "kernel-fallback"), 0, "{log}");
}
