//! The addresses of this network namespace's own interfaces (besides loopback), for
//! deciding which destinations can be strait peers on this host.
//!
//! Read with `getifaddrs` and cached: a known address costs no system call for a
//! second; an unknown one re-reads the list at most every 100 ms (so a remote
//! destination costs one `getifaddrs` per 100 ms at most, and a newly added address
//! is seen within 100 ms). Only interfaces that are up count (the kernel removes the
//! local routes of an interface that goes down). IPv6 link-local addresses need a
//! scope, which the address key does not carry: they are not accelerated.

use std::sync::RwLock;
use std::time::{Duration, Instant};

/// How long a known address is trusted without reading the list again.
const HIT_AGE: Duration = Duration::from_secs(1);
/// How often at most an unknown address reads the list again.
const MISS_AGE: Duration = Duration::from_millis(100);

struct Cache {
    addrs: Vec<[u8; 16]>,
    at: Option<Instant>,
}

static CACHE: RwLock<Cache> = RwLock::new(Cache { addrs: Vec::new(), at: None });

/// `a` (an address key: IPv4 as `::ffff:a.b.c.d`) is assigned to an interface of
/// this network namespace that is up. Loopback addresses are the callers' business.
pub fn host_address(a: &[u8; 16]) -> bool {
    if !usable(a) {
        return false;
    }
    let now = Instant::now();
    // Never blocks: a forked child may inherit the lock held by a thread that does
    // not exist there, and a refresh under way should not stall a connect.
    if let Ok(c) = CACHE.try_read() {
        if let Some(at) = c.at {
            let age = now.saturating_duration_since(at);
            let hit = c.addrs.contains(a);
            if (hit && age < HIT_AGE) || (!hit && age < MISS_AGE) {
                return hit;
            }
        }
    }
    let Some(fresh) = read_addresses() else { return false };
    let hit = fresh.contains(a);
    if let Ok(mut c) = CACHE.try_write() {
        c.addrs = fresh;
        c.at = Some(now);
    }
    hit
}

/// Not the unspecified address, not IPv6 link-local (it needs a scope id).
fn usable(a: &[u8; 16]) -> bool {
    let v4 = a[..10].iter().all(|&b| b == 0) && a[10] == 0xff && a[11] == 0xff;
    if v4 {
        a[12..] != [0, 0, 0, 0]
    } else {
        *a != [0u8; 16] && !(a[0] == 0xfe && a[1] & 0xc0 == 0x80)
    }
}

/// The addresses of the interfaces that are up, as keys.
fn read_addresses() -> Option<Vec<[u8; 16]>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut out = Vec::new();
    let mut p = head;
    while !p.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as libc::c_uint == 0 {
            continue;
        }
        // SAFETY: ifa_addr points at a socket address of its family's size.
        let fam = unsafe { (*ifa.ifa_addr).sa_family } as libc::c_int;
        let mut k = [0u8; 16];
        match fam {
            libc::AF_INET => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let s = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
                k[10] = 0xff;
                k[11] = 0xff;
                k[12..].copy_from_slice(&s.sin_addr.s_addr.to_ne_bytes());
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let s = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
                k = s.sin6_addr.s6_addr;
            }
            _ => continue,
        }
        if usable(&k) && !out.contains(&k) {
            out.push(k);
        }
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut k = [0u8; 16];
        k[10] = 0xff;
        k[11] = 0xff;
        k[12..].copy_from_slice(&a);
        k
    }

    #[test]
    fn loopback_interface_addresses_are_listed_and_others_are_not() {
        let all = read_addresses().expect("getifaddrs");
        // lo is up wherever these tests run.
        assert!(all.contains(&v4([127, 0, 0, 1])), "{all:?}");
        assert!(host_address(&v4([127, 0, 0, 1])));
        // TEST-NET-3 is never assigned here; asking twice uses the cache.
        assert!(!host_address(&v4([203, 0, 113, 77])));
        assert!(!host_address(&v4([203, 0, 113, 77])));
        assert!(!usable(&v4([0, 0, 0, 0])) && !usable(&[0u8; 16]));
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        assert!(!usable(&ll));
    }
}
