//! The embedded event bus: a Unix socket (normally `<runtime>/<vm>/events.sock`) that
//! `vmsight watch` and other local monitors subscribe to, with no extra service.
//!
//! Protocol (JSON lines): the client sends one line
//! `{"subscribe":["host:vm:/path/glob", ...],"data":false}` (an empty list means everything;
//! `data` asks for `data_b64`), the server answers `{"type":"subscribed",...}` and from then
//! on writes every matching [`Message`] as one line. Each client has a bounded queue: when it
//! is full, further messages for that client are dropped (publish never waits for a client)
//! and a `{"type":"dropped","count":N}` notice is written where the gap is. A refused request
//! gets `{"type":"error","message":...}` and the connection is closed.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use serde::Deserialize;
use vmsight_proto::server::{ServeError, UnixServer};

use crate::message::{Message, Notice};
use crate::pattern::{any_matches, Pattern, PatternError};

/// Default per-client queue length, in messages.
pub const DEFAULT_CLIENT_QUEUE: usize = 4096;
/// Longest accepted subscribe line.
pub const MAX_REQUEST_LINE: usize = 64 * 1024;
/// Most clients served at once; more are refused.
pub const MAX_CLIENTS: usize = 256;
/// How long a new client may take to send its subscribe line.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the embedded bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
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
}

impl From<ServeError> for BusError {
    fn from(e: ServeError) -> BusError {
        match e {
            ServeError::NotASocket(path) => BusError::NotASocket(path),
            e => BusError::Bind {
                path: e.path().to_path_buf(),
                source: e.into_io(),
            },
        }
    }
}

/// Why a client's subscribe request was refused (sent to it as an `error` notice).
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Reading the request failed (or timed out).
    #[error("no subscribe request: {0}")]
    Read(#[source] io::Error),
    /// The line is longer than [`MAX_REQUEST_LINE`].
    #[error("subscribe request longer than {MAX_REQUEST_LINE} bytes")]
    TooLong,
    /// The client hung up mid-line.
    #[error("connection closed before a complete subscribe request")]
    Incomplete,
    /// The line is not a subscribe request.
    #[error(r#"bad subscribe request (want {{"subscribe":["host:vm:/path"],"data":false}}): {0}"#)]
    Malformed(#[source] serde_json::Error),
    /// A pattern does not parse.
    #[error(transparent)]
    Pattern(#[from] PatternError),
}

/// The subscribe request a client sends first.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubscribeRequest {
    /// Patterns (see [`Pattern::parse`]); empty means everything.
    #[serde(default)]
    pub subscribe: Vec<String>,
    /// Include written bytes (`data_b64`).
    #[serde(default)]
    pub data: bool,
}

enum Item {
    Line(Arc<str>),
    Dropped(u64),
}

struct Queue {
    items: VecDeque<Item>,
    /// Messages dropped since the last one queued (the gap not yet reported).
    pending_drops: u64,
    closed: bool,
}

struct Client {
    patterns: Vec<Pattern>,
    data: bool,
    queue: Mutex<Queue>,
    ready: Condvar,
    cap: usize,
    /// A handle on the connection, so closing also unblocks a writer stuck in `write`.
    sock: UnixStream,
}

impl Client {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panicking writer thread cannot leave the queue inconsistent; keep going.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }

    /// Queues `line` or counts it as dropped; never waits.
    fn offer(&self, line: &Arc<str>) -> bool {
        let mut q = self.lock();
        if q.closed {
            return false;
        }
        if q.items.len() >= self.cap {
            q.pending_drops += 1;
            return false;
        }
        if q.pending_drops > 0 {
            let n = std::mem::take(&mut q.pending_drops);
            q.items.push_back(Item::Dropped(n));
        }
        q.items.push_back(Item::Line(Arc::clone(line)));
        drop(q);
        self.ready.notify_one();
        true
    }
}

struct Shared {
    clients: Mutex<Vec<Arc<Client>>>,
    cap: usize,
    published: AtomicU64,
    delivered: AtomicU64,
    dropped: AtomicU64,
}

impl Shared {
    fn clients(&self) -> MutexGuard<'_, Vec<Arc<Client>>> {
        self.clients.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Counters of a bus.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BusStats {
    /// Messages published.
    pub published: u64,
    /// Deliveries queued to clients (one message to two clients counts twice).
    pub delivered: u64,
    /// Deliveries dropped because a client's queue was full.
    pub dropped: u64,
    /// Clients connected now.
    pub clients: usize,
}

/// The server side of the embedded bus. Dropping it closes every client and removes the socket.
pub struct EventBus {
    path: PathBuf,
    shared: Arc<Shared>,
    server: Option<UnixServer>,
}

impl EventBus {
    /// Listens on `path` with the default per-client queue.
    pub fn bind(path: impl AsRef<Path>) -> Result<EventBus, BusError> {
        Self::bind_with(path, DEFAULT_CLIENT_QUEUE)
    }

    /// Listens on `path`; each client may have up to `queue` undelivered messages.
    pub fn bind_with(path: impl AsRef<Path>, queue: usize) -> Result<EventBus, BusError> {
        let path = path.as_ref().to_path_buf();
        let shared = Arc::new(Shared {
            clients: Mutex::new(Vec::new()),
            cap: queue.max(1),
            published: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        });
        let sh = Arc::clone(&shared);
        let server =
            UnixServer::bind(&path, "events-accept", move |conn| accept_client(conn, &sh))?;
        Ok(EventBus {
            path,
            shared,
            server: Some(server),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Offers `msg` to every subscribed client whose patterns match; never blocks on a client.
    pub fn publish(&self, msg: &Message) {
        self.shared.published.fetch_add(1, Ordering::Relaxed);
        let clients: Vec<Arc<Client>> = {
            let mut list = self.shared.clients();
            list.retain(|c| !c.lock().closed);
            list.iter()
                .filter(|c| any_matches(&c.patterns, &msg.host, &msg.vm, &msg.event.path))
                .cloned()
                .collect()
        };
        if clients.is_empty() {
            return;
        }
        // Serialise at most twice, whatever the number of clients.
        let mut plain: Option<Arc<str>> = None;
        let mut with_data: Option<Arc<str>> = None;
        for c in clients {
            let slot = if c.data && msg.event.data.is_some() {
                &mut with_data
            } else {
                &mut plain
            };
            let line = slot.get_or_insert_with(|| Arc::from(msg.to_json(c.data)));
            if c.offer(line) {
                self.shared.delivered.fetch_add(1, Ordering::Relaxed);
            } else {
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Current counters.
    pub fn stats(&self) -> BusStats {
        let mut clients = self.shared.clients();
        clients.retain(|c| !c.lock().closed);
        BusStats {
            published: self.shared.published.load(Ordering::Relaxed),
            delivered: self.shared.delivered.load(Ordering::Relaxed),
            dropped: self.shared.dropped.load(Ordering::Relaxed),
            clients: clients.len(),
        }
    }
}

impl Drop for EventBus {
    fn drop(&mut self) {
        // Stops accepting and removes the socket file (if it is still ours).
        if let Some(server) = self.server.take() {
            server.stop();
        }
        for c in self.shared.clients().drain(..) {
            c.close();
        }
    }
}

/// Starts a thread serving one accepted client.
fn accept_client(conn: io::Result<UnixStream>, shared: &Arc<Shared>) {
    let stream = match conn {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("events: accept failed: {e}");
            return;
        }
    };
    let sh = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name("events-client".into())
        .spawn(move || serve_client(stream, sh));
    if let Err(e) = spawned {
        tracing::warn!("events: cannot start a client thread: {e}");
    }
}

fn send_notice(stream: &mut UnixStream, n: &Notice) -> io::Result<()> {
    let mut line = serde_json::to_string(n).map_err(io::Error::other)?;
    line.push('\n');
    stream.write_all(line.as_bytes())
}

/// Reads the subscribe line: at most [`MAX_REQUEST_LINE`] bytes.
fn read_request(stream: &UnixStream) -> Result<SubscribeRequest, HandshakeError> {
    let mut line = Vec::new();
    let mut r = BufReader::new(stream.take(MAX_REQUEST_LINE as u64 + 1));
    r.read_until(b'\n', &mut line)
        .map_err(HandshakeError::Read)?;
    if line.last() != Some(&b'\n') {
        return Err(if line.len() > MAX_REQUEST_LINE {
            HandshakeError::TooLong
        } else {
            HandshakeError::Incomplete
        });
    }
    serde_json::from_slice(&line).map_err(HandshakeError::Malformed)
}

/// Reads and checks the subscribe request: the client's patterns and whether it wants data.
fn handshake(stream: &UnixStream) -> Result<(Vec<Pattern>, bool), HandshakeError> {
    let req = read_request(stream)?;
    let patterns = req
        .subscribe
        .iter()
        .map(|p| Pattern::parse(p))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((patterns, req.data))
}

fn serve_client(mut stream: UnixStream, shared: Arc<Shared>) {
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let parsed = handshake(&stream).map_err(|e| e.to_string());
    let (patterns, data) = match parsed {
        Ok(x) => x,
        Err(message) => {
            let _ = send_notice(&mut stream, &Notice::Error { message });
            return;
        }
    };
    let sock = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("events: cannot clone a client socket: {e}");
            return;
        }
    };
    let client = Arc::new(Client {
        sock,
        patterns,
        data,
        queue: Mutex::new(Queue {
            items: VecDeque::new(),
            pending_drops: 0,
            closed: false,
        }),
        ready: Condvar::new(),
        cap: shared.cap,
    });
    {
        let mut list = shared.clients();
        list.retain(|c| !c.lock().closed);
        if list.len() >= MAX_CLIENTS {
            drop(list);
            let message = format!("too many clients (at most {MAX_CLIENTS})");
            let _ = send_notice(&mut stream, &Notice::Error { message });
            return;
        }
        list.push(Arc::clone(&client));
    }
    let ack = Notice::Subscribed {
        patterns: client.patterns.iter().map(|p| p.to_string()).collect(),
        data,
    };
    if send_notice(&mut stream, &ack).is_err() {
        client.close();
        return;
    }
    // A reader notices the client going away even when nothing is being delivered.
    if let Ok(rd) = stream.try_clone() {
        let c = Arc::clone(&client);
        let _ = rd.set_read_timeout(None);
        let spawned = thread::Builder::new()
            .name("events-client-eof".into())
            .spawn(move || {
                let mut sink = [0u8; 512];
                let mut rd = rd;
                // Anything the client sends after subscribing is ignored.
                while matches!(rd.read(&mut sink), Ok(n) if n > 0) {}
                c.close();
            });
        if spawned.is_err() {
            client.close();
            return;
        }
    }
    write_loop(&mut stream, &client);
    client.close();
}

fn write_loop(stream: &mut UnixStream, client: &Client) {
    loop {
        let item = {
            let mut q = client.lock();
            loop {
                if q.closed {
                    return;
                }
                if let Some(item) = q.items.pop_front() {
                    break item;
                }
                if q.pending_drops > 0 {
                    // The flood is over and the queue drained: report the tail gap now.
                    break Item::Dropped(std::mem::take(&mut q.pending_drops));
                }
                q = client.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let res = match item {
            Item::Line(line) => stream
                .write_all(line.as_bytes())
                .and_then(|()| stream.write_all(b"\n")),
            Item::Dropped(count) => send_notice(stream, &Notice::Dropped { count }),
        };
        if res.is_err() {
            return;
        }
    }
}

/// A minimal client: connects, subscribes and returns a reader positioned after the
/// `subscribed` acknowledgement.
pub fn subscribe(
    path: impl AsRef<Path>,
    patterns: &[Pattern],
    data: bool,
) -> io::Result<BufReader<UnixStream>> {
    let mut s = UnixStream::connect(path.as_ref())?;
    // A wedged server must not hang the subscriber during the handshake.
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let req = serde_json::json!({
        "subscribe": patterns.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        "data": data,
    });
    s.write_all(format!("{req}\n").as_bytes())?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    match serde_json::from_str::<Notice>(&line) {
        Ok(Notice::Subscribed { .. }) => {
            r.get_ref().set_read_timeout(None)?;
            Ok(r)
        }
        Ok(Notice::Error { message }) => Err(io::Error::other(message)),
        _ => Err(io::Error::other(format!(
            "unexpected answer to subscribe: {}",
            line.trim_end()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Addresser, StreamItem};
    use vmsight_fsview::{EventKind, FsEvent};

    fn ev(path: &str) -> FsEvent {
        FsEvent {
            kind: EventKind::Create,
            path: path.into(),
            old_path: None,
            ino: 20,
            old: None,
            new: None,
            range: None,
            data: Some(vec![1, 2, 3]),
            txn: None,
            observed_ns: 1,
        }
    }

    fn next(r: &mut BufReader<UnixStream>) -> StreamItem {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        StreamItem::parse(line.trim_end()).unwrap()
    }

    #[test]
    fn delivers_matching_messages_with_or_without_data() {
        let d = tempfile::tempdir().unwrap();
        let bus = EventBus::bind(d.path().join("events.sock")).unwrap();
        let logs = vec![Pattern::parse("/var/log/*").unwrap()];
        let mut a = subscribe(bus.path(), &logs, false).unwrap();
        let mut b = subscribe(bus.path(), &[], true).unwrap();
        let addr = Addresser::new("h", "v");
        for p in ["/etc/passwd", "/var/log/syslog"] {
            bus.publish(&addr.wrap(ev(p)));
        }
        let StreamItem::Message(m) = next(&mut a) else {
            panic!("expected a message")
        };
        assert_eq!((m.seq, m.event.path.as_str()), (2, "/var/log/syslog"));
        assert_eq!(m.event.data, None, "data not requested");
        for want in [1, 2] {
            let StreamItem::Message(m) = next(&mut b) else {
                panic!("expected a message")
            };
            assert_eq!(m.seq, want);
            assert_eq!(m.event.data.as_deref(), Some(&[1u8, 2, 3][..]));
        }
        assert_eq!(bus.stats().published, 2);
        assert_eq!(bus.stats().delivered, 3);
    }

    #[test]
    fn slow_client_gets_a_dropped_notice_and_publish_does_not_wait() {
        let d = tempfile::tempdir().unwrap();
        let bus = EventBus::bind_with(d.path().join("events.sock"), 4).unwrap();
        let mut r = subscribe(bus.path(), &[], false).unwrap();
        let addr = Addresser::new("h", "v");
        // The client reads nothing while 100 000 messages are published: this returns only
        // because publish never waits for the client (socket buffer + queue hold far fewer).
        for i in 0..100_000 {
            bus.publish(&addr.wrap(ev(&format!("/f{i}"))));
        }
        assert!(bus.stats().dropped > 0);
        let mut seen = 0u64;
        let mut dropped = 0u64;
        let mut last_seq = 0;
        while seen + dropped < 100_000 {
            match next(&mut r) {
                StreamItem::Message(m) => {
                    assert!(m.seq > last_seq);
                    last_seq = m.seq;
                    seen += 1;
                }
                StreamItem::Notice(Notice::Dropped { count }) => dropped += count,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(
            seen + dropped,
            100_000,
            "every message is delivered or counted"
        );
        assert_eq!(dropped, bus.stats().dropped);
    }

    #[test]
    fn malformed_requests_get_an_error_and_the_bus_keeps_serving() {
        let d = tempfile::tempdir().unwrap();
        let bus = EventBus::bind(d.path().join("events.sock")).unwrap();
        for bad in [
            "not json\n".to_string(),
            "{\"subscribe\":[\"etc/passwd\"]}\n".to_string(),
            "{\"subscribe\":[],\"bogus\":1}\n".to_string(),
            format!("{}\n", "x".repeat(MAX_REQUEST_LINE + 10)),
        ] {
            let mut s = UnixStream::connect(bus.path()).unwrap();
            let _ = s.write_all(bad.as_bytes());
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line).unwrap();
            let n: Notice = serde_json::from_str(&line).unwrap();
            assert!(matches!(n, Notice::Error { .. }), "{bad:.40}: {line}");
        }
        // Half a request, then hang up.
        let mut s = UnixStream::connect(bus.path()).unwrap();
        s.write_all(b"{\"subscr").unwrap();
        drop(s);
        let mut r = subscribe(bus.path(), &[], false).unwrap();
        bus.publish(&Addresser::new("h", "v").wrap(ev("/x")));
        assert!(matches!(next(&mut r), StreamItem::Message(_)));
    }

    #[test]
    fn disconnected_clients_are_removed() {
        let d = tempfile::tempdir().unwrap();
        let bus = EventBus::bind(d.path().join("events.sock")).unwrap();
        let r = subscribe(bus.path(), &[], false).unwrap();
        assert_eq!(bus.stats().clients, 1);
        drop(r);
        // The EOF reader closes the client asynchronously; wait for it (no timing asserted).
        while bus.stats().clients != 0 {
            thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn drop_hangs_up_on_clients_even_without_the_socket_file() {
        let d = tempfile::tempdir().unwrap();
        let bus = EventBus::bind(d.path().join("events.sock")).unwrap();
        let mut r = subscribe(bus.path(), &[], false).unwrap();
        // The VM's runtime directory may be removed before the bus is dropped.
        std::fs::remove_file(bus.path()).unwrap();
        drop(bus);
        let mut line = String::new();
        assert_eq!(
            r.read_line(&mut line).unwrap(),
            0,
            "EOF after the bus is gone"
        );
    }

    #[test]
    fn drop_is_prompt_without_any_client() {
        let d = tempfile::tempdir().unwrap();
        let bus = EventBus::bind(d.path().join("events.sock")).unwrap();
        thread::sleep(Duration::from_millis(50));
        let t = std::time::Instant::now();
        drop(bus);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    #[test]
    fn refuses_to_replace_a_regular_file_and_cleans_up() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("events.sock");
        std::fs::write(&p, b"x").unwrap();
        assert!(matches!(EventBus::bind(&p), Err(BusError::NotASocket(_))));
        std::fs::remove_file(&p).unwrap();
        {
            let _bus = EventBus::bind(&p).unwrap();
            assert!(matches!(EventBus::bind(&p), Err(BusError::Bind { .. })));
        }
        assert!(!p.exists(), "socket removed on drop");
        // A stale socket (nobody listening) is replaced.
        drop(std::os::unix::net::UnixListener::bind(&p).unwrap());
        let _bus = EventBus::bind(&p).unwrap();
    }
}
