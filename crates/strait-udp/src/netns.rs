//! Two network namespaces joined by a veth pair, for the real-network tests and the
//! benchmark (needs root and iproute2's `ip`; loss injection needs `iptables`).
//!
//! Sockets are made inside a namespace by a short-lived thread that enters it
//! (`setns` changes only the calling thread's network namespace); a socket keeps
//! its namespace for life, so both ends of a connection can then be driven from
//! one process, each by its own thread, over the real kernel path between the
//! namespaces.
//!
//! ```no_run
//! # fn main() -> std::io::Result<()> {
//! let pair = strait_udp::netns::VethPair::create()?; // removed on drop
//! let (a, b) = pair.udp_pair(false)?;                // connected to each other
//! pair.set_loss(1, 0.01)?;                           // 1% of what B receives is dropped
//! # let _ = (a, b); Ok(()) }
//! ```

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use strait_sys::netns;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Two namespaces, `ns[0]` and `ns[1]`, with a veth pair between them:
/// 10.77.0.1/24 and fd77::1/64 in `ns[0]`, 10.77.0.2 and fd77::2 in `ns[1]`.
/// Dropping it deletes both namespaces (and so the pair), also during a panic.
#[derive(Debug)]
pub struct VethPair {
    /// Namespace names (under `/run/netns`).
    pub ns: [String; 2],
    /// Interface names (one in each namespace).
    pub dev: [String; 2],
    /// IPv4 addresses.
    pub v4: [Ipv4Addr; 2],
    /// IPv6 addresses.
    pub v6: [Ipv6Addr; 2],
}

fn run(cmd: &mut Command) -> io::Result<Output> {
    let out = cmd.stdin(Stdio::null()).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{:?} failed: {}",
            cmd,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(out)
}

fn has(tool: &str) -> bool {
    Command::new(tool).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok()
}

/// Checks that `iptables` is installed. Tests never install anything:
/// `scripts/install-deps`, which the test command runs first, does it once.
pub fn ensure_iptables() -> io::Result<()> {
    if has("iptables") {
        Ok(())
    } else {
        Err(io::Error::other("iptables is missing: run scripts/install-deps before the tests"))
    }
}

impl VethPair {
    /// Creates the namespaces and the pair (unique names per process and call).
    pub fn create() -> io::Result<Self> {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let id = format!("{:x}x{n}", std::process::id());
        let p = VethPair {
            ns: [format!("strait-udp-{id}-a"), format!("strait-udp-{id}-b")],
            dev: [format!("su{id}a"), format!("su{id}b")],
            v4: [Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 2)],
            v6: [Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 1), Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 2)],
        };
        // From here on, Drop cleans up whatever was made.
        netns::add_veth_namespaces([&p.ns[0], &p.ns[1]], [&p.dev[0], &p.dev[1]])?;
        for i in 0..2 {
            let (ns, dev) = (p.ns[i].as_str(), p.dev[i].as_str());
            netns::ip(&["-n", ns, "addr", "add", &format!("{}/24", p.v4[i]), "dev", dev])?;
            netns::ip(&["-n", ns, "addr", "add", &format!("{}/64", p.v6[i]), "dev", dev, "nodad"])?;
            netns::ip(&["-n", ns, "link", "set", dev, "up"])?;
            netns::ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(p)
    }

    /// Address of side `i` (0 or 1), IPv4 or IPv6.
    pub fn addr(&self, i: usize, v6: bool) -> IpAddr {
        if v6 {
            IpAddr::V6(self.v6[i])
        } else {
            IpAddr::V4(self.v4[i])
        }
    }

    /// Runs `f` on a thread inside namespace `i` and returns its result.
    pub fn in_ns<T: Send>(&self, i: usize, f: impl FnOnce() -> T + Send) -> io::Result<T> {
        netns::within(Some(&self.ns[i]), || Ok(f()))
    }

    /// A UDP socket in namespace `i`, bound to its address and port `port` (0 =
    /// any), not connected.
    pub fn udp_socket(&self, i: usize, v6: bool, port: u16) -> io::Result<UdpSocket> {
        let a = SocketAddr::new(self.addr(i, v6), port);
        self.in_ns(i, || UdpSocket::bind(a))?
    }

    /// Two UDP sockets, one per namespace, connected to each other.
    pub fn udp_pair(&self, v6: bool) -> io::Result<(UdpSocket, UdpSocket)> {
        let a = self.udp_socket(0, v6, 0)?;
        let b = self.udp_socket(1, v6, 0)?;
        a.connect(b.local_addr()?)?;
        b.connect(a.local_addr()?)?;
        Ok((a, b))
    }

    /// A TCP connection across the pair: (side 0, side 1), with `TCP_NODELAY` set.
    pub fn tcp_pair(&self) -> io::Result<(TcpStream, TcpStream)> {
        let l: TcpListener =
            self.in_ns(1, || TcpListener::bind(SocketAddr::new(self.addr(1, false), 0)))??;
        let to = l.local_addr()?;
        let a = self.in_ns(0, || TcpStream::connect(to))??;
        let (b, _) = l.accept()?;
        a.set_nodelay(true)?;
        b.set_nodelay(true)?;
        Ok((a, b))
    }

    /// Drops a random fraction `p` of the packets side `i` receives (an iptables
    /// `statistic` rule in its namespace); replaces any earlier rule. `p == 0`
    /// removes it.
    pub fn set_loss(&self, i: usize, p: f64) -> io::Result<()> {
        self.set_random_rule(i, "filter", "INPUT", &[], p, &["DROP"])
    }

    /// Marks a random fraction `p` of the ECN-capable (ECT(0)) UDP datagrams that
    /// arrive at side `i` Congestion Experienced, as a router's AQM would instead of
    /// dropping them (iptables' `TOS` target on the mangle table's `PREROUTING`;
    /// this kernel has no marking qdisc). 0 removes the rules.
    pub fn set_ce_marking(&self, i: usize, p: f64) -> io::Result<()> {
        let ect0 = ["-p", "udp", "-m", "tos", "--tos", "0x02/0x03"];
        self.set_random_rule(i, "mangle", "PREROUTING", &ect0, p, &["TOS", "--set-tos", "0x03/0x03"])
    }

    /// Replaces side `i`'s rules of `chain` in `table` (IPv4 and IPv6) with one that
    /// sends a random fraction `p` of the packets that match `matches` to `target`;
    /// 0 leaves the chain empty.
    fn set_random_rule(
        &self,
        i: usize,
        table: &str,
        chain: &str,
        matches: &[&str],
        p: f64,
        target: &[&str],
    ) -> io::Result<()> {
        ensure_iptables()?;
        let (on, p) = (p > 0.0, format!("{p}"));
        for tool in ["iptables", "ip6tables"] {
            self.exec(i, &[tool, "-t", table, "-F", chain])?;
            if on {
                let mut args = vec![tool, "-t", table, "-A", chain];
                args.extend_from_slice(matches);
                args.extend_from_slice(&["-m", "statistic", "--mode", "random", "--probability", &p, "-j"]);
                args.extend_from_slice(target);
                self.exec(i, &args)?;
            }
        }
        Ok(())
    }

    /// Datagrams side `i`'s marking rules marked CE so far (IPv4 and IPv6).
    pub fn ce_marked(&self, i: usize) -> io::Result<u64> {
        self.rule_packets(i, "mangle", "PREROUTING", "TOS")
    }

    /// Packets dropped so far by side `i`'s loss rules (IPv4 and IPv6).
    pub fn dropped(&self, i: usize) -> io::Result<u64> {
        self.rule_packets(i, "filter", "INPUT", "DROP")
    }

    /// Packets that side `i`'s rules of `chain` in `table` with target `target`
    /// matched so far (IPv4 and IPv6).
    fn rule_packets(&self, i: usize, table: &str, chain: &str, target: &str) -> io::Result<u64> {
        let mut total = 0;
        for tool in ["iptables", "ip6tables"] {
            let out = run(Command::new("ip").args([
                "netns",
                "exec",
                &self.ns[i],
                tool,
                "-t",
                table,
                "-L",
                chain,
                "-v",
                "-n",
                "-x",
            ]))?;
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if line.split_whitespace().nth(2) == Some(target) {
                    total += line.split_whitespace().next().and_then(|w| w.parse::<u64>().ok()).unwrap_or(0);
                }
            }
        }
        Ok(total)
    }

    /// A command that runs inside namespace `i` (`ip netns exec NS`); the caller adds
    /// the program and its arguments.
    pub fn command(&self, i: usize) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[i]]);
        c
    }

    /// The IPv4 subnet of the pair (`10.77.0.0/24`).
    pub fn subnet_v4(&self) -> String {
        let o = self.v4[0].octets();
        format!("{}.{}.{}.0/24", o[0], o[1], o[2])
    }

    /// Runs a command inside namespace `i` (`ip netns exec`).
    pub fn exec(&self, i: usize, args: &[&str]) -> io::Result<Output> {
        run(Command::new("ip").args(["netns", "exec", &self.ns[i]]).args(args))
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        for ns in &self.ns {
            netns::delete_namespace(ns);
        }
    }
}
