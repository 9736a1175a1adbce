//! Hylics (paper §3): a host in-memory file system shared with the guest.
//!
//! `--shared-mem SIZE[,path=DIR][,cache=MODE]` gives the VM a tmpfs of its own on the host
//! ([`share::Share`], mounted in the VM's runtime directory), served to the guest through
//! virtio-fs by virtiofsd ([`virtiofsd`], sandboxed to that tmpfs) and mounted by the guest's
//! init at `/hylics`. Host tools read and write the same files (`vmsight hylics NAME path`);
//! the size limit changes while the VM runs (`vmsight hylics NAME resize SIZE`). The device is
//! `crate::devices::fs`.
//!
//! With `--hylics-slo`, a controller ([`control::ShareController`], paper §5) sizes the share
//! from the task response times the guest library reports over vsock ([`offload`] serves
//! that channel; the device is `crate::devices::vsock`).

pub mod control;
pub mod handover;
pub mod offload;
pub mod share;
pub mod slo;
pub mod spec;
pub mod virtiofsd;

use std::sync::Arc;

pub use control::{ControlError, ShareController};
pub use share::{Share, ShareError};
pub use slo::{SloError, SloSpec};
pub use spec::{CacheMode, ShareSpec, ShareSpecError};

/// A VM's Hylics parts: its share, with `--hylics-slo` the controller sizing it, and with an
/// isolated network on vmsight's NIC the steering table of the socket scheme.
#[derive(Clone)]
pub struct Hylics {
    pub share: Arc<Share>,
    pub controller: Option<Arc<ShareController>>,
    pub steer: Option<Arc<vmsight_netdev::stages::steer::SteerControl>>,
}
