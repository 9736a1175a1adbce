//! vmsight-introspect: guest kernel knowledge for VMM-level introspection.
//!
//! [`profile`] builds and loads the kernel profile (symbol addresses and struct layouts of the
//! guest kernel); [`btf`] is the small BTF reader behind it.

pub mod btf;
pub mod profile;
pub mod syscall;

pub use profile::{KernelProfile, ProfileError};
