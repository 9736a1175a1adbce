//! `vmsight cpu NAME redirect ...`: run a guest function on a vCPU of a running VM and put
//! the vCPU back exactly as it was (plugin API v7, QEMU 11.1; docs/platforms.md).

use std::collections::BTreeMap;

use clap::{Args, Subcommand};
use vmsight_proto::control::{ControlReply, ControlRequest};
use vmsight_proto::redirect::{Frame, MemWrite, RedirectOutcome, RedirectRequest, Reg, Trigger};

use crate::cli::{control_socket, print_stdout, CliError};

#[derive(Debug, Args)]
pub(crate) struct CpuArgs {
    /// The VM (`vmsight ps` lists them).
    name: String,
    #[command(subcommand)]
    action: CpuAction,
}

#[derive(Debug, Subcommand)]
enum CpuAction {
    /// Take a vCPU at the next syscall of process PID (which must be monitored, e.g. `vmsight
    /// run --trace @cmd`), call the function at ENTRY with the arguments, and restore every
    /// register when it returns to a return marker (`nopl 0x564d5352(%rax)`) at RETURN.
    Redirect(RedirectArgs),
}

#[derive(Debug, Args)]
struct RedirectArgs {
    /// The guest process (TGID) whose next syscall is the trigger.
    #[arg(long)]
    pid: u32,
    /// The guest function's address (hex with 0x, or decimal).
    #[arg(long, value_parser = parse_u64)]
    entry: u64,
    /// The return address pushed for the function: an address holding the return marker.
    /// Without it no frame is built (set rsp yourself with --set, or return by other means).
    #[arg(long = "return", value_parser = parse_u64)]
    return_to: Option<u64>,
    /// Bytes left untouched below the stack pointer before the frame (the System V red zone).
    #[arg(long, default_value_t = 128, value_parser = parse_u64)]
    reserve: u64,
    /// Arguments in rdi, rsi, rdx, rcx, r8, r9 (repeat, up to six).
    #[arg(long = "arg", value_parser = parse_u64)]
    args: Vec<u64>,
    /// Other registers to set: REG=VALUE (gdb names: rax..r15, eflags, fs_base, gs_base,
    /// k_gs_base); repeat.
    #[arg(long = "set", value_parser = parse_set)]
    set: Vec<(Reg, u64)>,
    /// Guest memory to write first: ADDR=HEXBYTES (up to 256 bytes).
    #[arg(long, value_parser = parse_write)]
    write: Option<MemWrite>,
    /// How long to wait for the trigger and the return, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// Print the outcome as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) fn parse_u64(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("{s:?} is not a number (hex with 0x, or decimal)"))
}

fn parse_set(s: &str) -> Result<(Reg, u64), String> {
    let (name, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not REG=VALUE"))?;
    let reg = Reg::parse(name.trim()).ok_or_else(|| {
        let names: Vec<&str> = Reg::ALL.iter().map(|r| r.name()).collect();
        format!(
            "{name:?} is not a register that can be set (one of {})",
            names.join(", ")
        )
    })?;
    Ok((reg, parse_u64(value)?))
}

fn parse_write(s: &str) -> Result<MemWrite, String> {
    let (addr, hex) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not ADDR=HEXBYTES"))?;
    let hex = hex.trim();
    if hex.is_empty() || hex.len() % 2 != 0 {
        return Err(format!("{hex:?} is not an even number of hex digits"));
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| format!("{hex:?} is not hex"))?;
    Ok(MemWrite {
        addr: parse_u64(addr)?,
        bytes,
    })
}

impl RedirectArgs {
    fn request(&self) -> Result<RedirectRequest, CliError> {
        if self.args.len() > Reg::ARGS.len() {
            return Err(CliError::Other(format!(
                "at most {} --arg values fit the argument registers, not {}",
                Reg::ARGS.len(),
                self.args.len()
            )));
        }
        let mut regs: BTreeMap<Reg, u64> = Reg::ARGS
            .iter()
            .copied()
            .zip(self.args.iter().copied())
            .collect();
        for (r, v) in &self.set {
            if regs.insert(*r, *v).is_some() {
                return Err(CliError::Other(format!(
                    "register {} is set twice (by --arg and --set, or two --set)",
                    r.name()
                )));
            }
        }
        let req = RedirectRequest {
            trigger: Trigger::Syscall { tgid: self.pid },
            entry: self.entry,
            frame: self.return_to.map(|return_to| Frame {
                return_to,
                reserve: self.reserve,
            }),
            regs,
            memory: self.write.clone(),
            timeout_ms: self.timeout_ms,
        };
        req.validate().map_err(|e| CliError::Other(e.to_string()))?;
        Ok(req)
    }
}

/// `vmsight cpu NAME ...`: exit 0 when the function returned and every register was
/// restored, 1 when the restore check found a difference.
pub(crate) fn run(a: CpuArgs) -> Result<i32, CliError> {
    let CpuAction::Redirect(r) = a.action;
    let req = r.request()?;
    let sock = control_socket(&a.name)?;
    let o = match vmsight_launcher::control::request(&sock, ControlRequest::Redirect(req))? {
        ControlReply::Redirected(o) => o,
        other => {
            return Err(CliError::Other(format!(
                "unexpected answer from the VM: {other:?}"
            )))
        }
    };
    let text = if r.json {
        serde_json::to_string_pretty(&o).unwrap_or_default()
    } else {
        describe(&o)
    };
    print_stdout(&text)?;
    Ok(
        if o.restore_mismatch.as_ref().is_some_and(|m| !m.is_empty()) {
            1
        } else {
            0
        },
    )
}

fn describe(o: &RedirectOutcome) -> String {
    let reg = |m: &BTreeMap<Reg, u64>, r: Reg| m.get(&r).copied().unwrap_or(0);
    let restore = match &o.restore_mismatch {
        Some(m) if m.is_empty() => format!(
            "every register restored exactly ({} checked when the vCPU came back)",
            Reg::ALL.len()
        ),
        Some(m) => {
            let found: Vec<String> = m
                .iter()
                .map(|r| {
                    format!(
                        "{} (saved {:#x}, found {:#x})",
                        r.name(),
                        reg(&o.saved, *r),
                        reg(&o.at_check, *r)
                    )
                })
                .collect();
            format!("DIFFERENT after the restore: {}", found.join(", "))
        }
        None => "restored (the plugin did not see the vCPU come back to check)".into(),
    };
    format!(
        "redirected vCPU {} at {:#x} (returned on vCPU {}) after {:.3} ms\n  result: rax={:#x} \
         rdx={:#x}\n  restore: {restore}",
        o.vcpu,
        o.pc,
        o.return_vcpu,
        o.elapsed_ns as f64 / 1e6,
        reg(&o.at_return, Reg::Rax),
        reg(&o.at_return, Reg::Rdx),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_registers_and_bytes_parse() {
        assert_eq!(parse_u64("0x10"), Ok(16));
        assert_eq!(parse_u64("42"), Ok(42));
        assert!(parse_u64("zz").is_err());
        assert_eq!(parse_set("r12=0x5"), Ok((Reg::R12, 5)));
        assert!(parse_set("rip=1")
            .unwrap_err()
            .contains("not a register that can be set"));
        assert!(parse_set("rax").is_err());
        let w = parse_write("0x1000=00ff").unwrap();
        assert_eq!((w.addr, w.bytes), (0x1000, vec![0, 0xff]));
        assert!(parse_write("0x1000=0").is_err());
        assert!(parse_write("0x1000=zz").is_err());
    }

    fn args() -> RedirectArgs {
        RedirectArgs {
            pid: 5,
            entry: 0x401000,
            return_to: Some(0x402000),
            reserve: 128,
            args: vec![1, 2],
            set: vec![],
            write: None,
            timeout_ms: 1000,
            json: false,
        }
    }

    #[test]
    fn arguments_become_a_system_v_call() {
        let req = args().request().unwrap();
        assert_eq!(req.regs[&Reg::Rdi], 1);
        assert_eq!(req.regs[&Reg::Rsi], 2);
        assert_eq!(req.frame.unwrap().return_to, 0x402000);
        let mut a = args();
        a.set = vec![(Reg::Rdi, 9)];
        assert!(a.request().unwrap_err().to_string().contains("set twice"));
        let mut a = args();
        a.args = vec![0; 7];
        assert!(a.request().unwrap_err().to_string().contains("at most 6"));
        let mut a = args();
        a.set = vec![(Reg::Rsp, 9)];
        assert!(a.request().unwrap_err().to_string().contains("rsp"));
    }

    #[test]
    fn a_restore_mismatch_is_described_with_the_saved_and_found_values() {
        let regs = |v: u64| Reg::ALL.iter().map(|r| (*r, v)).collect::<BTreeMap<_, _>>();
        let mut o = RedirectOutcome {
            vcpu: 1,
            return_vcpu: 0,
            pc: 0x401000,
            elapsed_ns: 2_000_000,
            saved: regs(0x202),
            at_return: regs(7),
            restore_mismatch: Some(vec![]),
            at_check: BTreeMap::new(),
        };
        assert!(describe(&o).contains("every register restored exactly"));
        o.restore_mismatch = Some(vec![Reg::Eflags]);
        o.at_check = [(Reg::Eflags, 0x203)].into_iter().collect();
        let text = describe(&o);
        assert!(
            text.contains("DIFFERENT after the restore: eflags (saved 0x202, found 0x203)"),
            "{text}"
        );
        o.restore_mismatch = None;
        assert!(describe(&o).contains("did not see the vCPU come back"));
    }
}
