//! jbd2 journal parsing: the journal superblock, descriptor, commit and revoke blocks, and
//! assembly of committed transactions from journal blocks as the guest writes them.
//!
//! Blocks are buffered by journal position (block index inside the journal inode) as they
//! arrive, in any order. When the commit block of a transaction is buffered, the transaction is
//! assembled by walking the ring from its first descriptor to the commit; if a block on the way
//! has not arrived yet the transaction waits. A complete transaction is handed out as
//! `(home block, content)` pairs with escaped blocks restored and revoked blocks left out.

use crate::crc::crc32c_raw;
use std::collections::{BTreeMap, HashSet};

pub(crate) const JBD2_MAGIC: u32 = 0xC03B_3998;
const BT_DESCRIPTOR: u32 = 1;
const BT_COMMIT: u32 = 2;
const BT_SB_V1: u32 = 3;
const BT_SB_V2: u32 = 4;
const BT_REVOKE: u32 = 5;

#[cfg(test)]
const INCOMPAT_REVOKE: u32 = 0x1;
const INCOMPAT_64BIT: u32 = 0x2;
const INCOMPAT_CSUM_V2: u32 = 0x8;
const INCOMPAT_CSUM_V3: u32 = 0x10;

pub(crate) const FLAG_ESCAPE: u32 = 1;
pub(crate) const FLAG_SAME_UUID: u32 = 2;
pub(crate) const FLAG_LAST_TAG: u32 = 8;

/// Commits buffered behind one that still waits: past this many, the waiting one is given up
/// (its blocks never arrived, e.g. the stream started mid-transaction or the buffer
/// overflowed). jbd2 writes one commit at a time, so real streams have at most one or two.
const MAX_WAITING_BEHIND: usize = 8;

pub(crate) fn be32(b: &[u8], o: usize) -> u32 {
    b.get(o..o + 4)
        .map_or(0, |s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}
fn be16(b: &[u8], o: usize) -> u16 {
    b.get(o..o + 2)
        .map_or(0, |s| u16::from_be_bytes([s[0], s[1]]))
}

/// Is `a` after `b` in jbd2's wrapping transaction-id order?
fn tid_gt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// The parts of the journal superblock the parser needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JournalSuper {
    pub block_size: u32,
    /// Journal length in blocks (positions `first..maxlen` form the ring).
    pub maxlen: u32,
    pub first: u32,
    /// Oldest live transaction and where it starts (0 = journal clean).
    pub sequence: u32,
    pub start: u32,
    pub compat: u32,
    pub incompat: u32,
    pub seed: u32,
}

impl JournalSuper {
    /// Parse journal block 0; `None` if it is not a jbd2 superblock or is inconsistent.
    pub fn parse(b: &[u8]) -> Option<Self> {
        if be32(b, 0) != JBD2_MAGIC {
            return None;
        }
        let bt = be32(b, 4);
        if bt != BT_SB_V1 && bt != BT_SB_V2 {
            return None;
        }
        let v2 = bt == BT_SB_V2;
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(b.get(48..64)?);
        let sb = JournalSuper {
            block_size: be32(b, 12),
            maxlen: be32(b, 16),
            first: be32(b, 20),
            sequence: be32(b, 24),
            start: be32(b, 28),
            compat: if v2 { be32(b, 36) } else { 0 },
            incompat: if v2 { be32(b, 40) } else { 0 },
            seed: crc32c_raw(!0, &uuid),
        };
        let sane = sb.block_size >= 1024
            && sb.block_size.is_power_of_two()
            && sb.first >= 1
            && sb.first < sb.maxlen;
        sane.then_some(sb)
    }

    pub fn csum_v3(&self) -> bool {
        self.incompat & INCOMPAT_CSUM_V3 != 0
    }
    pub fn csum_v2(&self) -> bool {
        self.incompat & INCOMPAT_CSUM_V2 != 0
    }
    fn csum(&self) -> bool {
        self.csum_v2() || self.csum_v3()
    }
    fn is64(&self) -> bool {
        self.incompat & INCOMPAT_64BIT != 0
    }
    /// Bytes of one block tag (without the optional 16-byte UUID), as `journal_tag_bytes()`.
    pub fn tag_bytes(&self) -> usize {
        if self.csum_v3() {
            return 16;
        }
        let mut sz = 12;
        if self.csum_v2() {
            sz += 2;
        }
        if self.is64() {
            sz
        } else {
            sz - 4
        }
    }
    fn next(&self, p: u32) -> u32 {
        if p.saturating_add(1) >= self.maxlen {
            self.first
        } else {
            p + 1
        }
    }
    fn ring_len(&self) -> u32 {
        self.maxlen - self.first
    }
    /// Ring distance from `a` forward to `b`.
    fn dist(&self, a: u32, b: u32) -> u32 {
        let n = self.ring_len();
        (b.wrapping_sub(self.first) % n + n - a.wrapping_sub(self.first) % n) % n
    }
    fn block_csum_ok(&self, b: &[u8], csum_off: usize) -> bool {
        let mut copy = b.to_vec();
        let Some(slot) = copy.get_mut(csum_off..csum_off + 4) else {
            return false;
        };
        slot.fill(0);
        crc32c_raw(self.seed, &copy) == be32(b, csum_off)
    }
}

/// One tag of a descriptor block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tag {
    pub home: u64,
    pub flags: u32,
    pub csum: u32,
}

/// Parse the tags of a descriptor block (bounded by the block).
pub(crate) fn parse_tags(sb: &JournalSuper, b: &[u8]) -> Vec<Tag> {
    let tb = sb.tag_bytes();
    let end = b.len().saturating_sub(if sb.csum() { 4 } else { 0 });
    let mut off = 12;
    let mut tags = Vec::new();
    while off + tb <= end {
        let lo = u64::from(be32(b, off));
        let (flags, hi, csum) = if sb.csum_v3() {
            (be32(b, off + 4), be32(b, off + 8), be32(b, off + 12))
        } else {
            let hi = if sb.is64() { be32(b, off + 8) } else { 0 };
            (u32::from(be16(b, off + 6)), hi, u32::from(be16(b, off + 4)))
        };
        let home = if sb.is64() {
            lo | u64::from(hi) << 32
        } else {
            lo
        };
        off += tb;
        if flags & FLAG_SAME_UUID == 0 {
            off += 16;
        }
        tags.push(Tag { home, flags, csum });
        if flags & FLAG_LAST_TAG != 0 {
            break;
        }
    }
    tags
}

/// Parse the block numbers of a revoke block.
pub(crate) fn parse_revoke(sb: &JournalSuper, b: &[u8]) -> Vec<u64> {
    let rec = if sb.is64() { 8 } else { 4 };
    let limit = b.len().saturating_sub(if sb.csum() { 4 } else { 0 });
    let count = (be32(b, 12) as usize).min(limit);
    let mut out = Vec::new();
    let mut off = 16;
    while off + rec <= count {
        out.push(if rec == 8 {
            u64::from(be32(b, off)) << 32 | u64::from(be32(b, off + 4))
        } else {
            u64::from(be32(b, off))
        });
        off += rec;
    }
    out
}

/// A committed transaction, ready to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Txn {
    pub seq: u32,
    /// Logged blocks in log order: home block and content (escape undone).
    pub blocks: Vec<(u64, Vec<u8>)>,
    /// Blocks revoked by this transaction.
    pub revoked: Vec<u64>,
}

/// Journal counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct JournalStats {
    pub txns: u64,
    pub blocks_logged: u64,
    pub revoke_records: u64,
    pub revoked_skipped: u64,
    pub escaped: u64,
    pub csum_errors: u64,
    pub errors: u64,
    pub overflows: u64,
    pub abandoned: u64,
    pub buffered_bytes: u64,
}

enum Assembly {
    Ready(Txn, Vec<u32>),
    Wait,
    /// Malformed or inconsistent (the reason is for debugging).
    Broken(#[allow(dead_code)] &'static str),
}

/// Transaction assembly state.
pub(crate) struct Journal {
    pub sb: Option<JournalSuper>,
    blocks: BTreeMap<u32, Vec<u8>>,
    /// Buffered commit blocks: position -> sequence.
    commits: BTreeMap<u32, u32>,
    bytes: u64,
    max_bytes: u64,
    /// Where and with which sequence the next transaction starts, when known.
    next: Option<(u32, u32)>,
    last_applied: Option<u32>,
    pub stats: JournalStats,
}

impl Journal {
    pub fn new(sb_block: Option<&[u8]>, max_bytes: u64) -> Self {
        let sb = sb_block.and_then(JournalSuper::parse);
        // A clean journal (s_start == 0) is reset at mount: the first transaction is
        // s_sequence + 1 at s_first (jbd2 `journal_reset`).
        let next = sb
            .as_ref()
            .filter(|s| s.start == 0)
            .map(|s| (s.first, s.sequence.wrapping_add(1)));
        Journal {
            sb,
            blocks: BTreeMap::new(),
            commits: BTreeMap::new(),
            bytes: 0,
            max_bytes,
            next,
            last_applied: None,
            stats: JournalStats::default(),
        }
    }

    /// A write of `content` to journal block `pos`; returns the transactions it completed.
    pub fn write(&mut self, pos: u32, content: &[u8]) -> Vec<Txn> {
        if pos == 0 {
            // Superblock rewrites move the tail; the geometry and features stay.
            if let Some(s) = JournalSuper::parse(content) {
                if self.sb.as_ref().is_none_or(|o| o.maxlen != s.maxlen) {
                    self.clear();
                }
                self.sb = Some(s);
            } else {
                self.stats.errors += 1;
            }
            return Vec::new();
        }
        let Some(sb) = self.sb.clone() else {
            return Vec::new();
        };
        if pos < sb.first || pos >= sb.maxlen {
            return Vec::new();
        }
        if let Some(old) = self.blocks.insert(pos, content.to_vec()) {
            self.bytes -= old.len() as u64;
        }
        self.bytes += content.len() as u64;
        self.commits.remove(&pos);
        if be32(content, 0) == JBD2_MAGIC && be32(content, 4) == BT_COMMIT {
            let seq = be32(content, 8);
            if self.last_applied.is_none_or(|l| tid_gt(seq, l)) {
                self.commits.insert(pos, seq);
            }
        }
        let out = self.try_assemble(&sb);
        if self.bytes > self.max_bytes {
            // Bounded memory: forget the buffer; the changes reach the engine later as
            // checkpoint writes to their home locations.
            self.stats.overflows += 1;
            self.clear();
        }
        self.stats.buffered_bytes = self.bytes;
        out
    }

    fn clear(&mut self) {
        self.blocks.clear();
        self.commits.clear();
        self.bytes = 0;
        self.next = None;
        self.stats.buffered_bytes = 0;
    }

    fn try_assemble(&mut self, sb: &JournalSuper) -> Vec<Txn> {
        let mut out = Vec::new();
        // Oldest buffered commit in transaction order first.
        while let Some((cpos, seq)) = self.oldest_commit() {
            match self.assemble(sb, seq, cpos) {
                Assembly::Ready(txn, used) => {
                    for p in used {
                        if let Some(b) = self.blocks.remove(&p) {
                            self.bytes -= b.len() as u64;
                        }
                    }
                    self.commits.remove(&cpos);
                    self.last_applied = Some(seq);
                    self.next = Some((sb.next(cpos), seq.wrapping_add(1)));
                    self.stats.txns += 1;
                    self.stats.blocks_logged += txn.blocks.len() as u64;
                    out.push(txn);
                }
                Assembly::Wait => {
                    // Attached to a journal already in use (no known log start, nothing applied
                    // yet): a commit whose descriptor is not buffered belongs to the transaction
                    // that was being written when streaming started. jbd2 writes a commit only
                    // after the transaction's other blocks are on disk, so its descriptor came
                    // before the tap and will never arrive: give it up now instead of making
                    // every later transaction wait behind it (its changes reach the engine as
                    // checkpoint writes).
                    let straddles = self.next.is_none()
                        && self.last_applied.is_none()
                        && !self.blocks.keys().any(|&p| {
                            matches!(self.header(p), Some((bt, s2)) if s2 == seq
                                && (bt == BT_DESCRIPTOR || bt == BT_REVOKE))
                        });
                    if straddles || self.commits.len() > MAX_WAITING_BEHIND {
                        self.stats.abandoned += 1;
                        self.skip(seq, cpos);
                        continue;
                    }
                    break;
                }
                Assembly::Broken(_) => {
                    self.stats.errors += 1;
                    self.skip(seq, cpos);
                }
            }
        }
        out
    }

    fn oldest_commit(&self) -> Option<(u32, u32)> {
        let base = self.last_applied.map_or(0, |l| l.wrapping_add(1));
        self.commits
            .iter()
            .min_by_key(|(_, &s)| s.wrapping_sub(base))
            .map(|(&p, &s)| (p, s))
    }

    fn skip(&mut self, seq: u32, cpos: u32) {
        self.commits.remove(&cpos);
        self.last_applied = Some(seq);
        self.next = None;
    }

    fn header(&self, p: u32) -> Option<(u32, u32)> {
        let b = self.blocks.get(&p)?;
        (be32(b, 0) == JBD2_MAGIC).then(|| (be32(b, 4), be32(b, 8)))
    }

    fn assemble(&mut self, sb: &JournalSuper, seq: u32, cpos: u32) -> Assembly {
        // First block of the transaction: the expected start when the previous commit was
        // seen, else the descriptor or revoke block of `seq` farthest back from the commit.
        let start = match self.next {
            Some((p, s)) if s == seq => p,
            _ => {
                let first = self
                    .blocks
                    .keys()
                    .copied()
                    .filter(|&p| {
                        matches!(self.header(p), Some((bt, s)) if s == seq
                        && (bt == BT_DESCRIPTOR || bt == BT_REVOKE))
                    })
                    .max_by_key(|&p| sb.dist(p, cpos));
                match first {
                    Some(p) => p,
                    // The descriptor may still be on its way (or gone: then later commits
                    // piling up give this one up).
                    None => return Assembly::Wait,
                }
            }
        };
        let mut used = Vec::new();
        let mut blocks = Vec::new();
        let mut revoked: HashSet<u64> = HashSet::new();
        let mut revoked_order = Vec::new();
        let mut revoke_records = 0u64;
        // Counted once the transaction is decided, not on every attempt while it waits.
        let mut csum_errs = 0u64;
        let mut p = start;
        for _ in 0..=sb.ring_len() {
            let Some(blk) = self.blocks.get(&p) else {
                return Assembly::Wait;
            };
            used.push(p);
            if be32(blk, 0) != JBD2_MAGIC || be32(blk, 8) != seq {
                return Assembly::Broken("a block inside the transaction is not its own");
            }
            match be32(blk, 4) {
                BT_COMMIT => {
                    if p != cpos {
                        return Assembly::Broken("a second commit block");
                    }
                    if sb.csum() && !sb.block_csum_ok(blk, 16) {
                        // jbd2 recovery treats a bad commit checksum as the end of the log.
                        self.stats.csum_errors += csum_errs + 1;
                        return Assembly::Broken("commit block checksum mismatch");
                    }
                    break;
                }
                BT_DESCRIPTOR => {
                    if sb.csum() && !sb.block_csum_ok(blk, blk.len().saturating_sub(4)) {
                        csum_errs += 1;
                    }
                    let tags = parse_tags(sb, blk);
                    for t in tags {
                        p = sb.next(p);
                        let Some(data) = self.blocks.get(&p) else {
                            return Assembly::Wait;
                        };
                        used.push(p);
                        if sb.csum() {
                            let c = crc32c_raw(sb.seed, &seq.to_be_bytes());
                            let c = crc32c_raw(c, data);
                            let ok = if sb.csum_v3() {
                                c == t.csum
                            } else {
                                c & 0xFFFF == t.csum
                            };
                            if !ok {
                                // Recovery skips such a block; so do we.
                                csum_errs += 1;
                                continue;
                            }
                        }
                        let mut content = data.clone();
                        if t.flags & FLAG_ESCAPE != 0 {
                            if let Some(m) = content.get_mut(0..4) {
                                m.copy_from_slice(&JBD2_MAGIC.to_be_bytes());
                            }
                            self.stats.escaped += 1;
                        }
                        blocks.push((t.home, content));
                    }
                }
                BT_REVOKE => {
                    if sb.csum() && !sb.block_csum_ok(blk, blk.len().saturating_sub(4)) {
                        csum_errs += 1;
                    }
                    for r in parse_revoke(sb, blk) {
                        revoke_records += 1;
                        if revoked.insert(r) {
                            revoked_order.push(r);
                        }
                    }
                }
                _ => return Assembly::Broken("unknown journal block type"),
            }
            p = sb.next(p);
        }
        if used.last() != Some(&cpos) {
            return Assembly::Broken("the walk did not end at the commit block");
        }
        // A block revoked in this transaction is not replayed from it (recovery semantics:
        // revocation applies to transactions up to and including the revoking one).
        self.stats.revoke_records += revoke_records;
        self.stats.csum_errors += csum_errs;
        let before = blocks.len();
        blocks.retain(|(h, _)| !revoked.contains(h));
        self.stats.revoked_skipped += (before - blocks.len()) as u64;
        Assembly::Ready(
            Txn {
                seq,
                blocks,
                revoked: revoked_order,
            },
            used,
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub const BS: usize = 1024;

    /// Journal superblock for tests: ring `1..maxlen`, given incompat features.
    pub fn jsb(maxlen: u32, sequence: u32, incompat: u32) -> Vec<u8> {
        let mut b = vec![0u8; BS];
        b[0..4].copy_from_slice(&JBD2_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&BT_SB_V2.to_be_bytes());
        b[12..16].copy_from_slice(&(BS as u32).to_be_bytes());
        b[16..20].copy_from_slice(&maxlen.to_be_bytes());
        b[20..24].copy_from_slice(&1u32.to_be_bytes());
        b[24..28].copy_from_slice(&sequence.to_be_bytes());
        b[40..44].copy_from_slice(&incompat.to_be_bytes());
        b[48..64].copy_from_slice(&[7u8; 16]);
        b
    }

    fn header(bt: u32, seq: u32) -> Vec<u8> {
        let mut b = vec![0u8; BS];
        b[0..4].copy_from_slice(&JBD2_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&bt.to_be_bytes());
        b[8..12].copy_from_slice(&seq.to_be_bytes());
        b
    }

    fn set_tail_csum(sb: &JournalSuper, b: &mut [u8], off: usize) {
        b[off..off + 4].fill(0);
        let c = crc32c_raw(sb.seed, b);
        b[off..off + 4].copy_from_slice(&c.to_be_bytes());
    }

    /// Builds journal blocks of one transaction the way jbd2 lays them out.
    pub fn txn_blocks(
        sb: &JournalSuper,
        seq: u32,
        logged: &[(u64, Vec<u8>)],
        revoke: &[u64],
    ) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        if !revoke.is_empty() {
            let mut r = header(BT_REVOKE, seq);
            let rec = if sb.is64() { 8 } else { 4 };
            let mut off = 16;
            for &b in revoke {
                if rec == 8 {
                    r[off..off + 8].copy_from_slice(&b.to_be_bytes());
                } else {
                    r[off..off + 4].copy_from_slice(&(b as u32).to_be_bytes());
                }
                off += rec;
            }
            r[12..16].copy_from_slice(&(off as u32).to_be_bytes());
            if sb.csum() {
                set_tail_csum(sb, &mut r, BS - 4);
            }
            out.push(r);
        }
        if !logged.is_empty() {
            let mut d = header(BT_DESCRIPTOR, seq);
            let tb = sb.tag_bytes();
            let mut off = 12;
            let mut datas = Vec::new();
            for (i, (home, content)) in logged.iter().enumerate() {
                let mut data = content.clone();
                let mut flags = 0u32;
                if be32(&data, 0) == JBD2_MAGIC {
                    data[0..4].fill(0);
                    flags |= FLAG_ESCAPE;
                }
                if i > 0 {
                    flags |= FLAG_SAME_UUID;
                }
                if i + 1 == logged.len() {
                    flags |= FLAG_LAST_TAG;
                }
                let c = crc32c_raw(sb.seed, &seq.to_be_bytes());
                let c = crc32c_raw(c, &data);
                d[off..off + 4].copy_from_slice(&(*home as u32).to_be_bytes());
                if sb.csum_v3() {
                    d[off + 4..off + 8].copy_from_slice(&flags.to_be_bytes());
                    d[off + 8..off + 12].copy_from_slice(&((*home >> 32) as u32).to_be_bytes());
                    d[off + 12..off + 16].copy_from_slice(&c.to_be_bytes());
                } else {
                    d[off + 4..off + 6].copy_from_slice(&(c as u16).to_be_bytes());
                    d[off + 6..off + 8].copy_from_slice(&(flags as u16).to_be_bytes());
                    if sb.is64() {
                        d[off + 8..off + 12].copy_from_slice(&((*home >> 32) as u32).to_be_bytes());
                    }
                }
                off += tb;
                if flags & FLAG_SAME_UUID == 0 {
                    off += 16;
                }
                datas.push(data);
            }
            if sb.csum() {
                set_tail_csum(sb, &mut d, BS - 4);
            }
            out.push(d);
            out.extend(datas);
        }
        let mut c = header(BT_COMMIT, seq);
        if sb.csum() {
            set_tail_csum(sb, &mut c, 16);
        }
        out.push(c);
        out
    }

    fn block(fill: u8) -> Vec<u8> {
        vec![fill; BS]
    }

    const V3_64: u32 = INCOMPAT_REVOKE | INCOMPAT_64BIT | INCOMPAT_CSUM_V3;

    #[test]
    fn applies_at_commit_only() {
        let sbb = jsb(64, 9, V3_64);
        let sb = JournalSuper::parse(&sbb).expect("sb");
        assert_eq!(sb.tag_bytes(), 16);
        let mut j = Journal::new(Some(&sbb), 1 << 20);
        let blocks = txn_blocks(&sb, 10, &[(100, block(1)), (1 << 33, block(2))], &[]);
        assert_eq!(blocks.len(), 4);
        for (i, b) in blocks.iter().enumerate().take(3) {
            assert!(j.write(1 + i as u32, b).is_empty(), "no commit yet");
        }
        let t = j.write(4, &blocks[3]);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].seq, 10);
        assert_eq!(t[0].blocks, vec![(100, block(1)), (1 << 33, block(2))]);
        assert_eq!(j.stats.csum_errors, 0);
        assert_eq!(j.stats.buffered_bytes, 0, "applied blocks are released");
    }

    #[test]
    fn commit_before_data_waits() {
        let sbb = jsb(64, 1, V3_64);
        let sb = JournalSuper::parse(&sbb).expect("sb");
        let mut j = Journal::new(Some(&sbb), 1 << 20);
        let blocks = txn_blocks(&sb, 2, &[(5, block(1)), (6, block(2))], &[]);
        // Commit first, then the descriptor, then the data in reverse order.
        assert!(j.write(4, &blocks[3]).is_empty());
        assert!(j.write(1, &blocks[0]).is_empty());
        assert!(j.write(3, &blocks[2]).is_empty());
        let t = j.write(2, &blocks[1]);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].blocks.len(), 2);
    }

    #[test]
    fn escaped_block_is_restored() {
        let sbb = jsb(64, 1, V3_64);
        let sb = JournalSuper::parse(&sbb).expect("sb");
        let mut j = Journal::new(Some(&sbb), 1 << 20);
        let mut magic = block(3);
        magic[0..4].copy_from_slice(&JBD2_MAGIC.to_be_bytes());
        let blocks = txn_blocks(&sb, 2, &[(5, magic.clone())], &[]);
        assert_eq!(be32(&blocks[1], 0), 0, "escaped in the journal");
        let mut got = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            got.extend(j.write(1 + i as u32, b));
        }
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].blocks, vec![(5, magic)]);
        assert_eq!(j.stats.escaped, 1);
    }

    #[test]
    fn revoke_and_wrap() {
        // Ring of 6 positions (1..7), csum v2 without 64bit: 12-4+2 = 10-byte tags.
        let sbb = jsb(7, 0, INCOMPAT_REVOKE | INCOMPAT_CSUM_V2);
        let sb = JournalSuper::parse(&sbb).expect("sb");
        assert_eq!(sb.tag_bytes(), 10);
        let mut j = Journal::new(Some(&sbb), 1 << 20);
        let t1 = txn_blocks(&sb, 1, &[(10, block(1)), (11, block(2))], &[]);
        let mut got = Vec::new();
        for (i, b) in t1.iter().enumerate() {
            got.extend(j.write(1 + i as u32, b));
        }
        assert_eq!(got.len(), 1);
        // T2 starts at 5 and wraps: revoke@5, descriptor@6, data@1, data@2, commit@3.
        let t2 = txn_blocks(&sb, 2, &[(11, block(5)), (12, block(6))], &[11, 13]);
        let positions = [5u32, 6, 1, 2, 3];
        let mut got = Vec::new();
        for (p, b) in positions.iter().zip(&t2).rev() {
            got.extend(j.write(*p, b));
        }
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].seq, 2);
        assert_eq!(got[0].blocks, vec![(12, block(6))], "block 11 is revoked");
        assert_eq!(got[0].revoked, vec![11, 13]);
        assert_eq!(j.stats.revoke_records, 2);
        assert_eq!(j.stats.csum_errors, 0);
    }

    #[test]
    fn checksum_failures_are_counted() {
        let sbb = jsb(64, 1, V3_64);
        let sb = JournalSuper::parse(&sbb).expect("sb");
        let mut j = Journal::new(Some(&sbb), 1 << 20);
        let mut blocks = txn_blocks(&sb, 2, &[(5, block(1)), (6, block(2))], &[]);
        blocks[1][100] ^= 1; // damage the first data block
        let mut got = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            got.extend(j.write(1 + i as u32, b));
        }
        assert_eq!(got.len(), 1);
        assert_eq!(
            got[0].blocks,
            vec![(6, block(2))],
            "the bad block is skipped"
        );
        assert_eq!(j.stats.csum_errors, 1);
        // A bad commit checksum drops the transaction.
        let mut blocks = txn_blocks(&sb, 3, &[(7, block(1))], &[]);
        let last = blocks.len() - 1;
        blocks[last][40] ^= 1;
        let mut got = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            got.extend(j.write(5 + i as u32, b));
        }
        assert!(got.is_empty());
        assert_eq!(j.stats.csum_errors, 2);
    }

    #[test]
    fn overflow_and_garbage() {
        let sbb = jsb(64, 1, V3_64);
        let sb = JournalSuper::parse(&sbb).expect("sb");
        let mut j = Journal::new(Some(&sbb), 3 * BS as u64);
        let blocks = txn_blocks(&sb, 2, &[(5, block(1)), (6, block(2)), (7, block(3))], &[]);
        let mut got = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            got.extend(j.write(1 + i as u32, b));
        }
        assert!(got.is_empty(), "the buffer overflowed before the commit");
        assert_eq!(j.stats.overflows, 1);
        // A commit whose descriptor never comes: later complete transactions give it up.
        let mut j = Journal::new(Some(&sbb), 1 << 20);
        let lone = txn_blocks(&sb, 2, &[], &[]);
        assert!(j.write(5, &lone[0]).is_empty());
        let mut p = 10;
        let mut applied = 0;
        for seq in 3..3 + MAX_WAITING_BEHIND as u32 + 1 {
            for b in txn_blocks(&sb, seq, &[(9, block(9))], &[]) {
                applied += j.write(p, &b).len();
                p += 1;
            }
        }
        assert_eq!(j.stats.abandoned, 1);
        assert_eq!(
            applied,
            MAX_WAITING_BEHIND + 1,
            "all later transactions applied"
        );
        assert!(j.stats.buffered_bytes <= 3 * BS as u64);
        // Garbage descriptors never panic.
        let mut j = Journal::new(Some(&sbb), 1 << 20);
        let mut seed = 1u64;
        for p in 1..64u32 {
            let mut b = header(1 + p % 5, 2);
            for x in b.iter_mut().skip(12) {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                *x = (seed >> 33) as u8;
            }
            let _ = j.write(p, &b);
        }
        assert!(JournalSuper::parse(&[0u8; 10]).is_none());
    }
}
