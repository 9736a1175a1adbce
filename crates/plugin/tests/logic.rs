//! Unit tests of the plugin's pure logic (argument parsing, profile parsing, instruction
//! decoding, argument tables, classification). The module is compiled into this test
//! directly: the library itself references QEMU's API, which only exists inside QEMU, so a
//! test binary linking it could not start.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

#[path = "../src/logic.rs"]
#[allow(dead_code)]
mod logic;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use logic::*;
use vmsight_proto::profile::KernelProfile;
use vmsight_ring::{MonitorFilters, COMM_LEN};

#[test]
fn options_parse() {
    let o = Options::parse(["shm=/tmp/x.shm"]).expect("minimal");
    assert_eq!(o.shm, PathBuf::from("/tmp/x.shm"));
    assert!(o.records && !o.verbose && o.profile.is_none());
    assert_eq!(o.sync_every, DEFAULT_SYNC_EVERY);
    assert_eq!(o.buf, DEFAULT_BUF_BYTES);
    let o = Options::parse([
        "records=off",
        "shm=/a",
        "profile=/p.json",
        "buf=0",
        "sync=7",
        "verbose=yes",
    ])
    .expect("full");
    assert!(!o.records && o.verbose);
    assert!(o.count && o.translates(), "counting is on by default");
    let dormant = Options::parse(["shm=/a", "records=off", "count=off"]).expect("dormant");
    assert!(
        !dormant.translates(),
        "nothing asked: no translation callback"
    );
    for needs in ["records=on", "blk=/b", "symsync=on", "count=on"] {
        let o = Options::parse(["shm=/a", "records=off", "count=off", needs]).expect(needs);
        assert!(o.translates(), "{needs} needs translated code instrumented");
    }
    assert_eq!(o.profile, Some(PathBuf::from("/p.json")));
    assert_eq!((o.buf, o.sync_every), (0, 7));
    assert!(matches!(Options::parse([]), Err(PluginError::MissingShm)));
    for bad in [
        &["shm="][..],
        &["shm=/a", "records=maybe"],
        &["shm=/a", "count=2"],
        &["shm=/a", "sync=0"],
        &["shm=/a", "buf=4097"],
        &["shm=/a", "buf=-1"],
        &["shm=/a", "profile="],
    ] {
        assert!(
            matches!(
                Options::parse(bad.iter().copied()),
                Err(PluginError::BadValue { .. })
            ),
            "{bad:?}"
        );
    }
    assert!(matches!(
        Options::parse(["shm=/a", "peek=on"]),
        Err(PluginError::Unknown(_))
    ));
    assert!(matches!(
        Options::parse(["shm"]),
        Err(PluginError::Malformed(_))
    ));
    let msg = PluginError::MissingShm.to_string();
    assert!(msg.starts_with("the argument shm=PATH"), "{msg}");
}

const PROFILE: &str = r#"{
  "format": 3, "kernel_version": "6.1", "kernel_release": "x",
  "symbols": {"current_task": "0x000000000001fb80", "__per_cpu_start": "0x0000000000000000",
              "page_offset_base": "0xffffffff82398480"},
  "structs": {
    "task_struct": {"size": 9728, "members": {
      "pid": {"offset": 2416, "size": 4}, "tgid": {"offset": 2420, "size": 4},
      "comm": {"offset": 2976, "size": 16}, "real_parent": {"offset": 2432, "size": 8},
      "signal": {"offset": 3064, "size": 8}, "mm": {"offset": 2272, "size": 8}}},
    "mm_struct": {"size": 1096, "members": {"pgd": {"offset": 72, "size": 8}}}
  },
  "config": {}
}"#;

/// The layout of a profile text, or the error as text.
fn layout(text: &str) -> Result<KernelLayout, String> {
    let p = KernelProfile::from_json(text, Path::new("p.json")).map_err(|e| e.to_string())?;
    KernelLayout::from_profile(&p).map_err(|e| e.to_string())
}

/// The block submission path of the 6.1 cloud kernel (its BTF), added to [`PROFILE`].
fn block_profile(with_prctl: bool) -> String {
    let prctl = if with_prctl {
        r#", "__x64_sys_prctl": "0xffffffff810b3a80""#
    } else {
        ""
    };
    PROFILE
        .replace(
            r#""page_offset_base": "0xffffffff82398480""#,
            &format!(
                r#""page_offset_base": "0xffffffff82398480", "blk_mq_submit_bio": "0xffffffff81552580"{prctl}"#
            ),
        )
        .replace(
            r#""mm": {"offset": 2272, "size": 8}}},"#,
            r#""mm": {"offset": 2272, "size": 8}, "flags": {"offset": 44, "size": 4}}},
    "bio": {"size": 136, "members": {"bi_bdev": {"offset": 8, "size": 8},
      "bi_opf": {"offset": 16, "size": 4}, "bi_iter": {"offset": 32, "size": 24}}},
    "bvec_iter": {"size": 24, "members": {"bi_sector": {"offset": 0, "size": 8},
      "bi_size": {"offset": 8, "size": 4}}},
    "block_device": {"size": 1024, "members": {"bd_disk": {"offset": 848, "size": 8},
      "bd_dev": {"offset": 36, "size": 4}}},
    "gendisk": {"size": 1024, "members": {"major": {"offset": 0, "size": 4},
      "first_minor": {"offset": 4, "size": 4}, "disk_name": {"offset": 12, "size": 32}}},
    "pt_regs": {"size": 168, "members": {"di": {"offset": 112, "size": 8},
      "si": {"offset": 104, "size": 8}, "dx": {"offset": 96, "size": 8}}},"#,
        )
}

#[test]
fn block_layout_comes_from_the_profile_when_it_has_the_submission_path() {
    assert_eq!(layout(PROFILE).expect("valid").block, None);
    let b = layout(&block_profile(true))
        .expect("valid")
        .block
        .expect("block layout");
    assert_eq!(b.submit_bio, 0xffff_ffff_8155_2580);
    assert_eq!(b.prctl, Some(0xffff_ffff_810b_3a80));
    assert_eq!(
        (b.bi_sector, b.bi_size, b.bi_opf, b.bi_bdev),
        (32, 40, 16, 8)
    );
    assert_eq!(
        (b.bd_disk, b.major, b.first_minor, b.disk_name),
        (848, 0, 4, 12)
    );
    assert_eq!(
        (b.regs_di, b.regs_si, b.regs_dx, b.task_flags),
        (112, 104, 96, 44)
    );
    // Declarations are optional; the submission path is not.
    let b = layout(&block_profile(false)).expect("valid").block;
    assert_eq!(b.and_then(|b| b.prctl), None);
    assert!(b.is_some());
    let broken = block_profile(true).replace(r#""bi_size": {"offset": 8, "size": 4}"#, "");
    assert!(layout(&broken.replace(
        "\"bi_sector\": {\"offset\": 0, \"size\": 8},",
        "\"bi_sector\": {\"offset\": 0, \"size\": 8}"
    ))
    .expect("valid")
    .block
    .is_none());
}

#[test]
fn profile_parse() {
    let l = layout(PROFILE).expect("valid profile");
    assert_eq!(l.current_task, 0x1fb80);
    assert_eq!(
        (l.pid, l.tgid, l.comm, l.real_parent),
        (2416, 2420, 2976, 2432)
    );
    assert_eq!((l.mm, l.mm_pgd), (2272, 72));
    assert_eq!(l.page_offset_base, 0xffff_ffff_8239_8480);
    assert_eq!(l.files, None, "no fd-table members in this profile");
    let e = layout(&PROFILE.replace("\"tgid\"", "\"tgidx\"")).expect_err("missing member");
    assert_eq!(e, "it has no member task_struct.tgid");
    let e =
        layout(&PROFILE.replace("\"page_offset_base\"", "\"pob\"")).expect_err("missing symbol");
    assert_eq!(e, "it has no symbol page_offset_base");
    let e = layout(&PROFILE.replace(
        "\"offset\": 2416, \"size\": 4",
        "\"offset\": 2416, \"size\": 8",
    ))
    .expect_err("wrong size");
    assert_eq!(
        e,
        "task_struct.pid has size 8 at offset 2416, expected 4 bytes"
    );
    assert!(layout("not json").is_err());
    let e = layout(&PROFILE.replace("\"format\": 3", "\"format\": 2")).expect_err("format");
    assert!(e.contains("profile format 2"), "{e}");
    let e = layout(&PROFILE.replace("0x000000000001fb80", "0xffffffff8201fb80"))
        .expect_err("not per-cpu");
    assert!(e.contains("per-CPU"), "{e}");
    let msg = PluginError::Profile {
        path: "/x/profile.json".into(),
        source: LayoutError::MissingSymbol("current_task".into()),
    }
    .to_string();
    assert_eq!(
        msg,
        "cannot use the kernel profile /x/profile.json: it has no symbol current_task"
    );
    let e = KernelLayout::load(Path::new("/nonexistent/profile.json")).expect_err("no file");
    assert!(matches!(e, PluginError::ProfileFile(_)), "{e}");
    // A real profile of a cached image in the current format, when present (images of older
    // recipes keep a profile of the format they were last opened with).
    let current = |p: &Path| KernelProfile::load(p).is_ok();
    if let Some(p) = std::fs::read_dir("/root/.cache/vmsight/images")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("profile.json"))
        .find(|p| current(p))
    {
        let l = KernelLayout::load(&p).expect("image profile");
        assert!(l.current_task > 0 && l.comm > 0);
    }
}

#[test]
fn syscall_decoding() {
    assert!(is_syscall_insn(&[0x0f, 0x05]));
    assert!(is_syscall_insn(&[0x48, 0x0f, 0x05]));
    assert!(is_syscall_insn(&[0x66, 0x2e, 0x0f, 0x05]));
    assert!(!is_syscall_insn(&[0x0f, 0x34])); // sysenter
    assert!(!is_syscall_insn(&[0x0f]));
    assert!(!is_syscall_insn(&[]));
    assert!(!is_syscall_insn(&[0x90, 0x0f, 0x05])); // not a prefix
    assert!(!is_syscall_insn(&[0x0f, 0x05, 0x90]));
    assert!(is_compat_syscall_insn(&[0xcd, 0x80]));
    assert!(is_compat_syscall_insn(&[0x0f, 0x34]));
    assert!(is_compat_syscall_insn(&[0x66, 0xcd, 0x80]));
    assert!(!is_compat_syscall_insn(&[0xcd, 0x81])); // another interrupt
    assert!(!is_compat_syscall_insn(&[0x0f, 0x05]));
    assert!(!is_compat_syscall_insn(&[0x90, 0xcd, 0x80]));
    assert!(!is_compat_syscall_insn(&[0xcd]));
}

#[test]
fn kernel_insn_decoding() {
    use KernelInsn::*;
    assert_eq!(decode_kernel_insn(&[0x48, 0x0f, 0x07]), Some(Sysretq));
    assert_eq!(decode_kernel_insn(&[0x0f, 0x07]), None); // sysretl (32-bit)
    assert_eq!(decode_kernel_insn(&[0x48, 0xcf]), Some(Iretq));
    assert_eq!(decode_kernel_insn(&[0xcf]), None); // iretl
                                                   // mov %rdi,%cr3 = 0f 22 df; mov %rax,%cr3 = 0f 22 d8
    assert_eq!(
        decode_kernel_insn(&[0x0f, 0x22, 0xdf]),
        Some(Cr3Write { reg: 7 })
    );
    assert_eq!(
        decode_kernel_insn(&[0x0f, 0x22, 0xd8]),
        Some(Cr3Write { reg: 0 })
    );
    // mov %r12,%cr3 = 41 0f 22 dc; REX.W is ignored
    assert_eq!(
        decode_kernel_insn(&[0x41, 0x0f, 0x22, 0xdc]),
        Some(Cr3Write { reg: 12 })
    );
    assert_eq!(
        decode_kernel_insn(&[0x49, 0x0f, 0x22, 0xdf]),
        Some(Cr3Write { reg: 15 })
    );
    // mov %rax,%cr0 / %cr4 / %cr2: other control registers
    assert_eq!(decode_kernel_insn(&[0x0f, 0x22, 0xc0]), None);
    assert_eq!(decode_kernel_insn(&[0x0f, 0x22, 0xe0]), None);
    assert_eq!(decode_kernel_insn(&[0x0f, 0x22, 0xd0]), None);
    // mov %cr3,%rax (read) = 0f 20 d8
    assert_eq!(decode_kernel_insn(&[0x0f, 0x20, 0xd8]), None);
    // REX.R would be CR11
    assert_eq!(decode_kernel_insn(&[0x44, 0x0f, 0x22, 0xd8]), None);
    // mod bits are ignored by the CPU: 0f 22 18 is still mov %rax,%cr3
    assert_eq!(
        decode_kernel_insn(&[0x0f, 0x22, 0x18]),
        Some(Cr3Write { reg: 0 })
    );
    assert_eq!(decode_kernel_insn(&[]), None);
    assert_eq!(GPR_NAMES[7], "rdi");
    assert_eq!(GPR_NAMES[12], "r12");
}

#[test]
fn cr3_and_addresses() {
    assert_eq!(cr3_base(0x8000_0000_1234_5001), 0x1234_5000);
    assert!(is_kernel_addr(0xffff_8880_0000_0000));
    assert!(is_kernel_addr(0xff11_0000_0000_0000)); // 5-level direct map
    assert!(!is_kernel_addr(0x7fff_ffff_f000));
}

#[test]
fn argument_tables() {
    let strings = |nr: u32| string_args(nr).collect::<Vec<u8>>();
    assert_eq!(strings(257), [1]); // openat
    assert_eq!(strings(2), [0]); // open
    assert_eq!(strings(59), [0]); // execve: filename only
    assert_eq!(strings(322), [1]); // execveat
    assert_eq!(strings(316), [1, 3]); // renameat2
    assert_eq!(strings(266), [0, 2]); // symlinkat
    assert_eq!(strings(165), [0, 1, 2]); // mount
    assert_eq!(strings(332), [1]); // statx
    assert_eq!(strings(262), [1]); // newfstatat
    assert_eq!(strings(188), [0, 1]); // setxattr: path and attribute name
    assert_eq!(strings(110), [0u8; 0]); // getppid
    assert_eq!(strings(0), [0u8; 0]); // read
    assert_eq!(buffer_arg(1), Some((1, 2)));
    assert_eq!(buffer_arg(18), Some((1, 2)));
    assert_eq!(buffer_arg(0), None);
    assert_eq!(lifecycle(57, 0), Lifecycle::Fork);
    assert_eq!(lifecycle(58, 0), Lifecycle::Fork);
    assert_eq!(lifecycle(56, 0x01200011), Lifecycle::Fork); // fork-like clone (SIGCHLD)
    assert_eq!(lifecycle(56, 0x003d0f00), Lifecycle::None); // pthread_create's clone
    assert_eq!(lifecycle(435, 0), Lifecycle::Clone3);
    assert_eq!(lifecycle(231, 0), Lifecycle::ExitGroup);
    assert_eq!(lifecycle(60, 0), Lifecycle::None);
    assert_eq!(nul_position(b"abc\0def"), Some(3));
    assert_eq!(nul_position(b"abc"), None);
    let p: Vec<_> = pieces(0, 88).collect();
    assert_eq!(p, vec![(0, 0)]);
    let p: Vec<_> = pieces(88, 88).collect();
    assert_eq!(p, vec![(0, 88)]);
    let p: Vec<_> = pieces(200, 88).collect();
    assert_eq!(p, vec![(0, 88), (88, 88), (176, 24)]);
    assert_eq!(pieces(4096, 88).count(), 47);
}

/// A synthetic process tree: task pointer -> fields.
struct Tree(HashMap<u64, TaskFields>, u32);

impl TaskMemory for Tree {
    fn fields(&mut self, task: u64) -> Option<TaskFields> {
        self.1 += 1;
        self.0.get(&task).copied()
    }
}

fn comm(s: &str) -> [u8; COMM_LEN] {
    MonitorFilters::comm(s).expect("valid comm")
}

/// A task whose process identity (`signal`) is derived from its TGID.
fn task(pid: u32, tgid: u32, parent: u64, name: &str) -> TaskFields {
    TaskFields {
        pid,
        tgid,
        real_parent: parent,
        signal: 0xffff_0000_0000 + u64::from(tgid),
        comm: comm(name),
    }
}

/// swapper(0) <- init(1) <- sshd(100) <- bash(200) <- make(300) <- sh(400) <- ls(500)
fn tree() -> Tree {
    let mut m = HashMap::new();
    m.insert(0x1000, task(0, 0, 0x1000, "swapper/0"));
    m.insert(0x1001, task(1, 1, 0x1000, "init"));
    m.insert(0x1100, task(100, 100, 0x1001, "sshd"));
    m.insert(0x1200, task(200, 200, 0x1100, "bash"));
    m.insert(0x1300, task(300, 300, 0x1200, "make"));
    m.insert(0x1400, task(400, 400, 0x1300, "sh"));
    m.insert(0x1500, task(500, 500, 0x1400, "ls"));
    // a thread of make
    m.insert(0x1301, task(301, 300, 0x1200, "make-worker"));
    Tree(m, 0)
}

#[test]
fn classification() {
    let t = tree();
    let ls = t.0[&0x1500];
    let none = MonitorFilters::none();
    let run = |f: &MonitorFilters, set: &[u32], me: &TaskFields| {
        let mut tr = tree();
        let c = classify(f, |t| set.contains(&t.tgid), me, &mut tr);
        (c, tr.1)
    };
    // Nothing monitored: walks to init and stops.
    let (c, reads) = run(&none, &[], &ls);
    assert_eq!(c.verdict, Verdict::No);
    assert_eq!(c.hops, 5); // sh, make, bash, sshd, init
    assert_eq!(reads, 5);
    assert!(!c.read_error);
    // monitor_all: no walk at all.
    let (c, reads) = run(&MonitorFilters::all(), &[], &ls);
    assert_eq!((c.verdict, reads), (Verdict::All, 0));
    // Own TGID.
    let (c, _) = run(&none, &[500], &ls);
    assert_eq!(c.verdict, Verdict::Tgid);
    // Ancestor by TGID (make = 2 hops up).
    let (c, _) = run(&none, &[300], &ls);
    assert_eq!(c.verdict, Verdict::Ancestor(2));
    assert!(c.verdict.monitored());
    // Own comm, ancestor comm.
    let f = MonitorFilters::none().with_comm("ls").expect("valid");
    assert_eq!(run(&f, &[], &ls).0.verdict, Verdict::Comm);
    let f = MonitorFilters::none().with_comm("bash").expect("valid");
    assert_eq!(run(&f, &[], &ls).0.verdict, Verdict::Ancestor(3));
    // A thread: classified by its process (tgid 300), whatever its name.
    let worker = t.0[&0x1301];
    assert_eq!(run(&none, &[300], &worker).0.verdict, Verdict::Tgid);
    // Siblings and parents of a monitored process are not monitored.
    let bash = t.0[&0x1200];
    assert_eq!(run(&none, &[300], &bash).0.verdict, Verdict::No);
    // init itself is never walked past; tgid 1 monitored means every descendant.
    assert_eq!(run(&none, &[1], &ls).0.verdict, Verdict::Ancestor(5));
    // The idle task's TGID 0 never matches (it is nobody's monitored parent).
    let init = t.0[&0x1001];
    assert_eq!(run(&none, &[0], &init).0.verdict, Verdict::No);
}

#[test]
fn classification_is_bounded_and_survives_bad_memory() {
    let none = MonitorFilters::none();
    // A read failure stops the walk and is reported.
    let mut tr = tree();
    tr.0.remove(&0x1200);
    let ls = tr.0[&0x1500];
    let c = classify(&none, |t| t.tgid == 100, &ls, &mut tr);
    assert_eq!(c.verdict, Verdict::No);
    assert!(c.read_error);
    assert_eq!(c.hops, 2);
    // A cycle (corrupted or racing memory) is cut at MAX_ANCESTOR_HOPS.
    let mut m = HashMap::new();
    m.insert(0xa, task(10, 10, 0xb, "a"));
    m.insert(0xb, task(11, 11, 0xa, "b"));
    let me = task(12, 12, 0xa, "c");
    let mut tr = Tree(m, 0);
    let c = classify(&none, |_: &TaskFields| false, &me, &mut tr);
    assert_eq!(c.verdict, Verdict::No);
    assert_eq!(c.hops, MAX_ANCESTOR_HOPS);
    assert_eq!(tr.1, MAX_ANCESTOR_HOPS);
    // A self-parent stops immediately.
    let mut m = HashMap::new();
    m.insert(0xa, task(10, 10, 0xa, "a"));
    let me = task(12, 12, 0xa, "c");
    let c = classify(&none, |_: &TaskFields| false, &me, &mut Tree(m, 0));
    assert_eq!(c.hops, 1);
}

#[test]
fn chunk_plans_split_buffers_at_file_offset_boundaries() {
    // Aligned: two whole chunks, no partial pieces.
    let p = chunk_plan(8192, 8192);
    assert_eq!(
        (p.first_chunk, p.whole, p.head_len, p.tail_len),
        (2, 2, 0, 0)
    );
    // Small, inside one chunk: all head.
    let p = chunk_plan(100, 50);
    assert_eq!((p.whole, p.head_len, p.tail_len), (0, 50, 0));
    // Crossing one boundary without a whole chunk: head and tail on both sides.
    let p = chunk_plan(4000, 200);
    assert_eq!(
        (p.whole, p.head_len, p.tail_start, p.tail_len),
        (0, 96, 96, 104)
    );
    // Misaligned with whole chunks in the middle.
    let p = chunk_plan(100, 10000);
    assert_eq!((p.first_buf, p.first_chunk, p.whole), (3996, 1, 1));
    assert_eq!((p.tail_start, p.tail_len), (8092, 1908));
    assert_eq!(chunk_plan(0, 0).whole, 0);
    assert_eq!(chunk_plan(u64::MAX - 10, 100).whole, 0);
    let k = |nr| sum_kind(nr).map(|k| (k.read, k.vectored, k.pos, k.rwf_flags));
    assert_eq!(k(1), Some((false, false, PosArg::FilePos, false)));
    assert_eq!(k(17), Some((true, false, PosArg::Arg3, false)));
    assert_eq!(k(19), Some((true, true, PosArg::FilePos, false)));
    assert_eq!(k(296), Some((false, true, PosArg::Arg3, false)));
    assert_eq!(k(327), Some((true, true, PosArg::Arg3OrFilePos, true)));
    assert_eq!(k(328), Some((false, true, PosArg::Arg3OrFilePos, true)));
    assert_eq!(k(2), None);
    let o = Options::parse(["shm=/a", "sums=off", "sumcap=8"]).expect("sums options");
    assert!(!o.sums);
    assert_eq!(o.sum_cap, 8192);
    assert!(Options::parse(["shm=/a", "sumcap=4096"]).is_err());
}

#[test]
fn writes_append_per_o_append_and_rwf_flags() {
    let pwritev2 = sum_kind(328).unwrap();
    let pwrite = sum_kind(18).unwrap();
    let args = |rwf| [3, 0, 1, 0, 0, rwf];
    // O_APPEND appends even for a positional write; RWF_NOAPPEND cancels it per call.
    assert!(write_appends(pwrite, &args(0), O_APPEND));
    assert!(write_appends(pwritev2, &args(0), O_APPEND));
    assert!(!write_appends(pwritev2, &args(RWF_NOAPPEND), O_APPEND));
    // RWF_APPEND appends without O_APPEND; the flags argument of pwrite64 means nothing.
    assert!(write_appends(pwritev2, &args(RWF_APPEND), 0));
    assert!(!write_appends(pwrite, &args(RWF_APPEND), 0));
    assert!(!write_appends(pwritev2, &args(0), 0));
}

fn iov_raw(entries: &[(u64, u64)]) -> Vec<u8> {
    entries
        .iter()
        .flat_map(|(a, l)| a.to_le_bytes().into_iter().chain(l.to_le_bytes()))
        .collect()
}

#[test]
fn iovec_arrays_become_segments_without_empty_entries() {
    let mut segs = Vec::new();
    let raw = iov_raw(&[(0x1000, 100), (0x9000, 0), (0x5000, 4000), (0x7000, 1)]);
    assert_eq!(iov_segments(&raw, &mut segs), Some(4101));
    let got: Vec<_> = segs.iter().map(|s| (s.start, s.addr, s.len)).collect();
    assert_eq!(
        got,
        [(0, 0x1000, 100), (100, 0x5000, 4000), (4100, 0x7000, 1)]
    );
    // A length above isize::MAX is refused by the kernel (EINVAL): no sums.
    assert_eq!(iov_segments(&iov_raw(&[(1, u64::MAX)]), &mut segs), None);
    assert_eq!(iov_segments(&[], &mut segs), Some(0));
    assert!(segs.is_empty());
}

#[test]
fn byte_ranges_of_a_vectored_buffer_split_at_segment_ends() {
    let mut segs = Vec::new();
    iov_segments(
        &iov_raw(&[(0x1000, 100), (0x5000, 4000), (0x7000, 10)]),
        &mut segs,
    );
    let runs = |off, len| {
        let mut v = Vec::new();
        let n = for_each_run(&segs, off, len, |a, at, n| v.push((a, at, n)));
        (n, v)
    };
    // A 4 KiB chunk spanning all three segments.
    assert_eq!(
        runs(0, 4096),
        (4096, vec![(0x1000, 0, 100), (0x5000, 100, 3996)])
    );
    assert_eq!(
        runs(50, 4060),
        (
            4060,
            vec![(0x1000 + 50, 0, 50), (0x5000, 50, 4000), (0x7000, 4050, 10)]
        )
    );
    // Past the end: only what exists.
    assert_eq!(runs(4105, 100), (5, vec![(0x7000 + 5, 0, 5)]));
    assert_eq!(runs(5000, 10), (0, vec![]));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]
    /// Any byte range of any segmented buffer is covered exactly once, in order, by the runs,
    /// and each run lies inside its segment.
    #[test]
    fn runs_cover_a_range_exactly_once(
        lens in proptest::collection::vec(0u64..5000, 0..20),
        off in 0u64..40_000,
        len in 0u64..10_000,
    ) {
        let entries: Vec<(u64, u64)> = lens.iter().enumerate()
            .map(|(i, &l)| ((i as u64 + 1) << 20, l)).collect();
        let mut segs = Vec::new();
        let total = iov_segments(&iov_raw(&entries), &mut segs).unwrap();
        let mut next = 0usize;
        let n = for_each_run(&segs, off, len, |a, at, k| {
            assert_eq!(at, next);
            let s = segs.iter().find(|s| a >= s.addr && a < s.addr + s.len).unwrap();
            assert!(a + k as u64 <= s.addr + s.len);
            assert_eq!(s.start + (a - s.addr), off + at as u64);
            next += k;
        });
        assert_eq!(n, len.min(total.saturating_sub(off)));
        assert_eq!(next as u64, n);
    }
}

#[test]
fn a_reused_pid_is_not_the_monitored_process_that_died_unseen() {
    let none = MonitorFilters::none();
    let old = task(400, 400, 0x1300, "sh");
    let mut set = MonitoredSet::default();
    assert!(set.insert(&old));
    assert!(set.contains(&old));
    // Its threads share the identity.
    assert!(set.contains(&task(401, 400, 0x1300, "worker")));
    // The process was killed (no exit_group); PID 400 comes back on a process with another
    // signal_struct, under an unmonitored parent: not monitored, and the entry is dropped.
    let reused = TaskFields {
        signal: 0xdead_0000,
        real_parent: 0x1100,
        ..old
    };
    assert!(!set.contains(&reused));
    let mut tr = tree();
    let c = classify(&none, |t| set.contains(t), &reused, &mut tr);
    assert_eq!(c.verdict, Verdict::No);
    assert!(set.drop_stale(&reused));
    assert!(set.is_empty());
    assert!(!set.drop_stale(&reused), "only once");
    // A TGID vmsight asked for binds to the first process seen with it, and only that one.
    let mut set = MonitoredSet::from_tgids([400]);
    assert!(set.contains(&reused) && !set.drop_stale(&reused));
    assert!(
        !set.insert(&reused),
        "binding does not change the TGID list"
    );
    assert!(!set.contains(&old));
    assert_eq!(set.tgids().collect::<Vec<_>>(), [400]);
    assert!(set.remove(400) && !set.remove(400));
}

/// Guest kernel memory as a few u64 words and byte strings.
#[derive(Default)]
struct Mem(std::collections::BTreeMap<u64, Vec<u8>>);

impl Mem {
    fn word(&mut self, at: u64, v: u64) {
        self.0.insert(at, v.to_le_bytes().to_vec());
    }
    fn bytes(&mut self, at: u64, b: &[u8]) {
        self.0.insert(at, b.to_vec());
    }
}

impl KernelRead for Mem {
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        let Some((&start, b)) = self.0.range(..=addr).next_back() else {
            return false;
        };
        let off = (addr - start) as usize;
        if off + out.len() > b.len() {
            return false;
        }
        out.copy_from_slice(&b[off..off + out.len()]);
        true
    }
}

const PL: PathLayout = PathLayout {
    task_mm: 0x100,
    mm_exe_file: 0x50,
    file_path: 0x10,
    task_fs: 0x108,
    fs_pwd: 0x28,
    path_mnt: 0,
    path_dentry: 8,
    dentry_parent: 0x18,
    dentry_name: 0x20,
    qstr_len: 4,
    qstr_name: 8,
    vfsmount_root: 0,
    mount_mnt: 0x20,
    mount_parent: 0x10,
    mount_mountpoint: 0x18,
};

/// A dentry named `name` under `parent` (itself when `name` is empty: a root).
fn dentry(m: &mut Mem, at: u64, parent: u64, name: &str) {
    m.word(
        at + PL.dentry_parent,
        if name.is_empty() { at } else { parent },
    );
    let q = at + PL.dentry_name;
    m.bytes(q + PL.qstr_len, &(name.len() as u32).to_le_bytes());
    m.word(q + PL.qstr_name, at + 0x1000);
    m.bytes(at + 0x1000, name.as_bytes());
}

/// A mount at `at` (its vfsmount at `at + mount_mnt`) with root dentry `root`, mounted on
/// `mountpoint` of `parent` (itself for the root of the tree).
fn mount(m: &mut Mem, at: u64, root: u64, parent: u64, mountpoint: u64) {
    m.word(at + PL.mount_mnt + PL.vfsmount_root, root);
    m.word(at + PL.mount_parent, parent);
    m.word(at + PL.mount_mountpoint, mountpoint);
}

/// `/` (mount A) with `/usr/bin/sh`; mount B on `/mnt` with `/data/dir`; a task whose exe is
/// `/usr/bin/sh` and whose cwd is `/mnt/data/dir`.
fn filesystem() -> Mem {
    let mut m = Mem::default();
    let (a, b) = (0xa000_0000, 0xb000_0000);
    dentry(&mut m, 0x10_000, 0, ""); // A's root
    dentry(&mut m, 0x11_000, 0x10_000, "usr");
    dentry(&mut m, 0x12_000, 0x11_000, "bin");
    dentry(&mut m, 0x13_000, 0x12_000, "sh");
    dentry(&mut m, 0x14_000, 0x10_000, "mnt");
    dentry(&mut m, 0x20_000, 0, ""); // B's root
    dentry(&mut m, 0x21_000, 0x20_000, "data");
    dentry(&mut m, 0x22_000, 0x21_000, "dir");
    mount(&mut m, a, 0x10_000, a, 0);
    mount(&mut m, b, 0x20_000, a, 0x14_000);
    let (task, mm, file, fs) = (0x5000_0000, 0x6000_0000, 0x7000_0000, 0x8000_0000);
    m.word(task + PL.task_mm, mm);
    m.word(mm + PL.mm_exe_file, file);
    m.word(file + PL.file_path + PL.path_mnt, a + PL.mount_mnt);
    m.word(file + PL.file_path + PL.path_dentry, 0x13_000);
    m.word(task + PL.task_fs, fs);
    m.word(fs + PL.fs_pwd + PL.path_mnt, b + PL.mount_mnt);
    m.word(fs + PL.fs_pwd + PL.path_dentry, 0x22_000);
    m
}

#[test]
fn exe_and_cwd_are_rendered_like_d_path_across_mounts() {
    let mut m = filesystem();
    let mut out = Vec::new();
    task_exe(&PL, &mut m, 0x5000_0000, &mut out).unwrap();
    assert_eq!(out, b"/usr/bin/sh");
    task_cwd(&PL, &mut m, 0x5000_0000, &mut out).unwrap();
    assert_eq!(out, b"/mnt/data/dir");
    // The root of the tree is "/".
    m.word(
        0x8000_0000 + PL.fs_pwd + PL.path_mnt,
        0xa000_0000 + PL.mount_mnt,
    );
    m.word(0x8000_0000 + PL.fs_pwd + PL.path_dentry, 0x10_000);
    task_cwd(&PL, &mut m, 0x5000_0000, &mut out).unwrap();
    assert_eq!(out, b"/");
    // An exiting task has no mm (no exe).
    m.word(0x5000_0000 + PL.task_mm, 0);
    assert!(task_exe(&PL, &mut m, 0x5000_0000, &mut out).is_none());
}

#[test]
fn hostile_dentry_chains_are_refused_not_followed_forever() {
    let mut out = Vec::new();
    // A cycle of dentries that never reaches the mount root.
    let mut m = filesystem();
    dentry(&mut m, 0x11_000, 0x13_000, "usr");
    assert!(task_exe(&PL, &mut m, 0x5000_0000, &mut out).is_none());
    // A name longer than NAME_MAX, and one whose bytes cannot be read.
    let mut m = filesystem();
    m.bytes(
        0x12_000 + PL.dentry_name + PL.qstr_len,
        &4000u32.to_le_bytes(),
    );
    assert!(task_exe(&PL, &mut m, 0x5000_0000, &mut out).is_none());
    let mut m = filesystem();
    m.word(0x12_000 + PL.dentry_name + PL.qstr_name, 0xdead_0000);
    assert!(task_exe(&PL, &mut m, 0x5000_0000, &mut out).is_none());
    // A mount cycle that never reaches a self-parented root.
    let mut m = filesystem();
    mount(&mut m, 0xa000_0000, 0x10_000, 0xb000_0000, 0x20_000);
    mount(&mut m, 0xb000_0000, 0x20_000, 0xa000_0000, 0x10_000);
    assert!(task_cwd(&PL, &mut m, 0x5000_0000, &mut out).is_none());
}

#[test]
fn the_restore_check_names_what_differs_except_the_resume_flag() {
    use vmsight_proto::redirect::{Reg, NREGS};
    let mut saved = [0u64; NREGS];
    saved[Reg::Eflags.index()] = 0x202;
    saved[Reg::Rsp.index()] = 0x7ffc_1000;
    assert_eq!(mismatch_mask(&saved, &saved), 0);
    let mut now = saved;
    now[Reg::Eflags.index()] = 0x202 | EFLAGS_RF;
    assert_eq!(
        mismatch_mask(&saved, &now),
        0,
        "RF from an interrupt's iretq"
    );
    now[Reg::Eflags.index()] = 0x203 | EFLAGS_RF;
    assert_eq!(mismatch_mask(&saved, &now), 1 << Reg::Eflags.index());
    now[Reg::Eflags.index()] = 0x202;
    now[Reg::Rsp.index()] += 8;
    assert_eq!(mismatch_mask(&saved, &now), 1 << Reg::Rsp.index());
    now[Reg::Eflags.index()] = 0x202 & !EFLAGS_IF;
    assert_eq!(
        mismatch_mask(&saved, &now),
        1 << Reg::Rsp.index() | 1 << Reg::Eflags.index(),
        "IF is part of the state"
    );
}

/// The plugin library is built with `test = false` (it needs QEMU's symbols to link), so a
/// `#[test]` anywhere in `src/` outside `logic.rs` would never compile or run: it would be a
/// test that cannot fail. Its pure logic belongs in `logic.rs`, which this file includes.
#[test]
fn no_plugin_source_file_but_logic_rs_holds_tests_that_would_never_run() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut offenders = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") && p != src.join("logic.rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                if text.contains("#[test]") || text.contains("#[cfg(test)]") {
                    offenders.push(p.display().to_string());
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "tests in {offenders:?} are never compiled (the plugin library has test = false): move \
         the logic they check into src/logic.rs and the tests into tests/logic.rs"
    );
}
