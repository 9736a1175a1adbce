//! Registry entry of the iCache (Sky §7): `--stage icache:size=MIB[,policy=lru|priority]
//! [,mode=write-through|write-back]`, or the legacy `--cache-size/--cache-policy/--cache-mode`.
//! Every disk, the root disk included, each with its own cache of the given size: a workload
//! reading its files from `/` is cached like one on an extra disk.

use std::sync::Arc;

use vmsight_blockdev::stages::{CacheConfig, CacheMetrics, CacheSnapshot, ICache};

use super::{BuiltStage, DiskCtx, OptionsError, Sample, Snapshotting, StageEntry};
use crate::error::LaunchError;

pub static ENTRY: StageEntry = StageEntry {
    name: "icache",
    position: 20,
    summary:
        "block cache in host RAM, LRU or Sky's class priority policy (every disk, one cache each)",
    options: "size=MIB[,policy=lru|priority][,mode=write-through|write-back]",
    requested: true,
    check,
    build,
};

/// Parses `size=MIB,policy=...,mode=...`.
pub fn parse(options: &str) -> Result<CacheConfig, OptionsError> {
    let mut size: Option<u64> = None;
    let mut cfg = CacheConfig::from_mib(0);
    for kv in options.split(',').filter(|s| !s.is_empty()) {
        match kv.split_once('=') {
            Some(("size", v)) => {
                size = Some(
                    v.parse()
                        .map_err(|_| OptionsError(format!("size {v:?} is not a number of MiB")))?,
                )
            }
            Some(("policy", v)) => cfg.policy = v.parse().map_err(reason)?,
            Some(("mode", v)) => cfg.mode = v.parse().map_err(reason)?,
            _ => {
                return Err(OptionsError(format!(
                    "unknown option {kv:?} (expected {})",
                    ENTRY.options
                )))
            }
        }
    }
    let Some(mib) = size.filter(|&m| m > 0) else {
        return Err(OptionsError(format!(
            "needs a size in MiB: {}",
            ENTRY.options
        )));
    };
    let mut sized = CacheConfig::from_mib(mib);
    sized.policy = cfg.policy;
    sized.mode = cfg.mode;
    sized.validate().map_err(reason)?;
    Ok(sized)
}

fn reason(e: impl std::fmt::Display) -> OptionsError {
    OptionsError(e.to_string())
}

fn check(options: &str) -> Result<(), OptionsError> {
    parse(options).map(|_| ())
}

fn build(ctx: &DiskCtx<'_>) -> Result<Option<BuiltStage>, LaunchError> {
    let Some(options) = ctx.options else {
        return Ok(None);
    };
    let cfg = parse(options).map_err(|e| ctx.build_error(ENTRY.name, e))?;
    let (stage, m) = ICache::stage(cfg).map_err(|e| ctx.build_error(ENTRY.name, e))?;
    Ok(Some(BuiltStage {
        stage,
        metrics: Some(Arc::new(Metrics(m))),
        direct_io: false,
    }))
}

struct Metrics(Arc<CacheMetrics>);

impl Snapshotting for Metrics {
    type Snapshot = CacheSnapshot;
    const KEY: &'static str = "cache";

    fn take(&self) -> CacheSnapshot {
        self.0.snapshot()
    }

    fn line(s: &CacheSnapshot) -> String {
        format!("cache: {}", summary_line(s))
    }

    fn samples_of(s: &CacheSnapshot) -> Vec<Sample> {
        let mut v = vec![
            Sample::counter("icache_hits_total", "Cache hits (4 KiB blocks).", s.hits),
            Sample::counter(
                "icache_misses_total",
                "Cache misses (4 KiB blocks).",
                s.misses,
            ),
            Sample::gauge(
                "icache_resident_bytes",
                "Bytes held in the cache.",
                s.resident_bytes,
            ),
            Sample::gauge(
                "icache_dirty_bytes",
                "Dirty bytes (write-back).",
                s.dirty_bytes,
            ),
            Sample::counter(
                "icache_writebacks_total",
                "Dirty 4 KiB blocks written to the disk (write-back).",
                s.writebacks,
            ),
            Sample::counter(
                "icache_dirty_discarded_total",
                "Dirty 4 KiB blocks a discard covered before write-back (never written).",
                s.dirty_discarded,
            ),
        ];
        for k in &s.classes {
            v.push(
                Sample::counter(
                    "icache_class_hits_total",
                    "Cache hits per I/O class.",
                    k.hits,
                )
                .with("class", k.class.clone()),
            );
            v.push(
                Sample::counter(
                    "icache_class_misses_total",
                    "Cache misses per I/O class.",
                    k.misses,
                )
                .with("class", k.class.clone()),
            );
        }
        v
    }
}

/// Overall hit rate, then hits/misses and resident KiB per class.
fn summary_line(c: &CacheSnapshot) -> String {
    let mut line = format!(
        "{} {} {} MiB: hits={} misses={} hit rate={} resident={} KiB dirty={} KiB written back={} discarded dirty={}",
        c.policy,
        c.mode,
        c.size_bytes >> 20,
        c.hits,
        c.misses,
        c.hit_rate()
            .map_or_else(|| "-".to_string(), |r| format!("{:.1}%", r * 100.0)),
        c.resident_bytes / 1024,
        c.dirty_bytes / 1024,
        c.writebacks,
        c.dirty_discarded
    );
    for k in c
        .classes
        .iter()
        .filter(|k| k.hits + k.misses + k.inserted > 0)
    {
        line.push_str(&format!(
            " | class {}: {}h/{}m {} KiB",
            k.class,
            k.hits,
            k.misses,
            k.resident_bytes / 1024
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_blockdev::stages::{CacheMode, CachePolicy};

    #[test]
    fn options_parse_with_defaults_and_clear_errors() {
        let c = parse("size=64").expect("size only");
        assert_eq!(c.size_bytes, 64 << 20);
        let c = parse("size=8,policy=priority,mode=write-back").expect("all");
        assert_eq!(
            (c.policy, c.mode),
            (CachePolicy::Priority, CacheMode::WriteBack)
        );
        assert!(parse("").expect_err("no size").0.contains("needs a size"));
        assert!(parse("size=8,colour=red")
            .expect_err("unknown")
            .0
            .contains("unknown option"));
        assert!(parse("size=8,policy=fifo")
            .expect_err("policy")
            .0
            .contains("policy"));
    }
}
