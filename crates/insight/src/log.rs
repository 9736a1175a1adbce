//! The insight log (`--insights FILE`): JSON lines written by a thread of its own, fed
//! through a bounded channel so the block and trace threads never wait for the disk.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use vmsight_blockdev::insight::InsightRecord;

/// Records queued before new ones are dropped (and counted).
const QUEUE: usize = 1 << 16;

/// Sender side of the insight log. Cloneable; dropping every clone ends the writer thread.
#[derive(Clone)]
pub struct InsightLog {
    tx: Option<SyncSender<InsightRecord>>,
    dropped: Arc<AtomicU64>,
}

/// The writer thread; join it with [`LogWriter::finish`] after the last sender is gone.
pub struct LogWriter {
    handle: JoinHandle<std::io::Result<u64>>,
}

impl LogWriter {
    /// Waits for the writer; returns the number of lines written.
    pub fn finish(self) -> std::io::Result<u64> {
        self.handle
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the insight log writer panicked")))
    }
}

impl InsightLog {
    /// A log that discards everything (no `--insights`).
    pub fn disabled() -> Self {
        Self {
            tx: None,
            dropped: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Starts a writer thread writing to `out` (buffered).
    pub fn start(out: Box<dyn Write + Send>) -> std::io::Result<(Self, LogWriter)> {
        let (tx, rx) = sync_channel::<InsightRecord>(QUEUE);
        let handle = std::thread::Builder::new()
            .name("vmsight-insights".into())
            .spawn(move || {
                vmsight_vhostd::seccomp::install_once(
                    vmsight_vhostd::seccomp::ThreadClass::GuestService,
                );
                let mut w = std::io::BufWriter::new(out);
                let mut n = 0u64;
                while let Ok(r) = rx.recv() {
                    serde_json::to_writer(&mut w, &r).map_err(std::io::Error::other)?;
                    w.write_all(b"\n")?;
                    n += 1;
                }
                w.flush()?;
                Ok(n)
            })?;
        Ok((
            Self {
                tx: Some(tx),
                dropped: Arc::new(AtomicU64::new(0)),
            },
            LogWriter { handle },
        ))
    }

    /// Creates `path` and starts a writer for it.
    pub fn create(path: &std::path::Path) -> std::io::Result<(Self, LogWriter)> {
        Self::start(Box::new(std::fs::File::create(path)?))
    }

    /// Queues a record; never blocks (a full queue drops and counts).
    pub fn write(&self, r: InsightRecord) {
        if let Some(tx) = &self.tx {
            match tx.try_send(r) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Records dropped because the writer fell behind or stopped.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}
