//! The write recorder and `vmsight replay`: a recording of a real guest's disk, replayed over a
//! copy of the image it started from, gives the same file events as the live run did.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeMap;

use vmsight_tests::*;

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

    let out = run(&[
        "replay",
        base.to_str().unwrap(),
        rec.to_str().unwrap(),
        "--mount",
        "/srv",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let replayed = events(&out.stdout);
    assert_eq!(replayed, live_events, "replay differs from the live run");
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
