//! The write recorder and `vmsight replay`: a recording of a real guest's disk, replayed over a
//! copy of the image it started from (taken before the guest wrote anything), gives the same
//! file events as the live run did. The base copy differs from the final image in the blocks
//! the recording writes, the replay leaves that copy untouched (it works on a scratch copy of
//! its own), and a replay over the final image instead does not give the live events: the
//! base is what the engine reads.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeMap;
use std::path::Path;

use sha2::{Digest, Sha256};
use vmsight_blockdev::tap::{read_recording, TapKind};
use vmsight_tests::*;

fn sha256_of(path: &Path) -> Vec<u8> {
    Sha256::digest(std::fs::read(path).unwrap()).to_vec()
}

/// 4 KiB blocks the recording writes whose bytes differ between `base` and `fin`.
fn recorded_blocks_that_differ(rec: &Path, base: &Path, fin: &Path) -> usize {
    let (base, fin) = (std::fs::read(base).unwrap(), std::fs::read(fin).unwrap());
    assert_eq!(base.len(), fin.len(), "the run changed the image size");
    let mut blocks = std::collections::BTreeSet::new();
    for ev in read_recording(rec).unwrap() {
        if let TapKind::Write { offset, len, .. } | TapKind::WriteZeroes { offset, len } = ev.kind {
            blocks.extend((offset / 4096)..(offset + len).div_ceil(4096));
        }
    }
    blocks
        .into_iter()
        .filter(|b| {
            let r = (b * 4096) as usize..((b + 1) * 4096).min(fin.len() as u64) as usize;
            base[r.clone()] != fin[r]
        })
        .count()
}

/// `vmsight replay BASE REC --mount /srv`.
fn replay_run(base: &Path, rec: &Path) -> Run {
    run(&[
        "replay",
        base.to_str().unwrap(),
        rec.to_str().unwrap(),
        "--mount",
        "/srv",
    ])
}

/// The events of a replay that must succeed.
fn replay_events(base: &Path, rec: &Path) -> Vec<(u64, String, String, String, String)> {
    let out = replay_run(base, rec);
    assert_eq!(out.code, Some(0), "{out:?}");
    events(&out.stdout)
}

/// (seq, type, path, old_path, range) of each event line, ignoring host/vm names and times.
fn events(jsonl: &str) -> Vec<(u64, String, String, String, String)> {
    jsonl
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["seq"].as_u64().unwrap(),
                v["type"].as_str().unwrap().to_string(),
                v["path"].as_str().unwrap().to_string(),
                v["old_path"].as_str().unwrap_or("").to_string(),
                v["range"].to_string(),
            )
        })
        .collect()
}

#[test]
fn replaying_a_recording_gives_the_live_events() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("data.img");
    make_ext4(&img, 128);
    let base = dir.path().join("base.img");
    std::fs::copy(&img, &base).unwrap();
    let rec = dir.path().join("data.rec");
    let live = dir.path().join("live.jsonl");
    let r = guest_sh(
        &[
            "--disk",
            &format!("{},mount=/srv", img.display()),
            "--record-writes",
            &format!("1:{}", rec.display()),
            "--events",
            live.to_str().unwrap(),
        ],
        "set -e; mkdir -p /srv; mount /dev/vdb /srv; cd /srv; mkdir -p a/b; \
         seq 1 5000 > a/b/numbers; sync; mv a/b/numbers a/n; ln -s n a/link; chmod 700 a; \
         sync; rm a/n; sync; cd /; umount /srv",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let live_events = events(&std::fs::read_to_string(&live).unwrap());
    assert!(
        live_events.len() >= 6,
        "the live run produced too few events: {live_events:?}"
    );

    // The base copy is not the final image where the recording writes: a replay reading the
    // final image would see bytes the guest had not written yet.
    let differ = recorded_blocks_that_differ(&rec, &base, &img);
    assert!(
        differ > 0,
        "the base copy equals the final image in every recorded block"
    );
    let base_sha = sha256_of(&base);
    let replayed = replay_events(&base, &rec);
    assert_eq!(replayed, live_events, "replay differs from the live run");
    assert_eq!(
        sha256_of(&base),
        base_sha,
        "the replay changed its base image"
    );
    // Over the final image the same recording does not give the live events (or fails).
    let over_final = replay_run(&img, &rec);
    println!(
        "{differ} recorded blocks differ between base and final image; replay over the final \
         image: exit {:?}, {} events (live {}), stderr {:?}",
        over_final.code,
        over_final.stdout.lines().count(),
        live_events.len(),
        over_final.stderr
    );
    assert!(
        over_final.code != Some(0) || events(&over_final.stdout) != live_events,
        "a replay over the final image gives the live events: the base is not what is read"
    );
    let kinds: BTreeMap<String, usize> = replayed.iter().fold(BTreeMap::new(), |mut m, e| {
        *m.entry(e.1.clone()).or_default() += 1;
        m
    });
    for k in ["mkdir", "create", "rename", "symlink", "chmod", "delete"] {
        assert!(kinds.contains_key(k), "no {k} event in {replayed:?}");
    }
    assert!(replayed
        .iter()
        .any(|e| e.1 == "rename" && e.2 == "/srv/a/n" && e.3 == "/srv/a/b/numbers"));

    // A damaged recording is a clear error, not a crash.
    let bad = dir.path().join("bad.rec");
    std::fs::write(&bad, b"garbage!").unwrap();
    let out = run(&["replay", base.to_str().unwrap(), bad.to_str().unwrap()]);
    assert_ne!(out.code, Some(0));
    assert!(
        out.stderr.contains("not a vmsight write recording"),
        "{out:?}"
    );
}
