//! The symbiotic interface (`vmsight run --symbiotic`, docs/symbiotic.md): discovery, the SymSpy
//! page and symcalls into the guest module `vmsight_sym`, checked against the guest's own view
//! (`uname`, `/proc/meminfo`, `/proc/swaps`, `/proc/PID/{exe,cwd,fd,stat,comm}` and
//! `/proc/PID/pagemap`, read in the guest by its own tools), never against vmsight itself.
//! Also: the module without vmsight's device, a module of another interface version, and a
//! hostile guest (garbage in the shared region, a flood of doorbells, a handler that does not
//! return in time).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;
use vmsight_tests::*;

/// `key=value` words of a line.
fn fields(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn sym(args: &[&str]) -> Run {
    let mut a = vec!["sym"];
    a.extend_from_slice(args);
    run(&a)
}

/// A symcall's JSON answer (`{"reply", "decoded", "errno"}`); panics if the call failed on
/// vmsight's side.
fn call(name: &str, transport: &str, f: &str, args: &[String]) -> Value {
    let mut a = vec![name, "call", f, "--json", "--transport", transport];
    a.extend(args.iter().map(String::as_str));
    let r = sym(&a);
    assert!(r.code == Some(0) || r.code == Some(1), "{r:?}");
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {r:?}"))
}

fn spy(name: &str) -> Value {
    let r = sym(&[name, "spy", "--json"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    serde_json::from_str(&r.stdout).unwrap()
}

/// Waits until the handshake is done (the module loads during the guest's boot).
fn wait_active(name: &str) -> Value {
    let mut last = Value::Null;
    wait_until("the symbiotic interface to become active", 120, || {
        last = spy(name);
        last["guest_state"] == "active" && last["vmm_state"] == "accepted"
    });
    last
}

/// The guest side of the oracle checks: a swap file, a sleeper with a known cwd and fd 7, a
/// busy loop pinned to CPU 1 and a process with pages present, swapped out and never touched,
/// each described by the guest's own tools; then it waits for a line on stdin. A getppid loop
/// runs throughout: it stops with an error if a symcall ever disturbed the code it
/// interrupted (registers or flags not restored), reported at the end.
const ORACLE_SCRIPT: &str = r#"
set -e
dd if=/dev/zero of=/swapfile bs=1M count=32 2>/dev/null
chmod 600 /swapfile
mkswap /swapfile >/dev/null
swapon /swapfile
echo "hints $(tr '\n' ';' < /sys/module/vmsight_sym/parameters/hints)"
echo "uname r=$(uname -r)"
echo "version $(uname -v)"
echo "meminfo total=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo) swaptotal=$(awk '/^SwapTotal:/ {print $2}' /proc/meminfo)"
awk 'NR > 1 {print "swaps path=" $1 " size=" $3 " prio=" $5}' /proc/swaps
(cd /tmp && exec 7</etc/hostname && exec sleep 600) &
S=$!
while [ "$(cat /proc/$S/comm)" != sleep ]; do sleep 0.1; done
echo "sleeper pid=$S exe=$(readlink /proc/$S/exe) cwd=$(readlink /proc/$S/cwd) fd7=$(readlink /proc/$S/fd/7) comm=$(cat /proc/$S/comm) ppid=$(awk '{print $4}' /proc/$S/stat)"
taskset -c 1 sh -c 'while :; do :; done' &
B=$!
echo "busy pid=$B"
getppid_loop 1000000000 2> /tmp/gp.err &
G=$!
sleep 600 | pageout-probe 8 > /tmp/pp.out &
while ! grep -q pid= /tmp/pp.out 2>/dev/null; do sleep 0.1; done
line=$(cat /tmp/pp.out)
echo "$line"
P=$(echo "$line" | sed 's/.*pid=\([0-9]*\).*/\1/')
base=$(echo "$line" | sed 's/.*base=\(0x[0-9a-f]*\).*/\1/')
i=0
while [ $i -lt 8 ]; do
    echo "pagemap i=$i $(sym-pagemap $P $((base + i * 4096)))"
    i=$((i + 1))
done
echo ready
read x
kill $S $B $G
echo "getppid-errors=$(wc -c < /tmp/gp.err)"
for c in doorbell_calls sync_calls stale_answers spurious_doorbells; do
    echo "module $c=$(cat /sys/module/vmsight_sym/parameters/$c)"
done
echo end
"#;

fn lines_with<'a>(seen: &'a [String], prefix: &str) -> Vec<&'a String> {
    seen.iter().filter(|l| l.starts_with(prefix)).collect()
}

fn one(seen: &[String], prefix: &str) -> HashMap<String, String> {
    let l = lines_with(seen, prefix);
    assert_eq!(l.len(), 1, "{prefix}: {seen:?}");
    fields(l[0])
}

/// Every check of the oracle script over one transport.
fn check_against_the_guest(name: &str, vm: &mut LiveVm, transport: &str) {
    vm.wait_line("ready");
    let seen = vm.seen().to_vec();
    let s = wait_active(name);
    let g = &s["guest"];

    // vmsight -> guest: the module shows the VM's one disk (the root disk, writable and
    // streamed) as vmsight described it.
    let hints = seen.iter().find_map(|l| l.strip_prefix("hints ")).unwrap();
    assert_eq!(hints.matches("disk ").count(), 1, "{hints}");
    assert!(
        hints.starts_with("disk 0 ") && hints.contains("streamed"),
        "{hints}"
    );
    assert!(!hints.contains("read-only"), "{hints}");

    // SymSpy: the kernel, memory, swap devices.
    assert_eq!(g["release"], one(&seen, "uname ")["r"].as_str(), "{s}");
    let version = seen
        .iter()
        .find_map(|l| l.strip_prefix("version "))
        .unwrap();
    assert_eq!(g["version"], version, "{s}");
    let mem = one(&seen, "meminfo ");
    assert_eq!(g["mem"]["mem_total_kib"].to_string(), mem["total"], "{s}");
    let swaps = one(&seen, "swaps ");
    // Within the refresh interval the page has the swap file the guest just enabled.
    wait_until("SymSpy to show the swap file", 30, || {
        let s = spy(name);
        s["guest"]["swaps"].as_array().is_some_and(|a| a.len() == 1)
            && s["guest"]["mem"]["swap_total_kib"].as_u64() == mem["swaptotal"].parse().ok()
    });
    let s = spy(name);
    let sw = &s["guest"]["swaps"][0];
    assert_eq!(sw["path"], swaps["path"].as_str(), "{s}");
    assert_eq!(sw["size_kib"].to_string(), swaps["size"], "{s}");
    assert_eq!(sw["prio"].to_string(), swaps["prio"], "{s}");
    assert_eq!(sw["blockdev"], false, "a swap file: {s}");
    assert!(s["problems"].as_array().unwrap().is_empty(), "{s}");
    // The per-CPU current task: CPU 1 runs the pinned busy loop (nearly always).
    let busy = one(&seen, "busy ")["pid"].clone();
    wait_until("SymSpy to show the busy loop on CPU 1", 30, || {
        spy(name)["guest"]["cpus"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["cpu"] == 1 && c["tgid"].as_i64() == busy.parse().ok())
    });

    // echo returns its arguments.
    let e = call(
        name,
        transport,
        "echo",
        &[
            "1".into(),
            "0x22".into(),
            "3".into(),
            "4".into(),
            "5".into(),
        ],
    );
    assert_eq!(
        e["decoded"]["values"],
        serde_json::json!([1, 0x22, 3, 4, 5]),
        "{e}"
    );
    assert_eq!(e["reply"]["transport"], transport, "{e}");

    // task_info and fd_path against /proc.
    let sl = one(&seen, "sleeper ");
    let t = call(name, transport, "task_info", &[sl["pid"].clone()]);
    let d = &t["decoded"];
    assert_eq!(d["exe"], sl["exe"].as_str(), "{t}");
    assert_eq!(d["cwd"], sl["cwd"].as_str(), "{t}");
    assert_eq!(d["comm"], sl["comm"].as_str(), "{t}");
    assert_eq!(d["ppid"].to_string(), sl["ppid"], "{t}");
    assert_eq!(d["tgid"].to_string(), sl["pid"], "{t}");
    let f = call(name, transport, "fd_path", &[sl["pid"].clone(), "7".into()]);
    assert_eq!(f["decoded"]["path"], sl["fd7"].as_str(), "{f}");
    // Both directions: what the guest does not have is not invented.
    let f = call(
        name,
        transport,
        "fd_path",
        &[sl["pid"].clone(), "99".into()],
    );
    assert_eq!(f["errno"], "EBADF", "{f}");
    let t = call(name, transport, "task_info", &["999999".into()]);
    assert_eq!(t["errno"], "ESRCH", "{t}");

    // page_info against /proc/PID/pagemap, page by page: present, swapped (with its entry)
    // and never touched.
    let pp = one(&seen, "pageout-probe ");
    let base = u64::from_str_radix(pp["base"].trim_start_matches("0x"), 16).unwrap();
    let (mut present, mut swapped) = (0, 0);
    for l in lines_with(&seen, "pagemap ") {
        let m = fields(l);
        let i: u64 = m["i"].parse().unwrap();
        let addr = format!("{:#x}", base + i * 4096);
        let p = call(name, transport, "page_info", &[pp["pid"].clone(), addr]);
        let d = &p["decoded"];
        assert_eq!(d["present"], m["present"] == "1", "page {i}: {p} vs {l}");
        assert_eq!(d["swapped"], m["swapped"] == "1", "page {i}: {p} vs {l}");
        if m["present"] == "1" {
            present += 1;
            assert_eq!(d["pfn"].to_string(), m["pfn"], "page {i}: {p} vs {l}");
        }
        if m["swapped"] == "1" {
            swapped += 1;
            assert_eq!(
                d["swap_type"].to_string(),
                m["swap_type"],
                "page {i}: {p} vs {l}"
            );
            assert_eq!(
                d["swap_offset"].to_string(),
                m["swap_offset"],
                "page {i}: {p} vs {l}"
            );
        }
        assert_eq!(d["vma"]["write"], true, "an anonymous rw mapping: {p}");
    }
    assert!(
        present >= 3 && swapped >= 1,
        "the probe's pages: {present} present, {swapped} swapped"
    );

    // swap_info agrees with /proc/swaps too.
    let w = call(name, transport, "swap_info", &[]);
    assert_eq!(
        w["decoded"]["devices"][0]["path"],
        swaps["path"].as_str(),
        "{w}"
    );

    // Many calls in a row while the guest works: every answer is the call's own.
    let r = sym(&[
        name,
        "call",
        "echo",
        "1",
        "--repeat",
        "2000",
        "--transport",
        transport,
    ]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("2000 ok, 0 failed, 0 wrong"), "{r:?}");
}

/// After the oracle script's end: the guest's own getppid loop never saw a wrong result.
/// Returns the module's own call counters (its `/sys/module/vmsight_sym/parameters`), by name.
fn finish_oracle(mut vm: LiveVm) -> BTreeMap<String, u64> {
    vm.send("go");
    vm.wait_line("end");
    let (code, seen, err) = vm.finish();
    assert_eq!(code, Some(0), "{err}");
    assert!(seen.iter().any(|l| l == "getppid-errors=0"), "{seen:?}");
    let module: BTreeMap<String, u64> = seen
        .iter()
        .filter_map(|l| l.strip_prefix("module ")?.split_once('='))
        .map(|(k, v)| (k.to_string(), v.trim().parse().unwrap()))
        .collect();
    assert_eq!(module.len(), 4, "the module's counters: {seen:?}");
    module
}

/// VM `name` with the symbiotic interface on QEMU `qemu` (`system`: 10, `trixie`: 11.1),
/// `extra` options and `sh -c script`.
fn start_symbiotic(name: &str, qemu: &str, extra: &[&str], script: &str) -> LiveVm {
    let mut args = vec!["--name", name, "--qemu", qemu, "--symbiotic"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    LiveVm::start(&args)
}

/// [`start_symbiotic`] on QEMU 10.
fn start_on_qemu10(name: &str, extra: &[&str], script: &str) -> LiveVm {
    start_symbiotic(name, "system", extra, script)
}

#[test]
fn symcalls_and_symspy_over_the_doorbell_answer_what_the_guest_itself_sees() {
    let name = vm_name("sym-doorbell");
    // QEMU 10 (plugin API 4): the doorbell is the only transport there.
    let mut vm = start_on_qemu10(&name, &[], ORACLE_SCRIPT);
    check_against_the_guest(&name, &mut vm, "doorbell");
    let s = spy(&name);
    assert!(
        s["counters"]["calls_doorbell"].as_u64().unwrap() >= 2000,
        "{s}"
    );
    assert_eq!(
        s["counters"]["calls_sync"], 0,
        "QEMU 10 has no synchronous transport: {s}"
    );
    // Asking for the synchronous transport on QEMU 10 says why it is not there.
    let r = sym(&[&name, "call", "echo", "1", "--transport", "sync"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("plugin API"), "{r:?}");
    // The module's own counters: it answered exactly the calls vmsight counted, all by
    // doorbell, none replaced. (Its `spurious_doorbells`, interrupts that found no call
    // posted, are not checked: 6 were seen in 2014 calls, an interrupt arriving after the
    // module had already taken its call.)
    let module = finish_oracle(vm);
    assert_eq!(
        serde_json::json!(module["doorbell_calls"]),
        s["counters"]["calls_doorbell"],
        "module {module:?}, vmsight {s}"
    );
    assert_eq!(module["sync_calls"], 0, "{module:?}");
    assert_eq!(module["stale_answers"], 0, "{module:?}");
}

#[test]
fn symcalls_over_the_synchronous_transport_on_qemu11_answer_what_the_guest_itself_sees() {
    require_trixie_root();
    let name = vm_name("sym-sync");
    let mut vm = start_symbiotic(&name, "trixie", &[], ORACLE_SCRIPT);
    check_against_the_guest(&name, &mut vm, "sync");
    let s = spy(&name);
    // The mechanism engaged: the calls went through the vCPU redirection, not the doorbell.
    assert!(s["counters"]["calls_sync"].as_u64().unwrap() >= 2000, "{s}");
    assert_eq!(s["counters"]["calls_doorbell"], 0, "{s}");
    assert!(
        s["transports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t == "sync"),
        "{s}"
    );
    // Both transports behind one API: the doorbell still works on QEMU 11.
    let e = call(&name, "doorbell", "echo", &["7".into()]);
    assert_eq!(e["decoded"]["values"][0], 7, "{e}");
    // The module's own counters: the synchronous entries vmsight counted, and the one
    // doorbell call after them.
    let module = finish_oracle(vm);
    assert_eq!(
        serde_json::json!(module["sync_calls"]),
        s["counters"]["calls_sync"],
        "module {module:?}, vmsight {s}"
    );
    assert_eq!(module["doorbell_calls"], 1, "{module:?}");
    assert_eq!(module["stale_answers"], 0, "{module:?}");
}

/// An idle guest has every vCPU halted: nobody would take a synchronous call until an
/// interrupt, so vmsight rings the guest at once (the plugin's idle and resume callbacks say
/// so) instead of waiting for a running vCPU first; every call is still answered right.
/// `vmsight sym NAME call echo 1 --repeat N --transport sync` with `extra` options.
fn repeat_sync_echo(name: &str, n: u32, extra: &[&str]) -> Run {
    let n = n.to_string();
    let mut a = vec![
        name,
        "call",
        "echo",
        "1",
        "--repeat",
        &n,
        "--transport",
        "sync",
    ];
    a.extend_from_slice(extra);
    sym(&a)
}

#[test]
fn synchronous_calls_to_an_idle_guest_ring_it_at_once_and_are_answered() {
    require_trixie_root();
    let name = vm_name("sym-idle");
    let mut vm = start_symbiotic(&name, "trixie", &[], "echo ===UP; read x");
    vm.wait_line("===UP");
    wait_active(&name);
    let r = repeat_sync_echo(&name, 300, &[]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("300 ok, 0 failed, 0 wrong"), "{r:?}");
    let s = spy(&name);
    let c = &s["counters"];
    println!("idle guest: {c}");
    assert!(c["calls_sync"].as_u64().unwrap() >= 300, "{s}");
    assert!(c["sync_wakes_idle"].as_u64().unwrap() > 0, "{s}");
    // Where the time went: the doorbell woke a halted vCPU (QEMU's own resume callback,
    // recorded by the plugin, fell between the ring and the take), and every reply's clock
    // readings are in the order the call passed them.
    let r = repeat_sync_echo(&name, 100, &["--json"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let st: Value = serde_json::from_str(&r.stdout).unwrap();
    let parts = &st["stages_us"];
    for k in ["post_to_ring", "ring_to_resume", "post_to_take", "handler"] {
        assert!(parts[k]["calls"].as_u64().unwrap_or(0) > 0, "{k}: {st}");
    }
    for _ in 0..20 {
        let a = call(&name, "sync", "echo", &["7".into()]);
        let g = &a["reply"]["stages"];
        let n = |k: &str| g[k].as_u64();
        let order = [
            n("rung_ns").unwrap_or(0),
            n("taken_ns").unwrap(),
            n("returned_ns").unwrap(),
            n("seen_ns").unwrap(),
            a["reply"]["latency_ns"].as_u64().unwrap(),
        ];
        assert!(order.windows(2).all(|w| w[0] <= w[1]), "{a}");
        if let Some(resumed) = n("resumed_ns") {
            assert!(resumed <= order[1], "resumed before the take: {a}");
        }
    }
    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
}

#[test]
fn without_vmsight_the_module_finds_no_device_and_the_guest_works_as_before() {
    // Plain QEMU from vmsight's point of view: no --symbiotic, so no fw_cfg item and no device.
    let r = guest_sh(
        &[],
        "modprobe vmsight_sym; echo rc=$?; lsmod | grep -c '^vmsight_sym' || true; \
         dmesg | grep vmsight_sym; echo works > /tmp/f && cat /tmp/f",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("rc=1"), "modprobe must fail: {r:?}");
    assert!(
        r.stdout.lines().any(|l| l == "0"),
        "the module must not stay loaded: {r:?}"
    );
    assert!(r.stdout.contains("no symbiotic VMM"), "{r:?}");
    assert!(r.stdout.contains("works"), "{r:?}");
    // And vmsight refuses symbiotic requests to such a VM with a reason (checked on a live VM).
    let name = vm_name("sym-none");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--",
        "sh",
        "-c",
        "echo up; read x; echo end",
    ]);
    vm.wait_line("up");
    let r = sym(&[&name, "spy"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("--symbiotic"), "{r:?}");
    vm.send("go");
    vm.wait_line("end");
}

#[test]
fn a_module_of_another_interface_version_is_refused_on_both_sides_and_the_right_one_accepted_again()
{
    let name = vm_name("sym-version");
    let script = "echo up; read x; rmmod vmsight_sym; modprobe vmsight_sym_v99; echo rc99=$?; \
                  lsmod | grep -c '^vmsight_sym_v99' || true; echo v99-done; read x; \
                  modprobe vmsight_sym; echo rc1=$?; echo v1-done; read x; echo end";
    let dir = tempfile::tempdir().unwrap();
    let st = dir.path().join("stats.json");
    // On QEMU 10, where every call goes over the doorbell (counted below).
    let mut vm = start_on_qemu10(&name, &["--stats-json", st.to_str().unwrap()], script);
    vm.wait_line("up");
    wait_active(&name);
    vm.send("next");
    vm.wait_line("v99-done");
    let seen = vm.seen().to_vec();
    assert!(
        seen.iter().any(|l| l.starts_with("rc99=") && l != "rc99=0"),
        "{seen:?}"
    );
    assert!(
        seen.iter().any(|l| l == "0"),
        "v99 must not stay loaded: {seen:?}"
    );
    let s = spy(&name);
    assert_eq!(s["vmm_state"], "refused", "{s}");
    assert!(s["refused"].as_str().unwrap().contains("version 99"), "{s}");
    assert!(s["counters"]["refused"].as_u64().unwrap() >= 1, "{s}");
    let r = sym(&[&name, "call", "echo", "1"]);
    assert!(
        r.stderr.contains("version 99"),
        "calls are off while refused: {r:?}"
    );
    vm.send("next");
    vm.wait_line("v1-done");
    assert!(vm.seen().iter().any(|l| l == "rc1=0"), "{:?}", vm.seen());
    wait_active(&name);
    let e = call(&name, "auto", "echo", &["5".into()]);
    assert_eq!(e["decoded"]["values"][0], 5, "{e}");
    vm.send("next");
    vm.wait_line("end");
    let (code, _, err) = vm.finish();
    assert_eq!(code, Some(0), "{err}");
    // The run's stats count both handshakes the same way.
    let stats: Value = serde_json::from_slice(&std::fs::read(&st).unwrap()).unwrap();
    let c = &stats["symbiotic"];
    assert!(c["accepted"].as_u64().unwrap() >= 2, "{stats}");
    assert!(c["refused"].as_u64().unwrap() >= 1, "{stats}");
    assert!(c["calls_doorbell"].as_u64().unwrap() >= 1, "{stats}");
}

#[test]
fn a_hostile_guest_cannot_stop_vmsight_serving_the_vm() {
    let name = vm_name("sym-hostile");
    let script = "echo up; read x; sym-hostile flood 20000; echo flooded; read x; \
                  sym-hostile garbage 3; echo garbage-done; read x; \
                  rmmod vmsight_sym; modprobe vmsight_sym; echo reloaded; read x; \
                  echo still-works > /tmp/x && cat /tmp/x; echo end";
    // On QEMU 10: the doorbell transport, whose late answers make later calls busy (the
    // synchronous transport of QEMU 11 withdraws a call that timed out instead).
    let mut vm = start_on_qemu10(&name, &[], script);
    vm.wait_line("up");
    wait_active(&name);

    // A handler that does not return in time: the caller times out, later calls are refused
    // as busy (never given the late answer), and once the guest answers calls work again.
    let r = sym(&[&name, "call", "test_spin", "3000", "--timeout-ms", "500"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("no answer within 500 ms"), "{r:?}");
    let r = sym(&[&name, "call", "echo", "1"]);
    assert!(r.stderr.contains("busy"), "{r:?}");
    wait_until("the late answer to clear the busy state", 30, || {
        sym(&[&name, "call", "echo", "9", "--json"]).code == Some(0)
    });
    let s = spy(&name);
    assert!(s["counters"]["timeouts"].as_u64().unwrap() >= 1, "{s}");
    assert!(s["counters"]["busy"].as_u64().unwrap() >= 1, "{s}");

    // A flood of doorbells: counted as spurious, and calls still answered.
    vm.send("go");
    vm.wait_line("flooded");
    let s = spy(&name);
    assert!(
        s["counters"]["doorbells_spurious"].as_u64().unwrap() > 0,
        "{s}"
    );
    let e = call(&name, "doorbell", "echo", &["11".into()]);
    assert_eq!(e["decoded"]["values"][0], 11, "{e}");

    // Garbage over the guest's page and the call page: vmsight reports problems or an
    // inactive interface, never trusts the page, and keeps answering.
    vm.send("go");
    let mut saw_problem = false;
    for _ in 0..20 {
        let r = sym(&[&name, "spy", "--json"]);
        assert_eq!(r.code, Some(0), "spy must keep answering: {r:?}");
        let s: Value = serde_json::from_str(&r.stdout).unwrap();
        saw_problem |=
            !s["problems"].as_array().unwrap().is_empty() || s["guest_state"] != "active";
        let _ = sym(&[&name, "call", "echo", "1", "--timeout-ms", "200"]);
    }
    vm.wait_line("garbage-done");
    assert!(saw_problem, "the garbage must have been noticed");
    // Reloading the module restores the interface, also when the last call of the garbage
    // phase timed out (the call page was garbage): the new module never answers its
    // predecessor's call, so vmsight must not stay busy waiting for it.
    vm.send("go");
    vm.wait_line("reloaded");
    wait_active(&name);
    let e = call(&name, "doorbell", "echo", &["12".into()]);
    assert_eq!(e["decoded"]["values"][0], 12, "{e}");
    vm.send("go");
    vm.wait_line("end");
    let (code, seen, err) = vm.finish();
    assert_eq!(code, Some(0), "{err}");
    assert!(seen.iter().any(|l| l == "still-works"), "{seen:?}");
}

/// varmail's own count of the data chunks it made durable, and vmsight's insight counters, for
/// a varmail the engine meets already inside /mnt/v (the shell's `cd` is not traced: only
/// processes named varmail are), so its relative paths select files under the `/mnt/v` filter
/// only through a looked-up working directory.
fn varmail_with_lookups(symbiotic: bool) -> (u64, Value) {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.img");
    make_ext4(&img, 1024);
    let st = dir.path().join("stats.json");
    let log = dir.path().join("ins.jsonl");
    let mut args = vec![
        "--disk",
        img.to_str().unwrap(),
        "--insights",
        log.to_str().unwrap(),
        "--insight-target",
        "varmail",
        "--insight-paths",
        "/mnt/v",
        "--stats-json",
        st.to_str().unwrap(),
    ];
    if symbiotic {
        args.push("--symbiotic");
    }
    let r = guest_sh(
        &args,
        "set -e; mkdir -p /mnt/v; mount /dev/vdb /mnt/v; cd /mnt/v
varmail -d vm -n 300 -o 20000 -s 11
cd /; umount /mnt/v",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let truth: u64 = r
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("data_chunks ")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no data_chunks in varmail's output: {r:?}"));
    let stats: Value = serde_json::from_slice(&std::fs::read(&st).unwrap()).unwrap();
    (truth, stats["insights"].clone())
}

#[test]
fn insights_classify_the_same_with_the_symcall_source_as_with_the_profile_source() {
    let (truth_p, prof) = varmail_with_lookups(false);
    let (truth_s, symc) = varmail_with_lookups(true);
    let data = |v: &Value| v["write_chunks_data"].as_u64().unwrap();
    let err = |m: u64, t: u64| m.abs_diff(t) as f64 * 100.0 / t as f64;
    println!(
        "profile source: varmail {truth_p} data chunks, vmsight {}; symcall source: varmail \
         {truth_s}, vmsight {}",
        data(&prof),
        data(&symc)
    );
    assert!(truth_p > 5000 && truth_s > 5000, "varmail wrote too little");
    // The mechanism engaged, from the source each run claims: varmail's cwd was looked up.
    assert!(
        prof["lookups_task_profile"].as_u64().unwrap() >= 1,
        "{prof}"
    );
    assert_eq!(prof["lookups_task_symcall"], 0, "{prof}");
    assert!(
        symc["lookups_task_symcall"].as_u64().unwrap() >= 1,
        "{symc}"
    );
    assert_eq!(
        symc["lookups_task_profile"], 0,
        "the module answered: {symc}"
    );
    // The same classification, both against varmail's own count.
    assert!(err(data(&prof), truth_p) < 1.0, "profile source: {prof}");
    assert!(err(data(&symc), truth_s) < 1.0, "symcall source: {symc}");
}
