//! Serves one raw image over vhost-user-blk until the frontend disconnects.
//!
//! ```text
//! cargo run -p vmsight-blockdev --example serve -- IMAGE SOCKET [--ro] [--serial S]
//!     [--queues N] [--queue-size N] [--direct] [--metrics-every SECS]
//!     [--cache-size MIB] [--cache-policy lru|priority] [--cache-mode write-through|write-back]
//!     [--disk-model hdd|ssd|none]
//! ```
//! Prints the final metrics as JSON on stdout when the frontend goes away.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use vmsight_blockdev::stages::{CacheConfig, DiskModel, DiskModelConfig, ICache};
use vmsight_blockdev::{spawn_backend_with, DiskConfig, Stage};

fn usage() -> ExitCode {
    eprintln!(
        "usage: serve IMAGE SOCKET [--ro] [--serial S] [--queues N] [--queue-size N] [--direct] [--metrics-every SECS] \
         [--cache-size MIB] [--cache-policy lru|priority] [--cache-mode write-through|write-back] [--disk-model hdd|ssd|none]"
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
    let mut cache: Option<CacheConfig> = None;
    let mut policy = None;
    let mut mode = None;
    let mut model = DiskModelConfig::None;
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
            "--cache-size" => match num("--cache-size") {
                Some(n) => cache = Some(CacheConfig::from_mib(n)),
                None => return usage(),
            },
            "--cache-policy" => match args.next().map(|v| v.parse()) {
                Some(Ok(p)) => policy = Some(p),
                Some(Err(e)) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
                None => return usage(),
            },
            "--cache-mode" => match args.next().map(|v| v.parse()) {
                Some(Ok(m)) => mode = Some(m),
                Some(Err(e)) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
                None => return usage(),
            },
            "--disk-model" => match args.next().map(|v| v.parse()) {
                Some(Ok(m)) => model = m,
                Some(Err(e)) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
                None => return usage(),
            },
            _ => return usage(),
        }
    }
    let mut stages: Vec<Box<dyn Stage>> = Vec::new();
    let mut cache_metrics = None;
    if let Some(mut c) = cache {
        if let Some(p) = policy {
            c.policy = p;
        }
        if let Some(m) = mode {
            c.mode = m;
        }
        match ICache::stage(c) {
            Ok((s, m)) => {
                eprintln!("cache: {c}");
                stages.push(s);
                cache_metrics = Some(m);
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let mut model_metrics = None;
    if model != DiskModelConfig::None {
        let capacity = std::fs::metadata(&cfg.path).map_or(0, |m| m.len() / 512 * 512);
        let (s, m) = match DiskModel::stage(model, capacity) {
            Ok(sm) => sm,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        eprintln!("disk model: {}", m.describe());
        stages.push(s);
        model_metrics = Some(m);
    }
    let handle = match spawn_backend_with(cfg, std::path::Path::new(&socket), stages) {
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
    if let Some(m) = cache_metrics {
        if let Ok(j) = serde_json::to_string(&m.snapshot()) {
            println!("cache: {j}");
        }
    }
    if let Some(m) = model_metrics {
        if let Ok(j) = serde_json::to_string(&m.snapshot()) {
            println!("disk model: {j}");
        }
    }
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
