//! `vmsight idle NAME add|remove|list [TARGET]`: FoxyIdle's background marks on a running VM.

use clap::{Args, ValueEnum};
use vmsight_proto::control::{ControlReply, ControlRequest, IdleAction, IdleMark};

use crate::cli::{control_socket, print_stdout, CliError};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Action {
    /// Mark TARGET background.
    Add,
    /// Remove TARGET's mark.
    Remove,
    /// Print the marks.
    List,
}

#[derive(Debug, Args)]
pub(crate) struct IdleArgs {
    /// The VM (`vmsight ps` lists them).
    name: String,
    action: Action,
    /// A guest PID or command name (comm); add and remove need it.
    target: Option<String>,
}

pub(crate) fn run(a: IdleArgs) -> Result<i32, CliError> {
    let action = match a.action {
        Action::Add => IdleAction::Add,
        Action::Remove => IdleAction::Remove,
        Action::List => IdleAction::List,
    };
    if !matches!(action, IdleAction::List) && a.target.is_none() {
        return Err(
            "vmsight idle add and remove need a TARGET (a guest PID or command name)".into(),
        );
    }
    if let Some(t) = &a.target {
        // The same syntax as --background; @cmd exists only when the VM starts.
        t.parse::<vmsight_launcher::trace::TraceTarget>()
            .map_err(|e| CliError::Other(e.to_string()))?;
    }
    let sock = control_socket(&a.name)?;
    let req = ControlRequest::Idle {
        action,
        target: a.target,
    };
    match vmsight_launcher::control::request(&sock, req)? {
        ControlReply::IdleMarks(marks) => {
            print_stdout(&format_marks(&marks))?;
            Ok(0)
        }
        ControlReply::Refused(why) => Err(CliError::Other(why)),
        other => Err(CliError::Other(format!(
            "the VM answered an idle request with {other:?}"
        ))),
    }
}

/// One line per mark: `pid:1234 (cli)`; a note when there is none.
fn format_marks(marks: &[IdleMark]) -> String {
    if marks.is_empty() {
        return "no background marks".into();
    }
    marks
        .iter()
        .map(|m| format!("{} ({})", m.target, m.source))
        .collect::<Vec<_>>()
        .join("\n")
}
