//! strait: a user-level communication stack.
//!
//! This crate is the front door: it re-exports the native messaging API
//! ([`strait_core`]: workers, endpoints, memory regions, completions) and the
//! shared-memory device ([`strait_shm`]), and holds what the `strait` command needs
//! beyond them, such as the benchmark's transport registry ([`bench`](mod@bench)).
//!
//! ```no_run
//! use strait::strait_core::{Config, MemoryRegion};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cfg = Config::from_env()?;
//! let inbox = MemoryRegion::new(4096)?;
//! # let _ = (cfg, inbox); Ok(()) }
//! ```

pub use strait_core;
pub use strait_shm;

pub mod across_anatomy;
pub mod anatomy;
pub mod bench;
pub mod netns;
pub mod preload;
pub mod run_anatomy;
