//! The Device conformance suite (`strait_core::conformance`) for the shm device and
//! its box: both ends live in this process (a thread connects while the test
//! accepts), each with its own eventfd as a worker would have.

use strait_core::conformance::{Boxed, Harness, Pair};
use strait_core::Notifier;
use strait_shm::{ShmConfig, ShmDevice, ShmListener};

/// Connected shm pairs with 64 KiB rings (so filling one is quick): `a` connects,
/// `b` accepts.
struct ShmHarness;

fn unique() -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    format!("test-conf-{}-{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

impl Harness for ShmHarness {
    type Dev = ShmDevice;

    fn pair(&mut self) -> Pair<ShmDevice> {
        let name = unique();
        let listener = ShmListener::bind(&name).expect("bind a listener");
        let wake_a = Notifier::new().expect("eventfd");
        let wake_b = Notifier::new().expect("eventfd");
        let a = std::thread::scope(|s| {
            let connector = s.spawn(|| {
                let cfg = ShmConfig { ring_bytes: 64 << 10, ..ShmConfig::default() };
                ShmDevice::connect(&name, &cfg, &wake_a).expect("connect")
            });
            let b = listener.accept(&wake_b).expect("accept");
            (connector.join().expect("the connecting thread"), b)
        });
        let (a, b) = a;
        Pair { a, b, wake: Some((wake_a, wake_b)) }
    }
}

mod shm {
    use super::*;
    strait_core::device_conformance!(ShmHarness);
}

mod boxed_shm {
    use super::*;
    strait_core::device_conformance!(Boxed(ShmHarness));
}
