//! iDedup (issue 10, Sky §8) in real guests: data integrity against the guest's own files and
//! the host's e2fsck/debugfs, dedup really sharing chunks, garbage collection after the guest
//! discards, hints engaging (and not engaging without insights), crash consistency under
//! SIGKILL, and corrupt metadata refused with a clear error.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmsight_tests::*;

/// A 256 MiB dedup volume holding a fresh ext4 file system (made on the host, imported). The
/// gc tests rely on its size: a second 160 MiB only fits if freed chunks are reused.
fn volume_with_ext4(dir: &Path) -> PathBuf {
    volume_with_ext4_of(dir, 256)
}

/// The same with `mib` MiB.
fn volume_with_ext4_of(dir: &Path, mib: u64) -> PathBuf {
    let raw = dir.join("fs.img");
    make_ext4(&raw, mib);
    let vol = dir.join("vol");
    let r = run(&[
        "dedup",
        "create",
        vol.to_str().unwrap(),
        "--size",
        &format!("{mib}MiB"),
        "--from",
        raw.to_str().unwrap(),
    ]);
    assert_eq!(r.code, Some(0), "{r:?}");
    std::fs::remove_file(&raw).unwrap();
    vol
}

fn info(vol: &Path) -> Value {
    let r = run(&["dedup", "info", "--json", vol.to_str().unwrap()]);
    assert_eq!(r.code, Some(0), "{r:?}");
    serde_json::from_str(&r.stdout).unwrap()
}

fn used(vol: &Path) -> u64 {
    info(vol)["used_chunks"].as_u64().unwrap()
}

/// Bytes the host's file system allocated to the volume's (sparse) data file: an oracle of
/// what the volume stored that does not go through vmsight's own counters.
fn data_allocated(vol: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(vol.join("data")).unwrap().blocks() * 512
}

fn check_clean(vol: &Path) {
    let r = run(&["dedup", "check", vol.to_str().unwrap()]);
    assert_eq!(r.code, Some(0), "dedup check: {r:?}");
    assert!(r.stdout.contains("clean"), "{r:?}");
}

/// `vmsight dedup export` of the volume to `dir/export.img`.
fn export(vol: &Path, dir: &Path) -> PathBuf {
    let raw = dir.join("export.img");
    let r = run(&[
        "dedup",
        "export",
        vol.to_str().unwrap(),
        raw.to_str().unwrap(),
    ]);
    assert_eq!(r.code, Some(0), "{r:?}");
    raw
}

/// Exports the volume and returns the raw image after checking it with `e2fsck -fn`.
fn export_checked(vol: &Path, dir: &Path) -> PathBuf {
    let raw = export(vol, dir);
    let (ok, out) = fsck_clean(&raw);
    assert!(ok, "e2fsck -fn of the exported volume: {out}");
    raw
}

/// sha256 of a file dumped from an ext4 image with debugfs.
fn debugfs_sha(image: &Path, path: &str, dir: &Path) -> String {
    let out = dir.join("dump.bin");
    let _ = std::fs::remove_file(&out);
    debugfs(image, &format!("dump {path} {}", out.display()));
    let o = Command::new("sha256sum").arg(&out).output().unwrap();
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

fn stats_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The number after `prefix` on the first line of `out` that starts with it.
fn number_after(out: &str, prefix: &str) -> Option<u64> {
    out.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// The guest's `sha256sum` lines as (name, hash).
fn guest_sums(stdout: &str) -> Vec<(String, String)> {
    stdout
        .lines()
        .filter_map(|l| {
            let (h, n) = l.split_once("  ")?;
            (h.len() == 64).then(|| (n.trim().to_string(), h.to_string()))
        })
        .collect()
}

#[test]
fn a_copied_file_is_stored_once_reads_back_exactly_and_online_gc_frees_it_once_the_guest_discards()
{
    let d = tempfile::tempdir().unwrap();
    let vol = volume_with_ext4(d.path());
    let disk = format!("{},dedup", vol.display());
    // Boot 1: a file of random data, and the same bytes again under another name.
    let r = guest_sh(
        &["--disk", &disk],
        "set -e; mount /dev/vdb /mnt; head -c 64M /dev/urandom > /mnt/a; \
         head -c 3M /dev/urandom > /tmp/r; cat /tmp/r > /mnt/twice1; cat /tmp/r > /mnt/twice2; \
         sync; umount /mnt",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let before = used(&vol);
    let allocated_before = data_allocated(&vol);
    // Boot 2: copy the 64 MiB file; the guest's own sha256sum is the oracle.
    let r = guest_sh(
        &["--disk", &disk],
        "set -e; mount /dev/vdb /mnt; cp /mnt/a /mnt/b; sync; echo 3 > /proc/sys/vm/drop_caches; \
         cd /mnt; sha256sum a b twice1 twice2; cd /; umount /mnt",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let after = used(&vol);
    assert!(
        after < before + 256,
        "copying 64 MiB took {} new chunks (limit 256 = 1 MiB)",
        after.saturating_sub(before)
    );
    // The host agrees: the data file grew by at most the same 1 MiB, not by the copy's 64 MiB.
    let grown = data_allocated(&vol).saturating_sub(allocated_before);
    assert!(
        grown <= 1 << 20,
        "copying 64 MiB made the host allocate {grown} more bytes to the data file"
    );
    assert!(
        allocated_before >= 64 << 20,
        "the first boot's 64 MiB file is in the data file: {allocated_before} bytes allocated"
    );
    let sums = guest_sums(&r.stdout);
    assert_eq!(sums.len(), 4, "{r:?}");
    assert_eq!(sums[0].1, sums[1].1, "the copy differs from its source");
    assert_eq!(sums[2].1, sums[3].1);
    // The host's view of the same volume: e2fsck clean, debugfs dumps equal the guest's files.
    check_clean(&vol);
    let raw = export_checked(&vol, d.path());
    for (name, sha) in &sums {
        assert_eq!(
            &debugfs_sha(&raw, &format!("/{name}"), d.path()),
            sha,
            "{name}"
        );
    }
    // Boot 3: delete everything and discard; while the VM still runs, `vmsight dedup gc`
    // asks it (control socket) to free the chunks the index still held.
    let held = used(&vol);
    let mut vm = Command::new(vmsight_bin())
        .args(["run", "--disk", &disk, "--", "sh", "-c"])
        .arg(
            "set -e; mount /dev/vdb /mnt; rm /mnt/a /mnt/b /mnt/twice1 /mnt/twice2; sync; \
             fstrim -v /mnt; echo READY; read go; ls /mnt; umount /mnt",
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(vm.stdout.take().unwrap());
    let mut line = String::new();
    while out.read_line(&mut line).unwrap() > 0 && !line.contains("READY") {
        line.clear();
    }
    assert!(line.contains("READY"), "the guest never got to the gc");
    let g = run(&["dedup", "gc", vol.to_str().unwrap()]);
    {
        use std::io::Write;
        let mut stdin = vm.stdin.take().unwrap();
        let _ = writeln!(stdin, "go");
    }
    let status = vm.wait().unwrap();
    assert!(status.success(), "the VM failed after the online gc");
    assert_eq!(g.code, Some(0), "{g:?}");
    assert!(
        g.stdout.contains("online, by VM"),
        "not collected online: {g:?}"
    );
    let freed = number_after(&g.stdout, "freed ").unwrap_or_else(|| panic!("no count in {g:?}"));
    assert!(
        freed >= 16_384 + 768,
        "online gc freed {freed} chunks; the 67 MiB of deleted files are {} chunks",
        16_384 + 768
    );
    // The deleted files' chunks left the volume (boot 3's own metadata and journal writes
    // may keep up to 1 MiB of new chunks; gc also freed the garbage those left).
    let after = used(&vol);
    assert!(
        after + 16_384 + 768 <= held + 256,
        "{held} chunks before the deletion, {after} after the online gc"
    );
    // An offline gc finds only what the guest overwrote after the online one (its unmount's
    // journal blocks), not the deleted files.
    let g = run(&["dedup", "gc", vol.to_str().unwrap()]);
    let late = number_after(&g.stdout, "freed ").unwrap_or_else(|| panic!("no count in {g:?}"));
    assert!(
        late < 256,
        "the offline gc still found {late} chunks: {g:?}"
    );
    check_clean(&vol);
    export_checked(&vol, d.path());
}

#[test]
fn a_tar_of_usr_a_dpkg_install_overwrites_and_discards_on_a_dedup_disk_read_back_as_the_source() {
    let d = tempfile::tempdir().unwrap();
    // The guest's /usr/bin, /usr/sbin and /usr/lib/x86_64-linux-gnu outgrew 256 MiB when
    // MariaDB joined the image.
    let vol = volume_with_ext4_of(d.path(), 512);
    let disk = format!("{},dedup,meta-cache=64KiB", vol.display());
    let script = "set -e; mount /dev/vdb /mnt; \
        tar -C / -cf - usr/bin usr/sbin usr/lib/x86_64-linux-gnu | tar -C /mnt -xf -; \
        head -c 8M /dev/urandom > /mnt/r; dd if=/dev/urandom of=/mnt/r bs=4k count=300 seek=100 conv=notrunc 2>/dev/null; \
        cp /mnt/r /mnt/r2; rm /mnt/r2; fstrim /mnt; \
        mkdir -p /tmp/pkg/DEBIAN /tmp/pkg/opt/docpkg; cp -a /usr/share/doc /tmp/pkg/opt/docpkg/; \
        printf 'Package: docpkg\\nVersion: 1.0\\nArchitecture: all\\nMaintainer: t <t@example.com>\\nDescription: t\\n' > /tmp/pkg/DEBIAN/control; \
        dpkg-deb --build /tmp/pkg /tmp/docpkg.deb >/dev/null; \
        mkdir -p /mnt/root/var/lib/dpkg/info /mnt/root/var/lib/dpkg/updates; touch /mnt/root/var/lib/dpkg/status; \
        dpkg --root=/mnt/root -i /tmp/docpkg.deb >/dev/null; \
        dpkg --root=/mnt/root -s docpkg | grep -q 'install ok installed'; \
        sync; echo 3 > /proc/sys/vm/drop_caches; \
        (cd /usr && find bin sbin lib/x86_64-linux-gnu -type f -print0 | sort -z | xargs -0 sha256sum) > /tmp/src; \
        (cd /mnt/usr && find bin sbin lib/x86_64-linux-gnu -type f -print0 | sort -z | xargs -0 sha256sum) > /tmp/dst; \
        cmp /tmp/src /tmp/dst && echo SAME $(wc -l < /tmp/src); \
        (cd /usr/share/doc && find . -type f -print0 | sort -z | xargs -0 sha256sum) > /tmp/dsrc; \
        (cd /mnt/root/opt/docpkg/doc && find . -type f -print0 | sort -z | xargs -0 sha256sum) > /tmp/ddst; \
        cmp /tmp/dsrc /tmp/ddst && echo DPKG $(wc -l < /tmp/dsrc); \
        sha256sum /mnt/r; umount /mnt";
    let r = guest_sh(&["--disk", &disk], script);
    assert_eq!(r.code, Some(0), "{r:?}");
    let n = number_after(&r.stdout, "SAME ")
        .unwrap_or_else(|| panic!("the copy of /usr differs: {r:?}"));
    assert!(n > 500, "only {n} files compared");
    let pkg = number_after(&r.stdout, "DPKG ")
        .unwrap_or_else(|| panic!("the files dpkg installed differ from the package's: {r:?}"));
    assert!(pkg > 50, "only {pkg} installed files compared");
    check_clean(&vol);
    let raw = export_checked(&vol, d.path());
    let sums = guest_sums(&r.stdout);
    let (_, rsha) = sums.iter().find(|(n, _)| n == "/mnt/r").unwrap();
    assert_eq!(&debugfs_sha(&raw, "/r", d.path()), rsha);
    let bash = debugfs_sha(&raw, "/usr/bin/bash", d.path());
    assert_eq!(bash.len(), 64);
}

/// The dedup counters of disk 1 in `--stats-json`.
fn dedup_stats(st: &Path) -> Value {
    stats_json(st)["disks"][1]["dedup"].clone()
}

#[test]
fn copy_and_unique_hints_engage_with_insights_and_not_without() {
    let d = tempfile::tempdir().unwrap();
    let script = "set -e; mount /dev/vdb /mnt; head -c 32M /dev/urandom > /mnt/src; sync; \
        echo 3 > /proc/sys/vm/drop_caches; cp /mnt/src /mnt/dst; sync; \
        gpg --batch --yes --pinentry-mode loopback --passphrase x -c -o /mnt/src.gpg /mnt/src; sync; \
        stat -c 'SIZE %s' /mnt/src.gpg; cmp /mnt/src /mnt/dst && echo COPY-OK; umount /mnt";
    let mut results = Vec::new();
    for hinted in [true, false] {
        let sub = d.path().join(if hinted { "h" } else { "u" });
        std::fs::create_dir_all(&sub).unwrap();
        let vol = volume_with_ext4(&sub);
        let st = d.path().join(format!("st-{hinted}.json"));
        let log = d.path().join("ins.log");
        let disk = format!("{},dedup", vol.display());
        let mut args = vec!["--disk", &disk, "--stats-json", st.to_str().unwrap()];
        if hinted {
            args.extend([
                "--insights",
                log.to_str().unwrap(),
                "--insight-target",
                "@cmd",
            ]);
        }
        let r = guest_sh(&args, script);
        assert_eq!(r.code, Some(0), "hinted={hinted}: {r:?}");
        assert!(r.stdout.contains("COPY-OK"), "{r:?}");
        let gpg_bytes = number_after(&r.stdout, "SIZE ").unwrap();
        check_clean(&vol);
        results.push((hinted, dedup_stats(&st), gpg_bytes));
    }
    let (_, h, gpg_bytes) = &results[0];
    let (_, u, _) = &results[1];
    let g = |v: &Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"));
    // Copy: the classifier hinted cp's reads, the copy's writes found their chunks in the hint
    // cache instead of the on-disk index.
    assert!(g(h, "copy_hints") >= 4096, "copy hints: {h}");
    assert!(g(h, "hint_hits") >= 7000, "hint-cache hits: {h}");
    // Unique: gpg's output chunks (and metadata) skipped the index.
    assert!(
        g(h, "unique_hints") >= gpg_bytes / 4096,
        "unique hints {} < gpg's {} chunks: {h}",
        g(h, "unique_hints"),
        gpg_bytes / 4096
    );
    // Fewer index lookups than the unhinted run, by at least the copy and the gpg output.
    assert!(
        g(h, "index_lookups") + 8192 + gpg_bytes / 4096 / 2 <= g(u, "index_lookups"),
        "lookups hinted {} vs unhinted {}",
        g(h, "index_lookups"),
        g(u, "index_lookups")
    );
    // Without insights: none of that.
    for k in [
        "copy_hints",
        "hint_hits",
        "unique_hints",
        "copy_write_hints",
    ] {
        assert_eq!(g(u, k), 0, "{k} without insights: {u}");
    }
    // Both dedup the copy.
    for s in [h, u] {
        assert!(g(s, "index_hits") + g(s, "hint_hits") >= 7000, "{s}");
    }
}

/// Boots a writer on the volume, kills vmsight with SIGKILL once `wait_lines` files were
/// reported synced plus a random delay, and returns the (name, sha256) of the synced files.
fn run_and_kill(disk: &str, round: u32, delay: Duration, dir: &Path) -> Vec<(String, String)> {
    let script = format!(
        "mount /dev/vdb /mnt || exit 9; rm -rf /mnt/r*; mkdir -p /mnt/r{round} || exit 9; i=0; \
         while true; do i=$((i+1)); f=/mnt/r{round}/f$i; \
         head -c $(( (i % 7 + 1) * 131072 )) /dev/urandom > $f || exit 9; \
         cp $f $f.copy || exit 9; sync; echo SYNCED $(sha256sum $f) $(sha256sum $f.copy); done"
    );
    let name = format!("dedup-kill-{}-{round}", std::process::id());
    let console = dir.join(format!("console-{round}.log"));
    let mut child = vmsight()
        // -v: the phase lines on stderr say how far vmsight got if a round never syncs.
        .args([
            "-v",
            "run",
            "--name",
            &name,
            "--disk",
            disk,
            "--console-log",
        ])
        .arg(&console)
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("run.err")).unwrap())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut other = Vec::new();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut synced = Vec::new();
    let start = Instant::now();
    let mut deadline: Option<Instant> = None;
    loop {
        if deadline.is_some_and(|t| Instant::now() >= t) {
            break;
        }
        // The writer stopped by itself (its disk full, a failed mount): say why now.
        let exited = child.try_wait().ok().flatten();
        if start.elapsed() >= Duration::from_secs(240) || (exited.is_some() && deadline.is_none()) {
            let _ = child.kill();
            let err = std::fs::read_to_string(dir.join("run.err")).unwrap_or_default();
            let log = std::fs::read(&console).unwrap_or_default();
            let log = String::from_utf8_lossy(&log[log.len().saturating_sub(6000)..]);
            panic!(
                "round {round}: the writer never synced (exit: {exited:?}) in {:?}; guest output {other:?}; vmsight stderr: {}; guest console tail:\n{log}",
                start.elapsed(),
                &err[err.len().saturating_sub(3000)..]
            );
        }
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(20)) {
            let w: Vec<&str> = line.split_whitespace().collect();
            if w.first() == Some(&"SYNCED") && w.len() == 5 {
                synced.push((w[2].to_string(), w[1].to_string()));
                synced.push((w[4].to_string(), w[3].to_string()));
                deadline.get_or_insert_with(|| Instant::now() + delay);
            } else if other.len() < 50 {
                other.push(line);
            }
        }
    }
    child.kill().unwrap();
    let _ = child.wait();
    // QEMU dies with vmsight (PDEATHSIG); give it a moment to release the runtime directory.
    std::thread::sleep(Duration::from_millis(500));
    // A killed vmsight leaves its root disk's working copy (later runs sweep it after ten
    // minutes); 20 rounds would hold gigabytes until then.
    let cache = std::env::var_os("VMSIGHT_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(&std::env::var("HOME").unwrap()).join(".cache/vmsight"));
    let _ = std::fs::remove_dir_all(cache.join("vms").join(&name));
    synced
}

#[test]
fn after_sigkill_at_random_moments_the_volume_checks_clean_and_synced_files_are_intact() {
    let d = tempfile::tempdir().unwrap();
    let vol = volume_with_ext4(d.path());
    let disk = format!("{},dedup,meta-cache=64KiB,flush-every=64", vol.display());
    let mut seed = std::process::id() as u64 ^ 0x9e37_79b9_7f4a_7c15;
    for round in 0..20u32 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = Duration::from_millis(seed % 3000);
        let synced = run_and_kill(&disk, round, delay, d.path());
        assert!(!synced.is_empty(), "round {round}: nothing synced");
        check_clean(&vol);
        // The file system as the guest left it: recover its journal on a copy of the export,
        // then it must be clean and hold every synced file exactly.
        let raw = export(&vol, d.path());
        let fix = Command::new("e2fsck")
            .args(["-fy"])
            .arg(&raw)
            .output()
            .unwrap();
        assert!(
            fix.status.code().unwrap_or(8) <= 1,
            "round {round}: e2fsck -fy: {}",
            String::from_utf8_lossy(&fix.stdout)
        );
        let (ok, out) = fsck_clean(&raw);
        assert!(
            ok,
            "round {round}: after journal recovery, e2fsck -fn: {out}"
        );
        for (name, sha) in &synced {
            let path = name.strip_prefix("/mnt").unwrap();
            assert_eq!(
                &debugfs_sha(&raw, path, d.path()),
                sha,
                "round {round}: {name}"
            );
        }
    }
}

#[test]
fn a_corrupt_or_truncated_metadata_file_is_refused_with_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    let vol = d.path().join("vol");
    let r = run(&["dedup", "create", vol.to_str().unwrap(), "--size", "64MiB"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let meta = vol.join("meta");
    let good = std::fs::read(&meta).unwrap();
    let disk = format!("{},dedup", vol.display());
    for (what, bytes) in [
        ("truncated", good[..good.len() / 3].to_vec()),
        ("no valid superblock", vec![0xA5; good.len()]),
    ] {
        std::fs::write(&meta, &bytes).unwrap();
        for args in [
            vec!["dedup", "info", vol.to_str().unwrap()],
            vec!["dedup", "check", vol.to_str().unwrap()],
            vec!["run", "--disk", &disk, "--", "true"],
        ] {
            let r = run(&args);
            assert_eq!(r.code, Some(1), "{args:?}: {r:?}");
            assert!(r.stderr.contains(what), "{args:?}: {r:?}");
            assert!(!r.stderr.contains("panicked"), "{r:?}");
        }
    }
    let r = run(&[
        "run",
        "--disk",
        &format!("{},dedup", d.path().display()),
        "--",
        "true",
    ]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains("not a dedup volume"), "{r:?}");
}

/// Freed chunks are used again. A 256 MiB volume has 288 MiB of chunks; the guest writes
/// 160 MiB of random data, deletes and discards it, `vmsight dedup gc` frees its chunks while
/// the VM runs, and the guest writes another 160 MiB of random data: 320 MiB of distinct blocks
/// in all, more than the volume holds, so the second file fits only if the allocator reuses
/// the first file's freed chunks. The oracles are the host's allocated blocks of the sparse
/// data file (it grows by less than the second file: part of it landed on reused chunks, and it
/// never exceeds the volume's chunks) and the second file's bytes read back by the guest after
/// dropping its caches and by debugfs from an export, against the guest's sha256sum at write
/// time. Without the gc the second write runs out of chunks.
#[test]
fn after_gc_new_writes_reuse_the_freed_chunks_and_the_data_file_does_not_grow_past_them() {
    let d = tempfile::tempdir().unwrap();
    let vol = volume_with_ext4(d.path());
    let chunks = info(&vol)["physical_blocks"].as_u64().unwrap();
    let disk = format!("{},dedup", vol.display());
    let mut vm = Command::new(vmsight_bin())
        .args(["run", "--disk", &disk, "--", "sh", "-c"])
        .arg(
            "set -e; mount /dev/vdb /mnt; head -c 160M /dev/urandom > /mnt/a; sync; \
             echo WROTE_A; read go; rm /mnt/a; sync; fstrim /mnt; echo TRIMMED; read go; \
             head -c 160M /dev/urandom | tee /mnt/b | sha256sum | sed 's/ .*//;s/^/WRITTEN /'; \
             sync; echo 3 > /proc/sys/vm/drop_caches; \
             sha256sum /mnt/b | sed 's/ .*//;s/^/READ /'; umount /mnt",
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = vm.stdin.take().unwrap();
    let mut out = BufReader::new(vm.stdout.take().unwrap());
    let mut wait_for = |what: &str| {
        let mut line = String::new();
        while out.read_line(&mut line).unwrap() > 0 && !line.contains(what) {
            line.clear();
        }
        assert!(line.contains(what), "the guest never printed {what}");
    };
    wait_for("WROTE_A");
    let allocated_a = data_allocated(&vol);
    assert!(
        allocated_a >= 160 << 20,
        "the host allocated {allocated_a} bytes for 160 MiB"
    );
    {
        use std::io::Write;
        writeln!(stdin, "go").unwrap();
    }
    wait_for("TRIMMED");
    let g = run(&["dedup", "gc", vol.to_str().unwrap()]);
    assert_eq!(g.code, Some(0), "{g:?}");
    let freed = number_after(&g.stdout, "freed ").unwrap_or_else(|| panic!("no count in {g:?}"));
    assert!(
        freed >= 40_960,
        "gc freed {freed} chunks of the 40960 of /mnt/a: {g:?}"
    );
    {
        use std::io::Write;
        writeln!(stdin, "go").unwrap();
    }
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut vm.stderr.take().unwrap(), &mut err).unwrap();
    let status = vm.wait().unwrap();
    assert!(status.success(), "the guest failed: {rest}\n{err}");
    let written = number_line(&rest, "WRITTEN ");
    assert_eq!(
        number_line(&rest, "READ "),
        written,
        "the guest read back other bytes"
    );
    let allocated_b = data_allocated(&vol);
    let grown = allocated_b.saturating_sub(allocated_a);
    assert!(
        grown + (16 << 20) < 160 << 20,
        "the data file grew by {grown} bytes for the second 160 MiB: no freed chunk was reused"
    );
    // st_blocks also counts the host file system's own extent-tree blocks of the file (one
    // 4 KiB block was seen); 1 MiB covers them.
    assert!(
        allocated_b <= chunks * 4096 + (1 << 20),
        "the data file holds {allocated_b} bytes, more than the volume's {chunks} chunks"
    );
    check_clean(&vol);
    let raw = export_checked(&vol, d.path());
    assert_eq!(debugfs_sha(&raw, "/b", d.path()), written);
}

/// The value after `prefix` on its line of `out`.
fn number_line(out: &str, prefix: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in {out}"))
        .trim()
        .to_string()
}
