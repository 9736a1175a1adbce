//! Feed the blocks that differ between two images of the same file system into the inference
//! engine and print the events, the engine's counters and whether its view matches a fresh
//! crawl of the second image.
//!
//! `cargo run --release -p vmsight-fsview --example infer_diff -- BEFORE AFTER [--journal-first] [--quiet]`
//!
//! With `--journal-first`, blocks of the internal journal are fed before the home locations
//! (the order jbd2 writes them), so metadata events come from committed transactions.

use std::sync::Arc;
use std::time::Instant;
use vmsight_fsview::{
    Engine, EngineConfig, FileKind, FileSource, FsRead, Index, MemSource, Owner, StaticView,
};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let files: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let [before_path, after_path] = files[..] else {
        eprintln!("usage: infer_diff BEFORE AFTER [--journal-first] [--quiet]");
        std::process::exit(2);
    };
    let journal_first = args.iter().any(|a| a == "--journal-first");
    let quiet = args.iter().any(|a| a == "--quiet");
    let before = std::fs::read(before_path).unwrap_or_else(|e| die(&format!("{before_path}: {e}")));
    let after = std::fs::read(after_path).unwrap_or_else(|e| die(&format!("{after_path}: {e}")));
    let index = Index::crawl(&MemSource(before.clone()), None)
        .unwrap_or_else(|e| die(&format!("crawl of {before_path}: {e}")));
    let bs = index.fs_info().block_size as usize;
    let mut changed: Vec<u64> = (0..before.len().min(after.len()) / bs)
        .filter(|&b| before[b * bs..(b + 1) * bs] != after[b * bs..(b + 1) * bs])
        .map(|b| b as u64)
        .collect();
    if journal_first {
        changed.sort_by_key(|&b| !matches!(index.owner(b), Owner::Journal { .. }));
    }
    let disk = Arc::new(FileSource::open(after_path).unwrap_or_else(|e| die(&e.to_string())));
    let mut engine = Engine::new(disk.clone(), index, EngineConfig::default())
        .unwrap_or_else(|e| die(&e.to_string()));
    let t = Instant::now();
    let mut out = Vec::new();
    for (k, &b) in changed.iter().enumerate() {
        let off = b as usize * bs;
        engine.write(off as u64, &after[off..off + bs], k as u64, &mut out);
    }
    engine.flush(changed.len() as u64, &mut out);
    let elapsed = t.elapsed();
    if !quiet {
        for e in &out {
            println!(
                "{:?} {} {} txn={:?} range={:?} old={:?} new={:?}",
                e.kind,
                e.path,
                e.old_path.as_deref().unwrap_or(""),
                e.txn,
                e.range,
                e.old,
                e.new
            );
        }
    }
    let st = engine.stats();
    println!(
        "{} changed blocks fed in {:.3} s",
        changed.len(),
        elapsed.as_secs_f64()
    );
    println!("{st:#?}");
    if let Some(per) = st.overlay_bytes.checked_div(st.overlay_inodes) {
        println!("overlay: {per} B per changed inode");
    }
    let fresh_index =
        Index::crawl(disk.as_ref(), None).unwrap_or_else(|e| die(&format!("crawl: {e}")));
    let fresh = StaticView::new(fresh_index, disk);
    let diffs = compare(&engine, &fresh);
    println!("view vs fresh crawl: {diffs} differences");
}

fn compare(a: &dyn FsRead, b: &dyn FsRead) -> usize {
    let mut diffs = 0;
    let mut stack = vec![("/".to_string(), 2u32)];
    while let Some((path, ino)) = stack.pop() {
        let (Some(x), Some(y)) = (a.read_dir(ino), b.read_dir(ino)) else {
            println!("differs: {path} is not a directory on one side");
            diffs += 1;
            continue;
        };
        if x != y {
            println!("differs: entries of {path}");
            diffs += 1;
        }
        for e in y {
            let p = format!(
                "{}/{}",
                path.trim_end_matches('/'),
                String::from_utf8_lossy(&e.name)
            );
            if a.stat(e.ino) != b.stat(e.ino) {
                println!("differs: metadata of {p}");
                diffs += 1;
            }
            if e.kind == FileKind::Directory {
                stack.push((p, e.ino));
            }
        }
    }
    diffs
}

fn die(msg: &str) -> ! {
    eprintln!("infer_diff: {msg}");
    std::process::exit(1);
}
