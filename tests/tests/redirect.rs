//! vCPU redirection (`vmsight cpu NAME redirect`, docs/platforms.md): on QEMU 11.1 (plugin API
//! v7) a vCPU taken at a guest syscall runs a guest function and comes back with every register
//! as it was; the guest program checks every register itself after the syscall (the oracle),
//! and vmsight's own restore check must agree. On QEMU 10.0 (API v4) the request is refused
//! with the API it needs.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use serde_json::Value;
use vmsight_tests::*;

/// What `redirect-probe` prints first.
struct Probe {
    pid: u32,
    /// probe_fn and probe_ret, as printed (hex).
    entry: String,
    ret: String,
    /// Its syscall instruction, and the word it adds to its result.
    site: u64,
    poke: String,
}

fn probe_line(line: &str) -> Probe {
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k}= in {line:?}"))
            .to_string()
    };
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    Probe {
        pid: field("pid").parse().unwrap(),
        entry: field("fn"),
        ret: field("ret"),
        site: hex(&field("site")),
        poke: field("poke"),
    }
}

/// Starts `redirect-probe [ARGS...]` traced on `qemu`; returns the VM and its first line's
/// addresses.
fn start_probe(name: &str, qemu: &str, args: &[&str]) -> (LiveVm, Probe) {
    let mut argv = vec![
        "--name",
        name,
        "--qemu",
        qemu,
        "--trace",
        "@cmd",
        "--trace-out",
        "/dev/null",
        "--",
        "redirect-probe",
    ];
    argv.extend_from_slice(args);
    let mut vm = LiveVm::start(&argv);
    let probe = probe_line(&vm.wait_prefix("redirect-probe pid="));
    (vm, probe)
}

const ARGS: [u64; 6] = [0x1001, 0x2002, 0x3003, 0x4004, 0x5005, 0x6006];

/// Added to the function's result through a memory write before the call.
const POKE: u64 = 0x10_0000;
/// The GS base the function runs with (set through a register write).
const GS: u64 = 0x5a5a_0000;

fn redirect(name: &str, pid: u32, p: &Probe, timeout_ms: u64) -> Run {
    let pid = pid.to_string();
    let timeout = timeout_ms.to_string();
    let write = format!(
        "{}={}",
        p.poke,
        POKE.to_le_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    let gs = format!("gs_base={GS:#x}");
    let mut args = vec![
        "cpu",
        name,
        "redirect",
        "--pid",
        &pid,
        "--entry",
        &p.entry,
        "--return",
        &p.ret,
        "--write",
        &write,
        "--set",
        &gs,
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
    let (vm, p) = start_probe(&name, "trixie", &[]);

    // A trigger that never comes (no such process) times out, is cancelled, and leaves the
    // mailbox usable.
    let r = redirect(&name, 999_999, &p, 1500);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("no return within 1500 ms"), "{r:?}");

    let r = redirect(&name, p.pid, &p, 60_000);
    // Exit status 1 means a restore mismatch: checked below, after the guest's own check.
    assert!(matches!(r.code, Some(0 | 1)), "{r:?}");
    let o: Value = serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {r:?}"));
    // Taken at the probe's syscall instruction, and put back there.
    assert_eq!(o["pc"], p.site, "{o}");
    // The function ran with the arguments and the written word, and returned its result in
    // rax (and rdx); it ran with the GS base set for it.
    let want = ARGS
        .iter()
        .enumerate()
        .map(|(i, a)| (i as u64 + 1) * a)
        .sum::<u64>()
        + POKE;
    assert_eq!(o["at_return"]["rax"], want, "{o}");
    assert_eq!(o["at_return"]["rdx"], want, "{o}");
    assert_eq!(o["at_return"]["gs_base"], GS, "{o}");
    assert_eq!(o["saved"]["gs_base"], 0, "{o}");
    // It trashed the callee-saved registers (so the restore had something to do)...
    assert_eq!(o["at_return"]["r12"], 0x0bad_c0de_0bad_c0de_u64, "{o}");
    assert_ne!(o["saved"]["r12"], o["at_return"]["r12"], "{o}");
    // The guest's own check: the function ran once with these arguments and the GS base set
    // for it, and after the redirected syscall every register and the GS base held what they
    // must.
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
            "redirect-probe calls=1 result={want:#x} args={} fngs={GS:#x} gs=0 regs=intact",
            args.join(",")
        ),
        "{err} {o}"
    );
    assert_eq!(code, Some(0), "{out:?} {err}");
    // vmsight's check saw every register as saved when the vCPU came back (on a mismatch,
    // `at_check` holds what it found).
    assert_eq!(o["restore_mismatch"], serde_json::json!([]), "{o}");
    assert_eq!(r.code, Some(0), "{r:?}");
}

#[test]
fn redirect_on_qemu10_is_refused_naming_the_plugin_api_it_needs() {
    let name = vm_name("redirect10");
    let (vm, p) = start_probe(&name, "system", &["3000000"]);
    let r = redirect(&name, p.pid, &p, 5000);
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
        assert!(r.one_line_error().contains(want), "{a:?}: {r:?}");
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
