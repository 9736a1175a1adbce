//! Redis delivery against a real `redis-server` (with a password): a PSUBSCRIBE subscriber
//! using `Pattern::to_redis_glob()` receives the same messages as an embedded-bus client
//! subscribed to the same pattern (after exact re-filtering where Redis' glob is wider).

#![allow(clippy::unwrap_used)] // helpers outside #[test] functions unwrap too

use std::io::BufRead;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use vmsight_events::{
    subscribe, Addresser, EventBus, Message, Pattern, RedisPublisher, StreamItem,
};
use vmsight_fsview::{EventKind, FsEvent, Value};

const PASSWORD: &str = "s3cret-pw";

struct RedisServer {
    child: Child,
    port: u16,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_redis(dir: &Path) -> RedisServer {
    start_redis_on(dir, free_port())
}

fn start_redis_on(dir: &Path, port: u16) -> RedisServer {
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args([
            "--requirepass",
            PASSWORD,
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server is not installed (scripts/setup-host.sh installs it)");
    let server = RedisServer { child, port };
    // Wait until it answers (bounded; nothing about timing is asserted).
    let client = redis::Client::open(server.url(PASSWORD)).unwrap();
    for _ in 0..200 {
        if let Ok(mut c) = client.get_connection() {
            if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                return server;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("redis-server did not come up on port {port}");
}

impl RedisServer {
    fn url(&self, password: &str) -> String {
        format!("redis://:{password}@127.0.0.1:{}/", self.port)
    }
}

fn ev(kind: EventKind, path: &str, i: u64) -> FsEvent {
    FsEvent {
        kind,
        path: path.into(),
        old_path: (kind == EventKind::Rename).then(|| "/tmp/old".to_string()),
        ino: 100 + i as u32,
        old: None,
        new: (kind == EventKind::Chmod).then_some(Value::Mode(0o100600)),
        range: (kind == EventKind::Write).then_some((0, 5)),
        data: (kind == EventKind::Write).then(|| b"hello".to_vec()),
        txn: Some(i as u32),
        observed_ns: i,
    }
}

#[test]
fn wrong_password_is_refused_up_front() {
    let d = tempfile::tempdir().unwrap();
    let server = start_redis(d.path());
    assert!(RedisPublisher::connect(&server.url("wrong")).is_err());
    let p = RedisPublisher::connect(&server.url(PASSWORD)).unwrap();
    assert_eq!(p.stats().failed, 0);
}

#[test]
fn redis_subscriber_and_embedded_bus_see_the_same_messages() {
    let d = tempfile::tempdir().unwrap();
    let server = start_redis(d.path());
    let pattern = Pattern::parse("*:web1:/var/log/*").unwrap();

    // Redis subscriber, subscribed before anything is published.
    let client = redis::Client::open(server.url(PASSWORD)).unwrap();
    let mut conn = client.get_connection().unwrap();
    let mut pubsub = conn.as_pubsub();
    pubsub.psubscribe(pattern.to_redis_glob()).unwrap();
    pubsub
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();

    // Embedded bus client with the same pattern.
    let bus = EventBus::bind(d.path().join("events.sock")).unwrap();
    let mut bus_reader = subscribe(bus.path(), std::slice::from_ref(&pattern), false).unwrap();

    let publisher = RedisPublisher::connect(&server.url(PASSWORD)).unwrap();
    let web1 = Addresser::new("hostA", "web1");
    let web2 = Addresser::new("hostA", "web2");
    let events = [
        (&web1, EventKind::Write, "/var/log/syslog"),
        (&web1, EventKind::Create, "/etc/passwd"),
        (&web2, EventKind::Write, "/var/log/syslog"),
        (&web1, EventKind::Rename, "/var/log/auth.log"),
        // Matches the Redis glob (`*` crosses `/`) but not the pattern.
        (&web1, EventKind::Create, "/var/log/apt/history.log"),
        (&web1, EventKind::Chmod, "/var/log/syslog"),
    ];
    let mut all = Vec::new();
    for (i, (addr, kind, path)) in events.iter().enumerate() {
        let m = addr.wrap(ev(*kind, path, i as u64));
        publisher.publish(&m);
        bus.publish(&m);
        all.push(m);
    }
    assert!(
        publisher.flush(Duration::from_secs(10)),
        "redis queue did not drain"
    );
    assert_eq!(publisher.stats().published, all.len() as u64);
    assert_eq!(publisher.stats().failed, 0);

    // What Redis delivers for the translated glob: a superset, filtered exactly afterwards.
    let wanted: Vec<&Message> = all
        .iter()
        .filter(|m| pattern.matches(&m.host, &m.vm, &m.event.path))
        .collect();
    assert_eq!(wanted.len(), 3);
    let redis_wide: Vec<&Message> = all
        .iter()
        .filter(|m| m.vm == "web1" && m.event.path.starts_with("/var/log/"))
        .collect();
    let mut from_redis = Vec::new();
    for _ in 0..redis_wide.len() {
        let msg = pubsub.get_message().unwrap();
        let channel: String = msg.get_channel_name().to_string();
        let payload: String = msg.get_payload().unwrap();
        let m = Message::from_json(&payload).unwrap();
        assert_eq!(channel, m.channel());
        from_redis.push(m);
    }
    let exact: Vec<Message> = from_redis
        .iter()
        .filter(|m| pattern.matches_channel(&m.channel()))
        .cloned()
        .collect();
    assert_eq!(
        from_redis.len(),
        4,
        "Redis' glob also matched the nested path"
    );

    let mut from_bus = Vec::new();
    while from_bus.len() < wanted.len() {
        let mut line = String::new();
        bus_reader.read_line(&mut line).unwrap();
        match StreamItem::parse(line.trim_end()).unwrap() {
            StreamItem::Message(m) => from_bus.push(m),
            other => panic!("unexpected {other:?}"),
        }
    }
    // Same messages, same order, same bytes (data is not requested on either transport).
    let strip = |m: &Message| {
        let mut m = m.clone();
        m.event.data = None;
        m
    };
    let wanted: Vec<Message> = wanted.into_iter().map(strip).collect();
    assert_eq!(exact, wanted);
    assert_eq!(from_bus, wanted);
    assert_eq!(
        from_bus.iter().map(|m| m.seq).collect::<Vec<_>>(),
        [1, 3, 5],
        "per-VM sequence numbers"
    );
}

#[test]
fn publisher_reconnects_after_the_server_restarts() {
    let d = tempfile::tempdir().unwrap();
    let server = start_redis(d.path());
    let port = server.port;
    let publisher = RedisPublisher::connect(&server.url(PASSWORD)).unwrap();
    let a = Addresser::new("h", "v");
    publisher.publish(&a.wrap(ev(EventKind::Create, "/a", 0)));
    assert!(publisher.flush(Duration::from_secs(10)));
    assert_eq!(publisher.stats().published, 1);
    drop(server);
    // With the server gone, messages fail (they are counted, the caller never blocks).
    publisher.publish(&a.wrap(ev(EventKind::Create, "/b", 1)));
    assert!(publisher.flush(Duration::from_secs(10)));
    assert_eq!(publisher.stats().failed, 1);
    let _server = start_redis_on(d.path(), port);
    // Keep publishing until one gets through: the backoff decides when it reconnects.
    let mut tries = 0;
    while publisher.stats().published < 2 {
        tries += 1;
        assert!(tries < 200, "never reconnected: {:?}", publisher.stats());
        publisher.publish(&a.wrap(ev(EventKind::Create, "/c", 2)));
        assert!(publisher.flush(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(publisher.stats().reconnects >= 1);
}
