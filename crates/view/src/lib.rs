//! vmsight-view: the live read-only view of guest file systems (DS-VMI / Gamma-Ray §IV-B,
//! "/cloud"; issue 5 part 5).
//!
//! Each running VM serves its file system on `<runtime>/<vm>/view.sock` ([`ViewServer`],
//! answering from any [`ViewSource`]: a static crawl or the live inference engine), and
//! `vmsight mount DIR` ([`mount`]) shows every such VM as `DIR/<host>/<vm>/<guest path>`
//! through FUSE. A server shows every disk of its VM it can read, each at its guest mount
//! point (the root disk at `/`). The wire protocol is in [`protocol`].

mod mount;
pub mod protocol;
mod server;
mod tree;

pub use mount::{mount, MountOptions, ViewFs};
pub use server::{
    handle, ServedDisk, ViewClient, ViewError, ViewServer, ViewSource, MAX_CONNECTIONS, VIEW_SOCKET,
};
