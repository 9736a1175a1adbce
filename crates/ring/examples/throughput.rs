//! Throughput of one ring: one producer thread, one draining consumer thread.
//!
//! `cargo run --release -p vmsight-ring --example throughput [records] [ring_records]`
//! Prints records/second for (a) producer and consumer on two threads and (b) the producer
//! alone against a ring drained between bursts (no cross-core traffic).

use std::time::Instant;

use vmsight_ring::{Channel, Record};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: u64 = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(50_000_000);
    let ring: u32 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(65536);
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm")?
    } else {
        tempfile::tempdir()?
    };
    let path = dir.path().join("bench.shm");

    // (a) Two threads: the producer never blocks; it retries on full so every record arrives
    // (the plugin would drop instead).
    let mut host = Channel::create(&path, 1, ring)?;
    let plugin = Channel::attach(&path)?;
    let mut p = plugin.producer(0)?;
    let t0 = Instant::now();
    let producer = std::thread::spawn(move || {
        let mut full = 0u64;
        let mut r = Record::syscall_entry(0, 0, 0x1000, 0x40_1000, 39, [0; 6], 0);
        for i in 0..n {
            r.timestamp_ns = i;
            while !p.push(&r) {
                full += 1;
                std::hint::spin_loop();
            }
        }
        full
    });
    let mut got = 0u64;
    let mut sum = 0u64;
    while got < n {
        let k = host.drain(|r| sum = sum.wrapping_add(r.timestamp_ns));
        if k == 0 {
            std::hint::spin_loop();
        }
        got += k as u64;
    }
    let full = producer.join().map_err(|_| "producer thread panicked")?;
    let dt = t0.elapsed().as_secs_f64();
    let expect = n * (n - 1) / 2;
    println!(
        "two threads: {n} records in {dt:.3} s = {:.1} M records/s ({:.2} GB/s), \
         producer saw full {full} times, checksum {}",
        n as f64 / dt / 1e6,
        n as f64 * 128.0 / dt / 1e9,
        if sum == expect { "ok" } else { "MISMATCH" }
    );
    drop(plugin);
    drop(host);

    // (b) One thread: bursts of ring/2 pushes, then a drain.
    let mut host = Channel::create(&path, 1, ring)?;
    let plugin = Channel::attach(&path)?;
    let mut p = plugin.producer(0)?;
    let burst = u64::from(ring / 2);
    let r = Record::syscall_entry(0, 0, 0x1000, 0x40_1000, 39, [0; 6], 0);
    let mut push_time = 0f64;
    let mut pushed = 0u64;
    while pushed < n {
        let t = Instant::now();
        for _ in 0..burst {
            p.push(&r);
        }
        push_time += t.elapsed().as_secs_f64();
        pushed += burst;
        host.drain(|_| {});
    }
    println!(
        "push only:   {pushed} records, {:.1} M records/s ({:.1} ns/push)",
        pushed as f64 / push_time / 1e6,
        push_time * 1e9 / pushed as f64
    );
    Ok(())
}
