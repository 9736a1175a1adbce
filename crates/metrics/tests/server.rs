//! The HTTP endpoint, scraped over loopback with plain TCP clients, including hostile ones.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vmsight_metrics::harness::{http_exchange, http_get};
use vmsight_metrics::{
    from_fn, render, MetricSink, MetricSource, MetricsError, MetricsServer, ServerOptions,
};

fn fixed_source() -> Arc<dyn MetricSource> {
    Arc::new(from_fn(|s: &mut MetricSink| {
        s.counter(
            "vmsight_block_requests_total",
            "Completed block requests.",
            &[("vm", "a"), ("disk", "1"), ("kind", "read")],
            7u64,
        );
        s.gauge(
            "vmsight_block_in_flight_requests",
            "In flight.",
            &[("vm", "a"), ("disk", "1")],
            0u64,
        );
    }))
}

fn start(options: ServerOptions) -> MetricsServer {
    MetricsServer::start_with("127.0.0.1:0", fixed_source(), options).expect("start the endpoint")
}

/// Sends `request` and reads until the server closes; the raw answer as text.
fn raw_exchange(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(request).expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read the answer");
    out
}

#[test]
fn get_metrics_serves_the_exposition_with_its_content_type() {
    let server = start(ServerOptions::default());
    assert_ne!(server.local_addr().port(), 0, "the bound port is reported");
    assert_eq!(
        server.url(),
        format!("http://{}/metrics", server.local_addr())
    );
    let r = http_get(server.local_addr(), "/metrics").unwrap();
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4"),
        "{:?}",
        r.headers
    );
    assert_eq!(r.text(), render(&*fixed_source()));
    assert!(r
        .text()
        .contains("vmsight_block_requests_total{vm=\"a\",disk=\"1\",kind=\"read\"} 7\n"));
    assert_eq!(
        r.header("content-length"),
        Some(r.body.len().to_string().as_str())
    );
}

#[test]
fn http_1_1_requests_with_headers_and_a_query_string_are_served() {
    let server = start(ServerOptions::default());
    let r = http_exchange(
        server.local_addr(),
        b"GET /metrics?name[]=x HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\nAccept-Encoding: gzip\r\n\r\n",
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("connection"), Some("close"));
}

#[test]
fn other_paths_are_404_and_other_methods_405() {
    let server = start(ServerOptions::default());
    for path in ["/", "/metricsx", "/metrics/", "/favicon.ico"] {
        assert_eq!(
            http_get(server.local_addr(), path).unwrap().status,
            404,
            "{path}"
        );
    }
    let r = http_exchange(
        server.local_addr(),
        b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    )
    .unwrap();
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("GET, HEAD"));
}

#[test]
fn head_gets_the_headers_of_get_without_a_body() {
    let server = start(ServerOptions::default());
    let get = http_get(server.local_addr(), "/metrics").unwrap();
    let head = http_exchange(server.local_addr(), b"HEAD /metrics HTTP/1.0\r\n\r\n").unwrap();
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    assert_eq!(head.header("content-length"), get.header("content-length"));
}

#[test]
fn malformed_and_oversized_requests_are_refused() {
    let server = start(ServerOptions {
        max_request_bytes: 1024,
        ..ServerOptions::default()
    });
    let addr = server.local_addr();
    assert!(raw_exchange(addr, b"hello there\r\n\r\n").starts_with("HTTP/1.1 400 "));
    assert!(raw_exchange(addr, b"GET /metrics HTTP/9\r\n\r\n").starts_with("HTTP/1.1 400 "));
    let mut big = b"GET /metrics HTTP/1.1\r\n".to_vec();
    big.extend(std::iter::repeat_n(b'x', 4096));
    let answer = raw_exchange(addr, &big);
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
    // Still serving afterwards.
    assert_eq!(http_get(addr, "/metrics").unwrap().status, 200);
}

#[test]
fn a_slow_client_gets_408_and_does_not_delay_others() {
    let server = start(ServerOptions {
        request_deadline: Duration::from_secs(2),
        ..ServerOptions::default()
    });
    let addr = server.local_addr();
    let mut slow = TcpStream::connect(addr).unwrap();
    slow.write_all(b"GET /metr").unwrap();
    // Served while the slow client holds its connection open.
    assert_eq!(http_get(addr, "/metrics").unwrap().status, 200);
    let mut answer = String::new();
    slow.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
}

#[test]
fn a_client_that_trickles_bytes_is_cut_off_at_the_deadline() {
    let server = start(ServerOptions {
        request_deadline: Duration::from_millis(500),
        ..ServerOptions::default()
    });
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    // One header byte at a time, never finishing: each read succeeds, the total must not.
    let mut answer = Vec::new();
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    for _ in 0..2000 {
        if s.write_all(b"GET /metrics HTTP/1.1\r\nX: ").is_err() {
            break;
        }
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(_) => continue,
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 408 ") || answer.starts_with("HTTP/1.1 431 "),
        "the server ends the request: {answer:?}"
    );
}

#[test]
fn clients_that_connect_and_leave_do_not_hurt() {
    let server = start(ServerOptions::default());
    for _ in 0..20 {
        drop(TcpStream::connect(server.local_addr()).unwrap());
    }
    let mut half = TcpStream::connect(server.local_addr()).unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
    drop(half);
    assert_eq!(
        http_get(server.local_addr(), "/metrics").unwrap().status,
        200
    );
}

#[test]
fn connections_beyond_the_limit_wait_for_a_free_slot() {
    let server = start(ServerOptions {
        max_connections: 2,
        request_deadline: Duration::from_secs(1),
        ..ServerOptions::default()
    });
    let addr = server.local_addr();
    let mut idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Served once an idle connection's deadline frees its slot.
    assert_eq!(http_get(addr, "/metrics").unwrap().status, 200);
    for s in &mut idle {
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    }
}

#[test]
fn a_stop_while_every_slot_is_taken_still_closes_the_listener() {
    let server = start(ServerOptions {
        max_connections: 1,
        ..ServerOptions::default()
    });
    let addr = server.local_addr();
    let _idle = TcpStream::connect(addr).unwrap();
    let _waiting = TcpStream::connect(addr).unwrap();
    server.shutdown();
    assert!(
        TcpStream::connect(addr).is_err(),
        "nothing listens after shutdown"
    );
}

#[test]
fn concurrent_scrapes_all_succeed_and_see_a_live_counter() {
    let counter = Arc::new(AtomicU64::new(0));
    let c = counter.clone();
    let source = Arc::new(from_fn(move |s: &mut MetricSink| {
        s.counter(
            "scrapes_total",
            "",
            &[],
            c.fetch_add(1, Ordering::SeqCst) + 1,
        )
    }));
    let server = MetricsServer::start("127.0.0.1:0", source).unwrap();
    let addr = server.local_addr();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                (0..5)
                    .map(|_| http_get(addr, "/metrics").unwrap())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut seen = Vec::new();
    for t in threads {
        for r in t.join().unwrap() {
            assert_eq!(r.status, 200);
            let line = r
                .text()
                .lines()
                .find(|l| l.starts_with("scrapes_total "))
                .unwrap()
                .to_string();
            seen.push(line["scrapes_total ".len()..].parse::<u64>().unwrap());
        }
    }
    seen.sort();
    assert_eq!(
        seen,
        (1..=20).collect::<Vec<_>>(),
        "each scrape collects afresh"
    );
}

#[test]
fn a_panicking_source_gives_500_and_the_server_keeps_serving() {
    let calls = Arc::new(AtomicU64::new(0));
    let c = calls.clone();
    let source = Arc::new(from_fn(move |s: &mut MetricSink| {
        if c.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("buggy registry");
        }
        s.gauge("fine", "", &[], 1u64);
    }));
    let server = MetricsServer::start("127.0.0.1:0", source).unwrap();
    assert_eq!(
        http_get(server.local_addr(), "/metrics").unwrap().status,
        500
    );
    let r = http_get(server.local_addr(), "/metrics").unwrap();
    assert_eq!(r.status, 200);
    assert!(r.text().contains("\nfine 1\n"));
}

#[test]
fn shutdown_and_drop_close_the_listener() {
    let server = start(ServerOptions::default());
    let addr = server.local_addr();
    server.shutdown();
    assert!(
        TcpStream::connect(addr).is_err(),
        "nothing listens after shutdown"
    );

    let server = start(ServerOptions::default());
    let addr = server.local_addr();
    drop(server);
    assert!(
        TcpStream::connect(addr).is_err(),
        "nothing listens after drop"
    );
}

#[test]
fn a_wildcard_address_is_served_and_stopped() {
    let server = MetricsServer::start("0.0.0.0:0", fixed_source()).unwrap();
    let port = server.local_addr().port();
    let loopback: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert_eq!(http_get(loopback, "/metrics").unwrap().status, 200);
    server.shutdown();
    assert!(TcpStream::connect(loopback).is_err());
}

#[test]
fn start_errors_name_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let e = MetricsServer::start(&addr.to_string(), fixed_source()).unwrap_err();
    assert!(matches!(e, MetricsError::Bind { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("cannot listen for metrics on {addr}: ")),
        "{msg}"
    );

    let e = MetricsServer::start("not-an-address", fixed_source()).unwrap_err();
    assert!(matches!(e, MetricsError::Resolve { .. }), "{e:?}");
    assert!(e.to_string().contains("\"not-an-address\""), "{e}");

    let e = MetricsServer::start_at(addr, fixed_source()).unwrap_err();
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
}
