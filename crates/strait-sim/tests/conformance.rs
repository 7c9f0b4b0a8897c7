//! The Device conformance suite (`strait_core::conformance`) for the reliability
//! layer over a clean simulated link, `Reliable<SimLink>`, and for its box.

use strait_core::conformance::{Boxed, Harness, Pair};
use strait_core::reliable::{Reliable, ReliableConfig};
use strait_core::Device;
use strait_sim::{LinkConfig, LinkParams, SimLink, SimNet};

/// Established `Reliable<SimLink>` pairs on a fresh clean network; time is the
/// network's virtual clock.
struct SimHarness {
    net: SimNet,
    link: LinkConfig,
    rel: ReliableConfig,
}

impl SimHarness {
    fn new() -> Self {
        SimHarness { net: SimNet::new(1), link: LinkConfig::default(), rel: ReliableConfig::default() }
    }

    /// Moves the virtual clock to the next arrival or device timer.
    fn step(&self, devs: &[&Reliable<SimLink>]) {
        let now = self.net.now_ns();
        let timers = devs.iter().filter_map(|d| d.timer_ns()).map(|t| now.saturating_add(t.max(1)));
        if let Some(t) = self.net.next_event_ns().into_iter().chain(timers).min() {
            self.net.advance_to(t);
        }
    }
}

impl Harness for SimHarness {
    type Dev = Reliable<SimLink>;

    fn pair(&mut self) -> Pair<Reliable<SimLink>> {
        let (mut a, mut b) = self.net.reliable_pair(0, 1, LinkParams::default(), &self.link, &self.rel);
        if !Reliable::handshake(&mut a, &mut b, 10_000, |a, b| self.step(&[a, b])) {
            panic!("the reliable pair never established: {} / {}", a.describe(), b.describe());
        }
        Pair { a, b, wake: None }
    }

    fn advance(&mut self, devs: &[&Reliable<SimLink>]) {
        self.step(devs);
    }

    /// Half the window, which is the configured one cut to the link's slots less 16.
    fn expected_credits_hint(&self) -> Option<u16> {
        let window = self.rel.window.min(self.link.slots - 16);
        Some((window / 2) as u16)
    }
}

mod reliable_sim {
    use super::*;
    strait_core::device_conformance!(SimHarness::new());
}

mod boxed_reliable_sim {
    use super::*;
    strait_core::device_conformance!(Boxed(SimHarness::new()));
}
