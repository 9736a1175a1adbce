//! `vmsight sym NAME spy|call`: the symbiotic interface of a running VM (`vmsight run
//! --symbiotic`, docs/symbiotic.md): the guest module's SymSpy page, and symcalls into it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand, ValueEnum};
use vmsight_proto::control::{ControlReply, ControlRequest};
use vmsight_proto::sym::{nr, CallReply, CallRequest, Decoded, SpyReport, SyncStages, Transport};

use crate::cli::{control_socket, print_stdout, CliError};
use crate::cpu::parse_u64;

#[derive(Debug, Args)]
pub(crate) struct SymArgs {
    /// The VM (`vmsight ps` lists them).
    name: String,
    #[command(subcommand)]
    action: SymAction,
}

#[derive(Debug, Subcommand)]
enum SymAction {
    /// Print the interface's state and the guest's SymSpy page (kernel, symcalls, per-CPU
    /// current task, memory and swap counters, swap devices), read without exits.
    Spy {
        /// Print again every S seconds until interrupted.
        #[arg(long, value_name = "S")]
        watch: Option<f64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make a symcall: FN is a name (echo, task_info, fd_path, page_info, swap_info, ping,
    /// test_spin) or a number; ARGS are up to five numbers (hex with 0x, or decimal).
    Call {
        #[arg(value_name = "FN")]
        function: String,
        #[arg(value_name = "ARGS", value_parser = parse_u64)]
        args: Vec<u64>,
        /// Transport: auto (sync where available, else doorbell), doorbell or sync.
        #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
        transport: TransportArg,
        /// How long to wait for the guest's answer, in milliseconds.
        #[arg(long, default_value_t = 5000)]
        timeout_ms: u64,
        /// Make the call N times in a row and print a summary (calls, failures, latency).
        #[arg(long, value_name = "N")]
        repeat: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum TransportArg {
    Auto,
    Doorbell,
    Sync,
}

impl From<TransportArg> for Transport {
    fn from(t: TransportArg) -> Transport {
        match t {
            TransportArg::Auto => Transport::Auto,
            TransportArg::Doorbell => Transport::Doorbell,
            TransportArg::Sync => Transport::Sync,
        }
    }
}

/// `vmsight sym NAME ...`: exit 0 on success; a call the guest answered with an error
/// exits 1.
pub(crate) fn run(a: SymArgs) -> Result<i32, CliError> {
    let sock = control_socket(&a.name)?;
    match a.action {
        SymAction::Spy { watch, json } => spy(&sock, watch, json),
        SymAction::Call {
            function,
            args,
            transport,
            timeout_ms,
            repeat,
            json,
        } => {
            let n = nr::by_name(&function)
                .or_else(|| function.parse().ok())
                .ok_or_else(|| {
                    CliError::Other(format!(
                        "unknown symcall {function:?} (echo, task_info, fd_path, page_info, \
                         swap_info, ping, test_spin, or a number)"
                    ))
                })?;
            if args.len() > 5 {
                return Err(CliError::Other(format!(
                    "a symcall takes at most 5 arguments, not {}",
                    args.len()
                )));
            }
            let req = CallRequest {
                nr: n,
                args,
                transport: transport.into(),
                timeout_ms,
            };
            match repeat {
                Some(times) => repeat_calls(&sock, &req, times, json),
                None => one_call(&sock, req, json),
            }
        }
    }
}

fn request_spy(sock: &std::path::Path) -> Result<SpyReport, CliError> {
    match vmsight_launcher::control::request(sock, ControlRequest::SymSpy)? {
        ControlReply::SymSpy(r) => Ok(*r),
        other => Err(CliError::Other(format!(
            "unexpected answer from the VM: {other:?}"
        ))),
    }
}

fn request_call(sock: &std::path::Path, req: CallRequest) -> Result<CallReply, CliError> {
    match vmsight_launcher::control::request(sock, ControlRequest::SymCall(req))? {
        ControlReply::SymCalled(r) => Ok(r),
        other => Err(CliError::Other(format!(
            "unexpected answer from the VM: {other:?}"
        ))),
    }
}

fn spy(sock: &std::path::Path, watch: Option<f64>, json: bool) -> Result<i32, CliError> {
    loop {
        let r = request_spy(sock)?;
        let text = if json {
            serde_json::to_string(&r).unwrap_or_default()
        } else {
            describe_spy(&r)
        };
        print_stdout(&text)?;
        let Some(s) = watch else { return Ok(0) };
        std::thread::sleep(Duration::from_secs_f64(s.max(0.05)));
    }
}

fn describe_spy(r: &SpyReport) -> String {
    let mut out = vec![format!(
        "interface: version {}, features {}, vmsight {}, guest {}, transports [{}]",
        r.abi,
        r.features.join(","),
        r.vmm_state,
        r.guest_state,
        r.transports
            .iter()
            .map(|t| t.name())
            .collect::<Vec<_>>()
            .join(",")
    )];
    if let Some(why) = &r.refused {
        out.push(format!("off: {why}"));
    }
    if let Some(g) = &r.guest {
        out.push(format!("kernel: {} {}", g.release, g.version));
        out.push(format!(
            "symcalls: {} (sync entry: {})",
            g.symcalls.join(" "),
            if g.sync_entry { "yes" } else { "no" }
        ));
        let m = &g.mem;
        out.push(format!(
            "memory: total {} KiB, free {} KiB, available {} KiB; swap total {} KiB, free {} \
             KiB; pswpin {}, pswpout {}",
            m.mem_total_kib,
            m.mem_free_kib,
            m.mem_available_kib,
            m.swap_total_kib,
            m.swap_free_kib,
            m.pswpin,
            m.pswpout
        ));
        for s in &g.swaps {
            out.push(format!(
                "swap type {}: {} ({}), {} KiB used of {} KiB, prio {}{}",
                s.kind,
                s.path,
                if s.blockdev { "partition" } else { "file" },
                s.used_kib,
                s.size_kib,
                s.prio,
                if s.writeok { "" } else { ", not writable" }
            ));
        }
        for c in &g.cpus {
            out.push(format!(
                "cpu {}: pid {} tgid {} comm {} ({} switches)",
                c.cpu, c.pid, c.tgid, c.comm, c.switches
            ));
        }
        out.push(format!(
            "refreshed {} times, every {} ms",
            g.refreshes, g.refresh_ms
        ));
    }
    for p in &r.problems {
        out.push(format!("problem: {p}"));
    }
    let c = &r.counters;
    out.push(format!(
        "counters: calls {} doorbell, {} sync (guest woken at once {} times with all vCPUs idle, \
         {} with none in the kernel; {} after waiting); timeouts {}; busy {}; doorbells {} call, \
         {} state, {} spurious; spy problems {}",
        c.calls_doorbell,
        c.calls_sync,
        c.sync_wakes_idle,
        c.sync_wakes_user,
        c.sync_wakes_waited,
        c.timeouts,
        c.busy,
        c.doorbells_call,
        c.doorbells_state,
        c.doorbells_spurious,
        c.spy_problems
    ));
    out.join("\n")
}

fn one_call(sock: &std::path::Path, req: CallRequest, json: bool) -> Result<i32, CliError> {
    let r = request_call(sock, req)?;
    let text = if json {
        serde_json::json!({"reply": &r, "decoded": r.decode(), "errno": r.errno()}).to_string()
    } else {
        describe_call(&r)
    };
    print_stdout(&text)?;
    Ok(if r.ret < 0 { 1 } else { 0 })
}

fn describe_call(r: &CallReply) -> String {
    let head = format!(
        "{} #{} over {}: {} us",
        r.name.as_deref().unwrap_or("?"),
        r.seq,
        r.transport.name(),
        r.latency_ns / 1000
    );
    let body = match r.decode() {
        None => format!("error {} ({})", r.ret, r.errno().unwrap_or("?")),
        Some(Decoded::Ping) => "pong".into(),
        Some(Decoded::Echo { values } | Decoded::TestSpin { values }) => format!("{values:?}"),
        Some(Decoded::TaskInfo(t)) => format!(
            "tgid {} ppid {} threads {} comm {} exe {} cwd {}{}",
            t.tgid,
            t.ppid,
            t.threads,
            t.comm,
            t.exe,
            t.cwd,
            if t.kernel_thread {
                " (kernel thread)"
            } else {
                ""
            }
        ),
        Some(Decoded::FdPath(f)) => format!(
            "{} (flags {:#o}, pos {}, ino {}, size {})",
            f.path, f.flags, f.pos, f.ino, f.size
        ),
        Some(Decoded::PageInfo(p)) => serde_json::to_string(&p).unwrap_or_default(),
        Some(Decoded::SwapInfo(s)) => serde_json::to_string(&s).unwrap_or_default(),
    };
    format!("{head}\n{body}")
}

/// Calls `times` times in a row; every answer must be the call's own (an echo returns its
/// arguments) and none may fail.
fn repeat_calls(
    sock: &std::path::Path,
    req: &CallRequest,
    times: u64,
    json: bool,
) -> Result<i32, CliError> {
    let t0 = Instant::now();
    let (mut ok, mut failed, mut wrong) = (0u64, 0u64, 0u64);
    let mut lat: Vec<u64> = Vec::with_capacity(times as usize);
    let mut stages = StageSamples::default();
    let mut first_error = None;
    let mut first_wrong = None;
    for i in 0..times {
        let mut r = req.clone();
        if r.nr == nr::ECHO {
            // A fresh value per call: a stale or lost answer cannot pass.
            r.args = vec![i, i ^ 0x5a5a, i.wrapping_mul(3), !i, 7];
        }
        match request_call(sock, r.clone()) {
            Ok(a)
                if r.nr == nr::ECHO
                    && a.decode()
                        != Some(Decoded::Echo {
                            values: echo_of(&r.args),
                        }) =>
            {
                wrong += 1;
                first_wrong.get_or_insert_with(|| wrong_answer(i, &r.args, &a));
            }
            Ok(a) => {
                ok += 1;
                lat.push(a.latency_ns);
                if let Some(s) = &a.stages {
                    stages.add(s);
                }
            }
            Err(e) => {
                failed += 1;
                first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
    lat.sort_unstable();
    let pct = |p: f64| quantile(&lat, p);
    let summary = serde_json::json!({
        "calls": times, "ok": ok, "failed": failed, "wrong": wrong,
        "latency_us": {"min": pct(0.0) as f64 / 1e3, "median": pct(0.5) as f64 / 1e3,
                        "p99": pct(0.99) as f64 / 1e3, "max": pct(1.0) as f64 / 1e3},
        // The distribution (SymCall's Fig. 8): p0, p1, ..., p100 of the answered calls.
        "percentiles_us": (0..=100).map(|p| pct(f64::from(p) / 100.0) as f64 / 1e3).collect::<Vec<_>>(),
        // Where the synchronous calls' time went (absent on the doorbell transport).
        "stages_us": stages.summary(),
        "wall_s": t0.elapsed().as_secs_f64(),
        "first_error": first_error,
        "first_wrong": first_wrong,
    });
    let text =
        if json {
            summary.to_string()
        } else {
            format!(
            "{times} calls: {ok} ok, {failed} failed, {wrong} wrong answers; latency min {:.1} \
             us, median {:.1} us, p99 {:.1} us{}",
            pct(0.0) as f64 / 1e3,
            pct(0.5) as f64 / 1e3,
            pct(0.99) as f64 / 1e3,
            first_error.map(|e| format!("; first error: {e}")).unwrap_or_default()
        ) + &stages.line()
                + &first_wrong
                    .map(|w| format!("; first wrong answer: {w}"))
                    .unwrap_or_default()
        };
    print_stdout(&text)?;
    Ok(if failed + wrong == 0 { 0 } else { 1 })
}

/// The parts of synchronous calls' latencies, one sample per call that has the part.
#[derive(Default)]
struct StageSamples {
    parts: BTreeMap<&'static str, Vec<u64>>,
}

impl StageSamples {
    /// The parts, in the order a call passes them: posting to the doorbell (when rung), the
    /// doorbell to a halted vCPU resuming, that resume to the take (the guest's way to a safe
    /// point), posting to the take (all calls), the module's handler, the answer to vmsight
    /// seeing it.
    const PARTS: [&'static str; 6] = [
        "post_to_ring",
        "ring_to_resume",
        "resume_to_take",
        "post_to_take",
        "handler",
        "return_to_seen",
    ];

    fn add(&mut self, s: &SyncStages) {
        let mut put = |k: &'static str, v: Option<u64>| {
            if let Some(v) = v {
                self.parts.entry(k).or_default().push(v);
            }
        };
        put("post_to_ring", s.rung_ns);
        put(
            "ring_to_resume",
            s.rung_ns
                .zip(s.resumed_ns)
                .and_then(|(r, m)| m.checked_sub(r)),
        );
        put(
            "resume_to_take",
            s.resumed_ns.and_then(|m| s.taken_ns.checked_sub(m)),
        );
        put("post_to_take", Some(s.taken_ns));
        put("handler", s.returned_ns.checked_sub(s.taken_ns));
        put("return_to_seen", s.seen_ns.checked_sub(s.returned_ns));
    }

    /// Per part: how many calls had it and its p10/p50/p90/p99 in microseconds.
    fn summary(&mut self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        for k in Self::PARTS {
            let Some(v) = self.parts.get_mut(k) else {
                continue;
            };
            v.sort_unstable();
            let q = |p: f64| quantile(v, p) as f64 / 1e3;
            out.insert(
                k.to_owned(),
                serde_json::json!({"calls": v.len(), "p10": q(0.1), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}),
            );
        }
        serde_json::Value::Object(out)
    }

    /// `; stages (median us): post_to_take 12.0 (1000 calls), ...`, or nothing.
    fn line(&mut self) -> String {
        let parts: Vec<String> = Self::PARTS
            .iter()
            .filter_map(|k| {
                let v = self.parts.get_mut(k)?;
                v.sort_unstable();
                Some(format!(
                    "{k} {:.1} ({} calls)",
                    quantile(v, 0.5) as f64 / 1e3,
                    v.len()
                ))
            })
            .collect();
        if parts.is_empty() {
            return String::new();
        }
        format!("; stages (median us): {}", parts.join(", "))
    }
}

/// The `p` quantile (0.0 to 1.0) of sorted values, by rounding the rank; 0 when there are none.
fn quantile(sorted: &[u64], p: f64) -> u64 {
    sorted
        .get(((sorted.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(0)
}

/// What a wrong echo answer was: the call, what it sent, and what came back.
fn wrong_answer(i: u64, sent: &[u64], a: &CallReply) -> String {
    format!(
        "call {i} (sequence {}, {:?}) sent {:?}, got ret {}{} rets {:?} ({} data bytes)",
        a.seq,
        a.transport,
        echo_of(sent),
        a.ret,
        a.errno().map(|e| format!(" ({e})")).unwrap_or_default(),
        a.rets,
        a.data.len()
    )
}

fn echo_of(args: &[u64]) -> [u64; 5] {
    let mut v = [0u64; 5];
    v[..args.len().min(5)].copy_from_slice(&args[..args.len().min(5)]);
    v[0] &= i64::MAX as u64;
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_round_the_rank_and_cover_both_ends() {
        let v: Vec<u64> = (1..=101).collect();
        assert_eq!(quantile(&v, 0.0), 1);
        assert_eq!(quantile(&v, 0.5), 51);
        assert_eq!(quantile(&v, 0.99), 100);
        assert_eq!(quantile(&v, 1.0), 101);
        assert_eq!(quantile(&[7], 0.3), 7);
        assert_eq!(quantile(&[], 0.5), 0);
    }

    /// Each part is taken from the calls that have it: the doorbell parts only from rung
    /// calls, the resume parts only from calls a halted vCPU took.
    #[test]
    fn stage_parts_come_from_the_calls_that_have_them() {
        let mut s = StageSamples::default();
        s.add(&SyncStages {
            rung_ns: None,
            resumed_ns: None,
            taken_ns: 5_000,
            returned_ns: 8_000,
            seen_ns: 9_000,
        });
        s.add(&SyncStages {
            rung_ns: Some(1_000),
            resumed_ns: Some(101_000),
            taken_ns: 151_000,
            returned_ns: 154_000,
            seen_ns: 160_000,
        });
        let v = s.summary();
        let calls = |k: &str| v[k]["calls"].as_u64();
        assert_eq!(calls("post_to_take"), Some(2));
        assert_eq!(calls("post_to_ring"), Some(1));
        assert_eq!(calls("ring_to_resume"), Some(1));
        assert_eq!(v["ring_to_resume"]["p50"].as_f64(), Some(100.0));
        assert_eq!(v["resume_to_take"]["p50"].as_f64(), Some(50.0));
        assert_eq!(v["handler"]["p99"].as_f64(), Some(3.0));
        assert!(
            s.line().contains("ring_to_resume 100.0 (1 calls)"),
            "{}",
            s.line()
        );
        assert!(StageSamples::default().line().is_empty());
    }

    #[test]
    fn a_wrong_echo_answer_is_described_with_what_was_sent_and_what_came_back() {
        let a = CallReply {
            nr: nr::ECHO,
            name: Some("echo".into()),
            transport: Transport::Sync,
            seq: 1975,
            ret: -16,
            rets: [0; 4],
            data: Vec::new(),
            latency_ns: 1,
            stages: None,
        };
        let w = wrong_answer(1973, &[1973, 2, 3], &a);
        assert_eq!(
            w,
            "call 1973 (sequence 1975, Sync) sent [1973, 2, 3, 0, 0], got ret -16 (EBUSY) \
             rets [0, 0, 0, 0] (0 data bytes)"
        );
    }
}
