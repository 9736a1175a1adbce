//! The per-VM view server (`<runtime>/<vm>/view.sock`) and its client.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread;
use std::time::Duration;

use vmsight_fsview::{FileKind, FsRead, StaticView};
use vmsight_proto::server::{ServeError, UnixServer};

use crate::protocol::{
    read_frame, write_frame, Attr, DiskId, DiskMount, Entry, ErrorCode, FrameError, FsRequest,
    Request, Response, MAX_READ, MAX_REQUEST_FRAME, MAX_RESPONSE_FRAME,
};

/// File name of the view socket in a VM's runtime directory.
pub use vmsight_proto::layout::VIEW_SOCKET;
/// Most connections served at once.
pub const MAX_CONNECTIONS: usize = 64;

/// Something that can lend a consistent [`FsRead`] for the duration of one request: a
/// [`StaticView`], an `Arc<dyn FsRead>`, or a live engine behind a `RwLock`/`Mutex` (the lock
/// is held only while one request is answered).
pub trait ViewSource: Send + Sync + 'static {
    /// Calls `f` with the view.
    fn with_view<R>(&self, f: impl FnOnce(&dyn FsRead) -> R) -> R;
}

impl ViewSource for StaticView {
    fn with_view<R>(&self, f: impl FnOnce(&dyn FsRead) -> R) -> R {
        f(self)
    }
}

impl ViewSource for Arc<dyn FsRead> {
    fn with_view<R>(&self, f: impl FnOnce(&dyn FsRead) -> R) -> R {
        f(self.as_ref())
    }
}

impl<T: FsRead + 'static> ViewSource for RwLock<T> {
    fn with_view<R>(&self, f: impl FnOnce(&dyn FsRead) -> R) -> R {
        // A writer that panicked leaves the last state it reached; serving it beats failing.
        let g = self.read().unwrap_or_else(|e| e.into_inner());
        f(&*g)
    }
}

impl<T: FsRead + 'static> ViewSource for Mutex<T> {
    fn with_view<R>(&self, f: impl FnOnce(&dyn FsRead) -> R) -> R {
        let g = self.lock().unwrap_or_else(|e| e.into_inner());
        f(&*g)
    }
}

impl<S: ViewSource> ViewSource for Arc<S> {
    fn with_view<R>(&self, f: impl FnOnce(&dyn FsRead) -> R) -> R {
        self.as_ref().with_view(f)
    }
}

/// Errors of the view server and client.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The socket could not be created.
    #[error("cannot listen on {path}: {source}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Something that is not a socket is in the way.
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    /// Talking to a view server failed.
    #[error("view server {path}: {source}")]
    Client {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Mounting failed.
    #[error("cannot mount the view on {path}: {source}")]
    Mount {
        /// Mount point.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

impl From<ServeError> for ViewError {
    fn from(e: ServeError) -> ViewError {
        match e {
            ServeError::NotASocket(path) => ViewError::NotASocket(path),
            e => ViewError::Bind {
                path: e.path().to_path_buf(),
                source: e.into_io(),
            },
        }
    }
}

/// Answers one file-system question from `fs`.
pub fn handle(fs: &dyn FsRead, req: &FsRequest) -> Response {
    let not_found = |what: &str, ino: u32| {
        Response::error(ErrorCode::NotFound, format!("{what} {ino} not found"))
    };
    match req {
        FsRequest::Stat(ino) => match fs.stat(*ino) {
            Some(m) => Response::Attr(Attr::from_meta(*ino, &m)),
            None => not_found("inode", *ino),
        },
        FsRequest::ReadDir(ino) => match fs.read_dir(*ino) {
            Some(list) => Response::Entries(
                list.into_iter()
                    .map(|e| Entry {
                        name: e.name,
                        ino: e.ino,
                        kind: e.kind,
                    })
                    .collect(),
            ),
            None => match fs.stat(*ino) {
                Some(_) => {
                    Response::error(ErrorCode::NotDir, format!("inode {ino} is not a directory"))
                }
                None => not_found("directory", *ino),
            },
        },
        FsRequest::Lookup { dir, name } => {
            if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
                return Response::error(
                    ErrorCode::Invalid,
                    "names are non-empty, without '/' or NUL",
                );
            }
            match fs
                .lookup_in(*dir, name)
                .and_then(|ino| fs.stat(ino).map(|m| (ino, m)))
            {
                Some((ino, m)) => Response::Attr(Attr::from_meta(ino, &m)),
                None => Response::error(
                    ErrorCode::NotFound,
                    format!(
                        "{:?} not found in directory {dir}",
                        String::from_utf8_lossy(name)
                    ),
                ),
            }
        }
        FsRequest::ReadLink(ino) => match fs.read_link(*ino) {
            Some(t) => Response::Link(t),
            None => match fs.stat(*ino) {
                Some(_) => {
                    Response::error(ErrorCode::NotLink, format!("inode {ino} is not a symlink"))
                }
                None => not_found("inode", *ino),
            },
        },
        FsRequest::Read { ino, offset, len } => {
            if *len > MAX_READ {
                return Response::error(
                    ErrorCode::Invalid,
                    format!("read of {len} bytes is larger than the limit of {MAX_READ}"),
                );
            }
            match fs.stat(*ino) {
                None => return not_found("inode", *ino),
                Some(m) if m.kind() == FileKind::Directory => {
                    return Response::error(
                        ErrorCode::Invalid,
                        format!("inode {ino} is a directory"),
                    )
                }
                Some(_) => {}
            }
            let mut buf = vec![0u8; *len as usize];
            match fs.read(*ino, *offset, &mut buf) {
                Ok(n) => {
                    buf.truncate(n);
                    Response::Data(buf)
                }
                Err(e) => Response::error(ErrorCode::Io, e.to_string()),
            }
        }
    }
}

/// One disk a [`ViewServer`] shows.
pub struct ServedDisk<S> {
    /// The disk's number in the VM (0: root disk).
    pub disk: DiskId,
    /// Absolute guest path its file system is mounted on (`/` for the root disk).
    pub mount: String,
    /// Its file system.
    pub source: S,
}

/// The disks of one server, answering [`Request`]s.
struct Disks<S>(Vec<ServedDisk<S>>);

impl<S: ViewSource> Disks<S> {
    fn answer(&self, req: &Request) -> Response {
        match req {
            Request::Mounts => Response::Mounts(self.mounts()),
            Request::Fs { disk, op } => match self.0.iter().find(|d| d.disk == *disk) {
                Some(d) => d.source.with_view(|fs| handle(fs, op)),
                None => Response::error(ErrorCode::NotFound, format!("no disk {disk} is shown")),
            },
        }
    }

    /// The disks whose file system can be read now (a disk not crawled yet has no root).
    fn mounts(&self) -> Vec<DiskMount> {
        self.0
            .iter()
            .filter(|d| d.source.with_view(|fs| fs.stat(ROOT_INODE).is_some()))
            .map(|d| DiskMount {
                disk: d.disk,
                path: d.mount.as_bytes().to_vec(),
            })
            .collect()
    }
}

/// Inode of a file system's root directory.
const ROOT_INODE: u32 = 2;

/// Serves the guest file systems of one VM on a Unix socket. Dropping it stops accepting,
/// closes the connections and removes the socket.
pub struct ViewServer {
    path: PathBuf,
    conns: Connections,
    server: Option<UnixServer>,
}

impl ViewServer {
    /// Listens on `path` (normally `<runtime>/<vm>/view.sock`) and shows `source` as the root
    /// disk (disk 0, mounted on `/`).
    pub fn bind<S: ViewSource>(path: impl AsRef<Path>, source: S) -> Result<ViewServer, ViewError> {
        let root = ServedDisk {
            disk: 0,
            mount: "/".into(),
            source,
        };
        Self::bind_disks(path, vec![root])
    }

    /// Listens on `path` and shows each of `disks` at its mount point.
    pub fn bind_disks<S: ViewSource>(
        path: impl AsRef<Path>,
        disks: Vec<ServedDisk<S>>,
    ) -> Result<ViewServer, ViewError> {
        let path = path.as_ref().to_path_buf();
        let conns = Connections::default();
        let source = Arc::new(Disks(disks));
        let cs = conns.clone();
        let server =
            UnixServer::bind(&path, "view-accept", move |conn| accept(conn, &source, &cs))?;
        Ok(ViewServer {
            path,
            conns,
            server: Some(server),
        })
    }

    /// Convenience for a plain shared view.
    pub fn bind_fs(path: impl AsRef<Path>, fs: Arc<dyn FsRead>) -> Result<ViewServer, ViewError> {
        Self::bind(path, fs)
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ViewServer {
    fn drop(&mut self) {
        // Stops accepting and removes the socket file (if it is still ours).
        if let Some(server) = self.server.take() {
            server.stop();
        }
        self.conns.hang_up_all();
    }
}

/// The open connections, so that dropping the server can hang up on every client.
#[derive(Clone, Default)]
struct Connections {
    open: Arc<Mutex<HashMap<u64, UnixStream>>>,
    active: Arc<AtomicUsize>,
    next_id: Arc<AtomicUsize>,
}

impl Connections {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, UnixStream>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a connection; `None` when [`MAX_CONNECTIONS`] are open.
    fn add(&self, stream: &UnixStream) -> Option<u64> {
        if self.active.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::SeqCst) as u64;
        if let Ok(c) = stream.try_clone() {
            self.lock().insert(id, c);
        }
        self.active.fetch_add(1, Ordering::SeqCst);
        Some(id)
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
        self.active.fetch_sub(1, Ordering::SeqCst);
    }

    fn hang_up_all(&self) {
        for (_, c) in self.lock().drain() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Starts a thread serving one accepted connection, or refuses it when too many are open.
fn accept<S: ViewSource>(
    conn: io::Result<UnixStream>,
    source: &Arc<Disks<S>>,
    conns: &Connections,
) {
    let mut stream = match conn {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("view: accept failed: {e}");
            return;
        }
    };
    let Some(id) = conns.add(&stream) else {
        let msg = format!("too many connections (at most {MAX_CONNECTIONS})");
        let _ = write_frame(&mut stream, &Response::error(ErrorCode::Invalid, msg));
        return;
    };
    let (src, cs) = (Arc::clone(source), conns.clone());
    let spawned = thread::Builder::new()
        .name("view-conn".into())
        .spawn(move || {
            serve(stream, src.as_ref());
            cs.remove(id);
        });
    if let Err(e) = spawned {
        conns.remove(id);
        tracing::warn!("view: cannot start a connection thread: {e}");
    }
}

fn serve<S: ViewSource>(stream: UnixStream, source: &Disks<S>) {
    let Ok(wr) = stream.try_clone() else { return };
    let mut rd = BufReader::new(stream);
    let mut wr = BufWriter::new(wr);
    loop {
        let resp = match read_frame::<Request>(&mut rd, MAX_REQUEST_FRAME) {
            Ok(req) => source.answer(&req),
            Err(FrameError::Decode(e)) => {
                Response::error(ErrorCode::Invalid, format!("malformed request: {e}"))
            }
            Err(FrameError::TooLarge(n, lim)) => {
                // The rest of the stream cannot be framed any more: answer and hang up.
                let msg = format!("request of {n} bytes is larger than the limit of {lim}");
                let _ = write_frame(&mut wr, &Response::error(ErrorCode::Invalid, msg));
                let _ = wr.flush();
                return;
            }
            Err(FrameError::Closed | FrameError::Io(_)) => return,
        };
        if write_frame(&mut wr, &resp)
            .and_then(|()| wr.flush())
            .is_err()
        {
            return;
        }
    }
}

/// A connection to a view server.
pub struct ViewClient {
    path: PathBuf,
    rd: BufReader<UnixStream>,
    wr: UnixStream,
}

impl ViewClient {
    /// Connects to `path`; a request waits at most `timeout` for its answer.
    pub fn connect(path: impl AsRef<Path>, timeout: Duration) -> Result<ViewClient, ViewError> {
        let path = path.as_ref().to_path_buf();
        let err = |source| ViewError::Client {
            path: path.clone(),
            source,
        };
        let s = UnixStream::connect(&path).map_err(err)?;
        s.set_read_timeout(Some(timeout)).map_err(err)?;
        s.set_write_timeout(Some(timeout)).map_err(err)?;
        let wr = s.try_clone().map_err(err)?;
        Ok(ViewClient {
            rd: BufReader::new(s),
            wr,
            path,
        })
    }

    /// Asks disk `disk`'s file system `op` and waits for the answer.
    pub fn fs(&mut self, disk: DiskId, op: FsRequest) -> Result<Response, ViewError> {
        self.call(&Request::Fs { disk, op })
    }

    /// Sends `req` and waits for its answer.
    pub fn call(&mut self, req: &Request) -> Result<Response, ViewError> {
        let err = |source| ViewError::Client {
            path: self.path.clone(),
            source,
        };
        write_frame(&mut self.wr, req).map_err(err)?;
        read_frame::<Response>(&mut self.rd, MAX_RESPONSE_FRAME).map_err(|e| ViewError::Client {
            path: self.path.clone(),
            source: match e {
                FrameError::Io(e) => e,
                other => io::Error::other(other.to_string()),
            },
        })
    }
}

/// A disk not crawled yet (no root): a test fixture, also of the mount tests.
#[cfg(test)]
pub(crate) struct Empty;

#[cfg(test)]
impl FsRead for Empty {
    fn stat(&self, _: u32) -> Option<vmsight_fsview::InodeMeta> {
        None
    }
    fn read_dir(&self, _: u32) -> Option<Vec<vmsight_fsview::ViewEntry>> {
        None
    }
    fn lookup_in(&self, _: u32, _: &[u8]) -> Option<u32> {
        None
    }
    fn read_link(&self, _: u32) -> Option<Vec<u8>> {
        None
    }
    fn read(&self, _: u32, _: u64, _: &mut [u8]) -> vmsight_fsview::Result<usize> {
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_fsview::{InodeMeta, ViewEntry};

    /// A two-file tree: / (2) with `a` (12, "hello") and `l` -> a (13).
    struct Tiny;

    impl FsRead for Tiny {
        fn stat(&self, ino: u32) -> Option<InodeMeta> {
            let (mode, size) = match ino {
                2 => (0o040755, 4096),
                12 => (0o100644, 5),
                13 => (0o120777, 1),
                _ => return None,
            };
            Some(InodeMeta {
                mode,
                uid: 1,
                gid: 2,
                size,
                mtime: 3,
                ctime: 4,
                atime: 5,
                links: 1,
            })
        }
        fn read_dir(&self, ino: u32) -> Option<Vec<ViewEntry>> {
            (ino == 2).then(|| {
                vec![
                    ViewEntry {
                        name: b"a".to_vec(),
                        ino: 12,
                        kind: FileKind::Regular,
                    },
                    ViewEntry {
                        name: b"l".to_vec(),
                        ino: 13,
                        kind: FileKind::Symlink,
                    },
                ]
            })
        }
        fn lookup_in(&self, dir: u32, name: &[u8]) -> Option<u32> {
            self.read_dir(dir)?
                .into_iter()
                .find(|e| e.name == name)
                .map(|e| e.ino)
        }
        fn read_link(&self, ino: u32) -> Option<Vec<u8>> {
            (ino == 13).then(|| b"a".to_vec())
        }
        fn read(&self, ino: u32, offset: u64, buf: &mut [u8]) -> vmsight_fsview::Result<usize> {
            let data: &[u8] = if ino == 12 { b"hello" } else { b"" };
            let start = usize::try_from(offset)
                .unwrap_or(usize::MAX)
                .min(data.len());
            let n = buf.len().min(data.len() - start);
            buf[..n].copy_from_slice(&data[start..start + n]);
            Ok(n)
        }
    }

    fn server() -> (tempfile::TempDir, ViewServer) {
        let d = tempfile::tempdir().unwrap();
        let s = ViewServer::bind(d.path().join(VIEW_SOCKET), RwLock::new(Tiny)).unwrap();
        (d, s)
    }

    #[test]
    fn answers_every_request_kind() {
        let (_d, s) = server();
        let mut c = ViewClient::connect(s.path(), Duration::from_secs(30)).unwrap();
        let Response::Attr(a) = c.fs(0, FsRequest::Stat(12)).unwrap() else {
            panic!()
        };
        assert_eq!(
            (a.mode, a.uid, a.gid, a.size, a.mtime),
            (0o100644, 1, 2, 5, 3)
        );
        let Response::Entries(e) = c.fs(0, FsRequest::ReadDir(2)).unwrap() else {
            panic!()
        };
        assert_eq!(
            e.iter().map(|e| e.name.as_slice()).collect::<Vec<_>>(),
            [b"a", b"l"]
        );
        let r = c
            .fs(
                0,
                FsRequest::Lookup {
                    dir: 2,
                    name: b"l".to_vec(),
                },
            )
            .unwrap();
        assert!(matches!(r, Response::Attr(Attr { ino: 13, .. })));
        assert_eq!(
            c.fs(0, FsRequest::ReadLink(13)).unwrap(),
            Response::Link(b"a".to_vec())
        );
        let r = c
            .fs(
                0,
                FsRequest::Read {
                    ino: 12,
                    offset: 1,
                    len: 100,
                },
            )
            .unwrap();
        assert_eq!(r, Response::Data(b"ello".to_vec()));
    }

    #[test]
    fn errors_are_messages() {
        let (_d, s) = server();
        let mut c = ViewClient::connect(s.path(), Duration::from_secs(30)).unwrap();
        let code = |r: Response| match r {
            Response::Error { code, .. } => code,
            other => panic!("expected an error, got {other:?}"),
        };
        assert_eq!(
            code(c.fs(0, FsRequest::Stat(99)).unwrap()),
            ErrorCode::NotFound
        );
        assert_eq!(
            code(c.fs(0, FsRequest::ReadDir(12)).unwrap()),
            ErrorCode::NotDir
        );
        assert_eq!(
            code(c.fs(0, FsRequest::ReadLink(12)).unwrap()),
            ErrorCode::NotLink
        );
        assert_eq!(
            code(
                c.fs(
                    0,
                    FsRequest::Read {
                        ino: 2,
                        offset: 0,
                        len: 1
                    }
                )
                .unwrap()
            ),
            ErrorCode::Invalid
        );
        let big = FsRequest::Read {
            ino: 12,
            offset: 0,
            len: MAX_READ + 1,
        };
        assert_eq!(code(c.fs(0, big).unwrap()), ErrorCode::Invalid);
        let slash = FsRequest::Lookup {
            dir: 2,
            name: b"a/b".to_vec(),
        };
        assert_eq!(code(c.fs(0, slash).unwrap()), ErrorCode::Invalid);
        // Still usable after errors.
        assert!(matches!(
            c.fs(0, FsRequest::Stat(2)).unwrap(),
            Response::Attr(_)
        ));
    }

    #[test]
    fn malformed_and_oversized_frames_do_not_hurt_the_server() {
        use std::io::Read;
        let (_d, s) = server();
        // Garbage body: an error answer, and the connection stays usable.
        let mut raw = UnixStream::connect(s.path()).unwrap();
        raw.write_all(&[3, 0, 0, 0, 0xff, 0xff, 0xff]).unwrap();
        let r: Response = read_frame(&mut raw, MAX_RESPONSE_FRAME).unwrap();
        assert!(matches!(
            r,
            Response::Error {
                code: ErrorCode::Invalid,
                ..
            }
        ));
        write_frame(&mut raw, &Request::fs(0, FsRequest::Stat(2))).unwrap();
        let r: Response = read_frame(&mut raw, MAX_RESPONSE_FRAME).unwrap();
        assert!(matches!(r, Response::Attr(_)));
        // Oversized frame: an error answer, then the server hangs up.
        raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
        let r: Response = read_frame(&mut raw, MAX_RESPONSE_FRAME).unwrap();
        assert!(matches!(
            r,
            Response::Error {
                code: ErrorCode::Invalid,
                ..
            }
        ));
        let mut rest = Vec::new();
        raw.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
        // Half a frame then hang up.
        let mut half = UnixStream::connect(s.path()).unwrap();
        half.write_all(&[100, 0]).unwrap();
        drop(half);
        let mut c = ViewClient::connect(s.path(), Duration::from_secs(30)).unwrap();
        assert!(matches!(
            c.fs(0, FsRequest::Stat(2)).unwrap(),
            Response::Attr(_)
        ));
    }

    #[test]
    fn every_disk_is_served_and_listed_with_its_mount_point() {
        let d = tempfile::tempdir().unwrap();
        let disk = |disk, mount: &str, source: Arc<dyn FsRead>| ServedDisk {
            disk,
            mount: mount.into(),
            source,
        };
        let s = ViewServer::bind_disks(
            d.path().join(VIEW_SOCKET),
            vec![
                disk(0, "/", Arc::new(Tiny)),
                disk(1, "/mnt/data", Arc::new(Tiny)),
                disk(2, "/@disk2", Arc::new(Empty)),
            ],
        )
        .unwrap();
        let mut c = ViewClient::connect(s.path(), Duration::from_secs(30)).unwrap();
        // The disk without a root (not crawled yet) is not listed.
        let Response::Mounts(m) = c.call(&Request::Mounts).unwrap() else {
            panic!()
        };
        let listed: Vec<(u32, &[u8])> = m.iter().map(|m| (m.disk, m.path.as_slice())).collect();
        assert_eq!(listed, [(0, &b"/"[..]), (1, &b"/mnt/data"[..])]);
        // Each disk answers from its own file system.
        for disk in [0, 1] {
            let r = c.fs(
                disk,
                FsRequest::Read {
                    ino: 12,
                    offset: 0,
                    len: 5,
                },
            );
            assert_eq!(r.unwrap(), Response::Data(b"hello".to_vec()));
        }
        let code = |r: Response| match r {
            Response::Error { code, .. } => code,
            other => panic!("expected an error, got {other:?}"),
        };
        assert_eq!(
            code(c.fs(2, FsRequest::Stat(2)).unwrap()),
            ErrorCode::NotFound
        );
        assert_eq!(
            code(c.fs(9, FsRequest::Stat(2)).unwrap()),
            ErrorCode::NotFound
        );
    }

    #[test]
    fn socket_is_removed_on_drop() {
        let (d, s) = server();
        let p = s.path().to_path_buf();
        assert!(matches!(
            ViewServer::bind(&p, Tiny_static()),
            Err(ViewError::Bind { .. })
        ));
        drop(s);
        assert!(!p.exists());
        drop(d);
    }

    #[allow(non_snake_case)]
    fn Tiny_static() -> Arc<dyn FsRead> {
        Arc::new(Tiny)
    }
}
