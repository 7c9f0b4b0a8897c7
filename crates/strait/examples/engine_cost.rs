//! Measures the software cost of one message through the native API over the shm
//! device, with both ends on one thread (no cross-core transfer): the floor the
//! engine itself puts under the one-way latency.
use std::time::Instant;
use strait::strait_core::{Config, Device, MemoryRegion, Worker};
use strait::strait_shm::{ShmConfig, ShmDevice, ShmListener};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let name = format!("engine-cost-{}", std::process::id());
    let listener = ShmListener::bind(&name)?;
    let mut wa = Worker::new(Config::default())?;
    let h = std::thread::spawn(move || {
        let wb = Worker::new(Config::default()).expect("worker");
        let dev = listener.accept(wb.notifier()).expect("accept");
        (wb, dev)
    });
    let a = ShmDevice::connect(&name, &ShmConfig::default(), wa.notifier())?;
    let (mut wb, mut b) = h.join().expect("accept thread");
    let mut a = a;
    // The bare device: a 48-byte frame (an 8-byte message and its header) out and in.
    let frame = [7u8; 48];
    let mut buf = [0u8; 48];
    for round in 0..3 {
        let n = 1_000_000;
        let t = Instant::now();
        for _ in 0..n {
            a.send_frame(48, &mut |w| w.write(0, &frame))?;
            a.doorbell()?;
            b.recv_frame(&mut |f| {
                f.read(0, &mut buf);
            })?;
        }
        let dt = t.elapsed();
        println!(
            "device round {round}: {:.1} ns per frame (send+recv, one thread)",
            dt.as_nanos() as f64 / n as f64
        );
    }
    let ea = wa.attach(a);
    let eb = wb.attach(b);
    let size: usize = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(8);
    let out = MemoryRegion::new(size.max(1))?;
    let mut inbox = MemoryRegion::new(size.max(1))?;
    for round in 0..5 {
        let n = 200_000;
        let t = Instant::now();
        for _ in 0..n {
            wb.post_recv(eb, &mut inbox, 0..size, 1, u64::MAX, 0)?;
            wa.post_send(ea, &out, 0..size, 1, 0)?;
            loop {
                if wb.poll().is_some() {
                    break;
                }
            }
            loop {
                if wa.poll().is_some() {
                    break;
                }
            }
        }
        let dt = t.elapsed();
        println!(
            "round {round}: {:.1} ns per message (send+recv, one thread)",
            dt.as_nanos() as f64 / n as f64
        );
    }
    Ok(())
}
