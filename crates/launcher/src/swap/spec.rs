//! `--swap SIZE[,cache=SIZE][,max-cache=SIZE][,file=PATH][,grow=SIZE]`: what the user asked
//! for the VM's swap disk (docs/swapbypass.md).

use std::path::PathBuf;
use std::str::FromStr;

/// The smallest swap disk (the swap header and a few pages).
pub const MIN_SIZE: u64 = 1 << 20;
/// The largest swap disk (32-bit page offsets in the region protocol).
pub const MAX_SIZE: u64 = 1 << 44;
/// The virtio-blk serial of the swap disk (the guest init finds it by this).
pub const SERIAL: &str = "vmsight-swap";

/// The VM's swap disk as asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapSpec {
    /// Size of the swap disk, bytes.
    pub size: u64,
    /// Cache in host memory at start, bytes (default: the whole swap).
    pub cache: u64,
    /// The most the cache may be resized to, bytes (default: the swap size); sizes the region
    /// shared with the guest.
    pub max_cache: u64,
    /// The swap file; default a fresh sparse file beside the root working copy, removed at
    /// the end.
    pub file: Option<PathBuf>,
    /// Guest memory vmsight may add through virtio-mem when the guest thrashes, bytes
    /// (default 0: never).
    pub grow: u64,
}

/// Why `--swap` (or a cache resize) is not usable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SwapSpecError {
    #[error("{0:?} is not a size (digits in MiB, or with a K, M, G or T suffix)")]
    Size(String),
    #[error("a swap disk of {0} bytes is out of range (1 MiB to 16 TiB, whole pages)")]
    Range(u64),
    #[error("a cache of {cache} bytes is larger than max-cache ({max} bytes)")]
    Cache { cache: u64, max: u64 },
    #[error("max-cache {max} bytes is larger than the swap disk ({size} bytes)")]
    MaxCache { max: u64, size: u64 },
    #[error("grow={0} bytes is not a multiple of 2 MiB (virtio-mem's block size)")]
    Grow(u64),
    #[error("unknown option {0:?} (cache=SIZE, max-cache=SIZE, file=PATH, grow=SIZE)")]
    Option(String),
}

/// Parses a size: bare digits are MiB (like `--mem`), or digits with a suffix.
pub fn parse_size(s: &str) -> Result<u64, SwapSpecError> {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) {
        return s
            .parse::<u64>()
            .ok()
            .and_then(|m| m.checked_mul(1 << 20))
            .ok_or_else(|| SwapSpecError::Size(s.to_owned()));
    }
    vmsight_dedup::volume::parse_size(s).ok_or_else(|| SwapSpecError::Size(s.to_owned()))
}

impl FromStr for SwapSpec {
    type Err = SwapSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(',');
        let size = parse_size(parts.next().unwrap_or_default())?;
        if !(MIN_SIZE..=MAX_SIZE).contains(&size) || !size.is_multiple_of(4096) {
            return Err(SwapSpecError::Range(size));
        }
        let mut spec = SwapSpec {
            size,
            cache: size,
            max_cache: size,
            file: None,
            grow: 0,
        };
        let mut cache = None;
        for opt in parts {
            match opt.split_once('=') {
                Some(("cache", v)) => cache = Some(parse_size(v)?),
                Some(("max-cache", v)) => spec.max_cache = parse_size(v)?,
                Some(("file", v)) if !v.is_empty() => spec.file = Some(PathBuf::from(v)),
                Some(("grow", v)) => spec.grow = parse_size(v)?,
                _ => return Err(SwapSpecError::Option(opt.to_owned())),
            }
        }
        if spec.max_cache > size {
            return Err(SwapSpecError::MaxCache {
                max: spec.max_cache,
                size,
            });
        }
        spec.cache = cache.unwrap_or(spec.max_cache);
        if spec.cache > spec.max_cache {
            return Err(SwapSpecError::Cache {
                cache: spec.cache,
                max: spec.max_cache,
            });
        }
        if !spec.grow.is_multiple_of(2 << 20) {
            return Err(SwapSpecError::Grow(spec.grow));
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_options_and_defaults_parse() {
        let s: SwapSpec = "512M".parse().expect("parses");
        assert_eq!(
            (s.size, s.cache, s.max_cache, s.grow),
            (512 << 20, 512 << 20, 512 << 20, 0)
        );
        let s: SwapSpec = "512M,cache=64,max-cache=256M,file=/tmp/s.img,grow=1G"
            .parse()
            .expect("parses");
        assert_eq!(s.cache, 64 << 20);
        assert_eq!(s.max_cache, 256 << 20);
        assert_eq!(s.file, Some(PathBuf::from("/tmp/s.img")));
        assert_eq!(s.grow, 1 << 30);
        let s: SwapSpec = "1G,cache=0".parse().expect("parses");
        assert_eq!(s.cache, 0);
        let s: SwapSpec = "1G,max-cache=128M".parse().expect("parses");
        assert_eq!(s.cache, 128 << 20, "the cache defaults to its maximum");
    }

    #[test]
    fn bad_specs_are_refused_with_the_reason() {
        for (spec, want) in [
            ("", "not a size"),
            ("lots", "not a size"),
            ("100K", "out of range"),
            ("512M,cache=1G", "larger than max-cache"),
            ("512M,max-cache=1G", "larger than the swap disk"),
            ("512M,grow=3M", "multiple of 2 MiB"),
            ("512M,color=red", "unknown option"),
            ("512M,file=", "unknown option"),
        ] {
            let e = spec.parse::<SwapSpec>().expect_err(spec).to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }
}
