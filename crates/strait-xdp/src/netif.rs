//! Interface facts (index, MAC, MTU) and the neighbour table that maps peers'
//! addresses to MACs.

use std::collections::HashMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use crate::XdpError;

/// An Ethernet address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Mac(pub [u8; 6]);

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(f, "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2], b[3], b[4], b[5])
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Mac {
    type Err = XdpError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || XdpError::Config(format!("{s:?} is not a MAC address (aa:bb:cc:dd:ee:ff)"));
        let mut out = [0u8; 6];
        let mut parts = s.trim().split(':');
        for b in &mut out {
            let p = parts.next().ok_or_else(bad)?;
            if p.len() != 2 {
                return Err(bad());
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(Mac(out))
    }
}

/// One interface query by ioctl on a throwaway socket: answers for the calling
/// thread's network namespace (sysfs would answer for the mounter's).
fn ifreq(ifname: &str, request: libc::c_ulong, what: &'static str) -> Result<libc::ifreq, XdpError> {
    if ifname.is_empty() || ifname.len() >= libc::IFNAMSIZ || ifname.contains('\0') {
        return Err(XdpError::Config(format!("bad interface name {ifname:?}")));
    }
    // SAFETY: an all-zero ifreq is a valid value of this plain C struct.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(ifname.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: plain socket creation.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(XdpError::Io { op: what, source: std::io::Error::last_os_error() });
    }
    // SAFETY: `req` is a live ifreq; the request reads the name and fills one union
    // member.
    let r = unsafe { libc::ioctl(fd, request as _, &mut req) };
    let e = std::io::Error::last_os_error();
    // SAFETY: closes the socket made above.
    unsafe { libc::close(fd) };
    if r < 0 {
        return Err(XdpError::Interface { ifname: ifname.to_owned(), source: e });
    }
    Ok(req)
}

/// The interface's index.
pub fn ifindex(ifname: &str) -> Result<u32, XdpError> {
    let r = ifreq(ifname, libc::SIOCGIFINDEX, "query the interface index")?;
    // SAFETY: SIOCGIFINDEX filled the index member.
    Ok(unsafe { r.ifr_ifru.ifru_ifindex } as u32)
}

/// The interface's MAC.
pub fn mac(ifname: &str) -> Result<Mac, XdpError> {
    let r = ifreq(ifname, libc::SIOCGIFHWADDR, "query the interface MAC")?;
    // SAFETY: SIOCGIFHWADDR filled the hardware-address member.
    let sa = unsafe { r.ifr_ifru.ifru_hwaddr };
    let mut m = [0u8; 6];
    for (d, s) in m.iter_mut().zip(sa.sa_data.iter()) {
        *d = *s as u8;
    }
    Ok(Mac(m))
}

/// The interface's MTU (bytes of payload per Ethernet frame).
pub fn mtu(ifname: &str) -> Result<usize, XdpError> {
    let r = ifreq(ifname, libc::SIOCGIFMTU, "query the interface MTU")?;
    // SAFETY: SIOCGIFMTU filled the MTU member.
    Ok(unsafe { r.ifr_ifru.ifru_mtu }.max(0) as usize)
}

/// Peers' MACs by IPv4 address: entries set by hand, else the kernel's ARP cache
/// for the interface.
#[derive(Debug, Default, Clone)]
pub struct Neighbours {
    fixed: HashMap<Ipv4Addr, Mac>,
}

impl Neighbours {
    /// An empty table (lookups fall through to the kernel's cache).
    pub fn new() -> Self {
        Self::default()
    }

    /// Pins `ip` to `mac`.
    pub fn insert(&mut self, ip: Ipv4Addr, mac: Mac) {
        self.fixed.insert(ip, mac);
    }

    /// The MAC of `ip` on `ifname`.
    pub fn resolve(&self, ifname: &str, ip: Ipv4Addr) -> Result<Mac, XdpError> {
        if let Some(m) = self.fixed.get(&ip) {
            return Ok(*m);
        }
        let arp = std::fs::read_to_string("/proc/net/arp")
            .map_err(|source| XdpError::Interface { ifname: ifname.to_owned(), source })?;
        parse_arp(&arp, ifname, ip).ok_or_else(|| {
            XdpError::Config(format!(
                "no neighbour entry for {ip} on {ifname} (reach it once over IP, or pin its MAC)"
            ))
        })
    }
}

/// Finds a complete entry for `ip` on `ifname` in /proc/net/arp's text.
fn parse_arp(text: &str, ifname: &str, ip: Ipv4Addr) -> Option<Mac> {
    text.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // IP address, HW type, Flags, HW address, Mask, Device
        if f.len() < 6 || f[5] != ifname || f[0].parse::<Ipv4Addr>().ok()? != ip {
            return None;
        }
        let complete = u32::from_str_radix(f[2].trim_start_matches("0x"), 16).ok()? & 0x2 != 0;
        if !complete {
            return None;
        }
        f[3].parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_parse_and_print() {
        let m: Mac = "02:1a:ff:00:09:7e".parse().unwrap();
        assert_eq!(m.0, [2, 0x1a, 0xff, 0, 9, 0x7e]);
        assert_eq!(m.to_string(), "02:1a:ff:00:09:7e");
        for bad in ["", "02:1a:ff:00:09", "02:1a:ff:00:09:7e:01", "0g:1a:ff:00:09:7e", "2:1a:ff:00:09:7e"] {
            assert!(bad.parse::<Mac>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn arp_cache_lines_resolve() {
        let text = "IP address       HW type     Flags       HW address            Mask     Device\n\
                    10.9.0.2         0x1         0x2         02:00:00:00:00:02     *        sv0\n\
                    10.9.0.3         0x1         0x0         00:00:00:00:00:00     *        sv0\n\
                    10.9.0.2         0x1         0x2         02:00:00:00:00:99     *        other\n";
        let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        assert_eq!(parse_arp(text, "sv0", ip("10.9.0.2")), Some(Mac([2, 0, 0, 0, 0, 2])));
        assert_eq!(parse_arp(text, "sv0", ip("10.9.0.3")), None, "incomplete entry");
        assert_eq!(parse_arp(text, "other", ip("10.9.0.2")), Some(Mac([2, 0, 0, 0, 0, 0x99])));
        assert_eq!(parse_arp(text, "sv0", ip("10.9.0.4")), None);
    }
}
