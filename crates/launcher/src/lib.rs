//! vmsight-launcher: starts QEMU 10 with vmsight's TCG plugin and vhost-user backends, talks
//! QMP, and supervises the VM from start to clean-up.

pub mod accel;
mod child;
pub mod config;
pub mod confine;
pub mod control;
pub mod copymap;
pub mod daemon;
pub mod devices;
pub mod disksource;
pub mod error;
pub mod fuzzing;
pub mod guestio;
pub mod hylics;
pub mod idle;
pub mod lookup;
pub mod net;
pub mod process;
pub mod qemu;
pub mod qmp;
pub mod redirect;
pub mod runtime;
pub mod stages;
pub mod stats;
pub mod stream;
pub mod supervisor;
pub mod swap;
pub mod sym;
pub mod term;
pub mod trace;
pub mod trace_records;
pub mod vm;

pub use config::{DiskSpec, VmConfig};
pub use error::LaunchError;
pub use vm::{run, Artifacts, EndReason, RunOutcome};
