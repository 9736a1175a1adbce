//! Prometheus metrics for vmsight.
//!
//! Registries (VMs, disks, devices, pipeline stages) implement [`MetricSource`] and push their
//! live values into a [`MetricSink`] on every scrape; the sink groups the samples into
//! families (one `# HELP`/`# TYPE` per family, whatever the push order), validates names and
//! labels, and encodes the Prometheus text exposition format 0.0.4. [`MetricsServer`] serves
//! it at `GET /metrics` from its own thread.
//!
//! ```
//! use std::sync::Arc;
//! use vmsight_metrics::{from_fn, MetricSink, MetricSource, MetricsServer};
//!
//! struct Disk { index: u32, bytes_written: u64 }
//! impl MetricSource for Disk {
//!     fn collect(&self, sink: &mut MetricSink) {
//!         let disk = self.index.to_string();
//!         sink.counter("vmsight_block_bytes_total", "Bytes of successful block requests.",
//!                      &[("disk", &disk), ("kind", "write")], self.bytes_written);
//!     }
//! }
//! let disks = vec![Disk { index: 0, bytes_written: 4096 }, Disk { index: 1, bytes_written: 0 }];
//! let vm = from_fn(move |sink: &mut MetricSink| {
//!     sink.with_labels(&[("vm", "web1")], |sink| sink.collect_from(&disks))
//! });
//! let server = MetricsServer::start("127.0.0.1:0", Arc::new(vm))?;
//! println!("scrape {}", server.url()); // http://127.0.0.1:PORT/metrics
//! # Ok::<(), vmsight_metrics::MetricsError>(())
//! ```
//!
//! Naming conventions (docs/metrics.md lists the names vmsight emits): every name starts with
//! `vmsight_`, uses base units (`_bytes`, `_seconds`), counters end in `_total`; the labels in
//! [`labels`] identify what a sample is about.

mod http;
mod model;
pub mod names;
mod server;
pub mod text;

#[cfg(feature = "test-harness")]
pub mod harness;

pub use model::{
    from_fn, FnSource, MetricFamily, MetricSink, MetricSource, MetricType, Sample, SampleError,
    Value,
};
pub use server::{MetricsError, MetricsServer, ServerOptions};
pub use text::CONTENT_TYPE;

/// Label names shared by every vmsight registry, so the same thing has the same label.
pub mod labels {
    /// The VM's name (`vmsight run --name`).
    pub const VM: &str = "vm";
    /// A disk's index in its VM: 0 is the root disk, then the `--disk` options in order.
    pub const DISK: &str = "disk";
    /// A device backend's QEMU id, e.g. `disk1`.
    pub const DEVICE: &str = "device";
    /// A pipeline stage's name (`Stage::name`), e.g. `icache`.
    pub const STAGE: &str = "stage";
    /// A request kind: `read`, `write`, `flush`, `discard`, `write_zeroes`, `get_id`.
    pub const KIND: &str = "kind";
}

/// Gauge added to every scrape by [`collect`]: samples left out because they were invalid.
pub const REJECTED_SAMPLES: &str = "vmsight_metrics_rejected_samples";

/// Collects `source` into a new sink and adds the [`REJECTED_SAMPLES`] gauge.
pub fn collect(source: &dyn MetricSource) -> MetricSink {
    let mut sink = MetricSink::new();
    source.collect(&mut sink);
    let rejected = sink.rejected().len();
    sink.gauge(
        REJECTED_SAMPLES,
        "Samples of this scrape left out because their name, labels or value were invalid.",
        &[],
        rejected,
    );
    sink
}

/// What one scrape of `source` returns: the text exposition format.
pub fn render(source: &dyn MetricSource) -> String {
    collect(source).encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_reports_its_rejected_samples() {
        let source = from_fn(|s: &mut MetricSink| {
            s.counter("ok_total", "", &[], 1u64);
            s.counter("not_a_counter_name", "", &[], 1u64);
        });
        let text = render(&source);
        assert!(text.contains("\nok_total 1\n"), "{text}");
        assert!(
            text.contains("\nvmsight_metrics_rejected_samples 1\n"),
            "{text}"
        );
        assert!(!text.contains("not_a_counter_name"), "{text}");
    }
}
