//! vmsight-proto: what crosses process boundaries, defined once.
//!
//! - [`layout`]: the runtime directory (base directory, per-VM files, `vm.json`) through which
//!   `vmsight run` and the other commands find each other;
//! - [`control`]: requests and replies of a VM's control socket;
//! - [`server`]: the accept loop every Unix-socket service uses (event bus, view server,
//!   control socket);
//! - [`insight`]: request insights and the insight-log records (`--insights` →
//!   `vmsight report`).
//!
//! The crate is a leaf (serde, serde_json, thiserror, libc) because the TCG plugin, a shared
//! object loaded into QEMU, links it too.

pub mod control;
pub mod insight;
pub mod layout;
pub mod server;

pub use control::{ControlReply, ControlRequest, DiskStatus, RequestError, VmStatus};
pub use layout::{runtime_base, RunningVm, RuntimeLayout, VmPaths, VmRecord};
pub use server::{ServeError, UnixServer};
