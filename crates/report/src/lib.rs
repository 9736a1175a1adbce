//! `vmsight report`: summarises an insight log (`vmsight run --insights FILE`, JSON lines of
//! [`InsightRecord`]) as Sky §6 does: per-class totals, data and metadata written per file
//! system, and block lifetimes (§6.2) as a table and an SVG CDF plot.
//!
//! Malformed lines are counted and reported with the first one's line number; they are fatal
//! only when no line at all could be read.

pub mod lifetime;
pub mod svg;

use lifetime::{EndKind, Lifetimes, Percentiles, Tracker};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use vmsight_proto::insight::{BlockRecord, Content, InsightRecord};

/// Why a report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("cannot read the insight log {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the insight log {path} holds no records")]
    Empty { path: PathBuf },
    #[error("the insight log {path} holds no valid record: {count} malformed lines, the first at line {line}: {error}")]
    NothingParsed {
        path: PathBuf,
        count: u64,
        line: u64,
        error: String,
    },
    #[error("invalid file-system type '{0}': expected DISK=TYPE, e.g. 1=xfs")]
    BadFsSpec(String),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Parses `--fs DISK=TYPE` (e.g. `1=xfs`).
pub fn parse_fs_spec(s: &str) -> Result<(u32, String), ReportError> {
    let bad = || ReportError::BadFsSpec(s.to_string());
    let (disk, ty) = s.split_once('=').ok_or_else(bad)?;
    let disk: u32 = disk.trim().parse().map_err(|_| bad())?;
    let ty = ty.trim();
    if ty.is_empty() || !ty.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(bad());
    }
    Ok((disk, ty.to_string()))
}

/// Totals of requests and bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub requests: u64,
    pub bytes: u64,
    pub read_requests: u64,
    pub read_bytes: u64,
    pub write_requests: u64,
    pub write_bytes: u64,
    pub discard_requests: u64,
    pub discard_bytes: u64,
    /// Bytes of read and write requests classified as data / metadata / mixed / unknown
    /// (pages the guest kernel does not place: `O_DIRECT` buffers, unreadable pages).
    pub data_bytes: u64,
    pub metadata_bytes: u64,
    pub mixed_bytes: u64,
    pub unknown_bytes: u64,
    /// Requests that carried an application hint (libvmsight / shim).
    pub app_hinted_requests: u64,
}

#[derive(Clone, Copy)]
enum Op {
    Read,
    Write,
    Discard,
}

impl Totals {
    fn add(&mut self, op: Op, r: &BlockRecord) {
        self.requests += 1;
        self.bytes += r.len;
        match op {
            Op::Read => {
                self.read_requests += 1;
                self.read_bytes += r.len;
            }
            Op::Write => {
                self.write_requests += 1;
                self.write_bytes += r.len;
            }
            Op::Discard => {
                self.discard_requests += 1;
                self.discard_bytes += r.len;
                return;
            }
        }
        match r.insight.content {
            Content::Data => self.data_bytes += r.len,
            Content::Metadata => self.metadata_bytes += r.len,
            Content::Mixed => self.mixed_bytes += r.len,
            Content::Unknown => self.unknown_bytes += r.len,
        }
        if r.insight.app_class.is_some() {
            self.app_hinted_requests += 1;
        }
    }
}

/// Writes to one disk (one guest file system, when the disk holds one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FsTotals {
    pub disk: u32,
    /// File-system type, from the records' `fs` field or `--fs DISK=TYPE`.
    pub fs: Option<String>,
    pub write_requests: u64,
    pub metadata_write_bytes: u64,
    pub data_write_bytes: u64,
    pub mixed_write_bytes: u64,
    pub unknown_write_bytes: u64,
    /// Part of the metadata written to the file system's journal.
    pub journal_write_bytes: u64,
}

/// Lines the report skipped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Malformed {
    pub count: u64,
    pub first_line: Option<u64>,
    pub first_error: Option<String>,
}

/// Lifetime statistics for the JSON output and the table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LifetimeSummary {
    pub block_bytes: u64,
    pub born: u64,
    pub ended: BTreeMap<EndKind, u64>,
    pub alive: u64,
    /// Over all ended blocks, then per kind.
    pub all: Option<Percentiles>,
    pub by_kind: BTreeMap<EndKind, Percentiles>,
    /// Ages at the end of the log of the blocks still alive.
    pub alive_age: Option<Percentiles>,
    /// (limit in seconds, fraction of born blocks dead within it) at decades.
    pub cdf: Vec<(f64, f64)>,
    /// The same at 1-2-5 steps from 1 ms to 10 000 s (for plots).
    pub cdf_fine: Vec<(f64, f64)>,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub file: PathBuf,
    pub records: u64,
    pub malformed: Malformed,
    /// Time from the first to the last record.
    pub span_ns: u64,
    pub total: Totals,
    pub classes: BTreeMap<u8, Totals>,
    pub content: BTreeMap<&'static str, Totals>,
    pub filesystems: Vec<FsTotals>,
    pub unlinks: u64,
    pub truncates: u64,
    pub lifetimes: LifetimeSummary,
    /// Lifetimes as a block device alone would see them (Sky Fig 4's "naive" approach): a
    /// block dies only when it is overwritten; unlinks, truncates and discards are ignored.
    pub lifetimes_naive: LifetimeSummary,
    #[serde(skip)]
    pub raw_lifetimes: Lifetimes,
}

fn content_name(c: Content) -> &'static str {
    match c {
        Content::Data => "data",
        Content::Metadata => "metadata",
        Content::Mixed => "mixed",
        Content::Unknown => "unknown",
    }
}

/// How far out of time order the engine may log a record: a block request's record waits for
/// late syscall events (write grace 1 s, read window 4 s) while later ones are logged. Lifetimes
/// are followed in time order through a reorder buffer this wide.
const REORDER_WINDOW_NS: u64 = 10_000_000_000;

/// What the lifetime trackers learn from one record.
#[derive(Debug)]
enum LtEvent {
    Write {
        disk: u32,
        offset: u64,
        len: u64,
        data: bool,
        owner: Option<(Arc<str>, u64)>,
    },
    Discard {
        disk: u32,
        offset: u64,
        len: u64,
    },
    Unlink(String),
    Truncate(String, u64),
    Observe,
}

/// Sky's lifetimes and the naive ones (a block device alone: overwrites only).
#[derive(Default)]
struct LifetimeTrackers {
    sky: Tracker,
    naive: Tracker,
}

impl LifetimeTrackers {
    fn apply(&mut self, ts: u64, ev: LtEvent) {
        match ev {
            LtEvent::Write {
                disk,
                offset,
                len,
                data,
                owner,
            } => {
                let owner = owner.as_ref().map(|(f, o)| (f, *o));
                self.sky.write(ts, disk, offset, len, data, owner);
                self.naive.write(ts, disk, offset, len, data, None);
            }
            LtEvent::Discard { disk, offset, len } => {
                self.sky.discard(ts, disk, offset, len);
                self.naive.observe(ts);
            }
            LtEvent::Unlink(f) => {
                self.sky.unlink(ts, &f);
                self.naive.observe(ts);
            }
            LtEvent::Truncate(f, size) => {
                self.sky.truncate(ts, &f, size);
                self.naive.observe(ts);
            }
            LtEvent::Observe => {
                self.sky.observe(ts);
                self.naive.observe(ts);
            }
        }
    }
}

/// Lifetime events in time order: each waits until a record [`REORDER_WINDOW_NS`] newer was
/// read (log order is not time order, see there).
#[derive(Default)]
struct Reorder {
    heap: std::collections::BinaryHeap<std::cmp::Reverse<Timed>>,
    seq: u64,
    newest: u64,
}

/// An event ordered by (time, log order).
#[derive(Debug)]
struct Timed(u64, u64, LtEvent);

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        (self.0, self.1) == (o.0, o.1)
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.0, self.1).cmp(&(o.0, o.1))
    }
}

impl Reorder {
    fn push(&mut self, ts: u64, ev: LtEvent, lt: &mut LifetimeTrackers) {
        self.seq += 1;
        self.heap.push(std::cmp::Reverse(Timed(ts, self.seq, ev)));
        self.newest = self.newest.max(ts);
        let horizon = self.newest.saturating_sub(REORDER_WINDOW_NS);
        while self.heap.peek().is_some_and(|e| e.0 .0 < horizon) {
            if let Some(std::cmp::Reverse(Timed(ts, _, ev))) = self.heap.pop() {
                lt.apply(ts, ev);
            }
        }
    }

    fn drain(&mut self, lt: &mut LifetimeTrackers) {
        while let Some(std::cmp::Reverse(Timed(ts, _, ev))) = self.heap.pop() {
            lt.apply(ts, ev);
        }
    }
}

/// Decade limits of the CDF table, in seconds.
const CDF_LIMITS: [f64; 8] = [1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0];

/// Reads an insight log. `fs_types` names the file system of a disk (`--fs`); a record's own
/// `fs` field, when present, wins.
pub fn build(
    path: &Path,
    input: impl BufRead,
    fs_types: &BTreeMap<u32, String>,
) -> Result<Report, ReportError> {
    let mut malformed = Malformed::default();
    let mut records = 0u64;
    let mut total = Totals::default();
    let mut classes: BTreeMap<u8, Totals> = BTreeMap::new();
    let mut content: BTreeMap<&'static str, Totals> = BTreeMap::new();
    let mut fss: BTreeMap<u32, FsTotals> = BTreeMap::new();
    let mut record_fs: BTreeMap<u32, String> = BTreeMap::new();
    let mut lt = LifetimeTrackers::default();
    let mut order = Reorder::default();
    let (mut first_ts, mut last_ts) = (u64::MAX, 0u64);
    let (mut unlinks, mut truncates) = (0u64, 0u64);
    for (i, line) in input.lines().enumerate() {
        let line_no = i as u64 + 1;
        let line = line.map_err(|source| ReportError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<serde_json::Value>(&line).and_then(|v| {
            let fs = v.get("fs").and_then(|f| f.as_str()).map(str::to_string);
            serde_json::from_value::<InsightRecord>(v).map(|r| (r, fs))
        });
        let (rec, fs) = match parsed {
            Ok(x) => x,
            Err(e) => {
                malformed.count += 1;
                if malformed.first_line.is_none() {
                    malformed.first_line = Some(line_no);
                    malformed.first_error = Some(e.to_string());
                }
                continue;
            }
        };
        records += 1;
        let ts = match &rec {
            InsightRecord::Read(b) | InsightRecord::Write(b) | InsightRecord::Discard(b) => b.ts_ns,
            InsightRecord::Unlink(f) | InsightRecord::Truncate(f) => f.ts_ns,
        };
        first_ts = first_ts.min(ts);
        last_ts = last_ts.max(ts);
        let (op, b) = match &rec {
            InsightRecord::Read(b) => (Op::Read, b),
            InsightRecord::Write(b) => (Op::Write, b),
            InsightRecord::Discard(b) => (Op::Discard, b),
            InsightRecord::Unlink(f) => {
                unlinks += 1;
                order.push(f.ts_ns, LtEvent::Unlink(f.file.clone()), &mut lt);
                continue;
            }
            InsightRecord::Truncate(f) => {
                truncates += 1;
                order.push(f.ts_ns, LtEvent::Truncate(f.file.clone(), f.size), &mut lt);
                continue;
            }
        };
        if let (Some(fs), InsightRecord::Read(_) | InsightRecord::Write(_)) = (fs, &rec) {
            record_fs.insert(b.disk, fs);
        }
        total.add(op, b);
        classes.entry(b.insight.class).or_default().add(op, b);
        if !matches!(op, Op::Discard) {
            content
                .entry(content_name(b.insight.content))
                .or_default()
                .add(op, b);
        }
        match op {
            Op::Read => order.push(b.ts_ns, LtEvent::Observe, &mut lt),
            Op::Discard => order.push(
                b.ts_ns,
                LtEvent::Discard {
                    disk: b.disk,
                    offset: b.offset,
                    len: b.len,
                },
                &mut lt,
            ),
            Op::Write => {
                let f = fss.entry(b.disk).or_insert_with(|| FsTotals {
                    disk: b.disk,
                    ..FsTotals::default()
                });
                f.write_requests += 1;
                match b.insight.content {
                    Content::Data => f.data_write_bytes += b.len,
                    Content::Metadata => f.metadata_write_bytes += b.len,
                    Content::Mixed => f.mixed_write_bytes += b.len,
                    Content::Unknown => f.unknown_write_bytes += b.len,
                }
                if b.insight.journal {
                    f.journal_write_bytes += b.len;
                }
                let data = matches!(b.insight.content, Content::Data | Content::Mixed);
                let owner: Option<(Arc<str>, u64)> =
                    match (b.insight.content, &b.insight.file, b.insight.file_offset) {
                        (Content::Data, Some(file), Some(off)) => Some((Arc::clone(file), off)),
                        _ => None,
                    };
                order.push(
                    b.ts_ns,
                    LtEvent::Write {
                        disk: b.disk,
                        offset: b.offset,
                        len: b.len,
                        data,
                        owner,
                    },
                    &mut lt,
                );
            }
        }
    }
    if records == 0 {
        return Err(match malformed.first_line {
            Some(line) => ReportError::NothingParsed {
                path: path.to_path_buf(),
                count: malformed.count,
                line,
                error: malformed.first_error.unwrap_or_default(),
            },
            None => ReportError::Empty {
                path: path.to_path_buf(),
            },
        });
    }
    for (disk, f) in fss.iter_mut() {
        f.fs = record_fs.get(disk).or_else(|| fs_types.get(disk)).cloned();
    }
    order.drain(&mut lt);
    let lifetimes_naive = summarize(&lt.naive.finish());
    let lt = lt.sky.finish();
    let lifetimes = summarize(&lt);
    Ok(Report {
        file: path.to_path_buf(),
        records,
        malformed,
        span_ns: last_ts.saturating_sub(first_ts),
        total,
        classes,
        content,
        filesystems: fss.into_values().collect(),
        unlinks,
        truncates,
        lifetimes,
        lifetimes_naive,
        raw_lifetimes: lt,
    })
}

fn summarize(lt: &Lifetimes) -> LifetimeSummary {
    let mut ended = BTreeMap::new();
    let mut by_kind = BTreeMap::new();
    for k in EndKind::ALL {
        let d = lt.durations(Some(k));
        ended.insert(k, d.len() as u64);
        if let Some(p) = Percentiles::of(&d) {
            by_kind.insert(k, p);
        }
    }
    LifetimeSummary {
        block_bytes: lifetime::BLOCK,
        born: lt.born,
        ended,
        alive: lt.alive.len() as u64,
        all: Percentiles::of(&lt.durations(None)),
        by_kind,
        alive_age: Percentiles::of(&lt.alive),
        cdf: CDF_LIMITS
            .iter()
            .map(|s| (*s, lt.cdf_at((s * 1e9) as u64)))
            .collect(),
        cdf_fine: CDF_LIMITS
            .iter()
            .flat_map(|d| [1.0, 2.0, 5.0].map(|m| d * m))
            .take_while(|s| *s <= 10_000.0)
            .map(|s| (s, lt.cdf_at((s * 1e9) as u64)))
            .collect(),
    }
}

/// "1.5 MiB"-style sizes.
pub fn human_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// "12.3 ms"-style durations.
pub fn human_ns(ns: u64) -> String {
    let v = ns as f64;
    if ns < 1_000 {
        format!("{ns} ns")
    } else if ns < 1_000_000 {
        format!("{:.1} µs", v / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.1} ms", v / 1e6)
    } else if v < 60e9 * 10.0 {
        format!("{:.2} s", v / 1e9)
    } else {
        format!("{:.1} min", v / 60e9)
    }
}

fn totals_row(out: &mut String, label: &str, t: &Totals) {
    let _ = writeln!(
        out,
        "{label:<10} {:>9} {:>11} {:>9} {:>11} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11}",
        t.requests,
        human_bytes(t.bytes),
        t.read_requests,
        human_bytes(t.read_bytes),
        t.write_requests,
        human_bytes(t.write_bytes),
        human_bytes(t.data_bytes),
        human_bytes(t.metadata_bytes),
        human_bytes(t.mixed_bytes),
        human_bytes(t.unknown_bytes),
    );
}

fn pct_row(out: &mut String, label: &str, p: Option<&Percentiles>) {
    match p {
        Some(p) => {
            let _ = writeln!(
                out,
                "{label:<18} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                p.count,
                human_ns(p.min_ns),
                human_ns(p.p10_ns),
                human_ns(p.p50_ns),
                human_ns(p.p90_ns),
                human_ns(p.p99_ns),
                human_ns(p.max_ns)
            );
        }
        None => {
            let _ = writeln!(out, "{label:<18} {:>8}", 0);
        }
    }
}

impl Report {
    /// The human-readable report.
    pub fn text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "insight log {}: {} records over {}",
            self.file.display(),
            self.records,
            human_ns(self.span_ns)
        );
        if let (Some(line), Some(err)) = (self.malformed.first_line, &self.malformed.first_error) {
            let _ = writeln!(
                o,
                "warning: skipped {} malformed lines, the first at line {line}: {err}",
                self.malformed.count
            );
        }
        let header = format!(
            "{:<10} {:>9} {:>11} {:>9} {:>11} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
            "",
            "requests",
            "bytes",
            "reads",
            "read",
            "writes",
            "written",
            "data",
            "metadata",
            "mixed",
            "unknown"
        );
        let _ = writeln!(o, "\nPer class (5 = metadata, higher = more important):");
        o.push_str(&header);
        for (c, t) in &self.classes {
            totals_row(&mut o, &format!("class {c}"), t);
        }
        totals_row(&mut o, "total", &self.total);
        let _ = writeln!(o, "\nPer content:");
        o.push_str(&header);
        for (c, t) in &self.content {
            totals_row(&mut o, c, t);
        }
        if self.total.discard_requests > 0 {
            let _ = writeln!(
                o,
                "discards: {} requests, {}",
                self.total.discard_requests,
                human_bytes(self.total.discard_bytes)
            );
        }
        let _ = writeln!(
            o,
            "application-hinted requests: {}",
            self.total.app_hinted_requests
        );
        let _ = writeln!(o, "\nWrites per file system:");
        let _ = writeln!(
            o,
            "{:<5} {:<8} {:>9} {:>16} {:>12} {:>12} {:>12} {:>12} {:>9}",
            "disk",
            "fs",
            "writes",
            "metadata written",
            "(journal)",
            "data",
            "mixed",
            "unknown",
            "metadata%"
        );
        for f in &self.filesystems {
            let all = f.metadata_write_bytes
                + f.data_write_bytes
                + f.mixed_write_bytes
                + f.unknown_write_bytes;
            let pct = if all == 0 {
                0.0
            } else {
                100.0 * f.metadata_write_bytes as f64 / all as f64
            };
            let _ = writeln!(
                o,
                "{:<5} {:<8} {:>9} {:>16} {:>12} {:>12} {:>12} {:>12} {:>8.1}%",
                f.disk,
                f.fs.as_deref().unwrap_or("?"),
                f.write_requests,
                human_bytes(f.metadata_write_bytes),
                human_bytes(f.journal_write_bytes),
                human_bytes(f.data_write_bytes),
                human_bytes(f.mixed_write_bytes),
                human_bytes(f.unknown_write_bytes),
                pct
            );
        }
        let l = &self.lifetimes;
        let ended: Vec<String> = l
            .ended
            .iter()
            .map(|(k, n)| format!("{} {n}", k.name()))
            .collect();
        let _ = writeln!(
            o,
            "\nBlock lifetimes (4 KiB data blocks): {} born, {} ended ({}), {} still alive at the end; {} unlinks, {} truncates seen",
            l.born,
            l.ended.values().sum::<u64>(),
            ended.join(", "),
            l.alive,
            self.unlinks,
            self.truncates
        );
        let _ = writeln!(
            o,
            "{:<18} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "ended by", "blocks", "min", "p10", "p50", "p90", "p99", "max"
        );
        pct_row(&mut o, "any", l.all.as_ref());
        for k in EndKind::ALL {
            pct_row(&mut o, k.name(), l.by_kind.get(&k));
        }
        pct_row(&mut o, "alive (age at end)", l.alive_age.as_ref());
        let cdf: Vec<String> = l
            .cdf
            .iter()
            .map(|(s, f)| {
                let limit = if *s < 1.0 {
                    format!("{}ms", s * 1e3)
                } else {
                    format!("{s}s")
                };
                format!("≤{limit}: {f:.3}")
            })
            .collect();
        let _ = writeln!(
            o,
            "CDF (fraction of born blocks dead within): {}",
            cdf.join("  ")
        );
        o
    }

    /// The JSON report.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The SVG CDF plot of block lifetimes.
    pub fn svg(&self) -> String {
        svg::lifetime_cdf(&self.raw_lifetimes, &self.file.display().to_string())
    }
}

/// Reads FILE (or stdin for `-`) and builds the report.
pub fn build_from_path(
    path: &Path,
    fs_types: &BTreeMap<u32, String>,
) -> Result<Report, ReportError> {
    if path == Path::new("-") {
        let stdin = std::io::stdin();
        return build(path, stdin.lock(), fs_types);
    }
    let f = std::fs::File::open(path).map_err(|source| ReportError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    build(path, std::io::BufReader::new(f), fs_types)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[allow(clippy::too_many_arguments)] // One argument per record field keeps tests readable.
    fn rec(
        op: &str,
        ts: u64,
        disk: u32,
        off: u64,
        len: u64,
        content: &str,
        class: u8,
        file: Option<(&str, u64)>,
    ) -> String {
        let file = match file {
            Some((f, o)) => format!(",\"file\":\"{f}\",\"file_offset\":{o}"),
            None => String::new(),
        };
        format!(
            "{{\"op\":\"{op}\",\"ts_ns\":{ts},\"disk\":{disk},\"offset\":{off},\"len\":{len},\"class\":{class},\"content\":\"{content}\",\"size_class\":null,\"pattern\":null,\"app_class\":null,\"pid\":null,\"journal\":false{file}}}"
        )
    }

    fn report(text: &str) -> Result<Report, ReportError> {
        build(Path::new("t.jsonl"), text.as_bytes(), &BTreeMap::new())
    }

    #[test]
    fn totals_per_class_content_and_fs() {
        let log = [
            rec("write", S, 0, 0, 8192, "data", 2, Some(("/a", 0))),
            rec("write", S, 0, 1 << 20, 4096, "metadata", 5, None),
            rec("read", 2 * S, 0, 0, 4096, "data", 2, Some(("/a", 0))),
            rec("write", 3 * S, 1, 0, 4096, "mixed", 1, Some(("/b", 0))),
            "{\"op\":\"unlink\",\"ts_ns\":4000000000,\"file\":\"/a\",\"size\":0,\"pid\":7}"
                .to_string(),
        ]
        .join("\n");
        let mut fs = BTreeMap::new();
        fs.insert(1, "xfs".to_string());
        let r = build(Path::new("x"), log.as_bytes(), &fs).unwrap();
        assert_eq!(r.records, 5);
        assert_eq!(r.malformed.count, 0);
        assert_eq!(r.span_ns, 3 * S);
        assert_eq!(r.total.requests, 4);
        assert_eq!(r.total.write_bytes, 16384);
        assert_eq!(r.total.read_bytes, 4096);
        let c2 = &r.classes[&2];
        assert_eq!(
            (c2.requests, c2.read_requests, c2.write_bytes, c2.data_bytes),
            (2, 1, 8192, 12288)
        );
        assert_eq!(r.classes[&5].metadata_bytes, 4096);
        assert_eq!(r.content["mixed"].write_bytes, 4096);
        assert_eq!(r.filesystems.len(), 2);
        assert_eq!(r.filesystems[0].fs, None);
        assert_eq!(r.filesystems[0].metadata_write_bytes, 4096);
        assert_eq!(r.filesystems[0].data_write_bytes, 8192);
        assert_eq!(r.filesystems[1].fs.as_deref(), Some("xfs"));
        assert_eq!(r.unlinks, 1);
        // /a's two blocks died at the unlink after 3 s; /b's mixed block is alive.
        assert_eq!(r.lifetimes.born, 3);
        assert_eq!(r.lifetimes.ended[&EndKind::Unlink], 2);
        assert_eq!(r.lifetimes.by_kind[&EndKind::Unlink].p50_ns, 3 * S);
        assert_eq!(r.lifetimes.alive, 1);
        let text = r.text();
        assert!(text.contains("class 2"), "{text}");
        assert!(text.contains("xfs"), "{text}");
        // A block device alone (Sky Fig 4's naive approach) sees no unlink: all three alive.
        assert_eq!(r.lifetimes_naive.born, 3);
        assert_eq!(r.lifetimes_naive.alive, 3);
        assert!(r.lifetimes_naive.ended.values().all(|n| *n == 0));
        let json: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        assert_eq!(json["lifetimes"]["ended"]["unlink"], 2);
        assert_eq!(json["lifetimes_naive"]["alive"], 3);
        // The plot's CDF: 1-2-5 steps, 2 of 3 blocks dead within 5 s, none within 2 s.
        let fine = json["lifetimes"]["cdf_fine"].as_array().unwrap();
        assert_eq!(fine.len(), 22);
        let at = |s: f64| {
            fine.iter().find(|p| p[0] == s).unwrap()[1]
                .as_f64()
                .unwrap()
        };
        assert_eq!((at(2.0), at(5.0)), (0.0, 2.0 / 3.0));
        assert_eq!(json["classes"]["5"]["metadata_bytes"], 4096);
    }

    #[test]
    fn lifetimes_follow_time_order_not_log_order() {
        // The engine logs a write that waited for its grace after later records: here the
        // block written at 1 s is logged after its overwrite at 3 s. In time order it lived
        // 2 s; in log order it would be born after its death (a lifetime of 0) and live on.
        let log = [
            rec("write", 3 * S, 0, 0, 4096, "data", 2, Some(("/a", 0))),
            rec("write", S, 0, 0, 4096, "data", 2, Some(("/a", 0))),
            rec("read", 20 * S, 0, 1 << 20, 4096, "metadata", 5, None),
        ]
        .join("\n");
        let r = report(&log).unwrap();
        assert_eq!(r.lifetimes.born, 2);
        assert_eq!(r.lifetimes.ended[&EndKind::Overwrite], 1);
        assert_eq!(r.lifetimes.by_kind[&EndKind::Overwrite].p50_ns, 2 * S);
        assert_eq!(r.lifetimes.alive, 1);
        assert_eq!(r.lifetimes.alive_age.as_ref().unwrap().p50_ns, 17 * S);
    }

    #[test]
    fn record_fs_field_wins_over_flag() {
        let mut line = rec("write", 0, 2, 0, 4096, "metadata", 5, None);
        line.insert_str(1, "\"fs\":\"btrfs\",");
        let mut fs = BTreeMap::new();
        fs.insert(2, "ext4".to_string());
        let r = build(Path::new("x"), line.as_bytes(), &fs).unwrap();
        assert_eq!(r.filesystems[0].fs.as_deref(), Some("btrfs"));
    }

    #[test]
    fn malformed_lines_are_counted_with_the_first_line_number() {
        let log = format!(
            "{}\n\nnot json\n{{\"op\":\"explode\"}}\n{}\n",
            rec("write", 0, 0, 0, 4096, "data", 0, None),
            rec("read", 1, 0, 0, 4096, "data", 0, None)
        );
        let r = report(&log).unwrap();
        assert_eq!(r.records, 2);
        assert_eq!(r.malformed.count, 2);
        assert_eq!(r.malformed.first_line, Some(3));
        assert!(r.text().contains("line 3"));
    }

    #[test]
    fn nothing_parsed_is_an_error_naming_the_line() {
        let e = report("\n{\"op\":\"write\"}\ngarbage\n").unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                ReportError::NothingParsed {
                    count: 2,
                    line: 2,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(msg.contains("line 2"), "{msg}");
        assert!(matches!(
            report("\n\n").unwrap_err(),
            ReportError::Empty { .. }
        ));
    }

    #[test]
    fn fs_spec_parsing() {
        assert_eq!(parse_fs_spec("1=xfs").unwrap(), (1, "xfs".to_string()));
        assert!(parse_fs_spec("xfs").is_err());
        assert!(parse_fs_spec("a=xfs").is_err());
        assert!(parse_fs_spec("1=").is_err());
        assert!(parse_fs_spec("1=x/y").is_err());
    }

    #[test]
    fn lifetimes_through_records_for_each_ending() {
        let log = [
            // /a blocks 0,1 (file chunks 0,1); /b block 10.
            rec("write", 0, 0, 0, 8192, "data", 0, Some(("/a", 0))),
            rec("write", 0, 0, 10 * 4096, 4096, "data", 0, Some(("/b", 0))),
            rec("write", S, 0, 20 * 4096, 4096, "data", 0, Some(("/c", 0))),
            // overwrite of /a chunk 0 in place after 2 s
            rec("write", 2 * S, 0, 0, 4096, "data", 0, Some(("/a", 0))),
            // truncate /a to 4096: chunk 1 dies after 5 s
            "{\"op\":\"truncate\",\"ts_ns\":5000000000,\"file\":\"/a\",\"size\":4096,\"pid\":1}"
                .into(),
            // discard of /b's block after 7 s
            rec("discard", 7 * S, 0, 10 * 4096, 4096, "metadata", 5, None),
            // unlink /c after 9 s (born at 1 s: lifetime 8 s)
            "{\"op\":\"unlink\",\"ts_ns\":9000000000,\"file\":\"/c\",\"size\":0,\"pid\":1}".into(),
        ]
        .join("\n");
        let r = report(&log).unwrap();
        let l = &r.lifetimes;
        assert_eq!(l.born, 5);
        assert_eq!(l.by_kind[&EndKind::Overwrite].max_ns, 2 * S);
        assert_eq!(l.by_kind[&EndKind::Truncate].max_ns, 5 * S);
        assert_eq!(l.by_kind[&EndKind::Discard].max_ns, 7 * S);
        assert_eq!(l.by_kind[&EndKind::Unlink].max_ns, 8 * S);
        // The rewritten chunk 0 of /a (born at 2 s) is alive at 9 s: age 7 s.
        assert_eq!(l.alive, 1);
        assert_eq!(l.alive_age.as_ref().unwrap().max_ns, 7 * S);
        assert_eq!(r.total.discard_requests, 1);
        let svg = r.svg();
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("unlink"));
    }

    #[test]
    fn human_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_ns(1_500_000), "1.5 ms");
        assert_eq!(human_ns(2 * S), "2.00 s");
    }
}
