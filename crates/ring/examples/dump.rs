//! Host-side reader for manual verification of the plugin.
//!
//! `dump SHM [--vcpus N] [--ring RECORDS] [--comm NAME]... [--tgid N]... [--all]
//!      [--show K] [--paths FILE] [--late SECS] [--progress] -- COMMAND ARGS...`
//!
//! Creates the channel at SHM, sets the monitor filters (`--comm`, `--tgid`, `--all`) before
//! anything attaches, runs COMMAND (typically qemu-system-x86_64 with the plugin pointed at
//! SHM), drains the rings live while it runs, and then prints the plugin status, per-vCPU
//! counters, records per kind, process, syscall number, the paths captured for `openat`, and
//! a few sample records. `--paths FILE` writes every captured `openat` as `tgid comm path`.
//! `--late SECS` sets the filters only SECS seconds after starting COMMAND (a runtime change).
//! Without a command it waits until a plugin attaches and finishes.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::process::Command;
use std::time::Duration;

use vmsight_ring::{flags, kind, Channel, ChannelHost, MonitorFilters, Record, VcpuCounters};

/// An entry waiting for its DATA records: the entry, records still expected, arg -> bytes.
type Pending = (Record, u8, BTreeMap<u8, Vec<u8>>);

#[derive(Default)]
struct Stats {
    drained: u64,
    entries: u64,
    returns: u64,
    data: u64,
    by_nr: BTreeMap<u64, u64>,
    by_proc: BTreeMap<(u32, String), (u64, u64)>,
    returns_by_tgid: BTreeMap<u32, u64>,
    iret_returns: u64,
    sysret_returns: u64,
    tids: BTreeSet<u32>,
    samples: BTreeMap<u64, Vec<Record>>,
    ret_samples: Vec<Record>,
    reg_faults: u64,
    data_lost: u64,
    data_faults: u64,
    data_trunc: u64,
    /// Pending entry per ring waiting for its DATA records, with the args assembled so far.
    pending: BTreeMap<u32, Pending>,
    /// Completed entries with data: (entry, arg -> bytes).
    with_data: Vec<(Record, BTreeMap<u8, Vec<u8>>)>,
    data_orphans: u64,
    last_ts: BTreeMap<u32, u64>,
    ts_regressions: u64,
    paths: Option<std::fs::File>,
    openat_paths: u64,
}

impl Stats {
    fn finish_entry(&mut self, vcpu: u32) {
        if let Some((e, _, args)) = self.pending.remove(&vcpu) {
            if e.syscall_nr() == 257 {
                self.openat_paths += 1;
                if let Some(f) = self.paths.as_mut() {
                    let p = args.get(&1).cloned().unwrap_or_default();
                    let _ = writeln!(
                        f,
                        "{} {} {}",
                        e.tgid(),
                        e.comm_string(),
                        String::from_utf8_lossy(&p)
                    );
                }
            }
            if self.with_data.len() < 4000 {
                self.with_data.push((e, args));
            }
        }
    }

    fn add(&mut self, r: &Record, keep: usize) {
        self.drained += 1;
        if r.flags & flags::REG_FAULT != 0 {
            self.reg_faults += 1;
        }
        let last = self.last_ts.entry(r.vcpu).or_default();
        if r.kind != kind::DATA {
            if r.timestamp_ns < *last {
                self.ts_regressions += 1;
            }
            *last = r.timestamp_ns;
        }
        match r.kind {
            kind::SYSCALL_ENTRY => {
                self.finish_entry(r.vcpu);
                self.entries += 1;
                self.tids.insert(r.tid());
                *self.by_nr.entry(r.syscall_nr()).or_default() += 1;
                self.by_proc
                    .entry((r.tgid(), r.comm_string()))
                    .or_default()
                    .0 += 1;
                let s = self.samples.entry(r.syscall_nr()).or_default();
                if s.len() < keep {
                    s.push(*r);
                }
                if r.flags & flags::DATA_LOST != 0 {
                    self.data_lost += 1;
                }
                if r.data_count() > 0 {
                    self.pending
                        .insert(r.vcpu, (*r, r.data_count(), BTreeMap::new()));
                }
            }
            kind::SYSCALL_RETURN => {
                self.finish_entry(r.vcpu);
                self.returns += 1;
                *self.returns_by_tgid.entry(r.tgid()).or_default() += 1;
                if r.flags & flags::VIA_IRET != 0 {
                    self.iret_returns += 1;
                } else {
                    self.sysret_returns += 1;
                }
                if self.ret_samples.len() < keep * 2 {
                    self.ret_samples.push(*r);
                }
            }
            kind::SUMS => {
                // Buffer checksums (layout 3): one line per record, for checking by hand.
                let h = r.sums_header();
                println!(
                    "sums vcpu={} ts={} fd={} read={} append={} src={} pos={} len={} inode={:#x} \
                     i_size={} chunks={:?} flags={:#x}",
                    r.vcpu,
                    r.timestamp_ns,
                    h.fd,
                    h.read,
                    h.append,
                    h.pos_source,
                    h.pos,
                    h.len,
                    h.inode,
                    h.i_size,
                    r.sums_values(),
                    r.flags
                );
                if let Some((_, left, _)) = self.pending.get_mut(&r.vcpu) {
                    *left = left.saturating_sub(1);
                }
            }
            kind::DATA => {
                self.data += 1;
                if r.flags & flags::FAULT != 0 {
                    self.data_faults += 1;
                }
                if r.flags & flags::TRUNCATED != 0 {
                    self.data_trunc += 1;
                }
                let done = match self.pending.get_mut(&r.vcpu) {
                    Some((e, left, args)) if e.timestamp_ns == r.timestamp_ns && *left > 0 => {
                        r.append_data(args.entry(r.data_arg()).or_default());
                        *left -= 1;
                        *left == 0
                    }
                    _ => {
                        self.data_orphans += 1;
                        false
                    }
                };
                if done {
                    self.finish_entry(r.vcpu);
                }
            }
            _ => {}
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: dump SHM [--vcpus N] [--ring R] [--comm NAME]... [--tgid N]... [--all] \
                 [--show K] [--paths FILE] [--late SECS] [--progress] -- COMMAND...";
    let shm = args.next().ok_or(usage)?;
    let (mut vcpus, mut ring, mut keep, mut progress) = (4u32, 65536u32, 3usize, false);
    let mut filters = MonitorFilters::none();
    let mut paths = None;
    let mut late: Option<f64> = None;
    let mut cmd: Vec<String> = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--vcpus" => vcpus = args.next().ok_or("--vcpus needs a value")?.parse()?,
            "--ring" => ring = args.next().ok_or("--ring needs a value")?.parse()?,
            "--show" | "--samples" => keep = args.next().ok_or("--show needs a value")?.parse()?,
            "--comm" => filters = filters.with_comm(&args.next().ok_or("--comm needs a name")?)?,
            "--tgid" => {
                filters = filters.with_tgid(args.next().ok_or("--tgid needs N")?.parse()?)?
            }
            "--all" => filters.monitor_all = true,
            "--paths" => paths = Some(std::fs::File::create(args.next().ok_or("--paths FILE")?)?),
            "--progress" => progress = true,
            "--late" => late = Some(args.next().ok_or("--late needs seconds")?.parse()?),
            "--" => cmd = args.by_ref().collect(),
            other => return Err(format!("unknown argument {other}; {usage}").into()),
        }
    }
    let mut host = Channel::create(&shm, vcpus, ring)?;
    if late.is_none() {
        let generation = host.set_filters(&filters)?;
        eprintln!("dump: filters generation {generation}: {filters:?}");
    }
    let mut st = Stats {
        paths,
        ..Stats::default()
    };
    let t0 = std::time::Instant::now();
    if cmd.is_empty() {
        eprintln!("dump: channel {shm} ready ({vcpus} vCPUs x {ring} records); waiting");
        while !host.plugin_finished() {
            drain(&mut host, &mut st, keep);
            std::thread::sleep(Duration::from_millis(2));
        }
    } else {
        let mut child = Command::new(&cmd[0]).args(&cmd[1..]).spawn()?;
        let mut next = std::time::Instant::now();
        loop {
            if late.is_some_and(|s| t0.elapsed().as_secs_f64() >= s) {
                late = None;
                let g = host.set_filters(&filters)?;
                let ok = host.wait_filters_applied(g, Duration::from_secs(5));
                eprintln!(
                    "dump: t={:.1}s filters generation {g} set, applied={ok} after {:.1}s",
                    t0.elapsed().as_secs_f64(),
                    t0.elapsed().as_secs_f64()
                );
            }
            if progress && std::time::Instant::now() >= next {
                next += Duration::from_secs(1);
                let t = host.totals();
                eprintln!(
                    "dump: t={:.0}s syscalls={} monitored={} classif={} cr3={} returns={} \
                     written={} dropped={} drained={}",
                    t0.elapsed().as_secs_f64(),
                    t.syscalls,
                    t.monitored_syscalls,
                    t.classifications,
                    t.cr3_writes,
                    t.returns,
                    t.records_written,
                    t.records_dropped,
                    st.drained,
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
    let pending: Vec<u32> = st.pending.keys().copied().collect();
    for v in pending {
        st.finish_entry(v);
    }
    report(&host, &st, t0.elapsed());
    Ok(())
}

fn drain(host: &mut ChannelHost, st: &mut Stats, keep: usize) -> usize {
    host.drain(|r| st.add(r, keep))
}

fn row(name: &str, c: &VcpuCounters) {
    println!(
        "{name:>4} {:>9} {:>9} {:>9} {:>7} {:>6} {:>8} {:>8} {:>8} {:>7} {:>6} {:>5} {:>5} {:>5} \
         {:>5} {:>5} {:>5}",
        c.syscalls,
        c.callbacks,
        c.monitored_syscalls,
        c.classifications,
        c.cr3_writes,
        c.return_callbacks,
        c.returns,
        c.records_written,
        c.records_dropped,
        c.invalidations,
        c.ancestor_hops,
        c.kernel_read_errors,
        c.cr3_mismatches,
        c.mem_read_errors,
        c.reg_read_errors,
        c.internal_errors
    );
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
    if let Some(r) = host.plugin_report() {
        println!(
            "plugin report: applied generation {}, monitored tgids {:?}{}",
            r.applied_generation,
            r.tgids,
            if r.overflow { " (more)" } else { "" }
        );
    }
    println!(
        "vcpu  syscalls callbacks monitored classif cr3_wr ret_cbs  returns  written dropped \
         inval  hops kerr  cr3mm  merr  rerr  int"
    );
    for (v, c) in host.counters().iter().enumerate() {
        if *c != VcpuCounters::default() {
            row(&v.to_string(), c);
        }
    }
    let t = host.totals();
    row("all", &t);
    println!(
        "kernel-mode irets ignored {}, data records {} (plugin) / {} (drained), instrumented \
         syscall sites {}",
        t.kernel_returns, t.data_records, st.data, t.instrumented
    );
    println!(
        "drained {} records in {:.1} s (written - drained = {}), corrupt events {}: entries {}, \
         returns {} (sysret {}, iret {}), data {}; reg faults {}, data lost {}, \
         data faults {}, truncated {}, orphan data {}, timestamp regressions {}",
        st.drained,
        dt.as_secs_f64(),
        t.records_written as i64 - st.drained as i64,
        host.corrupt_events(),
        st.entries,
        st.returns,
        st.sysret_returns,
        st.iret_returns,
        st.data,
        st.reg_faults,
        st.data_lost,
        st.data_faults,
        st.data_trunc,
        st.data_orphans,
        st.ts_regressions
    );
    println!("entries per process (tgid comm: entries; returns):");
    for ((tgid, comm), (n, _)) in &st.by_proc {
        println!(
            "  {tgid:>6} {comm:<16} {n:>8}; {}",
            st.returns_by_tgid.get(tgid).copied().unwrap_or(0)
        );
    }
    println!("distinct tids: {}", st.tids.len());
    let mut by_nr: Vec<_> = st.by_nr.iter().collect();
    by_nr.sort_by(|a, b| b.1.cmp(a.1));
    println!("entries per syscall nr (top 12):");
    for (nr, n) in by_nr.iter().take(12) {
        println!("  nr {nr:>4}: {n}");
    }
    for nr in [110u64, 59, 56, 57, 61] {
        for r in st.samples.get(&nr).into_iter().flatten() {
            println!(
                "  entry nr={} vcpu={} tid={} tgid={} comm={} task={:#x} pc={:#x} cr3={:#x} \
                 sp={:#x} args={:x?}",
                r.syscall_nr(),
                r.vcpu,
                r.tid(),
                r.tgid(),
                r.comm_string(),
                r.task(),
                r.pc,
                r.cr3,
                r.user_sp(),
                r.syscall_args(),
            );
        }
    }
    for r in &st.ret_samples {
        println!(
            "  return via={:?} vcpu={} tid={} tgid={} task={:#x} rip={:#x} rax={:#x} sp={:#x} \
             cs={:#x} insn={:#x}",
            r.return_via(),
            r.vcpu,
            r.tid(),
            r.tgid(),
            r.task(),
            r.return_rip(),
            r.return_value(),
            r.return_sp(),
            r.return_cs(),
            r.return_insn(),
        );
    }
    println!("entries with data (first {}):", 40.min(st.with_data.len()));
    for (e, args) in st.with_data.iter().take(40) {
        let a: Vec<String> = args
            .iter()
            .map(|(i, b)| {
                let mut s = String::from_utf8_lossy(b).into_owned();
                s.truncate(60);
                format!("arg{i}={s:?}")
            })
            .collect();
        println!(
            "  {} {} nr={} {}",
            e.tgid(),
            e.comm_string(),
            e.syscall_nr(),
            a.join(" ")
        );
    }
    println!("openat entries with a path: {}", st.openat_paths);
}
