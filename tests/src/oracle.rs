//! Oracles shared by the real-guest tests: the guest's own `filefrag`/`find`/`sha256sum`
//! output, tools run on the host over `vmsight mount`, and the files vmsight writes
//! (`--stats-json`, the insight log) read back as JSON.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// A JSON file vmsight wrote (`--stats-json`).
pub fn json_file(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The records of an insight log (JSON lines).
pub fn insight_log(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A guest run with `--insights` and `--stats-json`: the run, then its insight log records
/// and its statistics (`insights` holds the engine's counters).
pub struct InsightRun {
    pub run: crate::Run,
    pub records: Vec<Value>,
    pub stats: Value,
}

/// Runs `script` in a guest with `--insights` and `--stats-json` (files in a temporary
/// directory) and asserts it exited 0.
pub fn guest_sh_with_insights(script: &str) -> InsightRun {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("ins.jsonl");
    let st = dir.path().join("stats.json");
    let run = crate::guest_sh(
        &[
            "--insights",
            log.to_str().unwrap(),
            "--stats-json",
            st.to_str().unwrap(),
        ],
        script,
    );
    assert_eq!(run.code, Some(0), "{run:?}");
    InsightRun {
        records: insight_log(&log),
        stats: json_file(&st),
        run,
    }
}

/// The lines of `stdout` between `BEGIN <tag>` and `END <tag>`.
pub fn section<'a>(stdout: &'a str, tag: &str) -> &'a str {
    let begin = format!("BEGIN {tag}\n");
    let start = stdout
        .find(&begin)
        .unwrap_or_else(|| panic!("no {begin:?}"))
        + begin.len();
    let len = stdout[start..]
        .find(&format!("END {tag}\n"))
        .unwrap_or_else(|| panic!("no END {tag}"));
    &stdout[start..start + len]
}

/// Where a 4 KiB disk block is in a file, per FIEMAP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileBlock {
    /// The file's path as `filefrag` printed it.
    pub file: String,
    /// Byte offset in the file of the block's first byte.
    pub file_offset: u64,
}

/// Every 4 KiB disk block (disk byte offset / 4096) holding file data in `filefrag -v` output
/// of one or more files, with the file and the offset in it; `disk_start` is the byte offset of
/// the file system on the disk (0 for a whole-disk file system). Inline, delalloc and
/// unknown-location extents hold no block of their own and are skipped.
pub fn fiemap_map(out: &str, disk_start: u64) -> HashMap<u64, FileBlock> {
    let mut map = HashMap::new();
    let (mut file, mut bs) = (String::new(), 0u64);
    for l in out.lines() {
        if let Some(rest) = l.strip_prefix("File size of ") {
            // "File size of PATH is N (B blocks of BS bytes)" ("1 block of" for one)
            let (path, tail) = rest.rsplit_once(" is ").unwrap();
            file = path.to_string();
            let bytes = tail.rsplit_once(" of ").unwrap().1;
            bs = bytes.split_whitespace().next().unwrap().parse().unwrap();
            continue;
        }
        let f: Vec<&str> = l.split(':').map(str::trim).collect();
        if f.len() < 5 || f[0].parse::<u64>().is_err() || f[2].is_empty() {
            continue;
        }
        let flags = f.get(5).copied().unwrap_or("");
        if ["inline", "delalloc", "unknown_loc"]
            .iter()
            .any(|x| flags.contains(x))
        {
            continue;
        }
        assert!(bs > 0, "extent before a file header: {l}");
        let logical: u64 = f[1].split("..").next().unwrap().trim().parse().unwrap();
        let physical: u64 = f[2].split("..").next().unwrap().trim().parse().unwrap();
        let len: u64 = f[3].parse().unwrap();
        // Every 4 KiB block the extent touches (file systems with smaller blocks included).
        let (first, end) = (
            disk_start + physical * bs,
            disk_start + (physical + len) * bs,
        );
        for disk_block in first / 4096..end.div_ceil(4096) {
            let file_offset = logical * bs + (disk_block * 4096).saturating_sub(first);
            map.insert(
                disk_block,
                FileBlock {
                    file: file.clone(),
                    file_offset,
                },
            );
        }
    }
    map
}

/// `find -printf '%P %s %m %U %G %T@ %y %l'` of the tree at `root` on the host, times cut to
/// whole seconds (the view's resolution), sorted.
pub fn find_listing(root: &Path) -> Vec<String> {
    let o = Command::new("find")
        .arg(root)
        .args(["-printf", "%P %s %m %U %G %T@ %y %l\\n"])
        .output()
        .unwrap();
    let mut v: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(whole_seconds)
        .collect();
    v.sort();
    v
}

/// A `find -printf '%P %s %m %U %G %T@ %y %l'` line with its time cut to whole seconds.
pub fn whole_seconds(line: &str) -> String {
    // Fields: path size mode uid gid time type [target]; the path never has spaces here.
    let mut f: Vec<String> = line.split(' ').map(str::to_string).collect();
    if f.len() > 5 {
        f[5] = f[5].split('.').next().unwrap_or("").to_string();
    }
    f.join(" ")
}

/// Stdout lines of `sh -c cmd` run in `dir` on the host.
pub fn sh_out(cmd: &str, dir: &Path) -> Vec<String> {
    let o = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .current_dir(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// The lines only one side has, marked with the side, for an assertion message.
pub fn line_diff(guest: &[String], host: &[String]) -> Vec<String> {
    guest
        .iter()
        .filter(|l| !host.contains(l))
        .map(|l| format!("guest only: {l}"))
        .chain(
            host.iter()
                .filter(|l| !guest.contains(l))
                .map(|l| format!("view only:  {l}")),
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fiemap_output_maps_disk_blocks_to_file_offsets() {
        let out = "Filesystem type is: ef53\n\
File size of /root/a b is 10000 (3 blocks of 4096 bytes)\n \
ext:     logical_offset:        physical_offset: length:   expected: flags:\n   \
0:        0..       1:      34816..     34817:      2:\n   \
1:        2..       2:      40000..     40000:      1:      34818: last,eof\n\
/root/a b: 2 extents found\n\
File size of /x is 4096 (1 block of 1024 bytes)\n   \
0:        0..       3:       8..       11:      4:             last,eof\n\
File size of /y is 2048 (2 blocks of 1024 bytes)\n   \
0:        0..       1:      13..       14:      2:             last,eof\n";
        let m = fiemap_map(out, 1 << 20);
        let at = |b: u64| m.get(&b).cloned().unwrap();
        assert_eq!(m.len(), 5);
        // 1 KiB blocks 13..14 lie inside 4 KiB disk block 3: it holds data of /y.
        assert_eq!(at(256 + 3).file, "/y");
        assert_eq!(at(256 + 34816).file, "/root/a b");
        assert_eq!(at(256 + 34817).file_offset, 4096);
        assert_eq!(at(256 + 40000).file_offset, 8192);
        // 1 KiB blocks 8..11 are the 4 KiB disk block 2 (plus the 1 MiB start).
        assert_eq!(at(256 + 2).file, "/x");
    }
}

/// The insight log's write records of one disk judged per 4 KiB block against a FIEMAP truth
/// (`fiemap_map`) of the files `ours`, in both directions.
#[derive(Debug, Default)]
pub struct BlockJudgement {
    /// Blocks of the files whose last write is not data of the right file at the right offset:
    /// (file, block, what the log says).
    pub missed: Vec<(String, u64, String)>,
    /// Blocks a record calls data of one of the files that are not that file's at that offset.
    pub spurious: Vec<String>,
    /// Blocks records attributed to the files (right or wrong).
    pub attributed: u64,
}

/// Judges `writes` (write records of one disk, in any order) per block against `truth`.
pub fn judge_file_blocks(
    writes: &[Value],
    truth: &HashMap<u64, FileBlock>,
    ours: &BTreeSet<String>,
) -> BlockJudgement {
    let mut writes: Vec<&Value> = writes.iter().collect();
    writes.sort_by_key(|r| r["ts_ns"].as_u64().unwrap());
    let mut j = BlockJudgement::default();
    // Per block: the last write record covering it and the file offset it says.
    let mut last: HashMap<u64, (&Value, Option<u64>)> = HashMap::new();
    for rec in writes {
        let off = rec["offset"].as_u64().unwrap();
        let file = rec["file"].as_str();
        for k in 0..rec["len"].as_u64().unwrap().div_ceil(4096) {
            let block = off / 4096 + k;
            let file_off = rec["file_offset"].as_u64().map(|f| f + k * 4096);
            last.insert(block, (rec, file_off));
            if file.is_some_and(|f| ours.contains(f)) && rec["content"] != "metadata" {
                j.attributed += 1;
                let right = truth.get(&block).is_some_and(|t| {
                    Some(t.file.as_str()) == file && Some(t.file_offset) == file_off
                });
                if !right {
                    j.spurious.push(format!("block {block}: {rec}"));
                }
            }
        }
    }
    for (block, t) in truth {
        let ok = last.get(block).is_some_and(|(rec, file_off)| {
            rec["content"] == "data"
                && rec["file"].as_str() == Some(t.file.as_str())
                && *file_off == Some(t.file_offset)
        });
        if !ok {
            let got = last.get(block).map(|(r, _)| r.to_string());
            j.missed.push((
                t.file.clone(),
                *block,
                format!("offset {}: last write {got:?}", t.file_offset),
            ));
        }
    }
    j.missed.sort();
    j
}
