//! What a VM is made of: the validated form of `vmsight run`'s options.

use std::path::PathBuf;
use std::str::FromStr;

use crate::accel::AccelRequest;
use crate::stages::StageRequest;

/// A VM configuration value that is not acceptable, with the sentence the user sees.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("a disk needs a path: --disk PATH[,ro][,direct][,serial=ID][,queues=N][,io=threads|io_uring][,io_threads=N][,mount=PATH][,dedup[,meta-cache=N%|SIZE][,flush-every=N][,hints=on|off]]")]
    DiskPath,
    #[error("disk option {0}")]
    Dedup(String),
    #[error("disk serial {0:?} must be 1 to 20 ASCII characters")]
    DiskSerial(String),
    #[error("disk queues {0:?} must be a number from 1 to 16")]
    DiskQueues(String),
    #[error("disk mount point {0:?} must be an absolute guest path such as /srv")]
    DiskMount(String),
    #[error("disk io_threads {0:?} must be a number from 1 to 64")]
    DiskIoThreads(String),
    #[error("disk io={0:?} must be threads or io_uring")]
    DiskIoEngine(String),
    #[error("disk io_threads=N applies to io=threads only, not io=io_uring")]
    DiskIoThreadsWithUring,
    #[error("unknown disk option {0:?} (known: ro, rw, direct, serial=ID, queues=N, io=threads|io_uring, io_threads=N, mount=PATH, dedup, meta-cache=N%|SIZE, flush-every=N, hints=on|off)")]
    DiskOption(String),
    #[error("VM name {0:?} must be 1-48 characters of letters, digits, '-' or '_', starting with a letter or digit")]
    Name(String),
    #[error("--vcpus must be between 1 and 64, not {0}")]
    Vcpus(u32),
    #[error("--mem must be at least 128 MiB for the Debian guest, not {0} MiB")]
    MemTooSmall(u64),
    #[error("--mem {0} MiB is more than 1 TiB")]
    MemTooLarge(u64),
    #[error("memory size {0:?} is not a number of MiB (e.g. 1024, 512M, 2G)")]
    MemSyntax(String),
    #[error("at most 16 extra disks, not {0}")]
    TooManyDisks(usize),
    #[error(
        "--qemu {0:?} must be auto, system, trixie or the path of a qemu-system-x86_64 binary"
    )]
    QemuChoice(String),
}

/// One extra disk from `--disk PATH[,ro][,serial=ID][,queues=N][,direct][,io_threads=N][,mount=PATH]`.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskSpec {
    pub path: PathBuf,
    pub read_only: bool,
    /// The virtio-blk serial (GET_ID), at most 20 bytes; defaults to `vmsight-diskN`.
    pub serial: Option<String>,
    pub num_queues: Option<u16>,
    /// Bypass the host page cache (O_DIRECT), like QEMU's `cache=none`.
    pub direct: bool,
    /// Where the guest mounts this disk's file system (`mount=/srv`): the prefix of the guest
    /// paths in file-update events. vmsight cannot know guest mounts by itself; without it the
    /// paths start with `/@diskN`.
    pub mount: Option<String>,
    /// I/O threads serving the image (`io_threads=N`, 1..=64; default 4).
    pub io_threads: Option<usize>,
    /// How the image is served (`io=threads|io_uring`; default: the backend's default).
    pub io_engine: Option<vmsight_blockdev::IoEngine>,
    /// The path is a dedup volume (`dedup`, see docs/dedup.md) opened with these settings.
    pub dedup: Option<DedupSpec>,
}

/// How a dedup volume is served (`--disk VOL,dedup[,meta-cache=..][,flush-every=N][,hints=..]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DedupSpec {
    /// Metadata buffer cache: percent of the volume's metadata or a size (default 1 %).
    pub meta_cache: vmsight_dedup::MetaCache,
    /// Commit after this many block writes without a FLUSH (default 4096).
    pub flush_every: u64,
    /// Use the insight engine's copy and unique hints (default on; they need `--insights`).
    pub hints: bool,
}

impl Default for DedupSpec {
    fn default() -> Self {
        let o = vmsight_dedup::VolumeOptions::default();
        Self {
            meta_cache: o.meta_cache,
            flush_every: o.flush_every,
            hints: true,
        }
    }
}

impl FromStr for DiskSpec {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(',');
        let path = parts.next().unwrap_or_default();
        if path.is_empty() {
            return Err(ConfigError::DiskPath);
        }
        let mut spec = DiskSpec {
            path: PathBuf::from(path),
            read_only: false,
            serial: None,
            num_queues: None,
            direct: false,
            mount: None,
            io_threads: None,
            io_engine: None,
            dedup: None,
        };
        let mut dedup_opts = Vec::new();
        for opt in parts {
            if opt == "dedup" {
                spec.dedup = Some(DedupSpec::default());
            } else if ["meta-cache=", "flush-every=", "hints="]
                .iter()
                .any(|p| opt.starts_with(p))
            {
                dedup_opts.push(opt);
            } else {
                spec.apply(opt)?;
            }
        }
        if spec.io_threads.is_some() && spec.io_engine == Some(vmsight_blockdev::IoEngine::IoUring)
        {
            return Err(ConfigError::DiskIoThreadsWithUring);
        }
        match spec.dedup.as_mut() {
            Some(d) => dedup_opts.iter().try_for_each(|o| d.apply(o))?,
            None => {
                if let Some(o) = dedup_opts.first() {
                    return Err(ConfigError::Dedup(format!(
                        "{o:?} needs \"dedup\" (--disk VOL,dedup,{o})"
                    )));
                }
            }
        }
        Ok(spec)
    }
}

impl DiskSpec {
    /// Applies one `,OPTION` of `--disk`.
    fn apply(&mut self, opt: &str) -> Result<(), ConfigError> {
        match opt.split_once('=') {
            None if opt == "ro" || opt == "readonly" => self.read_only = true,
            None if opt == "rw" => self.read_only = false,
            None if opt == "direct" => self.direct = true,
            Some(("serial", v)) => {
                if v.is_empty() || v.len() > 20 || !v.is_ascii() {
                    return Err(ConfigError::DiskSerial(v.into()));
                }
                self.serial = Some(v.to_string());
            }
            Some(("queues", v)) => match v.parse::<u16>() {
                Ok(n @ 1..=16) => self.num_queues = Some(n),
                _ => return Err(ConfigError::DiskQueues(v.into())),
            },
            Some(("io_threads", v)) => match v.parse::<usize>() {
                Ok(n @ 1..=64) => self.io_threads = Some(n),
                _ => return Err(ConfigError::DiskIoThreads(v.into())),
            },
            Some(("io", v)) => {
                self.io_engine = Some(v.parse().map_err(|_| ConfigError::DiskIoEngine(v.into()))?)
            }
            Some(("mount", v)) => {
                if !v.starts_with('/') || v.contains("//") || v.contains('\0') {
                    return Err(ConfigError::DiskMount(v.into()));
                }
                self.mount = Some(v.trim_end_matches('/').to_string());
            }
            _ => return Err(ConfigError::DiskOption(opt.into())),
        }
        Ok(())
    }
}

impl DedupSpec {
    fn apply(&mut self, opt: &str) -> Result<(), ConfigError> {
        let bad = |m: String| ConfigError::Dedup(m);
        match opt.split_once('=') {
            Some(("meta-cache", v)) => {
                self.meta_cache = vmsight_dedup::MetaCache::parse(v).map_err(bad)?;
            }
            Some(("flush-every", v)) => match v.parse::<u64>() {
                Ok(n) if n > 0 => self.flush_every = n,
                _ => {
                    return Err(bad(format!(
                        "flush-every={v:?} must be a positive number of writes"
                    )))
                }
            },
            Some(("hints", "on")) => self.hints = true,
            Some(("hints", "off")) => self.hints = false,
            _ => {
                return Err(bad(format!(
                    "{opt:?} is not meta-cache=N%|SIZE, flush-every=N or hints=on|off"
                )))
            }
        }
        Ok(())
    }
}

/// Checks a VM name: it becomes a directory name, a hostname and part of event addresses.
pub fn validate_name(name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Name(name.into()))
    }
}

/// A generated name: `vm-` and 6 hex digits from the kernel's random source.
pub fn generate_name() -> String {
    let mut buf = [0u8; 3];
    let got = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut buf));
    if got.is_err() {
        // Fall back to pid and time: unique enough for a name on one host.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let v = t ^ std::process::id();
        buf = [(v >> 16) as u8, (v >> 8) as u8, v as u8];
    }
    format!("vm-{:02x}{:02x}{:02x}", buf[0], buf[1], buf[2])
}

/// Everything needed to start one VM.
#[derive(Debug, Clone)]
pub struct VmConfig {
    pub name: String,
    pub vcpus: u32,
    pub mem_mib: u64,
    /// The guest kernel; `None`: the default image's.
    pub kernel: Option<PathBuf>,
    /// The initramfs; `None`: the default image's.
    pub initrd: Option<PathBuf>,
    /// The image the root disk is made from (copied fresh unless `persist`); `None`: the
    /// default image's root file system (with `persist`, a per-name copy of it).
    pub root_image: Option<PathBuf>,
    /// Keep root-disk changes: use `root_image` in place instead of a fresh copy.
    pub persist: bool,
    /// Extra kernel command line, appended to the defaults.
    pub append: Vec<String>,
    pub disks: Vec<DiskSpec>,
    /// The command to run in the guest; `None` means an interactive console.
    pub command: Option<Vec<String>>,
    pub accel: AccelRequest,
    /// Which QEMU runs the VM (`--qemu`, else `$VMSIGHT_QEMU`, else auto).
    pub qemu: crate::qemu::QemuChoice,
    /// Multi- or single-threaded TCG (`--tcg-threads`; `auto`, the default, is single-threaded
    /// only on a QEMU with the TCG section race).
    pub tcg_threads: crate::qemu::TcgThreads,
    /// Who QEMU and virtiofsd run as (`--run-as`; auto: a VM identity of their own when
    /// vmsight runs as root; docs/security.md).
    pub run_as: crate::confine::RunAs,
    /// QEMU's own seccomp filter (`-sandbox`, on unless `--qemu-sandbox off`).
    pub qemu_sandbox: bool,
    /// Load the vmsight TCG plugin (on by default under TCG).
    pub plugin: bool,
    /// Let the plugin push one record per syscall into the ring (for tracing and benchmarks).
    pub plugin_records: bool,
    /// Print counters at exit.
    pub stats: bool,
    /// Have the plugin count `syscall` instructions (`--count-syscalls`). Without it, and with
    /// nothing else asked of the plugin, the plugin is dormant: it registers no translation
    /// callback, so the guest runs as without a plugin (docs/plugin.md).
    pub count_syscalls: bool,
    /// Copy the guest console to stderr as it arrives.
    pub show_console: bool,
    /// Where to keep the console log (always written in the runtime directory too).
    pub console_log: Option<PathBuf>,
    /// How long a VM that runs a command may take to report `ready` before vmsight stops it
    /// (`--boot-timeout`; `None`: no limit). Interactive consoles have no limit.
    pub boot_timeout: Option<std::time::Duration>,
    /// Syscall tracing (`--trace*`); needs the plugin and the kernel profile.
    pub trace: Option<crate::trace::TraceConfig>,
    /// The guest kernel's profile (symbols and struct offsets), for task identification;
    /// `None`: the default image's, when the default image is used.
    pub profile: Option<PathBuf>,
    /// File-update streaming (write taps, recording, inference, delivery).
    pub stream: crate::stream::StreamConfig,
    /// Block stages requested by name (`--stage NAME:OPTIONS`, or the cache and disk-model
    /// flags); stages that belong to a feature (classifier, write tap) follow that feature.
    pub stages: Vec<StageRequest>,
    /// Serve Prometheus metrics on this address (`--metrics ADDR`).
    pub metrics: Option<String>,
    /// Storage insights (`--insights FILE`): classify every block request (Sky §3.3-3.6).
    pub insights: Option<InsightSettings>,
    /// FoxyIdle (`--background`, `--idle*`): hold background processes' reads.
    pub idle: Option<IdleSettings>,
    /// The NIC (`--net`, `--net-pcap`, `--foxyvegas*`).
    pub net: crate::net::NetSettings,
    /// `--shared-mem`: Hylics' shared in-memory file system.
    pub share: Option<crate::hylics::ShareSpec>,
    /// `--hylics-slo`: the controller sizing the share (needs `share`).
    pub slo: Option<crate::hylics::SloSpec>,
    /// `--symbiotic`: the symbiotic interface (fw_cfg item, ivshmem-doorbell device served by
    /// vmsight, guest module loaded at boot; docs/symbiotic.md).
    pub symbiotic: bool,
    /// `--swap`: the swap disk vmsight serves with its swap cache (SwapBypass,
    /// docs/swapbypass.md); shared with the guest module when `symbiotic` is on.
    pub swap: Option<crate::swap::SwapSpec>,
}

/// What `--background`, `--idle`, `--idle-interval`, `--idle-max-hold` and `--idle-log` ask
/// for (FoxyIdle, docs/foxyidle.md).
#[derive(Debug, Clone)]
pub struct IdleSettings {
    /// The idle scheduler's timing.
    pub scheduler: vmsight_blockdev::stages::idle::IdleConfig,
    /// Processes marked background from the start (`@cmd`: the command run).
    pub background: Vec<crate::trace::TraceTarget>,
    /// One JSON line per read/write request started by the idle stage.
    pub log: Option<PathBuf>,
}

/// What `--insights`, `--insight-target` and `--insight-paths` ask for.
#[derive(Debug, Clone)]
pub struct InsightSettings {
    /// Where the per-request classification records go (JSON lines).
    pub file: PathBuf,
    /// Which guest processes are monitored for insights (as `--trace TARGET`).
    pub target: crate::trace::TraceTarget,
    /// Only files under these guest path prefixes are followed (empty: all).
    pub paths: Vec<String>,
}

impl VmConfig {
    /// Checks value ranges; file existence is checked when the VM starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_name(&self.name)?;
        if self.vcpus == 0 || self.vcpus > 64 {
            return Err(ConfigError::Vcpus(self.vcpus));
        }
        if self.mem_mib < 128 {
            return Err(ConfigError::MemTooSmall(self.mem_mib));
        }
        if self.mem_mib > 1024 * 1024 {
            return Err(ConfigError::MemTooLarge(self.mem_mib));
        }
        if self.disks.len() > 16 {
            return Err(ConfigError::TooManyDisks(self.disks.len()));
        }
        Ok(())
    }
}

/// Parses a memory size such as `1024`, `512M`, `2G` into MiB.
pub fn parse_mem_mib(s: &str) -> Result<u64, ConfigError> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'G' | 'g')) => (&s[..i], 1024),
        Some((i, 'M' | 'm')) => (&s[..i], 1),
        _ => (s, 1),
    };
    let n: u64 = num.parse().map_err(|_| ConfigError::MemSyntax(s.into()))?;
    n.checked_mul(mult)
        .ok_or_else(|| ConfigError::MemTooLarge(n.saturating_mul(mult)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_spec_parses_options() {
        let d: DiskSpec = "/tmp/a.img,ro,serial=data1,queues=2,direct"
            .parse()
            .unwrap();
        assert!(d.direct);
        assert_eq!(d.path, PathBuf::from("/tmp/a.img"));
        assert!(d.read_only);
        assert_eq!(d.serial.as_deref(), Some("data1"));
        assert_eq!(d.num_queues, Some(2));
        let d: DiskSpec = "x.img".parse().unwrap();
        assert!(!d.read_only && d.serial.is_none());
    }

    #[test]
    fn disk_spec_rejects_bad_options() {
        assert!("".parse::<DiskSpec>().is_err());
        assert!("a.img,bogus".parse::<DiskSpec>().is_err());
        assert!("a.img,serial=".parse::<DiskSpec>().is_err());
        assert!("a.img,serial=012345678901234567890"
            .parse::<DiskSpec>()
            .is_err());
        assert!("a.img,queues=0".parse::<DiskSpec>().is_err());
        assert!("a.img,queues=x".parse::<DiskSpec>().is_err());
        assert_eq!(
            "a.img,io_threads=1"
                .parse::<DiskSpec>()
                .map(|d| d.io_threads),
            Ok(Some(1))
        );
        assert!("a.img,io_threads=0".parse::<DiskSpec>().is_err());
        let d: DiskSpec = "vol,dedup,meta-cache=10%,flush-every=64,hints=off"
            .parse()
            .unwrap();
        let dd = d.dedup.unwrap();
        assert_eq!(dd.meta_cache, vmsight_dedup::MetaCache::Percent(10.0));
        assert_eq!((dd.flush_every, dd.hints), (64, false));
        let d: DiskSpec = "vol,meta-cache=4MiB,dedup".parse().unwrap();
        assert_eq!(
            d.dedup.unwrap().meta_cache,
            vmsight_dedup::MetaCache::Bytes(4 << 20)
        );
        let e = "vol,meta-cache=4MiB"
            .parse::<DiskSpec>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs \"dedup\""), "{e}");
        assert!("vol,dedup,meta-cache=0%".parse::<DiskSpec>().is_err());
        assert!("vol,dedup,hints=maybe".parse::<DiskSpec>().is_err());
        assert!("a.img,io_threads=65".parse::<DiskSpec>().is_err());
        assert_eq!(
            "a.img,io=io_uring".parse::<DiskSpec>().map(|d| d.io_engine),
            Ok(Some(vmsight_blockdev::IoEngine::IoUring))
        );
        assert_eq!(
            "a.img,io=threads,io_threads=2"
                .parse::<DiskSpec>()
                .map(|d| (d.io_engine, d.io_threads)),
            Ok((Some(vmsight_blockdev::IoEngine::Threads), Some(2)))
        );
        assert_eq!(
            "a.img,io=aio".parse::<DiskSpec>(),
            Err(ConfigError::DiskIoEngine("aio".into()))
        );
        assert_eq!(
            "a.img,io_threads=2,io=io_uring".parse::<DiskSpec>(),
            Err(ConfigError::DiskIoThreadsWithUring)
        );
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("web1").is_ok());
        assert!(validate_name("a_b-c").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("-x").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name(&"x".repeat(49)).is_err());
        let g = generate_name();
        assert!(validate_name(&g).is_ok(), "{g}");
    }

    #[test]
    fn memory_sizes_parse() {
        assert_eq!(parse_mem_mib("1024").unwrap(), 1024);
        assert_eq!(parse_mem_mib("512M").unwrap(), 512);
        assert_eq!(parse_mem_mib("2G").unwrap(), 2048);
        assert!(parse_mem_mib("lots").is_err());
        assert!(parse_mem_mib("G").is_err());
    }
}
