//! The Device conformance suite (`strait_core::conformance`) for the udp device,
//! `Reliable<UdpLink>` over real UDP sockets on loopback, with both backends
//! (io_uring and sendmmsg/recvmmsg), and for its box.

use std::net::UdpSocket;
use std::time::Duration;

use strait_core::conformance::{Boxed, Harness, Pair};
use strait_core::{Device, Link, ReliableConfig};
use strait_udp::{Backend, UdpConfig, UdpDevice, UdpLink};

/// Established udp device pairs on 127.0.0.1; time is real time.
struct UdpHarness {
    backend: Backend,
    rel: ReliableConfig,
    /// The window the devices run with: the configured one, cut to the link's send
    /// slots less 16 (`Reliable::new`).
    window: Option<u32>,
}

impl UdpHarness {
    fn new(backend: Backend) -> Self {
        UdpHarness { backend, rel: ReliableConfig::default(), window: None }
    }
}

impl Harness for UdpHarness {
    type Dev = UdpDevice;

    fn pair(&mut self) -> Pair<UdpDevice> {
        let sa = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let sb = UdpSocket::bind("127.0.0.1:0").expect("bind");
        sa.connect(sb.local_addr().expect("address")).expect("connect");
        sb.connect(sa.local_addr().expect("address")).expect("connect");
        let cfg = UdpConfig { backend: self.backend, ..UdpConfig::default() };
        let la = UdpLink::from_socket(sa, &cfg).expect("udp link");
        let lb = UdpLink::from_socket(sb, &cfg).expect("udp link");
        assert_eq!(la.backend(), self.backend, "the backend asked for is the one running");
        let slots = la.tx_slots().expect("a udp link has send slots");
        self.window =
            Some(self.rel.window.clamp(2, 32768).min(slots.saturating_sub(16).clamp(2, 32768) as u32));
        let (mut a, mut b) = (la.reliable(self.rel.clone()), lb.reliable(self.rel.clone()));
        for _ in 0..20_000 {
            if a.is_established() && b.is_established() {
                return Pair { a, b, wake: None };
            }
            for d in [&mut a, &mut b] {
                while d
                    .recv_frame(&mut |_| panic!("a frame arrived during the handshake"))
                    .expect("handshake")
                {}
                d.doorbell().expect("handshake doorbell");
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        panic!("the udp pair never established: {} / {}", a.describe(), b.describe());
    }

    /// Real packets and timers need real time: a short pause per step.
    fn advance(&mut self, _devs: &[&UdpDevice]) {
        std::thread::sleep(Duration::from_micros(20));
    }

    fn expected_credits_hint(&self) -> Option<u16> {
        Some((self.window.expect("a pair was made") / 2) as u16)
    }

    /// The UDP socket is readable while the peer's FIN is in flight, not once it was
    /// received; a closed connection refuses `arm_sleep` instead.
    fn event_fd_readable_after_close(&self) -> bool {
        false
    }
}

mod uring {
    use super::*;
    strait_core::device_conformance!(UdpHarness::new(Backend::Uring));
}

mod mmsg {
    use super::*;
    strait_core::device_conformance!(UdpHarness::new(Backend::Mmsg));
}

mod boxed_uring {
    use super::*;
    strait_core::device_conformance!(Boxed(UdpHarness::new(Backend::Uring)));
}
