//! The endpoint checked by a real Prometheus server (Debian's `prometheus` package): it scrapes
//! a source whose counter grows on every scrape, and the values, labels and help texts read
//! back through Prometheus' HTTP API must be exactly what the source served. A missing
//! `prometheus` binary fails these tests; it is never a skip.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmsight_metrics::harness::{HarnessError, Prometheus, JOB};
use vmsight_metrics::{from_fn, MetricSink, MetricsServer};

/// Upper bound for anything Prometheus has to do (start, scrape, answer).
const WAIT: Duration = Duration::from_secs(60);
/// A label value using every character the format escapes, and some it must not touch.
const AWKWARD: &str = "/srv/a \"quoted\" name\\with\\backslashes\nand a line feed, é ✓ {x=\"y\"}";
/// Help text with a backslash and a line feed.
const AWKWARD_HELP: &str = "Help with a back\\slash,\na line feed and \"quotes\".";

/// Serves a counter that grows by one on every scrape, remembering each value served.
fn growing_counter() -> (MetricsServer, Arc<Mutex<BTreeSet<u64>>>) {
    let served = Arc::new(Mutex::new(BTreeSet::new()));
    let record = served.clone();
    let source = from_fn(move |sink: &mut MetricSink| {
        let mut served = record.lock().unwrap();
        let value = served.len() as u64 * 512 + 4096;
        served.insert(value);
        sink.with_labels(&[("vm", "test-vm")], |sink| {
            sink.counter(
                "vmsight_block_bytes_total",
                "Bytes of successful block requests.",
                &[("disk", "1"), ("kind", "write")],
                value,
            );
            sink.gauge(
                "vmsight_test_awkward",
                AWKWARD_HELP,
                &[("path", AWKWARD)],
                0.25,
            );
            sink.counter(
                "vmsight_block_bytes_total",
                "Bytes of successful block requests.",
                &[("disk", "1"), ("kind", "read")],
                1u64,
            );
        });
    });
    let server = MetricsServer::start("127.0.0.1:0", Arc::new(source)).expect("start the endpoint");
    (server, served)
}

#[test]
fn prometheus_reads_back_a_counter_the_source_served() {
    let (server, served) = growing_counter();
    let prometheus = Prometheus::start(&[server.local_addr()]).expect("start prometheus");
    let query = "vmsight_block_bytes_total{kind=\"write\"}";
    // Three scrapes at least: the counter is read back as it grows, not once.
    let samples = prometheus
        .wait_for(query, WAIT, |s| {
            s.len() == 1 && s[0].value >= 4096.0 + 2.0 * 512.0
        })
        .expect("the counter through prometheus");
    let s = &samples[0];
    let served = served.lock().unwrap();
    assert!(
        served.contains(&(s.value as u64)) && s.value.fract() == 0.0,
        "prometheus has {} but the source served {served:?}",
        s.value
    );
    assert_eq!(s.label("__name__"), Some("vmsight_block_bytes_total"));
    assert_eq!(s.label("vm"), Some("test-vm"));
    assert_eq!(s.label("disk"), Some("1"));
    assert_eq!(s.label("kind"), Some("write"));
    assert_eq!(s.label("job"), Some(JOB));
    assert_eq!(
        s.label("instance"),
        Some(server.local_addr().to_string().as_str())
    );
}

#[test]
fn escaped_labels_and_help_come_back_unchanged_and_the_scrape_is_clean() {
    let (server, _) = growing_counter();
    let prometheus = Prometheus::start(&[server.local_addr()]).expect("start prometheus");
    let samples = prometheus
        .wait_for("vmsight_test_awkward", WAIT, |s| s.len() == 1)
        .expect("the awkward gauge through prometheus");
    assert_eq!(samples[0].label("path"), Some(AWKWARD));
    assert_eq!(samples[0].value, 0.25);

    let both = prometheus.query("vmsight_block_bytes_total").unwrap();
    assert_eq!(both.len(), 2, "two series of one family: {both:?}");

    let meta = prometheus
        .api("metadata", &[("metric", "vmsight_test_awkward")])
        .unwrap();
    assert_eq!(
        meta["vmsight_test_awkward"][0]["help"], AWKWARD_HELP,
        "{meta}"
    );
    assert_eq!(meta["vmsight_test_awkward"][0]["type"], "gauge", "{meta}");
    let meta = prometheus
        .api("metadata", &[("metric", "vmsight_block_bytes_total")])
        .unwrap();
    assert_eq!(
        meta["vmsight_block_bytes_total"][0]["type"], "counter",
        "{meta}"
    );

    let rejected = prometheus
        .query("vmsight_metrics_rejected_samples")
        .unwrap();
    assert_eq!(rejected.len(), 1);
    assert_eq!(rejected[0].value, 0.0);
    let targets = prometheus.targets().unwrap();
    assert_eq!(targets.len(), 1, "{targets:?}");
    let (url, health, error) = &targets[0];
    assert_eq!(url, &server.url());
    assert_eq!((health.as_str(), error.as_str()), ("up", ""), "{targets:?}");
}

#[test]
fn a_missing_prometheus_binary_is_an_error_that_says_what_to_install() {
    let e = Prometheus::start_with(Path::new("/nonexistent/prometheus"), &[]).unwrap_err();
    assert!(matches!(e, HarnessError::BinaryMissing { .. }), "{e:?}");
    assert!(e.to_string().contains("`prometheus` package"), "{e}");
}
