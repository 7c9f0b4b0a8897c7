//! Engine settings, each with a default and a `STRAIT_*` environment override.

use std::ops::RangeInclusive;
use std::time::Duration;

use thiserror::Error;

/// How a rendezvous (large) message's bytes move once the receiver has matched it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RndvMode {
    /// The fastest path on this device and host, as measured: the device says
    /// ([`crate::Device::preferred_rndv`]); devices that do not measure keep
    /// [`RndvMode::Copy`].
    ///
    /// Neither wins everywhere. On the shm device, a 2-core AMD EPYC VM streamed
    /// 1 MiB messages at ~14 GB/s with the pipelined copy against ~9 GB/s with
    /// `process_vm_readv` (the copy path uses both cores at once: the sender copies
    /// chunk k+1 into the cache-resident ring while the receiver copies chunk k out);
    /// a 2-core Intel Xeon VM reached 10.3 GB/s with the remote read against 7.1 with
    /// the copy (docs/PERFORMANCE.md). So the shm device times both on the host
    /// (`strait_shm::calibrate`, cached per boot) and picks. On the Intel host a split
    /// transfer beat both (46 GB/s for one reused 1 MiB buffer against 16 for the
    /// remote read alone), so the calibration times it too.
    Auto,
    /// The receiver copies straight from the sender's buffer (one copy; on shm this is
    /// `process_vm_readv`).
    RemoteRead,
    /// The sender pushes the bytes through the device in chunks and the receiver copies
    /// each chunk out as it arrives (two copies, overlapped: fine-grained pipelining).
    Copy,
    /// A split transfer (one copy, two cores): the receiver asks the sender to write
    /// the second half of the message straight into the receiver's buffer
    /// ([`crate::Device::remote_write`]) while it reads the first half itself
    /// ([`crate::Device::remote_read`]). Used for messages of at least
    /// [`Config::split_threshold`] whose sender is polling (a sleeping sender would
    /// answer only after a wake-up); otherwise, and wherever the device cannot write
    /// into the peer, the receiver reads the whole message itself.
    Split,
}

/// Engine configuration. Build with [`Config::default`] or [`Config::from_env`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Messages up to this many bytes travel eagerly (inline); larger ones use the
    /// rendezvous protocol. `STRAIT_EAGER_THRESHOLD`, default 32768 (on shm, an eager
    /// 16-32 KiB message arrived in about half the time of a rendezvous one). Capped
    /// by the device's largest frame.
    pub eager_threshold: usize,
    /// Credits per endpoint: how many eager/RTS messages may be outstanding at the
    /// receiver before it returns credits. `STRAIT_CREDITS`, default 64.
    pub credits: u16,
    /// How long a blocking wait spins before it sleeps, at most; zero never spins.
    /// `STRAIT_SPIN_US` (microseconds), default 100.
    pub spin: Duration,
    /// Whether the spin adapts below [`Config::spin`] (see [`crate::spin`]): it
    /// stops while spins do not pay or the machine is crowded. True by default; an
    /// explicit `STRAIT_SPIN_US` makes the budget fixed (that is what was asked).
    pub spin_adaptive: bool,
    /// Rendezvous data movement. `STRAIT_RNDV_MODE` = `auto` | `remote-read` | `copy` |
    /// `split`.
    pub rndv_mode: RndvMode,
    /// Chunk size for pipelined (copy-mode) transfers. `STRAIT_CHUNK_SIZE`, default
    /// 131072 (32 KiB to 128 KiB measured; 128 KiB streamed fastest on shm). Capped by
    /// the device's largest frame.
    pub chunk_size: usize,
    /// Copy-mode messages at least this long are pipelined in `chunk_size` pieces;
    /// shorter ones move as one piece (coarse-grained). `STRAIT_PIPELINE_THRESHOLD`,
    /// default 65536.
    pub pipeline_threshold: usize,
    /// Rendezvous messages at least this long are split between the two sides when
    /// the split path is taken ([`RndvMode::Split`]); shorter ones are read whole by
    /// the receiver. `STRAIT_SPLIT_THRESHOLD`, default 65536.
    pub split_threshold: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            eager_threshold: 32768,
            credits: 64,
            spin: Duration::from_micros(100),
            spin_adaptive: true,
            rndv_mode: RndvMode::Auto,
            chunk_size: 131072,
            pipeline_threshold: 65536,
            split_threshold: 65536,
        }
    }
}

/// A `STRAIT_*` variable held a value that could not be used.
#[derive(Debug, Error)]
#[error("environment variable {var}={value:?}: {why}")]
pub struct ConfigError {
    /// Variable name.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub why: &'static str,
}

/// Reads a `STRAIT_*` size or count: a non-negative integer with an optional k/M
/// (binary) suffix; `Ok(None)` when the variable is unset.
pub fn env_num(var: &'static str) -> Result<Option<u64>, ConfigError> {
    match std::env::var(var) {
        Ok(v) => {
            let t = v.trim();
            let (num, mult) = match t.as_bytes().last() {
                Some(b'k' | b'K') => (&t[..t.len() - 1], 1024),
                Some(b'm' | b'M') => (&t[..t.len() - 1], 1024 * 1024),
                _ => (t, 1),
            };
            num.parse::<u64>().ok().and_then(|n| n.checked_mul(mult)).map(Some).ok_or(ConfigError {
                var,
                value: v.clone(),
                why: "expected a non-negative integer (k/M suffix allowed)",
            })
        }
        Err(_) => Ok(None),
    }
}

/// [`env_num`] for a variable whose value must lie in `range`; `why` says so in the
/// error (e.g. "must be 8..4096").
pub fn env_num_in(
    var: &'static str,
    range: RangeInclusive<u64>,
    why: &'static str,
) -> Result<Option<u64>, ConfigError> {
    match env_num(var)? {
        Some(v) if !range.contains(&v) => Err(ConfigError { var, value: v.to_string(), why }),
        v => Ok(v),
    }
}

/// A variable naming one of `choices` (after trimming): its value, `None` when
/// `var` is unset; `why` lists the choices in the error.
pub fn env_choice<T: Copy>(
    var: &'static str,
    choices: &[(&str, T)],
    why: &'static str,
) -> Result<Option<T>, ConfigError> {
    let Ok(v) = std::env::var(var) else { return Ok(None) };
    match choices.iter().find(|(name, _)| *name == v.trim()) {
        Some(&(_, t)) => Ok(Some(t)),
        None => Err(ConfigError { var, value: v, why }),
    }
}

/// A 0/1 switch: `None` when `var` is unset.
pub fn env_flag(var: &'static str) -> Result<Option<bool>, ConfigError> {
    Ok(env_num_in(var, 0..=1, "must be 0 or 1")?.map(|v| v == 1))
}

impl Config {
    /// Defaults overridden by any `STRAIT_*` variables that are set.
    pub fn from_env() -> Result<Self, ConfigError> {
        let mut c = Config::default();
        if let Some(v) = env_num("STRAIT_EAGER_THRESHOLD")? {
            c.eager_threshold = v as usize;
        }
        if let Some(v) = env_num_in("STRAIT_CREDITS", 1..=u16::MAX as u64, "must be 1..=65535")? {
            c.credits = v as u16;
        }
        if let Some(v) = env_num("STRAIT_SPIN_US")? {
            c.spin = Duration::from_micros(v);
            c.spin_adaptive = false;
        }
        let modes = [
            ("auto", RndvMode::Auto),
            ("remote-read", RndvMode::RemoteRead),
            ("cma", RndvMode::RemoteRead),
            ("copy", RndvMode::Copy),
            ("split", RndvMode::Split),
        ];
        if let Some(m) = env_choice("STRAIT_RNDV_MODE", &modes, "expected auto, remote-read, copy or split")?
        {
            c.rndv_mode = m;
        }
        if let Some(v) = env_num_in("STRAIT_CHUNK_SIZE", 1..=u64::MAX, "must be positive")? {
            c.chunk_size = v as usize;
        }
        if let Some(v) = env_num("STRAIT_PIPELINE_THRESHOLD")? {
            c.pipeline_threshold = v as usize;
        }
        if let Some(v) = env_num("STRAIT_SPLIT_THRESHOLD")? {
            c.split_threshold = v as usize;
        }
        Ok(c)
    }
}
