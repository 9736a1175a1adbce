//! Copies without a user buffer (Sky §3.5, §8): `copy_file_range`, `sendfile` and `splice`.
//!
//! coreutils 9 `cp` copies with `copy_file_range`: no buffer passes through user space, so no
//! read or write syscall carries checksums, the source's block reads match nothing and the
//! destination's block writes would be metadata (unique, for a deduplicating stage). Instead:
//!
//! 1. At the call's entry the engine takes the source path and byte range (the offset behind
//!    the pointer argument, captured by the plugin, or the fd's position; the whole file when
//!    the pointer's value is not known) and the destination from the fd tables; a
//!    [`FileBlocks`] resolver maps the source range to disk byte ranges, outside the lock.
//! 2. Those ranges are *active copy sources* while the call runs and for `read_window` after
//!    it returned. A block read inside one is data of the source file with the copy pattern,
//!    and each of its 4 KiB chunks is indexed as an expected write of the destination (pattern
//!    copy), so the destination's writeback, maybe 30 s later, matches as copied data.
//! 3. Block reads that came before the entry was known (the trace thread holds records back
//!    20 ms) and are still waiting for a read syscall are given the hint retroactively: their
//!    log records change and their chunks are expected in the destination; the requests
//!    themselves already went by.
//!
//! Chunks of the copied range whose content the engine already knows (written or read by a
//! monitored process recently) are expected in the destination at once, whether or not their
//! block reads come (a source in the page cache is not read from the disk); without disk
//! ranges (no resolver, file not found), a block read of such content is hinted all the same.

use super::*;
use crate::blocks::WHOLE_FILE;

pub(super) const SENDFILE: u64 = 40;
pub(super) const MOUNT: u64 = 165;
pub(super) const UMOUNT2: u64 = 166;
pub(super) const SPLICE: u64 = 275;
pub(super) const COPY_FILE_RANGE: u64 = 326;

/// Most copies followed at once (oldest dropped first).
const MAX_CALLS: usize = 1024;
/// Most disk ranges of all followed copies, and of one copy.
const MAX_RANGES: usize = 1 << 16;
const MAX_RANGES_PER_CALL: usize = 4096;
/// How long a copy whose return is never seen stays active.
const IN_FLIGHT_NS: u64 = 600_000_000_000;
/// Largest disk range taken from a resolver (a guard against garbage).
const MAX_RANGE_BYTES: u64 = 1 << 40;

const MS_REMOUNT: u64 = 32;
const MS_BIND: u64 = 4096;
const MS_MOVE: u64 = 8192;

/// Whether `nr` is a copy without a user buffer.
pub(super) fn is_copy(nr: u64) -> bool {
    matches!(nr, COPY_FILE_RANGE | SENDFILE | SPLICE)
}

/// What must be done outside the engine's lock after a completed call.
pub(crate) enum Followup {
    /// A copy that was not registered at its entry: resolve its source and register it.
    Copy(CopyReq),
    /// A mount or unmount for the resolver.
    Mount {
        source: String,
        target: String,
    },
    Umount {
        target: String,
    },
}

/// A copy call as the fd tables describe it, to be resolved to disk ranges.
#[derive(Debug, Clone)]
pub(crate) struct CopyReq {
    /// (tid, entry timestamp): the call.
    key: (u32, u64),
    pid: u32,
    /// Source path.
    pub src: Arc<str>,
    /// First source byte.
    pub off: u64,
    /// Bytes asked for ([`WHOLE_FILE`]: the offset is not known, the whole file).
    pub len: u64,
    dst: Option<Arc<str>>,
    /// Destination offset of `off`, when known.
    dst_start: Option<u64>,
    /// Bytes copied, when the call has already returned.
    done: Option<u64>,
}

/// A followed copy.
#[derive(Debug, Clone)]
struct CopyCall {
    key: (u32, u64),
    pid: u32,
    src: Arc<str>,
    /// Source bytes copied (`end` is `u64::MAX` while unknown).
    src_start: u64,
    src_end: u64,
    /// The source offset was not known: the whole file.
    whole: bool,
    dst: Option<Arc<str>>,
    dst_start: Option<u64>,
    src_class: u8,
    dst_class: u8,
    ranges: Vec<DiskRange>,
    /// Counted in the copy counters (the call returned bytes).
    counted: bool,
    expires: u64,
}

impl CopyCall {
    /// The source chunk at file offset `fo`, as a block read of it is classified.
    fn src_meta(&self, fo: u64, now: u64) -> ChunkMeta {
        ChunkMeta {
            pid: self.pid,
            file: Some(self.src.clone()),
            inode: 0,
            offset: fo,
            size_class: self.src_class,
            pattern: Some(Pattern::Copy),
            app_class: None,
            at: now,
            copied: false,
            by_page: false,
            unknown: false,
        }
    }

    /// The destination chunk the source chunk at `fo` becomes, if the copy writes it whole at
    /// a 4 KiB boundary.
    fn dst_meta(&self, fo: u64, now: u64) -> Option<ChunkMeta> {
        if fo < self.src_start || fo >= self.src_end {
            return None;
        }
        let offset = match self.dst_start {
            Some(d) => d.checked_add(fo - self.src_start)?,
            // Unknown destination position: as cp does, the source's.
            None => fo,
        };
        (offset % CHUNK == 0).then(|| ChunkMeta {
            pid: self.pid,
            file: self.dst.clone(),
            inode: 0,
            offset,
            size_class: self.dst_class,
            pattern: Some(Pattern::Copy),
            app_class: None,
            at: now,
            copied: true,
            by_page: false,
            unknown: false,
        })
    }
}

/// The followed copies and their disk ranges.
#[derive(Debug, Default)]
pub(super) struct Copies {
    calls: BTreeMap<u64, CopyCall>,
    by_key: HashMap<(u32, u64), u64>,
    by_src: HashMap<Arc<str>, Vec<u64>>,
    /// (disk, first byte, call) → (end byte, file offset of the first byte).
    ranges: BTreeMap<(u32, u64, u64), (u64, u64)>,
    /// Longest range in `ranges` (bounds the position queries).
    max_len: u64,
    next_id: u64,
    /// Earliest expiry of a call (`u64::MAX`: none).
    next_expiry: u64,
}

/// The u64 behind offset-pointer argument `arg`, if the plugin captured it.
fn captured(e: &EntryEvent, arg: u8) -> Option<u64> {
    e.arg_data(arg)
        .filter(|d| !d.fault)
        .and_then(|d| d.bytes.as_slice().try_into().ok())
        .map(u64::from_le_bytes)
}

/// Keeps the well-formed ranges, clipped to the file bytes `[lo, hi)`.
fn clip(ranges: Vec<DiskRange>, lo: u64, hi: u64) -> Vec<DiskRange> {
    ranges
        .into_iter()
        .filter(|r| r.bytes.start < r.bytes.end && r.bytes.end - r.bytes.start <= MAX_RANGE_BYTES)
        .filter_map(|r| {
            let len = r.bytes.end - r.bytes.start;
            let fend = r.file_offset.checked_add(len)?;
            let s = r.file_offset.max(lo);
            let e = fend.min(hi);
            (s < e).then(|| DiskRange {
                disk: r.disk,
                bytes: r.bytes.start + (s - r.file_offset)..r.bytes.start + (e - r.file_offset),
                file_offset: s,
            })
        })
        .take(MAX_RANGES_PER_CALL)
        .collect()
}

fn align_down(x: u64) -> u64 {
    x / CHUNK * CHUNK
}

fn align_up(x: u64) -> u64 {
    x.checked_next_multiple_of(CHUNK).unwrap_or(u64::MAX)
}

impl Engine {
    /// The copy call `e` at its entry (`done` = `None`) or, when it was not registered then,
    /// at its completion (`done` = bytes copied): who copies which bytes of which file where,
    /// from the fd tables. `None` if it is not followed (source not opened by path, sendfile
    /// to a socket, not selected by `--insight-paths`).
    pub(crate) fn copy_request(&mut self, e: &EntryEvent, done: Option<u64>) -> Option<CopyReq> {
        let a = e.args;
        // (source fd, its offset pointer and argument, destination fd, pointer, argument, len)
        let (fd_in, p_in, arg_in, fd_out, p_out, arg_out, len) = match e.nr {
            COPY_FILE_RANGE | SPLICE => (a[0], a[1], 1, a[2], a[3], 3, a[4]),
            // sendfile writes at the out fd's position.
            SENDFILE => (a[1], a[2], 2, a[0], 0, 0, a[3]),
            _ => return None,
        };
        let proc = self.procs.get(&e.tgid)?;
        let src_fd = proc.fds.get(&(fd_in as u32))?;
        let src = src_fd.path.clone()?;
        let dst_fd = proc.fds.get(&(fd_out as u32));
        let dst = dst_fd.and_then(|f| f.path.clone());
        if dst.is_none() && e.nr == SENDFILE {
            return None; // most likely a socket: not a file copy
        }
        // Selected by --insight-paths (all when empty): the source or the destination.
        if !(self.cfg.selects(&src) || dst.as_deref().is_some_and(|d| self.cfg.selects(d))) {
            return None;
        }
        let (off, len) = if p_in == 0 {
            (src_fd.offset, len)
        } else {
            match captured(e, arg_in) {
                Some(o) => (o, len),
                None => (0, WHOLE_FILE),
            }
        };
        let len = match done {
            Some(n) if len != WHOLE_FILE => n,
            _ => len,
        };
        let dst_start = if p_out == 0 {
            dst_fd.map(|f| f.offset)
        } else {
            captured(e, arg_out)
        };
        Some(CopyReq {
            key: (e.tid, e.ts_ns),
            pid: e.tgid,
            src,
            off,
            len,
            dst,
            dst_start,
            done,
        })
    }

    /// Registers a copy with the disk ranges of its source (from the resolver; anything it
    /// returns is clipped and bounded, a wrong range only mis-hints reads).
    pub(crate) fn copy_begin(&mut self, req: CopyReq, ranges: Vec<DiskRange>) {
        if self.copies.by_key.contains_key(&req.key) {
            return;
        }
        let now = self.now();
        let whole = req.len == WHOLE_FILE;
        let src_start = if whole { 0 } else { req.off };
        let src_end = if whole {
            u64::MAX
        } else {
            req.off.saturating_add(req.len)
        };
        let ranges = clip(ranges, align_down(src_start), align_up(src_end));
        let mapped_end = ranges
            .iter()
            .map(|r| r.file_offset + (r.bytes.end - r.bytes.start))
            .max()
            .unwrap_or(0);
        let copied_end = req.done.map_or(0, |n| src_start.saturating_add(n));
        let src_size = self
            .file_size(Some(&req.src))
            .unwrap_or(0)
            .max(mapped_end.min(src_end))
            .max(copied_end);
        let dst_size = self.file_size(req.dst.as_ref()).unwrap_or(0).max(src_size);
        let id = self.copies.next_id;
        self.copies.next_id += 1;
        let call = CopyCall {
            key: req.key,
            pid: req.pid,
            src: req.src.clone(),
            src_start,
            src_end,
            whole,
            dst: req.dst,
            dst_start: req.dst_start,
            src_class: self.cfg.size_classes.class_of(src_size),
            dst_class: self.cfg.size_classes.class_of(dst_size),
            ranges,
            counted: false,
            expires: now.saturating_add(IN_FLIGHT_NS),
        };
        self.copies.by_key.insert(req.key, id);
        self.copies.by_src.entry(req.src).or_default().push(id);
        for r in &call.ranges {
            self.copies
                .ranges
                .insert((r.disk, r.bytes.start, id), (r.bytes.end, r.file_offset));
            self.copies.max_len = self.copies.max_len.max(r.bytes.end - r.bytes.start);
        }
        self.copies.calls.insert(id, call);
        if req.done.is_some() {
            self.copy_returned(id, req.done);
        }
        self.copies.next_expiry = self
            .copies
            .next_expiry
            .min(self.copies.calls.get(&id).map_or(u64::MAX, |c| c.expires));
        while self.copies.calls.len() > MAX_CALLS || self.copies.ranges.len() > MAX_RANGES {
            let Some(&oldest) = self.copies.calls.keys().next() else {
                break;
            };
            self.remove_copy(oldest);
        }
        if self.copies.calls.contains_key(&id) {
            self.copy_expect_known(id, now);
            self.copy_retro(id, now);
        }
    }

    /// Expects in the destination every chunk of the copied range whose content is known
    /// (written or read by a monitored process recently): its block reads may have gone by
    /// before the copy was known, or never come (a source in the page cache).
    fn copy_expect_known(&mut self, id: u64, now: u64) {
        let Some(call) = self.copies.calls.get(&id) else {
            return;
        };
        let Some(t) = self.known_at.get(&call.src) else {
            return;
        };
        let expected: Vec<(u64, ChunkMeta)> = t
            .range(call.src_start..call.src_end)
            .filter_map(|(&fo, &sum)| call.dst_meta(fo, now).map(|d| (sum, d)))
            .collect();
        for (sum, d) in expected {
            self.expect_copy(sum, d);
        }
    }

    /// Indexes `d` as an expected write of chunk `sum`, unless exactly that is expected
    /// already (the source's chunk read twice, or known and read).
    fn expect_copy(&mut self, sum: u64, d: ChunkMeta) {
        let dup = self.writes.get(&sum).is_some_and(|ix| {
            ix.meta.copied && ix.meta.file == d.file && ix.meta.offset == d.offset
        });
        if !dup {
            self.index_write(sum, d);
            self.counters.copy_expected_chunks += 1;
        }
    }

    /// The copy `id` returned `done` bytes (`None`: nothing or an error): it stays active for
    /// the read window after now, over the bytes it copied; a copy that copied nothing ends.
    fn copy_returned(&mut self, id: u64, done: Option<u64>) {
        let Some(n) = done.filter(|n| *n > 0) else {
            self.remove_copy(id);
            return;
        };
        let now = self.now();
        let window = self.cfg.read_window.as_nanos() as u64;
        let Some(mut call) = self.copies.calls.remove(&id) else {
            return;
        };
        if !call.whole {
            call.src_end = call.src_start.saturating_add(n);
            let hi = align_up(call.src_end);
            for r in &call.ranges {
                self.copies.ranges.remove(&(r.disk, r.bytes.start, id));
            }
            call.ranges = clip(std::mem::take(&mut call.ranges), 0, hi);
            for r in &call.ranges {
                self.copies
                    .ranges
                    .insert((r.disk, r.bytes.start, id), (r.bytes.end, r.file_offset));
            }
        }
        if !call.counted {
            call.counted = true;
            self.counters.copy_calls += 1;
            if call.ranges.is_empty() {
                self.counters.copy_ranges_unmapped += 1;
            } else {
                self.counters.copy_ranges_mapped += 1;
            }
        }
        call.expires = now.saturating_add(window);
        self.copies.next_expiry = self.copies.next_expiry.min(call.expires);
        self.copies.calls.insert(id, call);
    }

    fn remove_copy(&mut self, id: u64) {
        let Some(call) = self.copies.calls.remove(&id) else {
            return;
        };
        self.copies.by_key.remove(&call.key);
        if let Some(v) = self.copies.by_src.get_mut(&call.src) {
            v.retain(|&x| x != id);
            if v.is_empty() {
                self.copies.by_src.remove(&call.src);
            }
        }
        for r in &call.ranges {
            self.copies.ranges.remove(&(r.disk, r.bytes.start, id));
        }
    }

    /// Ends the copies whose window has passed.
    pub(super) fn expire_copies(&mut self, now: u64) {
        if now < self.copies.next_expiry {
            return;
        }
        let due: Vec<u64> = self
            .copies
            .calls
            .iter()
            .filter(|(_, c)| c.expires <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in due {
            self.remove_copy(id);
        }
        self.copies.next_expiry = self
            .copies
            .calls
            .values()
            .map(|c| c.expires)
            .min()
            .unwrap_or(u64::MAX);
        self.copies.max_len = self
            .copies
            .ranges
            .iter()
            .map(|(k, v)| v.0 - k.1)
            .max()
            .unwrap_or(0);
    }

    /// The active copy range holding disk bytes `[start, end)`: (call, file offset of start).
    fn copy_at(&self, disk: u32, start: u64, end: u64) -> Option<(u64, u64)> {
        let lo = start.saturating_sub(self.copies.max_len);
        self.copies
            .ranges
            .range((disk, lo, 0)..=(disk, start, u64::MAX))
            .rev()
            .find(|(_, v)| v.0 >= end)
            .map(|(k, v)| (k.2, v.1 + (start - k.1)))
    }

    /// The active copy of `file` whose source bytes hold file offset `fo`.
    fn copy_of_file(&self, file: &Arc<str>, fo: u64) -> Option<u64> {
        self.copies
            .by_src
            .get(file)?
            .iter()
            .rev()
            .copied()
            .find(|id| {
                self.copies
                    .calls
                    .get(id)
                    .is_some_and(|c| c.src_start <= fo && fo < c.src_end)
            })
    }

    /// Gives the chunks of a block read of `len` bytes at disk byte `offset` that are data of
    /// an active copy's source the copy pattern (unmatched chunks inside a copy's disk range
    /// become data of the source file; chunks already known as data of the source keep their
    /// match), and indexes each as an expected write of the destination. True if any did.
    pub(super) fn copy_hint_read(
        &mut self,
        disk: u32,
        offset: u64,
        len: u64,
        chunks: &mut [(u64, Option<ChunkMeta>)],
        now: u64,
    ) -> bool {
        if self.copies.calls.is_empty() {
            return false;
        }
        let mut expected = Vec::new();
        let mut hinted = false;
        for (i, (sum, m)) in chunks.iter_mut().enumerate() {
            let start = offset.saturating_add(i as u64 * CHUNK);
            let clen = (len - i as u64 * CHUNK).min(CHUNK);
            let hit = match self.copy_at(disk, start, start.saturating_add(clen)) {
                Some(h) => Some(h),
                None => m.as_ref().and_then(|k| {
                    let f = k.file.as_ref()?;
                    self.copy_of_file(f, k.offset).map(|id| (id, k.offset))
                }),
            };
            let Some((id, fo)) = hit else { continue };
            let Some(call) = self.copies.calls.get(&id) else {
                continue;
            };
            match m {
                None => *m = Some(call.src_meta(fo, now)),
                Some(k) if k.pattern.is_none() => k.pattern = Some(Pattern::Copy),
                Some(_) => {}
            }
            hinted = true;
            if clen == CHUNK {
                if let Some(d) = call.dst_meta(fo, now) {
                    expected.push((*sum, d));
                }
            }
        }
        for (sum, d) in expected {
            self.expect_copy(sum, d);
        }
        hinted
    }

    /// Gives the hint to block reads of copy `id`'s ranges that went by before the copy was
    /// known and still wait for a read syscall: their records (log, counters) and their
    /// chunks as expected writes of the destination.
    fn copy_retro(&mut self, id: u64, now: u64) {
        let Some(call) = self.copies.calls.get(&id) else {
            return;
        };
        let ranges = call.ranges.clone();
        for r in ranges {
            let lo = r.bytes.start.saturating_sub(self.pending_read_max);
            let ids: Vec<u64> = self
                .pending_reads
                .range((r.disk, lo, 0)..(r.disk, r.bytes.end, 0))
                .map(|k| k.2)
                .collect();
            for pid in ids {
                let mut expected = Vec::new();
                let mut changed = false;
                let Some(call) = self.copies.calls.get(&id) else {
                    return;
                };
                let Some(p) = self.pending.get_mut(&pid).filter(|p| !p.write) else {
                    continue;
                };
                let (off, len) = (p.record.offset, p.record.len);
                for (i, (sum, m)) in p.chunks.iter_mut().enumerate() {
                    let start = off.saturating_add(i as u64 * CHUNK);
                    let clen = len.saturating_sub(i as u64 * CHUNK).min(CHUNK);
                    if m.is_some() || start < r.bytes.start || start + clen > r.bytes.end {
                        continue;
                    }
                    let fo = r.file_offset + (start - r.bytes.start);
                    *m = Some(call.src_meta(fo, now));
                    changed = true;
                    if clen == CHUNK {
                        if let Some(d) = call.dst_meta(fo, now) {
                            expected.push((*sum, d));
                        }
                    }
                }
                let all = p.chunks.iter().all(|c| c.1.is_some());
                if changed {
                    self.counters.copy_reads_late += 1;
                }
                if all {
                    self.finish_pending(pid);
                }
                for (sum, d) in expected {
                    self.expect_copy(sum, d);
                }
            }
        }
    }

    /// A copy returned: the fd positions and sizes move as the kernel moved them, and the
    /// followed copy keeps the bytes it copied for the read window. A copy that was not
    /// registered at its entry is returned for registration now.
    pub(super) fn on_copy_complete(&mut self, c: &Completed) -> Option<Followup> {
        let e = &c.entry;
        let key = (e.tid, e.ts_ns);
        let n = c.ret().filter(|r| *r > 0).map(|r| r as u64);
        let late = match self.copies.by_key.get(&key) {
            Some(&id) => {
                self.copy_returned(id, n);
                None
            }
            None => n.and_then(|n| self.copy_request(e, Some(n))),
        };
        if let Some(n) = n {
            self.copy_advance(e, n);
        }
        late.map(Followup::Copy)
    }

    /// After a copy of `n` bytes: a NULL offset pointer means the fd's position moved (for
    /// sendfile's destination always); the destination may have grown.
    fn copy_advance(&mut self, e: &EntryEvent, n: u64) {
        let a = e.args;
        let (fd_in, p_in, fd_out, p_out) = match e.nr {
            COPY_FILE_RANGE | SPLICE => (a[0], a[1], a[2], a[3]),
            SENDFILE => (a[1], a[2], a[0], 0),
            _ => return,
        };
        let out_at = if p_out == 0 { None } else { captured(e, 3) };
        let Some(p) = self.procs.get_mut(&e.tgid) else {
            return;
        };
        if p_in == 0 {
            if let Some(f) = p.fds.get_mut(&(fd_in as u32)) {
                f.offset = f.offset.saturating_add(n);
                f.highest = f.highest.max(f.offset);
            }
        }
        let mut grow = None;
        if let Some(f) = p.fds.get_mut(&(fd_out as u32)) {
            let start = if p_out == 0 {
                let s = f.offset;
                f.offset = s.saturating_add(n);
                Some(s)
            } else {
                out_at
            };
            if let Some(s) = start {
                let end = s.saturating_add(n);
                f.highest = f.highest.max(end);
                grow = Some((f.path.clone(), end));
            }
        }
        if let Some((path, end)) = grow {
            let s = self.file_size(path.as_ref()).unwrap_or(0).max(end);
            self.set_size(path.as_ref(), s);
        }
    }

    /// A completed mount or umount2: for the resolver (guest paths to disks).
    pub(super) fn on_mount(&mut self, c: &Completed) -> Option<Followup> {
        let e = &c.entry;
        if c.ret() != Some(0) {
            return None;
        }
        if e.nr == MOUNT {
            if e.args[3] & (MS_REMOUNT | MS_BIND | MS_MOVE) != 0 {
                return None;
            }
            let source = String::from_utf8_lossy(&path_arg(e, 0)?.bytes).into_owned();
            let target = self.resolve(e.tgid, None, &path_arg(e, 1)?.bytes);
            Some(Followup::Mount { source, target })
        } else {
            let target = self.resolve(e.tgid, None, &path_arg(e, 0)?.bytes);
            Some(Followup::Umount { target })
        }
    }
}
