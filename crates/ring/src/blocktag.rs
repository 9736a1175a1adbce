//! Records of the block-tag channel (FoxyIdle): who submitted each block I/O, and which guest
//! processes declared themselves background.
//!
//! The plugin observes the guest kernel's `blk_mq_submit_bio` entry (in the submitter's
//! context, before the request reaches the virtual disk) and the entry of `__x64_sys_prctl`
//! (a program declaring itself background through libvmsight), and pushes one record per
//! event into a channel of its own (`blocktag.shm`), separate from the syscall channel so the
//! block backend can drain it synchronously when a request arrives.
//!
//! | kind | `pc` | payload |
//! |---|---|---|
//! | [`kind::BLOCK_SUBMIT`](crate::kind::BLOCK_SUBMIT) | hook address | sector, size/op, disk name, dev, tid/tgid, comm[16], task flags, 4 ancestors |
//! | [`kind::BACKGROUND`](crate::kind::BACKGROUND) | hook address | tid/tgid, comm[16], on |
//!
//! Everything in a record comes from guest memory: decoding never fails, and consumers
//! treat the values as hints (a wrong one may cost performance, never data).

use crate::control::COMM_LEN;
use crate::record::{kind, Record};

/// `prctl` option of a background declaration ("vmsi"; `VMSIGHT_PRCTL_OPTION` in vmsight.h).
pub const PRCTL_OPTION: u64 = 0x766d_7369;
/// `prctl` second argument of a background declaration ("bgnd";
/// `VMSIGHT_PRCTL_BACKGROUND` in vmsight.h).
pub const PRCTL_BACKGROUND: u64 = 0x6267_6e64;

/// `task_struct.flags` bit of kernel threads (`PF_KTHREAD`).
pub const PF_KTHREAD: u32 = 0x0020_0000;

/// Ancestors carried by a [`BlockTag`] (parent first).
pub const ANCESTORS: usize = 4;

/// Payload word indices of a [`kind::BLOCK_SUBMIT`] record.
mod word {
    pub const SECTOR: usize = 0;
    /// `bi_size` in bits 0..32, `bi_opf` in bits 32..64.
    pub const SIZE_OP: usize = 1;
    /// The first 8 bytes of `gendisk.disk_name` ("vdb").
    pub const DISK_NAME: usize = 2;
    /// `gendisk.major` in bits 32..64, `first_minor` in bits 0..32.
    pub const DEV: usize = 3;
    /// tid in bits 0..32, tgid in bits 32..64.
    pub const IDS: usize = 4;
    /// `comm`, two words.
    pub const COMM: usize = 6;
    /// `task_struct.flags`.
    pub const FLAGS: usize = 5;
    /// Ancestors: tgid in bits 0..32, [`super::comm_hash`] of its comm in bits 32..64.
    pub const ANCESTORS: usize = 8;
    /// Background declaration: 1 on, 0 off.
    pub const ON: usize = 3;
}

/// An ancestor of a submitting task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ancestor {
    pub tgid: u32,
    /// [`comm_hash`] of its `comm`.
    pub comm_hash: u32,
}

/// One bio as the guest kernel submitted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockTag {
    /// First 512-byte sector (disk-absolute).
    pub sector: u64,
    /// Bytes.
    pub size: u32,
    /// `bi_opf`: the operation in the low byte (0 read, 1 write), flags above.
    pub opf: u32,
    /// `gendisk.disk_name`, NUL-padded (the first 8 bytes).
    pub disk_name: [u8; 8],
    pub major: u32,
    pub first_minor: u32,
    pub tid: u32,
    pub tgid: u32,
    pub comm: [u8; COMM_LEN],
    /// `task_struct.flags` of the submitter.
    pub task_flags: u32,
    /// Parent first; unused slots are zero.
    pub ancestors: [Ancestor; ANCESTORS],
}

/// A guest process declared itself background (or foreground again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Declaration {
    pub tid: u32,
    pub tgid: u32,
    pub comm: [u8; COMM_LEN],
    pub background: bool,
}

/// The request operations a tag can carry, from `bi_opf`'s low byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOp {
    Read,
    Write,
    Other,
}

/// 32-bit FNV-1a of a `comm` up to its first NUL: how ancestors' names travel in a tag (a
/// collision can only make a process look background, which costs performance, never data).
pub fn comm_hash(comm: &[u8]) -> u32 {
    let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    let mut h: u32 = 0x811c_9dc5;
    for &b in &comm[..end] {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

fn split(w: u64) -> (u32, u32) {
    (w as u32, (w >> 32) as u32)
}

fn join(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

fn put_comm(p: &mut [u64; 12], at: usize, c: &[u8; COMM_LEN]) {
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    a.copy_from_slice(&c[..8]);
    b.copy_from_slice(&c[8..]);
    p[at] = u64::from_ne_bytes(a);
    p[at + 1] = u64::from_ne_bytes(b);
}

fn get_comm(p: &[u64; 12], at: usize) -> [u8; COMM_LEN] {
    let mut c = [0u8; COMM_LEN];
    c[..8].copy_from_slice(&p[at].to_ne_bytes());
    c[8..].copy_from_slice(&p[at + 1].to_ne_bytes());
    c
}

fn header(k: u16, vcpu: u32, timestamp_ns: u64, pc: u64) -> Record {
    Record {
        kind: k,
        vcpu,
        timestamp_ns,
        pc,
        ..Record::default()
    }
}

impl BlockTag {
    /// The operation.
    pub fn op(&self) -> BlockOp {
        match self.opf & 0xff {
            0 => BlockOp::Read,
            1 => BlockOp::Write,
            _ => BlockOp::Other,
        }
    }

    /// Submitted by a kernel thread (writeback, journal, kswapd): it belongs to nobody.
    pub fn kernel_thread(&self) -> bool {
        self.task_flags & PF_KTHREAD != 0
    }

    /// The disk name as text ("vdb").
    pub fn disk(&self) -> String {
        let end = self.disk_name.iter().position(|&b| b == 0).unwrap_or(8);
        String::from_utf8_lossy(&self.disk_name[..end]).into_owned()
    }

    /// Sectors covered.
    pub fn sectors(&self) -> std::ops::Range<u64> {
        self.sector..self.sector.saturating_add(u64::from(self.size) >> 9)
    }

    /// Encodes the tag as a [`kind::BLOCK_SUBMIT`] record.
    pub fn to_record(&self, vcpu: u32, timestamp_ns: u64, pc: u64) -> Record {
        let mut r = header(kind::BLOCK_SUBMIT, vcpu, timestamp_ns, pc);
        let p = &mut r.payload;
        p[word::SECTOR] = self.sector;
        p[word::SIZE_OP] = join(self.size, self.opf);
        p[word::DISK_NAME] = u64::from_ne_bytes(self.disk_name);
        p[word::DEV] = join(self.first_minor, self.major);
        p[word::IDS] = join(self.tid, self.tgid);
        p[word::FLAGS] = u64::from(self.task_flags);
        put_comm(p, word::COMM, &self.comm);
        for (i, a) in self.ancestors.iter().enumerate() {
            p[word::ANCESTORS + i] = join(a.tgid, a.comm_hash);
        }
        r
    }

    /// Decodes a [`kind::BLOCK_SUBMIT`] record (`None` for another kind).
    pub fn from_record(r: &Record) -> Option<Self> {
        if r.kind != kind::BLOCK_SUBMIT {
            return None;
        }
        let p = &r.payload;
        let (size, opf) = split(p[word::SIZE_OP]);
        let (first_minor, major) = split(p[word::DEV]);
        let (tid, tgid) = split(p[word::IDS]);
        let mut ancestors = [Ancestor::default(); ANCESTORS];
        for (i, a) in ancestors.iter_mut().enumerate() {
            let (tgid, comm_hash) = split(p[word::ANCESTORS + i]);
            *a = Ancestor { tgid, comm_hash };
        }
        Some(Self {
            sector: p[word::SECTOR],
            size,
            opf,
            disk_name: p[word::DISK_NAME].to_ne_bytes(),
            major,
            first_minor,
            tid,
            tgid,
            comm: get_comm(p, word::COMM),
            task_flags: p[word::FLAGS] as u32,
            ancestors,
        })
    }
}

impl Declaration {
    /// Encodes the declaration as a [`kind::BACKGROUND`] record.
    pub fn to_record(&self, vcpu: u32, timestamp_ns: u64, pc: u64) -> Record {
        let mut r = header(kind::BACKGROUND, vcpu, timestamp_ns, pc);
        r.payload[word::IDS] = join(self.tid, self.tgid);
        put_comm(&mut r.payload, word::COMM, &self.comm);
        r.payload[word::ON] = u64::from(self.background);
        r
    }

    /// Decodes a [`kind::BACKGROUND`] record (`None` for another kind).
    pub fn from_record(r: &Record) -> Option<Self> {
        if r.kind != kind::BACKGROUND {
            return None;
        }
        let (tid, tgid) = split(r.payload[word::IDS]);
        Some(Self {
            tid,
            tgid,
            comm: get_comm(&r.payload, word::COMM),
            background: r.payload[word::ON] != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comm(s: &str) -> [u8; COMM_LEN] {
        let mut c = [0u8; COMM_LEN];
        c[..s.len()].copy_from_slice(s.as_bytes());
        c
    }

    #[test]
    fn a_tag_survives_the_record_round_trip() {
        let t = BlockTag {
            sector: 123_456,
            size: 131_072,
            opf: 0x800,
            disk_name: *b"vdb\0\0\0\0\0",
            major: 254,
            first_minor: 16,
            tid: 812,
            tgid: 810,
            comm: comm("updatedb.ploca"),
            task_flags: 0x0040_0100,
            ancestors: [
                Ancestor {
                    tgid: 700,
                    comm_hash: comm_hash(b"sh"),
                },
                Ancestor {
                    tgid: 1,
                    comm_hash: comm_hash(b"init"),
                },
                Ancestor::default(),
                Ancestor::default(),
            ],
        };
        let r = t.to_record(1, 99, 0xffff_ffff_8155_2580);
        assert_eq!(r.kind, kind::BLOCK_SUBMIT);
        assert_eq!(BlockTag::from_record(&r), Some(t));
        assert_eq!(Declaration::from_record(&r), None);
        assert_eq!(t.op(), BlockOp::Read);
        assert_eq!(t.disk(), "vdb");
        assert_eq!(t.sectors(), 123_456..123_712);
        assert!(!t.kernel_thread());
    }

    #[test]
    fn a_declaration_survives_the_record_round_trip() {
        let d = Declaration {
            tid: 5,
            tgid: 5,
            comm: comm("indexer"),
            background: true,
        };
        let r = d.to_record(0, 1, 2);
        assert_eq!(Declaration::from_record(&r), Some(d));
        assert_eq!(BlockTag::from_record(&r), None);
    }

    #[test]
    fn garbage_records_decode_without_panicking() {
        let mut r = Record {
            kind: kind::BLOCK_SUBMIT,
            payload: [u64::MAX; 12],
            ..Record::default()
        };
        let t = BlockTag::from_record(&r).expect("decodes");
        assert_eq!(t.op(), BlockOp::Other);
        assert!(t.kernel_thread());
        assert_eq!(t.sectors().end, u64::MAX);
        r.kind = kind::BACKGROUND;
        assert!(Declaration::from_record(&r).expect("decodes").background);
    }

    #[test]
    fn comm_hash_stops_at_the_nul() {
        assert_eq!(comm_hash(&comm("sh")), comm_hash(b"sh"));
        assert_ne!(comm_hash(b"sh"), comm_hash(b"bash"));
    }
}
