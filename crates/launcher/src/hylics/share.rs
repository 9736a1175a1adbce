//! The host side of the VM's share: a tmpfs of its own, mounted in the VM's runtime directory,
//! resizable while the VM runs, unmounted with the VM.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use vmsight_proto::hylics::ShareInfo;

use super::spec::{ShareSpec, TAG};

/// Why the share could not be made, resized or read.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    #[error("cannot create the share's mount point {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot mount a tmpfs on {path} (vmsight needs root for --shared-mem): {source}")]
    Mount {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("cannot resize the share {path} to {size} bytes: {source}")]
    Resize {
        path: PathBuf,
        size: u64,
        #[source]
        source: nix::Error,
    },
    #[error("cannot shrink the share {path} to {size} bytes: {used} bytes are in use (move or delete files first)")]
    InUse { path: PathBuf, size: u64, used: u64 },
    #[error("cannot read the share's usage at {path}: {source}")]
    Stat {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("cannot write {path}: {source}")]
    Info {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A mounted tmpfs, the VM's share. Unmounted (lazily, so a host tool still inside does not
/// keep it) and its mount point removed when dropped.
#[derive(Debug)]
pub struct Share {
    dir: PathBuf,
    info_path: PathBuf,
    guest_path: String,
    cache: &'static str,
    size: AtomicU64,
    /// Who owns the share's root (`None`: vmsight's user).
    owner: Option<(u32, u32)>,
    resizes: AtomicU64,
    /// Serializes resizes (the control socket may get two at once).
    resizing: Mutex<()>,
}

/// Bytes and inodes in use on a mounted file system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Usage {
    used_bytes: u64,
    files: u64,
}

fn usage(dir: &Path) -> Result<Usage, ShareError> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(|source| ShareError::Stat {
        path: dir.to_owned(),
        source,
    })?;
    let frsize = st.fragment_size();
    Ok(Usage {
        used_bytes: (st.blocks() - st.blocks_free()) * frsize,
        files: st.files() - st.files_free(),
    })
}

/// tmpfs mount options for a size (`mode=0755`: the guest's root owns the share's root),
/// with the share's root given to `owner` (the uid and gid virtiofsd runs as, when not
/// vmsight's: `crate::confine`).
fn tmpfs_options(size: u64, owner: Option<(u32, u32)>) -> String {
    match owner {
        Some((uid, gid)) => format!("size={size},mode=0755,uid={uid},gid={gid}"),
        None => format!("size={size},mode=0755"),
    }
}

impl Share {
    /// Mounts a tmpfs of `spec.size` bytes at `dir` (made if missing; a stale mount left by a
    /// killed run of a VM of the same name is replaced) and writes `info_path`. The parent of
    /// `dir` is made private (0700): the tmpfs's root must be 0755 for the guest, and the
    /// parent keeps other host users out. `owner` gets the share's root (virtiofsd's
    /// uid and gid when it runs as another user).
    pub fn create(
        dir: &Path,
        info_path: &Path,
        spec: &ShareSpec,
        owner: Option<(u32, u32)>,
    ) -> Result<Share, ShareError> {
        let dir_err = |source| ShareError::Dir {
            path: dir.to_owned(),
            source,
        };
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(dir)
            .map_err(dir_err)?;
        if let Some(parent) = dir.parent() {
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700))
                .map_err(dir_err)?;
        }
        // A mount point from a run that never reached teardown: drop it (its files belonged
        // to a VM that is gone).
        while is_mount_point(dir) {
            if umount2(dir, MntFlags::MNT_DETACH).is_err() {
                break;
            }
        }
        mount(
            Some("vmsight-share"),
            dir,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(tmpfs_options(spec.size, owner).as_str()),
        )
        .map_err(|source| ShareError::Mount {
            path: dir.to_owned(),
            source,
        })?;
        let share = Share {
            dir: dir.to_owned(),
            info_path: info_path.to_owned(),
            guest_path: spec.guest_path.clone(),
            cache: spec.cache.as_str(),
            size: AtomicU64::new(spec.size),
            owner,
            resizes: AtomicU64::new(0),
            resizing: Mutex::new(()),
        };
        // The tmpfs's root: 0755 from the mount options (the guest's view); its parent stays
        // private.
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
        share.write_info()?;
        Ok(share)
    }

    /// The host directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The size limit now, bytes.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    /// The share as `vmsight hylics` shows it (usage read now; zero if unreadable).
    pub fn info(&self) -> ShareInfo {
        let u = usage(&self.dir).unwrap_or(Usage {
            used_bytes: 0,
            files: 0,
        });
        ShareInfo {
            host_path: self.dir.display().to_string(),
            guest_path: self.guest_path.clone(),
            tag: TAG.to_owned(),
            size_bytes: self.size(),
            used_bytes: u.used_bytes,
            files: u.files,
            cache: self.cache.to_owned(),
            resizes: self.resizes.load(Ordering::Relaxed),
        }
    }

    /// Changes the size limit while the VM runs. Growing always works; shrinking below the
    /// bytes in use is refused (tmpfs would refuse it too), so nothing is ever lost.
    pub fn resize(&self, size: u64) -> Result<ShareInfo, ShareError> {
        let _one = self
            .resizing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let used = usage(&self.dir)?.used_bytes;
        if size < used {
            return Err(ShareError::InUse {
                path: self.dir.clone(),
                size,
                used,
            });
        }
        mount(
            None::<&str>,
            &self.dir,
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(tmpfs_options(size, self.owner).as_str()),
        )
        .map_err(|source| ShareError::Resize {
            path: self.dir.clone(),
            size,
            source,
        })?;
        self.size.store(size, Ordering::Relaxed);
        self.resizes.fetch_add(1, Ordering::Relaxed);
        self.write_info()?;
        Ok(self.info())
    }

    /// Writes `hylics.json` for `vmsight hylics NAME ...`.
    fn write_info(&self) -> Result<(), ShareError> {
        let err = |source| ShareError::Info {
            path: self.info_path.clone(),
            source,
        };
        let json = serde_json::to_vec_pretty(&self.info()).map_err(std::io::Error::other);
        std::fs::write(&self.info_path, json.map_err(err)?).map_err(err)
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.info_path);
        if let Err(e) = umount2(&self.dir, MntFlags::MNT_DETACH) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot unmount the share");
            return;
        }
        let _ = std::fs::remove_dir(&self.dir);
        // The private parent, when nothing else is in it.
        if let Some(parent) = self.dir.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

/// Whether `dir` is the root of a mount (its device differs from its parent's).
fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(d), Some(Ok(p))) = (std::fs::metadata(dir), dir.parent().map(std::fs::metadata)) else {
        return false;
    };
    d.dev() != p.dev()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hylics::spec::CacheMode;

    fn root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    fn spec(size: u64) -> ShareSpec {
        ShareSpec {
            size,
            guest_path: "/hylics".into(),
            cache: CacheMode::Auto,
            writeback: false,
            threads: 0,
        }
    }

    #[test]
    fn tmpfs_options_carry_the_size() {
        assert_eq!(tmpfs_options(1 << 20, None), "size=1048576,mode=0755");
        assert_eq!(
            tmpfs_options(1 << 20, Some((7, 8))),
            "size=1048576,mode=0755,uid=7,gid=8"
        );
    }

    /// Mounting needs root; as another user the test checks the error instead.
    #[test]
    fn a_share_holds_at_most_its_size_grows_and_refuses_to_shrink_below_its_use() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("hylics/share");
        let info = tmp.path().join("hylics.json");
        if !root() {
            let e = Share::create(&dir, &info, &spec(1 << 20), None).expect_err("not root");
            assert!(e.to_string().contains("needs root"), "{e}");
            return;
        }
        let share = Share::create(&dir, &info, &spec(1 << 20), None).expect("mounts");
        assert!(is_mount_point(&dir));
        use std::os::unix::fs::MetadataExt;
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").mode() & 0o777;
        assert_eq!(
            mode(dir.parent().expect("parent")),
            0o700,
            "other users stay out"
        );
        assert_eq!(mode(&dir), 0o755, "the guest's root of the share");
        let written: ShareInfo =
            serde_json::from_slice(&std::fs::read(&info).expect("info")).expect("json");
        assert_eq!(written.size_bytes, 1 << 20);
        // 2 MiB do not fit in 1 MiB: ENOSPC at the limit.
        let big = vec![7u8; 2 << 20];
        let e = std::fs::write(dir.join("big"), &big).expect_err("full");
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        std::fs::remove_file(dir.join("big")).expect("rm");
        // Grown, it fits, and every byte is there.
        let after = share.resize(4 << 20).expect("grows");
        assert_eq!((after.size_bytes, after.resizes), (4 << 20, 1));
        std::fs::write(dir.join("big"), &big).expect("fits now");
        assert_eq!(std::fs::read(dir.join("big")).expect("read"), big);
        // Shrinking below the 2 MiB in use is refused and changes nothing.
        let e = share.resize(1 << 20).expect_err("in use");
        assert!(matches!(e, ShareError::InUse { .. }), "{e}");
        assert_eq!(share.size(), 4 << 20);
        assert_eq!(std::fs::read(dir.join("big")).expect("read"), big);
        // Shrinking to what still fits works.
        share.resize(3 << 20).expect("shrinks");
        drop(share);
        assert!(!dir.exists(), "the mount point goes with the share");
        assert!(
            !tmp.path().join("hylics").exists(),
            "and its private parent"
        );
        assert!(!info.exists(), "hylics.json goes with the share");
    }

    #[test]
    fn a_stale_mount_of_the_same_name_is_replaced() {
        if !root() {
            return;
        }
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("share");
        let info = tmp.path().join("hylics.json");
        let old = Share::create(&dir, &info, &spec(1 << 20), None).expect("mounts");
        std::fs::write(dir.join("old"), b"x").expect("write");
        std::mem::forget(old); // as a SIGKILLed run leaves it
        let new = Share::create(&dir, &info, &spec(2 << 20), None).expect("mounts again");
        assert!(!dir.join("old").exists());
        assert_eq!(new.info().size_bytes, 2 << 20);
    }
}
