//! Choosing QEMU and building its command line.
//!
//! Which QEMU runs a VM is the user's [`QemuChoice`] (`--qemu`, or `$VMSIGHT_QEMU`), resolved
//! once into a [`Qemu`]: how to start it, its version and the TCG plugin API it speaks
//! (docs/platforms.md). The arguments are built by a pure function from a [`QemuPlan`], so they
//! can be unit-tested; the whole command is saved as `qemu.cmdline` in the runtime directory.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

pub use vmsight_proto::layout::{QemuInfo, QemuKind};

use crate::accel::Accel;
use crate::config::ConfigError;
use crate::error::LaunchError;

/// Names of the virtio-serial ports the guest init looks for (docs/guest-protocol.md).
pub const PORT_CTL: &str = "vmsight.ctl";
pub const PORT_STDOUT: &str = "vmsight.stdout";
pub const PORT_STDERR: &str = "vmsight.stderr";
pub const PORT_STDIN: &str = "vmsight.stdin";
/// fw_cfg entry holding the command script.
pub const FW_CFG_CMD: &str = "opt/vmsight/cmd";
/// fw_cfg entry that turns on hold mode (report `cmdpid`, wait for `go`).
pub const FW_CFG_HOLD: &str = "opt/vmsight/hold";

/// The environment variable that chooses QEMU when `--qemu` is not given (same values).
pub const QEMU_ENV: &str = "VMSIGHT_QEMU";
/// The system QEMU, looked up in `PATH`.
pub const SYSTEM_QEMU: &str = "qemu-system-x86_64";
/// The oldest QEMU major version vmsight runs on.
pub const MIN_MAJOR: u32 = 10;
/// The TCG plugin API versions the vmsight plugin (`crates/plugin`) can be loaded with.
pub const PLUGIN_APIS: [u32; 2] = [4, 7];

/// Where the trixie root's files are, relative to the root (scripts/build-qemu-trixie.sh).
const TRIXIE_LOADER: &str = "lib64/ld-linux-x86-64.so.2";
const TRIXIE_BINARY: &str = "usr/bin/qemu-system-x86_64";
const TRIXIE_LIBS: [&str; 2] = ["usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu"];
const TRIXIE_MODULES: &str = "usr/lib/x86_64-linux-gnu/qemu";
const TRIXIE_FIRMWARE: [&str; 2] = ["usr/share/qemu", "usr/share/seabios"];

/// The TCG plugin API version (`QEMU_PLUGIN_VERSION`) a QEMU release speaks:
///
/// | QEMU    | plugin API |
/// |---------|------------|
/// | 10.0.x  | 4          |
/// | 10.1.x  | 5          |
/// | 10.2.x  | 6          |
/// | 11.x    | 7          |
///
/// QEMU before 10 is refused before this matters (it is given 10.0's 4); a major after 11 is
/// taken to speak 7 until this table learns it (QEMU itself refuses a plugin whose API it does
/// not support, with its own message).
pub fn plugin_api_for(major: u32, minor: u32) -> u32 {
    match (major, minor) {
        (..=9, _) | (10, 0) => 4,
        (10, 1) => 5,
        (10, _) => 6,
        _ => 7,
    }
}

/// Which QEMU the user asked for: `--qemu auto|system|trixie|PATH`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum QemuChoice {
    /// The trixie root's QEMU 11.1 if it is built, unless the system QEMU is itself free of
    /// QEMU 10's TCG section race and can load the plugin ([`decide_auto`]).
    #[default]
    Auto,
    /// `qemu-system-x86_64` from `PATH`.
    System,
    /// QEMU 11 in the Debian trixie root built by `make qemu11`.
    Trixie,
    /// This binary: a path, or a bare name looked up in `PATH`.
    Path(PathBuf),
}

impl QemuChoice {
    /// `$VMSIGHT_QEMU`, which takes the values of `--qemu`; `auto` when unset or empty.
    pub fn from_env() -> QemuChoice {
        std::env::var_os(QEMU_ENV)
            .and_then(|v| QemuChoice::from_os(&v))
            .unwrap_or_default()
    }

    /// `None` for an empty value.
    fn from_os(v: &OsStr) -> Option<QemuChoice> {
        match v.to_str() {
            Some("") => None,
            Some("auto") => Some(QemuChoice::Auto),
            Some("system") => Some(QemuChoice::System),
            Some("trixie") => Some(QemuChoice::Trixie),
            _ => Some(QemuChoice::Path(PathBuf::from(v))),
        }
    }
}

impl FromStr for QemuChoice {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        QemuChoice::from_os(OsStr::new(s)).ok_or_else(|| ConfigError::QemuChoice(s.into()))
    }
}

impl fmt::Display for QemuChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QemuChoice::Auto => f.write_str("auto"),
            QemuChoice::System => f.write_str("system"),
            QemuChoice::Trixie => f.write_str("trixie"),
            QemuChoice::Path(p) => write!(f, "{}", p.display()),
        }
    }
}

/// What `--qemu auto` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoPick {
    System,
    Trixie,
    /// Nothing usable: no system QEMU 10 or newer, no trixie root.
    Neither,
}

/// `--qemu auto`, from the system QEMU's version (`None`: not in `PATH` or it does not run)
/// and whether the trixie root is built, in this order:
/// 1. the system QEMU when the plugin can be loaded into it (plugin API 4 or 7) and it does
///    not have QEMU 10's TCG section race ([`has_tcg_section_race`]): a system QEMU 11;
/// 2. the trixie root (QEMU 11.1) when it is built;
/// 3. the system QEMU when the plugin can be loaded into it (QEMU 10.0, with the race);
/// 4. a system QEMU 10.1 or 10.2 (a run that loads the plugin is then refused with its own
///    error, so a run with `--no-plugin` works).
pub fn decide_auto(system: Option<(u32, u32, u32)>, trixie_built: bool) -> AutoPick {
    let loadable = |(major, minor, _): (u32, u32, u32)| {
        major >= MIN_MAJOR && PLUGIN_APIS.contains(&plugin_api_for(major, minor))
    };
    match system {
        Some(v) if loadable(v) && !has_tcg_section_race(v) => AutoPick::System,
        _ if trixie_built => AutoPick::Trixie,
        Some(v) if loadable(v) => AutoPick::System,
        Some((major, _, _)) if major >= MIN_MAJOR => AutoPick::System,
        _ => AutoPick::Neither,
    }
}

/// Whether QEMU `version` has the TCG race behind the rare QEMU aborts
/// (`iotlb_to_section: Assertion 'section_index < d->map.sections_nb' failed`) and stalled
/// guest vCPU timers (docs/launcher.md, "QEMU 10's TCG section race"). A TLB entry for MMIO
/// keeps a section *index*, taken from the memory map of the time; QEMU 10 looks that index
/// up in the address space's *current* map, so an access made between a memory-map change
/// (a guest PCI BAR toggled on or off) and the vCPU's own TLB flush reaches another section
/// or none. QEMU 11 keeps the section itself in the TLB entry (its binary has no
/// `iotlb_to_section`); the 10.x releases all have the index.
pub fn has_tcg_section_race((major, _, _): (u32, u32, u32)) -> bool {
    major == 10
}

/// How to start a QEMU: the program and the arguments before QEMU's own, extra environment,
/// and firmware directories (`-L`, searched before QEMU's built-in one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuExec {
    pub program: PathBuf,
    pub leading_args: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
    pub firmware_dirs: Vec<PathBuf>,
}

impl QemuExec {
    /// A QEMU binary run as it is.
    pub fn direct(binary: &Path) -> QemuExec {
        QemuExec {
            program: binary.to_owned(),
            leading_args: Vec::new(),
            env: Vec::new(),
            firmware_dirs: Vec::new(),
        }
    }

    /// The QEMU of a trixie root, run on this (bookworm) host without chroot: through the
    /// root's own loader with the root's libraries, modules (`QEMU_MODULE_DIR`) and firmware,
    /// so nothing of the host's QEMU is mixed in.
    pub fn trixie(root: &Path) -> QemuExec {
        let libs: Vec<PathBuf> = TRIXIE_LIBS.iter().map(|l| root.join(l)).collect();
        let lib_path = std::env::join_paths(&libs).unwrap_or_else(|_| libs[0].clone().into());
        QemuExec {
            program: root.join(TRIXIE_LOADER),
            leading_args: vec![
                "--library-path".into(),
                lib_path,
                root.join(TRIXIE_BINARY).into(),
            ],
            env: vec![("QEMU_MODULE_DIR".into(), root.join(TRIXIE_MODULES).into())],
            firmware_dirs: TRIXIE_FIRMWARE.iter().map(|d| root.join(d)).collect(),
        }
    }

    /// What comes before QEMU's own arguments: the leading arguments, then `-L DIR` each.
    fn prefix_args(&self) -> Vec<OsString> {
        let mut v = self.leading_args.clone();
        for d in &self.firmware_dirs {
            v.push("-L".into());
            v.push(d.into());
        }
        v
    }

    /// A command that starts this QEMU; the caller adds QEMU's arguments.
    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.program);
        c.args(self.prefix_args()).envs(self.env.iter().cloned());
        c
    }

    /// The whole command with QEMU's arguments `args` as one shell line (environment first).
    pub fn shell_line(&self, args: &[String]) -> String {
        let env = self.env.iter().map(|(k, v)| {
            format!(
                "{}={}",
                k.to_string_lossy(),
                shell_quote(&v.to_string_lossy())
            )
        });
        let words = std::iter::once(self.program.as_os_str().to_owned())
            .chain(self.prefix_args())
            .map(|w| shell_quote(&w.to_string_lossy()))
            .chain(args.iter().map(|a| shell_quote(a)));
        env.chain(words).collect::<Vec<_>>().join(" ")
    }
}

/// The QEMU a VM runs on, resolved from a [`QemuChoice`] and checked to be version 10 or newer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qemu {
    pub kind: QemuKind,
    /// The `qemu-system-x86_64` file itself (inside the root for `trixie`).
    pub binary: PathBuf,
    pub exec: QemuExec,
    /// (major, minor, micro).
    pub version: (u32, u32, u32),
    /// The first line of `--version`.
    pub version_line: String,
}

impl Qemu {
    /// Resolves the user's choice (docs/platforms.md, "How QEMU is chosen").
    pub fn resolve(choice: &QemuChoice) -> Result<Qemu, LaunchError> {
        match choice {
            QemuChoice::Auto => Qemu::auto(),
            QemuChoice::System => Qemu::system(),
            QemuChoice::Trixie => Qemu::trixie(),
            QemuChoice::Path(p) => Qemu::at_path(p),
        }
    }

    /// `qemu-system-x86_64` from `PATH`.
    pub fn system() -> Result<Qemu, LaunchError> {
        Qemu::probe_system()?.require_min()
    }

    /// The trixie root in the vmsight cache (`$VMSIGHT_CACHE` or `~/.cache/vmsight`).
    pub fn trixie() -> Result<Qemu, LaunchError> {
        Qemu::trixie_in(&vmsight_image::cache_dir()?)
    }

    /// The trixie root of the cache `cache`: `<cache>/qemu/trixie-current/root`, resolved to
    /// the recipe directory it points to now (a rebuild does not move a running VM's files).
    pub fn trixie_in(cache: &Path) -> Result<Qemu, LaunchError> {
        let root = trixie_root(cache)?;
        let binary = root.join(TRIXIE_BINARY);
        Qemu::probe(QemuKind::Trixie, binary, QemuExec::trixie(&root))?.require_min()
    }

    /// The binary `path` (a bare name is looked up in `PATH`).
    pub fn at_path(path: &Path) -> Result<Qemu, LaunchError> {
        let wanted = path.to_string_lossy();
        let binary = resolve_in_path(&wanted)
            .ok_or_else(|| LaunchError::QemuNotFound(wanted.to_string()))?;
        Qemu::probe(QemuKind::Path, binary.clone(), QemuExec::direct(&binary))?.require_min()
    }

    /// `--qemu auto` ([`decide_auto`]).
    fn auto() -> Result<Qemu, LaunchError> {
        let system = Qemu::probe_system();
        let cache = vmsight_image::cache_dir().ok();
        let built = cache.as_deref().is_some_and(|c| trixie_root(c).is_ok());
        let pick = decide_auto(system.as_ref().ok().map(|q| q.version), built);
        tracing::debug!(
            "--qemu auto: system {:?}, trixie root built: {built}: {pick:?}",
            system.as_ref().map(|q| &q.version_line)
        );
        match (pick, cache) {
            (AutoPick::System, _) => {
                if let Ok(q) = &system {
                    if has_tcg_section_race(q.version) {
                        tracing::info!(
                            "--qemu auto runs the system QEMU {}, which has QEMU 10's TCG \
                             section race (rare aborts and stalled guest timers, \
                             docs/launcher.md); `make qemu11` builds QEMU 11.1, which auto \
                             then prefers",
                            q.version_string()
                        );
                    }
                }
                system
            }
            (AutoPick::Trixie, Some(cache)) => Qemu::trixie_in(&cache),
            _ => Err(LaunchError::NoUsableQemu {
                system: match system {
                    Ok(q) => format!(
                        "{} at {} is version {}, and vmsight needs {MIN_MAJOR} or newer",
                        SYSTEM_QEMU,
                        q.binary.display(),
                        q.version_string()
                    ),
                    Err(LaunchError::QemuNotFound(_)) => format!("{SYSTEM_QEMU} is not in PATH"),
                    Err(e) => e.to_string(),
                },
            }),
        }
    }

    /// The system QEMU and its version, whatever the version.
    fn probe_system() -> Result<Qemu, LaunchError> {
        let binary = resolve_in_path(SYSTEM_QEMU)
            .ok_or_else(|| LaunchError::QemuNotFound(SYSTEM_QEMU.into()))?;
        Qemu::probe(QemuKind::System, binary.clone(), QemuExec::direct(&binary))
    }

    /// Runs `--version` through `exec`.
    fn probe(kind: QemuKind, binary: PathBuf, exec: QemuExec) -> Result<Qemu, LaunchError> {
        let out = exec.command().arg("--version").output().map_err(|source| {
            LaunchError::QemuVersion {
                path: binary.clone(),
                source,
            }
        })?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let first = |t: &str| t.lines().next().unwrap_or("").trim().to_string();
        if !out.status.success() {
            return Err(LaunchError::QemuBroken {
                path: binary,
                status: out.status,
                stderr: first(&String::from_utf8_lossy(&out.stderr)),
            });
        }
        let version = parse_version(&text).ok_or_else(|| LaunchError::QemuTooOld {
            path: binary.clone(),
            found: Some(first(&text))
                .filter(|l| !l.is_empty())
                .unwrap_or_else(|| "unknown".into()),
        })?;
        Ok(Qemu {
            kind,
            binary,
            exec,
            version,
            version_line: first(&text),
        })
    }

    fn require_min(self) -> Result<Qemu, LaunchError> {
        if self.version.0 < MIN_MAJOR {
            return Err(LaunchError::QemuTooOld {
                path: self.binary,
                found: format!("{}.{}", self.version.0, self.version.1),
            });
        }
        Ok(self)
    }

    /// The TCG plugin API version this QEMU speaks ([`plugin_api_for`]).
    pub fn plugin_api(&self) -> u32 {
        plugin_api_for(self.version.0, self.version.1)
    }

    /// `major.minor.micro`.
    pub fn version_string(&self) -> String {
        let (a, b, c) = self.version;
        format!("{a}.{b}.{c}")
    }

    /// The vmsight plugin can be loaded into this QEMU (call only when it will be).
    pub fn check_plugin_api(&self) -> Result<(), LaunchError> {
        let api = self.plugin_api();
        if PLUGIN_APIS.contains(&api) {
            return Ok(());
        }
        Err(LaunchError::PluginApi {
            qemu: self.to_string(),
            api,
            supported: PLUGIN_APIS
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(" and "),
        })
    }

    /// What `vm.json` and the run's stats record.
    pub fn info(&self) -> QemuInfo {
        QemuInfo {
            kind: self.kind,
            version: self.version_string(),
            version_line: self.version_line.clone(),
            plugin_api: self.plugin_api(),
        }
    }
}

impl fmt::Display for Qemu {
    /// `QEMU 11.1.3 (trixie, /root/.cache/vmsight/qemu/trixie-…/root/usr/bin/qemu-system-x86_64)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "QEMU {} ({}, {})",
            self.version_string(),
            self.kind,
            self.binary.display()
        )
    }
}

/// `<cache>/qemu/trixie-current/root`, resolved through the link, if the root is built.
pub fn trixie_root(cache: &Path) -> Result<PathBuf, LaunchError> {
    let current = cache.join("qemu").join("trixie-current");
    let dir = std::fs::canonicalize(&current).map_err(|_| LaunchError::TrixieMissing {
        path: current.clone(),
    })?;
    let root = dir.join("root");
    for f in [TRIXIE_LOADER, TRIXIE_BINARY] {
        let p = root.join(f);
        if !p.is_file() {
            return Err(LaunchError::TrixieMissing { path: p });
        }
    }
    Ok(root)
}

fn resolve_in_path(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Parses "QEMU emulator version 10.0.2 (Debian ...)".
pub fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let rest = text.split("version ").nth(1)?;
    let v = rest.split_whitespace().next()?;
    let mut it = v.split('.').map(|p| {
        p.chars()
            .take_while(|c| c.is_ascii_digit())
            .collect::<String>()
            .parse::<u32>()
            .ok()
    });
    let major = it.next()??;
    let minor = it.next().flatten().unwrap_or(0);
    let micro = it.next().flatten().unwrap_or(0);
    Some((major, minor, micro))
}

/// How TCG runs the vCPUs (`-accel tcg,thread=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TcgThreads {
    /// `Single` on a QEMU with the TCG section race ([`has_tcg_section_race`]: QEMU 10) when
    /// the plugin does not instrument translated code, `Multi` otherwise
    /// ([`TcgThreads::resolve`]). The default.
    #[default]
    Auto,
    /// One host thread per vCPU (multi-threaded TCG).
    Multi,
    /// Every vCPU on one host thread, in turn. It takes QEMU 10's TCG section race away (no
    /// vCPU runs while another changes the memory map, and a vCPU with a TLB flush queued runs
    /// only after it, docs/launcher.md) at the price of parallel guest work.
    Single,
}

impl TcgThreads {
    /// The mode for QEMU `version`: `Auto` becomes `Single` where the section race is and the
    /// plugin does not instrument translated code (`plugin_translates`: its per-vCPU state
    /// lives on the vCPU threads, and single-threaded TCG runs every vCPU on one thread), else
    /// `Multi`; an explicit choice stays.
    pub fn resolve(self, version: (u32, u32, u32), plugin_translates: bool) -> TcgThreads {
        match self {
            TcgThreads::Auto if has_tcg_section_race(version) && !plugin_translates => {
                TcgThreads::Single
            }
            TcgThreads::Auto => TcgThreads::Multi,
            chosen => chosen,
        }
    }

    /// The value of QEMU's `thread=` option (an unresolved `Auto` is QEMU's own default,
    /// `multi`).
    pub fn as_str(self) -> &'static str {
        match self {
            TcgThreads::Multi | TcgThreads::Auto => "multi",
            TcgThreads::Single => "single",
        }
    }
}

/// Everything the QEMU command line depends on.
#[derive(Debug, Clone)]
pub struct QemuPlan {
    pub name: String,
    pub accel: Accel,
    /// Multi- or single-threaded TCG, resolved for the QEMU that runs (ignored under KVM).
    pub tcg_threads: TcgThreads,
    pub vcpus: u32,
    pub mem_mib: u64,
    /// Room for hot-plugged memory (`-m ...,maxmem=`), MiB beyond `mem_mib`: the swap
    /// service's virtio-mem device (`--swap ...,grow=SIZE`).
    pub hotplug_mib: u64,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub cmdline: String,
    pub qmp_socket: PathBuf,
    pub console_socket: PathBuf,
    pub ctl_socket: PathBuf,
    pub stdout_socket: PathBuf,
    pub stderr_socket: PathBuf,
    pub stdin_socket: PathBuf,
    /// The script behind fw_cfg `opt/vmsight/cmd`; `None` for an interactive console.
    pub command_file: Option<PathBuf>,
    /// Each device's own arguments (`-chardev ... -device ...`), in device order (the
    /// devices phase builds them; see `crate::devices`).
    pub devices: Vec<Vec<String>>,
    /// The plugin and its arguments after `shm=` (e.g. `records=on,profile=...`).
    pub plugin: Option<PluginPlan>,
    /// Ask the guest init to report the command's PID and wait for `go` before running it.
    pub hold: bool,
    /// QEMU's least privilege (`crate::confine`).
    pub confine: QemuConfine,
}

/// What QEMU may do once it runs: its seccomp sandbox, and the identity and empty root it
/// changes to after start-up (`crate::confine`).
#[derive(Debug, Clone, Default)]
pub struct QemuConfine {
    pub sandbox: bool,
    /// `-run-with user=UID:GID,chroot=DIR`'s value.
    pub run_with: Option<String>,
}

/// How the TCG plugin is loaded.
#[derive(Debug, Clone)]
pub struct PluginPlan {
    pub library: PathBuf,
    pub shm: PathBuf,
    pub records: bool,
    /// Kernel profile for task identification (needed for monitoring).
    pub profile: Option<PathBuf>,
    /// FoxyIdle's block-tag channel (`blk=`).
    pub blk: Option<PathBuf>,
    /// SymCall's synchronous transport (`symsync=on`, API v7).
    pub symsync: bool,
    /// Count `syscall` instructions (`count=`). Off with nothing else to do, the plugin is
    /// dormant: it registers no translation callback, so QEMU runs as without it.
    pub count: bool,
}

impl PluginPlan {
    /// Whether the plugin instruments translated code; without that it is dormant
    /// (docs/plugin.md). The same rule as the plugin's own `Options::translates`
    /// (`crates/plugin/src/logic.rs`), on the options this plan passes it: a profile alone
    /// does not make it translate.
    pub fn translates(&self) -> bool {
        self.count || self.records || self.blk.is_some() || self.symsync
    }
}

/// A `-chardev socket` in client mode for a socket vmsight listens on.
pub fn chardev_socket(id: &str, path: &Path) -> String {
    // Client mode: vmsight listens before QEMU starts, so no guest byte is lost.
    format!("socket,id={id},path={}", path.display())
}

/// QEMU's arguments for a vhost-user PCI device `model` (e.g. `vhost-user-fs-pci`) whose
/// backend listens on `socket`: a chardev named `id` and the device `{id}dev` on it, with the
/// device's own `props` (`key=value,...`, may be empty).
pub fn vhost_user_pci(id: &str, socket: &Path, model: &str, props: &str) -> Vec<String> {
    let sep = if props.is_empty() { "" } else { "," };
    vec![
        "-chardev".into(),
        chardev_socket(id, socket),
        "-device".into(),
        format!("{model},chardev={id},id={id}dev{sep}{props}"),
    ]
}

/// The kernel command line vmsight boots with; `extra` is appended.
pub fn kernel_cmdline(name: &str, extra: &[String]) -> String {
    let mut s = format!(
        "console=ttyS0 root=/dev/vda rw nokaslr panic=-1 init=/usr/lib/vmsight/init vmsight.name={name}"
    );
    for e in extra {
        s.push(' ');
        s.push_str(e);
    }
    s
}

/// Builds QEMU's argument vector (without the program name).
pub fn build_args(p: &QemuPlan) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    // `process=`: the trixie QEMU is started through its root's loader, whose name the
    // process would otherwise keep (`ld-linux-x86-64`); tools find QEMU by this name.
    push(&[
        "-name",
        &format!(
            "guest={},debug-threads=on,process=qemu-system-x86_64",
            p.name
        ),
    ]);
    push(&["-machine", "q35,memory-backend=mem,vmport=off,hpet=off"]);
    match p.accel {
        Accel::Tcg => push(&[
            "-accel",
            &format!("tcg,thread={},tb-size=256", p.tcg_threads.as_str()),
            "-cpu",
            "max",
        ]),
        Accel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
    }
    push(&["-smp", &p.vcpus.to_string()]);
    if p.hotplug_mib > 0 {
        let max = p.mem_mib + p.hotplug_mib;
        push(&["-m", &format!("{}M,maxmem={max}M", p.mem_mib)]);
    } else {
        push(&["-m", &format!("{}M", p.mem_mib)]);
    }
    // Guest RAM in a shared memfd: required by vhost-user, and lets vmsight map guest memory.
    push(&[
        "-object",
        &format!("memory-backend-memfd,id=mem,size={}M,share=on", p.mem_mib),
    ]);
    push(&[
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ]);
    push(&["-kernel", &p.kernel.display().to_string()]);
    push(&["-initrd", &p.initrd.display().to_string()]);
    push(&["-append", &p.cmdline]);
    push(&["-chardev", &chardev_socket("console", &p.console_socket)]);
    push(&["-serial", "chardev:console"]);
    push(&[
        "-qmp",
        &format!("unix:{},server=on,wait=off", p.qmp_socket.display()),
    ]);
    // pvpanic reports a guest panic to QMP (GUEST_PANICKED) even if the console is lost.
    push(&["-device", "pvpanic"]);
    push(&["-device", "virtio-serial-pci,id=vser,max_ports=8"]);
    for (id, path, port) in [
        ("ctl", &p.ctl_socket, PORT_CTL),
        ("out", &p.stdout_socket, PORT_STDOUT),
        ("err", &p.stderr_socket, PORT_STDERR),
        ("in", &p.stdin_socket, PORT_STDIN),
    ] {
        push(&["-chardev", &chardev_socket(id, path)]);
        push(&[
            "-device",
            &format!("virtserialport,bus=vser.0,chardev={id},name={port}"),
        ]);
    }
    if let Some(f) = &p.command_file {
        push(&[
            "-fw_cfg",
            &format!("name={FW_CFG_CMD},file={}", f.display()),
        ]);
    }
    for d in &p.devices {
        let items: Vec<&str> = d.iter().map(String::as_str).collect();
        push(&items);
    }
    if p.hold {
        push(&["-fw_cfg", &format!("name={FW_CFG_HOLD},string=1")]);
    }
    if let Some(pl) = &p.plugin {
        let mut arg = format!(
            "{},shm={},records={}",
            pl.library.display(),
            pl.shm.display(),
            if pl.records { "on" } else { "off" }
        );
        if let Some(prof) = &pl.profile {
            arg.push_str(&format!(",profile={}", prof.display()));
        }
        if let Some(blk) = &pl.blk {
            arg.push_str(&format!(",blk={}", blk.display()));
        }
        if pl.symsync {
            arg.push_str(",symsync=on");
        }
        if !pl.count {
            arg.push_str(",count=off");
        }
        push(&["-plugin", &arg]);
    }
    if p.confine.sandbox {
        push(&[
            "-sandbox",
            &crate::confine::sandbox_arg(p.confine.run_with.is_some()),
        ]);
    }
    if let Some(r) = &p.confine.run_with {
        push(&["-run-with", r]);
    }
    a
}

/// Quotes a word for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script the guest init runs for `vmsight run -- CMD ARGS...`.
pub fn command_script(argv: &[String]) -> String {
    let words: Vec<String> = argv.iter().map(|w| shell_quote(w)).collect();
    format!(
        "#!/bin/sh\n# Generated by vmsight: the command given to `vmsight run --`.\ncd /root 2>/dev/null || cd /\nexec {}\n",
        words.join(" ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vhost_user_devices_get_a_chardev_and_a_device_on_it() {
        let p = std::path::Path::new("/r/fs0.sock");
        assert_eq!(
            vhost_user_pci("fs0", p, "vhost-user-fs-pci", "tag=t"),
            [
                "-chardev",
                "socket,id=fs0,path=/r/fs0.sock",
                "-device",
                "vhost-user-fs-pci,chardev=fs0,id=fs0dev,tag=t"
            ]
        );
        assert_eq!(
            vhost_user_pci("v", p, "vhost-user-vsock-pci", "")[3],
            "vhost-user-vsock-pci,chardev=v,id=vdev"
        );
    }

    fn plan() -> QemuPlan {
        QemuPlan {
            name: "t1".into(),
            accel: Accel::Tcg,
            tcg_threads: TcgThreads::Multi,
            vcpus: 2,
            mem_mib: 1024,
            hotplug_mib: 0,
            kernel: "/k".into(),
            initrd: "/i".into(),
            cmdline: kernel_cmdline("t1", &["quiet".into()]),
            qmp_socket: "/r/qmp.sock".into(),
            console_socket: "/r/console.sock".into(),
            ctl_socket: "/r/ctl.sock".into(),
            stdout_socket: "/r/stdout.sock".into(),
            stderr_socket: "/r/stderr.sock".into(),
            stdin_socket: "/r/stdin.sock".into(),
            command_file: Some("/r/cmd.sh".into()),
            devices: vec![
                crate::devices::blk::qemu_args(0, Path::new("/r/disk0.sock"), 2, 256),
                crate::devices::blk::qemu_args(1, Path::new("/r/disk1.sock"), 1, 256),
            ],
            plugin: Some(PluginPlan {
                library: "/p.so".into(),
                shm: "/r/plugin.shm".into(),
                records: false,
                profile: None,
                blk: None,
                symsync: false,
                count: true,
            }),
            hold: false,
            confine: QemuConfine::default(),
        }
    }

    fn has_pair(a: &[String], k: &str, v: &str) -> bool {
        a.windows(2).any(|w| w[0] == k && w[1] == v)
    }

    #[test]
    fn a_confined_qemu_gets_its_sandbox_and_changes_user_and_root_after_start_up() {
        let a = build_args(&plan());
        assert!(!a.iter().any(|w| w == "-sandbox" || w == "-run-with"));
        let sandboxed = build_args(&QemuPlan {
            confine: QemuConfine {
                sandbox: true,
                run_with: None,
            },
            ..plan()
        });
        assert!(has_pair(
            &sandboxed,
            "-sandbox",
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
        ));
        let dropped = build_args(&QemuPlan {
            confine: QemuConfine {
                sandbox: true,
                run_with: Some("user=7:8,chroot=/r/jail".into()),
            },
            ..plan()
        });
        assert!(has_pair(&dropped, "-run-with", "user=7:8,chroot=/r/jail"));
        assert!(has_pair(
            &dropped,
            "-sandbox",
            "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"
        ));
    }

    #[test]
    fn command_line_has_shared_memory_and_tcg() {
        let a = build_args(&plan());
        assert!(has_pair(&a, "-accel", "tcg,thread=multi,tb-size=256"));
        let single = build_args(&QemuPlan {
            tcg_threads: TcgThreads::Single,
            ..plan()
        });
        assert!(has_pair(&single, "-accel", "tcg,thread=single,tb-size=256"));
        // Auto is single-threaded exactly where the section race is and the plugin does not
        // instrument translated code.
        assert_eq!(
            TcgThreads::Auto.resolve((10, 0, 2), false),
            TcgThreads::Single
        );
        assert_eq!(
            TcgThreads::Auto.resolve((10, 0, 2), true),
            TcgThreads::Multi
        );
        assert_eq!(
            TcgThreads::Auto.resolve((11, 1, 3), false),
            TcgThreads::Multi
        );
        assert_eq!(
            TcgThreads::Multi.resolve((10, 0, 2), false),
            TcgThreads::Multi
        );
        assert_eq!(
            TcgThreads::Single.resolve((11, 1, 3), true),
            TcgThreads::Single
        );
        assert!(has_pair(
            &a,
            "-object",
            "memory-backend-memfd,id=mem,size=1024M,share=on"
        ));
        assert!(has_pair(&a, "-smp", "2"));
        assert!(a.iter().any(|s| s == "-no-reboot"));
        assert!(has_pair(
            &a,
            "-name",
            "guest=t1,debug-threads=on,process=qemu-system-x86_64"
        ));
    }

    #[test]
    fn every_disk_is_vhost_user_in_order() {
        let a = build_args(&plan());
        let devs: Vec<&String> = a
            .iter()
            .filter(|s| s.starts_with("vhost-user-blk-pci"))
            .collect();
        assert_eq!(devs.len(), 2);
        assert!(devs[0].contains("chardev=disk0") && devs[0].contains("num-queues=2"));
        assert!(devs[1].contains("chardev=disk1"));
        assert!(!a.iter().any(|s| s.starts_with("if=") || s == "-drive"));
    }

    #[test]
    fn plugin_and_command_are_passed() {
        let a = build_args(&plan());
        assert!(has_pair(
            &a,
            "-plugin",
            "/p.so,shm=/r/plugin.shm,records=off"
        ));
        assert!(has_pair(
            &a,
            "-fw_cfg",
            "name=opt/vmsight/cmd,file=/r/cmd.sh"
        ));
        let mut p = plan();
        p.plugin = None;
        p.command_file = None;
        let a = build_args(&p);
        assert!(!a.iter().any(|s| s == "-plugin" || s == "-fw_cfg"));
        let mut p = plan();
        p.hold = true;
        if let Some(pl) = p.plugin.as_mut() {
            pl.profile = Some("/img/profile.json".into());
            pl.records = true;
        }
        let a = build_args(&p);
        assert!(has_pair(&a, "-fw_cfg", "name=opt/vmsight/hold,string=1"));
        assert!(has_pair(
            &a,
            "-plugin",
            "/p.so,shm=/r/plugin.shm,records=on,profile=/img/profile.json"
        ));
        if let Some(pl) = p.plugin.as_mut() {
            pl.blk = Some("/r/blocktag.shm".into());
        }
        assert!(has_pair(
            &build_args(&p),
            "-plugin",
            "/p.so,shm=/r/plugin.shm,records=on,profile=/img/profile.json,blk=/r/blocktag.shm"
        ));
        let mut p = plan();
        if let Some(pl) = p.plugin.as_mut() {
            pl.count = false;
        }
        assert!(has_pair(
            &build_args(&p),
            "-plugin",
            "/p.so,shm=/r/plugin.shm,records=off,count=off"
        ));
    }

    #[test]
    fn kvm_uses_host_cpu() {
        let mut p = plan();
        p.accel = Accel::Kvm;
        let a = build_args(&p);
        assert!(has_pair(&a, "-accel", "kvm") && has_pair(&a, "-cpu", "host"));
    }

    #[test]
    fn version_parsing() {
        assert_eq!(
            parse_version("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)\n"),
            Some((10, 0, 2))
        );
        assert_eq!(
            parse_version("QEMU emulator version 7.2.15"),
            Some((7, 2, 15))
        );
        assert_eq!(parse_version("garbage"), None);
    }

    #[test]
    fn qemu_choices_parse() {
        let p = |s: &str| s.parse::<QemuChoice>();
        assert_eq!(p("auto"), Ok(QemuChoice::Auto));
        assert_eq!(p("system"), Ok(QemuChoice::System));
        assert_eq!(p("trixie"), Ok(QemuChoice::Trixie));
        assert_eq!(
            p("/opt/q/bin/qemu-system-x86_64"),
            Ok(QemuChoice::Path("/opt/q/bin/qemu-system-x86_64".into()))
        );
        // A bare name is a binary looked up in PATH; ./trixie is a file named trixie.
        assert_eq!(
            p("qemu-system-x86_64"),
            Ok(QemuChoice::Path("qemu-system-x86_64".into()))
        );
        assert_eq!(p("./trixie"), Ok(QemuChoice::Path("./trixie".into())));
        let e = p("").expect_err("empty");
        assert!(e.to_string().contains("auto, system, trixie"), "{e}");
        assert_eq!(QemuChoice::default(), QemuChoice::Auto);
        for s in ["auto", "system", "trixie", "/x/qemu"] {
            assert_eq!(p(s).map(|c| c.to_string()).as_deref(), Ok(s));
        }
    }

    #[test]
    fn qemu_versions_map_to_plugin_apis() {
        for ((major, minor), api) in [
            ((10, 0), 4),
            ((10, 1), 5),
            ((10, 2), 6),
            ((11, 0), 7),
            ((11, 1), 7),
        ] {
            assert_eq!(plugin_api_for(major, minor), api, "QEMU {major}.{minor}");
        }
        assert_eq!(PLUGIN_APIS, [4, 7]);
    }

    fn qemu_at(version: (u32, u32, u32)) -> Qemu {
        Qemu {
            kind: QemuKind::System,
            binary: "/usr/bin/qemu-system-x86_64".into(),
            exec: QemuExec::direct(Path::new("/usr/bin/qemu-system-x86_64")),
            version,
            version_line: format!(
                "QEMU emulator version {}.{}.{}",
                version.0, version.1, version.2
            ),
        }
    }

    #[test]
    fn only_plugin_apis_4_and_7_can_load_the_plugin() {
        for v in [(10, 0, 2), (11, 1, 3), (11, 0, 0)] {
            assert!(qemu_at(v).check_plugin_api().is_ok(), "{v:?}");
        }
        for (v, api) in [((10, 1, 0), 5), ((10, 2, 1), 6)] {
            let e = qemu_at(v)
                .check_plugin_api()
                .expect_err("refused")
                .to_string();
            assert!(
                e.contains(&format!("plugin API {api}"))
                    && e.contains("API 4 and 7")
                    && e.contains("--no-plugin")
                    && e.contains("make qemu11"),
                "{e}"
            );
        }
        let info = qemu_at((11, 1, 3)).info();
        assert_eq!(
            (info.version.as_str(), info.plugin_api, info.kind),
            ("11.1.3", 7, QemuKind::System)
        );
    }

    #[test]
    fn auto_takes_the_system_qemu_the_plugin_can_use_else_the_trixie_root() {
        use AutoPick::*;
        for (system, built, pick) in [
            // A system QEMU 11 (API 7, no section race): the system one.
            (Some((11, 1, 3)), true, System),
            (Some((11, 1, 3)), false, System),
            // The host's QEMU 10.0 (API 4) has the race: the trixie root when it is built ...
            (Some((10, 0, 2)), true, Trixie),
            // ... else the system one all the same.
            (Some((10, 0, 2)), false, System),
            // 10.1 / 10.2 speak API 5 / 6: the trixie root when it is built ...
            (Some((10, 1, 0)), true, Trixie),
            (Some((10, 2, 0)), true, Trixie),
            // ... else the system one, refused later only if the plugin is loaded.
            (Some((10, 1, 0)), false, System),
            // No system QEMU, or one older than 10.
            (None, true, Trixie),
            (Some((9, 2, 0)), true, Trixie),
            (None, false, Neither),
            (Some((9, 2, 0)), false, Neither),
        ] {
            assert_eq!(decide_auto(system, built), pick, "{system:?} built={built}");
        }
    }

    fn executable(path: &Path, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).expect("mkdir");
        }
        std::fs::write(path, format!("#!/bin/sh\n{body}\n")).expect("write");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    /// A cache with a trixie root whose "loader" checks its `--library-path` and runs the
    /// "QEMU", which prints its module directory and arguments in its version line.
    fn fake_trixie_cache() -> tempfile::TempDir {
        let cache = tempfile::tempdir().expect("tmp");
        let dir = cache.path().join("qemu/trixie-0123456789abcdef");
        let root = dir.join("root");
        executable(
            &root.join(TRIXIE_LOADER),
            r#"[ "$1" = --library-path ] || { echo "bad loader args: $*" >&2; exit 127; }
shift 2
exec "$@""#,
        );
        executable(
            &root.join(TRIXIE_BINARY),
            r#"echo "QEMU emulator version 11.1.3 (fake) mod=$QEMU_MODULE_DIR args=$*""#,
        );
        std::fs::write(dir.join("info.json"), "{}").expect("info");
        std::os::unix::fs::symlink(
            "trixie-0123456789abcdef",
            cache.path().join("qemu/trixie-current"),
        )
        .expect("link");
        cache
    }

    #[test]
    fn the_trixie_qemu_runs_through_the_roots_loader_libraries_modules_and_firmware() {
        let cache = fake_trixie_cache();
        let root = std::fs::canonicalize(cache.path().join("qemu/trixie-0123456789abcdef"))
            .expect("canonical")
            .join("root");
        let r = |p: &str| root.join(p).display().to_string();
        let exec = QemuExec::trixie(&root);
        assert_eq!(exec.program, root.join("lib64/ld-linux-x86-64.so.2"));
        assert_eq!(
            exec.leading_args,
            [
                OsString::from("--library-path"),
                format!(
                    "{}:{}",
                    r("usr/lib/x86_64-linux-gnu"),
                    r("lib/x86_64-linux-gnu")
                )
                .into(),
                root.join("usr/bin/qemu-system-x86_64").into(),
            ]
        );
        assert_eq!(
            exec.env,
            [(
                OsString::from("QEMU_MODULE_DIR"),
                OsString::from(r("usr/lib/x86_64-linux-gnu/qemu"))
            )]
        );
        assert_eq!(
            exec.firmware_dirs,
            [root.join("usr/share/qemu"), root.join("usr/share/seabios")]
        );
        assert_eq!(
            exec.shell_line(&["-m".into(), "1024M".into()]),
            format!(
                "QEMU_MODULE_DIR={} {} --library-path {}:{} {} -L {} -L {} -m 1024M",
                r("usr/lib/x86_64-linux-gnu/qemu"),
                r("lib64/ld-linux-x86-64.so.2"),
                r("usr/lib/x86_64-linux-gnu"),
                r("lib/x86_64-linux-gnu"),
                r("usr/bin/qemu-system-x86_64"),
                r("usr/share/qemu"),
                r("usr/share/seabios"),
            )
        );
        // Resolved through trixie-current and run for real through the fake loader.
        let q = Qemu::trixie_in(cache.path()).expect("resolves");
        assert_eq!(q.kind, QemuKind::Trixie);
        assert_eq!(q.exec, exec);
        assert_eq!(q.binary, root.join("usr/bin/qemu-system-x86_64"));
        assert_eq!((q.version, q.plugin_api()), ((11, 1, 3), 7));
        assert_eq!(
            q.version_line,
            format!(
                "QEMU emulator version 11.1.3 (fake) mod={} args=-L {} -L {} --version",
                r("usr/lib/x86_64-linux-gnu/qemu"),
                r("usr/share/qemu"),
                r("usr/share/seabios")
            )
        );
    }

    #[test]
    fn a_missing_trixie_root_says_how_to_build_it() {
        let empty = tempfile::tempdir().expect("tmp");
        let e = Qemu::trixie_in(empty.path())
            .expect_err("missing")
            .to_string();
        assert!(
            e.starts_with("the QEMU 11 trixie root is not built: run `make qemu11` (scripts/build-qemu-trixie.sh)")
                && e.contains("qemu/trixie-current"),
            "{e}"
        );
        // A root without its QEMU is not built either.
        let cache = fake_trixie_cache();
        std::fs::remove_file(
            cache
                .path()
                .join("qemu/trixie-current/root")
                .join(TRIXIE_BINARY),
        )
        .expect("rm");
        let e = Qemu::trixie_in(cache.path())
            .expect_err("no binary")
            .to_string();
        assert!(
            e.contains("make qemu11") && e.contains("usr/bin/qemu-system-x86_64"),
            "{e}"
        );
    }

    #[test]
    fn a_qemu_given_by_path_is_run_for_its_version() {
        let tmp = tempfile::tempdir().expect("tmp");
        let bin = tmp.path().join("qemu");
        executable(
            &bin,
            "echo 'QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)'",
        );
        let q = Qemu::resolve(&QemuChoice::Path(bin.clone())).expect("runs");
        assert_eq!(
            (q.kind, q.version, q.plugin_api()),
            (QemuKind::Path, (10, 0, 2), 4)
        );
        assert_eq!(q.exec, QemuExec::direct(&bin));
        assert_eq!(
            q.version_line,
            "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)"
        );
        assert_eq!(
            q.exec.shell_line(&["-S".into()]),
            format!("{} -S", bin.display())
        );

        let old = tmp.path().join("old");
        executable(&old, "echo 'QEMU emulator version 9.2.0'");
        let e = Qemu::at_path(&old).expect_err("too old").to_string();
        assert!(
            e.contains("version 9.2") && e.contains("QEMU 10 or newer"),
            "{e}"
        );

        let broken = tmp.path().join("broken");
        executable(
            &broken,
            "echo 'error while loading shared libraries' >&2; exit 127",
        );
        let e = Qemu::at_path(&broken).expect_err("broken").to_string();
        assert!(
            e.contains("does not run") && e.contains("shared libraries"),
            "{e}"
        );

        let e = Qemu::at_path(Path::new("/nonexistent/qemu")).expect_err("missing");
        assert!(
            e.to_string()
                .starts_with("QEMU was not found: looked for `/nonexistent/qemu`"),
            "{e}"
        );
    }

    #[test]
    fn shell_quoting_survives_the_shell() {
        let argv: Vec<String> = ["echo", "it's", "a b", "$HOME", ""]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let script = command_script(&argv);
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(script.replace("cd /root 2>/dev/null || cd /\n", ""))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "it's a b $HOME \n");
    }

    #[test]
    fn cmdline_defaults() {
        let c = kernel_cmdline("web1", &["quiet".into()]);
        assert!(c.contains("root=/dev/vda") && c.contains("nokaslr") && c.contains("panic=-1"));
        assert!(c.ends_with("vmsight.name=web1 quiet"));
    }
}
