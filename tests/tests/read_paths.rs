//! A block read nobody's read syscall shows is still classified as its file's data, per
//! 4 KiB block (issue 32): a file read only through a memory mapping (page faults, no read
//! buffer) is classified by page ownership, the guest kernel's own `struct page` of the
//! page-cache pages the read fills (docs/insights.md). The file is one of the image's that
//! nothing reads during the boot (`/usr/bin/perl`), so no syscall ever showed its content.
//! The oracle is the guest's FIEMAP (`filefrag -v`), in both directions: every block of the
//! file is read as data of the file at the right offset, and no read record calls any other
//! block data of it.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeSet;

use serde_json::Value;
use vmsight_tests::oracle::{fiemap_map, guest_sh_with_insights, judge_file_blocks, section};

const FILE: &str = "/usr/bin/perl";

const SCRIPT: &str = r#"
set -e
sync
echo 3 > /proc/sys/vm/drop_caches
python3 - <<'PY'
import hashlib, mmap, os
fd = os.open("/usr/bin/perl", os.O_RDONLY)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
print("sha256", hashlib.sha256(m).hexdigest())
m.close(); os.close(fd)
PY
echo BEGIN fiemap
filefrag -v /usr/bin/perl
echo END fiemap
"#;

#[test]
fn reads_through_a_file_mapping_are_data_of_their_file_per_block() {
    let ir = guest_sh_with_insights(SCRIPT);
    let r = &ir.run;
    let truth = fiemap_map(section(&r.stdout, "fiemap"), 0);
    assert!(
        truth.len() > 900,
        "FIEMAP blocks of {FILE}: {}",
        truth.len()
    );
    let reads: Vec<Value> = ir
        .records
        .into_iter()
        .filter(|r| r["op"] == "read" && r["disk"] == 0)
        .collect();
    let ours: BTreeSet<String> = [FILE.to_string()].into();
    let j = judge_file_blocks(&reads, &truth, &ours);
    println!(
        "{FILE}: {} blocks, {} missed, {} spurious, {} attributed",
        truth.len(),
        j.missed.len(),
        j.spurious.len(),
        j.attributed
    );
    assert!(
        j.missed.is_empty(),
        "blocks not read as data of {FILE} at their offset, first: {:?}",
        &j.missed[..j.missed.len().min(5)]
    );
    assert!(
        j.spurious.is_empty(),
        "spurious, first: {:?}",
        &j.spurious[..j.spurious.len().min(5)]
    );
    // The mechanism: no read syscall showed these bytes, the pages' owner did.
    let ins = &ir.stats["insights"];
    println!("insights: {ins}");
    let by_page = ins["read_chunks_by_page"].as_u64().unwrap();
    assert!(by_page >= truth.len() as u64, "{ins}");
}
