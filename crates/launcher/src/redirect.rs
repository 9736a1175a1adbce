//! vCPU redirection from vmsight's side (`vmsight cpu NAME redirect`, and the Rust API later
//! features such as SymCall's synchronous transport build on): post a
//! [`RedirectRequest`] to the plugin's mailbox and block until the guest function returned
//! and the vCPU was restored, the plugin refused, or the timeout fired.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmsight_proto::redirect::{RedirectFailure, RedirectOutcome, RedirectRequest};
use vmsight_ring::redirect::{MailboxError, Progress};
use vmsight_ring::ChannelHost;

/// The plugin API that can write registers and move the PC.
pub const REDIRECT_API: u32 = 7;
/// How long to wait for the plugin's restore check once the function returned.
const CHECK_WAIT: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(1);

/// Why a redirection did not complete.
#[derive(Debug, thiserror::Error)]
pub enum RedirectCallError {
    #[error("this VM runs without the TCG plugin, which redirects vCPUs")]
    NoPlugin,
    #[error(
        "vCPU redirection needs plugin API {REDIRECT_API} (QEMU 11.1: `vmsight run --qemu \
         trixie`); this VM's plugin uses API {0}"
    )]
    Api(u32),
    #[error("the plugin has not attached yet (the VM is starting)")]
    NotAttached,
    #[error(transparent)]
    Mailbox(#[from] MailboxError),
    #[error("the plugin refused the redirection: {0}")]
    Refused(RedirectFailure),
    #[error("no return within {0} ms: {1}; the request was cancelled")]
    Timeout(u64, String),
}

/// Runs one redirection through `channel`, blocking the caller until it completes.
pub fn call(
    channel: &Arc<Mutex<ChannelHost>>,
    req: &RedirectRequest,
) -> Result<RedirectOutcome, RedirectCallError> {
    let seq = post(channel, req)?;
    let deadline = Instant::now() + Duration::from_millis(req.timeout_ms);
    let mut returned: Option<(RedirectOutcome, Instant)> = None;
    loop {
        let progress = lock(channel).redirect_mailbox().progress(seq);
        match progress {
            Progress::Failed(why) => return Err(RedirectCallError::Refused(why)),
            Progress::Returned(o) if o.restore_mismatch.is_some() => return Ok(o),
            Progress::Returned(o) => {
                let since = returned
                    .get_or_insert_with(|| (o.clone(), Instant::now()))
                    .1;
                if since.elapsed() > CHECK_WAIT {
                    return Ok(o); // returned and restored; the check did not come
                }
            }
            Progress::Waiting => {
                if Instant::now() > deadline {
                    lock(channel).redirect_mailbox().cancel(seq);
                    return Err(RedirectCallError::Timeout(
                        req.timeout_ms,
                        why_no_return(req),
                    ));
                }
            }
        }
        std::thread::sleep(POLL);
    }
}

/// What a timeout means for the request's trigger.
pub fn why_no_return(req: &RedirectRequest) -> String {
    match req.trigger {
        vmsight_proto::redirect::Trigger::Syscall { tgid } => format!(
            "the trigger did not come (is process {tgid} alive and monitored, e.g. `--trace \
             {tgid}`, and making syscalls?) or the guest function did not reach its return \
             marker"
        ),
        vmsight_proto::redirect::Trigger::Kernel { .. } => "no vCPU reached a kernel block \
             with interrupts enabled, or the guest function did not reach its return marker"
            .to_owned(),
    }
}

/// Posts `req` to the plugin; returns its sequence. For callers that wait themselves.
pub fn post(
    channel: &Arc<Mutex<ChannelHost>>,
    req: &RedirectRequest,
) -> Result<u64, RedirectCallError> {
    post_with(channel, req, true)
}

/// [`post`] for a caller that arms the vCPUs itself: the plugin's arming thread is not woken
/// (the caller wakes it with `Mailbox::wake_armers` if it cannot arm).
pub fn post_self_armed(
    channel: &Arc<Mutex<ChannelHost>>,
    req: &RedirectRequest,
) -> Result<u64, RedirectCallError> {
    post_with(channel, req, false)
}

fn post_with(
    channel: &Arc<Mutex<ChannelHost>>,
    req: &RedirectRequest,
    wake_armers: bool,
) -> Result<u64, RedirectCallError> {
    let host = lock(channel);
    if !host.plugin_attached() {
        return Err(RedirectCallError::NotAttached);
    }
    let api = host.plugin_status().api_version;
    if api != REDIRECT_API {
        return Err(RedirectCallError::Api(api));
    }
    let mb = host.redirect_mailbox();
    Ok(if wake_armers {
        mb.post(req)?
    } else {
        mb.post_quiet(req)?
    })
}

pub(crate) fn lock(c: &Arc<Mutex<ChannelHost>>) -> std::sync::MutexGuard<'_, ChannelHost> {
    c.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
