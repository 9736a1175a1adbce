//! Which guest processes are background: marks by PID or command name, set on the command
//! line (`--background`), on a running VM (`vmsight idle`) or by the guest itself
//! (libvmsight's declaration). Children of a marked process are background too: a block tag
//! carries the submitter's ancestors (TGID and a hash of the comm), and any marked ancestor
//! makes the submitter background. A process's own declaration of "foreground" overrides
//! a marked ancestor.

use std::collections::{BTreeMap, BTreeSet};

use vmsight_proto::control::IdleMark;
use vmsight_ring::blocktag::{comm_hash, BlockTag};

use crate::trace::TraceTarget;

/// Who set a mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `vmsight run --background`.
    Run,
    /// `vmsight idle NAME add`.
    Cli,
    /// The guest program declared itself (libvmsight).
    Guest,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Run => "run",
            Source::Cli => "cli",
            Source::Guest => "guest",
        }
    }
}

/// The marks of one VM.
#[derive(Debug, Default)]
pub struct Marks {
    pids: BTreeMap<u32, Source>,
    /// By comm, with the hash ancestors carry.
    comms: BTreeMap<String, (u32, Source)>,
    /// Processes that declared themselves foreground (they and their children are not
    /// background through an ancestor).
    foreground: BTreeSet<u32>,
}

/// Why a mark cannot be changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MarkError {
    #[error("@cmd names the command of `vmsight run`; mark it with --background @cmd when the VM starts")]
    Command,
    #[error("{0} is not marked background")]
    NotMarked(String),
}

fn describe(t: &TraceTarget) -> String {
    match t {
        TraceTarget::Pid(p) => format!("pid:{p}"),
        TraceTarget::Comm(c) => format!("comm:{c}"),
        TraceTarget::Command => "@cmd".into(),
    }
}

impl Marks {
    /// Marks `target` background (`@cmd` is resolved by the caller to a PID).
    pub fn add(&mut self, target: &TraceTarget, source: Source) -> Result<(), MarkError> {
        match target {
            TraceTarget::Pid(p) => {
                self.foreground.remove(p);
                self.pids.insert(*p, source);
            }
            TraceTarget::Comm(c) => {
                self.comms
                    .insert(c.clone(), (comm_hash(c.as_bytes()), source));
            }
            TraceTarget::Command => return Err(MarkError::Command),
        }
        Ok(())
    }

    /// Removes the mark of `target`.
    pub fn remove(&mut self, target: &TraceTarget) -> Result<(), MarkError> {
        let removed = match target {
            TraceTarget::Pid(p) => self.pids.remove(p).is_some(),
            TraceTarget::Comm(c) => self.comms.remove(c).is_some(),
            TraceTarget::Command => return Err(MarkError::Command),
        };
        if removed {
            Ok(())
        } else {
            Err(MarkError::NotMarked(describe(target)))
        }
    }

    /// A guest process declared itself background (`on`) or foreground.
    pub fn declare(&mut self, tgid: u32, on: bool) {
        if on {
            self.foreground.remove(&tgid);
            self.pids.insert(tgid, Source::Guest);
        } else {
            self.pids.remove(&tgid);
            self.foreground.insert(tgid);
        }
    }

    /// Nothing is marked: every request is foreground.
    pub fn is_empty(&self) -> bool {
        self.pids.is_empty() && self.comms.is_empty()
    }

    /// Whether the submitter of `tag` is background.
    pub fn background(&self, tag: &BlockTag) -> bool {
        if self.pids.contains_key(&tag.tgid) || self.comm_marked(comm_hash(&tag.comm)) {
            return true;
        }
        if self.foreground.contains(&tag.tgid) {
            return false;
        }
        for a in tag.ancestors.iter().take_while(|a| a.tgid != 0) {
            if self.foreground.contains(&a.tgid) {
                return false;
            }
            if self.pids.contains_key(&a.tgid) || self.comm_marked(a.comm_hash) {
                return true;
            }
        }
        false
    }

    fn comm_marked(&self, hash: u32) -> bool {
        self.comms.values().any(|(h, _)| *h == hash)
    }

    /// Every mark, PIDs first.
    pub fn list(&self) -> Vec<IdleMark> {
        let pids = self.pids.iter().map(|(p, s)| IdleMark {
            target: format!("pid:{p}"),
            source: s.name().into(),
        });
        let comms = self.comms.iter().map(|(c, (_, s))| IdleMark {
            target: format!("comm:{c}"),
            source: s.name().into(),
        });
        pids.chain(comms).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_ring::blocktag::Ancestor;

    fn tag(tgid: u32, comm: &str, ancestors: &[(u32, &str)]) -> BlockTag {
        let mut t = BlockTag {
            tgid,
            ..BlockTag::default()
        };
        t.comm[..comm.len()].copy_from_slice(comm.as_bytes());
        for (i, (p, c)) in ancestors.iter().enumerate() {
            t.ancestors[i] = Ancestor {
                tgid: *p,
                comm_hash: comm_hash(c.as_bytes()),
            };
        }
        t
    }

    #[test]
    fn pid_and_comm_marks_cover_the_process_and_its_descendants() {
        let mut m = Marks::default();
        assert!(m.is_empty());
        m.add(&TraceTarget::Pid(100), Source::Cli).expect("add");
        m.add(&TraceTarget::Comm("updatedb".into()), Source::Run)
            .expect("add");
        assert!(m.background(&tag(100, "sh", &[(1, "init")])));
        assert!(m.background(&tag(300, "find", &[(200, "sh"), (100, "sh")])));
        assert!(m.background(&tag(400, "updatedb", &[(1, "init")])));
        assert!(m.background(&tag(401, "sort", &[(400, "updatedb")])));
        assert!(!m.background(&tag(500, "grep", &[(1, "init")])));
        assert_eq!(
            m.list(),
            vec![
                IdleMark {
                    target: "pid:100".into(),
                    source: "cli".into()
                },
                IdleMark {
                    target: "comm:updatedb".into(),
                    source: "run".into()
                }
            ]
        );
        m.remove(&TraceTarget::Pid(100)).expect("remove");
        assert!(!m.background(&tag(100, "sh", &[])));
        assert_eq!(
            m.remove(&TraceTarget::Pid(100)),
            Err(MarkError::NotMarked("pid:100".into()))
        );
        assert_eq!(
            m.add(&TraceTarget::Command, Source::Cli),
            Err(MarkError::Command)
        );
    }

    #[test]
    fn declarations_mark_and_a_foreground_declaration_overrides_an_ancestor() {
        let mut m = Marks::default();
        m.declare(50, true);
        assert!(m.background(&tag(50, "indexer", &[])));
        assert!(m.background(&tag(60, "child", &[(50, "indexer")])));
        m.declare(60, false);
        assert!(!m.background(&tag(60, "child", &[(50, "indexer")])));
        assert!(!m.background(&tag(70, "grandchild", &[(60, "child"), (50, "indexer")])));
        m.declare(50, false);
        assert!(!m.background(&tag(50, "indexer", &[])));
        assert!(m.is_empty());
    }
}
