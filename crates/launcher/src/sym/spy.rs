//! Reading the SymSpy page. Everything in it was written by the guest and is hostile input:
//! the page is copied under its sequence counter (bounded retries), then every count is
//! bounded by the layout, every string is decoded lossily from its fixed field, and every
//! inconsistency is reported as a problem instead of trusted.

use vmsight_proto::sym::{
    c_str, feature, guest_state, guest_state_name, hint, le_u32, le_u64, nr, refuse, swap_record,
    vmm_state_name, CpuTask, GuestSpy, MemCounters, SpyReport, SymCounters, Ty, ABI_VERSION, CPU,
    GUEST, GUEST_MAGIC, HINT, MAX_CPUS, MAX_HINTS, MAX_SWAPS, SWAP, VMM,
};

use super::region::Region;

/// How often a torn copy (the guest was refreshing) is retried.
const SEQ_RETRIES: usize = 16;

/// What vmsight tells the guest about one of its disks (`VMM.hints`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskHint {
    pub index: u32,
    pub serial: String,
    pub flags: u32,
}

/// The hint for one of the VM's disks: how vmsight serves it.
pub fn disk_hint(cfg: &crate::config::VmConfig, d: &crate::vm::prepare::DiskPlan) -> DiskHint {
    let staged = |name: &str| cfg.stages.iter().any(|s| s.name == name);
    let mut flags = 0;
    for (on, bit) in [
        (d.read_only, hint::READONLY),
        // Every disk has the iCache when it is asked for; the disk model only extra disks.
        (staged("icache"), hint::ICACHE),
        (d.dedup.is_some(), hint::DEDUP),
        (d.index > 0 && staged("disk-model"), hint::DISK_MODEL),
        (!d.read_only && cfg.stream.enabled, hint::STREAMED),
    ] {
        if on {
            flags |= bit;
        }
    }
    DiskHint {
        index: d.index as u32,
        serial: d.serial.clone(),
        flags,
    }
}

/// Writes the disk hints into vmsight's page.
pub fn write_hints(r: &Region, hints: &[DiskHint]) {
    let n = hints.len().min(MAX_HINTS);
    let base = VMM.at("hints");
    for (i, h) in hints.iter().take(n).enumerate() {
        let at = base + i * HINT.size;
        r.store32(at + HINT.field("kind").offset, hint::KIND_DISK);
        r.store32(at + HINT.field("index").offset, h.index);
        r.store32(at + HINT.field("flags").offset, h.flags);
        let f = HINT.field("serial");
        let mut s = h.serial.as_bytes().to_vec();
        s.resize(f.ty.size() - 1, 0);
        s.push(0);
        r.write(at + f.offset, &s);
    }
    r.store32(VMM.at("nr_hints"), n as u32);
}

/// The feature bits' names.
pub fn feature_names(f: u32) -> Vec<String> {
    [
        (feature::SPY, "spy"),
        (feature::DOORBELL, "doorbell"),
        (feature::SYNC, "sync"),
        (feature::SWAP, "swap"),
    ]
    .iter()
    .filter(|(b, _)| f & b != 0)
    .map(|(_, n)| (*n).to_owned())
    .collect()
}

/// Why the interface was refused, as a sentence.
pub fn refusal(reason: u32, guest_abi: u32) -> String {
    match reason {
        refuse::VERSION => format!(
            "the guest module speaks interface version {guest_abi}, vmsight speaks \
             {ABI_VERSION}"
        ),
        refuse::MALFORMED => "the guest module's page is malformed (bad magic)".into(),
        n => format!("refused (reason {n})"),
    }
}

fn str_at(p: &[u8], name: &str) -> (String, bool) {
    let f = GUEST.field(name);
    let Ty::Str(n) = f.ty else {
        return (String::new(), false);
    };
    let raw = &p[f.offset..f.offset + n];
    let end = raw.iter().position(|&b| b == 0);
    let valid = end.is_some() && std::str::from_utf8(&raw[..end.unwrap_or(n)]).is_ok();
    (c_str(raw), valid)
}

/// A consistent copy of the guest page: the sequence counter even and unchanged around the
/// copy. `None` after [`SEQ_RETRIES`] torn copies.
fn stable_copy(r: &Region) -> Option<Vec<u8>> {
    let seq_at = GUEST.at("seq");
    for _ in 0..SEQ_RETRIES {
        let before = r.load32(seq_at);
        if before % 2 == 1 {
            std::thread::yield_now();
            continue;
        }
        let page = r.read(GUEST.base, GUEST.size);
        if r.load32(seq_at) == before {
            return Some(page);
        }
    }
    None
}

/// Reads and validates the page. The interface-level fields of the report (features,
/// transports, counters) are the caller's.
pub fn read(r: &Region) -> SpyReport {
    let vmm = r.load32(VMM.at("state"));
    let gstate = r.load32(GUEST.at("state"));
    let mut report = SpyReport {
        abi: ABI_VERSION,
        features: Vec::new(),
        vmm_state: vmm_state_name(vmm),
        guest_state: guest_state_name(gstate),
        refused: (vmm == vmsight_proto::sym::vmm_state::REFUSED)
            .then(|| refusal(r.load32(VMM.at("refuse_reason")), r.load32(GUEST.at("abi")))),
        transports: Vec::new(),
        guest: None,
        problems: Vec::new(),
        counters: SymCounters::default(),
    };
    if gstate != guest_state::ACTIVE {
        return report;
    }
    let Some(page) = stable_copy(r) else {
        report
            .problems
            .push("the page kept changing while read (sequence counter never stable)".into());
        return report;
    };
    report.guest = parse(&page, &mut report.problems);
    report
}

/// Validates a copy of the guest page.
pub fn parse(p: &[u8], problems: &mut Vec<String>) -> Option<GuestSpy> {
    if p.len() < GUEST.size {
        problems.push("short page".into());
        return None;
    }
    let off = |n: &str| GUEST.field(n).offset;
    if le_u64(p, off("magic")) != GUEST_MAGIC {
        problems.push("bad magic".into());
        return None;
    }
    let abi = le_u32(p, off("abi"));
    if abi != ABI_VERSION {
        problems.push(format!("interface version {abi}, expected {ABI_VERSION}"));
        return None;
    }
    let mut nr_cpus = le_u32(p, off("nr_cpus"));
    if nr_cpus == 0 || nr_cpus as usize > MAX_CPUS {
        problems.push(format!("nr_cpus {nr_cpus} outside 1..={MAX_CPUS}"));
        nr_cpus = nr_cpus.clamp(1, MAX_CPUS as u32);
    }
    let (release, ok1) = str_at(p, "release");
    let (version, ok2) = str_at(p, "version");
    for (name, ok) in [("release", ok1), ("version", ok2)] {
        if !ok {
            problems.push(format!("{name} is not a NUL-terminated UTF-8 string"));
        }
    }
    let mem = mem_counters(p, problems);
    Some(GuestSpy {
        abi,
        peer: le_u32(p, off("peer")),
        release,
        version,
        nr_cpus,
        refresh_ms: le_u32(p, off("refresh_ms")),
        refreshes: le_u64(p, off("refreshes")),
        symcalls: symcalls(p),
        sync_entry: le_u64(p, off("sync_entry")) != 0,
        mem,
        swaps: swaps(p, problems),
        cpus: cpus(p, nr_cpus),
    })
}

fn mem_counters(p: &[u8], problems: &mut Vec<String>) -> MemCounters {
    let g = |n: &str| le_u64(p, GUEST.field(n).offset);
    let m = MemCounters {
        mem_total_kib: g("mem_total_kib"),
        mem_free_kib: g("mem_free_kib"),
        mem_available_kib: g("mem_available_kib"),
        swap_total_kib: g("swap_total_kib"),
        swap_free_kib: g("swap_free_kib"),
        pswpin: g("pswpin"),
        pswpout: g("pswpout"),
    };
    if m.mem_free_kib > m.mem_total_kib || m.mem_available_kib > m.mem_total_kib {
        problems.push("free or available memory exceeds the total".into());
    }
    if m.swap_free_kib > m.swap_total_kib {
        problems.push("free swap exceeds the total".into());
    }
    m
}

fn symcalls(p: &[u8]) -> Vec<String> {
    let base = GUEST.field("symcalls").offset;
    (0..=nr::MAX)
        .filter(|n| le_u64(p, base + 8 * (*n as usize / 64)) & (1 << (n % 64)) != 0)
        .map(|n| nr::name(n).map_or_else(|| n.to_string(), str::to_owned))
        .collect()
}

fn swaps(p: &[u8], problems: &mut Vec<String>) -> Vec<vmsight_proto::sym::SwapDevice> {
    let n = le_u32(p, GUEST.field("nr_swap").offset) as usize;
    if n > MAX_SWAPS {
        problems.push(format!("nr_swap {n} exceeds {MAX_SWAPS}"));
    }
    let base = GUEST.field("swaps").offset;
    (0..n.min(MAX_SWAPS))
        .map(|i| swap_record(&p[base + i * SWAP.size..base + (i + 1) * SWAP.size]))
        .inspect(|s| {
            if s.used_kib > s.size_kib {
                problems.push(format!("swap {} uses more than its size", s.path));
            }
        })
        .collect()
}

fn cpus(p: &[u8], nr_cpus: u32) -> Vec<CpuTask> {
    let base = GUEST.field("cpus").offset;
    (0..nr_cpus as usize)
        .filter_map(|i| {
            let e = &p[base + i * CPU.size..base + (i + 1) * CPU.size];
            let seq = le_u32(e, CPU.field("seq").offset);
            let comm = CPU.field("comm");
            // Torn (odd) or never written (0) entries are skipped, not trusted.
            (seq != 0 && seq.is_multiple_of(2)).then(|| CpuTask {
                cpu: i as u32,
                pid: le_u32(e, CPU.field("pid").offset) as i32,
                tgid: le_u32(e, CPU.field("tgid").offset) as i32,
                comm: c_str(&e[comm.offset..comm.offset + comm.ty.size()]),
                switches: le_u64(e, CPU.field("switches").offset),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_proto::sym::{guest_state, SWAP};

    fn page() -> Vec<u8> {
        let mut p = vec![0u8; GUEST.size];
        let put64 = |p: &mut Vec<u8>, n: &str, v: u64| {
            let o = GUEST.field(n).offset;
            p[o..o + 8].copy_from_slice(&v.to_le_bytes());
        };
        let put32 = |p: &mut Vec<u8>, o: usize, v: u32| {
            p[o..o + 4].copy_from_slice(&v.to_le_bytes());
        };
        put64(&mut p, "magic", GUEST_MAGIC);
        put32(&mut p, GUEST.field("abi").offset, ABI_VERSION);
        put32(&mut p, GUEST.field("state").offset, guest_state::ACTIVE);
        put32(&mut p, GUEST.field("nr_cpus").offset, 2);
        let r = GUEST.field("release").offset;
        p[r..r + 5].copy_from_slice(b"6.1.0");
        let v = GUEST.field("version").offset;
        p[v..v + 3].copy_from_slice(b"#1 ");
        put64(&mut p, "mem_total_kib", 1000);
        put64(&mut p, "mem_free_kib", 500);
        put64(&mut p, "mem_available_kib", 600);
        put64(&mut p, "symcalls", 0b11);
        p
    }

    #[test]
    fn a_valid_page_reads_without_problems() {
        let mut problems = Vec::new();
        let g = parse(&page(), &mut problems).unwrap();
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(g.release, "6.1.0");
        assert_eq!(g.nr_cpus, 2);
        assert_eq!(g.symcalls, vec!["ping", "echo"]);
        assert!(g.cpus.is_empty(), "entries never written are skipped");
    }

    #[test]
    fn hostile_counts_and_strings_are_bounded_and_reported() {
        let mut p = page();
        let o = GUEST.field("nr_swap").offset;
        p[o..o + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let o = GUEST.field("nr_cpus").offset;
        p[o..o + 4].copy_from_slice(&9999u32.to_le_bytes());
        let r = GUEST.field("release").offset;
        p[r..r + 64].fill(0xff); // no NUL, not UTF-8
        let o = GUEST.field("mem_free_kib").offset;
        p[o..o + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let s = GUEST.field("swaps").offset + SWAP.field("used_kib").offset;
        p[s..s + 8].copy_from_slice(&5u64.to_le_bytes());
        let mut problems = Vec::new();
        let g = parse(&p, &mut problems).unwrap();
        assert_eq!(g.swaps.len(), MAX_SWAPS);
        assert_eq!(g.nr_cpus as usize, MAX_CPUS);
        assert!(problems.len() >= 5, "{problems:?}");
    }

    #[test]
    fn random_pages_never_panic() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..500 {
            let mut p = page();
            for b in p.iter_mut().skip(16) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            let mut problems = Vec::new();
            let _ = parse(&p, &mut problems);
        }
        let mut problems = Vec::new();
        assert!(parse(&[0u8; 10], &mut problems).is_none());
    }
}
