//! The swap disk's block stage: the last stage of the swap disk's pipeline, serving every
//! request from the [`SwapStore`] (cache slots, then the swap file) on a worker thread of its
//! own (file reads and the region's lock may wait, and a stage's `submit` must not).

use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use vmsight_blockdev::{Io, IoResult, Lower, Request, RequestKind, Stage, StageError, Status};
use vmsight_proto::sym::swapr::PAGE;

use crate::error::SwapError;
use crate::store::{OpError, SwapStore};

/// The stage.
pub struct SwapStage {
    tx: Mutex<Option<mpsc::Sender<Io>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for SwapStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapStage").finish()
    }
}

impl SwapStage {
    /// Starts the worker serving `store`.
    pub fn start(store: Arc<SwapStore>) -> Result<Self, SwapError> {
        let (tx, rx) = mpsc::channel::<Io>();
        let worker = std::thread::Builder::new()
            .name("vmsight-swap-io".into())
            .spawn(move || {
                vmsight_vhostd::seccomp::install_once(
                    vmsight_vhostd::seccomp::ThreadClass::GuestService,
                );
                for mut io in rx {
                    let r = serve(&store, io.request_mut());
                    io.complete(r);
                }
            })
            .map_err(SwapError::Thread)?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
        })
    }
}

impl Stage for SwapStage {
    fn name(&self) -> &str {
        "swap"
    }

    fn submit(&self, io: Io) {
        let tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        match tx.as_ref() {
            // A stopped worker drops the Io, which fails it (never a hang).
            Some(tx) => {
                let _ = tx.send(io);
            }
            None => io.complete(Ok(Status::IoErr)),
        }
    }

    fn shutdown(&self, _lower: &Lower) -> Result<(), StageError> {
        drop(
            self.tx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        if let Some(w) = self
            .worker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = w.join();
        }
        Ok(())
    }
}

/// One piece of a request within a swap page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    page: u64,
    /// Offset in the page.
    at: usize,
    len: usize,
    /// Offset in the request's data.
    data: u64,
}

/// The pieces of the byte range `[start, start + len)`, page by page.
fn pieces(start: u64, len: u64) -> impl Iterator<Item = Piece> {
    let end = start + len;
    let mut pos = start;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let page = pos / PAGE;
        let at = pos % PAGE;
        let n = (PAGE - at).min(end - pos);
        let p = Piece {
            page,
            at: at as usize,
            len: n as usize,
            data: pos - start,
        };
        pos += n;
        Some(p)
    })
}

fn status(e: OpError) -> Status {
    tracing::warn!("swap disk: {e}");
    Status::IoErr
}

/// Serves one request.
fn serve(store: &SwapStore, req: &mut Request) -> IoResult {
    let mut buf = vec![0u8; PAGE as usize];
    let full = |p: &Piece| p.at == 0 && p.len == PAGE as usize;
    match req.kind {
        RequestKind::Read => {
            for p in pieces(req.offset(), req.len) {
                if let Err(e) = store.read(p.page, &mut buf) {
                    return Ok(status(e));
                }
                req.write_data(p.data, &buf[p.at..p.at + p.len])?;
            }
        }
        RequestKind::Write => {
            for p in pieces(req.offset(), req.len) {
                if !full(&p) {
                    if let Err(e) = store.read(p.page, &mut buf) {
                        return Ok(status(e));
                    }
                }
                req.read_data(p.data, &mut buf[p.at..p.at + p.len])?;
                if let Err(e) = store.write(p.page, &buf) {
                    return Ok(status(e));
                }
            }
        }
        RequestKind::Discard | RequestKind::WriteZeroes => {
            let zero = req.kind == RequestKind::WriteZeroes;
            for r in req.ranges.clone() {
                for p in pieces(r.offset(), r.bytes()) {
                    let res = match (zero, full(&p)) {
                        // A discarded page may read back as anything: dropping its slot
                        // (the file keeps an older copy) is allowed.
                        (false, true) => store.discard(p.page),
                        (false, false) => Ok(()),
                        (true, _) => zero_piece(store, &p, &mut buf),
                    };
                    if let Err(e) = res {
                        return Ok(status(e));
                    }
                }
            }
        }
        RequestKind::Flush => {}
        RequestKind::GetId => return Ok(Status::Unsupp),
    }
    Ok(Status::Ok)
}

fn zero_piece(store: &SwapStore, p: &Piece, buf: &mut [u8]) -> Result<(), OpError> {
    if p.at != 0 || p.len != PAGE as usize {
        store.read(p.page, buf)?;
    }
    buf[p.at..p.at + p.len].fill(0);
    store.write(p.page, buf).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_split_at_page_boundaries() {
        let v: Vec<_> = pieces(4096 - 512, 4096 + 1024).collect();
        assert_eq!(
            v,
            vec![
                Piece {
                    page: 0,
                    at: 3584,
                    len: 512,
                    data: 0
                },
                Piece {
                    page: 1,
                    at: 0,
                    len: 4096,
                    data: 512
                },
                Piece {
                    page: 2,
                    at: 0,
                    len: 512,
                    data: 4608
                },
            ]
        );
        assert_eq!(pieces(8192, 0).count(), 0);
        assert_eq!(pieces(0, 8192).count(), 2);
    }
}
