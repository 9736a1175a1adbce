//! Crawl a raw disk image and print what the index holds.
//!
//! `cargo run --release -p vmsight-fsview --example crawl -- IMAGE [--partition N] [--save FILE]
//! [--lazy FILE]`
//!
//! `--lazy FILE` then writes the index as a lazy index's section file (removed at the end) and
//! prints what stays resident right after start-up and after one query per inode.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;
use vmsight_fsview::{read_partitions, Engine, EngineConfig, FileSource, Index, LazyConfig};

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let mut image = None;
    let mut partition = None;
    let mut save = None;
    let mut lazy = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--partition" => {
                let n = args.next().ok_or("--partition needs a number")?;
                partition = Some(
                    n.parse::<usize>()
                        .map_err(|e| format!("bad --partition {n:?}: {e}"))?,
                );
            }
            "--save" => save = Some(args.next().ok_or("--save needs a file name")?),
            "--lazy" => lazy = Some(args.next().ok_or("--lazy needs a file name")?),
            _ if image.is_none() => image = Some(a),
            _ => return Err(format!("unexpected argument {a:?}")),
        }
    }
    let image = image.ok_or("usage: crawl IMAGE [--partition N] [--save FILE] [--lazy FILE]")?;
    let src = FileSource::open(&image).map_err(|e| e.to_string())?;
    let table = read_partitions(&src).map_err(|e| e.to_string())?;
    for w in &table.warnings {
        eprintln!("partition table warning: {w}");
    }
    let part = match partition {
        Some(n) => Some(table.get(n).map_err(|e| e.to_string())?.clone()),
        None => None,
    };
    let t0 = Instant::now();
    let index = Index::crawl(&src, part.as_ref()).map_err(|e| e.to_string())?;
    let elapsed = t0.elapsed();
    let st = index.stats();
    let fs = index.fs_info();
    println!("image:        {image}");
    println!(
        "partitions:   {:?}, {} found",
        table.scheme,
        table.partitions.len()
    );
    println!(
        "file system:  {} blocks of {} bytes, {} groups, {} inodes",
        fs.blocks_count, fs.block_size, fs.group_count, fs.inodes_count
    );
    println!("crawl time:   {:.3} s", elapsed.as_secs_f64());
    // The process's peak so far (VmHWM), before the serialisation below adds its copy.
    if let Some(kib) = peak_rss_kib() {
        println!("crawl peak:   {kib} KiB resident (the crawl alone)");
    }
    println!(
        "in use:       {} inodes ({} dirs, {} files, {} symlinks), {} entries, {} block runs",
        st.inodes, st.directories, st.regular_files, st.symlinks, st.entries, st.runs
    );
    println!(
        "index size:   {} bytes in memory, {:.1} bytes per inode",
        st.heap_bytes,
        st.bytes_per_inode()
    );
    let tables: Vec<String> = index
        .table_bytes()
        .iter()
        .map(|(name, b)| format!("{name} {:.1}", *b as f64 / st.inodes.max(1) as f64))
        .collect();
    println!("per inode:    {}", tables.join(", "));
    let bytes = index.to_bytes().map_err(|e| e.to_string())?;
    println!(
        "serialised:   {} bytes, {:.1} bytes per inode",
        bytes.len(),
        bytes.len() as f64 / st.inodes.max(1) as f64
    );
    println!("warnings:     {}", index.warnings().len());
    for w in index.warnings().iter().take(5) {
        println!("  {}", w.message);
    }
    for ino in index
        .inodes()
        .filter(|&i| i >= 11)
        .step_by((st.inodes / 8).max(1))
        .take(8)
    {
        if let (Some(p), Some(m)) = (index.path_of(ino), index.inode(ino)) {
            println!("  {ino:>8} {:o} {:>10} {p}", m.mode, m.size);
        }
    }
    if let Some(path) = save {
        index.save(&path).map_err(|e| e.to_string())?;
        let t1 = Instant::now();
        Index::load(&path).map_err(|e| e.to_string())?;
        println!(
            "saved to {path}; reload took {:.3} s",
            t1.elapsed().as_secs_f64()
        );
    }
    if let Some(path) = lazy {
        let r = lazy_report(index, &image, &path);
        let _ = std::fs::remove_file(&path);
        r?;
    }
    Ok(())
}

/// Turn the index into a lazy one at `path` and print its resident bytes (alone, and with an
/// inference engine started on it, as `vmsight run --stream-lazy` does).
fn lazy_report(index: Index, image: &str, path: &str) -> Result<(), String> {
    let inodes = index.stats().inodes.max(1) as f64;
    let t0 = Instant::now();
    let lazy = index
        .into_lazy(path, &LazyConfig::default())
        .map_err(|e| e.to_string())?;
    let s = lazy.lazy_stats().ok_or("not lazy")?;
    println!(
        "lazy:         written and reopened in {:.3} s, file {} bytes ({:.1} per inode), {} sections",
        t0.elapsed().as_secs_f64(),
        s.file_bytes,
        s.file_bytes as f64 / inodes,
        s.sections
    );
    println!(
        "lazy start:   {} bytes resident, {:.1} bytes per inode",
        s.resident_bytes,
        s.resident_bytes as f64 / inodes
    );
    let disk = Arc::new(FileSource::open(image).map_err(|e| e.to_string())?);
    let engine = Engine::new(disk, lazy, EngineConfig::default()).map_err(|e| e.to_string())?;
    let st = engine.counters();
    println!(
        "lazy engine:  {} bytes resident after the engine started ({} sections loaded), {:.1} bytes per inode",
        st.index.resident_bytes,
        st.index.sections_loaded,
        st.index.resident_bytes as f64 / inodes
    );
    let lazy = engine.index();
    let t1 = Instant::now();
    let all: Vec<u32> = lazy.inodes().collect();
    for &ino in &all {
        let _ = (lazy.inode(ino), lazy.path_of(ino));
    }
    let s = lazy.lazy_stats().ok_or("not lazy")?;
    println!(
        "lazy walk:    inode + path of all {} inodes in {:.3} s: {} loads, {} evictions, {:.3} s loading, peak {} bytes ({:.1} per inode), {:.0}% of the tree loaded",
        all.len(),
        t1.elapsed().as_secs_f64(),
        s.loads,
        s.evictions,
        s.load_ns as f64 / 1e9,
        s.peak_resident_bytes,
        s.peak_resident_bytes as f64 / inodes,
        100.0 * s.inodes_loaded as f64 / s.inodes.max(1) as f64
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crawl: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The process's peak resident set so far (`VmHWM` in /proc/self/status), in KiB.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
