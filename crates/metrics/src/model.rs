//! The typed model: metric families, their samples, and the sink that sources push into.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use crate::names::{is_reserved_label_name, is_valid_label_name, is_valid_metric_name};

/// The Prometheus type of a metric family. Only the two types vmsight needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricType {
    /// A monotonically increasing total; its name ends in `_total`.
    Counter,
    /// A value that can go up and down (a level, a size, a state).
    Gauge,
}

impl MetricType {
    /// The type's name in a `# TYPE` line.
    pub fn as_str(self) -> &'static str {
        match self {
            MetricType::Counter => "counter",
            MetricType::Gauge => "gauge",
        }
    }
}

impl fmt::Display for MetricType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A sample value. Integers are kept exact in the exposition (Prometheus stores every value
/// as a float64, so integers above 2^53 lose precision only there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// An unsigned integer (most counters).
    U64(u64),
    /// A signed integer (a gauge that can be negative).
    I64(i64),
    /// A float (seconds, ratios); may be NaN or infinite for gauges.
    F64(f64),
}

impl Value {
    /// The value as Prometheus stores it.
    pub fn as_f64(self) -> f64 {
        match self {
            Value::U64(v) => v as f64,
            Value::I64(v) => v as f64,
            Value::F64(v) => v,
        }
    }

    /// Whether a counter may have this value: not negative, not NaN.
    fn is_valid_counter(self) -> bool {
        match self {
            Value::U64(_) => true,
            Value::I64(v) => v >= 0,
            Value::F64(v) => v >= 0.0,
        }
    }
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::U64(v)
    }
}

impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::U64(v.into())
    }
}

impl From<usize> for Value {
    fn from(v: usize) -> Self {
        Value::U64(v as u64)
    }
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::I64(v)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::F64(v)
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::U64(v.into())
    }
}

/// One labelled value of a family.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Label names and values, in the order they were given (scope labels first).
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: Value,
}

/// A metric family: one name, one help text, one type, and its samples.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricFamily {
    /// The metric name; for counters it ends in `_total`.
    pub name: String,
    /// One line of help (the first help given for the family wins).
    pub help: String,
    /// Counter or gauge.
    pub kind: MetricType,
    /// Samples in the order they were pushed; no two have the same label set.
    pub samples: Vec<Sample>,
}

/// Why a pushed sample was not taken. A rejected sample is left out of the exposition (which
/// stays valid) and counted in the `vmsight_metrics_rejected_samples` gauge of every scrape.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    /// The metric name is not `[a-zA-Z_:][a-zA-Z0-9_:]*`.
    #[error("invalid metric name {name:?}: must match [a-zA-Z_:][a-zA-Z0-9_:]*")]
    InvalidMetricName { name: String },
    /// A counter's name does not end in `_total` (Prometheus naming convention).
    #[error("counter {name}: a counter's name must end in _total")]
    CounterWithoutTotal { name: String },
    /// A label name is not `[a-zA-Z_][a-zA-Z0-9_]*`.
    #[error("metric {metric}: invalid label name {label:?}: must match [a-zA-Z_][a-zA-Z0-9_]*")]
    InvalidLabelName { metric: String, label: String },
    /// A label name starts with `__` (reserved for Prometheus).
    #[error("metric {metric}: label name {label} is reserved (starts with __)")]
    ReservedLabelName { metric: String, label: String },
    /// The same label name appears twice in one sample (possibly once from a scope).
    #[error("metric {metric}: label {label} given twice")]
    DuplicateLabel { metric: String, label: String },
    /// The family was first pushed with another type.
    #[error("metric {name}: pushed as a {pushed} but it is a {first}")]
    TypeConflict {
        name: String,
        first: MetricType,
        pushed: MetricType,
    },
    /// The family already has a sample with the same label set.
    #[error("metric {name}: a second sample with the labels {labels}")]
    DuplicateSeries { name: String, labels: String },
    /// A counter value is negative or NaN.
    #[error("counter {name}: invalid value {value} (must be >= 0)")]
    InvalidCounterValue { name: String, value: f64 },
}

/// Something that has metrics to show on every scrape: a registry of VMs, disks, devices or
/// stages implements this and pushes its current values into the sink. `collect` may be
/// called concurrently from several scrapes; it should read live counters, not block.
pub trait MetricSource: Send + Sync {
    /// Pushes the current value of every metric of this source into `sink`.
    fn collect(&self, sink: &mut MetricSink);
}

impl<T: MetricSource + ?Sized> MetricSource for Arc<T> {
    fn collect(&self, sink: &mut MetricSink) {
        (**self).collect(sink);
    }
}

impl<T: MetricSource + ?Sized> MetricSource for Box<T> {
    fn collect(&self, sink: &mut MetricSink) {
        (**self).collect(sink);
    }
}

impl<T: MetricSource> MetricSource for [T] {
    fn collect(&self, sink: &mut MetricSink) {
        for source in self {
            source.collect(sink);
        }
    }
}

impl<T: MetricSource> MetricSource for Vec<T> {
    fn collect(&self, sink: &mut MetricSink) {
        self.as_slice().collect(sink);
    }
}

/// A [`MetricSource`] made of a closure; see [`from_fn`].
pub struct FnSource<F>(F);

impl<F: Fn(&mut MetricSink) + Send + Sync> MetricSource for FnSource<F> {
    fn collect(&self, sink: &mut MetricSink) {
        (self.0)(sink);
    }
}

/// A source whose `collect` is the closure `f`.
pub fn from_fn<F: Fn(&mut MetricSink) + Send + Sync>(f: F) -> FnSource<F> {
    FnSource(f)
}

/// Collects the samples of one scrape, grouped by family whatever the order of the pushes.
///
/// Pushes never fail for the caller: an invalid sample is recorded in [`MetricSink::rejected`]
/// and left out, so one buggy source cannot break the whole exposition.
#[derive(Debug, Default)]
pub struct MetricSink {
    families: Vec<MetricFamily>,
    by_name: HashMap<String, usize>,
    /// (family index, label set sorted by name): the series already present.
    series: HashSet<(usize, Vec<(String, String)>)>,
    /// Labels added to every sample pushed inside [`MetricSink::with_labels`].
    scope: Vec<(String, String)>,
    rejected: Vec<SampleError>,
}

impl MetricSink {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// Pushes one sample of the counter family `name` (which must end in `_total`).
    pub fn counter(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        value: impl Into<Value>,
    ) {
        self.record(MetricType::Counter, name, help, labels, value.into());
    }

    /// Pushes one sample of the gauge family `name`.
    pub fn gauge(
        &mut self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        value: impl Into<Value>,
    ) {
        self.record(MetricType::Gauge, name, help, labels, value.into());
    }

    /// Pushes one sample and says whether it was taken (it is also recorded when rejected).
    pub fn push(
        &mut self,
        kind: MetricType,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        value: Value,
    ) -> Result<(), SampleError> {
        let result = self.try_push(kind, name, help, labels, value);
        if let Err(e) = &result {
            self.rejected.push(e.clone());
        }
        result
    }

    /// Runs `f` with `labels` added in front of every sample it pushes, e.g. a VM registry
    /// runs each disk's source inside `with_labels(&[("vm", name)], ..)`. Scopes nest.
    pub fn with_labels<R>(&mut self, labels: &[(&str, &str)], f: impl FnOnce(&mut Self) -> R) -> R {
        let depth = self.scope.len();
        self.scope
            .extend(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let result = f(self);
        self.scope.truncate(depth);
        result
    }

    /// Lets `source` push its samples into this sink.
    pub fn collect_from(&mut self, source: &dyn MetricSource) {
        source.collect(self);
    }

    /// The families collected so far, in the order their first sample was pushed.
    pub fn families(&self) -> &[MetricFamily] {
        &self.families
    }

    /// The families, consuming the sink.
    pub fn into_families(self) -> Vec<MetricFamily> {
        self.families
    }

    /// Why samples were left out, in push order.
    pub fn rejected(&self) -> &[SampleError] {
        &self.rejected
    }

    /// The samples as Prometheus text exposition format 0.0.4.
    pub fn encode(&self) -> String {
        crate::text::encode(&self.families)
    }

    /// [`MetricSink::push`] without the bookkeeping of rejections.
    fn record(
        &mut self,
        kind: MetricType,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        value: Value,
    ) {
        // The rejection is kept in `self.rejected` by `push`; nothing more to do here.
        let _rejected = self.push(kind, name, help, labels, value);
    }

    fn try_push(
        &mut self,
        kind: MetricType,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
        value: Value,
    ) -> Result<(), SampleError> {
        check_family(kind, name, value)?;
        let labels = self.full_labels(name, labels)?;
        let family = self.family_index(kind, name, help)?;
        let mut key = labels.clone();
        key.sort();
        if !self.series.insert((family, key)) {
            return Err(SampleError::DuplicateSeries {
                name: name.to_string(),
                labels: crate::text::label_set(&labels),
            });
        }
        self.families[family].samples.push(Sample { labels, value });
        Ok(())
    }

    /// The scope labels followed by `labels`, validated.
    fn full_labels(
        &self,
        metric: &str,
        labels: &[(&str, &str)],
    ) -> Result<Vec<(String, String)>, SampleError> {
        let mut all = self.scope.clone();
        all.extend(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let mut seen = HashSet::new();
        for (label, _) in &all {
            check_label_name(metric, label)?;
            if !seen.insert(label.as_str()) {
                return Err(SampleError::DuplicateLabel {
                    metric: metric.to_string(),
                    label: label.clone(),
                });
            }
        }
        Ok(all)
    }

    /// The index of family `name`, created on first use; its type must match.
    fn family_index(
        &mut self,
        kind: MetricType,
        name: &str,
        help: &str,
    ) -> Result<usize, SampleError> {
        if let Some(&i) = self.by_name.get(name) {
            let first = self.families[i].kind;
            if first != kind {
                return Err(SampleError::TypeConflict {
                    name: name.to_string(),
                    first,
                    pushed: kind,
                });
            }
            return Ok(i);
        }
        self.families.push(MetricFamily {
            name: name.to_string(),
            help: help.to_string(),
            kind,
            samples: Vec::new(),
        });
        let i = self.families.len() - 1;
        self.by_name.insert(name.to_string(), i);
        Ok(i)
    }
}

/// Checks a family's name against its type, and a counter's value.
fn check_family(kind: MetricType, name: &str, value: Value) -> Result<(), SampleError> {
    if !is_valid_metric_name(name) {
        return Err(SampleError::InvalidMetricName {
            name: name.to_string(),
        });
    }
    if kind == MetricType::Counter {
        if !name.ends_with("_total") {
            return Err(SampleError::CounterWithoutTotal {
                name: name.to_string(),
            });
        }
        if !value.is_valid_counter() {
            return Err(SampleError::InvalidCounterValue {
                name: name.to_string(),
                value: value.as_f64(),
            });
        }
    }
    Ok(())
}

/// Checks one label name of `metric`.
fn check_label_name(metric: &str, label: &str) -> Result<(), SampleError> {
    let err =
        |make: fn(String, String) -> SampleError| Err(make(metric.to_string(), label.to_string()));
    if !is_valid_label_name(label) {
        return err(|metric, label| SampleError::InvalidLabelName { metric, label });
    }
    if is_reserved_label_name(label) {
        return err(|metric, label| SampleError::ReservedLabelName { metric, label });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
