//! `vmsight dedup`: create, inspect, check, garbage-collect, export and import dedup volumes
//! (docs/dedup.md). A volume served by a running VM is locked; these commands then say so,
//! except `gc`, which asks that VM (control socket) to collect online.

use std::path::PathBuf;

use clap::Subcommand;
use vmsight_dedup::{parse_size, Volume, VolumeInfo, VolumeOptions};

use crate::cli::CliError;

/// Prints `text` (its final newline is the one `print_stdout` adds).
fn print_stdout(text: &str) -> Result<(), CliError> {
    crate::cli::print_stdout(text.trim_end_matches('\n'))
}

#[derive(Debug, Subcommand)]
pub enum DedupCmd {
    /// Create an empty volume (a directory with a sparse data file and a metadata file).
    Create {
        /// The volume directory (created; must not hold a volume).
        vol: PathBuf,
        /// Logical size the guest sees, e.g. 1GiB (a multiple of 4 KiB).
        #[arg(long, value_parser = parse_size_arg)]
        size: u64,
        /// Fill the new volume from a raw image (e.g. one made with mkfs.ext4); all-zero
        /// blocks stay unmapped.
        #[arg(long, value_name = "RAW")]
        from: Option<PathBuf>,
    },
    /// Logical size, physical use, dedup ratio, index and metadata sizes.
    Info {
        vol: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check reference counts against the map and the index, look for orphan chunks and
    /// verify every indexed chunk's hash; exit status 1 on any inconsistency.
    Check {
        vol: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Free chunks that nothing maps any more (the index still held them); on a volume a
    /// running VM serves, the VM does it online.
    Gc { vol: PathBuf },
    /// Write the volume's logical contents to a raw image (sparse) for e2fsck or debugfs.
    Export { vol: PathBuf, raw: PathBuf },
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).ok_or_else(|| format!("{s:?} is not a size such as 512MiB or 2G"))
}

fn open(vol: &std::path::Path) -> Result<Volume, CliError> {
    Ok(Volume::open(vol, VolumeOptions::default())?)
}

/// Asks the running VM that serves `vol` (by its disk list) to collect the volume's garbage;
/// `None` if no running VM lists it.
fn online_gc(vol: &std::path::Path) -> Result<Option<(String, u64)>, CliError> {
    use vmsight_proto::control::{ControlReply, ControlRequest};
    let canon = |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
    let want = canon(vol);
    let base = vmsight_launcher::runtime::runtime_base();
    let layout = vmsight_proto::layout::RuntimeLayout::at(&base);
    for vm in vmsight_launcher::runtime::list_running(&base) {
        if !vm.disks.iter().any(|d| canon(d) == want) {
            continue;
        }
        let sock = layout.vm(&vm.name).control_socket();
        let req = ControlRequest::DedupGc {
            volume: want.clone(),
        };
        return match vmsight_launcher::control::request(&sock, req)? {
            ControlReply::DedupGc { freed } => Ok(Some((vm.name, freed))),
            ControlReply::Refused(why) => Err(CliError::Other(format!(
                "VM {} serves {} but refused the garbage collection: {why}",
                vm.name,
                vol.display()
            ))),
            other => Err(CliError::Other(format!(
                "VM {} answered the garbage collection with {other:?}",
                vm.name
            ))),
        };
    }
    Ok(None)
}

fn info_text(i: &VolumeInfo) -> String {
    format!(
        "volume        {}\nlogical size  {} MiB ({} blocks of 4 KiB)\nmapped        {} blocks ({} MiB)\n\
         physical use  {} chunks ({} MiB) of {}\ndedup ratio   {:.3}\nspace saved   {} MiB\n\
         index         {} entries, {} MiB on disk\nmetadata      {} MiB, commit generation {}\n",
        i.path.display(),
        i.logical_bytes >> 20,
        i.logical_blocks,
        i.mapped_blocks,
        (i.mapped_blocks * 4096) >> 20,
        i.used_chunks,
        (i.used_chunks * 4096) >> 20,
        i.physical_blocks,
        i.dedup_ratio,
        i.saved_bytes >> 20,
        i.index_entries,
        i.index_bytes >> 20,
        i.meta_bytes >> 20,
        i.generation
    )
}

fn to_json(v: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default() + "\n"
}

/// Runs one `vmsight dedup` command.
pub fn run(cmd: DedupCmd) -> Result<i32, CliError> {
    match cmd {
        DedupCmd::Create { vol, size, from } => {
            Volume::create(&vol, size)?;
            if let Some(raw) = from {
                let mut v = open(&vol)?;
                let n = v.import(&raw)?;
                print_stdout(&format!(
                    "imported {} MiB of non-zero blocks from {}\n",
                    n >> 20,
                    raw.display()
                ))?;
            }
            print_stdout(&format!(
                "created dedup volume {} of {} MiB\n",
                vol.display(),
                size >> 20
            ))?;
            Ok(0)
        }
        DedupCmd::Info { vol, json } => {
            let i = open(&vol)?.info();
            print_stdout(&if json { to_json(&i) } else { info_text(&i) })?;
            Ok(0)
        }
        DedupCmd::Check { vol, json } => {
            let r = open(&vol)?.check()?;
            if json {
                print_stdout(&to_json(&r))?;
            } else {
                let mut t = format!(
                    "{} mapped blocks, {} referenced chunks, {} index entries ({} hashes verified), generation {}{}\n",
                    r.mapped_blocks,
                    r.referenced_chunks,
                    r.index_entries,
                    r.verified_chunks,
                    r.generation,
                    if r.replayed { ", replayed an unfinished commit" } else { "" }
                );
                for p in &r.problems {
                    t.push_str(&format!("problem: {p}\n"));
                }
                if r.problem_count as usize > r.problems.len() {
                    t.push_str(&format!("... {} problems in all\n", r.problem_count));
                }
                t.push_str(if r.is_clean() {
                    "clean\n"
                } else {
                    "INCONSISTENT\n"
                });
                print_stdout(&t)?;
            }
            Ok(if r.is_clean() { 0 } else { 1 })
        }
        DedupCmd::Gc { vol } => {
            let (n, how) = match Volume::open(&vol, VolumeOptions::default()) {
                Ok(mut v) => (v.gc()?, String::new()),
                Err(e @ vmsight_dedup::DedupError::InUse { .. }) => match online_gc(&vol)? {
                    Some((vm, n)) => (n, format!(" online, by VM {vm}")),
                    None => return Err(e.into()),
                },
                Err(e) => return Err(e.into()),
            };
            print_stdout(&format!(
                "freed {n} chunks ({} MiB){how}\n",
                (n * 4096) >> 20
            ))?;
            Ok(0)
        }
        DedupCmd::Export { vol, raw } => {
            let n = open(&vol)?.export(&raw)?;
            print_stdout(&format!(
                "exported {} MiB of mapped blocks to {}\n",
                n >> 20,
                raw.display()
            ))?;
            Ok(0)
        }
    }
}
