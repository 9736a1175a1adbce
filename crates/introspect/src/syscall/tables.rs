//! The syscall name and errno tables, defined once in [`vmsight_proto::syscall`] (the plugin
//! uses the same table) and re-exported here.

pub use vmsight_proto::syscall::{errno_name, SYSCALL_NAMES};
