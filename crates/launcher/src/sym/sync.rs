//! The synchronous transport: the plugin redirects a vCPU into the module's entry (QEMU 11,
//! plugin API v7) and puts it back when the entry returns to the module's return marker, with
//! no interrupt on a running guest (`Trigger::Kernel`: the next kernel block a vCPU runs with
//! interrupts enabled). An idle guest has no vCPU running: after [`WAKE_AFTER`] without a
//! taker vmsight rings the guest's state doorbell (again every [`WAKE_AGAIN`]), which wakes
//! a vCPU (the module's handler for it does nothing).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmsight_proto::redirect::{Frame, RedirectRequest, Reg, Trigger};
use vmsight_proto::sym::RET_NOT_HERE;
use vmsight_ring::redirect::Progress;
use vmsight_ring::ChannelHost;

use super::{Symbiotic, SyncEntry, SyncTransport};
use crate::redirect::{lock, post, REDIRECT_API};
use crate::vm::prepare::Prepared;

/// How long a request may wait for a running vCPU before vmsight wakes one (a running guest
/// enters a kernel block with interrupts enabled within microseconds).
pub const WAKE_AFTER: Duration = Duration::from_micros(50);
/// How often vmsight rings again while nobody took the request (the woken vCPU may have been
/// at a point that answered "not here" and gone back to sleep).
pub const WAKE_AGAIN: Duration = Duration::from_millis(1);
/// How long the caller spins before it starts sleeping between polls.
const SPIN: Duration = Duration::from_micros(300);

/// Whether the VM's plugin is loaded with the synchronous transport (`symsync=on`).
pub fn wanted(cfg: &crate::config::VmConfig, prep: &Prepared) -> bool {
    cfg.symbiotic && prep.use_plugin && prep.qemu.plugin_api() >= REDIRECT_API
}

/// Offers the transport to `sym` if this VM can carry it, else records why not.
pub fn offer(sym: &Symbiotic, prep: &Prepared, channel: Option<&Arc<Mutex<ChannelHost>>>) {
    let api = prep.qemu.plugin_api();
    match channel {
        None => sym.set_sync_missing("the VM runs without the TCG plugin"),
        Some(_) if api < REDIRECT_API => sym.set_sync_missing(&format!(
            "QEMU {}.{} speaks plugin API {api}; the synchronous transport needs API \
             {REDIRECT_API} (QEMU 11.1: --qemu trixie)",
            prep.qemu.version.0, prep.qemu.version.1,
        )),
        Some(c) if prep.guest.profile.is_none() => {
            let _ = c;
            sym.set_sync_missing("the VM has no kernel profile, which the plugin needs")
        }
        Some(c) => sym.set_sync(Box::new(PluginSync { channel: c.clone() })),
    }
}

/// The transport over the plugin's redirect mailbox.
struct PluginSync {
    channel: Arc<Mutex<ChannelHost>>,
}

/// The redirection that runs `entry(nr, a0..a4)` on the module's stack.
pub fn request(at: SyncEntry, n: u32, args: [u64; 5], timeout: Duration) -> RedirectRequest {
    let mut regs: BTreeMap<Reg, u64> = Reg::ARGS
        .iter()
        .copied()
        .zip(std::iter::once(u64::from(n)).chain(args))
        .collect();
    regs.insert(Reg::Rsp, at.stack);
    RedirectRequest {
        trigger: Trigger::Kernel {
            not_here: RET_NOT_HERE as u64,
        },
        entry: at.entry,
        frame: Some(Frame {
            return_to: at.return_to,
            reserve: 0,
        }),
        regs,
        memory: None,
        timeout_ms: (timeout.as_millis() as u64).max(1),
    }
}

impl SyncTransport for PluginSync {
    fn call(
        &self,
        at: SyncEntry,
        n: u32,
        args: [u64; 5],
        timeout: Duration,
        wake: &dyn Fn(),
    ) -> Result<i64, String> {
        let req = request(at, n, args, timeout);
        let seq = post(&self.channel, &req).map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let mut next_wake = t0 + WAKE_AFTER;
        loop {
            match lock(&self.channel).redirect_mailbox().progress(seq) {
                Progress::Returned(o) => {
                    return Ok(o.at_return.get(&Reg::Rax).copied().unwrap_or(0) as i64)
                }
                Progress::Failed(why) => return Err(why.to_string()),
                Progress::Waiting => {}
            }
            let now = Instant::now();
            if now - t0 > timeout {
                lock(&self.channel).redirect_mailbox().cancel(seq);
                return Err(format!(
                    "timed out: {}",
                    crate::redirect::why_no_return(&req)
                ));
            }
            if now >= next_wake {
                wake();
                next_wake = now + WAKE_AGAIN;
            }
            if now - t0 < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}
