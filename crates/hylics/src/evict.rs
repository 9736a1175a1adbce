//! Which files to move out of the share when it shrinks.
//!
//! When the controller lowers m below what the share holds, files must move from the host
//! tmpfs to the VM's default file system (§5.2: "the video data are then transferred between
//! the in-memory file system and the default file system ... based on the control law"; §6.4
//! evicts segments not requested in the last minute). [`cold_files_to_evict`] picks the
//! coldest files first — least recent access, ties broken by path so the choice is
//! deterministic — until enough bytes are freed.

use std::cmp::Ordering;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A file in the share.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShareFile {
    /// Path (relative to the share, or absolute: only used to name and order files).
    pub path: PathBuf,
    /// Size, bytes.
    pub size_bytes: u64,
    /// Last access, seconds (any fixed origin; smaller is colder).
    pub last_access_secs: f64,
}

/// The files to move, coldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvictionPlan {
    /// The chosen files, in eviction order.
    pub files: Vec<ShareFile>,
    /// Their total size, bytes.
    pub bytes_freed: u64,
    /// Whether `bytes_freed` reaches the requested amount (false: even evicting every
    /// non-empty file is not enough).
    pub enough: bool,
}

/// How many bytes must leave a share holding `used_bytes` to fit in `new_size_bytes`.
pub fn bytes_to_free(used_bytes: u64, new_size_bytes: u64) -> u64 {
    used_bytes.saturating_sub(new_size_bytes)
}

/// The least recently used files whose sizes add up to at least `bytes_to_free` (empty files
/// are skipped: moving them frees nothing). Asking for 0 bytes yields an empty plan.
pub fn cold_files_to_evict(files: &[ShareFile], bytes_to_free: u64) -> EvictionPlan {
    let mut order: Vec<&ShareFile> = files.iter().filter(|f| f.size_bytes > 0).collect();
    order.sort_by(|a, b| colder_first(a, b));
    let mut plan = EvictionPlan {
        files: Vec::new(),
        bytes_freed: 0,
        enough: bytes_to_free == 0,
    };
    for file in order {
        if plan.enough {
            break;
        }
        plan.bytes_freed = plan.bytes_freed.saturating_add(file.size_bytes);
        plan.files.push(file.clone());
        plan.enough = plan.bytes_freed >= bytes_to_free;
    }
    plan
}

fn colder_first(a: &ShareFile, b: &ShareFile) -> Ordering {
    a.last_access_secs
        .total_cmp(&b.last_access_secs)
        .then_with(|| a.path.cmp(&b.path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn file(name: &str, size_bytes: u64, last_access_secs: f64) -> ShareFile {
        ShareFile {
            path: PathBuf::from(name),
            size_bytes,
            last_access_secs,
        }
    }

    fn names(plan: &EvictionPlan) -> Vec<String> {
        plan.files
            .iter()
            .map(|f| f.path.display().to_string())
            .collect()
    }

    #[test]
    fn evicts_least_recently_used_first_until_enough() {
        let files = [
            file("hot", 100, 50.0),
            file("cold", 30, 1.0),
            file("warm", 40, 20.0),
            file("empty", 0, 0.0),
        ];
        let plan = cold_files_to_evict(&files, 50);
        assert_eq!(names(&plan), ["cold", "warm"]);
        assert_eq!((plan.bytes_freed, plan.enough), (70, true));
        assert!(cold_files_to_evict(&files, 0).files.is_empty());
        let all = cold_files_to_evict(&files, 1000);
        assert_eq!(names(&all), ["cold", "warm", "hot"]);
        assert!(!all.enough);
    }

    #[test]
    fn ties_are_broken_by_path() {
        let files = [file("b", 10, 5.0), file("a", 10, 5.0)];
        assert_eq!(names(&cold_files_to_evict(&files, 10)), ["a"]);
        assert_eq!(bytes_to_free(100, 60), 40);
        assert_eq!(bytes_to_free(50, 60), 0);
    }

    proptest! {
        #[test]
        fn frees_enough_and_no_more_files_than_needed(
            raw in prop::collection::vec((0u64..1000, 0.0f64..100.0), 0..20),
            want in 0u64..5000,
        ) {
            let files: Vec<ShareFile> = raw
                .iter()
                .enumerate()
                .map(|(i, (s, t))| file(&format!("f{i:02}"), *s, *t))
                .collect();
            let plan = cold_files_to_evict(&files, want);
            let total: u64 = files.iter().map(|f| f.size_bytes).sum();
            prop_assert_eq!(plan.enough, total >= want);
            prop_assert_eq!(plan.bytes_freed, plan.files.iter().map(|f| f.size_bytes).sum::<u64>());
            if let Some(last) = plan.files.last() {
                prop_assert!(plan.bytes_freed - last.size_bytes < want);
            }
            for pair in plan.files.windows(2) {
                prop_assert!(pair[0].last_access_secs <= pair[1].last_access_secs);
            }
        }
    }
}
