//! How the disks of one VM form one tree in `vmsight mount`, as the guest's own mounts do:
//! the root disk at `DIR/<host>/<vm>/`, every other disk at its guest mount point, hiding the
//! directory below it. Pure logic over paths; `mount.rs` applies it to inodes.

use crate::protocol::{DiskId, DiskMount};

/// A guest path as its components (`/mnt/data` is `["mnt", "data"]`, `/` is empty).
pub(crate) type Components = Vec<Vec<u8>>;

/// The components of an absolute guest path, or `None` when it is not absolute or climbs
/// (`..`). Empty components and `.` are dropped.
pub(crate) fn components(path: &[u8]) -> Option<Components> {
    if path.first() != Some(&b'/') {
        return None;
    }
    let mut out = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return None,
            c => out.push(c.to_vec()),
        }
    }
    Some(out)
}

/// The mount points of one VM's disks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct MountTable {
    /// (mount point, disk), at most one disk per mount point (the first listed wins).
    mounts: Vec<(Components, DiskId)>,
}

impl MountTable {
    /// The table of a server's [`DiskMount`] list; mount points that are not absolute paths
    /// or climb with `..`, disks `keep` refuses, and second disks on a mount point are left out.
    pub(crate) fn new(list: &[DiskMount], keep: impl Fn(DiskId) -> bool) -> MountTable {
        let mut mounts: Vec<(Components, DiskId)> = Vec::new();
        for m in list {
            let Some(c) = components(&m.path) else {
                tracing::warn!("disk {}: ignoring mount point {:?}", m.disk, m.path);
                continue;
            };
            if keep(m.disk) && !mounts.iter().any(|(p, _)| *p == c) {
                mounts.push((c, m.disk));
            }
        }
        MountTable { mounts }
    }

    /// The disk mounted exactly at `path`.
    pub(crate) fn disk_at(&self, path: &[Vec<u8>]) -> Option<DiskId> {
        self.mounts
            .iter()
            .find(|(p, _)| p.as_slice() == path)
            .map(|&(_, d)| d)
    }

    /// Whether some mount point lies strictly below `path` (so `path` is a directory on the
    /// way to it).
    pub(crate) fn leads_to_mount(&self, path: &[Vec<u8>]) -> bool {
        self.mounts
            .iter()
            .any(|(p, _)| p.len() > path.len() && p.starts_with(path))
    }

    /// The names in directory `path` that are mount points or lead to one, sorted, once each.
    pub(crate) fn names_below(&self, path: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let mut names: Vec<Vec<u8>> = self
            .mounts
            .iter()
            .filter(|(p, _)| p.len() > path.len() && p.starts_with(path))
            .map(|(p, _)| p[path.len()].clone())
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(disk: DiskId, path: &str) -> DiskMount {
        DiskMount {
            disk,
            path: path.as_bytes().to_vec(),
        }
    }

    fn p(s: &str) -> Components {
        components(s.as_bytes()).unwrap()
    }

    #[test]
    fn paths_split_into_components() {
        assert_eq!(p("/"), Vec::<Vec<u8>>::new());
        assert_eq!(p("/mnt//data/./"), vec![b"mnt".to_vec(), b"data".to_vec()]);
        assert_eq!(components(b"mnt/data"), None);
        assert_eq!(components(b"/mnt/../etc"), None);
        assert_eq!(components(b""), None);
    }

    #[test]
    fn mount_points_and_the_directories_leading_to_them() {
        let t = MountTable::new(
            &[
                m(0, "/"),
                m(1, "/mnt/data"),
                m(2, "/@disk2"),
                m(3, "/mnt/data/inner"),
                m(4, "/mnt/data"),   // second disk on one mount point: left out
                m(5, "relative"),    // not absolute: left out
                m(300, "/too/many"), // refused by `keep`
            ],
            |d| d < 255,
        );
        assert_eq!(t.disk_at(&p("/")), Some(0));
        assert_eq!(t.disk_at(&p("/mnt/data")), Some(1));
        assert_eq!(t.disk_at(&p("/mnt/data/inner")), Some(3));
        assert_eq!(t.disk_at(&p("/@disk2")), Some(2));
        assert_eq!(t.disk_at(&p("/mnt")), None);
        assert_eq!(t.disk_at(&p("/too/many")), None);
        assert!(t.leads_to_mount(&p("/")));
        assert!(t.leads_to_mount(&p("/mnt")));
        assert!(t.leads_to_mount(&p("/mnt/data")));
        assert!(!t.leads_to_mount(&p("/mnt/data/inner")));
        assert!(!t.leads_to_mount(&p("/etc")));
        assert!(!t.leads_to_mount(&p("/too")));
        assert_eq!(
            t.names_below(&p("/")),
            vec![b"@disk2".to_vec(), b"mnt".to_vec()]
        );
        assert_eq!(t.names_below(&p("/mnt")), vec![b"data".to_vec()]);
        assert_eq!(t.names_below(&p("/mnt/data")), vec![b"inner".to_vec()]);
        assert!(t.names_below(&p("/etc")).is_empty());
    }
}
