//! Helpers shared by the integration tests: build directory trees and images with e2fsprogs
//! and parse debugfs output. Missing tools make the tests fail, not skip.

#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::{chown, symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Run a tool; panic with a clear message if it is missing or fails.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| {
        panic!("required tool `{cmd}` could not be run ({e}); install e2fsprogs, gdisk and fdisk")
    });
    assert!(
        out.status.success(),
        "`{cmd} {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Populate `root` with the test tree; returns relative paths of regular files.
pub fn make_tree(root: &Path) -> Vec<String> {
    let w = |p: &str, data: &[u8]| {
        let path = root.join(p);
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(&path, data).expect("write");
    };
    let pattern = |n: usize| -> Vec<u8> { (0..n).map(|i| (i * 7 + i / 251) as u8).collect() };
    w("empty", b"");
    w("one", b"x");
    w("small.txt", b"hello world\n");
    w("f4095", &pattern(4095));
    w("f4096", &pattern(4096));
    w("f5000", &pattern(5000));
    w("dir/f100k", &pattern(100_000));
    w("dir/sub/deep/large", &pattern(3_000_000));
    // Sparse: data at 0, a hole, data at 1 MiB, hole to 4 MiB.
    let sp = root.join("dir/sparse");
    {
        use std::os::unix::fs::FileExt;
        let f = fs::File::create(&sp).expect("sparse");
        f.write_all_at(b"start", 0).expect("w");
        f.write_all_at(b"middle", 1 << 20).expect("w");
        f.set_len(4 << 20).expect("len");
    }
    // Many small pieces separated by holes: many extents (needs an extent-tree index block)
    // or indirect blocks.
    {
        use std::os::unix::fs::FileExt;
        let f = fs::File::create(root.join("dir/fragmented")).expect("frag");
        for i in 0..40u64 {
            f.write_all_at(&[i as u8 + 1; 100], i * 65536).expect("w");
        }
    }
    // Big directory (htree).
    for i in 0..350 {
        w(
            &format!("many/entry-with-a-longish-name-{i:04}"),
            format!("{i}\n").as_bytes(),
        );
    }
    // Hard links, symlinks.
    fs::hard_link(root.join("small.txt"), root.join("dir/hardlink")).expect("link");
    fs::hard_link(root.join("small.txt"), root.join("many/hardlink2")).expect("link");
    symlink("small.txt", root.join("fastlink")).expect("symlink");
    symlink("x".repeat(120), root.join("dir/slowlink")).expect("symlink");
    // Modes and owners (high uid/gid bits).
    fs::set_permissions(root.join("one"), fs::Permissions::from_mode(0o4755)).expect("chmod");
    fs::set_permissions(root.join("f4095"), fs::Permissions::from_mode(0o600)).expect("chmod");
    chown(root.join("f4096"), Some(1234), Some(5678)).expect("chown");
    chown(root.join("f5000"), Some(70000), Some(70001)).expect("chown");
    let mut files = vec![
        "empty",
        "one",
        "small.txt",
        "f4095",
        "f4096",
        "f5000",
        "dir/f100k",
        "dir/sub/deep/large",
        "dir/sparse",
        "dir/fragmented",
        "dir/hardlink",
    ]
    .into_iter()
    .map(String::from)
    .collect::<Vec<_>>();
    files.push("many/entry-with-a-longish-name-0007".into());
    files
}

/// A temporary directory with a populated tree.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub tree: PathBuf,
    pub files: Vec<String>,
}

pub fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let tree = dir.path().join("tree");
    fs::create_dir(&tree).expect("mkdir");
    let files = make_tree(&tree);
    Fixture { dir, tree, files }
}

/// Run several debugfs commands in one process; returns the output of each command.
pub fn debugfs(image: &Path, cmds: &[String]) -> Vec<String> {
    let file = image.with_extension("cmds");
    fs::write(&file, cmds.join("\n") + "\n").expect("cmd file");
    let out = Command::new("debugfs")
        .arg("-f")
        .arg(&file)
        .arg(image)
        .output()
        .unwrap_or_else(|e| {
            panic!("required tool `debugfs` could not be run ({e}); install e2fsprogs")
        });
    assert!(out.status.success(), "debugfs failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut res: Vec<String> = Vec::new();
    for line in text.lines() {
        if line.starts_with("debugfs: ") {
            res.push(String::new());
        } else if let Some(last) = res.last_mut() {
            last.push_str(line);
            last.push('\n');
        }
    }
    assert_eq!(
        res.len(),
        cmds.len(),
        "debugfs output did not match the commands"
    );
    res
}
