//! `vmsight hylics NAME path|info|resize SIZE|controller`: the shared in-memory file system of a
//! running VM and its controller; `vmsight hylics-replay LOG`: a controller log re-run
//! (docs/hylics.md).

use clap::{Args, Subcommand};
use vmsight_proto::control::{ControlReply, ControlRequest};
use vmsight_proto::hylics::{ControllerStatus, ShareInfo};

use crate::cli::{control_socket, print_stdout, CliError};

#[derive(Debug, Args)]
pub(crate) struct HylicsArgs {
    /// The VM (`vmsight ps` lists them).
    name: String,
    #[command(subcommand)]
    action: HylicsAction,
}

#[derive(Debug, Subcommand)]
enum HylicsAction {
    /// Print the host directory that holds the VM's share (host tools read and write there).
    Path,
    /// Size, use, guest mount point and cache mode of the share.
    Info {
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
    },
    /// Change the share's size limit while the VM runs (e.g. 512M, 2G); shrinking below what
    /// is in use is refused.
    Resize {
        /// The new size.
        size: String,
    },
    /// The share-size controller (`--hylics-slo`): target size, last response time, decisions.
    Controller {
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// The log (`vmsight run --hylics-slo ...,log=FILE`).
    log: std::path::PathBuf,
    /// Print every replayed decision as a JSON line.
    #[arg(long)]
    json: bool,
}

/// `vmsight hylics-replay LOG`: exit 0 when every logged decision is reproduced, 1 (with the
/// first difference) when not.
pub(crate) fn replay(a: ReplayArgs) -> Result<i32, CliError> {
    let text = std::fs::read_to_string(&a.log)
        .map_err(|e| CliError::Other(format!("cannot read {}: {e}", a.log.display())))?;
    let file = vmsight_hylics::LogFile::parse(&text)
        .map_err(|e| CliError::Other(format!("{}: {e}", a.log.display())))?;
    let decisions = file
        .replay()
        .map_err(|e| CliError::Other(format!("{}: {e}", a.log.display())))?;
    if a.json {
        for d in &decisions {
            print_stdout(&serde_json::to_string(d).map_err(|e| CliError::Other(e.to_string()))?)?;
        }
    }
    let last_mib = decisions
        .last()
        .map_or(file.config.m_initial_bytes, |d| d.m_after_bytes) as f64
        / (1u64 << 20) as f64;
    eprintln!(
        "{}: {} decisions of mode {} reproduced (final size {last_mib:.1} MiB)",
        a.log.display(),
        decisions.len(),
        file.config.mode
    );
    Ok(0)
}

pub(crate) fn run(a: HylicsArgs) -> Result<i32, CliError> {
    match a.action {
        HylicsAction::Path => {
            print_stdout(&share_info(&a.name)?.host_path)?;
            Ok(0)
        }
        HylicsAction::Info { json } => {
            let info = share_info(&a.name)?;
            let text = if json {
                serde_json::to_string_pretty(&info).map_err(|e| CliError::Other(e.to_string()))?
            } else {
                format_info(&a.name, &info)
            };
            print_stdout(&text)?;
            Ok(0)
        }
        HylicsAction::Resize { size } => {
            let bytes = vmsight_launcher::hylics::spec::parse_size(&size)
                .map_err(|e| CliError::Other(e.to_string()))?;
            let sock = control_socket(&a.name)?;
            match vmsight_launcher::control::request(&sock, ControlRequest::ShareResize { bytes })?
            {
                ControlReply::Share(info) => {
                    print_stdout(&format_info(&a.name, &info))?;
                    Ok(0)
                }
                ControlReply::Refused(why) => Err(CliError::Other(why)),
                other => Err(CliError::Other(format!(
                    "the VM answered a resize request with {other:?}"
                ))),
            }
        }
        HylicsAction::Controller { json } => {
            let status = controller_status(&a.name)?;
            let text = if json {
                serde_json::to_string_pretty(&status).map_err(|e| CliError::Other(e.to_string()))?
            } else {
                format!(
                    "VM {}: {}",
                    a.name,
                    vmsight_launcher::hylics::control::summary(&status)
                )
            };
            print_stdout(&text)?;
            Ok(0)
        }
    }
}

fn controller_status(name: &str) -> Result<ControllerStatus, CliError> {
    let sock = control_socket(name)?;
    match vmsight_launcher::control::request(&sock, ControlRequest::HylicsController)? {
        ControlReply::Controller(s) => Ok(s),
        ControlReply::Refused(why) => Err(CliError::Other(why)),
        other => Err(CliError::Other(format!(
            "the VM answered a controller request with {other:?}"
        ))),
    }
}

/// The running VM's `hylics.json`, with the use read now.
fn share_info(name: &str) -> Result<ShareInfo, CliError> {
    vmsight_launcher::config::validate_name(name)?;
    let paths = vmsight_proto::layout::RuntimeLayout::from_env().vm(name);
    if !paths.control_socket().exists() {
        return Err(CliError::NoSuchVm(name.to_owned()));
    }
    let mut info = paths.read_hylics_info().ok_or_else(|| {
        CliError::Other(format!(
            "VM {name} has no shared in-memory file system (start it with --shared-mem SIZE)"
        ))
    })?;
    if let Ok(st) = nix::sys::statvfs::statvfs(info.host_path.as_str()) {
        info.used_bytes = (st.blocks() - st.blocks_free()) * st.fragment_size();
        info.files = st.files() - st.files_free();
    }
    Ok(info)
}

fn format_info(name: &str, i: &ShareInfo) -> String {
    format!(
        "VM {name}: share at {} in the guest (virtio-fs tag {}), host directory {}\n\
         size {} KiB, {} KiB used, {} files, {} resizes, cache {}",
        i.guest_path,
        i.tag,
        i.host_path,
        i.size_bytes / 1024,
        i.used_bytes / 1024,
        i.files,
        i.resizes,
        i.cache
    )
}
