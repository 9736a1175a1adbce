//! The view protocol between `vmsight mount` and a VM's view server (`view.sock`).
//!
//! Each message is a frame: a 4-byte little-endian length, then that many bytes of
//! [postcard](https://docs.rs/postcard) encoding a [`Request`] (client → server) or a
//! [`Response`] (server → client). One response per request, in order. Binary framing keeps
//! file data (up to [`MAX_READ`] per request) free of any text encoding overhead.
//!
//! One server shows every disk of its VM that it can read: [`Request::Mounts`] lists them with
//! the guest path each is mounted on, and every file-system question ([`FsRequest`]) names its
//! disk ([`Request::Fs`]). Putting the mount points together into one tree is the client's job
//! (`vmsight mount`).

use std::io::{self, Read, Write};

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use vmsight_fsview::{FileKind, InodeMeta};

/// Largest `len` of a [`Request::Read`].
pub const MAX_READ: u32 = 1 << 20;
/// Largest request frame.
pub const MAX_REQUEST_FRAME: u32 = 64 * 1024;
/// Largest response frame (a directory listing may be long).
pub const MAX_RESPONSE_FRAME: u32 = 64 << 20;

/// A disk of the VM: 0 is the root disk, then the `--disk` order (as in `vmsight run`).
pub type DiskId = u32;

/// A request to a VM's view server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// The disks the server shows and where the guest mounts them → [`Response::Mounts`].
    Mounts,
    /// A question about one disk's file system.
    Fs {
        /// Which disk.
        disk: DiskId,
        /// The question.
        op: FsRequest,
    },
}

impl Request {
    /// A question about disk `disk`.
    pub fn fs(disk: DiskId, op: FsRequest) -> Request {
        Request::Fs { disk, op }
    }
}

/// A question about one guest file system. Inode numbers are the guest's; 2 is the root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsRequest {
    /// Metadata of an inode → [`Response::Attr`].
    Stat(u32),
    /// Entries of a directory (no `.`/`..`) → [`Response::Entries`].
    ReadDir(u32),
    /// Resolve a name in a directory → [`Response::Attr`] of the target.
    Lookup {
        /// Directory inode.
        dir: u32,
        /// Name bytes.
        name: Vec<u8>,
    },
    /// Target of a symlink → [`Response::Link`].
    ReadLink(u32),
    /// File data → [`Response::Data`] (short at end of file).
    Read {
        /// Inode.
        ino: u32,
        /// Byte offset.
        offset: u64,
        /// Bytes wanted, at most [`MAX_READ`].
        len: u32,
    },
}

/// Where the guest mounts one disk's file system.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskMount {
    /// The disk.
    pub disk: DiskId,
    /// Absolute guest path of its root: `/` for the root disk, the `mount=` of an extra disk,
    /// `/@diskN` when it has none.
    pub path: Vec<u8>,
}

/// Inode metadata on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    /// Guest inode number.
    pub ino: u32,
    /// `st_mode`.
    pub mode: u16,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Status change time.
    pub ctime: i64,
    /// Access time.
    pub atime: i64,
    /// Hard links.
    pub links: u16,
}

impl Attr {
    /// From the index's metadata.
    pub fn from_meta(ino: u32, m: &InodeMeta) -> Attr {
        Attr {
            ino,
            mode: m.mode,
            uid: m.uid,
            gid: m.gid,
            size: m.size,
            mtime: m.mtime,
            ctime: m.ctime,
            atime: m.atime,
            links: m.links,
        }
    }

    /// The file kind.
    pub fn kind(&self) -> FileKind {
        FileKind::from_mode(self.mode)
    }
}

/// One directory entry on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Name bytes.
    pub name: Vec<u8>,
    /// Target inode.
    pub ino: u32,
    /// Kind of the target.
    pub kind: FileKind,
}

/// What went wrong, as a class the client can map to an errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// No such inode or name.
    NotFound,
    /// Not a directory.
    NotDir,
    /// Not a symlink.
    NotLink,
    /// A malformed or out-of-range request.
    Invalid,
    /// Reading the disk failed.
    Io,
}

/// The answer to one [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// Metadata.
    Attr(Attr),
    /// Directory entries sorted by name.
    Entries(Vec<Entry>),
    /// Symlink target.
    Link(Vec<u8>),
    /// File bytes.
    Data(Vec<u8>),
    /// The disks shown, each with its guest mount point.
    Mounts(Vec<DiskMount>),
    /// The request failed.
    Error {
        /// Class.
        code: ErrorCode,
        /// Sentence for logs.
        message: String,
    },
}

impl Response {
    /// An error response.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Response {
        Response::Error {
            code,
            message: message.into(),
        }
    }
}

/// Writes one frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
    let body = postcard::to_stdvec(msg).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(body.len() + 4);
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)
}

/// A frame that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    /// The frame announces more than the limit (the stream cannot be resynchronised).
    #[error("frame of {0} bytes is larger than the limit of {1}")]
    TooLarge(u32, u32),
    /// The body is not a valid message (the stream stays usable).
    #[error("malformed frame: {0}")]
    Decode(postcard::Error),
    /// Reading failed.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Reads one frame of at most `limit` bytes.
pub fn read_frame<T: DeserializeOwned>(r: &mut impl Read, limit: u32) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    if let Err(e) = r.read_exact(&mut len) {
        return Err(if e.kind() == io::ErrorKind::UnexpectedEof {
            FrameError::Closed
        } else {
            FrameError::Io(e)
        });
    }
    let len = u32::from_le_bytes(len);
    if len > limit {
        return Err(FrameError::TooLarge(len, limit));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    postcard::from_bytes(&body).map_err(FrameError::Decode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let reqs = [
            Request::Mounts,
            Request::fs(0, FsRequest::Stat(2)),
            Request::fs(1, FsRequest::ReadDir(11)),
            Request::fs(
                0,
                FsRequest::Lookup {
                    dir: 2,
                    name: b"etc".to_vec(),
                },
            ),
            Request::fs(7, FsRequest::ReadLink(13)),
            Request::fs(
                u32::MAX,
                FsRequest::Read {
                    ino: 12,
                    offset: 1 << 40,
                    len: MAX_READ,
                },
            ),
        ];
        let mut buf = Vec::new();
        for r in &reqs {
            write_frame(&mut buf, r).unwrap();
        }
        let mut rd = &buf[..];
        for r in &reqs {
            let got: Request = read_frame(&mut rd, MAX_REQUEST_FRAME).unwrap();
            assert_eq!(&got, r);
        }
        assert!(matches!(
            read_frame::<Request>(&mut rd, MAX_REQUEST_FRAME),
            Err(FrameError::Closed)
        ));
        let mounts = Response::Mounts(vec![DiskMount {
            disk: 2,
            path: b"/mnt/data".to_vec(),
        }]);
        let mut buf = Vec::new();
        write_frame(&mut buf, &mounts).unwrap();
        let got: Response = read_frame(&mut &buf[..], MAX_RESPONSE_FRAME).unwrap();
        assert_eq!(got, mounts);
    }

    #[test]
    fn oversized_truncated_and_garbage_frames_are_errors() {
        let mut big = (MAX_REQUEST_FRAME + 1).to_le_bytes().to_vec();
        big.extend_from_slice(&[0; 8]);
        assert!(matches!(
            read_frame::<Request>(&mut &big[..], MAX_REQUEST_FRAME),
            Err(FrameError::TooLarge(..))
        ));
        let short = [10u8, 0, 0, 0, 1, 2];
        assert!(matches!(
            read_frame::<Request>(&mut &short[..], MAX_REQUEST_FRAME),
            Err(FrameError::Io(_))
        ));
        let garbage = [2u8, 0, 0, 0, 0xff, 0xff];
        assert!(matches!(
            read_frame::<Request>(&mut &garbage[..], MAX_REQUEST_FRAME),
            Err(FrameError::Decode(_))
        ));
    }
}
