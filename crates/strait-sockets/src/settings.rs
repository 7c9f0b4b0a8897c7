//! Settings read once from `STRAIT_*` variables, and the spin policy of blocked
//! calls (which backs off while the machine is crowded).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use strait_core::spin::{Crowding, SpinPolicy};

/// Connection-level settings, read once from `STRAIT_*` variables.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub ring: usize,
    /// How long a blocked call spins before it sleeps, at most.
    pub spin: Duration,
    /// The spin adapts below [`Settings::spin`] (`STRAIT_SPIN_US` unset): see
    /// [`spin_policy`].
    pub spin_adaptive: bool,
    pub attach_timeout: Duration,
    pub announce_wait: Duration,
    pub enabled: bool,
    /// Message mode asked for (`STRAIT_MESSAGES`).
    pub messages: bool,
    /// Smallest read buffer posted for rendezvous (`STRAIT_RENDEZVOUS_MIN`).
    pub rendezvous_min: usize,
    /// Longest a zero-timeout `epoll_wait` goes without asking the kernel set
    /// (`STRAIT_EPOLL_KERNEL_LOOK_US`; tests make it long to see what else bounds it).
    pub epoll_kernel_look: Duration,
    /// Connections' memfds kept in the process's io_uring vault ring (the default)
    /// rather than a socketpair each (`STRAIT_VAULT=socket`).
    pub vault_ring: bool,
    /// Local connections ring through the doorbells of their process pair (the
    /// default) rather than two eventfds each (`STRAIT_BELLS=own`).
    pub pairs: bool,
    /// New connections to a destination whose connections were too short to pay
    /// for their setup stay on the kernel (`STRAIT_SETUP`: `adaptive`, the default,
    /// or `always`; see `worth.rs`).
    pub setup_adaptive: bool,
    /// The most reads and writes with data a connection may carry and still count
    /// as too short for its setup (`STRAIT_SETUP_MIN_OPS`).
    pub setup_min_ops: u32,
}

impl Settings {
    pub fn get() -> &'static Settings {
        static S: std::sync::OnceLock<Settings> = std::sync::OnceLock::new();
        S.get_or_init(|| {
            let ring = env_u64("STRAIT_RING_SIZE")
                .map(|v| v as usize)
                .filter(|v| v.is_power_of_two() && (4096..=1 << 30).contains(v))
                // 512K: iperf3's 128 KiB writes then overlap with the reads (256K:
                // about half the throughput). Memory: twice this per connection.
                .unwrap_or(512 << 10);
            Settings {
                ring,
                spin: Duration::from_micros(env_u64("STRAIT_SPIN_US").unwrap_or(20)),
                spin_adaptive: env_u64("STRAIT_SPIN_US").is_none(),
                attach_timeout: Duration::from_millis(env_u64("STRAIT_ATTACH_TIMEOUT_MS").unwrap_or(1000)),
                announce_wait: Duration::from_millis(env_u64("STRAIT_ANNOUNCE_WAIT_MS").unwrap_or(200)),
                enabled: std::env::var("STRAIT_DISABLE").map(|v| v.is_empty() || v == "0").unwrap_or(true),
                messages: std::env::var("STRAIT_MESSAGES").is_ok_and(|v| !v.is_empty() && v != "0"),
                rendezvous_min: env_u64("STRAIT_RENDEZVOUS_MIN")
                    .map(|v| v.max(1) as usize)
                    .unwrap_or(64 << 10),
                epoll_kernel_look: Duration::from_micros(env_u64("STRAIT_EPOLL_KERNEL_LOOK_US").unwrap_or(2)),
                vault_ring: std::env::var("STRAIT_VAULT").map_or(true, |v| v.trim() != "socket"),
                pairs: std::env::var("STRAIT_BELLS").map_or(true, |v| v.trim() != "own"),
                setup_adaptive: std::env::var("STRAIT_SETUP").map_or(true, |v| v.trim() != "always"),
                setup_min_ops: env_u64("STRAIT_SETUP_MIN_OPS")
                    .map_or(8, |v| v.min(u64::from(u32::MAX)) as u32),
            }
        })
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let n = parse_size(&v);
    if n.is_none() {
        // The library cannot fail the program's start for it: it says so, naming the
        // variable, and keeps the default (a value silently dropped looked taken).
        eprintln!("strait: {name}={v:?} is not a whole number (K, M or G may follow); the default is used");
    }
    n
}

/// A whole number with an optional binary suffix (K, M, G); `None` if it is not one
/// or does not fit.
fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, mul) = match v.chars().last()? {
        'k' | 'K' => (&v[..v.len() - 1], 1u64 << 10),
        'm' | 'M' => (&v[..v.len() - 1], 1 << 20),
        'g' | 'G' => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mul)
}

/// A new waiter's spin policy (strait-core's [`SpinPolicy`]): adaptive unless
/// `STRAIT_SPIN_US` fixed the budget.
pub(crate) fn spin_policy() -> SpinPolicy {
    let s = Settings::get();
    if s.spin_adaptive {
        // Up to ten times the base for answers that keep coming just after it (a
        // large write waiting for ring space): each would otherwise pay a sleep and
        // a wake-up on both sides.
        SpinPolicy::adaptive_up_to(s.spin, s.spin * SPIN_CEILING_FACTOR)
    } else {
        SpinPolicy::fixed(s.spin)
    }
}

/// The adaptive spin may grow to this many times `STRAIT_SPIN_US`'s default.
const SPIN_CEILING_FACTOR: u32 = 10;

/// How often the process samples the machine's load for the spin policies: often
/// enough to follow spinners that stop and start (nginx's two workers and wrk on two
/// cores: sampled every 100 ms, wrk's p99 was 2.3 ms against 0.4 ms at 2 ms), seldom
/// enough to cost nothing (a read of `/proc/loadavg`, a few microseconds, per 2 ms of
/// waiting).
const LOAD_SAMPLE_EVERY: Duration = Duration::from_millis(2);

/// True while the machine looks crowded (more runnable threads than cores): waiters
/// then sleep at once. One sample per [`LOAD_SAMPLE_EVERY`] for the whole process
/// (reading `/proc/loadavg` through the library's handle on `/proc`, so a `chroot`
/// does not stop it; where it fails, as in a sandbox, the machine never counts as
/// crowded). `now` is the waiter's clock reading; between
/// samples this is two relaxed loads.
pub(crate) fn crowded(now: Instant) -> bool {
    static BASE: OnceLock<Instant> = OnceLock::new();
    static NEXT_MS: AtomicU64 = AtomicU64::new(0);
    static STATE: Mutex<Crowding> = Mutex::new(Crowding::new());
    let ms = now.saturating_duration_since(*BASE.get_or_init(Instant::now)).as_millis() as u64;
    if ms < NEXT_MS.load(Ordering::Relaxed) {
        return CROWDED.load(Ordering::Relaxed);
    }
    // One thread samples; the others keep the verdict of a moment ago.
    let Ok(mut c) = STATE.try_lock() else {
        return CROWDED.load(Ordering::Relaxed);
    };
    NEXT_MS.store(ms + LOAD_SAMPLE_EVERY.as_millis() as u64, Ordering::Relaxed);
    if let Some(l) = strait_core::spin::sample_load() {
        c.sample(l);
    }
    CROWDED.store(c.crowded(), Ordering::Relaxed);
    c.crowded()
}

/// The last verdict of [`crowded`].
static CROWDED: AtomicBool = AtomicBool::new(false);

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_take_binary_suffixes_and_refuse_the_rest() {
        assert_eq!(super::parse_size("64K"), Some(64 << 10));
        assert_eq!(super::parse_size(" 2m "), Some(2 << 20));
        assert_eq!(super::parse_size("1G"), Some(1 << 30));
        assert_eq!(super::parse_size("4096"), Some(4096));
        for bad in ["", "G", "1.5M", "-1", "12x", "99999999999999999999G"] {
            assert_eq!(super::parse_size(bad), None, "{bad:?}");
        }
    }
}
