//! A `ps` of a running guest, read from outside through guest RAM and the kernel profile.
//!
//! Usage: `ps <QEMU_PID|VM_NAME> <PROFILE.json|IMAGE_DIR> [--threads] [--fds PID]... [--cpus] [--json]`
//!
//! A VM name is looked up in `/run/vmsight/<NAME>/vm.json` (`qemu_pid`). With an image
//! directory the profile is generated from its System.map, vmlinux.btf and config (picking up
//! members added to the profile lists since the image was built).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use vmsight_introspect::kernel::{KernelView, TaskInfo};
use vmsight_introspect::memory::GuestRam;
use vmsight_introspect::profile::{self, KernelProfile};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ps: {e}");
            ExitCode::FAILURE
        }
    }
}

fn qemu_pid(arg: &str) -> Result<u32, String> {
    if let Ok(pid) = arg.parse() {
        return Ok(pid);
    }
    let path = format!("/run/vmsight/{arg}/vm.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("Cannot read {path}: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{path} is not JSON: {e}"))?;
    v.get("qemu_pid")
        .and_then(serde_json::Value::as_u64)
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| format!("{path} has no qemu_pid (is the VM running?)"))
}

fn load_profile(arg: &str) -> Result<KernelProfile, String> {
    let p = Path::new(arg);
    if p.is_dir() {
        profile::generate(
            &p.join("System.map"),
            &p.join("vmlinux.btf"),
            &p.join("config"),
        )
        .map_err(|e| e.to_string())
    } else {
        KernelProfile::load(p).map_err(|e| e.to_string())
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: ps <QEMU_PID|VM_NAME> <PROFILE.json|IMAGE_DIR> [--threads] [--fds PID]... [--cpus] [--json]";
    let (Some(target), Some(prof)) = (args.first(), args.get(1)) else {
        return Err(usage.into());
    };
    let mut threads = false;
    let mut json = false;
    let mut cpus = false;
    let mut fd_pids = Vec::new();
    let mut it = args[2..].iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--threads" => threads = true,
            "--json" => json = true,
            "--cpus" => cpus = true,
            "--fds" => {
                let pid = it
                    .next()
                    .and_then(|p| p.parse::<i32>().ok())
                    .ok_or("--fds needs a pid")?;
                fd_pids.push(pid);
            }
            other => return Err(format!("unknown argument {other:?}; {usage}")),
        }
    }

    let pid = qemu_pid(target)?;
    let profile = load_profile(prof)?;
    let ram = Arc::new(GuestRam::open_qemu(pid, None).map_err(|e| e.to_string())?);
    let view = KernelView::new(ram.clone(), &profile).map_err(|e| e.to_string())?;
    eprintln!(
        "guest RAM {} ({} MiB, {} region(s)); {}-level paging; phys_base {:#x}; page_offset_base {:#x}",
        ram.source(),
        ram.layout().ram_size() >> 20,
        ram.layout().regions().len(),
        view.paging_mode().levels(),
        view.phys_base(),
        view.page_offset_base()
    );

    let tasks = if threads {
        view.all_threads()
    } else {
        view.processes()
    }
    .map_err(|e| e.to_string())?;
    let mut infos: Vec<TaskInfo> = Vec::new();
    for t in tasks {
        match view.task_info(t) {
            Ok(i) => infos.push(i),
            // A task exiting under us: report and go on.
            Err(e) => eprintln!("task {t:#x}: {e}"),
        }
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&infos).map_err(|e| e.to_string())?
        );
    } else {
        if threads {
            println!(
                "{:>5} {:>5} {:>5} {:<16} {:<28} CWD",
                "PID", "LWP", "PPID", "COMMAND", "EXE"
            );
        } else {
            println!(
                "{:>5} {:>5} {:<16} {:<28} CWD",
                "PID", "PPID", "COMMAND", "EXE"
            );
        }
        for i in &infos {
            let exe = i.exe.as_deref().unwrap_or("-");
            let cwd = i.cwd.as_deref().unwrap_or("-");
            if threads {
                println!(
                    "{:>5} {:>5} {:>5} {:<16} {:<28} {}",
                    i.tgid, i.pid, i.ppid, i.comm, exe, cwd
                );
            } else {
                println!(
                    "{:>5} {:>5} {:<16} {:<28} {}",
                    i.pid, i.ppid, i.comm, exe, cwd
                );
            }
        }
    }

    if cpus {
        let n = view.nr_cpus().map_err(|e| e.to_string())?;
        for cpu in 0..n {
            match view.current_task(cpu).and_then(|t| view.task_info(t)) {
                Ok(i) => println!("cpu {cpu}: current pid {} ({})", i.pid, i.comm),
                Err(e) => println!("cpu {cpu}: {e}"),
            }
        }
    }

    for pid in fd_pids {
        let task = view.task_by_pid(pid).map_err(|e| e.to_string())?;
        let info = view.task_info(task).map_err(|e| e.to_string())?;
        println!("=== pid {pid} ({})", info.comm);
        println!("exe  -> {}", info.exe.as_deref().unwrap_or("-"));
        println!("cwd  -> {}", info.cwd.as_deref().unwrap_or("-"));
        println!("root -> {}", info.root.as_deref().unwrap_or("-"));
        let fds = view.fds(task).map_err(|e| e.to_string())?;
        if json {
            println!(
                "{}",
                serde_json::to_string_pretty(&fds).map_err(|e| e.to_string())?
            );
            continue;
        }
        for f in fds {
            println!(
                "{:>3} -> {:<32} pos {:<8} flags 0{:o} mode 0{:o} size {}",
                f.fd, f.path, f.pos, f.flags, f.mode, f.size
            );
        }
    }
    Ok(())
}
