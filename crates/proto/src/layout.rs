//! The runtime directory: where every running VM keeps its sockets, shared memory and state,
//! and how other vmsight commands find running VMs.
//!
//! Each VM owns `<base>/<name>/` ([`VmPaths`]); the base is chosen by [`runtime_base`]. The
//! launcher creates and removes the directory; `vmsight ps`, `watch`, `mount`, `stats` and
//! `stream` read it. Every file name used in it is defined here, once.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Environment variable that overrides the base directory.
pub const RUNTIME_ENV: &str = "VMSIGHT_RUNTIME";

/// `vm.json`: the [`VmRecord`] of the VM, how other commands find it.
pub const VM_RECORD: &str = "vm.json";
/// The control socket (`vmsight stats`, `vmsight stream`): [`crate::control`].
pub const CONTROL_SOCKET: &str = "control.sock";
/// The embedded event bus (`vmsight watch`).
pub const EVENTS_SOCKET: &str = "events.sock";
/// The view server (`vmsight mount`).
pub const VIEW_SOCKET: &str = "view.sock";
/// QEMU's QMP socket.
pub const QMP_SOCKET: &str = "qmp.sock";
/// The guest's serial console.
pub const CONSOLE_SOCKET: &str = "console.sock";
/// The guest's control port (`ready`, `cmdpid`, `exit N`).
pub const CTL_SOCKET: &str = "ctl.sock";
/// The guest command's stdout port.
pub const STDOUT_SOCKET: &str = "stdout.sock";
/// The guest command's stderr port.
pub const STDERR_SOCKET: &str = "stderr.sock";
/// The guest command's stdin port.
pub const STDIN_SOCKET: &str = "stdin.sock";
/// The plugin's shared-memory channel.
pub const PLUGIN_SHM: &str = "plugin.shm";
/// The plugin's block-tag channel (FoxyIdle attribution).
pub const BLOCKTAG_SHM: &str = "blocktag.shm";
/// The NIC's vhost-user socket.
pub const NET_SOCKET: &str = "net0.sock";
/// `net.json`: how the VM's NIC is attached ([`crate::net::NetInfo`]), for `vmsight net`.
pub const NET_INFO: &str = "net.json";
/// virtiofsd's vhost-user socket (the shared in-memory file system, Hylics).
pub const FS_SOCKET: &str = "fs0.sock";
/// `hylics.json`: the VM's share ([`crate::hylics::ShareInfo`]), for `vmsight hylics`.
pub const HYLICS_INFO: &str = "hylics.json";
/// The mount point of the VM's share (a tmpfs) inside its directory; its parent (`hylics/`)
/// is private to the user running vmsight, so other host users cannot reach the VM's files.
pub const SHARE_DIR: &str = "hylics/share";
/// The vsock device's vhost-user socket (vhost-device-vsock).
pub const VSOCK_SOCKET: &str = "vsock0.sock";
/// The vsock device's host side (hybrid vsock): guest connections to host port P arrive at
/// `vsock.sock_P`; host connections go through `vsock.sock` with `CONNECT P`.
pub const VSOCK_UDS: &str = "vsock.sock";
/// vhost-device-vsock's log.
pub const VSOCK_LOG: &str = "vsock.log";
/// The symbiotic device's ivshmem server socket (`--symbiotic`, docs/symbiotic.md).
pub const SYM_SOCKET: &str = "sym.sock";
/// virtiofsd's log.
pub const VIRTIOFSD_LOG: &str = "virtiofsd.log";
/// Copy of the guest's serial console.
pub const CONSOLE_LOG: &str = "console.log";
/// QEMU's stderr.
pub const QEMU_LOG: &str = "qemu.log";
/// QEMU's argument list, one per line.
pub const QEMU_CMDLINE: &str = "qemu.cmdline";
/// The command the guest runs (`vmsight run -- CMD`).
pub const COMMAND_SCRIPT: &str = "cmd.sh";
/// The empty directory QEMU chroots into once it runs (`--run-as`, docs/security.md).
pub const QEMU_JAIL: &str = "jail";

/// File name of disk `index`'s vhost-user socket (`disk0.sock` is the root disk).
pub fn disk_socket_name(index: usize) -> String {
    format!("disk{index}.sock")
}

/// Base directory under which each running VM gets a directory: `$VMSIGHT_RUNTIME` if set,
/// else `/run/vmsight` for root, else `$XDG_RUNTIME_DIR/vmsight`, else `/tmp/vmsight-<uid>`.
///
/// "Root" and `<uid>` are the *effective* user id (`geteuid(2)`): it is the identity the
/// kernel checks when the directory is created under `/run`, and it owns what is created
/// there. (Reading the owner of `/proc/self` gives the same answer only while the process is
/// dumpable; a setuid or `PR_SET_DUMPABLE=0` process sees root there, so that source is not
/// used.)
pub fn runtime_base() -> PathBuf {
    base_from(
        std::env::var_os(RUNTIME_ENV).map(PathBuf::from),
        effective_uid(),
        std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from),
    )
}

/// The effective user id of this process.
fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The rule of [`runtime_base`], from its inputs.
fn base_from(overridden: Option<PathBuf>, euid: u32, xdg: Option<PathBuf>) -> PathBuf {
    if let Some(p) = overridden {
        return p;
    }
    if euid == 0 {
        return PathBuf::from("/run/vmsight");
    }
    match xdg {
        Some(x) => x.join("vmsight"),
        None => PathBuf::from(format!("/tmp/vmsight-{euid}")),
    }
}

/// What `vm.json` records about a running VM, for discovery by other vmsight commands.
///
/// Only `name` and `pid` are needed to find a VM; the rest defaults when absent, so a
/// minimal record (`{"name":"v","pid":1}`) is valid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    /// VM name (also the directory name).
    pub name: String,
    /// The `vmsight run` process that owns the VM.
    pub pid: u32,
    /// QEMU's pid, once QEMU runs.
    #[serde(default)]
    pub qemu_pid: Option<u32>,
    /// Start time, seconds since the Unix epoch.
    #[serde(default)]
    pub started_unix: u64,
    /// Disk images, root disk first.
    #[serde(default)]
    pub disks: Vec<PathBuf>,
    /// Accelerator (`tcg` or `kvm`).
    #[serde(default)]
    pub accel: String,
    /// The QEMU that runs the VM; absent in records written before vmsight recorded it.
    #[serde(default)]
    pub qemu: Option<QemuInfo>,
    /// The TCG plugin API version in use: the QEMU's, when the plugin is loaded; `None` when
    /// it is not (`--no-plugin`, KVM) or the record predates the field.
    #[serde(default)]
    pub plugin_api: Option<u32>,
}

/// Which QEMU runs a VM (`vmsight run --qemu`), as `vm.json` and `vmsight run --stats-json`
/// report it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QemuInfo {
    /// How it was chosen and is run.
    pub kind: QemuKind,
    /// `major.minor.micro`, e.g. `11.1.3`.
    pub version: String,
    /// The first line of its `--version`, e.g.
    /// `QEMU emulator version 11.1.3 (Debian 1:11.1.3+ds-1~bpo13+1)`.
    pub version_line: String,
    /// The TCG plugin API version this QEMU speaks (docs/platforms.md).
    pub plugin_api: u32,
}

/// Where the QEMU a VM runs on comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QemuKind {
    /// `qemu-system-x86_64` from `PATH` (the host's QEMU 10).
    System,
    /// QEMU 11 in the Debian trixie root built by `scripts/build-qemu-trixie.sh`, run through
    /// the root's own loader and libraries.
    Trixie,
    /// A binary the user named (`--qemu PATH`, `VMSIGHT_QEMU=PATH`).
    Path,
}

impl std::fmt::Display for QemuKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QemuKind::System => "system",
            QemuKind::Trixie => "trixie",
            QemuKind::Path => "path",
        })
    }
}

/// Where running VMs live: a base directory holding one directory per VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeLayout {
    base: PathBuf,
}

impl RuntimeLayout {
    /// The layout under [`runtime_base`].
    pub fn from_env() -> RuntimeLayout {
        RuntimeLayout::at(runtime_base())
    }

    /// The layout under `base`.
    pub fn at(base: impl Into<PathBuf>) -> RuntimeLayout {
        RuntimeLayout { base: base.into() }
    }

    /// The base directory.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// The paths of VM `name` (which need not exist).
    pub fn vm(&self, name: &str) -> VmPaths {
        VmPaths::new(self.base.join(name))
    }

    /// The VMs whose `vm.json` names a live process, sorted by name. Directories without a
    /// readable record and records of dead processes (stale directories) are skipped.
    pub fn running(&self) -> Vec<RunningVm> {
        let Ok(rd) = fs::read_dir(&self.base) else {
            return Vec::new();
        };
        let mut out: Vec<RunningVm> = rd
            .filter_map(Result::ok)
            .filter_map(|e| {
                let paths = VmPaths::new(e.path());
                let record = paths.read_record()?;
                record.owner_alive().then_some(RunningVm { record, paths })
            })
            .collect();
        out.sort_by(|a, b| a.record.name.cmp(&b.record.name));
        out
    }

    /// Directories of VMs whose `vmsight run` is gone (killed with SIGKILL, so its guard never
    /// ran): their `vm.json` names a dead owner. A directory without `vm.json` is not listed:
    /// its VM may be starting.
    pub fn stale(&self) -> Vec<VmPaths> {
        let Ok(rd) = fs::read_dir(&self.base) else {
            return Vec::new();
        };
        rd.filter_map(Result::ok)
            .map(|e| VmPaths::new(e.path()))
            .filter(|p| p.read_record().is_some_and(|r| !r.owner_alive()))
            .collect()
    }
}

impl VmRecord {
    /// Whether the `vmsight run` that wrote this record still runs: its PID exists and that
    /// process is not younger than the record (a PID the kernel reused for a later process is
    /// not the owner, and its VM is gone). Records without a start time trust the PID.
    pub fn owner_alive(&self) -> bool {
        if !pid_alive(self.pid) {
            return false;
        }
        if self.started_unix == 0 {
            return true;
        }
        process_start_unix(self.pid)
            .is_none_or(|t| t <= self.started_unix.saturating_add(START_SLACK_SECS))
    }
}

/// A running VM found by [`RuntimeLayout::running`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningVm {
    /// Its `vm.json`.
    pub record: VmRecord,
    /// Its directory.
    pub paths: VmPaths,
}

/// True if a process with this pid exists.
pub fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// True if process `pid` exists and has not exited: not a zombie waiting to be reaped, which
/// has no files left.
pub fn process_running(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command name, which may hold spaces and parentheses.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| !matches!(state, 'Z' | 'X'))
    })
}

/// Rounding slack between a process's start time as `/proc` gives it (whole clock ticks after
/// a boot time in whole seconds) and a time it recorded itself.
const START_SLACK_SECS: u64 = 2;

/// When process `pid` started, seconds since the Unix epoch (`/proc/PID/stat` field 22 after
/// `/proc/stat`'s `btime`); `None` if it cannot be read.
pub fn process_start_unix(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from its last ')'.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let ticks: u64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let btime: u64 = fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok()?;
    (hz > 0).then(|| btime + ticks / hz)
}

/// The files of one VM's runtime directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmPaths {
    dir: PathBuf,
}

impl VmPaths {
    /// The files of the VM whose directory is `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> VmPaths {
        VmPaths { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of `file` in the directory.
    pub fn file(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// `vm.json`.
    pub fn record(&self) -> PathBuf {
        self.file(VM_RECORD)
    }

    /// Reads `vm.json`; `None` if it is missing or unreadable.
    pub fn read_record(&self) -> Option<VmRecord> {
        let data = fs::read(self.record()).ok()?;
        serde_json::from_slice(&data).ok()
    }

    /// The control socket.
    pub fn control_socket(&self) -> PathBuf {
        self.file(CONTROL_SOCKET)
    }

    /// The event bus socket.
    pub fn events_socket(&self) -> PathBuf {
        self.file(EVENTS_SOCKET)
    }

    /// The view server socket.
    pub fn view_socket(&self) -> PathBuf {
        self.file(VIEW_SOCKET)
    }

    /// QEMU's QMP socket.
    pub fn qmp_socket(&self) -> PathBuf {
        self.file(QMP_SOCKET)
    }

    /// The vhost-user socket of disk `index` (0 = root disk).
    pub fn disk_socket(&self, index: usize) -> PathBuf {
        self.file(&disk_socket_name(index))
    }

    /// The plugin's shared-memory channel.
    pub fn plugin_shm(&self) -> PathBuf {
        self.file(PLUGIN_SHM)
    }

    /// The NIC's vhost-user socket.
    pub fn net_socket(&self) -> PathBuf {
        self.file(NET_SOCKET)
    }

    /// `net.json`.
    pub fn net_info(&self) -> PathBuf {
        self.file(NET_INFO)
    }

    /// virtiofsd's vhost-user socket.
    pub fn fs_socket(&self) -> PathBuf {
        self.file(FS_SOCKET)
    }

    /// The share's mount point.
    pub fn share_dir(&self) -> PathBuf {
        self.file(SHARE_DIR)
    }

    /// `hylics.json`.
    pub fn hylics_info(&self) -> PathBuf {
        self.file(HYLICS_INFO)
    }

    /// Reads `hylics.json`; `None` if the VM has no share (or the file is unreadable).
    pub fn read_hylics_info(&self) -> Option<crate::hylics::ShareInfo> {
        let data = fs::read(self.hylics_info()).ok()?;
        serde_json::from_slice(&data).ok()
    }

    /// Reads `net.json`; `None` if the VM has no NIC (or the file is unreadable).
    pub fn read_net_info(&self) -> Option<crate::net::NetInfo> {
        let data = fs::read(self.net_info()).ok()?;
        serde_json::from_slice(&data).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_is_not_running_and_a_live_process_is() {
        assert!(process_running(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().expect("true");
        let pid = child.id();
        // Not yet reaped: a zombie once it exited.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while process_running(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(pid_alive(pid), "the zombie still has its /proc entry");
        assert!(!process_running(pid));
        child.wait().expect("reaped");
        assert!(!process_running(pid));
    }

    #[test]
    fn base_follows_override_then_euid_then_xdg() {
        let over = Some(PathBuf::from("/x"));
        let xdg = Some(PathBuf::from("/run/user/1000"));
        assert_eq!(base_from(over, 1000, xdg.clone()), PathBuf::from("/x"));
        assert_eq!(
            base_from(None, 0, xdg.clone()),
            PathBuf::from("/run/vmsight")
        );
        assert_eq!(
            base_from(None, 1000, xdg),
            PathBuf::from("/run/user/1000/vmsight")
        );
        assert_eq!(
            base_from(None, 1000, None),
            PathBuf::from("/tmp/vmsight-1000")
        );
    }

    #[test]
    fn vm_paths_use_the_well_known_names() {
        let vm = RuntimeLayout::at("/run/vmsight").vm("web1");
        assert_eq!(vm.dir(), Path::new("/run/vmsight/web1"));
        assert_eq!(vm.record(), Path::new("/run/vmsight/web1/vm.json"));
        assert_eq!(
            vm.control_socket(),
            Path::new("/run/vmsight/web1/control.sock")
        );
        assert_eq!(vm.events_socket().file_name(), Some("events.sock".as_ref()));
        assert_eq!(vm.view_socket().file_name(), Some("view.sock".as_ref()));
        assert_eq!(vm.disk_socket(2), Path::new("/run/vmsight/web1/disk2.sock"));
        assert_eq!(vm.plugin_shm().file_name(), Some("plugin.shm".as_ref()));
    }

    fn now_unix() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs()
    }

    #[test]
    fn a_record_is_live_only_while_its_writer_runs() {
        let me = std::process::id();
        let started = process_start_unix(me).expect("own start time");
        assert!(started <= now_unix() + START_SLACK_SECS, "{started}");
        let rec = |pid, started_unix| VmRecord {
            name: "v".into(),
            pid,
            qemu_pid: None,
            started_unix,
            disks: Vec::new(),
            accel: String::new(),
            qemu: None,
            plugin_api: None,
        };
        assert!(
            rec(me, now_unix()).owner_alive(),
            "written by this process now"
        );
        assert!(
            rec(me, 0).owner_alive(),
            "an old record without a start time"
        );
        // Written an hour before this process started: the PID was reused, the VM is gone.
        assert!(!rec(me, started.saturating_sub(3600)).owner_alive());
        // A PID above the kernel's maximum never exists.
        assert!(!rec(u32::MAX, now_unix()).owner_alive());
    }

    #[test]
    fn minimal_records_parse_and_full_ones_round_trip() {
        let r: VmRecord = serde_json::from_str(r#"{"name":"v","pid":7}"#).expect("minimal");
        assert_eq!((r.name.as_str(), r.pid, r.qemu_pid), ("v", 7, None));
        let full = VmRecord {
            name: "w".into(),
            pid: 1,
            qemu_pid: Some(2),
            started_unix: 3,
            disks: vec!["/a.img".into()],
            accel: "tcg".into(),
            qemu: Some(QemuInfo {
                kind: QemuKind::Trixie,
                version: "11.1.3".into(),
                version_line: "QEMU emulator version 11.1.3 (Debian 1:11.1.3+ds-1~bpo13+1)".into(),
                plugin_api: 7,
            }),
            plugin_api: Some(7),
        };
        let text = serde_json::to_string(&full).expect("serialises");
        assert!(text.contains(r#""kind":"trixie""#), "{text}");
        assert_eq!(
            serde_json::from_str::<VmRecord>(&text).expect("parses"),
            full
        );
        // A record written before the QEMU fields existed still reads.
        let old: VmRecord = serde_json::from_str(
            r#"{"name":"v","pid":7,"qemu_pid":8,"started_unix":1,"disks":[],"accel":"tcg"}"#,
        )
        .expect("old record");
        assert_eq!((old.qemu, old.plugin_api), (None, None));
    }

    #[test]
    fn discovery_skips_dead_and_broken_entries() {
        let d = tempfile::tempdir().expect("tempdir");
        let layout = RuntimeLayout::at(d.path());
        let write = |name: &str, text: &str| {
            fs::create_dir(d.path().join(name)).expect("mkdir");
            fs::write(layout.vm(name).record(), text).expect("write");
        };
        write(
            "b",
            &format!(r#"{{"name":"b","pid":{}}}"#, std::process::id()),
        );
        write("a", r#"{"name":"a","pid":1}"#); // init is always alive
        write("dead", r#"{"name":"dead","pid":0}"#); // pid 0 has no /proc entry
        write("junk", "{");
        fs::create_dir(d.path().join("empty")).expect("mkdir");
        let names: Vec<String> = layout
            .running()
            .into_iter()
            .map(|v| v.record.name)
            .collect();
        assert_eq!(names, ["a", "b"]);
        assert!(RuntimeLayout::at(d.path().join("missing"))
            .running()
            .is_empty());
    }
}
