//! `--shared-mem SIZE[,path=DIR][,cache=MODE][,writeback=on|off][,threads=N]`: what the user
//! asked for the VM's share.

use std::str::FromStr;

/// The smallest share (tmpfs rounds to pages; below this nothing useful fits).
pub const MIN_SIZE: u64 = 1 << 20;
/// The largest share accepted (tmpfs pages are only used when written, but a limit beyond any
/// host's memory is a typo).
pub const MAX_SIZE: u64 = 1 << 40;
/// Where the guest mounts the share unless `path=` says otherwise.
pub const DEFAULT_GUEST_PATH: &str = "/hylics";
/// The virtio-fs tag of the share.
pub const TAG: &str = "vmsight-hylics";

/// Guest directories a share may not cover (the guest's init needs them as they are).
const RESERVED: [&str; 12] = [
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr",
    "/var",
];

/// virtiofsd's cache policy for the guest's page and attribute caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// Cache, revalidate on open and after a second (virtiofsd's default).
    Auto,
    /// Cache without revalidation (fastest; host-side changes may stay unseen).
    Always,
    /// No caching: every access goes to the host (host-side changes are seen at once).
    Never,
    /// Cache metadata only.
    Metadata,
}

impl CacheMode {
    /// The name virtiofsd's `--cache` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheMode::Auto => "auto",
            CacheMode::Always => "always",
            CacheMode::Never => "never",
            CacheMode::Metadata => "metadata",
        }
    }
}

/// The VM's share as asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareSpec {
    /// tmpfs size limit, bytes.
    pub size: u64,
    /// The guest's mount point.
    pub guest_path: String,
    pub cache: CacheMode,
    /// The guest's FUSE writeback cache (virtiofsd `--writeback`): writes are gathered in the
    /// guest's page cache and reach the share in large requests.
    pub writeback: bool,
    /// virtiofsd's worker threads (`--thread-pool-size`; 0: requests are served on the queue's
    /// own thread, virtiofsd's default).
    pub threads: u16,
}

/// The most virtiofsd worker threads `threads=` accepts.
pub const MAX_THREADS: u16 = 64;

/// Why `--shared-mem` (or a resize) is not usable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShareSpecError {
    #[error("{0:?} is not a size (digits with an optional K, M, G or T suffix)")]
    Size(String),
    #[error("a share of {0} bytes is out of range (1 MiB to 1 TiB)")]
    Range(u64),
    #[error(
        "the guest path {0:?} must be absolute, without `..`, spaces or commas, and not the root"
    )]
    Path(String),
    #[error("the guest path {0:?} would cover a system directory of the guest")]
    Reserved(String),
    #[error("unknown cache mode {0:?} (auto, always, never, metadata)")]
    Cache(String),
    #[error("writeback must be on or off, not {0:?}")]
    Writeback(String),
    #[error("threads must be a number from 0 to {MAX_THREADS}, not {0:?}")]
    Threads(String),
    #[error("unknown option {0:?} (path=DIR, cache=MODE, writeback=on|off, threads=N)")]
    Option(String),
}

/// Parses a share size such as `256M` and checks its range.
pub fn parse_size(s: &str) -> Result<u64, ShareSpecError> {
    let bytes =
        vmsight_dedup::volume::parse_size(s).ok_or_else(|| ShareSpecError::Size(s.to_owned()))?;
    check_size(bytes)?;
    Ok(bytes)
}

/// Checks that a share size is in range.
pub fn check_size(bytes: u64) -> Result<(), ShareSpecError> {
    if !(MIN_SIZE..=MAX_SIZE).contains(&bytes) {
        return Err(ShareSpecError::Range(bytes));
    }
    Ok(())
}

fn parse_guest_path(p: &str) -> Result<String, ShareSpecError> {
    let ok_chars = p
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '-' | '_' | '.'));
    let trimmed = p.trim_end_matches('/');
    if !p.starts_with('/')
        || !ok_chars
        || trimmed.is_empty()
        || trimmed.split('/').any(|c| c == ".." || c == ".")
        || trimmed.contains("//")
    {
        return Err(ShareSpecError::Path(p.to_owned()));
    }
    if RESERVED
        .iter()
        .any(|r| trimmed == *r || trimmed.starts_with(&format!("{r}/")))
    {
        return Err(ShareSpecError::Reserved(p.to_owned()));
    }
    Ok(trimmed.to_owned())
}

impl FromStr for CacheMode {
    type Err = ShareSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "auto" => CacheMode::Auto,
            "always" => CacheMode::Always,
            "never" => CacheMode::Never,
            "metadata" => CacheMode::Metadata,
            _ => return Err(ShareSpecError::Cache(s.to_owned())),
        })
    }
}

impl FromStr for ShareSpec {
    type Err = ShareSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(',');
        let size = parse_size(parts.next().unwrap_or_default())?;
        let mut spec = ShareSpec {
            size,
            guest_path: DEFAULT_GUEST_PATH.to_owned(),
            cache: CacheMode::Auto,
            writeback: false,
            threads: 0,
        };
        for opt in parts {
            match opt.split_once('=') {
                Some(("path", p)) => spec.guest_path = parse_guest_path(p)?,
                Some(("cache", c)) => spec.cache = c.parse()?,
                Some(("writeback", w)) => spec.writeback = parse_on_off(w)?,
                Some(("threads", n)) => spec.threads = parse_threads(n)?,
                _ => return Err(ShareSpecError::Option(opt.to_owned())),
            }
        }
        Ok(spec)
    }
}

/// `writeback=on|off`.
fn parse_on_off(s: &str) -> Result<bool, ShareSpecError> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(ShareSpecError::Writeback(s.to_owned())),
    }
}

/// `threads=N`, at most [`MAX_THREADS`].
fn parse_threads(s: &str) -> Result<u16, ShareSpecError> {
    s.parse::<u16>()
        .ok()
        .filter(|n| *n <= MAX_THREADS)
        .ok_or_else(|| ShareSpecError::Threads(s.to_owned()))
}

impl ShareSpec {
    /// The guest kernel parameter the image's init reads: `vmsight.share=TAG:PATH`.
    pub fn guest_cmdline(&self) -> String {
        format!("vmsight.share={TAG}:{}", self.guest_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_alone_mounts_at_hylics_with_the_auto_cache() {
        let s: ShareSpec = "256M".parse().expect("parses");
        assert_eq!(s.size, 256 << 20);
        assert_eq!(s.guest_path, "/hylics");
        assert_eq!(s.cache, CacheMode::Auto);
        assert!(!s.writeback);
        assert_eq!(s.threads, 0);
        assert_eq!(s.guest_cmdline(), "vmsight.share=vmsight-hylics:/hylics");
    }

    #[test]
    fn writeback_and_threads_are_virtiofsd_options() {
        let s: ShareSpec = "64M,writeback=on,threads=4".parse().expect("parses");
        assert!(s.writeback);
        assert_eq!(s.threads, 4);
        let s: ShareSpec = "64M,writeback=off,threads=0".parse().expect("parses");
        assert!(!s.writeback);
        assert_eq!(s.threads, 0);
    }

    #[test]
    fn options_set_the_path_and_the_cache() {
        let s: ShareSpec = "1G,path=/srv/media/,cache=never".parse().expect("parses");
        assert_eq!(s.size, 1 << 30);
        assert_eq!(s.guest_path, "/srv/media");
        assert_eq!(s.cache, CacheMode::Never);
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        for (bad, want) in [
            ("", ShareSpecError::Size(String::new())),
            ("lots", ShareSpecError::Size("lots".into())),
            ("12Q", ShareSpecError::Size("12Q".into())),
            ("4K", ShareSpecError::Range(4096)),
            ("2T", ShareSpecError::Range(2 << 40)),
            ("64M,path=rel", ShareSpecError::Path("rel".into())),
            ("64M,path=/", ShareSpecError::Path("/".into())),
            (
                "64M,path=/a/../etc",
                ShareSpecError::Path("/a/../etc".into()),
            ),
            ("64M,path=/a b", ShareSpecError::Path("/a b".into())),
            ("64M,path=/etc", ShareSpecError::Reserved("/etc".into())),
            (
                "64M,path=/usr/share",
                ShareSpecError::Reserved("/usr/share".into()),
            ),
            (
                "64M,cache=sometimes",
                ShareSpecError::Cache("sometimes".into()),
            ),
            ("64M,size=3", ShareSpecError::Option("size=3".into())),
            ("64M,writeback=yes", ShareSpecError::Writeback("yes".into())),
            ("64M,threads=65", ShareSpecError::Threads("65".into())),
            ("64M,threads=-1", ShareSpecError::Threads("-1".into())),
            ("64M,writeback", ShareSpecError::Option("writeback".into())),
        ] {
            assert_eq!(bad.parse::<ShareSpec>(), Err(want), "{bad:?}");
        }
    }

    #[test]
    fn paths_that_only_look_reserved_are_allowed() {
        let s: ShareSpec = "8M,path=/variable".parse().expect("parses");
        assert_eq!(s.guest_path, "/variable");
        let s: ShareSpec = "8M,path=/srv/x".parse().expect("parses");
        assert_eq!(s.guest_path, "/srv/x");
    }
}
