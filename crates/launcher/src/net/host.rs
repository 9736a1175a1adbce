//! The host side of a VM's NIC: its tap, and in isolated mode the network namespace that
//! holds it with the host end's address, made with iproute2 (`ip netns`, the tool an operator
//! uses, so `ip netns exec` and `vmsight net NAME exec` see the same namespace) and removed
//! with the VM.

use std::path::Path;
use std::process::Command;

use vmsight_netdev::tap::{netns_path, Tap};

use super::spec::{mac_for, NetMode, NetSpec};
use crate::error::LaunchError;

/// The tap's name inside a VM's own namespace.
pub const ISOLATED_TAP: &str = "vmtap0";

/// A network namespace made for one VM; deleted when dropped.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Takes ownership of the existing namespace `name` (deleted when dropped).
    pub fn adopt(name: String) -> Netns {
        Netns { name }
    }

    /// The `ip netns` name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            tracing::warn!("cannot remove network namespace {}: {e}", self.name);
        }
    }
}

/// The `ip netns` name of VM `vm`'s namespace.
pub fn netns_name(vm: &str) -> String {
    format!("vmsight-{vm}")
}

/// A VM's NIC, host side, ready for the device.
#[derive(Debug)]
pub struct HostNet {
    pub spec: NetSpec,
    /// Taken by the device when it starts.
    pub tap: Option<Tap>,
    pub tap_name: String,
    pub mac: String,
    /// Dropped after the device (and QEMU) are gone.
    pub netns: Option<Netns>,
}

/// Runs `ip ARGS`; the error carries its stderr.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (install iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Sets up the host side of VM `vm`'s NIC as `spec` asks; `None` for `--net none`.
pub fn setup(spec: &NetSpec, vm: &str) -> Result<Option<HostNet>, LaunchError> {
    let err = |reason: String| LaunchError::Net {
        vm: vm.to_owned(),
        reason,
    };
    let mac = mac_for(vm);
    let mtu = spec.mtu.to_string();
    let (tap, netns) = match &spec.mode {
        NetMode::None => return Ok(None),
        NetMode::Isolated => {
            let ns = make_netns(vm).map_err(err)?;
            let path = netns_path(ns.name());
            let tap = open_tap(vm, ISOLATED_TAP, Some(&path))?;
            let n = ns.name().to_owned();
            let host = spec.host.map(|h| h.to_string());
            ip(&["-n", &n, "link", "set", "lo", "up"]).map_err(err)?;
            ip(&["-n", &n, "link", "set", ISOLATED_TAP, "mtu", &mtu, "up"]).map_err(err)?;
            if let Some(h) = &host {
                ip(&["-n", &n, "addr", "add", h, "dev", ISOLATED_TAP]).map_err(err)?;
            }
            (tap, Some(ns))
        }
        NetMode::Tap(name) => {
            let tap = open_tap(vm, name, None)?;
            ip(&["link", "set", name, "mtu", &mtu, "up"]).map_err(err)?;
            (tap, None)
        }
        NetMode::Bridge(br) => {
            if !Path::new("/sys/class/net").join(br).join("bridge").exists() {
                return Err(err(format!("{br} is not a bridge on this host")));
            }
            let name = bridge_tap_name(vm);
            let tap = open_tap(vm, &name, None)?;
            ip(&["link", "set", &name, "master", br]).map_err(err)?;
            ip(&["link", "set", &name, "mtu", &mtu, "up"]).map_err(err)?;
            (tap, None)
        }
    };
    Ok(Some(HostNet {
        spec: spec.clone(),
        tap_name: tap.name().to_owned(),
        tap: Some(tap),
        mac,
        netns,
    }))
}

fn open_tap(vm: &str, name: &str, ns: Option<&Path>) -> Result<Tap, LaunchError> {
    Tap::open(name, ns).map_err(|source| LaunchError::NetDevice {
        vm: vm.to_owned(),
        source,
    })
}

/// Makes the VM's namespace, replacing one left by a run that did not clean up (the VM's
/// name is exclusive: its runtime directory is already ours), and removes the namespaces of
/// other VMs that are gone.
fn make_netns(vm: &str) -> Result<Netns, String> {
    sweep_stale_netns(&vmsight_proto::layout::RuntimeLayout::from_env());
    let name = netns_name(vm);
    if netns_path(&name).exists() {
        tracing::info!("removing the stale network namespace {name}");
        ip(&["netns", "del", &name])?;
    }
    ip(&["netns", "add", &name]).map_err(|e| {
        format!("{e} (an isolated network needs root or CAP_SYS_ADMIN; --net none runs without)")
    })?;
    Ok(Netns { name })
}

/// Removes `vmsight-NAME` (and `vmsight-NAME.hylics`) namespaces whose VM is gone: a `vmsight run` killed with SIGKILL
/// never reaches teardown, and its namespace would stay forever. A VM is gone when it has no
/// runtime directory, or its `vm.json` names a process that no longer runs; a directory without
/// `vm.json` is a VM still starting, and its namespace stays. Returns how many went.
pub fn sweep_stale_netns(layout: &vmsight_proto::layout::RuntimeLayout) -> usize {
    let Ok(rd) = std::fs::read_dir("/run/netns") else {
        return 0;
    };
    let mut removed = 0;
    for e in rd.filter_map(Result::ok) {
        let ns = e.file_name().to_string_lossy().into_owned();
        let Some(vm) = ns.strip_prefix("vmsight-") else {
            continue;
        };
        // A VM's Hylics host namespace (`vmsight-NAME.hylics`) goes with the VM.
        let vm = vm.strip_suffix(".hylics").unwrap_or(vm);
        if !vm_is_gone(layout, vm) {
            continue;
        }
        match ip(&["netns", "del", &ns]) {
            Ok(()) => {
                tracing::info!("removed the network namespace {ns} of a VM that is gone");
                removed += 1;
            }
            Err(e) => tracing::debug!("cannot remove {ns}: {e}"),
        }
    }
    removed
}

/// Whether VM `vm` has neither a runtime directory nor a live owner process.
fn vm_is_gone(layout: &vmsight_proto::layout::RuntimeLayout, vm: &str) -> bool {
    let paths = layout.vm(vm);
    if !paths.dir().exists() {
        return true;
    }
    match paths.read_record() {
        Some(r) => !r.owner_alive(),
        None => false,
    }
}

/// The tap of VM `vm` on a bridge: `vms` and 6 hex digits of a hash of the name (15 bytes at
/// most, stable per name).
fn bridge_tap_name(vm: &str) -> String {
    let mac = mac_for(vm);
    format!("vms{}", mac[9..].replace(':', ""))
}

/// Whether this process may create network namespaces and taps (effective root, or the
/// capabilities CAP_NET_ADMIN and CAP_SYS_ADMIN).
pub fn may_isolate() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let caps = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = caps
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    const CAP_NET_ADMIN: u64 = 1 << 12;
    const CAP_SYS_ADMIN: u64 = 1 << 21;
    eff & CAP_NET_ADMIN != 0 && eff & CAP_SYS_ADMIN != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_is_gone_without_a_runtime_dir_or_with_a_dead_owner_and_kept_while_starting() {
        let d = tempfile::tempdir().expect("dir");
        let layout = vmsight_proto::layout::RuntimeLayout::at(d.path());
        assert!(vm_is_gone(&layout, "nodir"));
        std::fs::create_dir(d.path().join("starting")).expect("dir");
        assert!(
            !vm_is_gone(&layout, "starting"),
            "no vm.json yet: still starting"
        );
        for (name, pid) in [("dead", 0x7fff_fff0u32), ("live", std::process::id())] {
            let dir = d.path().join(name);
            std::fs::create_dir(&dir).expect("dir");
            let rec = serde_json::json!({"name": name, "pid": pid});
            std::fs::write(dir.join("vm.json"), rec.to_string()).expect("record");
        }
        assert!(vm_is_gone(&layout, "dead"));
        assert!(!vm_is_gone(&layout, "live"));
    }

    #[test]
    fn bridge_tap_names_fit_and_are_stable() {
        let n = bridge_tap_name("a-rather-long-vm-name-for-a-tap");
        assert!(n.len() <= 15, "{n}");
        assert_eq!(n, bridge_tap_name("a-rather-long-vm-name-for-a-tap"));
        assert!(vmsight_netdev::tap::check_ifname(&n).is_ok());
    }
}
