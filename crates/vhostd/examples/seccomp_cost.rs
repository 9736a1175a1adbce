//! What a thread filter costs per system call: the same calls timed on a thread without a
//! filter and on threads under each class's filter (`bench/seccomp_cost.py` runs it and
//! keeps the results). Calls from the allow lists at different places of the lists:
//! `read` (number 0) of an empty non-blocking eventfd, `clock_gettime` (228, the raw call,
//! not the vDSO), `epoll_wait` (232) on an empty epoll set with no timeout, `getrandom`
//! (318) of no bytes.
//!
//!   seccomp_cost [CALLS] [CLASS...]   (classes: none deny vring net io channel; default all)
//!
//! Prints one JSON object per class: nanoseconds per call of each call the class's filter
//! allows (a call it refuses is left out: no thread of the class makes it).

use std::time::Instant;

use vmsight_vhostd::seccomp::{self, ThreadClass};

/// A timed call: one system call that returns at once, with its raw result.
type Call = Box<dyn Fn() -> libc::c_long>;

/// The calls timed, by name.
fn calls() -> Vec<(&'static str, Call)> {
    // SAFETY: eventfd and epoll_create1 make new descriptors this process owns; they are
    // only read and waited on below and live until the process ends.
    let (efd, epfd) = unsafe {
        (
            libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC),
            libc::epoll_create1(libc::EPOLL_CLOEXEC),
        )
    };
    assert!(efd >= 0 && epfd >= 0, "eventfd/epoll");
    vec![
        (
            "read",
            Box::new(move || {
                let mut v = 0u64;
                // SAFETY: reads at most 8 bytes into `v`; the empty eventfd answers EAGAIN.
                unsafe { libc::read(efd, (&mut v as *mut u64).cast(), 8) as libc::c_long }
            }),
        ),
        (
            "clock_gettime",
            Box::new(|| {
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: the raw call writes one timespec into `ts`.
                unsafe {
                    libc::syscall(
                        libc::SYS_clock_gettime,
                        libc::CLOCK_MONOTONIC,
                        &mut ts as *mut libc::timespec,
                    )
                }
            }),
        ),
        (
            "epoll_wait",
            Box::new(move || {
                let mut ev = libc::epoll_event { events: 0, u64: 0 };
                // SAFETY: room for one event in `ev`; no timeout on an empty set.
                unsafe { libc::epoll_wait(epfd, &mut ev, 1, 0).into() }
            }),
        ),
        (
            "getrandom",
            Box::new(|| {
                // SAFETY: asks for no bytes; the pointer is never written.
                unsafe { libc::syscall(libc::SYS_getrandom, std::ptr::null_mut::<u8>(), 0, 0) }
            }),
        ),
    ]
}

fn class_of(name: &str) -> Option<Option<ThreadClass>> {
    Some(match name {
        "none" => None,
        "deny" => Some(ThreadClass::GuestService),
        "vring" => Some(ThreadClass::VringWorker),
        "net" => Some(ThreadClass::NetWorker),
        "io" => Some(ThreadClass::IoPool),
        "channel" => Some(ThreadClass::ChannelReader),
        _ => return None,
    })
}

/// Whether the filter refuses `call` (then it is not timed: a class does not make it).
fn refused(call: &Call) -> bool {
    call() < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Times `n` rounds of every call the filter of `class` allows, on a new thread under it.
fn measure(class: Option<ThreadClass>, n: u32) -> Vec<(&'static str, f64)> {
    std::thread::spawn(move || {
        // Descriptors first: a filtered thread may not make them.
        let calls = calls();
        if let Some(c) = class {
            seccomp::install(c).expect("the filter installs");
        }
        calls
            .into_iter()
            .filter(|(_, call)| !refused(call))
            .map(|(name, call)| {
                for _ in 0..n / 10 {
                    call();
                }
                let t0 = Instant::now();
                for _ in 0..n {
                    call();
                }
                (name, t0.elapsed().as_nanos() as f64 / f64::from(n))
            })
            .collect()
    })
    .join()
    .expect("the measuring thread")
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u32 = args
        .next()
        .map(|a| a.parse().expect("CALLS is a number"))
        .unwrap_or(2_000_000);
    let mut classes: Vec<String> = args.collect();
    if classes.is_empty() {
        classes = ["none", "deny", "vring", "net", "io", "channel"]
            .map(String::from)
            .to_vec();
    }
    for name in classes {
        let class = class_of(&name).unwrap_or_else(|| panic!("unknown class {name}"));
        let fields: Vec<String> = measure(class, n)
            .iter()
            .map(|(call, ns)| format!("\"{call}_ns\": {ns:.1}"))
            .collect();
        println!("{{\"config\": \"{name}\", {}}}", fields.join(", "));
    }
}
