//! Pure logic of the plugin (no QEMU calls): argument parsing, instruction matching, CR3
//! masking. Kept free of QEMU symbols so the tests can compile it on its own.

use std::path::PathBuf;

/// First non-canonical address above the lower (user) half on x86-64 (48-bit addressing).
pub const USER_SPACE_END: u64 = 0x0000_8000_0000_0000;
/// CR3 bits that are not part of the page-table base: PCID (11:0) and the no-flush bit (63).
pub const CR3_NON_BASE_BITS: u64 = 0xfff | (1 << 63);
/// Linux x86-64 `write(2)` number.
pub(crate) const SYS_WRITE: u32 = 1;
/// Default number of syscalls between two publications of a vCPU's scoreboard count.
pub const DEFAULT_SYNC_EVERY: u64 = 1024;

pub(crate) const USAGE: &str = "usage: -plugin libvmsight_plugin.so,shm=PATH[,records=on|off]\
                     [,peek=on|off][,sync=N][,verbose=on|off]";

/// Errors that make the plugin refuse to install.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The mandatory `shm=` argument is absent.
    #[error("The argument shm=PATH (the channel file created by vmsight) is missing.")]
    MissingShm,
    /// An argument is not `key=value`.
    #[error("The plugin argument {0:?} is not of the form key=value.")]
    Malformed(String),
    /// An argument has an unusable value.
    #[error("The plugin argument {key}={value:?} is invalid: {reason}.")]
    BadValue {
        /// Argument name.
        key: String,
        /// Its value.
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// An unknown argument.
    #[error("The plugin argument {0:?} is unknown (known: shm, records, peek, sync, verbose).")]
    Unknown(String),
    /// The channel file could not be attached.
    #[error("Cannot attach the vmsight channel: {0}")]
    Channel(#[from] vmsight_ring::Error),
    /// Loaded into user-mode QEMU.
    #[error("The plugin needs full-system emulation (qemu-system-x86_64), not user mode.")]
    NotSystemMode,
    /// Loaded into a QEMU for another architecture.
    #[error("The plugin supports only x86_64 guests, but QEMU emulates {0}.")]
    WrongTarget(String),
    /// The channel has fewer vCPU slots than the machine can have vCPUs.
    #[error(
        "The machine can have {qemu} vCPUs but the channel file has only {channel} vCPU slots; \
         create the channel with at least {qemu}."
    )]
    TooManyVcpus {
        /// QEMU's maximum vCPU count.
        qemu: i64,
        /// Slots in the channel.
        channel: u32,
    },
}

/// Parsed plugin arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Channel file (`shm=`).
    pub shm: PathBuf,
    /// Push syscall records (`records=`, default on). Off: count only.
    pub records: bool,
    /// Copy up to 32 bytes of `write(2)` buffers into records (`peek=`, default off).
    pub peek: bool,
    /// Publish scoreboard counts every this many syscalls per vCPU (`sync=`).
    pub sync_every: u64,
    /// Print a per-vCPU summary to stderr at exit (`verbose=`).
    pub verbose: bool,
}

impl Options {
    /// Parses `key=value` arguments as QEMU passes them.
    pub fn parse<'a>(args: impl IntoIterator<Item = &'a str>) -> Result<Self, PluginError> {
        let mut shm = None;
        let mut o = Options {
            shm: PathBuf::new(),
            records: true,
            peek: false,
            sync_every: DEFAULT_SYNC_EVERY,
            verbose: false,
        };
        for arg in args {
            let (k, v) = arg
                .split_once('=')
                .ok_or_else(|| PluginError::Malformed(arg.to_string()))?;
            let bad = |reason| PluginError::BadValue {
                key: k.to_string(),
                value: v.to_string(),
                reason,
            };
            let boolean = || match v {
                "on" | "yes" | "true" => Ok(true),
                "off" | "no" | "false" => Ok(false),
                _ => Err(bad("expected on or off")),
            };
            match k {
                "shm" if v.is_empty() => return Err(bad("the path is empty")),
                "shm" => shm = Some(PathBuf::from(v)),
                "records" => o.records = boolean()?,
                "peek" => o.peek = boolean()?,
                "verbose" => o.verbose = boolean()?,
                "sync" => {
                    o.sync_every = v
                        .parse::<u64>()
                        .ok()
                        .filter(|n| (1..=1 << 40).contains(n))
                        .ok_or_else(|| bad("expected an integer between 1 and 2^40"))?;
                }
                _ => return Err(PluginError::Unknown(arg.to_string())),
            }
        }
        o.shm = shm.ok_or(PluginError::MissingShm)?;
        Ok(o)
    }
}

/// True if `bytes` (one whole decoded instruction) is `syscall`: `0f 05` preceded only by
/// legacy or REX prefixes.
pub fn is_syscall_insn(bytes: &[u8]) -> bool {
    let Some((prefixes, op)) = bytes.split_last_chunk::<2>() else {
        return false;
    };
    *op == [0x0f, 0x05]
        && prefixes.iter().all(|b| {
            matches!(
                b,
                0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65 | 0x66 | 0x67 | 0xf0 | 0xf2 | 0xf3
            ) || (0x40..=0x4f).contains(b)
        })
}

/// Page-table base of a CR3 value (PCID and no-flush bits cleared).
pub fn cr3_base(cr3: u64) -> u64 {
    cr3 & !CR3_NON_BASE_BITS
}
