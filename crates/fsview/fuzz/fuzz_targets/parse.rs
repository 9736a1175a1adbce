//! Fuzz the partition-table parser, the ext2/3/4 crawler and the stored-index decoder with
//! arbitrary disk images. Seed with a small real image: `mkfs.ext4 -q -b 1024 seed.img 256k`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmsight_fsview::{read_partitions, CrawlOptions, Index, MemSource};

fuzz_target!(|data: &[u8]| {
    let src = MemSource(data.to_vec());
    if let Ok(table) = read_partitions(&src) {
        for p in table.partitions.iter().take(4) {
            let _ = Index::crawl(&src, Some(p));
        }
    }
    for opts in [
        CrawlOptions {
            strict: false,
            no_checksums: true,
        },
        CrawlOptions {
            strict: true,
            no_checksums: false,
        },
    ] {
        if let Ok(index) = Index::crawl_with(&src, None, &opts) {
            let inodes: Vec<u32> = index.inodes().take(64).collect();
            for ino in inodes {
                let _ = index.path_of(ino);
                let _ = index.read_dir(ino);
                let _ = index.read_link(ino);
                let mut buf = [0u8; 512];
                let _ = index.read_file(&src, ino, 0, &mut buf);
            }
            for b in (0..index.fs_info().blocks_count).step_by(7).take(4096) {
                let _ = index.owner(b);
            }
            let _ = index.lookup("/a/b/../c");
            if let Ok(bytes) = index.to_bytes() {
                let _ = Index::from_bytes(&bytes);
            }
        }
    }
    let _ = Index::from_bytes(data);
});
