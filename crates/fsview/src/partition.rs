//! Partition tables: MBR (with extended/logical partitions and the protective MBR) and GPT.

use crate::block::BlockSource;
use crate::crc::crc32;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

const SECTOR: u64 = 512;
/// Logical partitions followed at most (loop and size guard for the EBR chain).
const MAX_LOGICAL: usize = 128;
/// GPT entries read at most.
const MAX_GPT_ENTRIES: u32 = 1024;

/// Which kind of table was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Scheme {
    /// No partition table: the file system (if any) starts at byte 0.
    None,
    /// DOS/MBR table.
    Mbr,
    /// GUID partition table (behind a protective MBR).
    Gpt,
}

/// The type of one partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PartitionType {
    /// MBR system id (0x83 Linux, ...).
    Mbr(u8),
    /// GPT partition type GUID (on-disk byte order) and partition name.
    Gpt {
        /// Type GUID as stored on disk.
        type_guid: [u8; 16],
        /// Unique partition GUID as stored on disk.
        unique_guid: [u8; 16],
        /// Partition name (UTF-16LE decoded).
        name: String,
    },
}

/// One partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    /// 1-based number (MBR: 1–4 primary, 5.. logical; GPT: entry index + 1).
    pub number: usize,
    /// Start in bytes from the beginning of the disk.
    pub start: u64,
    /// Size in bytes.
    pub size: u64,
    /// Type.
    pub kind: PartitionType,
}

/// The result of [`read_partitions`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionTable {
    /// Table kind.
    pub scheme: Scheme,
    /// Partitions in table order (empty entries omitted).
    pub partitions: Vec<Partition>,
    /// Non-fatal problems (GPT CRC mismatch, partitions past the end of the disk, ...).
    pub warnings: Vec<String>,
}

impl PartitionTable {
    /// The partition with 1-based `number`.
    pub fn get(&self, number: usize) -> Result<&Partition> {
        self.partitions
            .iter()
            .find(|p| p.number == number)
            .ok_or(Error::NoSuchPartition {
                index: number,
                count: self.partitions.len(),
            })
    }
}

/// Format a GPT GUID (mixed-endian on disk) the usual way.
pub fn guid_string(g: &[u8; 16]) -> String {
    format!(
        "{:02X}{:02X}{:02X}{:02X}-{:02X}{:02X}-{:02X}{:02X}-{:02X}{:02X}-{:02X}{:02X}{:02X}{:02X}{:02X}{:02X}",
        g[3], g[2], g[1], g[0], g[5], g[4], g[7], g[6], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[15]
    )
}

fn le32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = b.get(off..off + 4) {
        a.copy_from_slice(s);
    }
    u32::from_le_bytes(a)
}

fn le64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(off..off + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

struct MbrEntry {
    kind: u8,
    lba: u64,
    sectors: u64,
}

fn mbr_entries(sector: &[u8]) -> Vec<MbrEntry> {
    (0..4)
        .filter_map(|i| {
            let base = 446 + 16 * i;
            let e = sector.get(base..base + 16)?;
            let kind = e[4];
            let lba = u64::from(le32(e, 8));
            let sectors = u64::from(le32(e, 12));
            (kind != 0 && sectors != 0).then_some(MbrEntry { kind, lba, sectors })
        })
        .collect()
}

fn is_extended(kind: u8) -> bool {
    matches!(kind, 0x05 | 0x0F | 0x85)
}

/// Read the partition table of `src`. A disk without an MBR signature has [`Scheme::None`].
pub fn read_partitions(src: &dyn BlockSource) -> Result<PartitionTable> {
    let mut table = PartitionTable {
        scheme: Scheme::None,
        partitions: Vec::new(),
        warnings: Vec::new(),
    };
    if src.len() < SECTOR {
        return Ok(table);
    }
    let mut mbr = [0u8; 512];
    src.read_at(0, &mut mbr)?;
    if mbr[510] != 0x55 || mbr[511] != 0xAA {
        return Ok(table);
    }
    let entries = mbr_entries(&mbr);
    if entries.iter().any(|e| e.kind == 0xEE) {
        table.scheme = Scheme::Gpt;
        read_gpt(src, &mut table)?;
        return Ok(table);
    }
    // A FAT/NTFS boot sector also ends in 55 AA; an ext file system at 0 does not (its first
    // 1024 bytes are unused). Treat a table whose entries are all empty as no table.
    table.scheme = Scheme::Mbr;
    let disk_sectors = src.len() / SECTOR;
    for (i, e) in entries.iter().enumerate() {
        if is_extended(e.kind) {
            read_logical(src, e.lba, &mut table)?;
        }
        push_mbr(&mut table, i + 1, e, 0, disk_sectors);
    }
    if table.partitions.is_empty() {
        table.scheme = Scheme::None;
    }
    table.partitions.sort_by_key(|p| p.number);
    Ok(table)
}

fn push_mbr(table: &mut PartitionTable, number: usize, e: &MbrEntry, base: u64, disk: u64) {
    let Some(lba) = e.lba.checked_add(base) else {
        return;
    };
    if lba.saturating_add(e.sectors) > disk {
        table.warnings.push(format!(
            "partition {number} ends at sector {} past the end of the disk ({disk} sectors)",
            lba.saturating_add(e.sectors)
        ));
    }
    table.partitions.push(Partition {
        number,
        start: lba * SECTOR,
        size: e.sectors * SECTOR,
        kind: PartitionType::Mbr(e.kind),
    });
}

fn read_logical(src: &dyn BlockSource, ext_lba: u64, table: &mut PartitionTable) -> Result<()> {
    let disk = src.len() / SECTOR;
    let mut next = 0u64; // relative to ext_lba
    let mut seen = Vec::new();
    for n in 0..MAX_LOGICAL {
        if seen.contains(&next) {
            table.warnings.push(format!(
                "extended partition chain loops at sector {}",
                ext_lba + next
            ));
            return Ok(());
        }
        seen.push(next);
        let lba = ext_lba
            .checked_add(next)
            .filter(|l| *l < disk)
            .ok_or_else(|| Error::Partition(format!("EBR {n} lies past the end of the disk")))?;
        let mut ebr = [0u8; 512];
        src.read_at(lba * SECTOR, &mut ebr)?;
        if ebr[510] != 0x55 || ebr[511] != 0xAA {
            return Err(Error::Partition(format!(
                "extended boot record at sector {lba} has no 55 AA signature"
            )));
        }
        let es = mbr_entries(&ebr);
        let mut link = None;
        for e in &es {
            if is_extended(e.kind) {
                link = Some(e.lba);
            } else if link.is_none() || table.partitions.iter().all(|p| p.number != 5 + n) {
                push_mbr(table, 5 + n, e, lba, disk);
            }
        }
        match link {
            Some(l) => next = l,
            None => return Ok(()),
        }
    }
    table.warnings.push(format!(
        "more than {MAX_LOGICAL} logical partitions; the rest are ignored"
    ));
    Ok(())
}

fn read_gpt(src: &dyn BlockSource, table: &mut PartitionTable) -> Result<()> {
    let mut hdr = [0u8; 512];
    src.read_at(SECTOR, &mut hdr)?;
    if &hdr[0..8] != b"EFI PART" {
        return Err(Error::Partition(
            "protective MBR present but no \"EFI PART\" GPT header at LBA 1".into(),
        ));
    }
    let hsize = le32(&hdr, 12) as usize;
    if !(92..=512).contains(&hsize) {
        return Err(Error::Partition(format!(
            "GPT header size {hsize} is not in 92..=512"
        )));
    }
    let stored = le32(&hdr, 16);
    let mut h = hdr;
    h[16..20].fill(0);
    let computed = crc32(&h[..hsize]);
    if computed != stored {
        table.warnings.push(format!(
            "GPT header CRC mismatch (stored {stored:#010x}, computed {computed:#010x})"
        ));
    }
    let entries_lba = le64(&hdr, 72);
    let count = le32(&hdr, 80);
    let esize = le32(&hdr, 84);
    let entries_crc = le32(&hdr, 88);
    if !(128..=4096).contains(&esize) || !esize.is_multiple_of(8) {
        return Err(Error::Partition(format!(
            "GPT entry size {esize} is invalid"
        )));
    }
    if count > MAX_GPT_ENTRIES {
        return Err(Error::Partition(format!(
            "GPT claims {count} entries, more than the supported {MAX_GPT_ENTRIES}"
        )));
    }
    let total = u64::from(count) * u64::from(esize);
    let off = entries_lba
        .checked_mul(SECTOR)
        .ok_or_else(|| Error::Partition("GPT entry array LBA overflows".into()))?;
    let mut buf = vec![0u8; total as usize];
    src.read_at(off, &mut buf)?;
    let computed = crc32(&buf);
    if computed != entries_crc {
        table.warnings.push(format!(
            "GPT partition entry array CRC mismatch (stored {entries_crc:#010x}, computed {computed:#010x})"
        ));
    }
    let disk = src.len() / SECTOR;
    for (i, e) in buf.chunks_exact(esize as usize).enumerate() {
        let mut type_guid = [0u8; 16];
        type_guid.copy_from_slice(&e[0..16]);
        if type_guid == [0u8; 16] {
            continue;
        }
        let mut unique_guid = [0u8; 16];
        unique_guid.copy_from_slice(&e[16..32]);
        let first = le64(e, 32);
        let last = le64(e, 40);
        if last < first {
            table.warnings.push(format!(
                "GPT entry {} ends before it starts; ignored",
                i + 1
            ));
            continue;
        }
        if last >= disk {
            table.warnings.push(format!(
                "GPT entry {} ends at LBA {last}, past the end of the disk ({disk} sectors)",
                i + 1
            ));
        }
        let units: Vec<u16> = e[56..128]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .take_while(|&u| u != 0)
            .collect();
        let (Some(start), Some(size)) = (
            first.checked_mul(SECTOR),
            (last - first)
                .checked_add(1)
                .and_then(|s| s.checked_mul(SECTOR)),
        ) else {
            table.warnings.push(format!(
                "GPT entry {} has an overflowing extent; ignored",
                i + 1
            ));
            continue;
        };
        table.partitions.push(Partition {
            number: i + 1,
            start,
            size,
            kind: PartitionType::Gpt {
                type_guid,
                unique_guid,
                name: String::from_utf16_lossy(&units),
            },
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::MemSource;

    fn mbr_disk() -> Vec<u8> {
        let mut d = vec![0u8; 64 * 1024];
        d[510] = 0x55;
        d[511] = 0xAA;
        let e = &mut d[446..462];
        e[4] = 0x83;
        e[8..12].copy_from_slice(&2048u32.to_le_bytes());
        e[12..16].copy_from_slice(&100u32.to_le_bytes());
        d
    }

    #[test]
    fn mbr_primary() {
        let t = read_partitions(&MemSource(mbr_disk())).expect("mbr");
        assert_eq!(t.scheme, Scheme::Mbr);
        assert_eq!(t.partitions.len(), 1);
        assert_eq!(t.partitions[0].start, 2048 * 512);
        assert_eq!(t.partitions[0].kind, PartitionType::Mbr(0x83));
        // Past the end of a 64 KiB disk: reported, not fatal.
        assert_eq!(t.warnings.len(), 1);
        assert!(t.get(2).is_err());
    }

    #[test]
    fn no_table_and_tiny_disk() {
        let t = read_partitions(&MemSource(vec![0u8; 4096])).expect("none");
        assert_eq!(t.scheme, Scheme::None);
        let t = read_partitions(&MemSource(vec![0u8; 10])).expect("tiny");
        assert_eq!(t.scheme, Scheme::None);
    }

    #[test]
    fn ebr_loop_is_bounded() {
        let mut d = mbr_disk();
        d[446 + 4] = 0x05; // extended at 2048
        d.resize(2048 * 512 + 512, 0);
        let ebr = 2048 * 512;
        d[ebr + 510] = 0x55;
        d[ebr + 511] = 0xAA;
        // logical entry + link back to itself
        d[ebr + 446 + 4] = 0x83;
        d[ebr + 446 + 8..ebr + 446 + 12].copy_from_slice(&1u32.to_le_bytes());
        d[ebr + 446 + 12..ebr + 446 + 16].copy_from_slice(&1u32.to_le_bytes());
        d[ebr + 462 + 4] = 0x05;
        d[ebr + 462 + 12..ebr + 462 + 16].copy_from_slice(&1u32.to_le_bytes());
        let t = read_partitions(&MemSource(d)).expect("loop tolerated");
        assert!(
            t.warnings.iter().any(|w| w.contains("loops")),
            "{:?}",
            t.warnings
        );
    }

    #[test]
    fn gpt_missing_header_is_error() {
        let mut d = mbr_disk();
        d[446 + 4] = 0xEE;
        let e = read_partitions(&MemSource(d)).expect_err("no header");
        assert!(e.to_string().contains("EFI PART"));
    }
}
