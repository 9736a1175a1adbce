//! SwapBypass (`vmsight run --swap`, docs/swapbypass.md): the swap disk vmsight serves from its
//! swap cache, with and without the symbiotic module's bypass, the cache resized while the
//! guest swaps, and guest memory added through virtio-mem while it thrashes. Every page's
//! integrity is checked by the guest's own program (swap-check: per-page versioned patterns,
//! random-order rounds); the mechanism claimed is checked against the guest kernel's own
//! counters (`/proc/vmstat` pswpin/pswpout, `/proc/swaps`, `/proc/meminfo`), never against
//! vmsight alone.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use vmsight_metrics::harness::{free_loopback_port, Prometheus};
use vmsight_tests::*;

/// Prints the guest's swap counters as `vmstat pswpin=N pswpout=N`.
const VMSTAT: &str =
    r#"echo "vmstat $(awk '/^pswp(in|out) / {printf "%s=%s ", $1, $2}' /proc/vmstat)""#;

/// The guest's own I/O counts of the disk under `/dev/vmswap0` (`/sys/block/DEV/stat`: read
/// and write requests completed), or `diskstat none` without the module's device.
const DISKSTAT: &str = r#"d=$(cat /sys/module/vmsight_sym/parameters/swap_disk 2>/dev/null || true); d=${d##*/}; if [ -n "$d" ] && [ -r /sys/block/$d/stat ]; then echo "diskstat $(awk '{printf "reads=%s writes=%s", $1, $5}' /sys/block/$d/stat)"; else echo "diskstat none"; fi"#;

/// `key=value` words of a line.
fn fields(line: &str) -> HashMap<String, u64> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
        .collect()
}

/// The last stdout line starting with `prefix`, as fields.
fn line_fields(stdout: &str, prefix: &str) -> HashMap<String, u64> {
    let l = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in {stdout}"));
    fields(l)
}

fn stats_swap(path: &Path) -> Value {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["swap"].clone()
}

fn n(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in the swap report {v}"))
}

/// The device the guest swaps on (`/proc/swaps`).
fn swap_device(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("swapdev "))
        .unwrap_or_else(|| panic!("no swap device line in {stdout}"))
        .trim()
        .to_owned()
}

/// The guest's (reads, writes) of the disk under `/dev/vmswap0` before and after the workload.
fn diskstats(stdout: &str) -> ((u64, u64), (u64, u64)) {
    let v: Vec<(u64, u64)> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("diskstat "))
        .map(|l| {
            let f = fields(l);
            (f["reads"], f["writes"])
        })
        .collect();
    assert_eq!(v.len(), 2, "two diskstat lines with counts in {stdout}");
    (v[0], v[1])
}

/// The guest part every test shares: swap state, counters before, the workload, counters
/// after.
fn script(workload: &str, after: &str) -> String {
    format!(
        "set -e\n\
         echo \"swapdev $(awk 'NR > 1 {{print $1}}' /proc/swaps)\"\n\
         {DISKSTAT}\n\
         {VMSTAT}\n\
         {workload}\n\
         {VMSTAT}\n\
         {DISKSTAT}\n\
         {after}\n"
    )
}

/// Reads and writes the block path makes on the swap disk besides the guest's swap I/O: the
/// swap header (mkswap, swapon) and the kernel's and blkid's probing of a new disk.
const PROBE_PAGES: u64 = 1024;

/// Runs `sh` in a 128 MiB guest with the symbiotic module and a `swap` swap disk (the
/// `--swap` spec), its stats written to `st`.
fn bypass_guest(st: &tempfile::NamedTempFile, swap: &str, sh: &str) -> Run {
    let stats = st.path().to_str().unwrap();
    guest_sh(
        &[
            "--mem",
            "128M",
            "--symbiotic",
            "--swap",
            swap,
            "--stats-json",
            stats,
        ],
        sh,
    )
}

/// After the workload: a moment for vmsight to take the freed pages' memory back, then the
/// guest's own count of swap in use as `swapused kib=N`.
const SWAPUSED: &str = "sleep 3; echo \"swapused kib=$(awk '/^SwapTotal:/ {t=$2} \
    /^SwapFree:/ {f=$2} END {print t - f}' /proc/meminfo)\"";

/// What stays in the cache is what the guest still has swapped out (its own count, from
/// [`SWAPUSED`]) and the swap header: the slots of every freed page were let go.
fn assert_cache_holds_only_the_swap_in_use(r: &Run, s: &Value) {
    let used_kib = line_fields(&r.stdout, "swapused")["kib"];
    assert!(
        n(s, "cache_used_pages") <= used_kib / 4 + 16,
        "cache vs the guest's {used_kib} KiB of swap in use: {s}"
    );
}

#[test]
fn without_the_module_every_swap_in_is_a_block_read_and_every_page_survives() {
    let st = tempfile::NamedTempFile::new().unwrap();
    let r = guest_sh(
        &[
            "--mem",
            "128M",
            "--swap",
            "256M,cache=32M",
            "--stats-json",
            st.path().to_str().unwrap(),
        ],
        &script("swap-check 160 --rounds 2", "true"),
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("swap-check OK"), "{r:?}");
    let dev = swap_device(&r.stdout);
    assert!(dev.starts_with("/dev/vd"), "swap on the disk itself: {dev}");
    let v = line_fields(&r.stdout, "vmstat");
    let (pin, pout) = (v["pswpin"], v["pswpout"]);
    assert!(pin > 1000 && pout > 1000, "the guest swapped: {v:?}");
    let s = stats_swap(st.path());
    assert_eq!(s["bypass_offered"], false);
    // The guest's own counts and the swap disk's requests agree page for page, but for the
    // header and probing reads.
    let (br, bw) = (n(&s, "block_reads"), n(&s, "block_writes"));
    assert!(
        br >= pin && br - pin <= PROBE_PAGES,
        "reads {br} vs pswpin {pin}"
    );
    assert!(
        bw >= pout && bw - pout <= PROBE_PAGES,
        "writes {bw} vs pswpout {pout}"
    );
    // A 32 MiB cache under 160 MiB of swapped pages: evictions and both kinds of reads.
    assert!(n(&s, "evictions") > 0, "{s}");
    assert!(n(&s, "cache_hits") > 0 && n(&s, "cache_misses") > 0, "{s}");
    assert!(n(&s, "cache_used_pages") <= 32 << 8, "{s}");
    assert_eq!(n(&s, "corrupt"), 0, "{s}");
}

/// The module's own time (`swap_stats`: store_ns, load_ns, copy_ns) as `symtime` fields.
const SYMTIME: &str = "echo \"symtime $(awk '/^(store|load|copy)_ns / {print $1 \"=\" $2}' \
    /sys/module/vmsight_sym/parameters/swap_stats | tr '\\n' ' ')\"";

/// This run copies pages with `copy_page` instead of `memcpy` (the module's `swap_copy_page`;
/// the other bypass tests keep the default): swap-check finds a page the copy got wrong.
#[test]
fn the_bypass_swaps_through_shared_memory_without_block_io_and_the_cache_empties_after() {
    let st = tempfile::NamedTempFile::new().unwrap();
    let workload = "echo 1 > /sys/module/vmsight_sym/parameters/swap_copy_page\n\
         swap-check 160 --rounds 2";
    let after = format!("{SWAPUSED}\n{SYMTIME}");
    let r = bypass_guest(&st, "256M", &script(workload, &after));
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("swap-check OK"), "{r:?}");
    // The module timed its work: every copy happens inside a store or a load.
    let t = line_fields(&r.stdout, "symtime");
    let (store, load, copy) = (t["store_ns"], t["load_ns"], t["copy_ns"]);
    assert!(store > 0 && load > 0 && copy > 0, "{t:?}");
    assert!(copy <= store + load, "{t:?}");
    assert_eq!(swap_device(&r.stdout), "/dev/vmswap0", "{r:?}");
    let v = line_fields(&r.stdout, "vmstat");
    let (pin, pout) = (v["pswpin"], v["pswpout"]);
    assert!(pin > 1000 && pout > 1000, "the guest swapped: {v:?}");
    let s = stats_swap(st.path());
    assert_eq!(s["bypass_active"], true, "{s}");
    // Every swap-in and swap-out the guest kernel counted went through the region, but for
    // the probing of the new device before mkswap (nothing cached yet) and the few pages the
    // module sent down the disk path when the region's lock stayed busy beyond its bound
    // (both counted): the disk path carries next to nothing.
    let (loads, lower_r) = (n(&s, "bypass_loads"), n(&s, "bypass_lower_reads"));
    let (stores, lower_w) = (n(&s, "bypass_stores"), n(&s, "bypass_lower_writes"));
    assert!(loads + lower_r >= pin, "loads vs pswpin {pin}: {s}");
    assert!(stores + lower_w >= pout, "stores vs pswpout {pout}: {s}");
    assert!(lower_r <= PROBE_PAGES + pin / 100, "{s}");
    assert!(lower_w <= pout / 100, "{s}");
    assert!(
        lower_w <= n(&s, "bypass_busy") + n(&s, "bypass_store_full"),
        "{s}"
    );
    assert_eq!(
        n(&s, "block_writes"),
        lower_w,
        "every disk write is a counted fallback: {s}"
    );
    assert!(n(&s, "block_reads") <= PROBE_PAGES + pin / 100, "{s}");
    // The guest's own block-layer counts of the disk under /dev/vmswap0 agree, independently
    // of vmsight's counters: the workload's swapping made next to no requests on it.
    let (before, after) = diskstats(&r.stdout);
    let (reads, writes) = (after.0 - before.0, after.1 - before.1);
    assert!(
        reads <= pin / 100 + 16 && writes <= pout / 100 + 16,
        "the guest's disk made {reads} reads and {writes} writes for {pin} swap-ins and {pout} \
         swap-outs"
    );
    // The workload is gone: its swap slots were freed, and the cache with them.
    assert_cache_holds_only_the_swap_in_use(&r, &s);
    assert!(
        n(&s, "cache_resident_bytes") <= 16 << 20,
        "the freed pages' memory went back to the host: {s}"
    );
    assert_eq!(n(&s, "corrupt") + n(&s, "bypass_corrupt"), 0, "{s}");
}

/// The measurement variant without `rw_page` (`vmsight_sym.swap_rw_page=0`): the kernel then
/// swaps in through its swap cache with readahead, in multi-page bios the module serves from
/// the region. The module says which mode it built (its own dmesg line, read in the guest),
/// every page survives (swap-check's own verification), and the swap-ins are region loads,
/// not reads of the disk below (the guest's diskstats).
#[test]
fn without_rw_page_swap_ins_go_through_the_swap_cache_and_still_come_from_the_region() {
    let st = tempfile::NamedTempFile::new().unwrap();
    let stats = st.path().to_str().unwrap();
    let workload = "dmesg | grep -o 'rw_page o[nf]*' | sed 's/^/mode /'\n\
         swap-check 160 --rounds 2";
    let r = guest_sh(
        &[
            "--mem",
            "128M",
            "--symbiotic",
            "--swap",
            "256M",
            "--append",
            "vmsight_sym.swap_rw_page=0",
            "--stats-json",
            stats,
        ],
        &script(workload, SWAPUSED),
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("swap-check OK"), "{r:?}");
    assert!(r.stdout.contains("mode rw_page off"), "{r:?}");
    assert_eq!(swap_device(&r.stdout), "/dev/vmswap0", "{r:?}");
    let v = line_fields(&r.stdout, "vmstat");
    let (pin, pout) = (v["pswpin"], v["pswpout"]);
    assert!(pin > 1000 && pout > 1000, "the guest swapped: {v:?}");
    let s = stats_swap(st.path());
    let (loads, lower_r) = (n(&s, "bypass_loads"), n(&s, "bypass_lower_reads"));
    assert!(loads + lower_r >= pin, "loads vs pswpin {pin}: {s}");
    assert!(lower_r <= PROBE_PAGES + pin / 100, "{s}");
    let (before, after) = diskstats(&r.stdout);
    assert!(
        after.0 - before.0 <= pin / 100 + 16,
        "the guest's disk reads for {pin} swap-ins: {before:?} -> {after:?}"
    );
    assert_eq!(n(&s, "corrupt") + n(&s, "bypass_corrupt"), 0, "{s}");
}

#[test]
fn swap_pages_freed_while_the_region_lock_is_busy_leave_the_cache_once_it_is_free() {
    let st = tempfile::NamedTempFile::new().unwrap();
    // The workload swaps out most of its 160 MiB and pauses; a guest process then takes the
    // region's lock as the module does, kills the workload (whose exit frees its swap pages)
    // and holds the lock for 1 s (well below the 2 s after which vmsight fails a disk-path
    // request): the module's free notifications meanwhile find the lock busy.
    let workload = "touch /tmp/pause\n\
         swap-check 160 --rounds 1 --pause-file /tmp/pause > /tmp/sc.out 2>&1 &\n\
         sc=$!\n\
         until grep -q 'swap-check: paused' /tmp/sc.out; do sleep 0.2; done\n\
         sym-hostile swaplock 1000 $sc\n\
         wait $sc || true";
    let r = bypass_guest(&st, "256M", &script(workload, SWAPUSED));
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("swaplock: held"), "{r:?}");
    assert_eq!(swap_device(&r.stdout), "/dev/vmswap0", "{r:?}");
    let v = line_fields(&r.stdout, "vmstat");
    assert!(v["pswpout"] > 1000, "the guest swapped: {v:?}");
    let s = stats_swap(st.path());
    // The mechanism engaged: frees met the busy lock and were deferred...
    assert!(n(&s, "bypass_deferred") > 0, "{s}");
    // ...and the drain let their slots go.
    assert_cache_holds_only_the_swap_in_use(&r, &s);
    assert_eq!(n(&s, "corrupt") + n(&s, "bypass_corrupt"), 0, "{s}");
}

/// `vmsight swap NAME ...` as JSON.
fn swap_cmd(name: &str, args: &[&str]) -> Value {
    let mut a = vec!["swap", name];
    a.extend_from_slice(args);
    a.push("--json");
    let r = run(&a);
    assert_eq!(r.code, Some(0), "{r:?}");
    serde_json::from_str(&r.stdout).unwrap()
}

#[test]
fn the_cache_shrinks_and_grows_while_the_guest_swaps_and_no_page_is_lost() {
    let name = vm_name("swapresize");
    let st = tempfile::NamedTempFile::new().unwrap();
    // swap-check waits while /tmp/pause exists (checked after the fill and after every
    // round); the host says when to go on and when to stop again.
    let guest = format!(
        "touch /tmp/pause; \
         (swap-check 160 --rounds 3 --pause-file /tmp/pause; echo \"exit $?\") & \
         while read l; do case $l in go) rm -f /tmp/pause ;; stop) touch /tmp/pause ;; \
         vmstat) {VMSTAT} ;; end) break ;; esac; done; wait"
    );
    // A real Prometheus scrapes the VM (docs/metrics.md).
    let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_loopback_port().unwrap()));
    let prometheus = Prometheus::start(&[metrics]).unwrap_or_else(|e| panic!("{e}"));
    let metrics_addr = metrics.to_string();
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--metrics",
        &metrics_addr,
        "--mem",
        "128M",
        "--symbiotic",
        "--swap",
        "256M",
        "--stats-json",
        st.path().to_str().unwrap(),
        "--",
        "sh",
        "-c",
        &guest,
    ]);
    vm.wait_line("swap-check: paused");
    // What the guest kernel swapped out so far went through the bypass, as scraped.
    vm.send("vmstat");
    let pout = fields(&vm.wait_prefix("vmstat"))["pswpout"];
    assert!(pout > 1000, "the fill swapped: {pout}");
    let q = format!("vmsight_swap_out_pages_total{{vm=\"{name}\",path=\"bypass\"}}");
    prometheus
        .wait_for(&q, Duration::from_secs(60), |s| {
            s.len() == 1 && s[0].value >= 0.99 * pout as f64
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let before = swap_cmd(&name, &["status"]);
    assert!(n(&before, "cache_used_pages") > 16 << 8, "{before}");
    // Shrink to 16 MiB: the evictor moves the coldest pages to the swap file.
    let r = swap_cmd(&name, &["cache", "16M"]);
    assert_eq!(n(&r, "cache_limit_pages"), 16 << 8, "{r}");
    let mut now = Value::Null;
    wait_until("the cache to shrink to 16 MiB", 60, || {
        now = swap_cmd(&name, &["status"]);
        n(&now, "cache_used_pages") <= 16 << 8
    });
    assert!(n(&now, "evictions") > 0, "{now}");
    vm.send("go");
    vm.wait_line("swap-check: resumed");
    // Pause again after the next round (the round takes seconds of swapping).
    vm.send("stop");
    vm.wait_prefix("swap-check: round");
    vm.wait_line("swap-check: paused");
    // The small cache sent pages down the disk path: the spill is in use.
    let mid = swap_cmd(&name, &["status"]);
    assert!(n(&mid, "bypass_lower_reads") > 0, "{mid}");
    assert!(
        n(&mid, "bypass_store_full") + n(&mid, "cache_misses") > 0,
        "{mid}"
    );
    let r = swap_cmd(&name, &["cache", "256M"]);
    assert!(n(&r, "cache_limit_pages") > 60_000, "{r}");
    vm.send("go");
    let ok = vm.wait_prefix("swap-check OK");
    assert!(ok.contains("pages=40960"), "{ok}");
    vm.wait_line("exit 0");
    vm.send("end");
    let (code, _, err) = vm.finish();
    assert_eq!(code, Some(0), "{err}");
    let s = stats_swap(st.path());
    assert!(
        n(&s, "evictions") >= n(&before, "cache_used_pages") - (16 << 8),
        "{s}"
    );
    assert_eq!(n(&s, "corrupt") + n(&s, "bypass_corrupt"), 0, "{s}");
}

#[test]
fn a_thrashing_guest_gets_memory_and_gives_it_back_when_the_workload_ends() {
    let st = tempfile::NamedTempFile::new().unwrap();
    let mem = r#"echo "memtotal $(awk '/^MemTotal:/ {print $2}' /proc/meminfo)""#;
    let r = bypass_guest(
        &st,
        "256M,grow=256M",
        &format!(
            "{mem}; swap-check 200 --rounds 3; {mem}; \
             n=0; while [ $n -lt 60 ]; do sleep 1; n=$((n + 1)); \
             t=$(awk '/^MemTotal:/ {{print $2}}' /proc/meminfo); \
             [ \"$t\" -lt 200000 ] && break; done; {mem}"
        ),
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("swap-check OK"), "{r:?}");
    let totals: Vec<u64> = r
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("memtotal "))
        .map(|t| t.trim().parse().unwrap())
        .collect();
    assert_eq!(totals.len(), 3, "{r:?}");
    assert!(
        totals[1] > totals[0] + 64 * 1024,
        "memory was added: {totals:?}"
    );
    assert!(totals[2] < totals[1], "memory was taken back: {totals:?}");
    let s = stats_swap(st.path());
    let m = &s["mem"];
    assert!(n(m, "grows") >= 1 && n(m, "added_bytes") >= 64 << 20, "{s}");
    assert!(
        n(m, "shrinks") >= 1 && n(m, "removed_bytes") >= 64 << 20,
        "{s}"
    );
}

/// Growable memory is a second memfd in QEMU (the virtio-mem device's backend): the tracer
/// still finds the guest's RAM among the two by its size and reads processes from it.
#[test]
fn a_traced_guest_with_growable_memory_has_its_processes_read_from_its_ram() {
    let r = guest_sh(
        &["--mem", "128M", "--swap", "64M,grow=64M", "--trace"],
        "cd /tmp && ls >/dev/null && echo traced",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("traced"), "{r:?}");
    assert!(
        !r.stderr.contains("cannot read guest kernel memory"),
        "process tracking opened the guest's RAM: {r:?}"
    );
    assert!(
        r.stderr
            .lines()
            .any(|l| l.contains("process ppid=") && l.contains("comm=ls")),
        "the traced ls was seen: {r:?}"
    );
}

#[test]
fn a_guest_scribbling_over_the_swap_region_cannot_take_vmsight_down() {
    let st = tempfile::NamedTempFile::new().unwrap();
    // Garbles the header's counters, the index, the slot states and the free stack of the
    // region (not the lock word, which a hostile guest could hold: that costs it its own swap
    // and is tested in vmsight-swap's unit tests), then swaps through it. The guest's data
    // may suffer; vmsight must serve the VM to its end and say what it met.
    let scribble = r#"
for d in /sys/bus/pci/devices/*; do
  [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = 0x1110 ] || continue
  python3 - "$d/resource2" <<'EOF'
import mmap, os, random, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_SYNC)
m = mmap.mmap(fd, 0)
if m[0:8] != b"VMSWAPRG":
    sys.exit(0)
data_off = int.from_bytes(m[56:64], "little")
random.seed(7)
for _ in range(200000):
    off = random.randrange(32, data_off - 8) & ~7
    if off // 8 != 3:  # the lock word shares the word at 24
        m[off:off + 8] = random.randbytes(8)
print("scribbled", sys.argv[1])
EOF
done
swap-check 160 --rounds 1 || echo "swap-check failed, as it may"
"#;
    let r = bypass_guest(&st, "256M", scribble);
    assert!(r.stdout.contains("scribbled"), "{r:?}");
    // vmsight served the VM to its end (the guest's last command ran) and reported what it
    // met.
    assert_eq!(r.code, Some(0), "{r:?}");
    let s = stats_swap(st.path());
    assert!(
        n(&s, "corrupt") + n(&s, "bypass_corrupt") > 0,
        "the garbage was noticed: {s}"
    );
}

#[test]
fn bad_swap_specs_are_refused_with_the_reason() {
    for (spec, want) in [
        ("lots", "not a size"),
        ("512M,cache=1G", "larger than max-cache"),
        ("512M,grow=3M", "multiple of 2 MiB"),
    ] {
        let r = run(&["run", "--swap", spec, "--", "true"]);
        assert_eq!(r.code, Some(1), "{spec}: {r:?}");
        let e = r.one_line_error();
        assert!(e.contains("--swap") && e.contains(want), "{spec}: {e}");
    }
    let r = run(&["swap", "no-such-vm", "status"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.one_line_error().contains("no-such-vm"), "{r:?}");
}
