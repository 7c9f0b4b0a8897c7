//! `strait-shm`: strait's native API (`strait_core::Worker`) over the shared-memory
//! device (`strait_shm::ShmDevice`), exactly as an application would use it; the
//! data path is [`NativeLink`]. Engine settings come from the `STRAIT_*` environment
//! ([`Config::from_env`]).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, Ordering};

use strait_anatomy::transport::Result;
use strait_anatomy::{BenchError, Pending, Transport, TransportSpec};
use strait_core::{Config, RndvMode, Worker};
use strait_shm::{ShmConfig, ShmDevice, ShmListener};

use super::native::NativeLink;

const NAME: &str = "strait-shm";

fn err(what: &str, e: impl std::fmt::Display) -> BenchError {
    BenchError::transport(NAME, format!("{what}: {e}"))
}

/// The strait-shm transport spec.
pub struct StraitShm;

impl TransportSpec for StraitShm {
    strait_anatomy::spec_identity!(
        NAME,
        "strait native API (Worker, post_send/post_recv, poll) over the shm device",
        true
    );

    fn settings(&self) -> Option<String> {
        match Config::from_env() {
            Ok(c) if c.rndv_mode == RndvMode::Auto => Some(strait_shm::calibrate::calibration().describe()),
            Ok(c) => Some(format!("rendezvous = {:?} (STRAIT_RNDV_MODE)", c.rndv_mode)),
            Err(_) => None,
        }
    }

    fn listen(&self) -> Result<Pending> {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("strait-bench-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let listener = ShmListener::bind(&name).map_err(|e| err("bind", e))?;
        Ok(Pending {
            peer_args: vec![name],
            peer_fds: Vec::new(),
            finish: Box::new(move || {
                let w = Worker::new(Config::from_env().map_err(|e| err("config", e))?)
                    .map_err(|e| err("worker", e))?;
                let dev = listener.accept(w.notifier()).map_err(|e| err("accept", e))?;
                Ok(Box::new(NativeLink::new(NAME, w, dev)?))
            }),
        })
    }

    fn connect(&self, args: &[String], _fds: Vec<OwnedFd>) -> Result<Box<dyn Transport>> {
        let name = args.first().ok_or_else(|| BenchError::Protocol("strait-shm peer needs a name".into()))?;
        let w =
            Worker::new(Config::from_env().map_err(|e| err("config", e))?).map_err(|e| err("worker", e))?;
        let dev =
            ShmDevice::connect(name, &ShmConfig::default(), w.notifier()).map_err(|e| err("connect", e))?;
        Ok(Box::new(NativeLink::new(NAME, w, dev)?))
    }
}
