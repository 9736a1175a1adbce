//! Kernel profile: the graybox knowledge introspection needs about one exact guest kernel
//! (symbol addresses and struct layouts), captured once at image build like LibVMI/Volatility
//! profiles.
//!
//! Inputs: the kernel's real `System.map` (addresses as linked; valid at run time because the
//! guest boots with `nokaslr`), the raw BTF blob of its vmlinux (struct layouts) and its
//! `config`. Output: a small JSON file (`profile.json` in the image directory), whose format
//! ([`KernelProfile`]: types, reading, writing, lookups) is defined in
//! [`vmsight_proto::profile`], because the plugin inside QEMU reads it too. This module
//! generates profiles.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::btf::{Btf, BtfError};

pub use vmsight_proto::profile::{
    Addr, KernelProfile, MemberLayout, ProfileError, StructLayout, PROFILE_FORMAT,
};

/// Problems generating a kernel profile from System.map, BTF and config. (Reading, writing and
/// using a profile fail with [`ProfileError`], defined with the format in
/// [`vmsight_proto::profile`].)
#[derive(Debug, Error)]
pub enum GenerateError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("line {line} of {path} is not a System.map line (\"ADDRESS TYPE NAME\").")]
    BadSystemMap { path: PathBuf, line: usize },
    #[error("{0} looks like Debian's placeholder System.map; the real one is in the linux-image-*-dbg package")]
    PlaceholderSystemMap(PathBuf),
    #[error("the kernel symbol {0} is missing from System.map")]
    MissingSymbol(String),
    #[error("the struct {0} is missing from the kernel's BTF")]
    MissingStruct(String),
    #[error("the member {0}.{1} is missing from the kernel's BTF")]
    MissingMember(String, String),
    #[error(
        "The member {0}.{1} is a bitfield or not byte-aligned; the profile records bytes only."
    )]
    BitfieldMember(String, String),
    #[error("the kernel's BTF in {path} is unusable: {source}")]
    Btf {
        path: PathBuf,
        #[source]
        source: BtfError,
    },
    #[error("{path} does not contain a .BTF section")]
    NoBtfSection { path: PathBuf },
    #[error("the System.map and the BTF do not belong to the same kernel: __stop_BTF - __start_BTF is {map} bytes, the BTF blob has {blob}")]
    Mismatch { map: u64, blob: u64 },
}

/// Symbols every profile has. Each entry: the profile key and the System.map names to try, in
/// order (on x86-64 `swapper_pg_dir` is a C macro for `init_top_pgt`, so System.map has only
/// the latter).
pub const REQUIRED_SYMBOLS: &[(&str, &[&str])] = &[
    ("current_task", &["current_task"]),
    ("__per_cpu_offset", &["__per_cpu_offset"]),
    ("__per_cpu_start", &["__per_cpu_start"]),
    ("init_task", &["init_task"]),
    ("entry_SYSCALL_64", &["entry_SYSCALL_64"]),
    ("swapper_pg_dir", &["swapper_pg_dir", "init_top_pgt"]),
    ("init_top_pgt", &["init_top_pgt", "swapper_pg_dir"]),
    ("page_offset_base", &["page_offset_base"]),
    ("sys_call_table", &["sys_call_table"]),
    ("linux_banner", &["linux_banner"]),
];

/// Symbols recorded when present (they vary between kernel versions and configs).
pub const OPTIONAL_SYMBOLS: &[&str] = &[
    "_text",
    "_stext",
    "_etext",
    "_end",
    "__per_cpu_end",
    "__start_BTF",
    "__stop_BTF",
    "init_mm",
    "init_fs",
    "nr_cpu_ids",
    "cpu_number",
    "pcpu_hot",
    "vmalloc_base",
    "vmemmap_base",
    "phys_base",
    "ia32_sys_call_table",
    "x32_sys_call_table",
    "do_syscall_64",
    "entry_SYSCALL_64_after_hwframe",
    "startup_64",
    "jiffies_64",
    "__pgtable_l5_enabled",
    // FoxyIdle: the block submission path (a bio's submitter) and the prctl entry (a guest
    // program declaring itself background).
    "blk_mq_submit_bio",
    "__x64_sys_prctl",
];

/// Struct members every profile has: (struct, members).
pub const REQUIRED_MEMBERS: &[(&str, &[&str])] = &[
    (
        "task_struct",
        &[
            "pid",
            "tgid",
            "comm",
            "mm",
            "active_mm",
            "real_parent",
            "parent",
            "tasks",
            "group_leader",
            "fs",
            "files",
            "flags",
            "exit_state",
            "signal",
        ],
    ),
    ("mm_struct", &["pgd", "exe_file"]),
    ("files_struct", &["fdt"]),
    ("fdtable", &["max_fds", "fd"]),
    ("file", &["f_path", "f_inode", "f_pos", "f_flags", "f_mode"]),
    ("path", &["mnt", "dentry"]),
    ("dentry", &["d_parent", "d_name", "d_inode"]),
    ("qstr", &["name", "len"]),
    ("inode", &["i_mode", "i_ino", "i_size", "i_sb"]),
    ("fs_struct", &["root", "pwd"]),
    ("mount", &["mnt", "mnt_parent", "mnt_mountpoint"]),
    ("vfsmount", &["mnt_root"]),
    ("list_head", &["next", "prev"]),
];

/// Struct members recorded when present.
pub const OPTIONAL_MEMBERS: &[(&str, &[&str])] = &[
    (
        "task_struct",
        &[
            "thread_group",
            "children",
            "sibling",
            "cred",
            "real_cred",
            "start_time",
            "stack",
            "__state",
            "state",
            "exit_code",
            "thread_pid",
            "nsproxy",
            "thread",
            "thread_node",
        ],
    ),
    (
        "mm_struct",
        &[
            "start_code",
            "end_code",
            "start_brk",
            "brk",
            "start_stack",
            "arg_start",
            "arg_end",
            "env_start",
            "env_end",
        ],
    ),
    ("cred", &["uid", "gid", "euid", "egid"]),
    ("file", &["f_count", "private_data", "f_op"]),
    (
        "inode",
        &[
            "i_uid",
            "i_gid",
            "i_nlink",
            "i_mtime",
            "i_sb_list",
            "i_dentry",
        ],
    ),
    ("super_block", &["s_dev", "s_type", "s_root", "s_id"]),
    ("file_system_type", &["name"]),
    ("mount", &["mnt_devname", "mnt_list", "mnt_id"]),
    ("dentry", &["d_hash", "d_u"]),
    ("signal_struct", &["thread_head"]),
    // FoxyIdle: a bio's sectors, direction and disk; the prctl arguments in pt_regs.
    ("bio", &["bi_bdev", "bi_opf", "bi_iter"]),
    ("bvec_iter", &["bi_sector", "bi_size"]),
    ("block_device", &["bd_disk", "bd_dev"]),
    ("gendisk", &["major", "first_minor", "disk_name"]),
    ("pt_regs", &["di", "si", "dx"]),
    // Page ownership (`kernel::pages`): whose data a block request's pages hold.
    ("page", &["mapping", "index"]),
    ("address_space", &["host"]),
];

/// Config options copied into the profile when present.
pub const CONFIG_KEYS: &[&str] = &[
    "CONFIG_X86_64",
    "CONFIG_SMP",
    "CONFIG_NR_CPUS",
    "CONFIG_HZ",
    "CONFIG_PGTABLE_LEVELS",
    "CONFIG_X86_5LEVEL",
    "CONFIG_RANDOMIZE_BASE",
    "CONFIG_RANDOMIZE_MEMORY",
    "CONFIG_PAGE_TABLE_ISOLATION",
    "CONFIG_KALLSYMS_ABSOLUTE_PERCPU",
    "CONFIG_THREAD_INFO_IN_TASK",
    "CONFIG_PHYSICAL_START",
    "CONFIG_PHYSICAL_ALIGN",
    "CONFIG_DEBUG_INFO_BTF",
    "CONFIG_PREEMPT_DYNAMIC",
    "CONFIG_VIRTIO_BLK",
    "CONFIG_VIRTIO_CONSOLE",
    "CONFIG_FW_CFG_SYSFS",
];

/// Parses System.map text ("ADDRESS TYPE NAME" per line) into name → address, keeping the
/// first address of a name (duplicates are local symbols of different files).
pub fn parse_system_map(text: &str, path: &Path) -> Result<BTreeMap<String, u64>, GenerateError> {
    let mut map = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let mut it = line.split_whitespace();
        let bad = || GenerateError::BadSystemMap {
            path: path.into(),
            line: i + 1,
        };
        let (Some(addr), Some(_ty), Some(name)) = (it.next(), it.next(), it.next()) else {
            return Err(bad());
        };
        let addr = u64::from_str_radix(addr, 16).map_err(|_| bad())?;
        map.entry(name.to_string()).or_insert(addr);
    }
    if map.len() < 2 && text.contains("The real System.map is in") {
        return Err(GenerateError::PlaceholderSystemMap(path.into()));
    }
    Ok(map)
}

/// Upstream version from the config header ("# Linux/x86 6.1.192 Kernel Configuration") and
/// the selected options.
pub fn parse_config(text: &str) -> (String, BTreeMap<String, String>) {
    let mut version = String::new();
    let mut opts = BTreeMap::new();
    for line in text.lines() {
        if version.is_empty() {
            if let Some(rest) = line.strip_prefix("# Linux/") {
                if let Some(v) = rest.split_whitespace().nth(1) {
                    version = v.to_string();
                }
            }
        }
        if let Some((k, v)) = line.split_once('=') {
            if CONFIG_KEYS.contains(&k) {
                opts.insert(k.to_string(), v.trim_matches('"').to_string());
            }
        }
    }
    (version, opts)
}

/// Returns the BTF blob: the file itself if it is raw BTF, or its `.BTF` section if it is an
/// ELF file (e.g. an uncompressed vmlinux).
fn btf_blob(data: &[u8], path: &Path) -> Result<Vec<u8>, GenerateError> {
    if data.starts_with(b"\x7fELF") {
        return elf_section(data, ".BTF")
            .map(<[u8]>::to_vec)
            .ok_or_else(|| GenerateError::NoBtfSection { path: path.into() });
    }
    Ok(data.to_vec())
}

/// The content of section `name` in a 64-bit little-endian ELF file.
fn elf_section<'a>(data: &'a [u8], name: &str) -> Option<&'a [u8]> {
    let u16_at = |o: usize| data.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| {
        data.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        data.get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    // ELFCLASS64, ELFDATA2LSB.
    if data.get(4) != Some(&2) || data.get(5) != Some(&1) {
        return None;
    }
    let shoff = usize::try_from(u64_at(0x28)?).ok()?;
    let shentsize = usize::from(u16_at(0x3a)?);
    let shnum = usize::from(u16_at(0x3c)?);
    let shstrndx = usize::from(u16_at(0x3e)?);
    let shdr = |i: usize| -> Option<(u32, usize, usize)> {
        let base = shoff.checked_add(i.checked_mul(shentsize)?)?;
        let off = usize::try_from(u64_at(base + 0x18)?).ok()?;
        let size = usize::try_from(u64_at(base + 0x20)?).ok()?;
        Some((u32_at(base)?, off, size))
    };
    let (_, str_off, str_size) = shdr(shstrndx)?;
    let names = data.get(str_off..str_off.checked_add(str_size)?)?;
    (0..shnum).find_map(|i| {
        let (name_off, off, size) = shdr(i)?;
        let tail = names.get(name_off as usize..)?;
        let end = tail.iter().position(|&c| c == 0)?;
        (&tail[..end] == name.as_bytes()).then(|| data.get(off..off.checked_add(size)?))?
    })
}

/// Builds a profile from in-memory inputs (see [`generate`]).
pub fn generate_from(
    system_map: &BTreeMap<String, u64>,
    btf_data: &[u8],
    btf_path: &Path,
    config_text: &str,
) -> Result<KernelProfile, GenerateError> {
    let mut symbols = BTreeMap::new();
    for (key, names) in REQUIRED_SYMBOLS {
        let addr = names
            .iter()
            .find_map(|n| system_map.get(*n))
            .ok_or_else(|| GenerateError::MissingSymbol(names.join(" or ")))?;
        symbols.insert((*key).to_string(), Addr(*addr));
    }
    for name in OPTIONAL_SYMBOLS {
        if let Some(a) = system_map.get(*name) {
            symbols.insert((*name).to_string(), Addr(*a));
        }
    }

    let blob = btf_blob(btf_data, btf_path)?;
    // A cheap guard against mixing files of two kernels: the linker-script symbols around the
    // .BTF section must span exactly the blob.
    if let (Some(start), Some(stop)) = (system_map.get("__start_BTF"), system_map.get("__stop_BTF"))
    {
        let span = stop.wrapping_sub(*start);
        if span != blob.len() as u64 {
            return Err(GenerateError::Mismatch {
                map: span,
                blob: blob.len() as u64,
            });
        }
    }
    let btf = Btf::parse(&blob).map_err(|source| GenerateError::Btf {
        path: btf_path.into(),
        source,
    })?;
    let btf_err = |source| GenerateError::Btf {
        path: btf_path.into(),
        source,
    };

    let mut structs: BTreeMap<String, StructLayout> = BTreeMap::new();
    let mut add = |strukt: &str, members: &[&str], required: bool| -> Result<(), GenerateError> {
        let Some((id, t)) = btf.struct_by_name(strukt) else {
            return if required {
                Err(GenerateError::MissingStruct(strukt.into()))
            } else {
                Ok(())
            };
        };
        let layout = structs
            .entry(strukt.to_string())
            .or_insert_with(|| StructLayout {
                size: u64::from(t.size_or_type),
                members: BTreeMap::new(),
            });
        for m in members {
            let Some(found) = btf.find_member(id, m).map_err(btf_err)? else {
                if required {
                    return Err(GenerateError::MissingMember(strukt.into(), (*m).into()));
                }
                continue;
            };
            if found.bitfield_size != 0 || found.bit_offset % 8 != 0 {
                if required {
                    return Err(GenerateError::BitfieldMember(strukt.into(), (*m).into()));
                }
                continue;
            }
            let size = btf.size_of(found.type_id).map_err(btf_err)?;
            layout.members.insert(
                (*m).to_string(),
                MemberLayout {
                    offset: u64::from(found.bit_offset / 8),
                    size,
                },
            );
        }
        Ok(())
    };
    for (s, ms) in REQUIRED_MEMBERS {
        add(s, ms, true)?;
    }
    for (s, ms) in OPTIONAL_MEMBERS {
        add(s, ms, false)?;
    }

    let (kernel_version, config) = parse_config(config_text);
    Ok(KernelProfile {
        format: PROFILE_FORMAT,
        kernel_version,
        kernel_release: String::new(),
        symbols,
        structs,
        config,
    })
}

/// Generates the profile of a kernel from its real System.map, its BTF (raw `.BTF` blob, or an
/// ELF vmlinux that contains one) and its config file. Fails with an error naming the first
/// missing symbol, struct or member.
pub fn generate(
    system_map: &Path,
    btf: &Path,
    config: &Path,
) -> Result<KernelProfile, GenerateError> {
    let read = |p: &Path| {
        fs::read(p).map_err(|source| GenerateError::Read {
            path: p.into(),
            source,
        })
    };
    let map_text = String::from_utf8_lossy(&read(system_map)?).into_owned();
    let map = parse_system_map(&map_text, system_map)?;
    let btf_data = read(btf)?;
    let config_text = String::from_utf8_lossy(&read(config)?).into_owned();
    generate_from(&map, &btf_data, btf, &config_text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::btf::kind;
    use crate::btf::tests::Builder;

    /// A BTF blob with every required struct and member (dummy layouts), plus `qstr` with the
    /// kernel's anonymous union/struct nesting.
    fn crafted_btf(drop_member: Option<(&str, &str)>) -> Vec<u8> {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        let u64t = b.int("long long unsigned int", 8);
        let ptr = b.ptr(0);
        let u8t = b.int("unsigned char", 1);
        let comm = b.array(u8t, int, 16);
        let inner = b.composite(kind::STRUCT, "", 8, &[("hash", int, 0), ("len", int, 32)]);
        let un = b.composite(kind::UNION, "", 8, &[("", inner, 0), ("hash_len", u64t, 0)]);
        b.composite(kind::STRUCT, "qstr", 16, &[("", un, 0), ("name", ptr, 64)]);
        for (s, members) in REQUIRED_MEMBERS {
            if *s == "qstr" {
                continue;
            }
            let list: Vec<(&str, u32, u32)> = members
                .iter()
                .filter(|m| drop_member != Some((s, m)))
                .enumerate()
                .map(|(i, m)| (*m, if *m == "comm" { comm } else { ptr }, (i as u32) * 128))
                .collect();
            b.composite(kind::STRUCT, s, 16 * members.len() as u32 + 8, &list);
        }
        b.finish()
    }

    fn crafted_map() -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        // Like x86-64: init_top_pgt only, swapper_pg_dir must be found through it.
        for (i, (key, _)) in REQUIRED_SYMBOLS
            .iter()
            .enumerate()
            .filter(|(_, (k, _))| *k != "swapper_pg_dir")
        {
            m.insert((*key).to_string(), 0xffff_ffff_8100_0000 + i as u64 * 0x100);
        }
        m
    }

    #[test]
    fn generates_from_crafted_inputs() {
        let config = "#\n# Linux/x86 6.1.192 Kernel Configuration\n#\nCONFIG_X86_64=y\nCONFIG_PGTABLE_LEVELS=4\n# CONFIG_X86_5LEVEL is not set\nCONFIG_FOO=y\n";
        let p = generate_from(
            &crafted_map(),
            &crafted_btf(None),
            Path::new("t.btf"),
            config,
        )
        .expect("profile");
        assert_eq!(p.kernel_version, "6.1.192");
        assert_eq!(
            p.config.get("CONFIG_PGTABLE_LEVELS").map(String::as_str),
            Some("4")
        );
        assert!(!p.config.contains_key("CONFIG_FOO"));
        // swapper_pg_dir is found under its x86-64 name init_top_pgt.
        assert_eq!(
            p.symbol("swapper_pg_dir").expect("alias"),
            p.symbol("init_top_pgt").expect("sym")
        );
        assert_eq!(
            p.member("qstr", "len").expect("len"),
            MemberLayout { offset: 4, size: 4 }
        );
        assert_eq!(
            p.member("qstr", "name").expect("name"),
            MemberLayout { offset: 8, size: 8 }
        );
        assert_eq!(p.member("task_struct", "comm").expect("comm").size, 16);
        assert_eq!(p.member("task_struct", "tgid").expect("tgid").offset, 16);
        assert!(matches!(
            p.member("task_struct", "nope"),
            Err(ProfileError::MissingMember(..))
        ));

        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("profile.json");
        p.save(&path).expect("save");
        assert_eq!(KernelProfile::load(&path).expect("load"), p);
    }

    #[test]
    fn names_what_is_missing() {
        let mut map = crafted_map();
        map.remove("page_offset_base");
        let e =
            generate_from(&map, &crafted_btf(None), Path::new("t.btf"), "").expect_err("must fail");
        assert!(e.to_string().contains("page_offset_base"), "{e}");

        let btf = crafted_btf(Some(("dentry", "d_parent")));
        let e = generate_from(&crafted_map(), &btf, Path::new("t.btf"), "").expect_err("must fail");
        assert_eq!(
            e.to_string(),
            "the member dentry.d_parent is missing from the kernel's BTF"
        );

        let mut map = crafted_map();
        map.insert("__start_BTF".into(), 0x1000);
        map.insert("__stop_BTF".into(), 0x1001);
        let e =
            generate_from(&map, &crafted_btf(None), Path::new("t.btf"), "").expect_err("must fail");
        assert!(matches!(e, GenerateError::Mismatch { map: 1, .. }), "{e}");
    }

    #[test]
    fn system_map_parsing() {
        let p = Path::new("System.map");
        let m = parse_system_map(
            "0000000000000000 D __per_cpu_start\nffffffff81000000 T _text\n",
            p,
        )
        .expect("map");
        assert_eq!(m.get("_text"), Some(&0xffff_ffff_8100_0000));
        let e = parse_system_map(
            "ffffffffffffffff B The real System.map is in the linux-image-<version>-dbg package\n",
            p,
        );
        assert!(matches!(e, Err(GenerateError::PlaceholderSystemMap(_))));
        assert!(matches!(
            parse_system_map("zz T x\n", p),
            Err(GenerateError::BadSystemMap { line: 1, .. })
        ));
    }

    #[test]
    fn format_mismatch_is_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("profile.json");
        fs::write(&path, r#"{"format": 999}"#).expect("write");
        assert!(matches!(
            KernelProfile::load(&path),
            Err(ProfileError::Format { found: 999, .. })
        ));
    }

    /// The real kernel: VMSIGHT_TEST_KERNEL_DIR names a directory with System.map,
    /// vmlinux.btf (or vmlinux) and config, e.g. an image directory of the cache. `make test`
    /// runs it against the cached guest image.
    #[test]
    #[ignore = "needs VMSIGHT_TEST_KERNEL_DIR=<image dir>; make test sets it"]
    fn real_kernel_profile() {
        let dir = std::env::var_os("VMSIGHT_TEST_KERNEL_DIR")
            .map(PathBuf::from)
            .expect(
                "set VMSIGHT_TEST_KERNEL_DIR to a directory with System.map, vmlinux.btf, config",
            );
        let btf = if dir.join("vmlinux.btf").exists() {
            dir.join("vmlinux.btf")
        } else {
            dir.join("vmlinux")
        };
        let p = generate(&dir.join("System.map"), &btf, &dir.join("config")).expect("real profile");
        assert!(p.kernel_version.starts_with("6."), "{}", p.kernel_version);
        assert_eq!(p.symbol("__per_cpu_start").expect("per-cpu start"), 0);
        assert!(p.symbol("init_task").expect("init_task") >= 0xffff_ffff_8000_0000);
        assert_eq!(p.member("task_struct", "comm").expect("comm").size, 16);
        assert_eq!(
            p.member("qstr", "len").expect("len"),
            MemberLayout { offset: 4, size: 4 }
        );
        assert_eq!(p.member("list_head", "prev").expect("prev").offset, 8);
        assert!(p.struct_size("task_struct").expect("sizeof") > 1000);
    }
}
