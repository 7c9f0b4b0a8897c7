//! One-way latency of the bare shm device (frames only, no protocol engine) and of
//! the native API over it, between two threads: separates the device's cost from
//! the engine's. `cargo run --release --example device_pingpong`.
use std::time::Instant;
use strait::strait_core::{Config, Device, MemoryRegion, Worker};
use strait::strait_shm::{ShmConfig, ShmDevice, ShmListener};

const N: usize = 200_000;

fn pair(tag: &str) -> (Worker<ShmDevice>, ShmDevice, Worker<ShmDevice>, ShmDevice) {
    let name = format!("devpp-{tag}-{}", std::process::id());
    let listener = ShmListener::bind(&name).expect("bind");
    let h = std::thread::spawn(move || {
        let wb = Worker::new(Config::default()).expect("worker");
        let dev = listener.accept(wb.notifier()).expect("accept");
        (wb, dev)
    });
    let wa = Worker::new(Config::default()).expect("worker");
    let a = ShmDevice::connect(&name, &ShmConfig::default(), wa.notifier()).expect("connect");
    let (wb, b) = h.join().expect("accept thread");
    (wa, a, wb, b)
}

fn bounce(dev: &mut ShmDevice, n: usize, first: bool) {
    let frame = [7u8; 48];
    let mut buf = [0u8; 48];
    for i in 0..2 * n {
        if (i % 2 == 0) == first {
            while !dev.send_frame(48, &mut |w| w.write(0, &frame)).expect("send") {}
        } else {
            while !dev
                .recv_frame(&mut |f| {
                    f.read(0, &mut buf);
                })
                .expect("recv")
            {}
        }
    }
}

fn main() {
    for round in 0..3 {
        let (_wa, mut a, _wb, mut b) = pair(&format!("dev{round}"));
        let h = std::thread::spawn(move || bounce(&mut b, N, false));
        let t = Instant::now();
        bounce(&mut a, N, true);
        let dt = t.elapsed();
        h.join().unwrap();
        println!("device: {:.0} ns one-way", dt.as_nanos() as f64 / (2 * N) as f64);

        let (mut wa, a, mut wb, b) = pair(&format!("api{round}"));
        let ea = wa.attach(a);
        let h = std::thread::spawn(move || {
            let eb = wb.attach(b);
            let mut m = MemoryRegion::new(8).unwrap();
            for _ in 0..N {
                wb.post_recv(eb, &mut m, 0..8, 1, u64::MAX, 0).unwrap();
                while wb.poll().is_none() {}
                wb.post_send(eb, &m, 0..8, 2, 0).unwrap();
                while wb.poll().is_none() {}
            }
        });
        let mut m = MemoryRegion::new(8).unwrap();
        let t = Instant::now();
        for _ in 0..N {
            wa.post_recv(ea, &mut m, 0..8, 2, u64::MAX, 0).unwrap();
            wa.post_send(ea, &m, 0..8, 1, 0).unwrap();
            let mut got = 0;
            while got < 2 {
                if wa.poll().is_some() {
                    got += 1;
                }
            }
        }
        let dt = t.elapsed();
        h.join().unwrap();
        println!("native API: {:.0} ns one-way", dt.as_nanos() as f64 / (2 * N) as f64);
    }
}
