//! Two processes exchanging messages through the native API over shared memory.
//!
//! `cargo run --release --example pingpong [SIZE] [ITERS]` starts itself a second
//! time as the echo server, connects, bounces `ITERS` messages of `SIZE` bytes
//! (default 8 and 100000) and prints the one-way latency (round trip / 2).
use std::process::Command;
use std::time::{Duration, Instant};

use strait::strait_core::{Config, MemoryRegion, OpKind, Status, Worker};
use strait::strait_shm::{ShmConfig, ShmDevice, ShmListener};

const PING: u64 = 1;
const PONG: u64 = 2;

type Error = Box<dyn std::error::Error>;

fn wait_for(w: &mut Worker<ShmDevice>, op: OpKind) -> Result<(), Error> {
    loop {
        let c = w.wait(Some(Duration::from_secs(10)))?;
        if c.status != Status::Ok {
            return Err(format!("{:?} completed with {:?}", c.op, c.status).into());
        }
        if c.op == op {
            return Ok(());
        }
    }
}

fn server(listener: ShmListener, size: usize, iters: usize) -> Result<(), Error> {
    let mut w = Worker::new(Config::from_env()?)?;
    let ep = w.attach(listener.accept(w.notifier())?);
    let mut buf = MemoryRegion::new(size)?;
    for _ in 0..iters {
        w.post_recv(ep, &mut buf, 0..size, PING, u64::MAX, 0)?;
        wait_for(&mut w, OpKind::Recv)?;
        w.post_send(ep, &buf, 0..size, PONG, 0)?;
        wait_for(&mut w, OpKind::Send)?;
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--server") {
        let (name, size, iters) = (&args[2], args[3].parse()?, args[4].parse()?);
        // The client connects only after this process says it listens.
        let listener = ShmListener::bind(name)?;
        println!("listening");
        return server(listener, size, iters);
    }
    let size: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let iters: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(100_000);
    let name = format!("pingpong-{}", std::process::id());
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--server", &name, &size.to_string(), &iters.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().ok_or("no stdout")?),
        &mut line,
    )?;
    let mut w = Worker::new(Config::from_env()?)?;
    let ep = w.attach(ShmDevice::connect(&name, &ShmConfig::from_env()?, w.notifier())?);
    let mut out = MemoryRegion::new(size)?;
    out.bytes_mut()?.fill(0x5a);
    let mut back = MemoryRegion::new(size)?;
    let mut rtts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        w.post_recv(ep, &mut back, 0..size, PONG, u64::MAX, 0)?;
        w.post_send(ep, &out, 0..size, PING, 0)?;
        wait_for(&mut w, OpKind::Recv)?;
        rtts.push(t.elapsed());
    }
    assert_eq!(back.bytes()?, out.bytes()?, "the echo came back different");
    rtts.sort();
    let p = |q: f64| rtts[((rtts.len() - 1) as f64 * q) as usize].as_nanos() as f64 / 2.0;
    println!("{iters} x {size} B: one-way latency p50 {:.0} ns, p99 {:.0} ns", p(0.5), p(0.99));
    if !child.wait()?.success() {
        return Err("the server failed".into());
    }
    Ok(())
}
