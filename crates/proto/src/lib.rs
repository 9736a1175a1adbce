//! vmsight-proto: what crosses process boundaries, defined once.
//!
//! - [`layout`]: the runtime directory (base directory, per-VM files, `vm.json`) through which
//!   `vmsight run` and the other commands find each other.
//!
//! The crate is a leaf (serde, serde_json, thiserror, libc) because the TCG plugin, a shared
//! object loaded into QEMU, links it too.

pub mod layout;

pub use layout::{runtime_base, RunningVm, RuntimeLayout, VmPaths, VmRecord};
