//! Hylics (paper §3): a host in-memory file system shared with the guest.
//!
//! `--shared-mem SIZE[,path=DIR][,cache=MODE]` gives the VM a tmpfs of its own on the host
//! ([`share::Share`], mounted in the VM's runtime directory), served to the guest through
//! virtio-fs by virtiofsd ([`virtiofsd`], sandboxed to that tmpfs) and mounted by the guest's
//! init at `/hylics`. Host tools read and write the same files (`vmsight hylics NAME path`);
//! the size limit changes while the VM runs (`vmsight hylics NAME resize SIZE`). The device is
//! `crate::devices::fs`.

pub mod offload;
pub mod share;
pub mod spec;
pub mod virtiofsd;

pub use share::{Share, ShareError};
pub use spec::{CacheMode, ShareSpec, ShareSpecError};
