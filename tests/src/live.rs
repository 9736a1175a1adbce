//! A `vmsight run` the test talks to while the guest runs (stdin to the guest command,
//! stdout line by line).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::vmsight;

/// A `vmsight run` whose stdin is a pipe (forwarded to the guest command) and whose stdout is
/// read line by line as it comes.
pub struct LiveVm {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
}

impl LiveVm {
    pub fn start(args: &[&str]) -> LiveVm {
        LiveVm::start_with_env(args, &[])
    }

    /// [`start`](Self::start) with extra environment variables for vmsight.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> LiveVm {
        let mut child = vmsight()
            .envs(env.iter().copied())
            .arg("run")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start vmsight run");
        let stdin = child.stdin.take();
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let err = child.stderr.take().unwrap();
        let e2 = stderr.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines() {
                let Ok(l) = l else { break };
                let mut s = e2.lock().unwrap();
                s.push_str(&l);
                s.push('\n');
            }
        });
        LiveVm {
            child,
            stdin,
            lines: rx,
            seen: Vec::new(),
            stderr,
        }
    }

    /// The PID of the `vmsight run` process.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a stdout line equal to `marker` (bounded: a guest that never gets there is a
    /// failure, not a hang).
    pub fn wait_line(&mut self, marker: &str) {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    let hit = l == marker;
                    self.seen.push(l);
                    if hit {
                        return;
                    }
                }
                Err(_) => panic!(
                    "the guest never printed {marker:?}; stdout {:?}, stderr {}",
                    self.seen,
                    self.stderr.lock().unwrap()
                ),
            }
        }
    }

    /// Waits for a stdout line starting with `prefix` and returns it (bounded like
    /// [`LiveVm::wait_line`]).
    pub fn wait_prefix(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.starts_with(prefix) {
                        return l;
                    }
                }
                Err(_) => panic!(
                    "the guest never printed a line starting with {prefix:?}; stdout {:?}, \
                     stderr {}",
                    self.seen,
                    self.stderr.lock().unwrap()
                ),
            }
        }
    }

    /// Stdout lines between the lines `from` and `to` (exclusive) seen so far.
    pub fn section(&self, from: &str, to: &str) -> Vec<String> {
        let start = self.seen.iter().position(|l| l == from).unwrap() + 1;
        let end = self.seen[start..].iter().position(|l| l == to).unwrap() + start;
        self.seen[start..end].to_vec()
    }

    /// Every stdout line seen so far (the VM may still run).
    pub fn seen(&self) -> &[String] {
        &self.seen
    }

    pub fn send(&mut self, line: &str) {
        let s = self.stdin.as_mut().unwrap();
        s.write_all(line.as_bytes()).unwrap();
        s.write_all(b"\n").unwrap();
        s.flush().unwrap();
    }

    /// Closes stdin and waits for the end: (exit code, remaining stdout, stderr).
    pub fn finish(mut self) -> (Option<i32>, Vec<String>, String) {
        drop(self.stdin.take());
        let code = self.child.wait().unwrap().code();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.seen.push(l);
        }
        let err = self.stderr.lock().unwrap().clone();
        (code, std::mem::take(&mut self.seen), err)
    }
}

impl Drop for LiveVm {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A background helper process killed when the test ends.
pub struct Bg(pub Child);

impl Drop for Bg {
    fn drop(&mut self) {
        crate::terminate(&mut self.0, Duration::from_secs(10));
    }
}

/// Collects a child's stdout lines into a shared vector as they arrive.
pub fn collect_lines(child: &mut Child) -> Arc<Mutex<Vec<String>>> {
    let out = child.stdout.take().unwrap();
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l2 = lines.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            l2.lock().unwrap().push(l);
        }
    });
    lines
}

/// Polls `f` until it returns true (bounded; the bound is a hang guard, not a timing check).
pub fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("timed out waiting for {what}");
}

/// `vmsight mount DIR --vm VM --host h` in the background: VM's view at `DIR/h/VM`.
pub fn mount_view(dir: &std::path::Path, vm: &str) -> Bg {
    Bg(vmsight()
        .arg("mount")
        .arg(dir)
        .args(["--vm", vm, "--host", "h"])
        .spawn()
        .unwrap())
}

/// Unmounts the view at `dir` with `fusermount3 -u` and asserts that an external unmount ends
/// `vmsight mount` cleanly.
pub fn unmount_view(dir: &std::path::Path, mount: &mut Bg) {
    let st = std::process::Command::new("fusermount3")
        .arg("-u")
        .arg(dir)
        .status()
        .unwrap();
    assert!(st.success(), "unmount");
    let mut status = None;
    wait_until("vmsight mount to exit after fusermount3 -u", 30, || {
        status = mount.0.try_wait().unwrap();
        status.is_some()
    });
    assert!(status.unwrap().success(), "vmsight mount: {status:?}");
}
