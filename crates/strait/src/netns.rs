//! Two network namespaces joined by a veth pair, made for `strait bench
//! --across-netns` and removed when dropped.

use std::io;

use strait_sys::netns;
use thiserror::Error;

/// Why the namespaces could not be set up.
#[derive(Debug, Error)]
pub enum NetnsError {
    /// An `ip` command failed.
    #[error("`ip {args}` failed: {why} (creating namespaces needs root and iproute2)")]
    Ip {
        /// Its arguments.
        args: String,
        /// Its error output or spawn error.
        why: String,
    },
    /// Entering a namespace failed.
    #[error("entering network namespace {ns}: {source}")]
    Enter {
        /// The namespace.
        ns: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// One end of the pair.
#[derive(Debug, Clone)]
pub struct End {
    /// Namespace name (under /run/netns).
    pub ns: String,
    /// Interface name inside it.
    pub ifname: String,
    /// Its MAC, `aa:bb:cc:dd:ee:ff`.
    pub mac: String,
    /// Its IPv4 address (empty on the raw-Ethernet pair).
    pub ip: String,
}

/// The namespaces and the veth pairs between them.
#[derive(Debug)]
pub struct VethPair {
    /// The driver's end and the peer's end (with IPv4 addresses).
    pub ends: [End; 2],
    /// A second veth pair between the same namespaces, without addresses, for raw
    /// Ethernet: an XDP program attached to a veth makes it take every packet
    /// through its XDP path (no large GSO packets), which would slow the kernel
    /// transports measured beside it.
    pub raw: [End; 2],
}

impl From<netns::IpError> for NetnsError {
    fn from(e: netns::IpError) -> NetnsError {
        NetnsError::Ip { args: e.args, why: e.why }
    }
}

fn ip(args: &[&str]) -> Result<(), NetnsError> {
    Ok(netns::ip(args)?)
}

impl VethPair {
    /// Creates `<tag>a` and `<tag>b` joined by a veth pair with fixed MACs and
    /// addresses `10.213.<n>.1/2`.
    pub fn create(tag: &str) -> Result<VethPair, NetnsError> {
        let n = std::process::id() % 250;
        let end = |side: char, host: u8| End {
            ns: format!("{tag}{side}"),
            ifname: format!("{tag}{side}0"),
            mac: format!("02:5b:00:00:{n:02x}:{host:02x}"),
            ip: format!("10.213.{n}.{host}"),
        };
        let raw = |side: char, host: u8| End {
            ifname: format!("{tag}{side}1"),
            mac: format!("02:5b:00:01:{n:02x}:{host:02x}"),
            ip: String::new(),
            ..end(side, host)
        };
        let pair = VethPair { ends: [end('a', 1), end('b', 2)], raw: [raw('a', 1), raw('b', 2)] };
        for e in &pair.ends {
            // A namespace left by a crashed run of the same name goes first.
            netns::delete_namespace(&e.ns);
        }
        let [a, b] = &pair.ends;
        netns::add_veth_namespaces([&a.ns, &b.ns], [&a.ifname, &b.ifname])?;
        for e in &pair.ends {
            ip(&["-n", &e.ns, "link", "set", &e.ifname, "address", &e.mac, "up"])?;
            ip(&["-n", &e.ns, "addr", "add", &format!("{}/24", e.ip), "dev", &e.ifname])?;
            ip(&["-n", &e.ns, "link", "set", "lo", "up"])?;
            // Pin the neighbour so no ARP exchange lands inside a measurement.
        }
        let [ra, rb] = &pair.raw;
        netns::add_veth([&ra.ns, &rb.ns], [&ra.ifname, &rb.ifname])?;
        for e in &pair.raw {
            ip(&["-n", &e.ns, "link", "set", &e.ifname, "address", &e.mac, "up"])?;
        }
        ip(&["-n", &a.ns, "neigh", "replace", &b.ip, "lladdr", &b.mac, "dev", &a.ifname])?;
        ip(&["-n", &b.ns, "neigh", "replace", &a.ip, "lladdr", &a.mac, "dev", &b.ifname])?;
        Ok(pair)
    }

    /// Moves the calling thread into end `i`'s namespace (sockets it creates from
    /// now on live there; so do the processes it spawns).
    pub fn enter(&self, i: usize) -> Result<(), NetnsError> {
        let ns = &self.ends[i].ns;
        netns::enter(ns).map_err(|source| NetnsError::Enter { ns: ns.clone(), source })
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        for e in &self.ends {
            netns::delete_namespace(&e.ns);
        }
    }
}
