//! Insight engine settings: size-class table, windows, bounds, path selection.

use std::time::Duration;

/// Errors in insight settings (CLI values).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// `--insight-paths` has an entry that is not absolute.
    #[error("the insight path prefix {0:?} is not an absolute guest path")]
    RelativePrefix(String),
    /// The size-class table is not increasing.
    #[error("the size-class thresholds must be strictly increasing (got {0:?})")]
    Thresholds(Vec<u64>),
}

/// Sky Table 6: files smaller than `thresholds[i]` bytes get `classes[i]`; larger files get
/// `otherwise`; metadata gets `metadata`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SizeClasses {
    /// (upper bound exclusive in bytes, class), increasing bounds.
    pub table: Vec<(u64, u8)>,
    /// Class of files at least as large as the last bound.
    pub otherwise: u8,
    /// Class of file-system metadata.
    pub metadata: u8,
}

impl Default for SizeClasses {
    /// <1 MiB → 4, <2 MiB → 3, <5 MiB → 2, <10 MiB → 1, else 0; metadata 5.
    fn default() -> Self {
        const M: u64 = 1 << 20;
        Self {
            table: vec![(M, 4), (2 * M, 3), (5 * M, 2), (10 * M, 1)],
            otherwise: 0,
            metadata: vmsight_blockdev::insight::CLASS_METADATA,
        }
    }
}

impl SizeClasses {
    /// Checks that bounds increase.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.table.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(ConfigError::Thresholds(
                self.table.iter().map(|t| t.0).collect(),
            ));
        }
        Ok(())
    }

    /// The class of a file of `size` bytes.
    pub fn class_of(&self, size: u64) -> u8 {
        self.table
            .iter()
            .find(|(bound, _)| size < *bound)
            .map_or(self.otherwise, |t| t.1)
    }
}

/// Settings of an [`crate::InsightEngine`].
#[derive(Debug, Clone)]
pub struct InsightConfig {
    /// Only files under these absolute guest path prefixes are followed (empty: all).
    pub paths: Vec<String>,
    pub size_classes: SizeClasses,
    /// How long checksums of block reads wait for the read syscall that consumed them (Sky:
    /// 4 s); unmatched reads are metadata after that.
    pub read_window: Duration,
    /// How long a block write with unmatched chunks waits for a late syscall event (the
    /// trace thread lags the block thread) before its log record is final.
    pub write_grace: Duration,
    /// Most write checksums indexed (oldest evicted first).
    pub max_write_sums: usize,
    /// Most block-read checksums kept for the read window.
    pub max_read_sums: usize,
    /// Most 4 KiB chunks kept in the recent-I/O cache (partial-chunk completion).
    pub max_cached_chunks: usize,
    /// Most processes followed.
    pub max_processes: usize,
}

impl Default for InsightConfig {
    fn default() -> Self {
        Self {
            paths: Vec::new(),
            size_classes: SizeClasses::default(),
            read_window: Duration::from_secs(4),
            write_grace: Duration::from_secs(1),
            max_write_sums: 1 << 20,
            max_read_sums: 1 << 18,
            max_cached_chunks: 4096,
            max_processes: 4096,
        }
    }
}

impl InsightConfig {
    /// Parses `--insight-paths /a,/b`.
    pub fn parse_paths(list: &str) -> Result<Vec<String>, ConfigError> {
        list.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                if p.starts_with('/') {
                    Ok(p.trim_end_matches('/').to_string())
                } else {
                    Err(ConfigError::RelativePrefix(p.to_string()))
                }
            })
            .collect()
    }

    /// True if `path` is selected by `paths`.
    pub fn selects(&self, path: &str) -> bool {
        self.paths.is_empty()
            || self.paths.iter().any(|p| {
                p.is_empty()
                    || (path.starts_with(p.as_str())
                        && matches!(path.as_bytes().get(p.len()), None | Some(b'/')))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_follow_table_6() {
        let s = SizeClasses::default();
        assert_eq!(s.class_of(0), 4);
        assert_eq!(s.class_of((1 << 20) - 1), 4);
        assert_eq!(s.class_of(1 << 20), 3);
        assert_eq!(s.class_of(3 << 20), 2);
        assert_eq!(s.class_of(9 << 20), 1);
        assert_eq!(s.class_of(10 << 20), 0);
        assert_eq!(s.metadata, 5);
        assert!(s.validate().is_ok());
        let bad = SizeClasses {
            table: vec![(5, 1), (5, 2)],
            ..SizeClasses::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn path_prefixes_select_whole_components() {
        let c = InsightConfig {
            paths: InsightConfig::parse_paths("/data/, /var/mail").unwrap(),
            ..InsightConfig::default()
        };
        assert!(c.selects("/data/x"));
        assert!(c.selects("/var/mail"));
        assert!(!c.selects("/database"));
        assert!(!c.selects("/etc/passwd"));
        assert!(InsightConfig::parse_paths("rel/x").is_err());
        assert!(InsightConfig::default().selects("anything"));
    }
}
