//! Serves one raw image over vhost-user-blk until the frontend disconnects.
//!
//! ```text
//! cargo run -p vmsight-blockdev --example serve -- IMAGE SOCKET [--ro] [--serial S]
//!     [--queues N] [--queue-size N] [--direct] [--metrics-every SECS]
//! ```
//! Prints the final metrics as JSON on stdout when the frontend goes away.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use vmsight_blockdev::{spawn_backend, DiskConfig};

fn usage() -> ExitCode {
    eprintln!(
        "usage: serve IMAGE SOCKET [--ro] [--serial S] [--queues N] [--queue-size N] [--direct] [--metrics-every SECS]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let (Some(image), Some(socket)) = (args.next(), args.next()) else {
        return usage();
    };
    let mut cfg = DiskConfig::new(PathBuf::from(image));
    let mut every: Option<u64> = None;
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> Option<u64> {
            let v = args.next().and_then(|v| v.parse().ok());
            if v.is_none() {
                eprintln!("{what} needs a number");
            }
            v
        };
        match a.as_str() {
            "--ro" => cfg.read_only = true,
            "--direct" => cfg.direct_io = true,
            "--serial" => match args.next() {
                Some(s) => cfg.serial = s,
                None => return usage(),
            },
            "--queues" => match num("--queues").and_then(|n| u16::try_from(n).ok()) {
                Some(n) => cfg.num_queues = n,
                None => return usage(),
            },
            "--queue-size" => match num("--queue-size").and_then(|n| u16::try_from(n).ok()) {
                Some(n) => cfg.queue_size = n,
                None => return usage(),
            },
            "--metrics-every" => match num("--metrics-every") {
                Some(n) => every = Some(n.max(1)),
                None => return usage(),
            },
            _ => return usage(),
        }
    }
    let handle = match spawn_backend(cfg, std::path::Path::new(&socket)) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let metrics = handle.metrics();
    if let Some(secs) = every {
        while !handle.is_finished() {
            std::thread::sleep(Duration::from_secs(secs));
            if let Ok(j) = serde_json::to_string(&metrics.snapshot()) {
                eprintln!("metrics: {j}");
            }
        }
    }
    let res = handle.wait();
    match serde_json::to_string_pretty(&metrics.snapshot()) {
        Ok(j) => println!("{j}"),
        Err(e) => eprintln!("cannot serialise metrics: {e}"),
    }
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
