//! The metrics endpoint of one VM (`vmsight run --metrics ADDR`): every device, every stage of
//! every disk and every file-update stream, read live on each scrape. Nothing here names a
//! device kind or a stage: it iterates over the registries' handles.

use std::sync::{Arc, Mutex};

use vmsight_metrics::{labels, MetricSink, MetricSource, MetricType, MetricsServer, Value};

use crate::config::VmConfig;
use crate::devices::{Device, DeviceMetrics};
use crate::error::LaunchError;
use crate::stages::{Sample, SampleKind};
use crate::stream::{DiskStream, InferStats};

/// What one file-update stream exposes.
struct StreamMetrics {
    disk: usize,
    queue: Arc<vmsight_blockdev::tap::TapQueue>,
    infer: Arc<Mutex<InferStats>>,
}

/// The VM's metric source.
struct VmSource {
    vm: String,
    devices: Vec<DeviceMetrics>,
    streams: Vec<StreamMetrics>,
}

/// Starts the endpoint when `--metrics` asks for it.
pub fn serve(
    cfg: &VmConfig,
    devices: &[Box<dyn Device>],
    streams: &[DiskStream],
) -> Result<Option<MetricsServer>, LaunchError> {
    let Some(addr) = &cfg.metrics else {
        return Ok(None);
    };
    let source = VmSource {
        vm: cfg.name.clone(),
        devices: devices.iter().map(|d| d.metrics()).collect(),
        streams: streams
            .iter()
            .map(|s| StreamMetrics {
                disk: s.index,
                queue: s.queue(),
                infer: s.infer.clone(),
            })
            .collect(),
    };
    let server = MetricsServer::start(addr, Arc::new(source))?;
    tracing::info!("metrics at {}", server.url());
    if !server.local_addr().ip().is_loopback() {
        // No authentication, no TLS (docs/metrics.md, docs/security.md).
        tracing::warn!(
            "VM {}: metrics served on {}, not a loopback address: anyone who can reach it \
             reads the VM's counters",
            cfg.name,
            server.local_addr()
        );
    }
    Ok(Some(server))
}

/// Pushes one registry sample, prefixed `vmsight_`, under the caller's label scope.
fn push(sink: &mut MetricSink, s: &Sample) {
    let name = format!("vmsight_{}", s.name);
    let labels: Vec<(&str, &str)> = s.labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let kind = match s.kind {
        SampleKind::Counter => MetricType::Counter,
        SampleKind::Gauge => MetricType::Gauge,
    };
    let _ = sink.push(kind, &name, s.help, &labels, Value::from(s.value));
}

impl VmSource {
    fn device(&self, sink: &mut MetricSink, d: &DeviceMetrics) {
        let disk = d.disk.map(|i| i.to_string());
        let mut info = vec![(labels::DEVICE, d.id.as_str()), ("type", d.kind)];
        if let Some(disk) = &disk {
            info.push((labels::DISK, disk));
        }
        sink.gauge(
            "vmsight_device_info",
            "One per device backend; joins device to disk.",
            &info,
            1u64,
        );
        // Disks are labelled by index (as their stages always were), other devices by id.
        let scope = match &disk {
            Some(disk) => (labels::DISK, disk.as_str()),
            None => (labels::DEVICE, d.id.as_str()),
        };
        sink.with_labels(&[scope], |sink| {
            for s in (d.samples)() {
                push(sink, &s);
            }
            for (stage, m) in &d.stages {
                let pos = match disk {
                    Some(_) => crate::stages::entry(stage).map(|e| e.position),
                    None => crate::net::stages::entry(stage).map(|e| e.position),
                }
                .unwrap_or(0)
                .to_string();
                sink.gauge(
                    "vmsight_stage_info",
                    "One per reporting stage in each disk's pipeline; position as in the stage registry.",
                    &[(labels::STAGE, stage), ("position", &pos)],
                    1u64,
                );
                sink.with_labels(&[(labels::STAGE, stage)], |sink| {
                    for s in m.samples() {
                        push(sink, &s);
                    }
                });
            }
        });
    }

    fn stream(&self, sink: &mut MetricSink, s: &StreamMetrics) {
        let disk = s.disk.to_string();
        let t = s.queue.snapshot();
        let infer = s.infer.lock().map(|g| g.clone()).unwrap_or_default();
        sink.with_labels(&[(labels::DISK, &disk)], |sink| {
            for (name, help, v) in [
                (
                    "vmsight_tap_events_total",
                    "Write-tap events queued.",
                    t.events,
                ),
                (
                    "vmsight_tap_bytes_total",
                    "Payload bytes the tap copied.",
                    t.bytes,
                ),
                (
                    "vmsight_tap_writes_without_data_total",
                    "Writes queued without their bytes (overload).",
                    t.writes_without_data,
                ),
                (
                    "vmsight_stream_events_total",
                    "File-update events inferred.",
                    infer.events,
                ),
                (
                    "vmsight_stream_transactions_applied_total",
                    "jbd2 transactions applied.",
                    infer.txns_applied,
                ),
                (
                    "vmsight_stream_dropped_data_writes_total",
                    "Data writes dropped by overload control.",
                    infer.dropped_data_writes,
                ),
                (
                    "vmsight_stream_index_sections_loaded_total",
                    "Sections of a lazy index read from its file.",
                    infer.index.sections_loaded,
                ),
            ] {
                sink.counter(name, help, &[], v);
            }
            sink.gauge(
                "vmsight_tap_queued_bytes",
                "Bytes waiting in the tap queue.",
                &[],
                t.queued_bytes,
            );
            sink.gauge(
                "vmsight_stream_pending_blocks",
                "Blocks waiting for their owner.",
                &[],
                infer.pending_blocks,
            );
            sink.gauge(
                "vmsight_stream_index_resident_bytes",
                "Bytes the disk's index holds in memory.",
                &[],
                infer.index.resident_bytes,
            );
        });
    }
}

impl MetricSource for VmSource {
    fn collect(&self, sink: &mut MetricSink) {
        sink.with_labels(&[(labels::VM, &self.vm)], |sink| {
            for d in &self.devices {
                self.device(sink, d);
            }
            for s in &self.streams {
                self.stream(sink, s);
            }
        });
    }
}
