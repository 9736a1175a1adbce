//! Helpers for the real-guest integration tests: locate the built `vmsight`, run it, and make
//! disk images on the host. A missing binary or guest image is a test failure, never a skip.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// The `vmsight` binary under test: `$VMSIGHT_BIN`, else the workspace's release build.
pub fn vmsight_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("VMSIGHT_BIN") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let p = target.join("release").join("vmsight");
    assert!(
        p.is_file(),
        "vmsight binary not found at {} — run `make test` (it builds it first) or set VMSIGHT_BIN",
        p.display()
    );
    p
}

/// A `vmsight` command with a quiet log.
pub fn vmsight() -> Command {
    let mut c = Command::new(vmsight_bin());
    c.env_remove("RUST_LOG").stdin(Stdio::null());
    c
}

/// The result of one run, with helpers for assertions.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Run {
    fn from(o: Output) -> Self {
        Run {
            code: o.status.code(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

impl Run {
    /// The single line of stderr (a one-line error), or a failed test.
    pub fn one_line_error(&self) -> String {
        let lines: Vec<&str> = self.stderr.trim().lines().collect();
        assert_eq!(lines.len(), 1, "expected a one-line error: {self:?}");
        lines[0].to_string()
    }
}

/// How long one `vmsight` run may take in a test: `VMSIGHT_TEST_RUN_TIMEOUT` seconds, else 20
/// minutes (the longest test run takes a few). A hung guest then fails its own test, with
/// vmsight's output, instead of holding the whole suite until CI's limit.
pub fn run_timeout() -> Duration {
    std::env::var("VMSIGHT_TEST_RUN_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(1200))
}

/// Runs `vmsight` with `args` to completion, at most [`run_timeout`].
///
/// A `vmsight run` that failed with the signature of QEMU 10's TCG section race before its
/// command started ([`rerun_reason`]) runs once more: the guest never ran the command, so the
/// second run is the same test. Every such rerun is said on stderr and written to
/// [`reruns_dir`], which `make test` counts at its end (it fails on more than one).
pub fn run(args: &[&str]) -> Run {
    let once = || {
        let mut c = vmsight();
        c.args(args);
        output_within(c, run_timeout(), &args.join(" "))
    };
    let r = once();
    if let Some(why) = rerun_reason(args, &r) {
        let line = args.join(" ");
        eprintln!(
            "vmsight-tests: RERUN of `vmsight {line}`: {why}. First run's stderr:\n{}",
            r.stderr
        );
        record_rerun(&line, why, &r);
        return once();
    }
    r
}

/// Why a finished `vmsight` run may run again, or `None` (it may not). Only one signature
/// counts: vmsight stopped the guest because a vCPU's timer vector stayed in service (QEMU
/// 10's TCG section race lost its EOI; the message carries QEMU's local APIC state), before
/// the guest reported ready. Never for a run with the symbiotic module or the swap service
/// (`--symbiotic`, `--swap`): their own guest code runs with interrupts off and could leave a
/// vCPU looking the same.
pub fn rerun_reason(args: &[&str], r: &Run) -> Option<&'static str> {
    use vmsight_launcher::supervisor::{BEFORE_READY, TIMER_STUCK_MESSAGE};
    let own_guest_code = args
        .iter()
        .any(|a| matches!(*a, "--symbiotic" | "--swap") || a.starts_with("--swap="));
    let stuck = r.code == Some(125)
        && r.stderr.contains(TIMER_STUCK_MESSAGE)
        && r.stderr.contains(BEFORE_READY)
        && r.stderr.contains("ISR");
    (args.first() == Some(&"run") && !own_guest_code && stuck).then_some(
        "a guest vCPU's timer stuck in service before the guest reported ready (QEMU 10's \
         TCG section race, docs/launcher.md)",
    )
}

/// Where the harness writes one file per rerun: `<target>/vmsight-test-reruns`.
pub fn reruns_dir() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("vmsight-test-reruns")
}

/// Writes one rerun's record (the command, the reason, the first run's stderr) to
/// [`reruns_dir`]. A failure to write fails the test: an uncounted rerun is a hidden one.
fn record_rerun(line: &str, why: &str, first: &Run) {
    let dir = reruns_dir();
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let file = dir.join(format!("{stamp}-{}.txt", std::process::id()));
    let text = format!(
        "command: vmsight {line}\nreason: {why}\nexit: {:?}\n--- first run's stderr:\n{}\n",
        first.code, first.stderr
    );
    std::fs::write(&file, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", file.display()));
}

/// Runs `cmd` (stdout and stderr captured) for at most `limit`. Past it, the command gets
/// SIGTERM (vmsight then stops its QEMU), SIGKILL 20 s later, and the test fails with what it
/// printed. `what` names the command in that failure.
pub fn output_within(mut cmd: Command, limit: Duration, what: &str) -> Run {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if start.elapsed() < limit => std::thread::sleep(Duration::from_millis(50)),
            _ => break None,
        }
    };
    let Some(status) = status else {
        terminate(&mut child, Duration::from_secs(20));
        let (out, err) = (collect(stdout), collect(stderr));
        panic!(
            "`{what}` was still running after {} s and was stopped\n--- stdout:\n{out}\n--- \
             stderr:\n{err}",
            limit.as_secs()
        );
    };
    Run {
        code: status.code(),
        stdout: collect(stdout),
        stderr: collect(stderr),
    }
}

/// Reads a pipe to its end on a thread.
fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> Receiver<Vec<u8>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        let _ = tx.send(buf);
    });
    rx
}

/// What a [`drain`] read; at most 30 s after the process ended (a grandchild holding the pipe
/// must not hang the test).
fn collect(rx: Receiver<Vec<u8>>) -> String {
    let bytes = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// SIGTERM (vmsight then stops its QEMU), then SIGKILL if the child is still there after
/// `grace`.
pub fn terminate(child: &mut Child, grace: Duration) {
    // SAFETY: kill(2) on our own child's PID, which has not been reaped (try_wait saw it run).
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    while t.elapsed() < grace {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs a shell command line in a fresh default guest with `extra` vmsight options.
pub fn guest_sh(extra: &[&str], script: &str) -> Run {
    let mut args = vec!["run"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    let r = run(&args);
    assert!(
        !r.stderr.contains("vmsight image build"),
        "the guest image is missing: run `vmsight image build` (make test does): {}",
        r.stderr
    );
    r
}

/// Makes a raw ext4 image of `mib` MiB on the host.
pub fn make_ext4(path: &Path, mib: u64) {
    let f = std::fs::File::create(path).expect("create image");
    f.set_len(mib << 20).expect("size image");
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "vmtest"])
        .arg(path)
        .status()
        .expect("mkfs.ext4 must be installed");
    assert!(st.success(), "mkfs.ext4 failed");
}

/// `debugfs -R CMD IMAGE` stdout.
pub fn debugfs(image: &Path, cmd: &str) -> String {
    let o = Command::new("debugfs")
        .args(["-R", cmd])
        .arg(image)
        .output()
        .expect("debugfs must be installed");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Disk byte offsets of the data blocks of `path` on the ext4 `image` (4 KiB blocks), in file
/// order (block k holds file bytes k*4096..), from debugfs: an oracle independent of vmsight.
pub fn file_blocks(image: &Path, path: &str) -> Vec<u64> {
    let out = debugfs(image, &format!("blocks {path}"));
    let blocks: Vec<u64> = out
        .split_whitespace()
        .map(|b| b.parse::<u64>().expect("debugfs block number") * 4096)
        .collect();
    assert!(!blocks.is_empty(), "debugfs lists no blocks of {path}");
    blocks
}

/// Whether `e2fsck -fn` finds the image clean.
pub fn fsck_clean(image: &Path) -> (bool, String) {
    let o = Command::new("e2fsck")
        .arg("-fn")
        .arg(image)
        .output()
        .expect("e2fsck must be installed");
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// The trixie root `vmsight run --qemu trixie` uses; a missing root fails the test.
pub fn require_trixie_root() {
    let cache = std::env::var_os("VMSIGHT_CACHE")
        .filter(|c| !c.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/vmsight")
        });
    let qemu = cache.join("qemu/trixie-current/root/usr/bin/qemu-system-x86_64");
    assert!(
        qemu.is_file(),
        "the QEMU 11 trixie root is missing ({} does not exist): run `make qemu11` (make test does)",
        qemu.display()
    );
}

/// A unique VM name for a test.
pub fn vm_name(test: &str) -> String {
    format!("t-{test}-{}", std::process::id())
}

pub mod live;
pub mod oracle;
pub mod trace_compare;

pub use live::{collect_lines, mount_view, unmount_view, wait_until, Bg, LiveVm};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_timer_stuck_before_ready_without_own_guest_code_is_rerun() {
        use vmsight_launcher::supervisor::EndReason;
        let run = |code, stderr: &str| Run {
            code,
            stdout: String::new(),
            stderr: stderr.to_owned(),
        };
        let apic = "LVTT 0x000200ec periodic Fixed  (vec 236)\nISR      236\nPPR 0xe0";
        let msg = |ready| {
            format!(
                "vmsight: {}",
                EndReason::TimerStuck(1, apic.into(), ready)
                    .error_message()
                    .unwrap()
            )
        };
        let before = run(Some(125), &msg(false));
        assert!(rerun_reason(&["run", "--", "true"], &before).is_some());
        // Not after ready (the command had started), not with the guest module or the swap
        // service, not for another subcommand, not without the APIC state.
        assert!(rerun_reason(&["run", "--", "true"], &run(Some(125), &msg(true))).is_none());
        assert!(rerun_reason(&["run", "--symbiotic", "--", "true"], &before).is_none());
        assert!(rerun_reason(&["run", "--swap", "64M", "--", "true"], &before).is_none());
        assert!(rerun_reason(&["stats", "x"], &before).is_none());
        let no_apic = msg(false).replace("ISR", "");
        assert!(rerun_reason(&["run"], &run(Some(125), &no_apic)).is_none());
        // The old signature alone (an RCU report and a boot timeout) no longer reruns, nor
        // does QEMU's abort, nor a success.
        let old = "WARN the guest reports that the timer of its CPU 0 did not fire (an RCU \
                   stall)\nvmsight: the guest did not report ready within 600 s";
        assert!(rerun_reason(&["run"], &run(Some(125), old)).is_none());
        let abort = "vmsight: QEMU failed: ... iotlb_to_section: Assertion ... failed.";
        assert!(rerun_reason(&["run"], &run(Some(125), abort)).is_none());
        assert!(rerun_reason(&["run"], &run(Some(0), &msg(false))).is_none());
    }

    #[test]
    fn a_bounded_run_returns_status_and_both_streams() {
        let mut c = Command::new("sh");
        c.args(["-c", "echo out; echo err >&2; exit 4"]);
        let r = output_within(c, Duration::from_secs(60), "sh");
        assert_eq!(r.code, Some(4));
        assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("out\n", "err\n"));
    }

    #[test]
    #[should_panic(expected = "was still running after 1 s and was stopped")]
    fn a_run_past_its_bound_is_stopped_and_fails_with_its_output() {
        let mut c = Command::new("sh");
        c.args(["-c", "echo started; exec sleep 600"]);
        output_within(c, Duration::from_secs(1), "sleeper");
    }
}
