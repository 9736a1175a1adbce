//! Host-side reader for manual verification of the plugin.
//!
//! `dump SHM [--vcpus N] [--ring RECORDS] [--samples K] [--progress] -- COMMAND ARGS...`
//!
//! Creates the channel at SHM, runs COMMAND (typically qemu-system-x86_64 with the plugin
//! pointed at SHM), drains the rings live while it runs, and then prints the plugin status,
//! per-vCPU counters, records per syscall number and per CR3, and a few sample records.
//! Without a command it waits until a plugin attaches and finishes. `--progress` prints the
//! live counters once a second while the command runs.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use vmsight_ring::{flags, Channel, ChannelHost, Record};

#[derive(Default)]
struct Stats {
    drained: u64,
    by_nr: BTreeMap<u64, u64>,
    by_cr3: BTreeMap<u64, u64>,
    by_vcpu: BTreeMap<u32, u64>,
    samples: BTreeMap<u64, Vec<Record>>,
    with_data: Vec<Record>,
    reg_faults: u64,
    data_faults: u64,
    last_ts: BTreeMap<u32, u64>,
    ts_regressions: u64,
}

impl Stats {
    fn add(&mut self, r: &Record, keep: usize) {
        self.drained += 1;
        *self.by_nr.entry(r.syscall_nr()).or_default() += 1;
        *self.by_cr3.entry(r.cr3).or_default() += 1;
        *self.by_vcpu.entry(r.vcpu).or_default() += 1;
        let s = self.samples.entry(r.syscall_nr()).or_default();
        if s.len() < keep {
            s.push(*r);
        }
        if r.flags & flags::DATA != 0 && self.with_data.len() < keep * 4 {
            self.with_data.push(*r);
        }
        if r.flags & flags::REG_FAULT != 0 {
            self.reg_faults += 1;
        }
        if r.flags & flags::DATA_FAULT != 0 {
            self.data_faults += 1;
        }
        let last = self.last_ts.entry(r.vcpu).or_default();
        if r.timestamp_ns < *last {
            self.ts_regressions += 1;
        }
        *last = r.timestamp_ns;
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let shm = args
        .next()
        .ok_or("usage: dump SHM [--vcpus N] [--ring R] -- COMMAND...")?;
    let (mut vcpus, mut ring, mut keep, mut progress) = (4u32, 65536u32, 3usize, false);
    let mut cmd: Vec<String> = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--vcpus" => vcpus = args.next().ok_or("--vcpus needs a value")?.parse()?,
            "--ring" => ring = args.next().ok_or("--ring needs a value")?.parse()?,
            "--samples" => keep = args.next().ok_or("--samples needs a value")?.parse()?,
            "--progress" => progress = true,
            "--" => {
                cmd = args.by_ref().collect();
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let mut host = Channel::create(&shm, vcpus, ring)?;
    let mut st = Stats::default();
    let t0 = std::time::Instant::now();
    if cmd.is_empty() {
        eprintln!(
            "dump: channel {shm} ready ({vcpus} vCPUs x {ring} records); waiting for a plugin"
        );
        while !host.plugin_finished() {
            drain(&mut host, &mut st, keep);
            std::thread::sleep(Duration::from_millis(2));
        }
    } else {
        let mut child = Command::new(&cmd[0]).args(&cmd[1..]).spawn()?;
        let mut next = std::time::Instant::now();
        loop {
            if progress && std::time::Instant::now() >= next {
                next += Duration::from_secs(1);
                let t = host.totals();
                eprintln!(
                    "dump: t={:.0}s syscalls={} callbacks={} written={} dropped={} drained={} \
                     heartbeat={}",
                    t0.elapsed().as_secs_f64(),
                    t.syscalls,
                    t.callbacks,
                    t.records_written,
                    t.records_dropped,
                    st.drained,
                    host.plugin_status().heartbeat_ns
                );
            }
            if drain(&mut host, &mut st, keep) == 0 {
                if child.try_wait()?.is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let status = child.wait()?;
        eprintln!("dump: command exited with {status}");
    }
    drain(&mut host, &mut st, keep);
    report(&host, &st, t0.elapsed());
    Ok(())
}

fn drain(host: &mut ChannelHost, st: &mut Stats, keep: usize) -> usize {
    host.drain(|r| st.add(r, keep))
}

fn report(host: &ChannelHost, st: &Stats, dt: Duration) {
    let s = host.plugin_status();
    println!(
        "plugin: attached={} finished={} pid={} api=v{} vcpus={} flags={:#x} attaches={}",
        host.plugin_attached(),
        host.plugin_finished(),
        s.pid,
        s.api_version,
        s.vcpus,
        s.flags,
        s.attach_count
    );
    println!(
        "vcpu  syscalls  callbacks  written  dropped  instrumented  reg_err  mem_err  internal"
    );
    for (v, c) in host.counters().iter().enumerate() {
        if *c == Default::default() {
            continue;
        }
        println!(
            "{v:>4} {:>9} {:>10} {:>8} {:>8} {:>13} {:>8} {:>8} {:>9}",
            c.syscalls,
            c.callbacks,
            c.records_written,
            c.records_dropped,
            c.instrumented,
            c.reg_read_errors,
            c.mem_read_errors,
            c.internal_errors
        );
    }
    let t = host.totals();
    println!(
        " all {:>9} {:>10} {:>8} {:>8} {:>13} {:>8} {:>8} {:>9}",
        t.syscalls,
        t.callbacks,
        t.records_written,
        t.records_dropped,
        t.instrumented,
        t.reg_read_errors,
        t.mem_read_errors,
        t.internal_errors
    );
    println!(
        "drained {} records in {:.1} s (written - drained = {}), corrupt events {}, \
         reg faults {}, data faults {}, per-vCPU timestamp regressions {}",
        st.drained,
        dt.as_secs_f64(),
        t.records_written as i64 - st.drained as i64,
        host.corrupt_events(),
        st.reg_faults,
        st.data_faults,
        st.ts_regressions
    );
    println!("records per vCPU: {:?}", st.by_vcpu);
    let mut by_nr: Vec<_> = st.by_nr.iter().collect();
    by_nr.sort_by(|a, b| b.1.cmp(a.1));
    println!("records per syscall nr (top 20):");
    for (nr, n) in by_nr.iter().take(20) {
        println!("  nr {nr:>4}: {n}");
    }
    let mut by_cr3: Vec<_> = st.by_cr3.iter().collect();
    by_cr3.sort_by(|a, b| b.1.cmp(a.1));
    println!("distinct CR3 values: {} (top 8):", by_cr3.len());
    for (cr3, n) in by_cr3.iter().take(8) {
        println!("  cr3 {cr3:#012x}: {n}");
    }
    for nr in [39u64, 1, 59] {
        for r in st.samples.get(&nr).into_iter().flatten() {
            println!(
                "  sample nr={} vcpu={} pc={:#x} cr3={:#x} sp={:#x} args={:x?} t={}",
                r.syscall_nr(),
                r.vcpu,
                r.pc,
                r.cr3,
                r.user_sp(),
                r.syscall_args(),
                r.timestamp_ns
            );
        }
    }
    for r in &st.with_data {
        let d = r.data().unwrap_or_default();
        println!(
            "  write(fd={}, len={}) data[{}]={:?}",
            r.syscall_args()[0],
            r.syscall_args()[2],
            d.len(),
            String::from_utf8_lossy(&d)
        );
    }
}
