//! vCPU redirection (`vmsight cpu NAME redirect`, docs/platforms.md): on QEMU 11.1 (plugin API
//! v7) a vCPU taken at a guest syscall runs a guest function and comes back with every register
//! as it was; the guest program checks every register itself after the syscall (the oracle),
//! and vmsight's own restore check must agree. On QEMU 10.0 (API v4) the request is refused
//! with the API it needs.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use serde_json::Value;
use vmsight_tests::*;

/// The addresses `redirect-probe` prints: (pid, probe_fn, probe_ret, its syscall site).
fn probe_line(line: &str) -> (u32, String, String, u64) {
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k}= in {line:?}"))
            .to_string()
    };
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    (
        field("pid").parse().unwrap(),
        field("fn"),
        field("ret"),
        hex(&field("site")),
    )
}

const ARGS: [u64; 6] = [0x1001, 0x2002, 0x3003, 0x4004, 0x5005, 0x6006];

fn redirect(name: &str, pid: u32, entry: &str, ret: &str, timeout_ms: u64) -> Run {
    let pid = pid.to_string();
    let timeout = timeout_ms.to_string();
    let mut args = vec![
        "cpu",
        name,
        "redirect",
        "--pid",
        &pid,
        "--entry",
        entry,
        "--return",
        ret,
        "--timeout-ms",
        &timeout,
        "--json",
    ];
    let hex: Vec<String> = ARGS.iter().map(|a| format!("{a:#x}")).collect();
    for h in &hex {
        args.extend(["--arg", h.as_str()]);
    }
    run(&args)
}

#[test]
fn redirected_vcpu_runs_a_guest_function_and_comes_back_with_every_register_restored() {
    require_trixie_root();
    let name = vm_name("redirect");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--qemu",
        "trixie",
        "--trace",
        "@cmd",
        "--trace-out",
        "/dev/null",
        "--",
        "redirect-probe",
    ]);
    let (pid, entry, ret, site) = probe_line(&vm.wait_prefix("redirect-probe pid="));

    // A trigger that never comes (no such process) times out, is cancelled, and leaves the
    // mailbox usable.
    let r = redirect(&name, 999_999, &entry, &ret, 1500);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("no return within 1500 ms"), "{r:?}");

    let r = redirect(&name, pid, &entry, &ret, 60_000);
    assert_eq!(r.code, Some(0), "{r:?}");
    let o: Value = serde_json::from_str(&r.stdout).unwrap();
    // Taken at the probe's syscall instruction, and put back there.
    assert_eq!(o["pc"], site, "{o}");
    // The function ran with the arguments and returned its result in rax (and rdx).
    let want = ARGS
        .iter()
        .enumerate()
        .map(|(i, a)| (i as u64 + 1) * a)
        .sum::<u64>();
    assert_eq!(o["at_return"]["rax"], want, "{o}");
    assert_eq!(o["at_return"]["rdx"], want, "{o}");
    // It trashed the callee-saved registers (so the restore had something to do)...
    assert_eq!(o["at_return"]["r12"], 0x0bad_c0de_0bad_c0de_u64, "{o}");
    assert_ne!(o["saved"]["r12"], o["at_return"]["r12"], "{o}");
    // ... and vmsight's check saw every register as saved when the vCPU came back.
    assert_eq!(o["restore_mismatch"], serde_json::json!([]), "{o}");

    // The guest's own check: the function ran once with these arguments, and after the
    // redirected syscall every register held what it must.
    let (code, out, err) = vm.finish();
    let last = out
        .iter()
        .rev()
        .find(|l| l.starts_with("redirect-probe calls="))
        .unwrap_or_else(|| panic!("no result line: {out:?} {err}"));
    let args: Vec<String> = ARGS.iter().map(|a| format!("{a:#x}")).collect();
    assert_eq!(
        last,
        &format!(
            "redirect-probe calls=1 result={want:#x} args={} regs=intact",
            args.join(",")
        ),
        "{err}"
    );
    assert_eq!(code, Some(0), "{out:?} {err}");
}

#[test]
fn redirect_on_qemu10_is_refused_naming_the_plugin_api_it_needs() {
    let name = vm_name("redirect10");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--qemu",
        "system",
        "--trace",
        "@cmd",
        "--trace-out",
        "/dev/null",
        "--",
        "redirect-probe",
        "3000000",
    ]);
    let (pid, entry, ret, _) = probe_line(&vm.wait_prefix("redirect-probe pid="));
    let r = redirect(&name, pid, &entry, &ret, 5000);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(
        r.stderr.contains("needs plugin API 7") && r.stderr.contains("uses API 4"),
        "{r:?}"
    );
    // Nothing was redirected: the probe runs out its iterations uncalled.
    let (code, out, err) = vm.finish();
    assert!(
        out.iter().any(|l| l == "redirect-probe calls=0 exhausted"),
        "{out:?} {err}"
    );
    assert_eq!(code, Some(2), "{out:?} {err}");
}

#[test]
fn bad_redirect_requests_are_one_line_errors() {
    for (args, want) in [
        (vec!["--pid", "0", "--entry", "0x1000"], "TGID 0"),
        (vec!["--pid", "5", "--entry", "0"], "entry address is 0"),
        (
            vec!["--pid", "5", "--entry", "0x1", "--set", "rip=1"],
            "not a register that can be set",
        ),
        (
            vec!["--pid", "5", "--entry", "0x1", "--write", "0x10=abc"],
            "even number of hex digits",
        ),
        (
            vec!["--pid", "5", "--entry", "0x1", "--timeout-ms", "0"],
            "timeout must be between",
        ),
    ] {
        let mut a = vec!["cpu", "no-such-vm", "redirect"];
        a.extend(args.iter().copied());
        let r = run(&a);
        assert_ne!(r.code, Some(0), "{a:?}: {r:?}");
        assert!(r.stderr.contains(want), "{a:?}: {r:?}");
        assert_eq!(r.stderr.trim().lines().count(), 1, "{a:?}: {r:?}");
    }
    let r = run(&[
        "cpu",
        "no-such-vm",
        "redirect",
        "--pid",
        "5",
        "--entry",
        "0x1",
    ]);
    assert!(r.stderr.contains("no-such-vm"), "{r:?}");
}
