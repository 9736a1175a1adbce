//! The Prometheus text exposition format, version 0.0.4.
//!
//! Why not `prometheus-client`'s encoder: that crate (0.25) writes OpenMetrics 1.0 text only
//! (`# EOF`, a counter's `# TYPE` line without the `_total` suffix, unit suffixes), which is not
//! the 0.0.4 format served here as `text/plain; version=0.0.4`; it does not escape `# HELP`
//! text, does not validate names, and wants every metric registered up front in its own
//! registry. vmsight collects on scrape from registries that come and go with VMs, so the
//! families are built per scrape ([`crate::MetricSink`]), and writing them is the few lines
//! below. Format reference: <https://prometheus.io/docs/instrumenting/exposition_formats/>.
//!
//! ```text
//! # HELP vmsight_block_requests_total Completed block requests.
//! # TYPE vmsight_block_requests_total counter
//! vmsight_block_requests_total{vm="web1",disk="1",kind="read"} 42
//! ```

use std::fmt::Write;

use crate::model::{MetricFamily, Value};

/// The `Content-Type` of the format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Encodes `families` (names and labels already validated) as text format 0.0.4.
pub fn encode(families: &[MetricFamily]) -> String {
    let mut out = String::new();
    for family in families {
        encode_family(&mut out, family);
    }
    out
}

/// One family: its `# HELP` and `# TYPE` lines, then one line per sample.
fn encode_family(out: &mut String, family: &MetricFamily) {
    if !family.help.is_empty() {
        out.push_str("# HELP ");
        out.push_str(&family.name);
        out.push(' ');
        out.push_str(&escape_help(&family.help));
        out.push('\n');
    }
    out.push_str("# TYPE ");
    out.push_str(&family.name);
    out.push(' ');
    out.push_str(family.kind.as_str());
    out.push('\n');
    for sample in &family.samples {
        out.push_str(&family.name);
        out.push_str(&label_set(&sample.labels));
        out.push(' ');
        out.push_str(&format_value(sample.value));
        out.push('\n');
    }
}

/// `{a="x",b="y"}`, or nothing without labels.
pub(crate) fn label_set(labels: &[(String, String)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let mut out = String::from("{");
    for (i, (name, value)) in labels.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Writing into a String cannot fail.
        let _ = write!(out, "{name}=\"{}\"", escape_label_value(value));
    }
    out.push('}');
    out
}

/// A label value with `\`, `"` and line feed escaped.
pub fn escape_label_value(value: &str) -> String {
    escape(value, true)
}

/// Help text with `\` and line feed escaped (quotes stay as they are).
pub fn escape_help(help: &str) -> String {
    escape(help, false)
}

fn escape(s: &str, quotes: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quotes => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out
}

/// A value as Go's `strconv.ParseFloat` (Prometheus' parser) reads it: integers exact,
/// floats in the shortest form that round-trips, `NaN`, `+Inf`, `-Inf`.
pub fn format_value(value: Value) -> String {
    match value {
        Value::U64(v) => v.to_string(),
        Value::I64(v) => v.to_string(),
        Value::F64(v) => format_f64(v),
    }
}

fn format_f64(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_string()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else if v == 0.0 || (1e-6..1e16).contains(&v.abs()) {
        format!("{v}")
    } else {
        // Very large or small magnitudes: exponent form instead of hundreds of digits.
        format!("{v:e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{MetricType, Sample};

    fn family(name: &str, help: &str, kind: MetricType, samples: Vec<Sample>) -> MetricFamily {
        MetricFamily {
            name: name.into(),
            help: help.into(),
            kind,
            samples,
        }
    }

    fn sample(labels: &[(&str, &str)], value: Value) -> Sample {
        Sample {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            value,
        }
    }

    #[test]
    fn label_values_escape_backslash_quote_and_line_feed() {
        assert_eq!(escape_label_value(r#"a\b"c"#), r#"a\\b\"c"#);
        assert_eq!(escape_label_value("line1\nline2"), r"line1\nline2");
        assert_eq!(escape_label_value("tab\tand é ✓"), "tab\tand é ✓");
        assert_eq!(
            escape_label_value(r"\n"),
            r"\\n",
            "a literal backslash-n stays two chars"
        );
    }

    #[test]
    fn help_escapes_backslash_and_line_feed_but_not_quotes() {
        assert_eq!(escape_help("say \"hi\"\\\nbye"), "say \"hi\"\\\\\\nbye");
    }

    #[test]
    fn a_family_is_help_type_then_samples() {
        let f = family(
            "vmsight_block_requests_total",
            "Completed requests.",
            MetricType::Counter,
            vec![
                sample(&[("vm", "a"), ("kind", "read")], Value::U64(3)),
                sample(&[("vm", "a"), ("kind", "write")], Value::U64(4)),
            ],
        );
        assert_eq!(
            encode(&[f]),
            "# HELP vmsight_block_requests_total Completed requests.\n\
             # TYPE vmsight_block_requests_total counter\n\
             vmsight_block_requests_total{vm=\"a\",kind=\"read\"} 3\n\
             vmsight_block_requests_total{vm=\"a\",kind=\"write\"} 4\n"
        );
    }

    #[test]
    fn no_labels_means_no_braces_and_no_help_means_no_help_line() {
        let f = family(
            "up_now",
            "",
            MetricType::Gauge,
            vec![sample(&[], Value::I64(-2))],
        );
        assert_eq!(encode(&[f]), "# TYPE up_now gauge\nup_now -2\n");
    }

    #[test]
    fn label_values_are_escaped_in_sample_lines() {
        let f = family(
            "g",
            "h",
            MetricType::Gauge,
            vec![sample(&[("path", "/a \"b\"\\c\nd")], Value::U64(1))],
        );
        assert!(
            encode(&[f]).contains("g{path=\"/a \\\"b\\\"\\\\c\\nd\"} 1\n"),
            "escaped"
        );
    }

    #[test]
    fn values_are_formatted_for_go_parse_float() {
        assert_eq!(format_value(Value::U64(u64::MAX)), "18446744073709551615");
        assert_eq!(format_value(Value::I64(-5)), "-5");
        assert_eq!(format_value(Value::F64(0.0)), "0");
        assert_eq!(format_value(Value::F64(1.5)), "1.5");
        assert_eq!(format_value(Value::F64(-0.25)), "-0.25");
        assert_eq!(format_value(Value::F64(1e300)), "1e300");
        assert_eq!(format_value(Value::F64(2.5e-9)), "2.5e-9");
        assert_eq!(format_value(Value::F64(f64::NAN)), "NaN");
        assert_eq!(format_value(Value::F64(f64::INFINITY)), "+Inf");
        assert_eq!(format_value(Value::F64(f64::NEG_INFINITY)), "-Inf");
        for v in [0.1, 1.0 / 3.0, 123456.789, 1e15 + 0.5, 7e-7] {
            let s = format_value(Value::F64(v));
            assert_eq!(s.parse::<f64>().ok(), Some(v), "{s} round-trips");
        }
    }
}
