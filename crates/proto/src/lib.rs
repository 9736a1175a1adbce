//! vmsight-proto: what crosses process boundaries, defined once.
//!
//! - [`layout`]: the runtime directory (base directory, per-VM files, `vm.json`) through which
//!   `vmsight run` and the other commands find each other;
//! - [`control`]: requests and replies of a VM's control socket;
//! - [`server`]: the accept loop every Unix-socket service uses (event bus, view server,
//!   control socket);
//! - [`insight`]: request insights and the insight-log records (`--insights` →
//!   `vmsight report`);
//! - [`net`]: how a VM's NIC is attached (`net.json` → `vmsight net`);
//! - [`profile`]: the kernel profile format (`profile.json`: image build → plugin, process
//!   tracking);
//! - [`redirect`]: vCPU redirection requests and outcomes (control socket and plugin mailbox);
//! - [`swap`]: SwapBypass's report (swap disk, cache, bypass, added memory);
//! - [`sym`]: the symbiotic interface (the region shared with the guest module, call numbers);
//! - [`syscall`]: the x86-64 syscall table (names, errno names, what each argument is), shared
//!   by the plugin (which captures string and buffer arguments) and the trace decoder.
//!
//! The crate is a leaf (serde, serde_json, thiserror, libc) because the TCG plugin, a shared
//! object loaded into QEMU, links it too.

pub mod control;
pub mod hylics;
pub mod insight;
pub mod layout;
pub mod net;
pub mod peer;
pub mod profile;
pub mod redirect;
pub mod server;
pub mod swap;
pub mod sym;
pub mod syscall;

pub use control::{ControlReply, ControlRequest, DiskStatus, RequestError, VmStatus};
pub use layout::{runtime_base, QemuInfo, QemuKind, RunningVm, RuntimeLayout, VmPaths, VmRecord};
pub use profile::{KernelProfile, ProfileError, PROFILE_FORMAT};
pub use server::{ServeError, UnixServer};
