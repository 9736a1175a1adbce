//! `vmsight`: see inside unmodified VMs. See `vmsight --help` and README.md.

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    let code = cli::main();
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}
