//! Resolving a batch into events: directory diffs matched by inode number (renames across
//! directories, links), attribute diffs, and data claimed from the pending set.

use super::state::{self, Entries, Inode};
use super::{Batch, Engine};
use crate::event::{EventKind, FsEvent, Value};
use crate::index::{FileKind, InodeMeta, NO_BLOCK, RUN_DATA, RUN_UNWRITTEN};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Deepest path followed (as the index).
const MAX_DEPTH: usize = 4096;
/// Largest directory (in blocks) re-read when it changes.
const MAX_DIR_BLOCKS: u64 = 1 << 18;

/// One entry that appeared or disappeared: directory, name, inode, file-type byte.
type Change = (u32, Vec<u8>, u32, u8);

/// Entries of one directory by block index.
type BlockEntries = BTreeMap<u64, Entries>;

/// A directory's entries after the batch, and the per-block form when it is kept.
type NewDir = (u32, Entries, Option<BlockEntries>);

/// The entry changes of one batch and the names they had before it.
struct NameChanges {
    removed: Vec<Change>,
    added: Vec<Change>,
    /// Path of each removed entry before the batch.
    old_paths: Vec<Option<String>>,
    /// Path each added inode had before the batch (`None`: none, or the inode is new).
    had_name: HashMap<u32, Option<String>>,
}

/// The name events of one batch as they are collected, before they are ordered.
struct NameEvents {
    txn: Option<u32>,
    ns: u64,
    deletes: Vec<FsEvent>,
    creates: Vec<FsEvent>,
    /// Inodes that got a name.
    named: BTreeSet<u32>,
}

fn join(dir: &str, name: &[u8]) -> String {
    let n = String::from_utf8_lossy(name);
    if dir == "/" {
        format!("/{n}")
    } else {
        format!("{dir}/{n}")
    }
}

fn depth(p: &str) -> usize {
    p.matches('/').count()
}

impl Engine {
    /// Entries of directory `d` as stored (overlay, else the index).
    pub(super) fn entries_of(&self, d: u32) -> Entries {
        if let Some(e) = self.dirs.get(&d) {
            return e.clone();
        }
        self.index
            .read_dir(d)
            .unwrap_or_default()
            .into_iter()
            .map(|e| (e.name.to_vec(), (e.ino, state::ftype_of(e.kind))))
            .collect()
    }

    /// The name used for `ino`'s path: (directory, entry name).
    fn primary(&self, ino: u32) -> Option<(u32, Vec<u8>)> {
        if let Some(l) = self.links.get(&ino) {
            return l.clone();
        }
        self.index
            .primary(ino)
            .map(|(dir, name)| (dir, name.into_owned()))
    }

    /// Current absolute path of `ino` (as of the last resolved batch).
    pub(super) fn path_of(&self, ino: u32) -> Option<String> {
        let mut parts: Vec<Vec<u8>> = Vec::new();
        let mut cur = ino;
        for _ in 0..MAX_DEPTH {
            if cur == 2 {
                let mut s = String::new();
                for p in parts.iter().rev() {
                    s.push('/');
                    s.push_str(&String::from_utf8_lossy(p));
                }
                if s.is_empty() {
                    s.push('/');
                }
                return Some(s);
            }
            let (d, n) = self.primary(cur)?;
            parts.push(n);
            cur = d;
        }
        None
    }

    /// Another existing name of `ino` (after its primary one went away).
    fn find_link(&self, ino: u32) -> Option<(u32, Vec<u8>)> {
        for (d, es) in &self.dirs {
            if let Some((n, _)) = es.iter().find(|(_, (i, _))| *i == ino) {
                return Some((*d, n.clone()));
            }
        }
        self.index
            .names_of(ino)
            .into_iter()
            .find(|(d, _)| !self.dirs.contains_key(d))
    }

    /// Read directory `d` as it is now (committed copies, then disk); `None` if a block is
    /// malformed (the directory keeps its stored entries until it parses).
    fn read_dir_now(&self, inode: &Inode) -> Option<Entries> {
        let mut out = Entries::new();
        if inode.inline {
            let ok = state::parse_inline_dir(inode.blob.as_deref().unwrap_or(&[]), &mut out);
            return ok.then_some(out);
        }
        let nblocks = inode.meta.size.div_ceil(self.bs).min(MAX_DIR_BLOCKS);
        for r in inode.runs.iter().filter(|r| r.kind() == RUN_DATA) {
            let first = u64::from(r.logical);
            if first >= nblocks {
                continue;
            }
            for k in 0..u64::from(r.len).min(nblocks - first) {
                let blk = self.read_block(r.phys() + k)?;
                if !state::parse_dir_block(&blk, &mut out) {
                    return None;
                }
            }
        }
        Some(out)
    }

    /// Per-block entries of directory `d` as stored, when every entry's block is known.
    fn stored_blocks(&self, d: u32) -> Option<BlockEntries> {
        if let Some(b) = self.dir_blocks.get(&d) {
            return Some(b.clone());
        }
        if self.dirs.contains_key(&d) {
            // Resolved before without block positions (inline, or read whole).
            return None;
        }
        let Some(records) = self.index.dir_records(d) else {
            // Not a directory at crawl time: all its blocks arrive as writes.
            return Some(BTreeMap::new());
        };
        let mut out = BlockEntries::new();
        let mut unplaced = false;
        for (name, e) in records {
            if e.block == NO_BLOCK {
                unplaced = true;
                continue;
            }
            out.entry(u64::from(e.block))
                .or_default()
                .insert(name, (e.ino, e.file_type));
        }
        if unplaced {
            // Entries of an inline directory (none of its blocks exist yet) or of a block past
            // the recorded range.
            let was_inline = out.is_empty()
                && !self
                    .index_runs(d)
                    .iter()
                    .any(|r| r.kind() & !RUN_UNWRITTEN == RUN_DATA);
            return was_inline.then(BTreeMap::new);
        }
        Some(out)
    }

    /// Entries of directory `d` (inode `i`) after this batch's block writes, and the per-block
    /// form when it is kept; `None` if it cannot be read.
    fn dir_after_writes(
        &mut self,
        d: u32,
        i: &Inode,
        writes: &BTreeMap<(u32, u64), Vec<u8>>,
    ) -> Option<(Entries, Option<BlockEntries>)> {
        if i.inline {
            let mut e = Entries::new();
            if !state::parse_inline_dir(i.blob.as_deref().unwrap_or(&[]), &mut e) {
                return None;
            }
            return Some((e, None));
        }
        let Some(mut blocks) = self.stored_blocks(d) else {
            return self.read_dir_now(i).map(|e| (e, None));
        };
        for ((_, fb), content) in writes.range((d, 0)..=(d, u64::MAX)) {
            let mut e = Entries::new();
            if state::parse_dir_block(content, &mut e) {
                blocks.insert(*fb, e);
            } else {
                // A torn or foreign block: keep its stored entries.
                self.c.meta_errors += 1;
            }
        }
        // Blocks no longer in the directory (it shrank or was converted) hold nothing.
        let nblocks = i.meta.size.div_ceil(self.bs);
        blocks.retain(|fb, _| {
            *fb < nblocks
                && i.runs.iter().any(|r| {
                    r.kind() == RUN_DATA
                        && *fb >= u64::from(r.logical)
                        && *fb < u64::from(r.logical) + u64::from(r.len)
                })
        });
        let mut all = Entries::new();
        for e in blocks.values() {
            for (n, v) in e {
                all.insert(n.clone(), *v);
            }
        }
        Some((all, Some(blocks)))
    }

    fn event(
        &mut self,
        kind: EventKind,
        path: String,
        ino: u32,
        txn: Option<u32>,
        ns: u64,
    ) -> FsEvent {
        FsEvent {
            kind,
            path,
            old_path: None,
            ino,
            old: None,
            new: None,
            range: None,
            data: None,
            txn,
            observed_ns: ns,
        }
    }

    /// Resolve the open batch into events and make its state the consistent one.
    pub(super) fn resolve(&mut self, txn: Option<u32>, ns: u64, out: &mut Vec<FsEvent>) {
        if self.batch.is_empty() {
            return;
        }
        let mut batch = std::mem::take(&mut self.batch);
        self.claim_dir_blocks(&mut batch);

        // 1. Diff the dirty directories against their stored entries.
        let (removed, added, new_dirs) = self.diff_dirs(&batch);
        // 2. Names as they were.
        let mut ch = self.names_before(removed, added);
        // 3. Apply.
        self.apply_dirs(new_dirs, &ch);
        // 4. Name events, matched by inode.
        let named = self.name_events(&batch, &mut ch, txn, ns, out);
        // 5. Attribute events of inodes that existed before the batch and still do.
        self.attr_events(&batch, &named, &ch.had_name, txn, ns, out);

        // 6. Data that waited for these inodes' metadata.
        let claim: BTreeSet<u32> = batch.claims.iter().copied().chain(named).collect();
        for ino in claim {
            self.claim(ino, txn, ns, out);
        }
    }

    /// Move directory blocks that waited in the pending set for their directory's map into
    /// the batch's directory writes.
    fn claim_dir_blocks(&mut self, batch: &mut Batch) {
        for &ino in &batch.claims {
            let Some(i) = self.stored_inode(ino) else {
                continue;
            };
            if i.kind() != FileKind::Directory {
                continue;
            }
            for r in i.runs.iter().filter(|r| r.kind() == RUN_DATA) {
                for (b, p) in self.pending.take_range(r.phys(), u64::from(r.len)) {
                    self.c.claimed += 1;
                    let fb = u64::from(r.logical) + (b - r.phys());
                    // Kept without its bytes: the disk has it (or something newer).
                    let data = if p.data.is_empty() {
                        match self.read_block(b) {
                            Some(d) => d,
                            None => {
                                self.c.meta_errors += 1;
                                continue;
                            }
                        }
                    } else {
                        p.data
                    };
                    batch.dir_writes.insert((ino, fb), data);
                    batch.dirty_dirs.insert(ino);
                }
            }
        }
    }

    /// Diff the batch's dirty directories against their stored entries: the entries removed,
    /// the entries added, and each directory's new contents.
    fn diff_dirs(&mut self, batch: &Batch) -> (Vec<Change>, Vec<Change>, Vec<NewDir>) {
        let mut removed: Vec<Change> = Vec::new();
        let mut added: Vec<Change> = Vec::new();
        let mut new_dirs: Vec<NewDir> = Vec::new();
        for &d in &batch.dirty_dirs {
            let (new_entries, new_blocks) = match self.stored_inode(d) {
                Some(i) if i.kind() == FileKind::Directory => {
                    match self.dir_after_writes(d, &i, &batch.dir_writes) {
                        Some(x) => x,
                        None => {
                            self.c.meta_errors += 1;
                            continue;
                        }
                    }
                }
                _ => (Entries::new(), Some(BTreeMap::new())),
            };
            let old = self.entries_of(d);
            for (n, (i, ft)) in &old {
                if new_entries.get(n).map(|x| x.0) != Some(*i) {
                    removed.push((d, n.clone(), *i, *ft));
                }
            }
            for (n, (i, ft)) in &new_entries {
                if old.get(n).map(|x| x.0) != Some(*i) {
                    added.push((d, n.clone(), *i, *ft));
                }
            }
            new_dirs.push((d, new_entries, new_blocks));
        }
        (removed, added, new_dirs)
    }

    /// The paths the removed entries and the added inodes had before the batch is applied.
    fn names_before(&self, removed: Vec<Change>, added: Vec<Change>) -> NameChanges {
        let old_paths: Vec<Option<String>> = removed
            .iter()
            .map(|(d, n, _, _)| self.path_of(*d).map(|p| join(&p, n)))
            .collect();
        let mut had_name: HashMap<u32, Option<String>> = HashMap::new();
        for (_, _, i, _) in &added {
            let p = self.path_of(*i);
            had_name.entry(*i).or_insert(p);
        }
        NameChanges {
            removed,
            added,
            old_paths,
            had_name,
        }
    }

    /// Store the directories' new contents and update the primary names of the inodes whose
    /// entries changed.
    fn apply_dirs(&mut self, new_dirs: Vec<NewDir>, ch: &NameChanges) {
        for (d, e, blocks) in new_dirs {
            self.dirs.insert(d, e);
            match blocks {
                Some(b) => self.dir_blocks.insert(d, b),
                None => self.dir_blocks.remove(&d),
            };
        }
        for (d, n, i, _) in &ch.removed {
            if self.primary(*i).as_ref() == Some(&(*d, n.clone())) {
                self.links.insert(*i, None);
            }
        }
        for (d, n, i, _) in &ch.added {
            if self.primary(*i).is_none() {
                self.links.insert(*i, Some((*d, n.clone())));
            }
        }
        for (_, _, i, _) in &ch.removed {
            if self.primary(*i).is_none() && self.meta_of(*i).is_some_and(|m| m.links > 0) {
                if let Some(l) = self.find_link(*i) {
                    self.links.insert(*i, Some(l));
                }
            }
        }
    }

    /// Emit the name events (deletes deepest first, then creates shallowest first), matching
    /// removed and added entries by inode; returns the inodes that got a name.
    fn name_events(
        &mut self,
        batch: &Batch,
        ch: &mut NameChanges,
        txn: Option<u32>,
        ns: u64,
        out: &mut Vec<FsEvent>,
    ) -> BTreeSet<u32> {
        let mut by_ino: BTreeMap<u32, (Vec<usize>, Vec<usize>)> = BTreeMap::new();
        for (k, r) in ch.removed.iter().enumerate() {
            by_ino.entry(r.2).or_default().0.push(k);
        }
        for (k, a) in ch.added.iter().enumerate() {
            by_ino.entry(a.2).or_default().1.push(k);
        }
        let mut ev = NameEvents {
            txn,
            ns,
            deletes: Vec::new(),
            creates: Vec::new(),
            named: BTreeSet::new(),
        };
        for (ino, (rs, ads)) in by_ino {
            self.names_of_inode(batch, ch, ino, &rs, &ads, &mut ev);
        }
        ev.deletes.sort_by(|a, b| {
            depth(&b.path)
                .cmp(&depth(&a.path))
                .then(a.path.cmp(&b.path))
        });
        ev.creates.sort_by(|a, b| {
            depth(&a.path)
                .cmp(&depth(&b.path))
                .then(a.path.cmp(&b.path))
        });
        out.extend(ev.deletes);
        out.extend(ev.creates);
        ev.named
    }

    /// Whether `ino` was freed and allocated again in the batch (seen free, or a new kind or
    /// generation), so that its new names are not renames.
    fn is_reused(&self, batch: &Batch, ino: u32) -> bool {
        let now = self.stored_inode(ino);
        batch.freed.contains(&ino) && now.is_some()
            || match (batch.changed.get(&ino), &now) {
                (Some(Some((om, og))), Some(n)) => {
                    om.kind() != n.kind()
                        || og.is_some_and(|g| n.generation.is_some_and(|ng| ng != g))
                }
                _ => false,
            }
    }

    /// Collect the name events of one inode: its removed entries `rs` and added entries `ads`
    /// (indices into `ch`), paired as renames unless the inode was reused.
    fn names_of_inode(
        &mut self,
        batch: &Batch,
        ch: &mut NameChanges,
        ino: u32,
        rs: &[usize],
        ads: &[usize],
        ev: &mut NameEvents,
    ) {
        // The same inode number under a new name is a rename, unless the inode was freed
        // and allocated again (new kind or generation, or seen free in between).
        let reused = self.is_reused(batch, ino);
        if reused {
            ch.had_name.insert(ino, None);
        }
        let (txn, ns) = (ev.txn, ev.ns);
        let pairs = if reused { 0 } else { rs.len().min(ads.len()) };
        for (idx, &a) in ads.iter().enumerate() {
            let (d, n, _, ft) = &ch.added[a];
            let Some(path) = self.path_of(*d).map(|p| join(&p, n)) else {
                self.c.unnamed += 1;
                continue;
            };
            ev.named.insert(ino);
            if idx < pairs {
                let mut e = self.event(EventKind::Rename, path, ino, txn, ns);
                e.old_path = ch.old_paths[rs[idx]].clone();
                ev.creates.push(e);
                continue;
            }
            let e = self.new_name_event(ch, ino, path, *ft, txn, ns);
            ev.creates.push(e);
        }
        for &r in rs.iter().skip(pairs) {
            let (_, _, _, ft) = &ch.removed[r];
            let Some(path) = ch.old_paths[r].clone() else {
                self.c.unnamed += 1;
                continue;
            };
            let e = self.removed_name_event(batch, ino, path, *ft, txn, ns);
            ev.deletes.push(e);
        }
    }

    /// The event of an unpaired new name `path` of `ino` (file-type byte `ft`): a link when
    /// the inode already had a name, else a mkdir, symlink or create.
    fn new_name_event(
        &mut self,
        ch: &NameChanges,
        ino: u32,
        path: String,
        ft: u8,
        txn: Option<u32>,
        ns: u64,
    ) -> FsEvent {
        let existing = ch.had_name.get(&ino).cloned().flatten();
        let kind = self
            .meta_of(ino)
            .map_or_else(|| state::kind_of_ftype(ft), |m| m.kind());
        if let Some(old) = existing.filter(|_| kind != FileKind::Directory) {
            let mut e = self.event(EventKind::Link, path, ino, txn, ns);
            e.old_path = Some(old);
            return e;
        }
        let mut e = match kind {
            FileKind::Directory => self.event(EventKind::Mkdir, path, ino, txn, ns),
            FileKind::Symlink => {
                let mut e = self.event(EventKind::Symlink, path, ino, txn, ns);
                e.new = self
                    .inodes
                    .get(&ino)
                    .cloned()
                    .flatten()
                    .and_then(|i| i.blob)
                    .or_else(|| self.index.read_link(ino).map(std::borrow::Cow::into_owned))
                    .map(|t| Value::Target(String::from_utf8_lossy(&t).into_owned()));
                e
            }
            _ => self.event(EventKind::Create, path, ino, txn, ns),
        };
        e.txn = txn;
        e
    }

    /// The event of an unpaired removed name `path` of `ino` (file-type byte `ft`): an rmdir
    /// or a delete, by the inode's kind at the batch start (else now, else `ft`).
    fn removed_name_event(
        &mut self,
        batch: &Batch,
        ino: u32,
        path: String,
        ft: u8,
        txn: Option<u32>,
        ns: u64,
    ) -> FsEvent {
        let kind = batch
            .changed
            .get(&ino)
            .copied()
            .flatten()
            .map(|(m, _)| m)
            .or_else(|| self.meta_of(ino))
            .map_or_else(|| state::kind_of_ftype(ft), |m: InodeMeta| m.kind());
        let k = if kind == FileKind::Directory {
            EventKind::Rmdir
        } else {
            EventKind::Delete
        };
        self.event(k, path, ino, txn, ns)
    }

    /// Emit the attribute events (chmod, chown, truncate / extend, mtime) of the inodes that
    /// existed before the batch and still do.
    fn attr_events(
        &mut self,
        batch: &Batch,
        named: &BTreeSet<u32>,
        had_name: &HashMap<u32, Option<String>>,
        txn: Option<u32>,
        ns: u64,
        out: &mut Vec<FsEvent>,
    ) {
        for (&ino, old) in &batch.changed {
            let (Some((o, _)), Some(n)) = (*old, self.meta_of(ino)) else {
                continue;
            };
            let created = named.contains(&ino) && had_name.get(&ino).is_some_and(Option::is_none);
            if o.kind() != n.kind() || created || batch.freed.contains(&ino) {
                continue;
            }
            let Some(path) = self.path_of(ino) else {
                continue;
            };
            if o.mode != n.mode {
                let mut e = self.event(EventKind::Chmod, path.clone(), ino, txn, ns);
                e.old = Some(Value::Mode(o.mode));
                e.new = Some(Value::Mode(n.mode));
                out.push(e);
            }
            if (o.uid, o.gid) != (n.uid, n.gid) {
                let mut e = self.event(EventKind::Chown, path.clone(), ino, txn, ns);
                e.old = Some(Value::Owner {
                    uid: o.uid,
                    gid: o.gid,
                });
                e.new = Some(Value::Owner {
                    uid: n.uid,
                    gid: n.gid,
                });
                out.push(e);
            }
            if o.size != n.size && n.kind() != FileKind::Directory {
                let k = if n.size < o.size {
                    EventKind::Truncate
                } else {
                    EventKind::Extend
                };
                let mut e = self.event(k, path.clone(), ino, txn, ns);
                e.old = Some(Value::Size(o.size));
                e.new = Some(Value::Size(n.size));
                out.push(e);
            }
            if o.mtime != n.mtime {
                let mut e = self.event(EventKind::Mtime, path, ino, txn, ns);
                e.old = Some(Value::Time(o.mtime));
                e.new = Some(Value::Time(n.mtime));
                out.push(e);
            }
        }
    }

    fn claim(&mut self, ino: u32, txn: Option<u32>, ns: u64, out: &mut Vec<FsEvent>) {
        let Some(inode) = self
            .inodes
            .get(&ino)
            .cloned()
            .flatten()
            .or_else(|| self.stored_inode(ino))
        else {
            return;
        };
        if self.pending.is_empty() {
            return;
        }
        let is_file = inode.kind() == FileKind::Regular;
        let path = self.path_of(ino);
        let bs = self.bs;
        for r in inode.runs.iter().filter(|r| r.kind() == RUN_DATA) {
            for (b, p) in self.pending.take_range(r.phys(), u64::from(r.len)) {
                self.c.claimed += 1;
                if !is_file {
                    continue;
                }
                let file_offset = (u64::from(r.logical) + (b - r.phys())) * bs;
                let start = file_offset + u64::from(p.start);
                let end = (file_offset + u64::from(p.end)).min(inode.meta.size);
                // Still nameless, or nothing of the write inside the file yet: keep waiting.
                let Some(path) = path.as_deref().filter(|_| start < end) else {
                    self.pending.insert(
                        b,
                        p.data,
                        p.start,
                        p.end,
                        p.observed_ns,
                        self.cfg.pending_max_bytes,
                    );
                    continue;
                };
                let n = (end - start) as usize;
                // Without data capture only the length counts (the block was kept bare).
                let filler;
                let bytes = if p.data.is_empty() {
                    filler = vec![0u8; n];
                    &filler[..]
                } else {
                    p.data
                        .get(p.start as usize..p.start as usize + n)
                        .unwrap_or(&[])
                };
                self.emit_write(ino, path, start, bytes, txn, ns, out);
            }
        }
    }
}
