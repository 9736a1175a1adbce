//! A small reader for the BPF Type Format (BTF) blob of a kernel (`.BTF` section of vmlinux).
//!
//! Hand-written rather than taken from crates.io: the maintained parser (`btf-rs`) is
//! LGPL-2.1, which does not sit well with statically linking it into this Apache-2.0 project,
//! and the profile needs only a fraction of BTF: type records, struct/union members, type
//! sizes. The format is specified in the kernel's Documentation/bpf/btf.rst; this reader covers
//! every kind up to BTF_KIND_ENUM64 (kernel 6.0) so it can walk the whole type section, and
//! rejects unknown kinds with a clear error instead of misparsing.

use std::collections::HashMap;

use thiserror::Error;

/// Problems with a BTF blob.
#[derive(Debug, Error)]
pub enum BtfError {
    #[error("the BTF data is too short ({0} bytes) to hold a header")]
    TooShort(usize),
    #[error("the BTF magic is {0:#06x}, not 0xeb9f; this is not (little-endian) BTF")]
    BadMagic(u16),
    #[error("the BTF header describes sections outside the {len}-byte blob ({what})")]
    BadHeader { what: &'static str, len: usize },
    #[error("BTF type {id} is truncated at byte {offset} of the type section")]
    Truncated { id: u32, offset: usize },
    #[error("BTF type {id} has unknown kind {kind}; this BTF is newer than this reader")]
    UnknownKind { id: u32, kind: u32 },
    #[error("BTF type id {0} does not exist")]
    BadTypeId(u32),
    #[error("BTF string offset {0} is outside the string section")]
    BadString(u32),
    #[error("BTF type chain starting at id {0} is too deep (a loop?)")]
    TooDeep(u32),
    #[error("BTF type {0} has no size (void, function or forward declaration)")]
    Unsized(u32),
}

/// BTF kinds (`BTF_KIND_*`).
pub mod kind {
    pub const INT: u32 = 1;
    pub const PTR: u32 = 2;
    pub const ARRAY: u32 = 3;
    pub const STRUCT: u32 = 4;
    pub const UNION: u32 = 5;
    pub const ENUM: u32 = 6;
    pub const FWD: u32 = 7;
    pub const TYPEDEF: u32 = 8;
    pub const VOLATILE: u32 = 9;
    pub const CONST: u32 = 10;
    pub const RESTRICT: u32 = 11;
    pub const FUNC: u32 = 12;
    pub const FUNC_PROTO: u32 = 13;
    pub const VAR: u32 = 14;
    pub const DATASEC: u32 = 15;
    pub const FLOAT: u32 = 16;
    pub const DECL_TAG: u32 = 17;
    pub const TYPE_TAG: u32 = 18;
    pub const ENUM64: u32 = 19;
}

/// One struct or union member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Empty for anonymous struct/union members.
    pub name: String,
    pub type_id: u32,
    /// Offset from the start of the enclosing struct, in bits.
    pub bit_offset: u32,
    /// Non-zero for bitfields.
    pub bitfield_size: u32,
}

/// One type record.
#[derive(Debug, Clone)]
pub struct Type {
    pub kind: u32,
    pub name: String,
    /// `size` for INT/STRUCT/UNION/ENUM/FLOAT, referenced type id for PTR/TYPEDEF/modifiers.
    pub size_or_type: u32,
    /// Struct/union members (empty for other kinds).
    pub members: Vec<Member>,
    /// ARRAY only: element type and element count.
    pub array: Option<(u32, u32)>,
}

/// A parsed BTF blob.
#[derive(Debug)]
pub struct Btf {
    /// Index = type id; id 0 is `void`.
    types: Vec<Type>,
    /// Struct/union ids by name, in id order.
    by_name: HashMap<String, Vec<u32>>,
}

const HEADER_MIN: usize = 24;
const MAX_CHAIN: usize = 64;

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    let s = b.get(off..off + 4)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

impl Btf {
    /// Parses a raw BTF blob (the content of a `.BTF` section or `/sys/kernel/btf/vmlinux`).
    pub fn parse(data: &[u8]) -> Result<Btf, BtfError> {
        if data.len() < HEADER_MIN {
            return Err(BtfError::TooShort(data.len()));
        }
        let magic = u16::from_le_bytes([data[0], data[1]]);
        if magic != 0xeb9f {
            return Err(BtfError::BadMagic(magic));
        }
        let field = |off| u32_at(data, off).ok_or(BtfError::TooShort(data.len()));
        let hdr_len = field(4)? as usize;
        let (type_off, type_len) = (field(8)? as usize, field(12)? as usize);
        let (str_off, str_len) = (field(16)? as usize, field(20)? as usize);
        let section = |off: usize, len: usize, what| {
            let start = hdr_len.checked_add(off);
            let end = start.and_then(|s| s.checked_add(len));
            match (start, end) {
                (Some(s), Some(e)) if e <= data.len() => Ok(&data[s..e]),
                _ => Err(BtfError::BadHeader {
                    what,
                    len: data.len(),
                }),
            }
        };
        let types_sec = section(type_off, type_len, "type section")?;
        let strings = section(str_off, str_len, "string section")?;
        let string = |off: u32| -> Result<String, BtfError> {
            let tail = strings
                .get(off as usize..)
                .ok_or(BtfError::BadString(off))?;
            let end = tail
                .iter()
                .position(|&c| c == 0)
                .ok_or(BtfError::BadString(off))?;
            Ok(String::from_utf8_lossy(&tail[..end]).into_owned())
        };

        let void = Type {
            kind: 0,
            name: String::new(),
            size_or_type: 0,
            members: vec![],
            array: None,
        };
        let mut types = vec![void];
        let mut pos = 0usize;
        while pos < types_sec.len() {
            let id = types.len() as u32;
            let rd =
                |off: usize| u32_at(types_sec, off).ok_or(BtfError::Truncated { id, offset: off });
            let name_off = rd(pos)?;
            let info = rd(pos + 4)?;
            let size_or_type = rd(pos + 8)?;
            pos += 12;
            let vlen = (info & 0xffff) as usize;
            let k = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            let mut members = Vec::new();
            let mut array = None;
            match k {
                kind::INT | kind::VAR | kind::DECL_TAG => pos += 4,
                kind::PTR
                | kind::FWD
                | kind::TYPEDEF
                | kind::VOLATILE
                | kind::CONST
                | kind::RESTRICT
                | kind::FUNC
                | kind::FLOAT
                | kind::TYPE_TAG => {}
                kind::ARRAY => {
                    array = Some((rd(pos)?, rd(pos + 8)?));
                    pos += 12;
                }
                kind::STRUCT | kind::UNION => {
                    members.reserve(vlen);
                    for _ in 0..vlen {
                        let raw = rd(pos + 8)?;
                        // With kind_flag the offset word is bitfield_size << 24 | bit_offset.
                        let (bit_offset, bitfield_size) = if kind_flag {
                            (raw & 0xff_ffff, raw >> 24)
                        } else {
                            (raw, 0)
                        };
                        members.push(Member {
                            name: string(rd(pos)?)?,
                            type_id: rd(pos + 4)?,
                            bit_offset,
                            bitfield_size,
                        });
                        pos += 12;
                    }
                }
                kind::ENUM | kind::FUNC_PROTO => pos += 8 * vlen,
                kind::DATASEC | kind::ENUM64 => pos += 12 * vlen,
                _ => return Err(BtfError::UnknownKind { id, kind: k }),
            }
            if pos > types_sec.len() {
                return Err(BtfError::Truncated { id, offset: pos });
            }
            // Only struct/union names are looked up; reading other names would waste time.
            let name = if matches!(k, kind::STRUCT | kind::UNION) {
                string(name_off)?
            } else {
                String::new()
            };
            types.push(Type {
                kind: k,
                name,
                size_or_type,
                members,
                array,
            });
        }

        let mut by_name: HashMap<String, Vec<u32>> = HashMap::new();
        for (id, t) in types.iter().enumerate() {
            if !t.name.is_empty() {
                by_name.entry(t.name.clone()).or_default().push(id as u32);
            }
        }
        Ok(Btf { types, by_name })
    }

    /// Number of types, including `void`.
    pub fn len(&self) -> usize {
        self.types.len()
    }

    /// Always false: `void` is type 0.
    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }

    pub fn get(&self, id: u32) -> Result<&Type, BtfError> {
        self.types.get(id as usize).ok_or(BtfError::BadTypeId(id))
    }

    /// The first complete struct named `name` (unions are returned too, for `union` lookups).
    /// Forward declarations are skipped; BTF dedup leaves one full definition per name.
    pub fn struct_by_name(&self, name: &str) -> Option<(u32, &Type)> {
        self.by_name.get(name)?.iter().find_map(|&id| {
            let t = &self.types[id as usize];
            matches!(t.kind, kind::STRUCT | kind::UNION).then_some((id, t))
        })
    }

    /// Follows typedefs and qualifiers (const, volatile, restrict, type tags) to the real type.
    pub fn resolve(&self, mut id: u32) -> Result<u32, BtfError> {
        for _ in 0..MAX_CHAIN {
            let t = self.get(id)?;
            match t.kind {
                kind::TYPEDEF | kind::VOLATILE | kind::CONST | kind::RESTRICT | kind::TYPE_TAG => {
                    id = t.size_or_type;
                }
                _ => return Ok(id),
            }
        }
        Err(BtfError::TooDeep(id))
    }

    /// `sizeof` of a type, in bytes (pointers are 8 bytes: this reader serves x86-64 kernels).
    pub fn size_of(&self, id: u32) -> Result<u64, BtfError> {
        let rid = self.resolve(id)?;
        let t = self.get(rid)?;
        match t.kind {
            kind::INT | kind::STRUCT | kind::UNION | kind::ENUM | kind::ENUM64 | kind::FLOAT => {
                Ok(u64::from(t.size_or_type))
            }
            kind::PTR => Ok(8),
            kind::ARRAY => {
                let (elem, n) = t.array.ok_or(BtfError::Unsized(rid))?;
                Ok(self.size_of(elem)? * u64::from(n))
            }
            _ => Err(BtfError::Unsized(rid)),
        }
    }

    /// Finds member `name` of struct/union `id`, descending into anonymous struct/union members
    /// (e.g. `qstr.len` lives in an anonymous union inside an anonymous struct). Returns the
    /// member with its bit offset made relative to the outer struct.
    pub fn find_member(&self, id: u32, name: &str) -> Result<Option<Member>, BtfError> {
        self.find_member_depth(id, name, 0)
    }

    fn find_member_depth(
        &self,
        id: u32,
        name: &str,
        depth: usize,
    ) -> Result<Option<Member>, BtfError> {
        if depth > MAX_CHAIN {
            return Err(BtfError::TooDeep(id));
        }
        let t = self.get(self.resolve(id)?)?;
        if let Some(m) = t.members.iter().find(|m| m.name == name) {
            return Ok(Some(m.clone()));
        }
        for m in t.members.iter().filter(|m| m.name.is_empty()) {
            let inner = self.resolve(m.type_id)?;
            if !matches!(self.get(inner)?.kind, kind::STRUCT | kind::UNION) {
                continue;
            }
            if let Some(mut found) = self.find_member_depth(inner, name, depth + 1)? {
                found.bit_offset += m.bit_offset;
                return Ok(Some(found));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds BTF blobs by hand for tests.
    #[derive(Default)]
    pub(crate) struct Builder {
        types: Vec<u8>,
        strings: Vec<u8>,
        next_id: u32,
    }

    impl Builder {
        pub(crate) fn new() -> Self {
            Builder {
                types: vec![],
                strings: vec![0],
                next_id: 1,
            }
        }

        fn str(&mut self, s: &str) -> u32 {
            if s.is_empty() {
                return 0;
            }
            let off = self.strings.len() as u32;
            self.strings.extend_from_slice(s.as_bytes());
            self.strings.push(0);
            off
        }

        fn push(&mut self, name: &str, k: u32, vlen: u32, flag: bool, size_or_type: u32) -> u32 {
            let name_off = self.str(name);
            let info = (k << 24) | vlen | if flag { 1 << 31 } else { 0 };
            for w in [name_off, info, size_or_type] {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
            self.next_id += 1;
            self.next_id - 1
        }

        pub(crate) fn int(&mut self, name: &str, size: u32) -> u32 {
            let id = self.push(name, kind::INT, 0, false, size);
            self.types.extend_from_slice(&(size * 8).to_le_bytes());
            id
        }

        pub(crate) fn ptr(&mut self, to: u32) -> u32 {
            self.push("", kind::PTR, 0, false, to)
        }

        pub(crate) fn typedef(&mut self, name: &str, to: u32) -> u32 {
            self.push(name, kind::TYPEDEF, 0, false, to)
        }

        pub(crate) fn array(&mut self, elem: u32, index: u32, n: u32) -> u32 {
            let id = self.push("", kind::ARRAY, 0, false, 0);
            for w in [elem, index, n] {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
            id
        }

        /// `members`: (name, type id, bit offset).
        pub(crate) fn composite(
            &mut self,
            k: u32,
            name: &str,
            size: u32,
            members: &[(&str, u32, u32)],
        ) -> u32 {
            let id = self.push(name, k, members.len() as u32, false, size);
            for &(n, t, off) in members {
                let n = self.str(n);
                for w in [n, t, off] {
                    self.types.extend_from_slice(&w.to_le_bytes());
                }
            }
            id
        }

        pub(crate) fn fwd(&mut self, name: &str) -> u32 {
            self.push(name, kind::FWD, 0, false, 0)
        }

        pub(crate) fn finish(&self) -> Vec<u8> {
            let mut out = Vec::new();
            out.extend_from_slice(&0xeb9fu16.to_le_bytes());
            out.extend_from_slice(&[1, 0]);
            let tl = self.types.len() as u32;
            for w in [24u32, 0, tl, tl, self.strings.len() as u32] {
                out.extend_from_slice(&w.to_le_bytes());
            }
            out.extend_from_slice(&self.types);
            out.extend_from_slice(&self.strings);
            out
        }
    }

    #[test]
    fn parses_members_sizes_and_anonymous_nesting() {
        let mut b = Builder::new();
        let u32t = b.int("unsigned int", 4);
        let u64t = b.int("long long unsigned int", 8);
        let u8t = b.int("unsigned char", 1);
        let u32td = b.typedef("u32", u32t);
        let name_ptr = b.ptr(u8t);
        let inner = b.composite(
            kind::STRUCT,
            "",
            8,
            &[("hash", u32td, 0), ("len", u32td, 32)],
        );
        let un = b.composite(kind::UNION, "", 8, &[("", inner, 0), ("hash_len", u64t, 0)]);
        let qstr = b.composite(
            kind::STRUCT,
            "qstr",
            16,
            &[("", un, 0), ("name", name_ptr, 64)],
        );
        let arr = b.array(u8t, u32t, 16);
        b.fwd("task_struct");
        let task = b.composite(
            kind::STRUCT,
            "task_struct",
            48,
            &[("comm", arr, 0), ("d_name", qstr, 128)],
        );
        let btf = Btf::parse(&b.finish()).expect("crafted BTF parses");

        assert_eq!(
            btf.struct_by_name("task_struct").map(|(id, _)| id),
            Some(task)
        );
        assert_eq!(btf.size_of(arr).expect("array size"), 16);
        assert_eq!(btf.size_of(name_ptr).expect("pointer size"), 8);
        assert_eq!(btf.size_of(u32td).expect("typedef size"), 4);
        let len = btf
            .find_member(qstr, "len")
            .expect("walk")
            .expect("len found");
        assert_eq!(len.bit_offset, 32);
        let name = btf
            .find_member(qstr, "name")
            .expect("walk")
            .expect("name found");
        assert_eq!(name.bit_offset, 64);
        assert!(btf.find_member(qstr, "nope").expect("walk").is_none());
    }

    #[test]
    fn rejects_garbage() {
        assert!(matches!(Btf::parse(&[0; 8]), Err(BtfError::TooShort(8))));
        assert!(matches!(Btf::parse(&[0; 32]), Err(BtfError::BadMagic(0))));
        let mut b = Builder::new();
        b.int("int", 4);
        let mut blob = b.finish();
        blob.truncate(blob.len() - 4);
        assert!(matches!(Btf::parse(&blob), Err(BtfError::BadHeader { .. })));
    }
}
