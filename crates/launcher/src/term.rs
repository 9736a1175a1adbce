//! Interactive console: the host terminal in raw mode, bridged to the guest's serial console.
//!
//! Ctrl-] (0x1d) leaves the console and stops the VM, like telnet's escape; every other byte,
//! Ctrl-C included, goes to the guest.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use nix::sys::termios::{self, SetArg, Termios};

use crate::vm::Event;

const ESCAPE: u8 = 0x1d;

/// Restores the terminal on drop.
pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// Puts stdin in raw mode (if it is a terminal) and starts forwarding keystrokes to the
    /// console once QEMU has connected it.
    pub fn enter(
        console: Arc<Mutex<Option<UnixStream>>>,
        events: Sender<Event>,
    ) -> Option<RawMode> {
        let stdin = std::io::stdin();
        if !std::io::IsTerminal::is_terminal(&stdin) {
            return None;
        }
        let saved = termios::tcgetattr(stdin.as_fd()).ok()?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).ok()?;
        eprint!("vmsight: interactive console; press Ctrl-] to stop the VM\r\n");
        std::thread::spawn(move || {
            let mut input = std::io::stdin();
            let mut buf = [0u8; 1024];
            loop {
                let n = match input.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let data = &buf[..n];
                if let Some(pos) = data.iter().position(|&b| b == ESCAPE) {
                    forward(&console, &data[..pos]);
                    let _ = events.send(Event::ConsoleQuit);
                    break;
                }
                forward(&console, data);
            }
        });
        Some(RawMode { saved })
    }
}

fn forward(console: &Arc<Mutex<Option<UnixStream>>>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    if let Ok(mut c) = console.lock() {
        if let Some(s) = c.as_mut() {
            let _ = s.write_all(data);
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let stdin = std::io::stdin();
        let _ = termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &self.saved);
        eprintln!();
    }
}
