//! Publishing to Redis pub/sub for cloud-wide monitoring: each message goes to the channel
//! `host:vm:/guest/path`, so monitors anywhere `PSUBSCRIBE` with [`Pattern::to_redis_glob`].
//!
//! The caller never waits for Redis: messages go through a bounded queue to a publisher
//! thread, which reconnects with exponential backoff after errors. A message that finds the
//! queue full, or whose PUBLISH fails twice, is counted as failed and dropped.
//!
//! [`Pattern::to_redis_glob`]: crate::Pattern::to_redis_glob

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::message::Message;

/// Default queue length, in messages.
pub const DEFAULT_REDIS_QUEUE: usize = 10_000;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const IO_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Errors of [`RedisPublisher::connect`].
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// The URL does not parse.
    #[error("bad Redis URL: {0}")]
    Url(redis::RedisError),
    /// The first connection (including authentication) failed.
    #[error("cannot connect to Redis: {0}")]
    Connect(redis::RedisError),
    /// The publisher thread could not be started.
    #[error("cannot start the Redis publisher thread: {0}")]
    Thread(std::io::Error),
}

/// Counters of a [`RedisPublisher`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RedisStats {
    /// Messages accepted by Redis.
    pub published: u64,
    /// Messages dropped: queue full or PUBLISH failed after a reconnect.
    pub failed: u64,
    /// Connections made after an error.
    pub reconnects: u64,
}

#[derive(Default)]
struct Counters {
    published: AtomicU64,
    failed: AtomicU64,
    reconnects: AtomicU64,
    /// Messages handed to the thread and not yet published or failed.
    in_flight: Mutex<u64>,
    idle: Condvar,
}

impl Counters {
    fn settle(&self, n: u64) {
        let mut f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        *f = f.saturating_sub(n);
        if *f == 0 {
            self.idle.notify_all();
        }
    }
}

/// Publishes messages to Redis from its own thread.
pub struct RedisPublisher {
    tx: Option<SyncSender<(String, String)>>,
    counters: Arc<Counters>,
    thread: Option<thread::JoinHandle<()>>,
    data: bool,
}

impl RedisPublisher {
    /// Connects to `url` (`redis://[:password@]host:port/[db]`, `rediss://` not enabled in
    /// this build, `redis+unix:///path`); the first connection must succeed so a wrong address
    /// or password is reported at once. Written bytes are not included in the messages.
    pub fn connect(url: &str) -> Result<RedisPublisher, RedisError> {
        Self::connect_with(url, DEFAULT_REDIS_QUEUE, false)
    }

    /// Like [`connect`](Self::connect), with the queue length and whether to include written
    /// bytes (`data_b64`).
    pub fn connect_with(url: &str, queue: usize, data: bool) -> Result<RedisPublisher, RedisError> {
        let client = redis::Client::open(url).map_err(RedisError::Url)?;
        let conn = open(&client).map_err(RedisError::Connect)?;
        let (tx, rx) = mpsc::sync_channel::<(String, String)>(queue.max(1));
        let counters = Arc::new(Counters::default());
        let c = Arc::clone(&counters);
        let thread = thread::Builder::new()
            .name("events-redis".into())
            .spawn(move || run(client, Some(conn), rx, c))
            .map_err(RedisError::Thread)?;
        Ok(RedisPublisher {
            tx: Some(tx),
            counters,
            thread: Some(thread),
            data,
        })
    }

    /// Queues `msg` for channel [`Message::channel`]; never blocks.
    pub fn publish(&self, msg: &Message) {
        let Some(tx) = &self.tx else { return };
        *self
            .counters
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner()) += 1;
        match tx.try_send((msg.channel(), msg.to_json(self.data))) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
                self.counters.settle(1);
            }
        }
    }

    /// Waits up to `timeout` until every queued message is published or failed; returns
    /// whether the queue drained.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut f = self
            .counters
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        while *f > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            f = self
                .counters
                .idle
                .wait_timeout(f, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Current counters.
    pub fn stats(&self) -> RedisStats {
        RedisStats {
            published: self.counters.published.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
            reconnects: self.counters.reconnects.load(Ordering::Relaxed),
        }
    }
}

impl Drop for RedisPublisher {
    fn drop(&mut self) {
        // Give queued messages a moment, then let the thread end with the channel.
        self.flush(Duration::from_secs(2));
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn open(client: &redis::Client) -> redis::RedisResult<redis::Connection> {
    let mut conn = client.get_connection_with_timeout(CONNECT_TIMEOUT)?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    // Authentication happens in get_connection; a PING proves the session works.
    redis::cmd("PING").query::<String>(&mut conn)?;
    Ok(conn)
}

fn publish_one(
    conn: &mut redis::Connection,
    channel: &str,
    payload: &str,
) -> redis::RedisResult<()> {
    redis::cmd("PUBLISH")
        .arg(channel)
        .arg(payload)
        .query::<i64>(conn)
        .map(|_| ())
}

fn run(
    client: redis::Client,
    mut conn: Option<redis::Connection>,
    rx: mpsc::Receiver<(String, String)>,
    c: Arc<Counters>,
) {
    let mut backoff = Duration::from_millis(100);
    let mut retry_at = Instant::now();
    loop {
        let (channel, payload) = match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        // Two attempts: the connection may have died since the last message.
        let mut ok = false;
        for _ in 0..2 {
            if conn.is_none() {
                if Instant::now() < retry_at {
                    break; // backing off: fail fast rather than stall the queue
                }
                match open(&client) {
                    Ok(cn) => {
                        conn = Some(cn);
                        backoff = Duration::from_millis(100);
                        c.reconnects.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::warn!("redis: reconnect failed (next try in {backoff:?}): {e}");
                        retry_at = Instant::now() + backoff;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        break;
                    }
                }
            }
            if let Some(cn) = conn.as_mut() {
                match publish_one(cn, &channel, &payload) {
                    Ok(()) => {
                        ok = true;
                        break;
                    }
                    Err(e) => {
                        tracing::warn!("redis: PUBLISH failed: {e}");
                        conn = None;
                    }
                }
            }
        }
        if ok {
            c.published.fetch_add(1, Ordering::Relaxed);
        } else {
            c.failed.fetch_add(1, Ordering::Relaxed);
        }
        c.settle(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_urls_and_unreachable_servers_are_reported() {
        assert!(matches!(
            RedisPublisher::connect("http://nope"),
            Err(RedisError::Url(_))
        ));
        // Port 1 on loopback: nothing listens there.
        assert!(matches!(
            RedisPublisher::connect("redis://127.0.0.1:1/"),
            Err(RedisError::Connect(_))
        ));
    }
}
