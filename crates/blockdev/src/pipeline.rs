//! The pipeline of stages between the virtqueue and the backing file.
//!
//! A validated [`Request`] enters the first [`Stage`]; each stage may inspect or annotate it,
//! answer it itself (e.g. a cache hit) or pass it on with `next.run(req)`. After the last stage
//! the [`Terminal`] (normally [`crate::file::RawFile`]) performs the I/O.
//!
//! ```text
//! virtqueue -> request.rs (parse + validate) -> stage 0 -> stage 1 -> ... -> Terminal (RawFile)
//! ```
//!
//! Stages are called synchronously on the queue worker thread, in order, with `&mut self`, so
//! they can keep state without locks. The whole pipeline of one disk is shared by its queues
//! behind one mutex (see docs/blockdev.md, "Limits").

use std::fmt;
use std::io;

use crate::request::Request;

/// The virtio-blk status byte written back to the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// `VIRTIO_BLK_S_OK`.
    Ok,
    /// `VIRTIO_BLK_S_IOERR`.
    IoErr,
    /// `VIRTIO_BLK_S_UNSUPP`.
    Unsupp,
}

impl Status {
    /// The byte value defined by the virtio specification.
    pub fn as_u8(self) -> u8 {
        match self {
            Status::Ok => virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK as u8,
            Status::IoErr => virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR as u8,
            Status::Unsupp => virtio_bindings::virtio_blk::VIRTIO_BLK_S_UNSUPP as u8,
        }
    }
}

/// An error raised inside the pipeline. The device turns it into `VIRTIO_BLK_S_IOERR` for the
/// guest, counts it in the metrics and logs it; it never stops the backend.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The backing file failed.
    #[error("{op} on the disk image failed: {source}")]
    Io {
        /// What was attempted ("pread", "pwrite", "fdatasync", "fallocate", ...).
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// A guest buffer could not be accessed (the guest unmapped or never mapped it).
    #[error("guest memory at {addr:#x} (+{len} bytes) is not accessible")]
    GuestMemory {
        /// Guest-physical address.
        addr: u64,
        /// Length of the access.
        len: u64,
    },
    /// A stage refused or failed the request for its own reason.
    #[error("stage {stage} failed: {reason}")]
    Stage {
        /// The stage's name.
        stage: String,
        /// Sentence describing what went wrong.
        reason: String,
    },
}

/// The rest of the pipeline, as seen from one stage.
pub trait Next {
    /// Runs the remaining stages and the terminal on `req` and returns their status.
    fn run(&mut self, req: &mut Request<'_>) -> Result<Status, StageError>;
}

/// One step of the block pipeline (classifier, cache, dedup, write tap, delay scheduler, ...).
///
/// A stage either returns a status itself (it has served or refused the request) or calls
/// `next.run(req)` (possibly after modifying or annotating `req`, possibly doing work after it
/// returns). A stage must not panic on any request: everything reaching it has been validated
/// against the disk geometry, but the guest may still change its buffers at any time.
pub trait Stage: Send {
    /// Short name used in logs and metrics (e.g. `"classifier"`).
    fn name(&self) -> &str;

    /// Handles one request.
    fn process(&mut self, req: &mut Request<'_>, next: &mut dyn Next)
        -> Result<Status, StageError>;

    /// Called once when the backend stops (the frontend disconnected or the backend was shut
    /// down), front to back, with the stages below still usable: a stage holding state that
    /// must reach the image (e.g. a write-back cache's dirty blocks) writes it here. The
    /// default does nothing.
    fn shutdown(&mut self, next: &mut dyn Next) -> Result<(), StageError> {
        let _ = next;
        Ok(())
    }
}

/// The end of the pipeline: the component that really stores the data.
pub trait Terminal: Send {
    /// Short name used in logs (e.g. `"raw-file"`).
    fn name(&self) -> &str;

    /// Performs the I/O described by `req` (read, write, flush, discard, write-zeroes).
    fn execute(&mut self, req: &mut Request<'_>) -> Result<Status, StageError>;
}

/// An ordered list of stages in front of a terminal.
pub struct Pipeline {
    stages: Vec<Box<dyn Stage>>,
    terminal: Box<dyn Terminal>,
}

impl fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pipeline")
            .field("stages", &self.stage_names())
            .field("terminal", &self.terminal.name())
            .finish()
    }
}

impl Pipeline {
    /// A pipeline with no stages: requests go straight to `terminal`.
    pub fn new(terminal: Box<dyn Terminal>) -> Self {
        Self {
            stages: Vec::new(),
            terminal,
        }
    }

    /// Appends a stage; it runs after every stage pushed before it.
    pub fn push(&mut self, stage: Box<dyn Stage>) {
        self.stages.push(stage);
    }

    /// Names of the stages in order, then the terminal's.
    pub fn stage_names(&self) -> Vec<String> {
        self.stages
            .iter()
            .map(|s| s.name().to_owned())
            .chain(std::iter::once(self.terminal.name().to_owned()))
            .collect()
    }

    /// Calls [`Stage::shutdown`] on every stage, front to back, each with the stages after it
    /// and the terminal as its `next`. Every stage is called even if an earlier one failed;
    /// the first error is returned.
    pub fn shutdown(&mut self) -> Result<(), StageError> {
        let mut first_err = None;
        for i in 0..self.stages.len() {
            let Some((stage, rest)) = self.stages.get_mut(i..).and_then(|s| s.split_first_mut())
            else {
                break;
            };
            let mut next = Rest {
                stages: rest,
                terminal: self.terminal.as_mut(),
            };
            if let Err(e) = stage.shutdown(&mut next) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Runs `req` through every stage and the terminal.
    pub fn run(&mut self, req: &mut Request<'_>) -> Result<Status, StageError> {
        Rest {
            stages: &mut self.stages,
            terminal: self.terminal.as_mut(),
        }
        .run(req)
    }
}

/// The stages not yet run, plus the terminal.
struct Rest<'p> {
    stages: &'p mut [Box<dyn Stage>],
    terminal: &'p mut dyn Terminal,
}

impl Next for Rest<'_> {
    fn run(&mut self, req: &mut Request<'_>) -> Result<Status, StageError> {
        match self.stages.split_first_mut() {
            Some((first, rest)) => {
                let mut next = Rest {
                    stages: rest,
                    terminal: &mut *self.terminal,
                };
                first.process(req, &mut next)
            }
            None => self.terminal.execute(req),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{RequestKind, Segment};
    use std::sync::{Arc, Mutex};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    /// Records the order in which stages see requests.
    struct Recorder {
        name: &'static str,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Stage for Recorder {
        fn name(&self) -> &str {
            self.name
        }
        fn process(
            &mut self,
            req: &mut Request<'_>,
            next: &mut dyn Next,
        ) -> Result<Status, StageError> {
            self.log
                .lock()
                .map_err(|_| StageError::Stage {
                    stage: self.name.into(),
                    reason: "poisoned".into(),
                })?
                .push(format!("{}:before", self.name));
            let s = next.run(req);
            if let Ok(mut l) = self.log.lock() {
                l.push(format!("{}:after", self.name));
            }
            s
        }
    }

    /// Serves reads of sector 7 from "cache" without calling the terminal.
    struct ShortCircuit;
    impl Stage for ShortCircuit {
        fn name(&self) -> &str {
            "short-circuit"
        }
        fn process(
            &mut self,
            req: &mut Request<'_>,
            next: &mut dyn Next,
        ) -> Result<Status, StageError> {
            if req.kind == RequestKind::Read && req.sector == 7 {
                req.write_data(0, &[0xab; 512])?;
                return Ok(Status::Ok);
            }
            next.run(req)
        }
    }

    struct CountingTerminal {
        log: Arc<Mutex<Vec<String>>>,
    }
    impl Terminal for CountingTerminal {
        fn name(&self) -> &str {
            "terminal"
        }
        fn execute(&mut self, _req: &mut Request<'_>) -> Result<Status, StageError> {
            if let Ok(mut l) = self.log.lock() {
                l.push("terminal".into());
            }
            Ok(Status::Ok)
        }
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).expect("guest memory")
    }

    #[test]
    fn stages_run_in_order_around_the_terminal() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut p = Pipeline::new(Box::new(CountingTerminal { log: log.clone() }));
        p.push(Box::new(Recorder {
            name: "a",
            log: log.clone(),
        }));
        p.push(Box::new(Recorder {
            name: "b",
            log: log.clone(),
        }));
        assert_eq!(p.stage_names(), vec!["a", "b", "terminal"]);
        let m = mem();
        let mut req = Request::new_for_test(&m, RequestKind::Flush, 0, vec![]);
        assert_eq!(p.run(&mut req).expect("run"), Status::Ok);
        let got = log.lock().expect("log").clone();
        assert_eq!(
            got,
            vec!["a:before", "b:before", "terminal", "b:after", "a:after"]
        );
    }

    #[test]
    fn a_stage_can_answer_without_the_terminal() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut p = Pipeline::new(Box::new(CountingTerminal { log: log.clone() }));
        p.push(Box::new(ShortCircuit));
        let m = mem();
        let seg = Segment {
            addr: GuestAddress(0x1000),
            len: 512,
        };
        let mut req = Request::new_for_test(&m, RequestKind::Read, 7, vec![seg]);
        assert_eq!(p.run(&mut req).expect("run"), Status::Ok);
        assert!(log.lock().expect("log").is_empty());
        let mut buf = [0u8; 512];
        m.read_slice(&mut buf, GuestAddress(0x1000)).expect("read");
        assert!(buf.iter().all(|&b| b == 0xab));
        let mut req = Request::new_for_test(&m, RequestKind::Read, 8, vec![seg]);
        assert_eq!(p.run(&mut req).expect("run"), Status::Ok);
        assert_eq!(log.lock().expect("log").len(), 1);
    }

    #[test]
    fn status_bytes_match_the_spec() {
        assert_eq!(Status::Ok.as_u8(), 0);
        assert_eq!(Status::IoErr.as_u8(), 1);
        assert_eq!(Status::Unsupp.as_u8(), 2);
    }
}
