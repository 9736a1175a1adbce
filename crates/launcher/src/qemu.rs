//! Locating QEMU and building its command line.
//!
//! The command line is built by a pure function from a [`QemuPlan`], so it can be unit-tested
//! and shown with `vmsight run --dry-run`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::accel::Accel;
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

/// Finds `qemu-system-x86_64` (or `$VMSIGHT_QEMU`) and checks it is QEMU 10 or newer.
pub fn find_qemu() -> Result<(PathBuf, String), LaunchError> {
    let wanted = std::env::var("VMSIGHT_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into());
    let path = resolve_in_path(&wanted).ok_or_else(|| LaunchError::QemuNotFound(wanted.clone()))?;
    let out = Command::new(&path)
        .arg("--version")
        .output()
        .map_err(|source| LaunchError::QemuVersion {
            path: path.clone(),
            source,
        })?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let version = parse_version(&text).ok_or_else(|| LaunchError::QemuTooOld {
        path: path.clone(),
        found: text.lines().next().unwrap_or("unknown").to_string(),
    })?;
    if version.0 < 10 {
        return Err(LaunchError::QemuTooOld {
            path,
            found: format!("{}.{}", version.0, version.1),
        });
    }
    Ok((path, format!("{}.{}.{}", version.0, version.1, version.2)))
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

/// One vhost-user-blk disk as QEMU sees it.
/// Everything the QEMU command line depends on.
#[derive(Debug, Clone)]
pub struct QemuPlan {
    pub name: String,
    pub accel: Accel,
    pub vcpus: u32,
    pub mem_mib: u64,
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
    push(&["-name", &format!("guest={},debug-threads=on", p.name)]);
    push(&["-machine", "q35,memory-backend=mem,vmport=off,hpet=off"]);
    match p.accel {
        Accel::Tcg => push(&["-accel", "tcg,thread=multi,tb-size=256", "-cpu", "max"]),
        Accel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
    }
    push(&["-smp", &p.vcpus.to_string()]);
    push(&["-m", &format!("{}M", p.mem_mib)]);
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
        push(&["-plugin", &arg]);
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
            vcpus: 2,
            mem_mib: 1024,
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
            }),
            hold: false,
        }
    }

    fn has_pair(a: &[String], k: &str, v: &str) -> bool {
        a.windows(2).any(|w| w[0] == k && w[1] == v)
    }

    #[test]
    fn command_line_has_shared_memory_and_tcg() {
        let a = build_args(&plan());
        assert!(has_pair(&a, "-accel", "tcg,thread=multi,tb-size=256"));
        assert!(has_pair(
            &a,
            "-object",
            "memory-backend-memfd,id=mem,size=1024M,share=on"
        ));
        assert!(has_pair(&a, "-smp", "2"));
        assert!(a.iter().any(|s| s == "-no-reboot"));
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
