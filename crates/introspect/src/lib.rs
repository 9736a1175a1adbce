//! vmsight-introspect: guest kernel knowledge for VMM-level introspection.
//!
//! [`profile`] builds and loads the kernel profile (symbol addresses and struct layouts of the
//! guest kernel); [`btf`] is the small BTF reader behind it. [`memory`] reads guest RAM from
//! QEMU's shared memory backend and translates virtual addresses; [`kernel`] reads kernel
//! objects (tasks, open files, paths) through it with the profile.

pub mod btf;
pub mod kernel;
pub mod memory;
pub mod profile;
pub mod syscall;

pub use kernel::{FdInfo, KernelError, KernelView, TaskInfo};
pub use memory::{AddressSpace, GuestRam, MemError, QemuRam, RamLayout};
pub use profile::{GenerateError, KernelProfile, ProfileError};
