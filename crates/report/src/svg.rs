//! A hand-written SVG plot of the block-lifetime CDF (Sky Figure 5): log-scale lifetime on x,
//! the fraction of all born blocks whose life ended within x on y (alive blocks keep the
//! curves below 1), one curve for all endings and one per ending kind.

use crate::lifetime::{EndKind, Lifetimes};
use std::fmt::Write as _;

const W: f64 = 760.0;
const H: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
/// Points per curve at most; longer curves are thinned evenly (the last point is kept).
const MAX_POINTS: usize = 2000;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Tick label for 10^e seconds.
fn decade_label(e: i32) -> String {
    match e {
        -9 => "1ns".into(),
        -8 => "10ns".into(),
        -7 => "100ns".into(),
        -6 => "1µs".into(),
        -5 => "10µs".into(),
        -4 => "100µs".into(),
        -3 => "1ms".into(),
        -2 => "10ms".into(),
        -1 => "100ms".into(),
        0 => "1s".into(),
        1 => "10s".into(),
        2 => "100s".into(),
        _ => format!("1e{e}s"),
    }
}

/// The plot as an SVG document.
pub fn lifetime_cdf(l: &Lifetimes, title: &str) -> String {
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">Block lifetimes (4 KiB data blocks): {}</text>"#,
        LEFT + pw / 2.0,
        esc(title)
    );
    // x range in log10 seconds, whole decades around the data (1 ms .. 10 s when empty).
    let secs = |ns: u64| (ns.max(1) as f64) / 1e9;
    let (lo, hi) = match (l.ended.first(), l.ended.last()) {
        (Some(a), Some(b)) => {
            let lo = secs(a.0).log10().floor() as i32;
            let hi = secs(b.0).log10().ceil() as i32;
            (lo, hi.max(lo + 1))
        }
        _ => (-3, 1),
    };
    let x_of = |ns: u64| {
        let v = secs(ns).log10().clamp(lo as f64, hi as f64);
        LEFT + (v - lo as f64) / (hi - lo) as f64 * pw
    };
    let y_of = |f: f64| TOP + (1.0 - f) * ph;
    // Grid, ticks and labels.
    for e in lo..=hi {
        let x = LEFT + (e - lo) as f64 / (hi - lo) as f64 * pw;
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph,
            TOP + ph + 18.0,
            decade_label(e)
        );
    }
    for i in 0..=10 {
        let f = i as f64 / 10.0;
        let y = y_of(f);
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{f:.1}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        o,
        r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">lifetime (log scale)</text>"#,
        LEFT + pw / 2.0,
        H - 18.0
    );
    let _ = writeln!(
        o,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">fraction of born blocks dead</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    // Curves.
    let series: [(&str, Option<EndKind>, &str); 5] = [
        ("any ending", None, "#000000"),
        ("overwrite", Some(EndKind::Overwrite), "#1f77b4"),
        ("discard", Some(EndKind::Discard), "#2ca02c"),
        ("unlink", Some(EndKind::Unlink), "#d62728"),
        ("truncate", Some(EndKind::Truncate), "#ff7f0e"),
    ];
    let mut legend_y = TOP + 10.0;
    for (name, kind, color) in series {
        let d = l.durations(kind);
        if d.is_empty() {
            continue;
        }
        let born = l.born.max(1) as f64;
        // Step function: at each lifetime the fraction rises by one block.
        let step = d.len().div_ceil(MAX_POINTS).max(1);
        let mut pts = format!("{:.1},{:.1}", LEFT, y_of(0.0));
        let mut prev_y = y_of(0.0);
        for (i, ns) in d.iter().enumerate() {
            if (i + 1) % step != 0 && i + 1 != d.len() {
                continue;
            }
            let x = x_of(*ns);
            let y = y_of((i + 1) as f64 / born);
            let _ = write!(pts, " {x:.1},{prev_y:.1} {x:.1},{y:.1}");
            prev_y = y;
        }
        let _ = write!(pts, " {:.1},{prev_y:.1}", LEFT + pw);
        let width = if kind.is_none() { 2.5 } else { 1.5 };
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{color}" stroke-width="{width}" points="{pts}"/>"#
        );
        let lx = LEFT + pw + 12.0;
        let _ = writeln!(
            o,
            r#"<line x1="{lx:.1}" y1="{legend_y:.1}" x2="{:.1}" y2="{legend_y:.1}" stroke="{color}" stroke-width="{width}"/><text x="{:.1}" y="{:.1}">{name} ({})</text>"#,
            lx + 20.0,
            lx + 26.0,
            legend_y + 4.0,
            d.len()
        );
        legend_y += 20.0;
    }
    let lx = LEFT + pw + 12.0;
    let _ = writeln!(
        o,
        r#"<text x="{lx:.1}" y="{:.1}">born: {}</text><text x="{lx:.1}" y="{:.1}">alive at end: {}</text>"#,
        legend_y + 10.0,
        l.born,
        legend_y + 28.0,
        l.alive.len()
    );
    if l.ended.is_empty() {
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">no block life ended in this log</text>"#,
            LEFT + pw / 2.0,
            TOP + ph / 2.0
        );
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plot_has_axes_legend_and_escaped_title() {
        let l = Lifetimes {
            born: 4,
            ended: vec![
                (2_000_000, EndKind::Overwrite),
                (3_000_000_000, EndKind::Unlink),
            ],
            alive: vec![5, 6],
        };
        let s = lifetime_cdf(&l, "a<b>&c");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("a&lt;b&gt;&amp;c"));
        // Decades from 1 ms to 10 s.
        for label in ["1ms", "10ms", "100ms", "1s", "10s"] {
            assert!(s.contains(&format!(">{label}</text>")), "{label}");
        }
        assert!(s.contains("any ending (2)"));
        assert!(s.contains("unlink (1)"));
        assert!(!s.contains("discard ("), "empty kinds have no curve");
        assert!(s.contains("alive at end: 2"));
        assert_eq!(s.matches("<polyline").count(), 3);
    }

    #[test]
    fn empty_plot_says_so() {
        let l = Lifetimes {
            born: 0,
            ended: vec![],
            alive: vec![],
        };
        let s = lifetime_cdf(&l, "x");
        assert!(s.contains("no block life ended"));
        assert_eq!(s.matches("<polyline").count(), 0);
    }
}
