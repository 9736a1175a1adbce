//! The evictor: a thread that carries out cache resizes and keeps free slots for the guest's
//! stores by moving cold pages to the swap file, and gives back the memory of slots nobody
//! uses.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmsight_proto::sym::swapr::PAGE;

use crate::error::SwapError;
use crate::store::{SwapStore, EVICT_BATCH};

/// Pause between checks when nothing needs doing.
const IDLE: Duration = Duration::from_millis(5);
/// How often unused free slots are given back.
const TRIM_EVERY: Duration = Duration::from_secs(1);

/// Free slots the evictor keeps for the guest once the cache is full: 1/32 of the cache,
/// between 16 and 2048 pages (and never more than the cache).
pub fn low_water(target: u64) -> u64 {
    (target / 32).clamp(16, 2048).min(target)
}

/// The running evictor; stopped when dropped.
#[derive(Debug)]
pub struct Evictor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Evictor {
    pub fn start(store: Arc<SwapStore>) -> Result<Self, SwapError> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("vmsight-swap-evict".into())
            .spawn(move || {
                vmsight_vhostd::seccomp::install_once(
                    vmsight_vhostd::seccomp::ThreadClass::GuestService,
                );
                run(&store, &s)
            })
            .map_err(SwapError::Thread)?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Evictor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(store: &SwapStore, stop: &AtomicBool) {
    let mut last_trim = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if step(store) {
            continue;
        }
        if last_trim.elapsed() >= TRIM_EVERY {
            trim(store);
            last_trim = Instant::now();
        }
        std::thread::sleep(IDLE);
    }
}

/// One round: resize, then keep the low-water mark. True if it evicted something (so the
/// next round follows at once).
pub fn step(store: &SwapStore) -> bool {
    let excess = store.rebalance();
    if excess > 0 {
        return store.evict(EVICT_BATCH.min(excess as usize)) > 0;
    }
    let target = store.target();
    let (free, used) = store.occupancy();
    let low = low_water(target);
    if target > 0 && used > 0 && free < low {
        let want = (2 * low).min(target).saturating_sub(free) as usize;
        return store.evict(EVICT_BATCH.min(want.max(1))) > 0;
    }
    false
}

/// Gives back the memory of free slots when the region holds clearly more than the pages in
/// use and the free slots kept for the guest.
fn trim(store: &SwapStore) {
    let (free, used) = store.occupancy();
    let l = store.layout();
    let meta_pages = l.data_off / PAGE;
    let resident = store.region().resident_bytes() / PAGE;
    let keep = meta_pages + used + low_water(store.target());
    if free > 0 && resident > keep + 64 {
        store.trim((resident - keep) as usize);
    }
}
