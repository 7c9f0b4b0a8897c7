//! CRC32C over packets of a udp datagram's size: this crate's one-pass CRC (three
//! lanes over the whole length) against the `crc32c` crate, and `packet::open` as
//! strait runs it. `cargo run --release -p strait-wire --example crc_bench`
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let len = 1_472usize;
    let buf: Vec<u8> = (0..len).map(|i| (i * 131 + 7) as u8).collect();
    let n = 2_000_000u32;
    for round in 0..3 {
        let t = Instant::now();
        let mut acc = 0u32;
        for _ in 0..n {
            acc ^= crc32c::crc32c(black_box(&buf));
        }
        let crate_ns = t.elapsed().as_nanos() as f64 / f64::from(n);
        let t = Instant::now();
        for _ in 0..n {
            acc ^= strait_wire::crc::crc32c(black_box(&buf));
        }
        let ours_ns = t.elapsed().as_nanos() as f64 / f64::from(n);
        println!(
            "round {round}: {len} bytes: crc32c crate {crate_ns:.1} ns ({:.1} GB/s), strait-wire {ours_ns:.1} ns ({:.1} GB/s), ratio {:.2} [{acc:08x}]",
            len as f64 / crate_ns,
            len as f64 / ours_ns,
            crate_ns / ours_ns
        );
    }
}
