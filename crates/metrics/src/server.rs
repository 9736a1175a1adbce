//! The scrape endpoint: `GET /metrics` on a TCP address, served from its own thread.
//!
//! Why std's `TcpListener` and not an HTTP crate: the endpoint answers one kind of request,
//! and what matters is bounding hostile clients, which `tiny_http` 0.12 does not do (it reads
//! a header line into an unbounded buffer, sets no read timeout, and starts a thread per
//! connection without limit). Here every connection is bounded in bytes, in time (one
//! deadline for the whole request, not per read, so a client trickling a byte at a time
//! cannot hold it longer) and in number. The accept
//! thread blocks in `accept(2)` and wakes for nothing but connections: stopping sets a flag
//! and then connects to the listener itself, so there is no polling loop and the stop takes
//! one local round trip. Each accepted connection is served on its own short-lived thread,
//! so one slow client never delays a scrape. At most [`ServerOptions::max_connections`] are
//! served at once; beyond that the accept thread waits for a free slot and new connections
//! wait in the kernel's backlog (answering them with an error instead would reset them
//! before the client reads the answer, and gains nothing: a slot frees within the deadline).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::http::{close_gracefully, read_head, write_all_by, ReadError, RequestHead, Response};
use crate::model::MetricSource;
use crate::text::CONTENT_TYPE;

/// Why the endpoint could not start. Every message names the address.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address could not be parsed or resolved.
    #[error("invalid metrics address {addr:?}: {source}")]
    Resolve { addr: String, source: io::Error },
    /// The address resolved to nothing.
    #[error("metrics address {addr:?} resolves to no address")]
    NoAddress { addr: String },
    /// Binding or listening failed (address in use, not local, no permission).
    #[error("cannot listen for metrics on {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    /// The serving thread could not be started.
    #[error("cannot start the metrics server thread for {addr}: {source}")]
    Spawn { addr: SocketAddr, source: io::Error },
}

/// Limits of the endpoint; [`ServerOptions::default`] suits a Prometheus scraper.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Largest request head (request line and headers) accepted; larger gets 431.
    pub max_request_bytes: usize,
    /// Time a connection has to send its request, and then again to take the response.
    pub request_deadline: Duration,
    /// Connections served at once; more wait (in the listen backlog) for a free slot.
    pub max_connections: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_request_bytes: 8 * 1024,
            request_deadline: Duration::from_secs(10),
            max_connections: 8,
        }
    }
}

/// Longest wait for the stop's wake-up connection.
const WAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait, after a response, for the client to close its side (see `close_gracefully`).
const LINGER: Duration = Duration::from_secs(2);
/// Pause after a failed `accept` (e.g. out of file descriptors) so it does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// State shared by the accept thread and the connection threads.
struct Shared {
    source: Arc<dyn MetricSource>,
    options: ServerOptions,
    stop: AtomicBool,
    /// Connections being served, and its change signal.
    active: Mutex<usize>,
    slot_freed: Condvar,
    /// Rejected samples of the previous scrape, to log only changes.
    last_rejected: AtomicUsize,
}

/// A running metrics endpoint. Dropping it (or [`MetricsServer::shutdown`]) stops it.
pub struct MetricsServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl MetricsServer {
    /// Listens on `addr` (`"127.0.0.1:9464"`, `"[::1]:0"`, `"localhost:9464"`; port 0 picks a
    /// free port, see [`MetricsServer::local_addr`]) and serves `source` with default limits.
    pub fn start(addr: &str, source: Arc<dyn MetricSource>) -> Result<MetricsServer, MetricsError> {
        Self::start_with(addr, source, ServerOptions::default())
    }

    /// [`MetricsServer::start`] on an already parsed address.
    pub fn start_at(
        addr: SocketAddr,
        source: Arc<dyn MetricSource>,
    ) -> Result<MetricsServer, MetricsError> {
        Self::serve(bind(addr)?, source, ServerOptions::default())
    }

    /// [`MetricsServer::start`] with explicit limits.
    pub fn start_with(
        addr: &str,
        source: Arc<dyn MetricSource>,
        options: ServerOptions,
    ) -> Result<MetricsServer, MetricsError> {
        Self::serve(bind_any(addr)?, source, options)
    }

    /// The address actually bound (with the chosen port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/metrics`.
    pub fn url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }

    /// Stops accepting connections and waits for the accept thread to end. Connections being
    /// served finish on their own (bounded by the request deadline).
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn serve(
        listener: TcpListener,
        source: Arc<dyn MetricSource>,
        options: ServerOptions,
    ) -> Result<MetricsServer, MetricsError> {
        let addr = listener.local_addr().map_err(|source| MetricsError::Bind {
            addr: unspecified(),
            source,
        })?;
        let shared = Arc::new(Shared {
            source,
            options,
            stop: AtomicBool::new(false),
            active: Mutex::new(0),
            slot_freed: Condvar::new(),
            last_rejected: AtomicUsize::new(0),
        });
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || accept_loop(&listener, &thread_shared))
            .map_err(|source| MetricsError::Spawn { addr, source })?;
        tracing::debug!("metrics endpoint on http://{addr}/metrics");
        Ok(MetricsServer {
            addr,
            shared,
            thread: Some(thread),
        })
    }

    fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.shared.stop.store(true, Ordering::SeqCst);
        // Under the lock, so an accept thread waiting for a slot cannot miss the stop.
        drop(self.shared.lock_active());
        self.shared.slot_freed.notify_all();
        match TcpStream::connect_timeout(&wake_addr(self.addr), WAKE_TIMEOUT) {
            Ok(_) => {
                if thread.join().is_err() {
                    tracing::warn!("the metrics thread of {} panicked", self.addr);
                }
            }
            // The thread is left to end at its next connection.
            Err(e) => tracing::warn!("cannot wake the metrics listener on {}: {e}", self.addr),
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Binds the first address `addr` resolves to that can be bound.
fn bind_any(addr: &str) -> Result<TcpListener, MetricsError> {
    let resolved = addr
        .to_socket_addrs()
        .map_err(|source| MetricsError::Resolve {
            addr: addr.to_string(),
            source,
        })?;
    let mut last = None;
    for candidate in resolved {
        match bind(candidate) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| MetricsError::NoAddress {
        addr: addr.to_string(),
    }))
}

fn bind(addr: SocketAddr) -> Result<TcpListener, MetricsError> {
    TcpListener::bind(addr).map_err(|source| MetricsError::Bind { addr, source })
}

fn unspecified() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)
}

/// Where to connect to reach a listener bound to `addr` (a wildcard address means loopback).
fn wake_addr(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port())
}

/// Accepts connections until the stop flag is seen (set before the wake-up connection).
fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        match conn {
            Ok(stream) => dispatch(stream, shared),
            Err(e) => {
                tracing::warn!("metrics endpoint: accept failed: {e}");
                std::thread::sleep(ACCEPT_ERROR_PAUSE);
            }
        }
    }
}

/// Serves `stream` on a new thread once a slot is free.
fn dispatch(stream: TcpStream, shared: &Arc<Shared>) {
    let Some(slot) = Slot::wait(shared) else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("metrics-conn".into())
        .spawn(move || serve_connection(stream, &slot));
    if let Err(e) = spawned {
        tracing::warn!("metrics endpoint: cannot start a connection thread: {e}");
    }
}

impl Shared {
    fn lock_active(&self) -> std::sync::MutexGuard<'_, usize> {
        // The counter stays meaningful even if a holder panicked.
        self.active.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One of the `max_connections` places; given back when dropped (also on panic).
struct Slot(Arc<Shared>);

impl Slot {
    /// Waits for a free slot; `None` when the server stops meanwhile.
    fn wait(shared: &Arc<Shared>) -> Option<Slot> {
        let mut active = shared.lock_active();
        while *active >= shared.options.max_connections.max(1) {
            if shared.stop.load(Ordering::SeqCst) {
                return None;
            }
            active = shared
                .slot_freed
                .wait(active)
                .unwrap_or_else(PoisonError::into_inner);
        }
        *active += 1;
        Some(Slot(shared.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        *self.0.lock_active() -= 1;
        self.0.slot_freed.notify_one();
    }
}

/// Reads one request, answers it, closes the connection.
fn serve_connection(mut stream: TcpStream, slot: &Slot) {
    let shared = &slot.0;
    let deadline = Instant::now() + shared.options.request_deadline;
    let (response, is_head) =
        match read_head(&mut stream, shared.options.max_request_bytes, deadline) {
            Ok(head) => (route(&head, shared), head.method == "HEAD"),
            Err(ReadError::TooLarge) => (Response::text(431, "request head too large\n"), false),
            Err(ReadError::Malformed) => (Response::text(400, "malformed request\n"), false),
            Err(ReadError::TimedOut) => {
                (Response::text(408, "request not received in time\n"), false)
            }
            Err(ReadError::Gone) => return,
        };
    let deadline = Instant::now() + shared.options.request_deadline;
    let mut bytes = response.head();
    if !is_head {
        bytes.extend_from_slice(&response.body);
    }
    if let Err(e) = write_all_by(&mut stream, &bytes, deadline) {
        tracing::debug!("metrics endpoint: response not delivered: {e}");
        return;
    }
    close_gracefully(stream, Instant::now() + LINGER);
}

/// `GET`/`HEAD /metrics` → the exposition; other paths 404, other methods 405.
fn route(head: &RequestHead, shared: &Shared) -> Response {
    if head.path != "/metrics" {
        return Response::text(404, "not found: metrics are at /metrics\n");
    }
    if head.method != "GET" && head.method != "HEAD" {
        let mut r = Response::text(405, "only GET and HEAD\n");
        r.headers.push(("Allow", "GET, HEAD"));
        return r;
    }
    match catch_unwind(AssertUnwindSafe(|| scrape(shared))) {
        Ok(text) => Response {
            status: 200,
            content_type: CONTENT_TYPE,
            headers: Vec::new(),
            body: text.into_bytes(),
        },
        Err(_) => Response::text(500, "a metric source panicked; see the vmsight log\n"),
    }
}

/// Collects and encodes, logging rejected samples when their number changes.
fn scrape(shared: &Shared) -> String {
    let sink = crate::collect(&*shared.source);
    let rejected = sink.rejected().len();
    if shared.last_rejected.swap(rejected, Ordering::Relaxed) != rejected && rejected > 0 {
        tracing::warn!(
            "metrics: {rejected} samples rejected, first: {}",
            sink.rejected()[0]
        );
    }
    sink.encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_listener_is_woken_through_loopback() {
        let v4: SocketAddr = "0.0.0.0:80".parse().unwrap();
        let v6: SocketAddr = "[::]:80".parse().unwrap();
        let exact: SocketAddr = "127.0.0.2:80".parse().unwrap();
        assert_eq!(wake_addr(v4), "127.0.0.1:80".parse().unwrap());
        assert_eq!(wake_addr(v6), "[::1]:80".parse().unwrap());
        assert_eq!(wake_addr(exact), exact);
    }
}
