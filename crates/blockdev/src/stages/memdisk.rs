//! An in-memory [`Terminal`] for stage tests: a byte vector that executes reads, writes,
//! discards and write-zeroes (both zero the range, like a punched hole) and counts requests.

use crate::pipeline::{StageError, Status, Terminal};
use crate::request::{Request, RequestKind};

/// A disk in a `Vec<u8>`.
#[derive(Debug, Clone)]
pub(crate) struct MemDisk {
    pub(crate) data: Vec<u8>,
    pub(crate) reads: u64,
    pub(crate) writes: u64,
    pub(crate) flushes: u64,
    /// Fail every write and flush (to test error paths).
    pub(crate) fail_writes: bool,
    /// Requests seen, in order: (kind, byte offset, len).
    pub(crate) log: Vec<(RequestKind, u64, u64)>,
}

impl MemDisk {
    pub(crate) fn new(len: usize) -> Self {
        Self {
            data: vec![0; len],
            reads: 0,
            writes: 0,
            flushes: 0,
            fail_writes: false,
            log: Vec::new(),
        }
    }
}

impl Terminal for MemDisk {
    fn name(&self) -> &str {
        "mem-disk"
    }

    fn execute(&mut self, req: &mut Request) -> Result<Status, StageError> {
        self.log.push((req.kind, req.offset(), req.len));
        let range = |off: u64, len: u64| off as usize..(off + len) as usize;
        match req.kind {
            RequestKind::Read => {
                self.reads += 1;
                let r = range(req.offset(), req.len);
                let src = self.data.get(r).ok_or(StageError::Stage {
                    stage: "mem-disk".into(),
                    reason: "read beyond the disk".into(),
                })?;
                req.write_data(0, src)?;
            }
            RequestKind::Write => {
                self.writes += 1;
                if self.fail_writes {
                    return Ok(Status::IoErr);
                }
                let r = range(req.offset(), req.len);
                let dst = self.data.get_mut(r).ok_or(StageError::Stage {
                    stage: "mem-disk".into(),
                    reason: "write beyond the disk".into(),
                })?;
                req.read_data(0, dst)?;
            }
            RequestKind::Flush => {
                self.flushes += 1;
                if self.fail_writes {
                    return Ok(Status::IoErr);
                }
            }
            RequestKind::Discard | RequestKind::WriteZeroes => {
                for sr in &req.ranges {
                    if let Some(d) = self.data.get_mut(range(sr.offset(), sr.bytes())) {
                        d.fill(0);
                    }
                }
            }
            RequestKind::GetId => return Ok(Status::Unsupp),
        }
        Ok(Status::Ok)
    }
}
