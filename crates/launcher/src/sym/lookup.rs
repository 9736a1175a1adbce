//! The insight engine's symcall source (Sky's insight-calls through SymCall): `task_info` and
//! `fd_path` answered by the guest module, falling back to the kernel-profile reader when the
//! module is absent, refuses, times out, or the call fails.

use std::sync::Arc;

use vmsight_insight::{FdFacts, Lookup, LookupSource, TaskFacts};
use vmsight_proto::sym::{nr, CallRequest, Decoded, Transport};

use super::Symbiotic;

/// How long a lookup waits for the guest (the trace thread waits meanwhile).
const LOOKUP_TIMEOUT_MS: u64 = 500;

/// Asks the guest module first, then `fallback`.
pub struct SymLookup {
    sym: Arc<Symbiotic>,
    fallback: Box<dyn Lookup>,
}

impl SymLookup {
    pub fn new(sym: Arc<Symbiotic>, fallback: Box<dyn Lookup>) -> SymLookup {
        SymLookup { sym, fallback }
    }

    fn ask(&self, n: u32, args: Vec<u64>) -> Option<Decoded> {
        let req = CallRequest {
            nr: n,
            args,
            transport: Transport::Auto,
            timeout_ms: LOOKUP_TIMEOUT_MS,
        };
        match self.sym.call(&req) {
            Ok(r) => r.decode(),
            Err(e) => {
                tracing::debug!("symcall lookup failed, using the profile: {e}");
                None
            }
        }
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

impl Lookup for SymLookup {
    fn task(&mut self, pid: u32) -> Option<(TaskFacts, LookupSource)> {
        match self.ask(nr::TASK_INFO, vec![pid.into()]) {
            Some(Decoded::TaskInfo(t)) => Some((
                TaskFacts {
                    tgid: t.tgid as u32,
                    ppid: t.ppid as u32,
                    comm: t.comm,
                    exe: non_empty(t.exe),
                    cwd: non_empty(t.cwd),
                },
                LookupSource::Symcall,
            )),
            _ => self.fallback.task(pid),
        }
    }

    fn fd(&mut self, pid: u32, fd: u32) -> Option<(FdFacts, LookupSource)> {
        match self.ask(nr::FD_PATH, vec![pid.into(), fd.into()]) {
            Some(Decoded::FdPath(f)) => Some((
                FdFacts {
                    path: f.path,
                    flags: Some(f.flags),
                    pos: Some(f.pos),
                },
                LookupSource::Symcall,
            )),
            _ => self.fallback.fd(pid, fd),
        }
    }
}
