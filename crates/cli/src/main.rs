//! `vmsight`: see inside unmodified VMs. See `vmsight --help` and README.md.

mod cli;
mod cpu;
mod dedup;
mod hylics;
mod idle;
mod net;
mod swap;
mod sym;

use std::process::ExitCode;

/// Keeps vmsight's private memory proportional to what it holds, not to what passed through.
///
/// The write taps copy guest writes (up to 1 MiB each) on the I/O threads and the stream
/// consumers free them: with glibc's defaults each I/O thread gets its own arena and the
/// dynamic mmap threshold climbs after the first large free, so freed buffers stay resident
/// in several arenas. A fixed 128 KiB mmap threshold returns large buffers to the kernel on
/// free, and two arenas bound the per-thread caches. Measured with a 300 MiB write + 13 000
/// file untar on an extra disk (docs/benchmarks.md): peak private memory 55 MiB -> 34 MiB.
fn tune_malloc() {
    // SAFETY: mallopt only sets allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

fn main() -> ExitCode {
    tune_malloc();
    let code = cli::main();
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}
