//! The native messaging API over the udp device across two network namespaces
//! joined by a veth pair (made and removed by each test): every size class both
//! ways, both backends, IPv4 and IPv6; and with 1% random loss injected on both
//! sides (iptables `statistic` rules), every message intact, by retransmission.

mod common;

use std::time::Duration;

use common::{device_pair, exchange, SIZES};
use strait_udp::netns::VethPair;
use strait_udp::Backend;

fn veth() -> VethPair {
    VethPair::create().expect("cannot create network namespaces and a veth pair (root and iproute2 needed)")
}

fn every_size(backend: Backend, v6: bool) {
    let pair = veth();
    let (a, b, _) = device_pair(&pair, v6, backend);
    let r = exchange(a, b, SIZES, Duration::from_secs(60));
    for s in &r {
        assert_eq!(s.rel.bad_checksum + s.rel.bad_header + s.rel.wrong_conn, 0, "{s:?}");
        assert!(s.rel.link.datagrams_sent > 0);
    }
    assert!(r[0].ep.rndv_sent > 0 && r[0].ep.eager_sent > 0, "{:?}", r[0].ep);
}

common::test_per_backend!(every_size_class_uring_v4, every_size_class_mmsg_v4: every_size, false);
common::test_per_backend!(every_size_class_uring_v6, every_size_class_mmsg_v6: every_size, true);

fn lossy(backend: Backend) {
    let pair = veth();
    let (a, b, _) = device_pair(&pair, false, backend);
    pair.set_loss(0, 0.01).expect("cannot install the iptables loss rule");
    pair.set_loss(1, 0.01).expect("cannot install the iptables loss rule");
    // Every size class, then a stream of mixed messages: 8 MiB or so each way.
    let mut sizes: Vec<usize> = SIZES.to_vec();
    sizes.extend((0..300).map(|i| [8, 1000, 5000, 40_000, 200_000][i % 5]));
    let r = exchange(a, b, &sizes, Duration::from_secs(120));
    let dropped = pair.dropped(0).unwrap() + pair.dropped(1).unwrap();
    let retrans: u64 = r.iter().map(|s| s.rel.timeout_retransmits + s.rel.fast_retransmits).sum();
    eprintln!(
        "{backend:?}: {dropped} packets dropped by iptables; retransmits: {} fast, {} timeout; {:?} / {:?}",
        r[0].rel.fast_retransmits + r[1].rel.fast_retransmits,
        r[0].rel.timeout_retransmits + r[1].rel.timeout_retransmits,
        r[0].elapsed,
        r[1].elapsed
    );
    assert!(dropped > 0, "the loss rule dropped nothing");
    assert!(retrans > 0, "packets were lost but none was retransmitted");
}

common::test_per_backend!(one_percent_loss_all_intact_uring, one_percent_loss_all_intact_mmsg: lossy);
