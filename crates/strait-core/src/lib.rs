//! strait's native messaging API and protocol engine.

pub mod api;
pub mod config;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
pub mod congestion;
pub mod device;
mod engine;
pub mod link;
pub mod loopback;
pub mod notifier;
pub mod region;
pub mod reliable;
pub mod sansio;
pub mod secret;
pub mod spin;
pub mod worker;

pub use api::{Completion, EpId, OpKind, PostError, Status, WaitError};
pub use config::{Config, ConfigError, RndvMode};
pub use device::{Device, DeviceError, DeviceStats, FrameWriter, RndvPath, RxFrame};
pub use link::{Link, LinkError, LinkStats, SlotPool};
pub use notifier::Notifier;
pub use region::{MemoryRegion, RegionBusy};
pub use reliable::{PacketAuth, PacketKey, Reliable, ReliableConfig, ReliableStats};
pub use sansio::Engine;
pub use secret::{load_secret_file, secret_from_env, SecretError, SECRET_ENV};
pub use spin::{Crowding, SpinPolicy};
pub use worker::{EndpointStats, Worker};
