use super::*;

fn names(sink: &MetricSink) -> Vec<&str> {
    sink.families().iter().map(|f| f.name.as_str()).collect()
}

#[test]
fn interleaved_pushes_are_grouped_into_one_family_each() {
    let mut sink = MetricSink::new();
    sink.counter("a_total", "A.", &[("disk", "0")], 1u64);
    sink.gauge("b", "B.", &[("disk", "0")], 2u64);
    sink.counter("a_total", "A.", &[("disk", "1")], 3u64);
    sink.gauge("b", "B.", &[("disk", "1")], 4u64);
    assert_eq!(names(&sink), ["a_total", "b"]);
    assert_eq!(sink.families()[0].samples.len(), 2);
    assert_eq!(sink.families()[1].samples.len(), 2);
    let text = sink.encode();
    assert_eq!(
        text.matches("# TYPE a_total counter\n").count(),
        1,
        "{text}"
    );
    assert_eq!(text.matches("# HELP b B.\n").count(), 1, "{text}");
    assert_eq!(
        text,
        "# HELP a_total A.\n# TYPE a_total counter\na_total{disk=\"0\"} 1\na_total{disk=\"1\"} 3\n\
         # HELP b B.\n# TYPE b gauge\nb{disk=\"0\"} 2\nb{disk=\"1\"} 4\n"
    );
    assert!(sink.rejected().is_empty());
}

#[test]
fn the_first_help_of_a_family_wins() {
    let mut sink = MetricSink::new();
    sink.gauge("g", "first", &[("a", "1")], 1u64);
    sink.gauge("g", "second", &[("a", "2")], 1u64);
    assert_eq!(sink.families()[0].help, "first");
}

#[test]
fn scoped_labels_come_first_and_nest() {
    let mut sink = MetricSink::new();
    sink.with_labels(&[("vm", "web1")], |sink| {
        sink.with_labels(&[("disk", "1")], |sink| {
            sink.counter("x_total", "", &[("kind", "read")], 5u64);
        });
        sink.gauge("y", "", &[], 1u64);
    });
    sink.gauge("z", "", &[], 1u64);
    let labels = |i: usize| sink.families()[i].samples[0].labels.clone();
    let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    assert_eq!(
        labels(0),
        pairs(&[("vm", "web1"), ("disk", "1"), ("kind", "read")])
    );
    assert_eq!(labels(1), pairs(&[("vm", "web1")]));
    assert!(labels(2).is_empty(), "the scope ends with the closure");
}

#[test]
fn invalid_names_are_rejected_and_left_out() {
    let mut sink = MetricSink::new();
    sink.gauge("bad-name", "", &[], 1u64);
    sink.gauge("g", "", &[("bad-label", "x")], 1u64);
    sink.gauge("g", "", &[("__name__", "x")], 1u64);
    sink.gauge("g", "", &[("9", "x")], 1u64);
    assert!(sink.families().iter().all(|f| f.samples.is_empty()));
    assert_eq!(
        sink.rejected(),
        [
            SampleError::InvalidMetricName {
                name: "bad-name".into()
            },
            SampleError::InvalidLabelName {
                metric: "g".into(),
                label: "bad-label".into()
            },
            SampleError::ReservedLabelName {
                metric: "g".into(),
                label: "__name__".into()
            },
            SampleError::InvalidLabelName {
                metric: "g".into(),
                label: "9".into()
            },
        ]
    );
    assert_eq!(sink.encode(), "", "no family got a sample");
}

#[test]
fn counters_need_total_and_a_non_negative_value() {
    let mut sink = MetricSink::new();
    sink.counter("requests", "", &[], 1u64);
    sink.counter("a_total", "", &[("s", "neg")], -1i64);
    sink.counter("a_total", "", &[("s", "nan")], f64::NAN);
    sink.counter("a_total", "", &[("s", "ok")], 0.5);
    sink.gauge("level", "", &[("s", "neg")], -1i64);
    sink.gauge("level", "", &[("s", "nan")], f64::NAN);
    assert_eq!(sink.rejected().len(), 3, "{:?}", sink.rejected());
    assert!(
        matches!(&sink.rejected()[0], SampleError::CounterWithoutTotal { name } if name == "requests")
    );
    assert!(
        matches!(&sink.rejected()[1], SampleError::InvalidCounterValue { value, .. } if *value == -1.0)
    );
    assert!(
        matches!(&sink.rejected()[2], SampleError::InvalidCounterValue { value, .. } if value.is_nan())
    );
    assert_eq!(
        sink.families()
            .iter()
            .map(|f| f.samples.len())
            .sum::<usize>(),
        3
    );
}

#[test]
fn a_family_keeps_its_first_type() {
    let mut sink = MetricSink::new();
    sink.gauge("x_total", "", &[("a", "1")], 1u64);
    let r = sink.push(
        MetricType::Counter,
        "x_total",
        "",
        &[("a", "2")],
        Value::U64(1),
    );
    assert_eq!(
        r,
        Err(SampleError::TypeConflict {
            name: "x_total".into(),
            first: MetricType::Gauge,
            pushed: MetricType::Counter
        })
    );
    assert_eq!(sink.families()[0].samples.len(), 1);
    assert_eq!(sink.rejected().len(), 1, "push records its rejection too");
}

#[test]
fn the_same_series_twice_is_rejected_whatever_the_label_order() {
    let mut sink = MetricSink::new();
    sink.gauge("g", "", &[("a", "1"), ("b", "2")], 1u64);
    sink.gauge("g", "", &[("b", "2"), ("a", "1")], 2u64);
    sink.with_labels(&[("a", "1")], |s| s.gauge("g", "", &[("b", "2")], 3u64));
    sink.gauge("g", "", &[("a", "1"), ("b", "3")], 4u64);
    assert_eq!(sink.families()[0].samples.len(), 2);
    assert_eq!(sink.rejected().len(), 2);
    assert_eq!(
        sink.rejected()[0].to_string(),
        "metric g: a second sample with the labels {b=\"2\",a=\"1\"}"
    );
}

#[test]
fn a_label_given_by_the_scope_and_the_sample_is_a_duplicate() {
    let mut sink = MetricSink::new();
    sink.with_labels(&[("vm", "a")], |s| s.gauge("g", "", &[("vm", "b")], 1u64));
    sink.gauge("g", "", &[("x", "1"), ("x", "2")], 1u64);
    assert_eq!(
        sink.rejected(),
        [
            SampleError::DuplicateLabel {
                metric: "g".into(),
                label: "vm".into()
            },
            SampleError::DuplicateLabel {
                metric: "g".into(),
                label: "x".into()
            },
        ]
    );
}

#[test]
fn sources_compose_and_closures_are_sources() {
    let disk = |n: &'static str| {
        Arc::new(from_fn(move |s: &mut MetricSink| {
            s.counter(
                "vmsight_block_requests_total",
                "Requests.",
                &[("disk", n)],
                7u64,
            )
        })) as Arc<dyn MetricSource>
    };
    let vm = from_fn(move |s: &mut MetricSink| {
        let disks = vec![disk("0"), disk("1")];
        s.with_labels(&[("vm", "web1")], |s| s.collect_from(&disks));
    });
    let mut sink = MetricSink::new();
    sink.collect_from(&vm);
    let f = &sink.families()[0];
    assert_eq!(f.samples.len(), 2);
    assert_eq!(
        f.samples[1].labels[0],
        ("vm".to_string(), "web1".to_string())
    );
    assert_eq!(
        f.samples[1].labels[1],
        ("disk".to_string(), "1".to_string())
    );
}

#[test]
fn value_conversions() {
    assert_eq!(Value::from(3u32), Value::U64(3));
    assert_eq!(Value::from(3usize), Value::U64(3));
    assert_eq!(Value::from(true), Value::U64(1));
    assert_eq!(Value::from(-3i64).as_f64(), -3.0);
    assert_eq!(Value::from(0.5).as_f64(), 0.5);
}
