//! The host ends of the guest's channels: console, control port, stdout/stderr/stdin ports.
//!
//! vmsight binds every socket before QEMU starts and QEMU connects as a client, so nothing the
//! guest writes early is lost. Each socket gets one thread: accept the single connection, pump.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::LaunchError;
use crate::supervisor::DownAction;
use crate::vm::Event;

/// Binds a listener (mode 0600), replacing a stale socket file.
pub fn listen(path: &Path) -> Result<UnixListener, LaunchError> {
    let _ = std::fs::remove_file(path);
    let err = |source| LaunchError::Listen {
        path: path.to_path_buf(),
        source,
    };
    let l = UnixListener::bind(path).map_err(err)?;
    vmsight_proto::peer::restrict_socket(path).map_err(err)?;
    Ok(l)
}

/// Waits for QEMU's connection, giving up when `stop` is set (QEMU died before connecting).
pub fn accept_until(listener: &UnixListener, stop: &AtomicBool) -> Option<UnixStream> {
    if listener.set_nonblocking(true).is_err() {
        return listener.accept().ok().map(|(s, _)| s);
    }
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                if let Err(e) = vmsight_proto::peer::check_peer(&s) {
                    tracing::warn!("guest channel: {e}");
                    continue;
                }
                // Blocking I/O from here on; failure only means a busy-loop we avoid by bailing.
                return s.set_nonblocking(false).ok().map(|_| s);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if stop.load(Ordering::Relaxed) {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => return None,
        }
    }
}

fn spawn_named<F: FnOnce() + Send + 'static>(
    name: &str,
    f: F,
) -> Result<JoinHandle<()>, LaunchError> {
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(f)
        .map_err(LaunchError::Io)
}

/// Copies a guest output port to a host writer until EOF; returns the bytes copied.
pub fn spawn_output_pump(
    name: &str,
    listener: UnixListener,
    stop: Arc<AtomicBool>,
    mut sink: Box<dyn Write + Send>,
) -> Result<JoinHandle<()>, LaunchError> {
    spawn_named(name, move || {
        let Some(mut s) = accept_until(&listener, &stop) else {
            return;
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    // A closed host stdout (e.g. `| head`) must not stop the guest: keep draining.
                    let _ = sink.write_all(&buf[..n]);
                    let _ = sink.flush();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
    })
}

/// Reads the control port's lines (`ready <uptime>`, `exit <status>`, `down`) into events.
/// `writer` receives a clone of the connection, for the host's `go` in hold mode.
pub fn spawn_ctl_reader(
    listener: UnixListener,
    stop: Arc<AtomicBool>,
    events: Sender<Event>,
    writer: Arc<Mutex<Option<UnixStream>>>,
) -> Result<JoinHandle<()>, LaunchError> {
    spawn_named("vmsight-ctl", move || {
        let Some(s) = accept_until(&listener, &stop) else {
            return;
        };
        if let (Ok(mut slot), Ok(w)) = (writer.lock(), s.try_clone()) {
            *slot = Some(w);
        }
        let mut r = BufReader::new(s);
        let mut line = String::new();
        loop {
            line.clear();
            match r.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if let Some(ev) = parse_ctl_line(&line) {
                if events.send(ev).is_err() {
                    break;
                }
            } else if !line.trim().is_empty() {
                tracing::warn!("ignoring unknown control message {:?}", line.trim());
            }
        }
    })
}

/// Parses one control-port line; the guest is not trusted, so anything odd is ignored.
pub fn parse_ctl_line(line: &str) -> Option<Event> {
    let mut it = line.split_whitespace();
    match (it.next()?, it.next()) {
        ("ready", Some(up)) => Some(Event::Ready(
            up.parse::<f64>().ok().filter(|v| v.is_finite())?,
        )),
        ("ready", None) => Some(Event::Ready(f64::NAN)),
        ("cmdpid", Some(pid)) => {
            let p: u32 = pid.parse().ok()?;
            (p > 1).then_some(Event::CmdPid(p))
        }
        ("exit", Some(code)) => {
            let c: i32 = code.parse().ok()?;
            (0..=255).contains(&c).then_some(Event::GuestExit(c))
        }
        ("down", a) => Some(Event::GuestDown(DownAction::parse(a))),
        _ => None,
    }
}

/// Feeds the host's stdin to the guest command, then closes the port so the guest sees EOF.
/// With a terminal on stdin (or `feed` false) the port is closed at once: stdin is empty.
///
/// Nothing is sent before `go` fires (the guest's `ready`): the guest's virtio_console driver
/// discards data that arrives for a port the guest has not opened yet.
pub fn spawn_stdin_feeder(
    listener: UnixListener,
    stop: Arc<AtomicBool>,
    feed: bool,
    go: std::sync::mpsc::Receiver<()>,
) -> Result<JoinHandle<()>, LaunchError> {
    spawn_named("vmsight-stdin", move || {
        let Some(mut s) = accept_until(&listener, &stop) else {
            return;
        };
        if go.recv().is_err() {
            return; // the run ended before the guest was ready
        }
        if feed {
            let mut stdin = io::stdin().lock();
            let _ = io::copy(&mut stdin, &mut s);
        }
        // Half-close: QEMU treats a full close as a hang-up and drops stdin bytes it has not
        // passed to the guest yet; after SHUT_WR it delivers them and then EOF.
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = [0u8; 256];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    })
}

/// Keeps the end of the console output for error reports.
#[derive(Debug, Default)]
pub struct ConsoleTail {
    buf: Vec<u8>,
}

const TAIL_BYTES: usize = 64 * 1024;

impl ConsoleTail {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
        if self.buf.len() > TAIL_BYTES * 2 {
            let cut = self.buf.len() - TAIL_BYTES;
            self.buf.drain(..cut);
        }
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.buf).replace('\r', "")
    }

    /// The panic report: from the "Kernel panic" line (and the oops before it) to the end.
    pub fn panic_text(&self) -> Option<String> {
        let text = self.text();
        let lines: Vec<&str> = text.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.contains("Kernel panic - not syncing"))?;
        // Include the preceding oops/BUG header if it is close: it says what went wrong.
        let start = lines[..at]
            .iter()
            .rposition(|l| {
                l.contains("------------[ cut here ]")
                    || l.contains("BUG:")
                    || l.contains("sysrq: Trigger a crash")
            })
            .filter(|&s| at - s <= 60)
            .unwrap_or(at);
        let end = (at + 3).min(lines.len());
        Some(lines[start..end].join("\n"))
    }
}

/// What the guest kernel's RCU stall detector prints when the timer of a CPU did not fire:
/// `rcu: \tPossible timer handling issue on cpu=1 timer-softirq=4` (kernel/rcu/tree_stall.h).
const TIMER_STALL: &str = "Possible timer handling issue on cpu=";

/// The CPUs the console text reports as having a stalled timer, in order, each once. The text
/// is the guest's: only CPUs below `vcpus` (the VM's own) count, so a guest printing the line
/// for made-up CPUs cannot make vmsight query the monitor more than once per vCPU.
pub fn timer_stall_cpus(text: &str, vcpus: u32) -> Vec<u32> {
    let mut cpus = Vec::new();
    for (at, _) in text.match_indices(TIMER_STALL) {
        let rest = &text[at + TIMER_STALL.len()..];
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        // A line cut at the end of the text is not complete yet: take it from a later read.
        if end == rest.len() {
            continue;
        }
        if let Ok(cpu) = rest[..end].parse::<u32>() {
            if cpu < vcpus && !cpus.contains(&cpu) {
                cpus.push(cpu);
            }
        }
    }
    cpus
}

/// Reads the serial console: log file, tail buffer, optional live copy, panic detection, and
/// the guest kernel's reports of a CPU whose timer stopped firing (each of the VM's `vcpus`
/// once).
#[allow(clippy::too_many_arguments)] // one reader, fed by the services that own each end
pub fn spawn_console_reader(
    listener: UnixListener,
    vcpus: u32,
    stop: Arc<AtomicBool>,
    tail: Arc<Mutex<ConsoleTail>>,
    mut log: Option<std::fs::File>,
    mut live: Option<Box<dyn Write + Send>>,
    stream_out: Arc<Mutex<Option<UnixStream>>>,
    events: Sender<Event>,
) -> Result<JoinHandle<()>, LaunchError> {
    spawn_named("vmsight-console", move || {
        let Some(mut s) = accept_until(&listener, &stop) else {
            return;
        };
        if let (Ok(mut slot), Ok(w)) = (stream_out.lock(), s.try_clone()) {
            *slot = Some(w);
        }
        let mut buf = vec![0u8; 16 * 1024];
        let mut panic_seen = false;
        let mut stalls_seen: Vec<u32> = Vec::new();
        loop {
            let n = match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            let chunk = &buf[..n];
            if let Some(f) = log.as_mut() {
                let _ = f.write_all(chunk);
            }
            if let Some(w) = live.as_mut() {
                let _ = w.write_all(chunk);
                let _ = w.flush();
            }
            if let Ok(mut t) = tail.lock() {
                t.push(chunk);
                let text = t.text();
                if !panic_seen && text.contains("Kernel panic - not syncing") {
                    panic_seen = true;
                    let _ = events.send(Event::ConsolePanic);
                }
                if text.contains(TIMER_STALL) {
                    for cpu in timer_stall_cpus(&text, vcpus) {
                        if !stalls_seen.contains(&cpu) {
                            stalls_seen.push(cpu);
                            let _ = events.send(Event::TimerStall(cpu));
                        }
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctl_lines_parse_and_garbage_is_ignored() {
        assert!(matches!(parse_ctl_line("ready 1.25\n"), Some(Event::Ready(v)) if v == 1.25));
        assert!(matches!(
            parse_ctl_line("exit 3\n"),
            Some(Event::GuestExit(3))
        ));
        assert!(matches!(
            parse_ctl_line("exit 255"),
            Some(Event::GuestExit(255))
        ));
        assert!(parse_ctl_line("exit 256").is_none());
        assert!(parse_ctl_line("exit -1").is_none());
        assert!(parse_ctl_line("exit x").is_none());
        for (line, a) in [
            ("down poweroff\n", DownAction::Poweroff),
            ("down halt", DownAction::Halt),
            ("down reboot", DownAction::Reboot),
            ("down", DownAction::Poweroff),
            ("down \u{1b}[2J", DownAction::Poweroff),
        ] {
            assert!(
                matches!(parse_ctl_line(line), Some(Event::GuestDown(x)) if x == a),
                "{line:?}"
            );
        }
        assert!(parse_ctl_line("ready NaN").is_none());
        assert!(matches!(
            parse_ctl_line("cmdpid 153\n"),
            Some(Event::CmdPid(153))
        ));
        assert!(parse_ctl_line("cmdpid 1").is_none());
        assert!(parse_ctl_line("cmdpid -5").is_none());
        assert!(parse_ctl_line("").is_none());
        assert!(parse_ctl_line("\u{0}\u{1}garbage").is_none());
    }

    #[test]
    fn panic_text_is_extracted_from_the_console_tail() {
        let mut t = ConsoleTail::default();
        t.push(b"[    1.0] booting\r\n[    5.1] sysrq: Trigger a crash\r\n[    5.2] Kernel panic - not syncing: sysrq triggered crash\r\n[    5.3] CPU: 0 PID: 1\r\n");
        let p = t.panic_text().unwrap();
        assert!(p.starts_with("[    5.1] sysrq: Trigger a crash"), "{p}");
        assert!(p.contains("Kernel panic - not syncing: sysrq triggered crash"));
        assert!(!p.contains("booting"));
        let mut none = ConsoleTail::default();
        none.push(b"all fine\n");
        assert!(none.panic_text().is_none());
    }

    #[test]
    fn timer_stall_reports_name_each_cpu_once_and_wait_for_the_whole_line() {
        let text = "[  148.671529] rcu: \tPossible timer handling issue on cpu=1 timer-softirq=4\n\
                    [  211.693288] rcu: \tPossible timer handling issue on cpu=1 timer-softirq=4\n\
                    [  232.713295] rcu: \tPossible timer handling issue on cpu=12 timer-softirq=0\n\
                    rcu: Possible timer handling issue on cpu=x\n\
                    rcu: \tPossible timer handling issue on cpu=3";
        assert_eq!(timer_stall_cpus(text, 64), vec![1, 12]);
        assert_eq!(
            timer_stall_cpus("rcu: INFO: rcu_preempt detected stalls", 2),
            Vec::<u32>::new()
        );
    }

    #[test]
    fn made_up_cpus_in_hostile_console_text_are_ignored() {
        let spam: String = (0..10_000)
            .map(|n| format!("Possible timer handling issue on cpu={n} timer-softirq=0\n"))
            .collect();
        assert_eq!(timer_stall_cpus(&spam, 2), vec![0, 1]);
        assert_eq!(
            timer_stall_cpus("Possible timer handling issue on cpu=99999999999 x", 2),
            Vec::<u32>::new()
        );
    }

    #[test]
    fn console_tail_is_bounded() {
        let mut t = ConsoleTail::default();
        for _ in 0..100 {
            t.push(&[b'x'; 10_000]);
        }
        assert!(t.buf.len() <= TAIL_BYTES * 2);
    }
}
