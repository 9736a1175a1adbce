//! What the control socket can see and do (`vmsight stream NAME`, `vmsight stats NAME`).
//! Stages are reported through the registry's handles, under each stage's key.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::devices::{Device, DeviceMetrics};
use crate::stream::{DiskStream, EngineSlot, InferStats};

/// One disk's stream handles.
struct StreamHandles {
    index: usize,
    queue: Arc<vmsight_blockdev::tap::TapQueue>,
    attach: Arc<AtomicBool>,
    slot: Arc<RwLock<EngineSlot>>,
    infer: Arc<Mutex<InferStats>>,
}

impl StreamHandles {
    fn ready(&self) -> bool {
        self.slot.read().map(|s| s.0.is_some()).unwrap_or(false)
    }
}

/// The state the control socket's handler reads.
pub struct ControlState {
    streams: Vec<StreamHandles>,
    devices: Vec<DeviceMetrics>,
    insight: Option<vmsight_insight::InsightEngine>,
}

impl ControlState {
    pub fn new(
        streams: &[DiskStream],
        devices: &[Box<dyn Device>],
        insight: Option<vmsight_insight::InsightEngine>,
    ) -> Self {
        Self {
            streams: streams
                .iter()
                .map(|d| StreamHandles {
                    index: d.index,
                    queue: d.queue(),
                    attach: d.attach.clone(),
                    slot: d.slot.clone(),
                    infer: d.infer.clone(),
                })
                .collect(),
            devices: devices.iter().map(|d| d.metrics()).collect(),
            insight,
        }
    }

    /// One object per disk that streams: its tap and inference, and every reporting stage's
    /// snapshot under the stage's key plus its summary line.
    fn status(&self) -> serde_json::Value {
        let disks: Vec<serde_json::Value> = self
            .streams
            .iter()
            .map(|h| {
                let mut d = serde_json::json!({
                    "disk": h.index,
                    "streaming": h.ready(),
                    "tap": h.queue.snapshot(),
                    "inference": h.infer.lock().ok().map(|s| s.clone()),
                });
                let mut lines = Vec::new();
                for dev in self.devices.iter().filter(|m| m.disk == Some(h.index)) {
                    for (_, m) in &dev.stages {
                        d[m.key()] = m.snapshot();
                        lines.push(m.summary());
                    }
                }
                d["stages"] = serde_json::json!(lines);
                d
            })
            .collect();
        serde_json::json!({
            "disks": disks,
            "insights": self.insight.as_ref().map(|e| e.counters()),
        })
    }

    /// Enables every idle tap and waits (bounded) for the crawls, so the caller knows when
    /// events flow; a disk without a readable file system never becomes ready.
    fn stream_start(&self) -> serde_json::Value {
        let mut started = Vec::new();
        for h in &self.streams {
            if !h.ready() {
                h.queue.set_enabled(true);
                h.attach.store(true, Ordering::Release);
                started.push(h.index);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline
            && self
                .streams
                .iter()
                .any(|h| started.contains(&h.index) && !h.ready())
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut v = self.status();
        v["attached"] = serde_json::json!(started);
        v
    }

    pub fn request(&self, req: &serde_json::Value) -> Result<serde_json::Value, String> {
        match req.get("cmd").and_then(serde_json::Value::as_str) {
            Some("status") => Ok(self.status()),
            Some("stream-start") => Ok(self.stream_start()),
            Some(other) => Err(format!(
                "unknown command {other:?} (known: status, stream-start)"
            )),
            None => Err("the request has no command".into()),
        }
    }
}
