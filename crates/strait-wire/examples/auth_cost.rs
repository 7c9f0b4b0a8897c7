//! What authenticating a packet costs: sealing and opening packets of `len`
//! payload bytes (default 1452, a udp-device datagram on a 1500-byte MTU) with the
//! header-only CRC (no secret: the udp device's default) and with the HMAC-SHA256
//! tag (a secret).
//!
//! `cargo run --release -p strait-wire --example auth_cost [len] [packets]`

use std::hint::black_box;
use std::time::Instant;

use strait_wire::packet::{
    open_auth, open_with, seal_auth, seal_with, CrcCoverage, PacketHeader, PacketKey, PacketKind,
    PACKET_HEADER_LEN, TAG_LEN,
};

fn main() {
    let a: Vec<usize> = std::env::args().skip(1).filter_map(|v| v.parse().ok()).collect();
    let len = a.first().copied().unwrap_or(1452);
    let n = a.get(1).copied().unwrap_or(500_000);
    let h = PacketHeader {
        kind: PacketKind::Data,
        flags: 3,
        dst_id: 1,
        src_id: 2,
        seq: 3,
        ack: 4,
        sack: 0,
        len: len as u16,
        window: 512,
        ts: 5,
        ts_echo: 6,
        ce_echo: 0,
    };
    let key = PacketKey::new(b"per-connection key, derived");
    let mut plain = vec![7u8; PACKET_HEADER_LEN + len];
    let mut tagged = vec![7u8; PACKET_HEADER_LEN + len + TAG_LEN];
    h.encode(&mut plain);
    h.encode(&mut tagged);
    let time = |what: &str, f: &mut dyn FnMut()| {
        for _ in 0..n / 10 {
            f();
        }
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!("{what:<32} {ns:8.1} ns/packet");
        ns
    };
    println!("{len}-byte payload, {n} packets");
    let s0 =
        time("seal, header CRC (no secret)", &mut || seal_with(black_box(&mut plain), CrcCoverage::Header));
    let o0 = time("open, header CRC (no secret)", &mut || {
        black_box(open_with(black_box(&plain), true).is_ok());
    });
    let s1 = time("seal, HMAC-SHA256 tag (secret)", &mut || seal_auth(black_box(&mut tagged), &key));
    let o1 = time("open, HMAC-SHA256 tag (secret)", &mut || {
        black_box(open_auth(black_box(&tagged), &key).is_ok());
    });
    println!("added per packet: {:.1} ns to send, {:.1} ns to receive", s1 - s0, o1 - o0);
}
