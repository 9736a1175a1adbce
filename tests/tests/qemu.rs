//! Choosing QEMU (`--qemu`, `VMSIGHT_QEMU`; docs/platforms.md): the default guest boots on the
//! QEMU 11 of the trixie root (`make qemu11`), the run reports which QEMU it used, and QEMU
//! choices that cannot work are one-line errors before anything boots.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use vmsight_tests::*;

#[test]
fn qemu11_boots_the_default_guest_without_the_plugin_and_reports_its_version() {
    require_trixie_root();
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.json");
    let name = vm_name("qemu11");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--qemu",
        "trixie",
        "--no-plugin",
        "--stats",
        "--stats-json",
        stats.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        "cat /proc/version; echo up; read line; echo \"got $line\"",
    ]);
    vm.wait_line("up");
    // The host's /proc agrees with what vmsight reports below: the trixie root's QEMU runs.
    let (exe, argv) = qemu_process(&name);
    assert!(
        exe.to_string_lossy().contains("/qemu/trixie-")
            && argv
                .iter()
                .any(|a| a.contains("/qemu/trixie-") && a.ends_with("/usr/bin/qemu-system-x86_64")),
        "{exe:?} {argv:?}"
    );

    // While it runs, `vmsight ps` shows the QEMU it runs on.
    let ps = run(&["ps", "--json"]);
    assert_eq!(ps.code, Some(0), "{ps:?}");
    let vms: serde_json::Value = serde_json::from_str(&ps.stdout).unwrap();
    let rec = vms
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name.as_str())
        .unwrap_or_else(|| panic!("{name} is not in `vmsight ps --json`: {}", ps.stdout));
    assert_eq!(rec["qemu"]["kind"], "trixie", "{rec}");
    assert!(
        rec["qemu"]["version"]
            .as_str()
            .unwrap()
            .starts_with("11.1."),
        "{rec}"
    );
    assert_eq!(rec["qemu"]["plugin_api"], 7, "{rec}");
    assert!(
        rec["plugin_api"].is_null(),
        "no plugin, no API in use: {rec}"
    );
    let table = run(&["ps"]);
    let row = table
        .stdout
        .lines()
        .find(|l| l.starts_with(&name))
        .unwrap_or_else(|| panic!("{name} is not in `vmsight ps`: {}", table.stdout));
    assert!(row.contains("11.1.") && row.contains("(trixie)"), "{row}");

    vm.send("hello");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "stdout {out:?}, stderr {err}");
    assert!(
        out.iter().any(|l| l.starts_with("Linux version ")),
        "{out:?}"
    );
    assert!(out.iter().any(|l| l == "got hello"), "{out:?}");

    // The stats say which QEMU ran: text (stderr) and JSON.
    assert!(
        err.lines()
            .any(|l| l.trim_start().starts_with("qemu 11.1.") && l.contains("(trixie)")),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    assert_eq!(v["qemu"]["kind"], "trixie", "{v}");
    assert!(
        v["qemu"]["version"].as_str().unwrap().starts_with("11.1."),
        "{v}"
    );
    assert!(
        v["qemu"]["version_line"]
            .as_str()
            .unwrap()
            .starts_with("QEMU emulator version 11.1."),
        "{v}"
    );
    assert_eq!(v["qemu_version"], v["qemu"]["version"], "{v}");
    assert!(
        v["plugin_api"].is_null() && v["plugin_attached"].is_null(),
        "{v}"
    );
}

/// The QEMU process of VM `name`, as the host's /proc shows it: the file it executes and its
/// argument vector (the pid from `vmsight ps --json`).
fn qemu_process(name: &str) -> (std::path::PathBuf, Vec<String>) {
    let ps = run(&["ps", "--json"]);
    let vms: serde_json::Value = serde_json::from_str(&ps.stdout).unwrap();
    let rec = vms
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("{name} is not in `vmsight ps --json`: {}", ps.stdout));
    let pid = rec["qemu_pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("no QEMU pid: {rec}"));
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let argv = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    (exe, argv)
}

/// The default QEMU (`--qemu auto`, which `--qemu` given on the command line makes sure of
/// whatever `VMSIGHT_QEMU` says) is the trixie root's QEMU 11.1, not the
/// host's QEMU 10 with its TCG section race (docs/launcher.md). The oracle is the host's
/// /proc: the process executes the root's own loader with the root's QEMU binary as its
/// program, and nothing under /usr/bin.
#[test]
fn the_default_qemu_is_the_trixie_roots_as_the_hosts_proc_shows() {
    require_trixie_root();
    let name = vm_name("qemu-default");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--qemu",
        "auto",
        "--",
        "sh",
        "-c",
        "echo up; read line",
    ]);
    vm.wait_line("up");
    let (exe, argv) = qemu_process(&name);
    vm.send("done");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "stdout {out:?}, stderr {err}");
    // `<cache>/qemu/trixie-<recipe>/root`, the root whose loader QEMU runs through.
    let exe_s = exe.to_string_lossy().into_owned();
    let at = exe_s
        .find("/qemu/trixie-")
        .unwrap_or_else(|| panic!("QEMU does not run from the trixie root: {exe:?}"));
    let end = at
        + exe_s[at..]
            .find("/root/")
            .unwrap_or_else(|| panic!("{exe:?}"))
        + "/root".len();
    let root = &exe_s[..end];
    assert!(
        exe_s.contains("ld-linux"),
        "QEMU runs through the trixie root's loader: {exe:?}"
    );
    assert!(
        argv.iter()
            .any(|a| a.starts_with(root) && a.ends_with("/usr/bin/qemu-system-x86_64")),
        "the root's QEMU is the program: {argv:?}"
    );
    assert!(
        !argv.iter().any(|a| a == "/usr/bin/qemu-system-x86_64"),
        "{argv:?}"
    );
}

#[test]
fn unusable_qemu_choices_are_one_line_errors_before_boot() {
    let empty_cache = tempfile::tempdir().unwrap();

    let r = run(&["run", "--qemu", "/nonexistent", "--", "true"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    let line = r.one_line_error();
    assert!(
        line.starts_with("vmsight: QEMU was not found: looked for `/nonexistent`"),
        "{line}"
    );

    // `--qemu trixie`, and VMSIGHT_QEMU=trixie without --qemu, need the root.
    for (args, env) in [
        (vec!["run", "--qemu", "trixie", "--", "true"], None),
        (vec!["run", "--", "true"], Some("trixie")),
    ] {
        let mut c = vmsight();
        c.env("VMSIGHT_CACHE", empty_cache.path()).args(&args);
        if let Some(v) = env {
            c.env("VMSIGHT_QEMU", v);
        }
        let r = Run::from(c.output().unwrap());
        assert_eq!(r.code, Some(1), "{args:?} {env:?}: {r:?}");
        let line = r.one_line_error();
        assert!(
            line.contains(
                "the QEMU 11 trixie root is not built: run `make qemu11` (scripts/build-qemu-trixie.sh)"
            ),
            "{args:?} {env:?}: {line}"
        );
    }

    let r = run(&["run", "--qemu", "", "--", "true"]);
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(r.one_line_error().contains("auto, system, trixie"), "{r:?}");

    // A QEMU whose plugin API the plugin does not speak (10.1: API 5) is refused when the
    // plugin would be loaded, with what to do instead.
    let fake = empty_cache.path().join("qemu-10.1");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'QEMU emulator version 10.1.0 (fake)'\nexit 0\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = run(&["run", "--qemu", fake.to_str().unwrap(), "--", "true"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    let line = r.one_line_error();
    assert!(
        line.contains("QEMU 10.1.0 (path, ")
            && line.contains("plugin API 5")
            && line.contains("--no-plugin"),
        "{line}"
    );
}
