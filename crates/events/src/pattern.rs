//! Channel patterns: `host:vm:/guest/path/glob` (Gamma-Ray Table I).
//!
//! Glob semantics, per field:
//! - `?` matches one character other than `/`;
//! - `*` matches any run of characters other than `/` (so it stays within one path component);
//! - `**` matches any run of characters including `/`; written as a whole component followed by
//!   a slash (`/var/**/x`) it also matches zero components (`/var/x`);
//! - `\c` matches `c` literally; every other character matches itself.
//!
//! A pattern with fewer fields is completed with `*` on the left: `/etc/*` means `*:*:/etc/*`
//! and `web1:/etc/*` means `*:web1:/etc/*`. The path field must be absolute, or `*` / `**`,
//! which both mean every path. Host and VM names never contain `:` (VM names are letters,
//! digits, `-` and `_`), so a pattern splits at its first two colons and the path may contain
//! colons.

use std::fmt;

/// Why a pattern was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    /// Empty pattern.
    #[error("the pattern is empty")]
    Empty,
    /// The path field is neither absolute nor `*`/`**`.
    #[error("pattern {0:?}: the path must start with '/' (or be '*' or '**')")]
    RelativePath(String),
    /// A host or VM field is empty.
    #[error("pattern {0:?}: the host and VM fields must not be empty (use '*')")]
    EmptyField(String),
    /// A backslash at the end of a field.
    #[error("pattern {0:?}: a trailing '\\' escapes nothing")]
    TrailingEscape(String),
    /// Longer than [`MAX_PATTERN_LEN`].
    #[error("pattern is longer than {MAX_PATTERN_LEN} bytes")]
    TooLong,
}

/// Longest accepted pattern, in bytes.
pub const MAX_PATTERN_LEN: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Lit(char),
    /// `?`
    One,
    /// `*`
    Star,
    /// `**`
    Any,
    /// `**/` at the start of a component: empty, or anything ending in `/`.
    Dirs,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Glob {
    toks: Vec<Tok>,
}

impl Glob {
    fn parse(field: &str, whole: &str) -> Result<Glob, PatternError> {
        let chars: Vec<char> = field.chars().collect();
        let mut toks = Vec::with_capacity(chars.len());
        let mut i = 0;
        while i < chars.len() {
            match chars[i] {
                '\\' => {
                    let c = *chars
                        .get(i + 1)
                        .ok_or_else(|| PatternError::TrailingEscape(whole.to_string()))?;
                    toks.push(Tok::Lit(c));
                    i += 2;
                }
                '?' => {
                    toks.push(Tok::One);
                    i += 1;
                }
                '*' => {
                    let mut n = 0;
                    while chars.get(i + n) == Some(&'*') {
                        n += 1;
                    }
                    let at_component_start = i == 0 || chars[i - 1] == '/';
                    if n >= 2 && at_component_start && chars.get(i + n) == Some(&'/') {
                        toks.push(Tok::Dirs);
                        i += n + 1;
                    } else {
                        toks.push(if n >= 2 { Tok::Any } else { Tok::Star });
                        i += n;
                    }
                }
                c => {
                    toks.push(Tok::Lit(c));
                    i += 1;
                }
            }
        }
        Ok(Glob { toks })
    }

    fn matches(&self, text: &str) -> bool {
        let t: Vec<char> = text.chars().collect();
        // can[j]: the tokens so far can consume exactly t[..j]. O(tokens × text).
        let mut can = vec![false; t.len() + 1];
        can[0] = true;
        for tok in &self.toks {
            let mut next = vec![false; t.len() + 1];
            match tok {
                Tok::Lit(c) => {
                    for j in 0..t.len() {
                        next[j + 1] = can[j] && t[j] == *c;
                    }
                }
                Tok::One => {
                    for j in 0..t.len() {
                        next[j + 1] = can[j] && t[j] != '/';
                    }
                }
                Tok::Star => {
                    let mut run = false;
                    for j in 0..=t.len() {
                        run = can[j] || (run && j > 0 && t[j - 1] != '/');
                        next[j] = run;
                    }
                }
                Tok::Any => {
                    let mut run = false;
                    for j in 0..=t.len() {
                        run = run || can[j];
                        next[j] = run;
                    }
                }
                Tok::Dirs => {
                    let mut seen = false;
                    for j in 0..=t.len() {
                        // Reachable with nothing consumed, or any earlier start then a `/`.
                        next[j] = can[j] || (seen && j > 0 && t[j - 1] == '/');
                        seen = seen || can[j];
                    }
                }
            }
            can = next;
        }
        can[t.len()]
    }

    fn is_everything(&self) -> bool {
        matches!(self.toks.as_slice(), [Tok::Any]) || matches!(self.toks.as_slice(), [Tok::Star])
    }

    fn redis(&self, out: &mut String) {
        for tok in &self.toks {
            match tok {
                Tok::Lit(c) => {
                    if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                        out.push('\\');
                    }
                    out.push(*c);
                }
                Tok::One => out.push('?'),
                // Redis `*` crosses `/`; several in a row are harmless but collapse them.
                Tok::Star | Tok::Any | Tok::Dirs => {
                    if !out.ends_with('*') || out.ends_with("\\*") {
                        out.push('*');
                    }
                }
            }
        }
    }
}

/// A subscription pattern over channels `host:vm:/guest/path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    source: String,
    host: Glob,
    vm: Glob,
    path: Glob,
    all_paths: bool,
}

impl Pattern {
    /// Parses `host:vm:/path`, `vm:/path` or `/path` (see the module documentation).
    pub fn parse(s: &str) -> Result<Pattern, PatternError> {
        if s.is_empty() {
            return Err(PatternError::Empty);
        }
        if s.len() > MAX_PATTERN_LEN {
            return Err(PatternError::TooLong);
        }
        let (host, vm, path) = if s.starts_with('/') || s == "*" || s == "**" {
            ("*", "*", s)
        } else {
            let mut it = s.splitn(3, ':');
            match (it.next(), it.next(), it.next()) {
                (Some(h), Some(v), Some(p)) => (h, v, p),
                (Some(v), Some(p), None) => ("*", v, p),
                _ => return Err(PatternError::RelativePath(s.to_string())),
            }
        };
        if host.is_empty() || vm.is_empty() {
            return Err(PatternError::EmptyField(s.to_string()));
        }
        if !(path.starts_with('/') || path == "*" || path == "**") {
            return Err(PatternError::RelativePath(s.to_string()));
        }
        let path_glob = Glob::parse(path, s)?;
        Ok(Pattern {
            source: format!("{host}:{vm}:{path}"),
            host: Glob::parse(host, s)?,
            vm: Glob::parse(vm, s)?,
            all_paths: path_glob.is_everything(),
            path: path_glob,
        })
    }

    /// A pattern matching every channel (`*:*:**`).
    pub fn everything() -> Pattern {
        // The literal is valid by construction; fall back to building it by hand anyway.
        Pattern::parse("*:*:**").unwrap_or_else(|_| Pattern {
            source: "*:*:**".into(),
            host: Glob {
                toks: vec![Tok::Any],
            },
            vm: Glob {
                toks: vec![Tok::Any],
            },
            path: Glob {
                toks: vec![Tok::Any],
            },
            all_paths: true,
        })
    }

    /// Whether the pattern can match anything on VM `vm` of host `host` (used to skip VMs).
    pub fn matches_vm(&self, host: &str, vm: &str) -> bool {
        self.host.matches(host) && self.vm.matches(vm)
    }

    /// Whether the channel of an event at `path` on `host`/`vm` matches.
    pub fn matches(&self, host: &str, vm: &str, path: &str) -> bool {
        self.matches_vm(host, vm) && (self.all_paths || self.path.matches(path))
    }

    /// Whether a full channel name `host:vm:/path` matches.
    pub fn matches_channel(&self, channel: &str) -> bool {
        let mut it = channel.splitn(3, ':');
        match (it.next(), it.next(), it.next()) {
            (Some(h), Some(v), Some(p)) => self.matches(h, v, p),
            _ => false,
        }
    }

    /// The same pattern as a Redis `PSUBSCRIBE` glob.
    ///
    /// Redis' `*` also matches `/` and `:`, so the Redis pattern matches a superset of the
    /// channels this pattern matches: `*:*:/var/log/*` also receives `/var/log/apt/history.log`
    /// from Redis. Subscribers that need the exact semantics filter again with
    /// [`Pattern::matches_channel`]. `?` and literals translate exactly (Redis specials are
    /// escaped), and `**`/`**/` become `*`.
    pub fn to_redis_glob(&self) -> String {
        let mut out = String::new();
        self.host.redis(&mut out);
        out.push(':');
        self.vm.redis(&mut out);
        out.push(':');
        if self.all_paths {
            out.push('*');
        } else {
            self.path.redis(&mut out);
        }
        out
    }

    /// The normalised text form, always with three fields.
    pub fn as_str(&self) -> &str {
        &self.source
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

impl std::str::FromStr for Pattern {
    type Err = PatternError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Pattern::parse(s)
    }
}

/// Whether any of `patterns` matches (an empty list matches everything).
pub fn any_matches(patterns: &[Pattern], host: &str, vm: &str, path: &str) -> bool {
    patterns.is_empty() || patterns.iter().any(|p| p.matches(host, vm, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, ch: &str) -> bool {
        Pattern::parse(p).unwrap().matches_channel(ch)
    }

    #[test]
    fn gamma_ray_table_one() {
        assert!(m("*:*:/var/log/*", "gs9671:test:/var/log/syslog"));
        assert!(m("*:*:/var/log/*", "otherhost:web1:/var/log/auth.log"));
        assert!(!m("*:*:/var/log/*", "h:v:/var/log/apt/history.log"));
        assert!(!m("*:*:/var/log/*", "h:v:/var/logs"));
        assert!(m("gs9671:test:/var/log/*", "gs9671:test:/var/log/syslog"));
        assert!(!m("gs9671:test:/var/log/*", "gs9671:prod:/var/log/syslog"));
        assert!(m(
            "gs9671:*:/var/log/auth.log",
            "gs9671:a:/var/log/auth.log"
        ));
        assert!(!m(
            "gs9671:*:/var/log/auth.log",
            "gs9672:a:/var/log/auth.log"
        ));
        assert!(m("myhost:web1:/etc/passwd", "myhost:web1:/etc/passwd"));
        assert!(!m("myhost:web1:/etc/passwd", "myhost:web1:/etc/passwd-"));
    }

    #[test]
    fn star_stays_in_component_double_star_crosses() {
        assert!(m("/var/*/x", "h:v:/var/a/x"));
        assert!(!m("/var/*/x", "h:v:/var/a/b/x"));
        assert!(m("/var/**", "h:v:/var/a/b/x"));
        assert!(m("/var/**/x", "h:v:/var/a/b/x"));
        assert!(m("/var/**/x", "h:v:/var/x"), "**/ matches zero components");
        assert!(!m("/var/**/x", "h:v:/var/ax"));
        assert!(m("/var/l**", "h:v:/var/log/syslog"));
        assert!(m("/*.conf", "h:v:/a.conf"));
        assert!(!m("/*.conf", "h:v:/etc/a.conf"));
        assert!(m("/**.conf", "h:v:/etc/a.conf"));
    }

    #[test]
    fn question_mark_and_escapes() {
        assert!(m("/tmp/?", "h:v:/tmp/a"));
        assert!(!m("/tmp/?", "h:v:/tmp/ab"));
        assert!(!m("/tmp?a", "h:v:/tmp/a"));
        assert!(m(r"/tmp/\*", "h:v:/tmp/*"));
        assert!(!m(r"/tmp/\*", "h:v:/tmp/a"));
        assert!(m("/a[1]", "h:v:/a[1]"), "brackets are literal");
    }

    #[test]
    fn fewer_fields_default_to_star() {
        let p = Pattern::parse("/etc/*").unwrap();
        assert_eq!(p.as_str(), "*:*:/etc/*");
        assert!(p.matches("any", "vm", "/etc/passwd"));
        let p = Pattern::parse("web1:/etc/*").unwrap();
        assert_eq!(p.as_str(), "*:web1:/etc/*");
        assert!(p.matches("h", "web1", "/etc/hosts"));
        assert!(!p.matches("h", "web2", "/etc/hosts"));
        for all in ["*", "**", "*:*:*", "h:v:**"] {
            let p = Pattern::parse(all).unwrap();
            assert!(p.matches("h", "v", "/a/b/c"), "{all}");
        }
    }

    #[test]
    fn paths_may_contain_colons() {
        assert!(m("h:v:/a:b/*", "h:v:/a:b/c"));
        assert!(!m("h:v:/a:b/*", "h:v:/a:c/c"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert_eq!(Pattern::parse(""), Err(PatternError::Empty));
        assert!(matches!(
            Pattern::parse("etc/passwd"),
            Err(PatternError::RelativePath(_))
        ));
        assert!(matches!(
            Pattern::parse("h:v:etc"),
            Err(PatternError::RelativePath(_))
        ));
        assert!(matches!(
            Pattern::parse("::/etc"),
            Err(PatternError::EmptyField(_))
        ));
        assert!(matches!(
            Pattern::parse("/etc\\"),
            Err(PatternError::TrailingEscape(_))
        ));
        assert_eq!(
            Pattern::parse(&"/".repeat(MAX_PATTERN_LEN + 1)),
            Err(PatternError::TooLong)
        );
    }

    #[test]
    fn redis_globs() {
        let r = |p: &str| Pattern::parse(p).unwrap().to_redis_glob();
        assert_eq!(r("*:*:/var/log/*"), "*:*:/var/log/*");
        assert_eq!(r("myhost:web1:/etc/passwd"), "myhost:web1:/etc/passwd");
        assert_eq!(r("/etc/*"), "*:*:/etc/*");
        assert_eq!(r("/var/**/x"), "*:*:/var/*x");
        assert_eq!(r("/tmp/?"), "*:*:/tmp/?");
        assert_eq!(r(r"/a[1]/\*"), r"*:*:/a\[1\]/\*");
        assert_eq!(r("**"), "*:*:*");
    }

    #[test]
    fn long_inputs_stay_polynomial() {
        let p = Pattern::parse(&format!("/{}b", "*a".repeat(40))).unwrap();
        let path = format!("/{}", "a".repeat(2000));
        assert!(!p.matches("h", "v", &path));
    }
}
