//! The `vmsight-sym` thread: accepts QEMU's connection on `<rt>/sym.sock`, gives it the
//! region and the doorbells (ivshmem protocol), and turns the guest's doorbells into calls on
//! [`Symbiotic`]. A flood of doorbells costs one eventfd read per wakeup (eventfds add up),
//! so it cannot starve anything; only one QEMU connection is served at a time.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmsight_proto::sym::{VEC_CALL, VEC_STATE};

use super::{ivshmem, Symbiotic};

/// The running thread.
pub struct Server {
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<Result<(), String>>>,
    socket: PathBuf,
}

impl Server {
    /// Binds `socket` (before QEMU starts) and starts serving.
    pub fn start(sym: Arc<Symbiotic>, socket: &Path) -> std::io::Result<Server> {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)?;
        vmsight_proto::peer::restrict_socket(socket)?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let st = stop.clone();
        let thread = std::thread::Builder::new()
            .name("vmsight-sym".into())
            .spawn(move || {
                vmsight_vhostd::seccomp::install_once(
                    vmsight_vhostd::seccomp::ThreadClass::GuestService,
                );
                serve(&sym, &listener, &st)
            })?;
        Ok(Server {
            stop,
            thread: Some(thread),
            socket: socket.to_owned(),
        })
    }

    /// The thread's error, if it ended with one.
    pub fn stopped(&self) -> Option<String> {
        self.thread
            .as_ref()
            .filter(|t| t.is_finished())
            .map(|_| "the symbiotic device's server thread ended".to_owned())
    }

    /// Stops and joins the thread.
    pub fn finish(mut self) -> Option<String> {
        let _ = self.stop.write(1);
        let r = self.thread.take().map(|t| t.join());
        let _ = std::fs::remove_file(&self.socket);
        match r {
            Some(Ok(Err(e))) => Some(e),
            Some(Err(_)) => Some("the symbiotic server thread panicked".into()),
            _ => None,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn pfd(fd: BorrowedFd<'_>) -> PollFd<'_> {
    PollFd::new(fd, PollFlags::POLLIN)
}

fn serve(sym: &Symbiotic, listener: &UnixListener, stop: &EventFd) -> Result<(), String> {
    let mut qemu: Option<UnixStream> = None;
    loop {
        let bells = sym.bells();
        let mut fds = vec![
            pfd(ivshmem::borrow(stop)),
            pfd(listener.as_fd()),
            pfd(ivshmem::borrow(&bells.to_vmm[VEC_CALL as usize])),
            pfd(ivshmem::borrow(&bells.to_vmm[VEC_STATE as usize])),
        ];
        if let Some(q) = &qemu {
            fds.push(pfd(q.as_fd()));
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(format!("poll: {e}")),
        }
        let ready = |i: usize| {
            fds.get(i)
                .and_then(|f| f.revents())
                .is_some_and(|r| !r.is_empty())
        };
        let (stopped, accept, call, state, conn) =
            (ready(0), ready(1), ready(2), ready(3), ready(4));
        drop(fds);
        if stopped {
            return Ok(());
        }
        if call {
            let rings = bells.drain_vmm(VEC_CALL);
            if rings > 0 {
                sym.on_call_doorbell(rings);
            }
        }
        if state && bells.drain_vmm(VEC_STATE) > 0 {
            sym.on_state_doorbell();
        }
        if conn {
            // QEMU never sends anything: readable means it hung up.
            tracing::debug!("VM {}: QEMU closed the symbiotic device's socket", sym.vm());
            qemu = None;
        }
        if accept {
            if let Some(s) = accept_qemu(sym, listener, qemu.is_some()) {
                qemu = Some(s);
            }
        }
    }
}

fn accept_qemu(sym: &Symbiotic, listener: &UnixListener, busy: bool) -> Option<UnixStream> {
    let (s, _) = listener.accept().ok()?;
    if let Err(e) = vmsight_proto::peer::check_peer(&s) {
        tracing::warn!("VM {}: symbiotic socket: {e}", sym.vm());
        return None;
    }
    if busy {
        tracing::warn!(
            "VM {}: a second client on the symbiotic socket was refused",
            sym.vm()
        );
        return None;
    }
    if let Err(e) = s.set_nonblocking(false) {
        tracing::warn!("VM {}: symbiotic socket: {e}", sym.vm());
    }
    match ivshmem::setup_client(&s, sym.region().fd(), sym.bells()) {
        Ok(()) => Some(s),
        Err(e) => {
            tracing::warn!("VM {}: cannot set up QEMU's ivshmem device: {e}", sym.vm());
            None
        }
    }
}
