//! `vmsight swap NAME status|cache SIZE`: the swap disk of a running VM (`--swap`), its cache
//! in host memory and the guest module's bypass (docs/swapbypass.md).

use clap::{Args, Subcommand};
use vmsight_proto::control::{ControlReply, ControlRequest};
use vmsight_proto::swap::SwapReport;

use crate::cli::{control_socket, print_stdout, CliError};

#[derive(Debug, Args)]
pub(crate) struct SwapArgs {
    /// The VM (`vmsight ps` lists them).
    name: String,
    #[command(subcommand)]
    action: SwapAction,
}

#[derive(Debug, Subcommand)]
enum SwapAction {
    /// The swap disk, the cache (size, use, host memory), the bypass and the guest's own swap
    /// counters.
    Status {
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
    },
    /// Resize the swap cache while the VM runs (e.g. 64M, 1G; bare numbers are MiB; 0 sends
    /// every page to the swap file). Shrinking moves the coldest pages to the swap file and
    /// gives their memory back; no page is lost.
    Cache {
        /// The new size.
        size: String,
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) fn run(a: SwapArgs) -> Result<i32, CliError> {
    let (cache_bytes, json) = match a.action {
        SwapAction::Status { json } => (None, json),
        SwapAction::Cache { size, json } => {
            let bytes = vmsight_launcher::swap::spec::parse_size(&size)
                .map_err(|e| CliError::Other(e.to_string()))?;
            (Some(bytes), json)
        }
    };
    let report = request(&a.name, cache_bytes)?;
    let text = if json {
        serde_json::to_string_pretty(&report).map_err(|e| CliError::Other(e.to_string()))?
    } else {
        format!("VM {}: {}", a.name, report.summary())
    };
    print_stdout(&text)?;
    Ok(0)
}

fn request(name: &str, cache_bytes: Option<u64>) -> Result<SwapReport, CliError> {
    let sock = control_socket(name)?;
    match vmsight_launcher::control::request(&sock, ControlRequest::Swap { cache_bytes })? {
        ControlReply::Swap(r) => Ok(*r),
        ControlReply::Refused(why) => Err(CliError::Other(why)),
        other => Err(CliError::Other(format!(
            "the VM answered a swap request with {other:?}"
        ))),
    }
}
