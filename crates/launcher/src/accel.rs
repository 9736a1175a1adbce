//! Chooses the accelerator: hardware KVM only when it can run a stock kernel, TCG otherwise.
//!
//! On the machines vmsight is developed on, `/dev/kvm` is provided by the PVM hypervisor
//! (`kvm_pvm`), which only runs PVM-enabled guest kernels; a stock Debian kernel dies in it. So
//! the presence of `/dev/kvm` alone is not enough: the module behind it must be a hardware one.

use std::fmt;
use std::path::Path;

/// The accelerator QEMU runs the guest with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Multi-threaded TCG: one host thread per vCPU; the vmsight plugin runs.
    Tcg,
    /// Hardware KVM (kvm_intel/kvm_amd): plugins do not run, CPU-side introspection is off.
    Kvm,
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Accel::Tcg => write!(f, "tcg"),
            Accel::Kvm => write!(f, "kvm"),
        }
    }
}

/// What was detected, and why this accelerator was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccelChoice {
    pub accel: Accel,
    pub reason: String,
}

/// Why the requested accelerator cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccelError {
    /// `--accel kvm`, but no usable hardware KVM.
    #[error("KVM was requested but cannot be used: {0}")]
    KvmUnusable(&'static str),
}

/// The user's request on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AccelRequest {
    #[default]
    Auto,
    Tcg,
    Kvm,
}

/// Decides the accelerator from `/dev/kvm` and the kernel's modules. `/sys/module` is used
/// rather than `/proc/modules` because it also lists built-in modules (the PVM host kernel here
/// has kvm_pvm built in and no `/proc/modules` at all).
pub fn choose(request: AccelRequest) -> Result<AccelChoice, AccelError> {
    let mut modules = std::fs::read_to_string("/proc/modules").unwrap_or_default();
    if let Ok(rd) = std::fs::read_dir("/sys/module") {
        for e in rd.flatten() {
            modules.push_str(&e.file_name().to_string_lossy());
            modules.push('\n');
        }
    }
    choose_from(request, Path::new("/dev/kvm").exists(), &modules)
}

fn loaded_modules(proc_modules: &str) -> impl Iterator<Item = &str> {
    proc_modules
        .lines()
        .filter_map(|l| l.split_whitespace().next())
}

/// Pure decision function, separated for testing.
pub fn choose_from(
    request: AccelRequest,
    dev_kvm: bool,
    proc_modules: &str,
) -> Result<AccelChoice, AccelError> {
    let pvm = loaded_modules(proc_modules).any(|m| m == "kvm_pvm");
    let hw = loaded_modules(proc_modules).any(|m| m == "kvm_intel" || m == "kvm_amd");
    let hw_usable = dev_kvm && hw && !pvm;
    let why_not = if !dev_kvm {
        "no /dev/kvm"
    } else if pvm {
        "/dev/kvm is the PVM hypervisor (kvm_pvm), which cannot run a stock kernel"
    } else {
        "/dev/kvm has no hardware KVM module (kvm_intel/kvm_amd) behind it"
    };
    match request {
        AccelRequest::Tcg => Ok(AccelChoice {
            accel: Accel::Tcg,
            reason: "TCG requested".into(),
        }),
        AccelRequest::Kvm if hw_usable => Ok(AccelChoice {
            accel: Accel::Kvm,
            reason: "KVM requested and hardware KVM is available".into(),
        }),
        AccelRequest::Kvm => Err(AccelError::KvmUnusable(why_not)),
        AccelRequest::Auto if hw_usable => Ok(AccelChoice {
            accel: Accel::Kvm,
            reason: "hardware KVM detected (the TCG plugin does not run under KVM)".into(),
        }),
        AccelRequest::Auto => Ok(AccelChoice {
            accel: Accel::Tcg,
            reason: format!("TCG: {why_not}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PVM: &str = "kvm_pvm 1234 0 - Live 0x0\nkvm 1000 1 kvm_pvm, Live 0x0\n";
    const INTEL: &str = "kvm_intel 1234 0 - Live 0x0\nkvm 1000 1 kvm_intel, Live 0x0\n";

    #[test]
    fn pvm_kvm_falls_back_to_tcg_with_reason() {
        let c = choose_from(AccelRequest::Auto, true, PVM).unwrap();
        assert_eq!(c.accel, Accel::Tcg);
        assert!(c.reason.contains("PVM"), "{}", c.reason);
    }

    #[test]
    fn hardware_kvm_is_used_in_auto_mode() {
        let c = choose_from(AccelRequest::Auto, true, INTEL).unwrap();
        assert_eq!(c.accel, Accel::Kvm);
    }

    #[test]
    fn kvm_request_without_hardware_is_an_error() {
        let e = choose_from(AccelRequest::Kvm, false, "").unwrap_err();
        assert_eq!(
            e.to_string(),
            "KVM was requested but cannot be used: no /dev/kvm"
        );
        assert!(choose_from(AccelRequest::Kvm, true, PVM).is_err());
    }

    #[test]
    fn tcg_request_is_always_honoured() {
        let c = choose_from(AccelRequest::Tcg, true, INTEL).unwrap();
        assert_eq!(c.accel, Accel::Tcg);
    }
}
