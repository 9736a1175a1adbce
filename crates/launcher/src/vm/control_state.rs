//! What the control socket can see and do (`vmsight stream NAME`, `vmsight stats NAME`).
//! Stages are reported through the registry's handles, under each stage's key.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use vmsight_proto::control::{ControlReply, ControlRequest, DiskStatus, IdleAction, VmStatus};

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

/// Why a VM without the interface refuses symbiotic requests.
const NO_SYM: &str = "the VM runs without the symbiotic interface (start it with --symbiotic)";
const NO_SWAP: &str = "the VM has no swap disk served by vmsight (start it with --swap SIZE)";

/// The feature services the control socket reaches (each absent when not configured).
pub struct ControlFeatures {
    pub idle: Option<Arc<crate::idle::Attributor>>,
    pub hylics: Option<crate::hylics::Hylics>,
    pub sym: Option<Arc<crate::sym::Symbiotic>>,
    pub swap: Option<Arc<crate::swap::SwapService>>,
}

/// The state the control socket's handler reads.
pub struct ControlState {
    streams: Vec<StreamHandles>,
    devices: Vec<DeviceMetrics>,
    insight: Option<vmsight_insight::InsightEngine>,
    idle: Option<Arc<crate::idle::Attributor>>,
    hylics: Option<crate::hylics::Hylics>,
    /// The plugin's channel (vCPU redirection goes through its mailbox).
    plugin: Option<Arc<Mutex<vmsight_ring::ChannelHost>>>,
    /// The symbiotic interface (`--symbiotic`).
    sym: Option<Arc<crate::sym::Symbiotic>>,
    /// The swap disk's service (`--swap`).
    swap: Option<Arc<crate::swap::SwapService>>,
}

impl ControlState {
    pub fn new(
        streams: &[DiskStream],
        devices: &[Box<dyn Device>],
        insight: Option<vmsight_insight::InsightEngine>,
        plugin: Option<Arc<Mutex<vmsight_ring::ChannelHost>>>,
        features: ControlFeatures,
    ) -> Self {
        let ControlFeatures {
            idle,
            hylics,
            sym,
            swap,
        } = features;
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
            idle,
            hylics,
            plugin,
            sym,
            swap,
        }
    }

    /// One entry per disk that streams: its tap and inference, and every reporting stage's
    /// snapshot under the stage's key plus its summary line.
    fn status(&self) -> VmStatus {
        let disks = self
            .streams
            .iter()
            .map(|h| {
                let mut stage_counters = BTreeMap::new();
                let mut stages = Vec::new();
                for dev in self.devices.iter().filter(|m| m.disk == Some(h.index)) {
                    for (_, m) in &dev.stages {
                        stage_counters.insert(m.key().to_owned(), m.snapshot());
                        stages.push(m.summary());
                    }
                }
                DiskStatus {
                    disk: h.index,
                    streaming: h.ready(),
                    tap: serde_json::to_value(h.queue.snapshot()).unwrap_or_default(),
                    inference: h
                        .infer
                        .lock()
                        .ok()
                        .and_then(|s| serde_json::to_value(s.clone()).ok()),
                    stages,
                    stage_counters,
                }
            })
            .collect();
        VmStatus {
            disks,
            insights: self
                .insight
                .as_ref()
                .and_then(|e| serde_json::to_value(e.counters()).ok()),
        }
    }

    /// Enables every idle tap and waits (bounded) for the crawls, so the caller knows when
    /// events flow; a disk without a readable file system never becomes ready.
    fn stream_start(&self) -> ControlReply {
        let mut attached = Vec::new();
        for h in &self.streams {
            if !h.ready() {
                h.queue.set_enabled(true);
                h.attach.store(true, Ordering::Release);
                attached.push(h.index);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline
            && self
                .streams
                .iter()
                .any(|h| attached.contains(&h.index) && !h.ready())
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        ControlReply::StreamStarted {
            status: self.status(),
            attached,
        }
    }

    /// Answers one control request.
    pub fn request(&self, req: ControlRequest) -> ControlReply {
        match req {
            ControlRequest::Status => ControlReply::Status(self.status()),
            ControlRequest::StreamStart => self.stream_start(),
            ControlRequest::DedupGc { volume } => match crate::disksource::gc(&volume) {
                Some(Ok(freed)) => ControlReply::DedupGc { freed },
                Some(Err(e)) => ControlReply::Refused(e.to_string()),
                None => ControlReply::Refused(format!(
                    "this VM does not serve dedup volume {}",
                    volume.display()
                )),
            },
            ControlRequest::Idle { action, target } => self.idle(action, target.as_deref()),
            ControlRequest::ShareResize { bytes } => self.share_resize(bytes),
            ControlRequest::HylicsController => self.controller(),
            ControlRequest::Redirect(req) => self.redirect(&req),
            ControlRequest::SymSpy => match &self.sym {
                Some(s) => ControlReply::SymSpy(Box::new(s.spy())),
                None => ControlReply::Refused(NO_SYM.into()),
            },
            ControlRequest::SymCall(req) => match &self.sym {
                Some(s) => match s.call(&req) {
                    Ok(r) => ControlReply::SymCalled(r),
                    Err(e) => ControlReply::Refused(e.to_string()),
                },
                None => ControlReply::Refused(NO_SYM.into()),
            },
            ControlRequest::Swap { cache_bytes } => self.swap(cache_bytes),
        }
    }

    /// `vmsight swap NAME status|cache SIZE`: resizes the cache if asked, then reports.
    fn swap(&self, cache_bytes: Option<u64>) -> ControlReply {
        let Some(s) = &self.swap else {
            return ControlReply::Refused(NO_SWAP.into());
        };
        if let Some(b) = cache_bytes {
            if let Err(e) = s.set_cache(b) {
                return ControlReply::Refused(e.to_string());
            }
        }
        ControlReply::Swap(Box::new(s.report()))
    }

    /// `vmsight cpu NAME redirect`: blocks until the guest function returned (or why not).
    fn redirect(&self, req: &vmsight_proto::redirect::RedirectRequest) -> ControlReply {
        let result = match &self.plugin {
            Some(p) => crate::redirect::call(p, req),
            None => Err(crate::redirect::RedirectCallError::NoPlugin),
        };
        match result {
            Ok(o) => ControlReply::Redirected(o),
            Err(e) => ControlReply::Refused(e.to_string()),
        }
    }

    /// `vmsight hylics NAME resize SIZE`: the share afterwards, or why not.
    fn share_resize(&self, bytes: u64) -> ControlReply {
        let Some(share) = self.hylics.as_ref().map(|h| &h.share) else {
            return ControlReply::Refused(
                "this VM has no shared in-memory file system (start it with --shared-mem SIZE)"
                    .into(),
            );
        };
        if let Err(e) = crate::hylics::spec::check_size(bytes) {
            return ControlReply::Refused(e.to_string());
        }
        match share.resize(bytes) {
            Ok(info) => ControlReply::Share(info),
            Err(e) => ControlReply::Refused(e.to_string()),
        }
    }

    /// `vmsight hylics NAME controller`: the controller's state, or why there is none.
    fn controller(&self) -> ControlReply {
        match self.hylics.as_ref().and_then(|h| h.controller.as_ref()) {
            Some(c) => ControlReply::Controller(c.status()),
            None => ControlReply::Refused(
                "this VM has no Hylics controller (start it with --shared-mem SIZE --hylics-slo TAU)"
                    .into(),
            ),
        }
    }

    /// `vmsight idle NAME add|remove|list`: changes the marks, answers with all of them.
    fn idle(&self, action: IdleAction, target: Option<&str>) -> ControlReply {
        let Some(a) = &self.idle else {
            return ControlReply::Refused(
                "FoxyIdle is off in this VM (start it with --background or --idle)".into(),
            );
        };
        let parsed = match (action, target) {
            (IdleAction::List, _) => None,
            (_, None) => {
                return ControlReply::Refused("add and remove need a PID or a COMM".into())
            }
            (_, Some(t)) => match t.parse::<crate::trace::TraceTarget>() {
                Ok(t) => Some(t),
                Err(e) => return ControlReply::Refused(e.to_string()),
            },
        };
        let done = match (action, &parsed) {
            (IdleAction::Add, Some(t)) => a.mark(t, crate::idle::marks::Source::Cli),
            (IdleAction::Remove, Some(t)) => a.unmark(t),
            _ => Ok(()),
        };
        match done {
            Ok(()) => ControlReply::IdleMarks(a.marks()),
            Err(e) => ControlReply::Refused(e.to_string()),
        }
    }
}
