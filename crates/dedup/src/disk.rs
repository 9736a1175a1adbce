//! The volume's two files and the modelled device under them.
//!
//! Data chunks and metadata pages are charged to one [`ModelClock`] as if both files lay on
//! one disk, the data file first and the metadata file after it (one address space, so a
//! metadata access after a data access is a seek on the HDD model): the unhinted system pays
//! its random index I/O as dm-dedup on a single disk does.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use vmsight_blockdev::stages::{DiskModelConfig, ModelClock};
use vmsight_blockdev::RequestKind;

use crate::error::{DedupError, Result};
use crate::format::{Geometry, BLOCK};

/// Host I/O counters of the two files.
#[derive(Debug, Default, Clone, Copy)]
pub struct DiskCounters {
    /// Metadata pages read from the metadata file.
    pub meta_reads: u64,
    /// Metadata pages written (journal and in place).
    pub meta_writes: u64,
    /// Data chunks read / written.
    pub data_reads: u64,
    pub data_writes: u64,
    /// fdatasync calls.
    pub syncs: u64,
}

/// The data file, the metadata file and the modelled disk.
pub struct Disk {
    dir: PathBuf,
    data: File,
    meta: File,
    meta_base: u64,
    clock: ModelClock,
    pub counters: DiskCounters,
}

impl Disk {
    /// Wraps opened files of a volume with `geo`, modelled as `model`.
    pub fn new(dir: &Path, data: File, meta: File, geo: &Geometry, model: DiskModelConfig) -> Self {
        let meta_base = geo.data_bytes();
        Self {
            dir: dir.to_owned(),
            data,
            meta,
            meta_base,
            clock: ModelClock::new(model, meta_base + geo.meta_bytes()),
            counters: DiskCounters::default(),
        }
    }

    /// The volume directory (for error messages).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The modelled disk.
    pub fn clock(&mut self) -> &mut ModelClock {
        &mut self.clock
    }

    fn err(&self, op: String, source: std::io::Error) -> DedupError {
        DedupError::Io {
            path: self.dir.clone(),
            op,
            source,
        }
    }

    /// Reads metadata page `page`.
    pub fn read_meta(&mut self, page: u64, buf: &mut [u8]) -> Result<()> {
        let off = page * BLOCK;
        self.meta
            .read_exact_at(buf, off)
            .map_err(|e| self.err(format!("reading metadata page {page}"), e))?;
        self.counters.meta_reads += 1;
        self.clock
            .charge(RequestKind::Read, self.meta_base + off, buf.len() as u64);
        Ok(())
    }

    /// Writes `buf` (whole pages) at metadata page `page`.
    pub fn write_meta(&mut self, page: u64, buf: &[u8]) -> Result<()> {
        let off = page * BLOCK;
        self.meta
            .write_all_at(buf, off)
            .map_err(|e| self.err(format!("writing metadata page {page}"), e))?;
        self.counters.meta_writes += buf.len() as u64 / BLOCK;
        self.clock
            .charge(RequestKind::Write, self.meta_base + off, buf.len() as u64);
        Ok(())
    }

    /// Reads whole chunks starting at chunk `pba`.
    pub fn read_data(&mut self, pba: u64, buf: &mut [u8]) -> Result<()> {
        let off = pba * BLOCK;
        self.data
            .read_exact_at(buf, off)
            .map_err(|e| self.err(format!("reading data chunk {pba}"), e))?;
        self.counters.data_reads += buf.len() as u64 / BLOCK;
        self.clock.charge(RequestKind::Read, off, buf.len() as u64);
        Ok(())
    }

    /// Writes whole chunks starting at chunk `pba`.
    pub fn write_data(&mut self, pba: u64, buf: &[u8]) -> Result<()> {
        let off = pba * BLOCK;
        self.data
            .write_all_at(buf, off)
            .map_err(|e| self.err(format!("writing data chunk {pba}"), e))?;
        self.counters.data_writes += buf.len() as u64 / BLOCK;
        self.clock.charge(RequestKind::Write, off, buf.len() as u64);
        Ok(())
    }

    /// Makes written data chunks durable.
    pub fn sync_data(&mut self) -> Result<()> {
        self.counters.syncs += 1;
        self.data
            .sync_data()
            .map_err(|e| self.err("fdatasync of the data file".into(), e))
    }

    /// Makes written metadata pages durable.
    pub fn sync_meta(&mut self) -> Result<()> {
        self.counters.syncs += 1;
        self.meta
            .sync_data()
            .map_err(|e| self.err("fdatasync of the metadata file".into(), e))
    }
}
