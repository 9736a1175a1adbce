//! `vmsight net NAME info|exec`: the network of a running VM (docs/network.md).

use std::os::unix::process::CommandExt;

use clap::{Args, Subcommand};
use vmsight_proto::net::NetInfo;

use crate::cli::{print_stdout, CliError};

#[derive(Debug, Args)]
pub(crate) struct NetArgs {
    /// The VM (`vmsight ps` lists them).
    name: String,
    #[command(subcommand)]
    action: NetAction,
}

#[derive(Debug, Subcommand)]
enum NetAction {
    /// How the VM's NIC is attached: namespace, tap, addresses, MAC, stages.
    Info {
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run a host command inside the VM's network namespace (isolated networks), e.g. a
    /// server the guest reaches at its gateway, or tcpdump on the host end (`vmtap0`).
    Exec {
        /// The command and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
}

pub(crate) fn run(a: NetArgs) -> Result<i32, CliError> {
    let info = net_info(&a.name)?;
    match a.action {
        NetAction::Info { json } => {
            let text = if json {
                serde_json::to_string_pretty(&info).map_err(|e| CliError::Other(e.to_string()))?
            } else {
                format_info(&a.name, &info)
            };
            print_stdout(&text)?;
            Ok(0)
        }
        NetAction::Exec { command } => exec_in(&a.name, &info, &command),
    }
}

/// The running VM's `net.json`.
fn net_info(name: &str) -> Result<NetInfo, CliError> {
    vmsight_launcher::config::validate_name(name)?;
    let paths = vmsight_proto::layout::RuntimeLayout::from_env().vm(name);
    if !paths.control_socket().exists() {
        return Err(CliError::NoSuchVm(name.to_owned()));
    }
    paths.read_net_info().ok_or_else(|| {
        CliError::Other(format!(
            "VM {name} has no network (it runs with --net none)"
        ))
    })
}

/// Replaces this process with `command`, run in the VM's namespace; returns only on failure.
fn exec_in(name: &str, info: &NetInfo, command: &[String]) -> Result<i32, CliError> {
    let Some(ns) = &info.netns else {
        return Err(CliError::Other(format!(
            "VM {name}'s network is {} ({}): there is no namespace of its own; run the command directly",
            info.mode, info.tap
        )));
    };
    let path = vmsight_netdev::tap::netns_path(ns);
    vmsight_netdev::tap::enter_netns(&path).map_err(|e| CliError::Other(e.to_string()))?;
    let (prog, args) = command
        .split_first()
        .ok_or_else(|| CliError::Other("vmsight net exec needs a command".into()))?;
    let err = std::process::Command::new(prog).args(args).exec();
    Err(CliError::Other(format!("cannot run {prog}: {err}")))
}

fn format_info(name: &str, i: &NetInfo) -> String {
    let mut s = format!("VM {name}: {} network\n", i.mode);
    if let Some(ns) = &i.netns {
        s.push_str(&format!(
            "  namespace: {ns} (vmsight net {name} exec CMD...)\n"
        ));
    }
    s.push_str(&format!("  tap: {}", i.tap));
    if let Some(b) = &i.bridge {
        s.push_str(&format!(" on bridge {b}"));
    }
    s.push('\n');
    if let Some(h) = &i.host_addr {
        s.push_str(&format!("  host end: {h}\n"));
    }
    s.push_str(&format!(
        "  guest: {} mac {} mtu {}",
        i.guest_addr
            .as_deref()
            .unwrap_or("(no address set by vmsight)"),
        i.mac,
        i.mtu
    ));
    if let Some(g) = &i.gateway {
        s.push_str(&format!(" gateway {g}"));
    }
    s.push('\n');
    s.push_str(&format!(
        "  offloads: {}\n  stages: {}",
        if i.offloads { "checksum, TSO" } else { "off" },
        i.stages.join(", ")
    ));
    s
}
