//! The supervisor: the event handler that decides what to do while a VM runs and how the run
//! ended.
//!
//! It is pure logic. Threads around the VM (console reader, ctl reader, QMP, QEMU's waiter,
//! signals, the backend watcher) turn what happens into [`Event`]s; [`Supervisor::on_event`]
//! answers each with [`Flow::Continue`] and the [`Effect`]s to carry out (let the guest
//! command run, send QMP `quit`, kill QEMU, ...), or with [`Flow::End`] once QEMU is gone. The
//! [`Ending`] then gives the [`EndReason`], completed by facts that only arrive late (the
//! panic text on the console, QEMU's last stderr lines). `vm::run` owns the side effects; the
//! tests below drive the supervisor with scripted events.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use crate::qmp::QmpEvent;

/// How long a backend may be gone while QEMU still runs before it counts as failed: QEMU
/// closes its vhost-user connections as it exits, so a backend may end a moment before
/// QEMU's exit is seen.
pub const BACKEND_GRACE: Duration = Duration::from_secs(3);
/// How long QEMU gets to quit after a `quit` before it is killed.
pub const QUIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long QEMU gets to exit after the guest init reported `down` (its file systems synced
/// and read-only, the power-off call next) before vmsight stops it. A guest kernel can hang in
/// its device shutdown (Debian 6.1's virtio_net spins on a broken TX queue: see
/// docs/guest-protocol.md); nothing of the guest's is lost by stopping it then.
pub const POWEROFF_TIMEOUT: Duration = Duration::from_secs(20);

/// Something that happened during the run, delivered to the supervising loop.
#[derive(Debug)]
pub enum Event {
    /// The guest init is about to run the command (guest uptime in seconds).
    Ready(f64),
    /// The command exited with this status.
    GuestExit(i32),
    /// The guest init synced its file systems, made `/` read-only and is about to end the VM
    /// this way.
    GuestDown(DownAction),
    /// "Kernel panic" appeared on the console.
    ConsolePanic,
    /// The guest kernel reported that this CPU's timer did not fire (an RCU stall with
    /// "Possible timer handling issue on cpu=N").
    TimerStall(u32),
    /// QEMU's local APIC of this vCPU (the `info lapic` text) shows the timer's vector stuck
    /// in service after a reported stall ([`timer_vector_in_service`]): the vCPU can take no
    /// more timer interrupts, ever, so the guest will not recover.
    TimerStuck(u32, String),
    /// An event from QMP (`SHUTDOWN`, `GUEST_PANICKED`, ...).
    Qmp(QmpEvent),
    /// QEMU's process ended.
    QemuExited(std::io::Result<ExitStatus>),
    /// vmsight received this signal (SIGINT, SIGTERM, SIGHUP).
    Signal(i32),
    /// The user typed the console escape (Ctrl-]).
    ConsoleQuit,
    /// Hold mode: the guest init's PID for the command, which waits for `go`.
    CmdPid(u32),
    /// A disk backend stopped (its description).
    BackendStopped(String),
    /// Nothing happened for a while (lets time-outs fire).
    Tick,
}

/// How the guest init ends the VM after `down`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownAction {
    Poweroff,
    Reboot,
    Halt,
}

impl DownAction {
    /// The action a `down` line names; anything else (the guest is not trusted) is a poweroff.
    pub fn parse(word: Option<&str>) -> Self {
        match word {
            Some("reboot") => DownAction::Reboot,
            Some("halt") => DownAction::Halt,
            _ => DownAction::Poweroff,
        }
    }

    /// What the guest asked for, as a verb.
    pub fn verb(self) -> &'static str {
        match self {
            DownAction::Poweroff => "power off",
            DownAction::Reboot => "reboot",
            DownAction::Halt => "halt",
        }
    }
}

/// The start of [`EndReason::TimerStuck`]'s message: the signature test harnesses and tools
/// look for (with the local APIC state after it).
pub const TIMER_STUCK_MESSAGE: &str = "a guest vCPU's timer interrupt is stuck in service";

/// How [`EndReason::TimerStuck`]'s message says that the guest had not reported ready: its
/// command never started, so running it again is the same run.
pub const BEFORE_READY: &str = "before the guest reported ready";

/// Whether QEMU's `info lapic` text shows the timer's vector (the `LVTT` entry's `vec N`) in
/// service (the `ISR` line), the state of a lost EOI: the processor priority then holds back
/// every later timer interrupt of that vCPU. A healthy vCPU shows it at most pending (`IRR`).
pub fn timer_vector_in_service(apic: &str) -> bool {
    let vector = apic
        .lines()
        .find(|l| l.trim_start().starts_with("LVTT"))
        .and_then(|l| l.split("(vec ").nth(1))
        .and_then(|r| r.split(')').next())
        .and_then(|v| v.trim().parse::<u32>().ok());
    let Some(vector) = vector else {
        return false;
    };
    apic.lines()
        .filter_map(|l| l.trim_start().strip_prefix("ISR"))
        .flat_map(str::split_whitespace)
        .any(|v| v.parse::<u32>() == Ok(vector))
}

/// How the run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndReason {
    /// The command ran and exited with this status.
    CommandExited(i32),
    /// The guest powered off by itself (interactive shell exit, or a command running `poweroff`).
    GuestPoweroff,
    /// The guest kernel panicked; the panic text from the console.
    GuestPanic(String),
    /// QEMU exited on its own without a guest shutdown.
    QemuFailed(String),
    /// A disk backend failed.
    BackendFailed(String),
    /// The guest init did not report `ready` within the boot timeout; the console's last lines.
    BootTimeout(Duration, String),
    /// A vCPU's timer vector stayed in service (QEMU 10's TCG section race lost its EOI,
    /// docs/launcher.md): the vCPU, QEMU's `info lapic` of it, and whether the guest had
    /// reported ready (its command had started). vmsight stopped the VM.
    TimerStuck(u32, String, bool),
    /// vmsight was told to stop (SIGINT/SIGTERM/SIGHUP or the console escape).
    Interrupted(i32),
}

impl EndReason {
    /// The exit status `vmsight run` returns: the command's own status, 0 for a guest poweroff,
    /// 128+signal when interrupted, and 125 when the VM itself failed.
    pub fn exit_code(&self) -> i32 {
        match self {
            EndReason::CommandExited(c) => *c,
            EndReason::GuestPoweroff => 0,
            EndReason::Interrupted(sig) => 128 + sig,
            EndReason::GuestPanic(_)
            | EndReason::QemuFailed(_)
            | EndReason::BackendFailed(_)
            | EndReason::BootTimeout(..)
            | EndReason::TimerStuck(..) => 125,
        }
    }

    /// A one-line description for errors; `None` for a normal end.
    pub fn error_message(&self) -> Option<String> {
        match self {
            EndReason::CommandExited(_) | EndReason::GuestPoweroff => None,
            EndReason::GuestPanic(t) => Some(format!("guest kernel panic:\n{t}")),
            EndReason::QemuFailed(t) => Some(format!("QEMU failed: {t}")),
            EndReason::BackendFailed(t) => Some(format!("disk backend failed: {t}")),
            EndReason::BootTimeout(d, tail) => Some(format!(
                "the guest did not report ready within {} s (--boot-timeout), so vmsight \
                 stopped it; a custom root image needs vmsight's init (docs/guest-protocol.md); \
                 last console lines:\n{}",
                d.as_secs(),
                if tail.trim().is_empty() {
                    "(none)"
                } else {
                    tail
                }
            )),
            EndReason::TimerStuck(cpu, apic, ready) => Some(format!(
                "{TIMER_STUCK_MESSAGE} on vCPU {cpu}, {}: its local APIC keeps the timer vector in \
                 service, so it takes no timer interrupt again and the guest cannot recover; \
                 vmsight stopped it. This is QEMU 10's TCG section race (a lost EOI); QEMU 11.1 \
                 (`--qemu trixie`, the default once `make qemu11` built it) does not have it \
                 (docs/launcher.md). QEMU's local APIC of that vCPU:\n{}",
                if *ready {
                    "after the guest reported ready"
                } else {
                    BEFORE_READY
                },
                apic.trim_end()
            )),
            EndReason::Interrupted(sig) => Some(format!("interrupted by signal {sig}; VM stopped")),
        }
    }
}

/// Something the supervising loop must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// The guest is ready: start forwarding vmsight's stdin.
    StartStdin,
    /// Monitor this guest PID and tell the held command to go.
    LetCommandRun(u32),
    /// Ask QEMU to quit (QMP `quit`, else SIGTERM).
    RequestQuit,
    /// Kill QEMU (SIGKILL).
    KillQemu,
    /// Log QEMU's state of this vCPU's local APIC (`info lapic`): what the guest's stalled
    /// timer looks like from the device's side.
    DumpLocalApic(u32),
}

/// What the loop does next.
#[derive(Debug)]
pub enum Flow {
    /// Keep going after carrying out these effects.
    Continue(Vec<Effect>),
    /// QEMU is gone: tear down, then ask the ending for the reason.
    End(Ending),
}

/// Facts only known after QEMU is gone.
#[derive(Debug, Clone, Default)]
pub struct LateFacts {
    /// Panic text found on the console (it can trail the ctl events).
    pub panic_text: Option<String>,
    /// QEMU's last stderr lines.
    pub qemu_stderr: Vec<String>,
    /// The last console lines (all of them for a boot timeout, the last 5 for a QEMU failure
    /// without stderr).
    pub console_tail: String,
    /// A backend that ended with an error when joined.
    pub backend_error: Option<String>,
}

/// The supervisor's state when QEMU was gone.
#[derive(Debug, Clone, Default)]
pub struct Ending {
    guest_exit: Option<i32>,
    panicked: bool,
    guest_shutdown: bool,
    /// The init reported `down`, and how it ends the VM.
    guest_down: Option<DownAction>,
    /// vmsight stopped QEMU because it was still running [`POWEROFF_TIMEOUT`] after `down`.
    poweroff_forced: bool,
    /// vmsight stopped QEMU because `ready` had not come within this boot timeout.
    boot_timed_out: Option<Duration>,
    /// vmsight stopped QEMU because this vCPU's timer vector stayed in service (and the APIC).
    timer_stuck: Option<(u32, String)>,
    interrupted: Option<i32>,
    backend_failed: Option<String>,
    qemu_status: Option<String>,
    /// When the guest became ready, since the supervisor started.
    pub boot_time: Option<Duration>,
    /// The guest's own uptime when it became ready, seconds.
    pub guest_uptime: Option<f64>,
}

impl Ending {
    /// How the run ended, in order of precedence: an interruption, a panic, a failed backend,
    /// the command's status, a guest poweroff, else QEMU failed.
    pub fn reason(&self, late: &LateFacts) -> EndReason {
        if let Some(sig) = self.interrupted {
            return EndReason::Interrupted(if sig == 0 { libc::SIGINT } else { sig });
        }
        if self.panicked || late.panic_text.is_some() {
            return EndReason::GuestPanic(late.panic_text.clone().unwrap_or_else(|| {
                "the guest reported a panic (pvpanic) but the console showed no panic text".into()
            }));
        }
        if let Some(e) = self.backend_failed.clone().or(late.backend_error.clone()) {
            return EndReason::BackendFailed(e);
        }
        if let Some((cpu, apic)) = self.timer_stuck.clone() {
            return EndReason::TimerStuck(cpu, apic, self.boot_time.is_some());
        }
        if let Some(d) = self.boot_timed_out {
            return EndReason::BootTimeout(d, late.console_tail.clone());
        }
        if let Some(c) = self.guest_exit {
            return EndReason::CommandExited(c);
        }
        if self.guest_shutdown || self.guest_down.is_some() {
            return EndReason::GuestPoweroff;
        }
        EndReason::QemuFailed(self.qemu_failure(late))
    }

    /// Whether vmsight had to stop QEMU after the guest's `down` (see [`POWEROFF_TIMEOUT`]).
    pub fn poweroff_forced(&self) -> bool {
        self.poweroff_forced
    }

    /// How the guest init said it would end the VM, if it got that far.
    pub fn down_action(&self) -> Option<DownAction> {
        self.guest_down
    }

    fn qemu_failure(&self, late: &LateFacts) -> String {
        let status = self.qemu_status.as_deref().unwrap_or("unknown status");
        let detail = if !late.qemu_stderr.is_empty() {
            let n = late.qemu_stderr.len();
            late.qemu_stderr[n.saturating_sub(5)..].join("\n")
        } else if late.console_tail.trim().is_empty() {
            "no output".to_string()
        } else {
            let lines: Vec<&str> = late.console_tail.lines().collect();
            let last = lines[lines.len().saturating_sub(5)..].join("\n");
            format!("last console lines:\n{last}")
        };
        format!("QEMU exited ({status}) without a guest shutdown: {detail}")
    }
}

/// The event handler. See the module documentation.
#[derive(Debug)]
pub struct Supervisor {
    started: Instant,
    state: Ending,
    quit_sent_at: Option<Instant>,
    backend_gone_at: Option<Instant>,
    down_at: Option<Instant>,
    boot_timeout: Option<Duration>,
    killed: bool,
}

impl Supervisor {
    /// A supervisor whose boot time counts from `started`, with no boot timeout.
    pub fn new(started: Instant) -> Self {
        Self {
            started,
            state: Ending::default(),
            quit_sent_at: None,
            backend_gone_at: None,
            down_at: None,
            boot_timeout: None,
            killed: false,
        }
    }

    /// Stops the VM if the guest has not reported `ready` within `limit` of the start.
    pub fn with_boot_timeout(mut self, limit: Option<Duration>) -> Self {
        self.boot_timeout = limit;
        self
    }

    /// Handles one event that happened at `now`.
    pub fn on_event(&mut self, ev: Event, now: Instant) -> Flow {
        let effects = match ev {
            Event::QemuExited(st) => {
                self.state.qemu_status = st.ok().map(|s| s.to_string());
                return Flow::End(self.state.clone());
            }
            Event::Ready(up) => {
                self.state.boot_time = Some(now.saturating_duration_since(self.started));
                self.state.guest_uptime = up.is_finite().then_some(up);
                vec![Effect::StartStdin]
            }
            Event::GuestExit(c) => {
                self.state.guest_exit = Some(c);
                Vec::new()
            }
            Event::GuestDown(a) => {
                self.state.guest_down = Some(a);
                self.down_at.get_or_insert(now);
                Vec::new()
            }
            Event::CmdPid(pid) => vec![Effect::LetCommandRun(pid)],
            Event::ConsolePanic => {
                self.state.panicked = true;
                Vec::new()
            }
            Event::TimerStall(cpu) => vec![Effect::DumpLocalApic(cpu)],
            Event::TimerStuck(cpu, apic) => self.timer_stuck(cpu, apic, now),
            Event::Qmp(q) => self.on_qmp(&q),
            Event::Signal(sig) => self.stop_requested(sig, now),
            Event::ConsoleQuit => self.stop_requested(0, now),
            Event::BackendStopped(what) => self.on_backend_stopped(what, now),
            Event::Tick => Vec::new(),
        };
        let mut effects = effects;
        effects.extend(self.timeouts(now));
        Flow::Continue(effects)
    }

    fn on_qmp(&mut self, q: &QmpEvent) -> Vec<Effect> {
        match q.name.as_str() {
            "GUEST_PANICKED" => self.state.panicked = true,
            "SHUTDOWN" => {
                self.state.guest_shutdown = q
                    .data
                    .get("guest")
                    .and_then(|g| g.as_bool())
                    .unwrap_or(false);
            }
            _ => {}
        }
        Vec::new()
    }

    /// A vCPU's timer can never fire again: stop the VM now rather than at a timeout.
    fn timer_stuck(&mut self, cpu: u32, apic: String, now: Instant) -> Vec<Effect> {
        if self.quit_sent_at.is_some() || self.state.timer_stuck.is_some() {
            return Vec::new();
        }
        self.state.timer_stuck = Some((cpu, apic));
        self.quit_sent_at = Some(now);
        vec![Effect::RequestQuit]
    }

    /// A signal (or the console escape, `sig` 0): quit politely first, kill on the second.
    fn stop_requested(&mut self, sig: i32, now: Instant) -> Vec<Effect> {
        if self.quit_sent_at.is_some() {
            return self.kill();
        }
        self.state.interrupted = Some(sig);
        self.quit_sent_at = Some(now);
        vec![Effect::RequestQuit]
    }

    /// A backend ended. Only one that stays gone while QEMU keeps running is a failure.
    fn on_backend_stopped(&mut self, what: String, now: Instant) -> Vec<Effect> {
        if self.state.backend_failed.is_some() || self.quit_sent_at.is_some() {
            return Vec::new();
        }
        match self.backend_gone_at {
            None => {
                self.backend_gone_at = Some(now);
                Vec::new()
            }
            Some(t) if now.saturating_duration_since(t) > BACKEND_GRACE => {
                self.state.backend_failed = Some(what);
                self.quit_sent_at = Some(now);
                vec![Effect::RequestQuit]
            }
            Some(_) => Vec::new(),
        }
    }

    fn timeouts(&mut self, now: Instant) -> Vec<Effect> {
        let since = |t: Instant| now.saturating_duration_since(t);
        match (self.quit_sent_at, self.down_at) {
            (Some(t), _) if since(t) > QUIT_TIMEOUT => self.kill(),
            (Some(_), _) => Vec::new(),
            (None, Some(t)) if since(t) > POWEROFF_TIMEOUT => {
                self.state.poweroff_forced = true;
                self.quit_sent_at = Some(now);
                vec![Effect::RequestQuit]
            }
            (None, _) => match self.boot_timeout {
                Some(d) if self.state.boot_time.is_none() && since(self.started) > d => {
                    self.state.boot_timed_out = Some(d);
                    self.quit_sent_at = Some(now);
                    vec![Effect::RequestQuit]
                }
                _ => Vec::new(),
            },
        }
    }

    fn kill(&mut self) -> Vec<Effect> {
        if self.killed {
            return Vec::new();
        }
        self.killed = true;
        vec![Effect::KillQemu]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn exited(code: i32) -> Event {
        Event::QemuExited(Ok(ExitStatus::from_raw(code << 8)))
    }

    fn qmp(name: &str, data: serde_json::Value) -> Event {
        Event::Qmp(QmpEvent {
            name: name.into(),
            data,
        })
    }

    /// Feeds `events` at the given offsets (ms) and returns the effects and the ending.
    fn script(events: Vec<(u64, Event)>) -> (Vec<Effect>, Ending) {
        let t0 = Instant::now();
        let mut s = Supervisor::new(t0);
        let mut effects = Vec::new();
        for (ms, ev) in events {
            match s.on_event(ev, t0 + Duration::from_millis(ms)) {
                Flow::Continue(e) => effects.extend(e),
                Flow::End(end) => return (effects, end),
            }
        }
        panic!("the script never ended the run");
    }

    fn reason(events: Vec<(u64, Event)>) -> EndReason {
        script(events).1.reason(&LateFacts::default())
    }

    #[test]
    fn command_exit_status_is_the_end_reason() {
        let (effects, end) = script(vec![
            (100, Event::Ready(1.5)),
            (200, Event::GuestExit(3)),
            (300, qmp("SHUTDOWN", serde_json::json!({"guest": true}))),
            (400, exited(0)),
        ]);
        assert_eq!(effects, vec![Effect::StartStdin]);
        assert_eq!(end.boot_time, Some(Duration::from_millis(100)));
        assert_eq!(end.guest_uptime, Some(1.5));
        let r = end.reason(&LateFacts::default());
        assert_eq!(r, EndReason::CommandExited(3));
        assert_eq!(r.exit_code(), 3);
    }

    #[test]
    fn guest_poweroff_without_a_command_ends_with_status_zero() {
        let r = reason(vec![
            (0, qmp("SHUTDOWN", serde_json::json!({"guest": true}))),
            (10, exited(0)),
        ]);
        assert_eq!(r, EndReason::GuestPoweroff);
        assert_eq!(r.exit_code(), 0);
    }

    #[test]
    fn a_host_side_shutdown_is_not_a_guest_poweroff() {
        let r = reason(vec![
            (0, qmp("SHUTDOWN", serde_json::json!({"guest": false}))),
            (10, exited(0)),
        ]);
        assert!(matches!(r, EndReason::QemuFailed(_)), "{r:?}");
    }

    #[test]
    fn guest_panic_wins_over_the_command_status_and_carries_the_console_text() {
        let (_, end) = script(vec![
            (0, Event::GuestExit(0)),
            (1, qmp("GUEST_PANICKED", serde_json::json!({}))),
            (2, exited(0)),
        ]);
        let late = LateFacts {
            panic_text: Some("Kernel panic - not syncing: test".into()),
            ..LateFacts::default()
        };
        let r = end.reason(&late);
        assert_eq!(
            r,
            EndReason::GuestPanic("Kernel panic - not syncing: test".into())
        );
        assert_eq!(r.exit_code(), 125);
        // Seen only on the console, after the fact.
        let r = reason(vec![(0, Event::ConsolePanic), (1, exited(0))]);
        assert!(matches!(r, EndReason::GuestPanic(t) if t.contains("pvpanic")));
    }

    #[test]
    fn qemu_exit_without_shutdown_is_a_failure_with_its_stderr() {
        let (_, end) = script(vec![(0, exited(1))]);
        let late = LateFacts {
            qemu_stderr: (0..8).map(|i| format!("line {i}")).collect(),
            ..LateFacts::default()
        };
        let EndReason::QemuFailed(t) = end.reason(&late) else {
            panic!("not a QEMU failure");
        };
        assert!(t.contains("exit status: 1"), "{t}");
        assert!(
            t.contains("line 3") && t.contains("line 7") && !t.contains("line 2"),
            "{t}"
        );
        let EndReason::QemuFailed(t) = end.reason(&LateFacts {
            console_tail: "last words".into(),
            ..LateFacts::default()
        }) else {
            panic!("not a QEMU failure");
        };
        assert!(t.contains("last console lines:\nlast words"), "{t}");
    }

    #[test]
    fn a_signal_asks_qemu_to_quit_then_a_second_one_kills_it() {
        let (effects, end) = script(vec![
            (0, Event::Signal(libc::SIGTERM)),
            (10, Event::Signal(libc::SIGTERM)),
            (20, Event::Signal(libc::SIGTERM)),
            (30, exited(0)),
        ]);
        assert_eq!(effects, vec![Effect::RequestQuit, Effect::KillQemu]);
        let r = end.reason(&LateFacts::default());
        assert_eq!(r, EndReason::Interrupted(libc::SIGTERM));
        assert_eq!(r.exit_code(), 128 + libc::SIGTERM);
    }

    #[test]
    fn the_console_escape_counts_as_sigint() {
        let r = reason(vec![(0, Event::ConsoleQuit), (5, exited(0))]);
        assert_eq!(r, EndReason::Interrupted(libc::SIGINT));
    }

    #[test]
    fn qemu_is_killed_when_it_does_not_quit_in_time() {
        let (effects, _) = script(vec![
            (0, Event::Signal(libc::SIGINT)),
            (5_000, Event::Tick),
            (10_001, Event::Tick),
            (12_000, Event::Tick),
            (12_001, exited(9)),
        ]);
        assert_eq!(effects, vec![Effect::RequestQuit, Effect::KillQemu]);
    }

    #[test]
    fn a_backend_gone_while_qemu_runs_is_a_failure_after_the_grace() {
        let (effects, end) = script(vec![
            (
                0,
                Event::BackendStopped("the backend of /d.img stopped".into()),
            ),
            (
                1_000,
                Event::BackendStopped("the backend of /d.img stopped".into()),
            ),
            (
                3_500,
                Event::BackendStopped("the backend of /d.img stopped".into()),
            ),
            (3_600, exited(0)),
        ]);
        assert_eq!(effects, vec![Effect::RequestQuit]);
        let r = end.reason(&LateFacts::default());
        assert_eq!(
            r,
            EndReason::BackendFailed("the backend of /d.img stopped".into())
        );
        assert_eq!(r.exit_code(), 125);
    }

    #[test]
    fn a_backend_ending_as_qemu_exits_is_not_a_failure() {
        let r = reason(vec![
            (0, Event::GuestExit(0)),
            (10, Event::BackendStopped("disk0".into())),
            (20, exited(0)),
        ]);
        assert_eq!(r, EndReason::CommandExited(0));
        // ... unless joining it reported an error.
        let (_, end) = script(vec![(0, Event::GuestExit(0)), (20, exited(0))]);
        let late = LateFacts {
            backend_error: Some("disk0: I/O error".into()),
            ..LateFacts::default()
        };
        assert_eq!(
            end.reason(&late),
            EndReason::BackendFailed("disk0: I/O error".into())
        );
    }

    #[test]
    fn a_guest_that_does_not_power_off_after_down_is_stopped_then_killed() {
        let (effects, end) = script(vec![
            (0, Event::GuestExit(4)),
            (10, Event::GuestDown(DownAction::Poweroff)),
            (19_000, Event::Tick),
            (20_011, Event::Tick),
            (25_000, Event::Tick),
            (30_012, Event::Tick),
            (30_013, exited(9)),
        ]);
        assert_eq!(effects, vec![Effect::RequestQuit, Effect::KillQemu]);
        assert!(end.poweroff_forced());
        // The command's status stands: the guest had synced and was powering off.
        assert_eq!(
            end.reason(&LateFacts::default()),
            EndReason::CommandExited(4)
        );
    }

    #[test]
    fn a_guest_that_powers_off_in_time_after_down_is_left_alone() {
        let (effects, end) = script(vec![
            (0, Event::GuestDown(DownAction::Poweroff)),
            (15_000, Event::Tick),
            (19_999, exited(0)),
        ]);
        assert!(effects.is_empty(), "{effects:?}");
        assert!(!end.poweroff_forced());
        // A command that ran poweroff itself: no exit line, but the init said down.
        assert_eq!(end.reason(&LateFacts::default()), EndReason::GuestPoweroff);
    }

    #[test]
    fn a_guest_that_never_reports_ready_is_stopped_at_the_boot_timeout() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut s = Supervisor::new(t0).with_boot_timeout(Some(Duration::from_secs(60)));
        let mut effects = Vec::new();
        for ms in [1_000, 59_999, 60_001, 60_500, 70_002] {
            let Flow::Continue(e) = s.on_event(Event::Tick, at(ms)) else {
                panic!("ended early");
            };
            effects.extend(e);
        }
        assert_eq!(effects, vec![Effect::RequestQuit, Effect::KillQemu]);
        let Flow::End(end) = s.on_event(exited(9), at(70_003)) else {
            panic!("QEMU exited");
        };
        let late = LateFacts {
            console_tail: "SeaBIOS".into(),
            ..LateFacts::default()
        };
        let r = end.reason(&late);
        assert_eq!(
            r,
            EndReason::BootTimeout(Duration::from_secs(60), "SeaBIOS".into())
        );
        assert_eq!(r.exit_code(), 125);
        let msg = r.error_message().unwrap();
        assert!(
            msg.contains("within 60 s") && msg.ends_with("SeaBIOS"),
            "{msg}"
        );
    }

    #[test]
    fn a_guest_that_reports_ready_in_time_has_no_boot_timeout() {
        let t0 = Instant::now();
        let mut s = Supervisor::new(t0).with_boot_timeout(Some(Duration::from_secs(60)));
        let mut effects = Vec::new();
        for (ms, ev) in [(59_000, Event::Ready(3.0)), (600_000, Event::Tick)] {
            let Flow::Continue(e) = s.on_event(ev, t0 + Duration::from_millis(ms)) else {
                panic!("ended early");
            };
            effects.extend(e);
        }
        assert_eq!(effects, vec![Effect::StartStdin]);
    }

    #[test]
    fn hold_mode_lets_the_command_run_once_its_pid_is_known() {
        let (effects, _) = script(vec![(0, Event::CmdPid(42)), (1, exited(0))]);
        assert_eq!(effects, vec![Effect::LetCommandRun(42)]);
    }

    #[test]
    fn a_timer_vector_stuck_in_service_stops_the_vm_with_the_apic_state() {
        let apic = "LVTT 0x000200ec active-hi edge periodic Fixed  (vec 236)\nISR      236\n";
        let (effects, end) = script(vec![
            (0, Event::TimerStall(1)),
            (1, Event::TimerStuck(1, apic.into())),
            (2, Event::TimerStuck(0, apic.into())),
            (5, exited(0)),
        ]);
        assert_eq!(
            effects,
            vec![Effect::DumpLocalApic(1), Effect::RequestQuit],
            "one quit, for the first stuck vCPU"
        );
        let why = end.reason(&LateFacts::default());
        assert_eq!(why, EndReason::TimerStuck(1, apic.into(), false));
        assert_eq!(why.exit_code(), 125);
        let msg = why.error_message().unwrap();
        assert!(
            msg.starts_with(TIMER_STUCK_MESSAGE) && msg.contains("ISR      236"),
            "{msg}"
        );
        assert!(msg.contains(BEFORE_READY), "{msg}");
        // After ready, the message says so (the command had started).
        let after = reason(vec![
            (0, Event::Ready(2.0)),
            (1, Event::TimerStuck(0, apic.into())),
            (5, exited(0)),
        ]);
        assert_eq!(after, EndReason::TimerStuck(0, apic.into(), true));
        assert!(!after.error_message().unwrap().contains(BEFORE_READY));
    }

    #[test]
    fn only_the_timer_vector_in_service_counts_as_stuck() {
        // The stalled vCPU of docs/launcher.md (QEMU 10.0.2, boot loop, 2026-11-25).
        let stuck = "Dumping local APIC state for CPU 1\n\n\
            LVT0\t 0x00010700 active-hi edge  masked                      ExtINT (vec 0)\n\
            LVTT\t 0x000200ec active-hi edge                 periodic     Fixed  (vec 236)\n\
            Timer\t DCR=0x3 (divide by 16) initial_count = 251110 current_count = 66445\n\
            ISR\t 236\n\
            IRR\t 34 35 36 236\n\n\
            APR 0x01 TPR 0x10 DFR 0x0f LDR 0x02 PPR 0xe0\n";
        assert!(timer_vector_in_service(stuck));
        // A healthy vCPU: the timer pending, nothing in service.
        let healthy = "LVTT\t 0x000000ec active-hi edge                 one-shot     Fixed  (vec \
            236)\nTimer\t DCR=0x3 (divide by 16) initial_count = 229726 current_count = 0\n\
            IRR\t 236\n";
        assert!(!timer_vector_in_service(healthy));
        // Another vector in service (a device interrupt being handled), or no LVTT at all.
        assert!(!timer_vector_in_service(
            "LVTT 0x000000ec (vec 236)\nISR\t 34 2360\n"
        ));
        assert!(!timer_vector_in_service("ISR 236\n"));
        assert!(!timer_vector_in_service("LVTT (vec x)\nISR 236\n"));
    }

    #[test]
    fn a_guest_timer_stall_asks_for_that_vcpus_local_apic_and_ends_nothing() {
        let (effects, end) = script(vec![(0, Event::TimerStall(1)), (5, exited(0))]);
        assert_eq!(effects, vec![Effect::DumpLocalApic(1)]);
        assert!(!end.panicked);
    }

    #[test]
    fn a_lost_event_channel_is_a_qemu_failure_with_unknown_status() {
        let (_, end) = script(vec![(
            0,
            Event::QemuExited(Err(std::io::Error::other("gone"))),
        )]);
        let EndReason::QemuFailed(t) = end.reason(&LateFacts::default()) else {
            panic!("not a QEMU failure");
        };
        assert!(
            t.contains("unknown status") && t.contains("no output"),
            "{t}"
        );
    }
}
