//! Validity of metric and label names, as the Prometheus data model defines them.
//!
//! Only the classic (pre-UTF-8) character sets are accepted: every Prometheus server version
//! and every exposition-format parser understands them, quoting is never needed, and names
//! stay usable unquoted in PromQL.

/// Whether `name` is a valid metric name: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
pub fn is_valid_metric_name(name: &str) -> bool {
    is_identifier(name, |c| c == ':')
}

/// Whether `name` is a valid label name: `[a-zA-Z_][a-zA-Z0-9_]*`. Names starting with `__`
/// are valid but reserved for Prometheus itself; see [`is_reserved_label_name`].
pub fn is_valid_label_name(name: &str) -> bool {
    is_identifier(name, |_| false)
}

/// Whether `name` is reserved for Prometheus' internal use (starts with `__`).
pub fn is_reserved_label_name(name: &str) -> bool {
    name.starts_with("__")
}

/// Non-empty, first character a letter, `_` or `extra`, the rest also digits.
fn is_identifier(name: &str, extra: impl Fn(char) -> bool) -> bool {
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return false;
    };
    let word = |c: char| c.is_ascii_alphabetic() || c == '_' || extra(c);
    word(first) && chars.all(|c| word(c) || c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_follow_the_data_model() {
        for ok in [
            "a",
            "_x",
            "vmsight_block_requests_total",
            "ns:rule:rate5m",
            "A9_",
        ] {
            assert!(is_valid_metric_name(ok), "{ok}");
        }
        for bad in ["", "9a", "a-b", "a b", "a.b", "é", "a{b}", "a\"", "a\n"] {
            assert!(!is_valid_metric_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn label_names_follow_the_data_model() {
        for ok in ["vm", "disk", "_x", "a9", "__name__"] {
            assert!(is_valid_label_name(ok), "{ok}");
        }
        for bad in ["", "9a", "a:b", "a-b", "a b", "é"] {
            assert!(!is_valid_label_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn double_underscore_labels_are_reserved() {
        assert!(is_reserved_label_name("__name__"));
        assert!(is_reserved_label_name("__x"));
        assert!(!is_reserved_label_name("_x"));
        assert!(!is_reserved_label_name("vm"));
    }
}
