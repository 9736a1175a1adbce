//! Growing a thrashing guest (`--swap ...,grow=SIZE`): a virtio-mem device whose requested
//! size vmsight raises through QMP while the guest swaps in heavily and the host has memory
//! to spare (a quarter of `grow=` per step, or at once what the guest has swapped out when
//! SymSpy says), and lowers it again a step at a time once the guest has that much memory free
//! and stopped swapping (docs/swapbypass.md).
//!
//! The policy is deliberately simple and its inputs are all independent of the guest module's
//! honesty for safety: swap-in rate from vmsight's own counters (block reads plus the
//! module's loads), host MemAvailable from /proc/meminfo, and the guest's MemAvailable from
//! SymSpy (without the module, memory is only removed once nothing is in the swap cache).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::json;
use vmsight_proto::swap::{MemReport, SwapReport};

use crate::qmp::Qmp;

/// QEMU's ids of the memory backend and the virtio-mem device.
pub const BACKEND_ID: &str = "swapvmem";
pub const DEVICE_ID: &str = "swapvmem0";
/// virtio-mem's block size (the granularity of plugging).
pub const BLOCK: u64 = 2 << 20;
/// The kernel parameter that makes the guest init load virtio_mem and online new memory.
pub const KERNEL_ARG: &str = "vmsight.memhp=1";
/// How often the policy looks.
const PERIOD: Duration = Duration::from_millis(250);
/// Pages swapped in and out per second above which the guest is short of memory (4 MiB/s):
/// a guest pushing pages out is already paying for the shortage, before it reads them back.
const THRASH_PAGES_PER_S: f64 = 1024.0;
/// Looks in a row that must agree before memory is removed (3 s).
const CALM_LOOKS: u32 = 12;
/// Looks in a row above the threshold before memory is added (a burst, like the kernel
/// probing a new disk at boot, is not a shortage).
const HOT_LOOKS: u32 = 2;
/// Host memory that must stay available after a grow.
const HOST_RESERVE: u64 = 512 << 20;

/// QEMU's arguments for the device with `max` bytes of room, and the QMP monitor vmsight
/// drives it through.
pub fn qemu_args(max: u64, qmp: &Path) -> Vec<String> {
    vec![
        "-object".into(),
        format!("memory-backend-memfd,id={BACKEND_ID},size={max},share=on"),
        "-device".into(),
        format!(
            "virtio-mem-pci,id={DEVICE_ID},memdev={BACKEND_ID},block-size={BLOCK},requested-size=0"
        ),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", qmp.display()),
    ]
}

/// What the policy decides from one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Stay,
    /// Ask for this many bytes in total.
    Request(u64),
}

/// The policy's state.
#[derive(Debug, Clone)]
pub struct Policy {
    pub max: u64,
    pub step: u64,
    pub requested: u64,
    calm: u32,
    hot: u32,
}

/// One look's inputs.
#[derive(Debug, Clone, Copy)]
pub struct Look {
    /// Pages swapped in and out per second since the last look.
    pub swap_per_s: f64,
    /// Host MemAvailable, bytes.
    pub host_available: u64,
    /// The guest's MemAvailable, bytes (SymSpy), if known.
    pub guest_available: Option<u64>,
    /// Swap the guest has in use, bytes (SymSpy), if known: how much memory it is short of.
    pub guest_swap_used: Option<u64>,
    /// Pages in the swap cache.
    pub cache_used: u64,
}

impl Policy {
    pub fn new(max: u64) -> Self {
        // A quarter of the room per step, in whole blocks, at least one block.
        let step = ((max / 4) / BLOCK).max(1) * BLOCK;
        Self {
            max,
            step,
            requested: 0,
            calm: 0,
            hot: 0,
        }
    }

    /// Decides from one look.
    pub fn decide(&mut self, l: &Look) -> Decision {
        if l.swap_per_s >= THRASH_PAGES_PER_S {
            self.calm = 0;
            self.hot = self.hot.saturating_add(1);
            if self.hot < HOT_LOOKS {
                return Decision::Stay;
            }
            let room = self.max - self.requested;
            // At least a step; as much as the guest has swapped out when it says (its
            // shortfall), in whole blocks.
            let want = l
                .guest_swap_used
                .map_or(self.step, |u| u.div_ceil(BLOCK).saturating_mul(BLOCK))
                .max(self.step);
            let step = want.min(room);
            if step > 0 && l.host_available >= step.saturating_add(HOST_RESERVE) {
                self.requested += step;
                return Decision::Request(self.requested);
            }
            return Decision::Stay;
        }
        self.hot = 0;
        if self.requested == 0 || l.swap_per_s > 0.0 {
            self.calm = 0;
            return Decision::Stay;
        }
        let step = self.step.min(self.requested);
        let spare = match l.guest_available {
            Some(avail) => avail >= step + (64 << 20),
            None => l.cache_used == 0,
        };
        if !spare {
            self.calm = 0;
            return Decision::Stay;
        }
        self.calm += 1;
        if self.calm < CALM_LOOKS {
            return Decision::Stay;
        }
        self.calm = 0;
        self.requested -= step;
        Decision::Request(self.requested)
    }
}

/// The running controller.
pub struct MemController {
    report: Arc<Mutex<MemReport>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MemController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemController").finish()
    }
}

/// What the controller thread reads each look.
pub type Source = Box<dyn Fn() -> SwapReport + Send>;

impl MemController {
    /// Starts the controller; it connects to `qmp` once QEMU is up.
    pub fn start(max: u64, qmp: PathBuf, source: Source) -> std::io::Result<Self> {
        let report = Arc::new(Mutex::new(MemReport {
            max_bytes: max,
            ..MemReport::default()
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (report.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("vmsight-swap-mem".into())
            .spawn(move || {
                vmsight_vhostd::seccomp::install_once(
                    vmsight_vhostd::seccomp::ThreadClass::GuestService,
                );
                run(max, &qmp, &source, &r, &s)
            })?;
        Ok(Self {
            report,
            stop,
            thread: Some(thread),
        })
    }

    /// The report the controller keeps up to date.
    pub fn shared_report(&self) -> Arc<Mutex<MemReport>> {
        self.report.clone()
    }
}

impl Drop for MemController {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(max: u64, path: &Path, source: &Source, report: &Mutex<MemReport>, stop: &AtomicBool) {
    let Some(qmp) = connect(path, stop) else {
        return;
    };
    let mut policy = Policy::new(max);
    let mut last = (Instant::now(), swapped(&source()));
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(PERIOD);
        let r = source();
        let now = (Instant::now(), swapped(&r));
        let secs = now.0.duration_since(last.0).as_secs_f64().max(1e-3);
        let look = Look {
            swap_per_s: now.1.saturating_sub(last.1) as f64 / secs,
            host_available: host_available(),
            guest_available: guest_available(&r),
            guest_swap_used: r.guest_swap_used_kib.map(kib_to_bytes),
            cache_used: r.cache_used_pages,
        };
        last = now;
        if let Decision::Request(bytes) = policy.decide(&look) {
            request(&qmp, bytes, report);
        }
        if let Some(size) = plugged(&qmp) {
            report
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .plugged_bytes = size;
        }
    }
}

/// Pages swapped in and out so far: the guest kernel's own count when SymSpy gives it, else
/// the swap disk's traffic by either path (which includes the kernel probing the disk). The
/// guest's counts come from its SymSpy page (hostile input): sums saturate.
fn swapped(r: &SwapReport) -> u64 {
    match (r.guest_pswpin, r.guest_pswpout) {
        (Some(i), Some(o)) => i.saturating_add(o),
        _ => [r.block_writes, r.bypass_loads, r.bypass_stores]
            .into_iter()
            .fold(r.block_reads, u64::saturating_add),
    }
}

/// KiB from the guest's SymSpy page in bytes, saturating (the guest writes any value).
fn kib_to_bytes(kib: u64) -> u64 {
    kib.saturating_mul(1024)
}

/// The guest's MemAvailable from SymSpy (absent without the module).
fn guest_available(r: &SwapReport) -> Option<u64> {
    r.guest_mem_available_kib.map(kib_to_bytes)
}

fn connect(path: &Path, stop: &AtomicBool) -> Option<Qmp> {
    while !stop.load(Ordering::Relaxed) {
        let (tx, _rx) = crate::qmp::event_channel();
        match Qmp::connect(path, Duration::from_secs(1), tx) {
            Ok(q) => return Some(q),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
    None
}

fn request(qmp: &Qmp, bytes: u64, report: &Mutex<MemReport>) {
    let args = json!({
        "path": format!("/machine/peripheral/{DEVICE_ID}"),
        "property": "requested-size",
        "value": bytes,
    });
    match qmp.execute("qom-set", Some(args), Duration::from_secs(5)) {
        Ok(_) => {
            let mut r = report.lock().unwrap_or_else(PoisonError::into_inner);
            if bytes > r.requested_bytes {
                r.added_bytes += bytes - r.requested_bytes;
                r.grows += 1;
            } else {
                r.removed_bytes += r.requested_bytes - bytes;
                r.shrinks += 1;
            }
            r.requested_bytes = bytes;
            tracing::info!(
                "swap: asked the guest to have {} MiB of added memory",
                bytes >> 20
            );
        }
        Err(e) => tracing::warn!("swap: cannot resize the virtio-mem device: {e}"),
    }
}

fn plugged(qmp: &Qmp) -> Option<u64> {
    let args = json!({
        "path": format!("/machine/peripheral/{DEVICE_ID}"),
        "property": "size",
    });
    qmp.execute("qom-get", Some(args), Duration::from_secs(5))
        .ok()?
        .as_u64()
}

/// The host's MemAvailable, bytes (0 if unreadable: then nothing is added).
fn host_available() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |k| k << 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn look(rate: f64, guest_mib: Option<u64>) -> Look {
        Look {
            swap_per_s: rate,
            host_available: 8 << 30,
            guest_available: guest_mib.map(|m| m << 20),
            guest_swap_used: None,
            cache_used: 100,
        }
    }

    #[test]
    fn guest_counts_at_the_top_of_u64_neither_overflow_nor_ask_for_more_than_the_limit() {
        let mut p = Policy::new(1 << 30);
        let huge = Look {
            guest_swap_used: Some(kib_to_bytes(u64::MAX)),
            host_available: u64::MAX,
            ..look(5000.0, Some(u64::MAX >> 20))
        };
        assert_eq!(p.decide(&huge), Decision::Stay, "one look is a burst");
        assert_eq!(p.decide(&huge), Decision::Request(1 << 30));
        let r = SwapReport {
            guest_pswpin: Some(u64::MAX),
            guest_pswpout: Some(u64::MAX),
            ..SwapReport::default()
        };
        assert_eq!(swapped(&r), u64::MAX);
        let r = SwapReport {
            block_reads: u64::MAX,
            bypass_stores: 7,
            ..SwapReport::default()
        };
        assert_eq!(swapped(&r), u64::MAX);
        assert_eq!(kib_to_bytes(u64::MAX), u64::MAX);
    }

    #[test]
    fn thrashing_grows_in_steps_up_to_the_limit() {
        let mut p = Policy::new(1 << 30);
        assert_eq!(
            p.decide(&look(5000.0, None)),
            Decision::Stay,
            "one look is a burst"
        );
        assert_eq!(p.decide(&look(5000.0, None)), Decision::Request(256 << 20));
        assert_eq!(p.decide(&look(5000.0, None)), Decision::Request(512 << 20));
        p.decide(&look(5000.0, None));
        assert_eq!(p.decide(&look(5000.0, None)), Decision::Request(1 << 30));
        assert_eq!(
            p.decide(&look(5000.0, None)),
            Decision::Stay,
            "at the limit"
        );
    }

    #[test]
    fn a_guest_that_says_how_much_it_swapped_gets_that_much_at_once() {
        let mut p = Policy::new(1 << 30);
        let mut l = look(5000.0, Some(10));
        l.guest_swap_used = Some((600 << 20) + 1);
        p.decide(&l);
        assert_eq!(p.decide(&l), Decision::Request((600 << 20) + BLOCK));
        assert_eq!(p.decide(&l), Decision::Request(1 << 30), "capped by grow=");
    }

    #[test]
    fn a_host_short_of_memory_gives_nothing() {
        let mut p = Policy::new(1 << 30);
        let mut l = look(5000.0, None);
        l.host_available = 600 << 20;
        assert_eq!(p.decide(&l), Decision::Stay);
        assert_eq!(p.decide(&l), Decision::Stay);
    }

    #[test]
    fn memory_goes_back_only_after_a_calm_stretch_with_room_in_the_guest() {
        let mut p = Policy::new(512 << 20);
        p.decide(&look(5000.0, None));
        p.decide(&look(5000.0, None));
        assert_eq!(p.requested, 128 << 20);
        // Still swapping a little: nothing moves.
        for _ in 0..10 {
            assert_eq!(p.decide(&look(10.0, Some(1024))), Decision::Stay);
        }
        // Calm, but the guest uses the memory: nothing moves.
        for _ in 0..10 {
            assert_eq!(p.decide(&look(0.0, Some(100))), Decision::Stay);
        }
        for _ in 0..CALM_LOOKS - 1 {
            assert_eq!(p.decide(&look(0.0, Some(1024))), Decision::Stay);
        }
        assert_eq!(p.decide(&look(0.0, Some(1024))), Decision::Request(0));
    }

    #[test]
    fn without_the_module_memory_goes_back_once_the_cache_is_empty() {
        let mut p = Policy::new(256 << 20);
        p.decide(&look(5000.0, None));
        p.decide(&look(5000.0, None));
        let mut l = look(0.0, None);
        for _ in 0..CALM_LOOKS {
            assert_eq!(p.decide(&l), Decision::Stay);
        }
        l.cache_used = 0;
        for _ in 0..CALM_LOOKS - 1 {
            p.decide(&l);
        }
        assert_eq!(p.decide(&l), Decision::Request(0));
    }

    #[test]
    fn the_device_arguments_name_the_backend_and_a_monitor() {
        let a = qemu_args(1 << 30, Path::new("/r/swap-qmp.sock")).join(" ");
        assert!(a.contains("memory-backend-memfd,id=swapvmem,size=1073741824,share=on"));
        assert!(a.contains(
            "virtio-mem-pci,id=swapvmem0,memdev=swapvmem,block-size=2097152,requested-size=0"
        ));
        assert!(a.contains("-qmp unix:/r/swap-qmp.sock,server=on,wait=off"));
    }
}
