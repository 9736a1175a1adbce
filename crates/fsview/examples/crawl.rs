//! Crawl a raw disk image and print what the index holds.
//!
//! `cargo run --release -p vmsight-fsview --example crawl -- IMAGE [--partition N] [--save FILE]`

use std::process::ExitCode;
use std::time::Instant;
use vmsight_fsview::{read_partitions, FileSource, Index};

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let mut image = None;
    let mut partition = None;
    let mut save = None;
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
            _ if image.is_none() => image = Some(a),
            _ => return Err(format!("unexpected argument {a:?}")),
        }
    }
    let image = image.ok_or("usage: crawl IMAGE [--partition N] [--save FILE]")?;
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
    println!(
        "in use:       {} inodes ({} dirs, {} files, {} symlinks), {} entries, {} block runs",
        st.inodes, st.directories, st.regular_files, st.symlinks, st.entries, st.runs
    );
    println!(
        "index size:   {} bytes in memory, {:.1} bytes per inode",
        st.heap_bytes,
        st.bytes_per_inode()
    );
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
