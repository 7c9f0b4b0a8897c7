//! `strait run [--] CMD ARGS...`: runs an unchanged program with
//! `libstrait_preload.so` preloaded, so that its local TCP connections to other
//! `strait run` processes go through shared memory.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use clap::Args;

/// Checks a `--peers` list: addresses or address/prefix, comma-separated.
fn parse_peers(v: &str) -> Result<String, String> {
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (addr, bits) = item.split_once('/').map_or((item, None), |(a, b)| (a, Some(b)));
        let ip: std::net::IpAddr =
            addr.parse().map_err(|_| format!("{item:?} is not an IP address or subnet"))?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        if let Some(b) = bits {
            match b.parse::<u32>() {
                Ok(n) if n <= max => {}
                _ => return Err(format!("{item:?}: prefix length must be 0..={max}")),
            }
        }
    }
    Ok(v.to_string())
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Bytes of each direction's shared-memory ring per connection (power of two,
    /// 4K to 1G; K/M suffixes). Sets STRAIT_RING_SIZE.
    #[arg(long)]
    ring_size: Option<String>,
    /// Microseconds a blocked call busy-polls before it sleeps. Sets STRAIT_SPIN_US.
    #[arg(long)]
    spin_us: Option<u64>,
    /// Longest wait, in milliseconds, of a connecting side for the accepting side to
    /// attach before the connection stays on the kernel. Sets STRAIT_ATTACH_TIMEOUT_MS.
    #[arg(long)]
    attach_timeout_ms: Option<u64>,
    /// Print one line per process on stderr at exit with its accelerated and
    /// kernel-fallback connection counts. Sets STRAIT_STATS=1.
    #[arg(long)]
    stats: bool,
    /// Hosts whose TCP connections strait may carry over its udp device when they run
    /// strait too: addresses or subnets, comma-separated (10.0.0.2,fd00::/64). Sets
    /// STRAIT_PEERS.
    #[arg(long, value_parser = parse_peers)]
    peers: Option<String>,
    /// File holding a secret shared with the peers (16 to 4096 bytes, mode 600, owned
    /// by this user): discovery and every data packet of connections to other hosts
    /// are authenticated with it, and a peer without the same secret stays on the
    /// kernel. Checked before the program starts. Sets STRAIT_PEERS_SECRET_FILE.
    #[arg(long, value_name = "FILE")]
    peers_secret: Option<PathBuf>,
    /// Carry connections to peers on the same link over the AF_XDP raw-Ethernet
    /// device when both ends have it (attaches an XDP program to the interface; needs
    /// CAP_NET_ADMIN and CAP_BPF). Sets STRAIT_XDP=1.
    #[arg(long)]
    xdp: bool,
    /// Keep message boundaries on connections whose two ends both ask for it: each
    /// write is one message, and a read returns bytes of one message only. Sets
    /// STRAIT_MESSAGES=1.
    #[arg(long)]
    messages: bool,
    /// Smallest read buffer, in bytes, that a waiting reader offers for rendezvous (a
    /// large write goes straight into it: one copy instead of two), and smallest write
    /// that takes one (K/M suffixes; default 64K). Sets STRAIT_RENDEZVOUS_MIN.
    #[arg(long)]
    rendezvous_min: Option<String>,
    /// Path of libstrait_preload.so (default: $STRAIT_PRELOAD_LIB, else next to the
    /// strait binary).
    #[arg(long)]
    preload: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

/// Replaces this process with the command (returns only on failure).
pub fn run(a: RunArgs) -> ExitCode {
    let lib = match strait::preload::find_lib(a.preload) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("strait run: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut preload = OsString::from(lib.as_os_str());
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(" ");
        preload.push(old);
    }
    // A secret asked for (flag or variable) must be usable: the library could only
    // leave remote connections on the kernel, so refuse here, before the program runs.
    let secret = match &a.peers_secret {
        Some(p) => strait_core::load_secret_file("--peers-secret", p).map(|_| Some(p.clone())),
        None => strait_core::secret_from_env().map(|_| None),
    };
    let secret = match secret {
        Ok(Some(p)) => match p.canonicalize() {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("strait run: --peers-secret {}: {e}", p.display());
                return ExitCode::from(2);
            }
        },
        Ok(None) => None,
        Err(e) => {
            eprintln!("strait run: {e}");
            return ExitCode::from(2);
        }
    };
    let mut cmd = Command::new(&a.command[0]);
    cmd.args(&a.command[1..]).env("LD_PRELOAD", preload);
    if let Some(v) = a.ring_size {
        cmd.env("STRAIT_RING_SIZE", v);
    }
    if let Some(v) = a.spin_us {
        cmd.env("STRAIT_SPIN_US", v.to_string());
    }
    if let Some(v) = a.attach_timeout_ms {
        cmd.env("STRAIT_ATTACH_TIMEOUT_MS", v.to_string());
    }
    if a.stats {
        cmd.env("STRAIT_STATS", "1");
    }
    if let Some(v) = a.peers {
        cmd.env("STRAIT_PEERS", v);
    }
    if let Some(p) = secret {
        cmd.env(strait_core::SECRET_ENV, p);
    }
    if a.xdp {
        cmd.env("STRAIT_XDP", "1");
    }
    if a.messages {
        cmd.env("STRAIT_MESSAGES", "1");
    }
    if let Some(v) = a.rendezvous_min {
        cmd.env("STRAIT_RENDEZVOUS_MIN", v);
    }
    let e = cmd.exec();
    eprintln!("strait run: cannot run {}: {e}", a.command[0].to_string_lossy());
    ExitCode::from(if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 })
}
