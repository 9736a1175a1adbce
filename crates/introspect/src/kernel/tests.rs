//! A synthetic kernel in synthetic guest RAM: page tables, a task list with threads, a mount
//! tree, dentries and open files, laid out with a made-up profile.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::*;
use crate::memory::testutil::PtBuilder;
use crate::memory::PagingMode;
use crate::profile::{MemberLayout, StructLayout, PROFILE_FORMAT};

const PHYS_BASE: u64 = 0x20_0000;
const RAM: usize = 16 << 20;

fn st(size: u64, members: &[(&str, u64, u64)]) -> StructLayout {
    StructLayout {
        size,
        members: members
            .iter()
            .map(|(n, offset, size)| {
                (
                    (*n).to_string(),
                    MemberLayout {
                        offset: *offset,
                        size: *size,
                    },
                )
            })
            .collect(),
    }
}

/// Symbol offsets inside the fake kernel image (VA = START_KERNEL_MAP + offset).
const SYM_BANNER: u64 = 0x1000;
const SYM_PHYS_BASE: u64 = 0x1100;
const SYM_PAGE_OFFSET_BASE: u64 = 0x1108;
const SYM_L5: u64 = 0x1110;
const SYM_NR_CPU_IDS: u64 = 0x1118;
const SYM_PER_CPU_OFFSET: u64 = 0x1200;
const SYM_INIT_TASK: u64 = 0x2000;
/// Page tables are built from here (inside the image, below the objects).
const SYM_INIT_TOP_PGT: u64 = 0x8000;
const PERCPU_CURRENT_TASK: u64 = 0x100;

fn profile(with_l5_symbol: bool, top_pgt_va: u64) -> KernelProfile {
    let mut symbols = BTreeMap::new();
    let k = |o: u64| Addr(START_KERNEL_MAP + o);
    symbols.insert("linux_banner".into(), k(SYM_BANNER));
    symbols.insert("phys_base".into(), k(SYM_PHYS_BASE));
    symbols.insert("page_offset_base".into(), k(SYM_PAGE_OFFSET_BASE));
    if with_l5_symbol {
        symbols.insert("__pgtable_l5_enabled".into(), k(SYM_L5));
    }
    symbols.insert("nr_cpu_ids".into(), k(SYM_NR_CPU_IDS));
    symbols.insert("__per_cpu_offset".into(), k(SYM_PER_CPU_OFFSET));
    symbols.insert("init_task".into(), k(SYM_INIT_TASK));
    symbols.insert("init_top_pgt".into(), Addr(top_pgt_va));
    symbols.insert("current_task".into(), Addr(PERCPU_CURRENT_TASK));
    let mut structs = BTreeMap::new();
    structs.insert(
        "task_struct".into(),
        st(
            0x400,
            &[
                ("pid", 0x10, 4),
                ("tgid", 0x14, 4),
                ("comm", 0x20, 16),
                ("mm", 0x40, 8),
                ("real_parent", 0x50, 8),
                ("tasks", 0x60, 16),
                ("group_leader", 0x70, 8),
                ("fs", 0x78, 8),
                ("files", 0x80, 8),
                ("flags", 0x88, 4),
                ("signal", 0x90, 8),
                ("thread_group", 0xa0, 16),
            ],
        ),
    );
    structs.insert(
        "mm_struct".into(),
        st(0x40, &[("pgd", 0, 8), ("exe_file", 8, 8)]),
    );
    structs.insert("files_struct".into(), st(0x40, &[("fdt", 8, 8)]));
    structs.insert(
        "fdtable".into(),
        st(0x40, &[("max_fds", 0, 4), ("fd", 8, 8)]),
    );
    structs.insert(
        "file".into(),
        st(
            0x40,
            &[
                ("f_path", 0x10, 16),
                ("f_inode", 0x20, 8),
                ("f_pos", 0x28, 8),
                ("f_flags", 0x30, 4),
            ],
        ),
    );
    structs.insert("path".into(), st(16, &[("mnt", 0, 8), ("dentry", 8, 8)]));
    structs.insert(
        "dentry".into(),
        st(
            0x40,
            &[
                ("d_hash", 0, 16),
                ("d_parent", 0x18, 8),
                ("d_name", 0x20, 16),
                ("d_inode", 0x30, 8),
            ],
        ),
    );
    structs.insert("qstr".into(), st(16, &[("len", 4, 4), ("name", 8, 8)]));
    structs.insert(
        "inode".into(),
        st(
            0x40,
            &[
                ("i_mode", 0, 2),
                ("i_sb", 8, 8),
                ("i_ino", 0x10, 8),
                ("i_nlink", 0x18, 4),
                ("i_size", 0x20, 8),
            ],
        ),
    );
    structs.insert(
        "fs_struct".into(),
        st(0x30, &[("root", 8, 16), ("pwd", 0x18, 16)]),
    );
    structs.insert(
        "mount".into(),
        st(
            0x60,
            &[
                ("mnt_parent", 0x10, 8),
                ("mnt_mountpoint", 0x18, 8),
                ("mnt", 0x20, 32),
            ],
        ),
    );
    structs.insert("vfsmount".into(), st(32, &[("mnt_root", 0, 8)]));
    structs.insert(
        "list_head".into(),
        st(16, &[("next", 0, 8), ("prev", 8, 8)]),
    );
    structs.insert("super_block".into(), st(0x40, &[("s_type", 8, 8)]));
    structs.insert("file_system_type".into(), st(0x40, &[("name", 0, 8)]));
    KernelProfile {
        format: PROFILE_FORMAT,
        kernel_version: "6.1.0".into(),
        kernel_release: String::new(),
        symbols,
        structs,
        config: BTreeMap::new(),
    }
}

/// The fake guest under construction; objects live in the kernel image mapping.
struct Fake {
    pt: PtBuilder,
    next: u64,
}

impl Fake {
    fn new(mode: PagingMode) -> Fake {
        let mut pt = PtBuilder::new(RAM, mode, PHYS_BASE + SYM_INIT_TOP_PGT);
        // Kernel image: 8 MiB of 2 MiB pages at START_KERNEL_MAP -> PHYS_BASE.
        for i in 0..4u64 {
            pt.map(
                START_KERNEL_MAP + i * 0x20_0000,
                PHYS_BASE + i * 0x20_0000,
                0x20_0000,
                0,
            );
        }
        Fake {
            pt,
            next: 0x10_0000,
        }
    }

    fn pa(va: u64) -> u64 {
        va - START_KERNEL_MAP + PHYS_BASE
    }

    fn alloc(&mut self, size: u64) -> u64 {
        let va = START_KERNEL_MAP + self.next;
        self.next += (size + 63) & !63;
        va
    }

    fn w64(&mut self, va: u64, v: u64) {
        self.pt.write_u64(Fake::pa(va), v);
    }

    fn w32(&mut self, va: u64, v: u32) {
        self.pt.write(Fake::pa(va), &v.to_le_bytes());
    }

    fn bytes(&mut self, va: u64, b: &[u8]) {
        self.pt.write(Fake::pa(va), b);
    }

    fn string(&mut self, s: &str) -> u64 {
        let va = self.alloc(s.len() as u64 + 1);
        self.bytes(va, s.as_bytes());
        va
    }

    fn super_block(&mut self, fs: &str) -> u64 {
        let ty = self.alloc(0x40);
        let name = self.string(fs);
        self.w64(ty, name);
        let sb = self.alloc(0x40);
        self.w64(sb + 8, ty);
        sb
    }

    fn inode(&mut self, sb: u64, ino: u64, mode: u16, size: u64, nlink: u32) -> u64 {
        let i = self.alloc(0x40);
        self.bytes(i, &mode.to_le_bytes());
        self.w64(i + 8, sb);
        self.w64(i + 0x10, ino);
        self.w32(i + 0x18, nlink);
        self.w64(i + 0x20, size);
        i
    }

    /// A dentry; `parent` None makes it a root; hashed unless `unhashed`.
    fn dentry(&mut self, name: &str, parent: Option<u64>, inode: u64, unhashed: bool) -> u64 {
        let d = self.alloc(0x40);
        let n = self.string(name);
        self.w64(d + 8, if unhashed { 0 } else { 0xffff_ffff_dead_0000 });
        self.w64(d + 0x18, parent.unwrap_or(d));
        self.w32(d + 0x24, name.len() as u32);
        self.w64(d + 0x28, n);
        self.w64(d + 0x30, inode);
        d
    }

    /// A mount; returns the address of its embedded vfsmount.
    fn mount(&mut self, root: u64, parent: Option<u64>, mountpoint: u64) -> u64 {
        let m = self.alloc(0x60);
        self.w64(m + 0x10, parent.map(|p| p - 0x20).unwrap_or(m));
        self.w64(m + 0x18, mountpoint);
        self.w64(m + 0x20, root);
        m + 0x20
    }

    fn file(&mut self, vfsmnt: u64, dentry: u64, inode: u64, pos: u64, flags: u32) -> u64 {
        let f = self.alloc(0x40);
        self.w64(f + 0x10, vfsmnt);
        self.w64(f + 0x18, dentry);
        self.w64(f + 0x20, inode);
        self.w64(f + 0x28, pos);
        self.w32(f + 0x30, flags);
        f
    }

    fn task(&mut self, at: Option<u64>, pid: i32, tgid: i32, comm: &str) -> u64 {
        let t = at.unwrap_or_else(|| self.alloc(0x400));
        self.w32(t + 0x10, pid as u32);
        self.w32(t + 0x14, tgid as u32);
        self.bytes(t + 0x20, comm.as_bytes());
        self.w64(t + 0x70, t); // group_leader
        self.w64(t + 0xa0, t + 0xa0); // thread_group: alone
        t
    }

    fn link_ring(&mut self, nodes: &[u64]) {
        for (i, n) in nodes.iter().enumerate() {
            let next = nodes[(i + 1) % nodes.len()];
            let prev = nodes[(i + nodes.len() - 1) % nodes.len()];
            self.w64(*n, next);
            self.w64(*n + 8, prev);
        }
    }
}

/// Addresses of interesting objects in the fake guest.
struct World {
    init: u64,
    a: u64,
    b: u64,
    c: u64,
    c2: u64,
    c3: u64,
    etc: u64,
    passwd: u64,
    fdt: u64,
}

fn build(mode: PagingMode, with_l5_symbol: bool) -> (World, KernelProfile, Fake) {
    let mut f = Fake::new(mode);
    let k = START_KERNEL_MAP;
    f.bytes(k + SYM_BANNER, b"Linux version 6.1.0-test\0");
    f.w64(k + SYM_PHYS_BASE, PHYS_BASE);
    let pob = match mode {
        PagingMode::FiveLevel => 0xff11_0000_0000_0000,
        PagingMode::FourLevel => 0xffff_8880_0000_0000,
    };
    f.w64(k + SYM_PAGE_OFFSET_BASE, pob);
    f.w32(k + SYM_L5, u32::from(mode == PagingMode::FiveLevel));
    f.w32(k + SYM_NR_CPU_IDS, 2);

    // File systems: rootfs "/" with the real root mounted on it.
    let sb_root = f.super_block("rootfs");
    let sb_ext4 = f.super_block("ext4");
    let sb_pipe = f.super_block("pipefs");
    let sb_anon = f.super_block("anon_inodefs");
    let i_dir = f.inode(sb_ext4, 2, 0o040755, 4096, 2);
    let i_rootfs = f.inode(sb_root, 1, 0o040755, 0, 2);
    let r0 = f.dentry("/", None, i_rootfs, true);
    let m0 = f.mount(r0, None, r0);
    let r = f.dentry("/", None, i_dir, true);
    let m1 = f.mount(r, Some(m0), r0);
    let etc = f.dentry("etc", Some(r), i_dir, false);
    let i_passwd = f.inode(sb_ext4, 100, 0o100644, 1234, 1);
    let passwd = f.dentry("passwd", Some(etc), i_passwd, false);
    let usr = f.dentry("usr", Some(r), i_dir, false);
    let bin = f.dentry("bin", Some(usr), i_dir, false);
    let i_sleep = f.inode(sb_ext4, 101, 0o100755, 43_000, 1);
    let sleep = f.dentry("sleep", Some(bin), i_sleep, false);
    let tmp = f.dentry("tmp", Some(r), i_dir, false);
    let i_gone = f.inode(sb_ext4, 102, 0o100644, 5, 0);
    let gone = f.dentry("gone", Some(tmp), i_gone, true);
    let i_pipe = f.inode(sb_pipe, 11321, 0o010600, 0, 1);
    let pd = f.dentry("", None, i_pipe, true);
    let mp = f.mount(pd, None, pd);
    let i_ev = f.inode(sb_anon, 1, 0o600, 0, 1);
    let ad = f.dentry("[eventfd]", None, i_ev, true);
    let ma = f.mount(ad, None, ad);

    let f_passwd = f.file(m1, passwd, i_passwd, 7, 0o100000);
    let f_pipe = f.file(mp, pd, i_pipe, 0, 0);
    let f_ev = f.file(ma, ad, i_ev, 0, 2);
    let f_gone = f.file(m1, gone, i_gone, 5, 0o100001);
    let f_exe = f.file(m1, sleep, i_sleep, 0, 0);

    let fd_array = f.alloc(64 * 8);
    for (i, file) in [(0, f_passwd), (3, f_pipe), (5, f_ev), (63, f_gone)] {
        f.w64(fd_array + i * 8, file);
    }
    let fdt = f.alloc(0x40);
    f.w32(fdt, 64);
    f.w64(fdt + 8, fd_array);
    let files = f.alloc(0x40);
    f.w64(files + 8, fdt);
    let fs = f.alloc(0x30);
    f.w64(fs + 8, m1);
    f.w64(fs + 0x10, r);
    f.w64(fs + 0x18, m1);
    f.w64(fs + 0x20, usr);
    let pgd = f.alloc(0x1000);
    let mm = f.alloc(0x40);
    f.w64(mm, pgd);
    f.w64(mm + 8, f_exe);

    // Tasks: init_task (pid 0) -> A (1) -> B (2, kthread) -> C (7, threads 8 and 9).
    let init = f.task(Some(k + SYM_INIT_TASK), 0, 0, "swapper/0");
    f.w64(init + 0x50, init);
    f.w32(init + 0x88, PF_KTHREAD);
    let a = f.task(None, 1, 1, "init");
    f.w64(a + 0x50, init);
    let b = f.task(None, 2, 2, "kthreadd");
    f.w64(b + 0x50, init);
    f.w32(b + 0x88, PF_KTHREAD);
    let c = f.task(None, 7, 7, "sleep");
    let c2 = f.task(None, 8, 7, "sleep");
    let c3 = f.task(None, 9, 7, "worker");
    for t in [c, c2, c3] {
        f.w64(t + 0x50, a);
        f.w64(t + 0x70, c);
        f.w64(t + 0x40, mm);
        f.w64(t + 0x78, fs);
        f.w64(t + 0x80, files);
    }
    f.link_ring(&[c + 0xa0, c2 + 0xa0, c3 + 0xa0]);
    f.link_ring(&[init + 0x60, a + 0x60, b + 0x60, c + 0x60]);

    // Per-CPU: CPU 0 runs c3, CPU 1 runs A.
    let pcpu0 = f.alloc(0x200);
    let pcpu1 = f.alloc(0x200);
    f.w64(k + SYM_PER_CPU_OFFSET, pcpu0);
    f.w64(k + SYM_PER_CPU_OFFSET + 8, pcpu1);
    f.w64(pcpu0 + PERCPU_CURRENT_TASK, c3);
    f.w64(pcpu1 + PERCPU_CURRENT_TASK, a);

    let p = profile(with_l5_symbol, START_KERNEL_MAP + SYM_INIT_TOP_PGT);
    let world = World {
        init,
        a,
        b,
        c,
        c2,
        c3,
        etc,
        passwd,
        fdt,
    };
    (world, p, f)
}

fn finish(f: Fake) -> Arc<GuestRam> {
    Arc::new(f.pt.into_ram())
}

fn view(mode: PagingMode, with_l5_symbol: bool) -> (World, KernelView) {
    let (w, p, f) = build(mode, with_l5_symbol);
    let v = KernelView::new(finish(f), &p).expect("kernel view");
    (w, v)
}

fn check_everything(mode: PagingMode, with_l5_symbol: bool) {
    let (w, v) = view(mode, with_l5_symbol);
    assert_eq!(v.phys_base(), PHYS_BASE);
    assert_eq!(v.paging_mode(), mode);

    let procs = v.processes().expect("processes");
    assert_eq!(procs, vec![w.a, w.b, w.c]);
    let pids: Vec<i32> = procs.iter().map(|t| v.pid(*t).expect("pid")).collect();
    assert_eq!(pids, vec![1, 2, 7]);
    assert_eq!(v.threads(w.c2).expect("threads"), vec![w.c, w.c2, w.c3]);
    assert_eq!(v.threads(w.a).expect("threads"), vec![w.a]);
    assert_eq!(v.all_threads().expect("all").len(), 5);
    assert_eq!(v.task_by_pid(9).expect("tid 9"), w.c3);
    assert_eq!(v.task_by_pid(0).expect("tid 0"), w.init);
    assert!(matches!(
        v.task_by_pid(99),
        Err(KernelError::NoSuchTask(99))
    ));

    let info = v.task_info(w.c3).expect("info");
    assert_eq!(
        (info.pid, info.tgid, info.ppid, info.comm.as_str()),
        (9, 7, 1, "worker")
    );
    assert_eq!(info.exe.as_deref(), Some("/usr/bin/sleep"));
    assert_eq!(info.cwd.as_deref(), Some("/usr"));
    assert_eq!(info.root.as_deref(), Some("/"));
    assert!(!info.kernel_thread);
    let kt = v.task_info(w.b).expect("kthread");
    assert!(kt.kernel_thread);
    assert_eq!((kt.exe, kt.cwd, kt.ppid), (None, None, 0));
    let json = serde_json::to_string(&info).expect("json");
    assert!(json.contains("\"exe\":\"/usr/bin/sleep\""), "{json}");

    let fds = v.fds(w.c).expect("fds");
    let got: Vec<(u32, &str)> = fds.iter().map(|f| (f.fd, f.path.as_str())).collect();
    assert_eq!(
        got,
        vec![
            (0, "/etc/passwd"),
            (3, "pipe:[11321]"),
            (5, "anon_inode:[eventfd]"),
            (63, "/tmp/gone (deleted)"),
        ]
    );
    assert_eq!(
        (
            fds[0].pos,
            fds[0].flags,
            fds[0].mode,
            fds[0].size,
            fds[0].ino
        ),
        (7, 0o100000, 0o100644, 1234, 100)
    );

    assert_eq!(v.nr_cpus().expect("cpus"), 2);
    assert_eq!(v.current_task(0).expect("cpu0"), w.c3);
    assert_eq!(v.current_task(1).expect("cpu1"), w.a);
    assert!(matches!(
        v.current_task(2),
        Err(KernelError::NoSuchCpu { cpu: 2, count: 2 })
    ));
    let us = v.user_space(w.c).expect("mm").expect("user space");
    assert_eq!(us.levels(), mode.levels());
    assert_eq!(v.user_space(w.b).expect("no mm"), None);
}

#[test]
fn four_level_kernel_without_l5_symbol() {
    check_everything(PagingMode::FourLevel, false);
}

#[test]
fn five_level_kernel() {
    check_everything(PagingMode::FiveLevel, true);
}

#[test]
fn task_list_loop_is_an_error() {
    let (w, p, mut f) = build(PagingMode::FourLevel, true);
    // C.tasks.next -> B.tasks: B -> C -> B -> … never returns to init_task.
    f.w64(w.c + 0x60, w.b + 0x60);
    // A thread ring that skips its leader.
    f.w64(w.c3 + 0xa0, w.c2 + 0xa0);
    let (c, c2) = (w.c, w.c2);
    let v = KernelView::new(finish(f), &p).expect("view");
    let e = v.processes().expect_err("loop");
    assert!(matches!(e, KernelError::ListLoop { .. }), "{e}");
    assert!(e.to_string().contains("init_task.tasks"), "{e}");
    assert!(matches!(v.threads(c), Err(KernelError::ListLoop { .. })));
    assert!(v.task_by_pid(42).is_err());
    let _ = c2;
}

#[test]
fn long_lists_and_deep_paths_are_bounded() {
    let (w, p, mut f) = build(PagingMode::FourLevel, true);
    // A dentry cycle etc <-> passwd never reaches a root.
    f.w64(w.etc + 0x18, w.passwd);
    // An absurd max_fds.
    f.w32(w.fdt, u32::MAX);
    let (c, a) = (w.c, w.a);
    let v = KernelView::new(finish(f), &p)
        .expect("view")
        .with_limits(Limits {
            max_tasks: 2,
            ..Limits::default()
        });
    assert!(matches!(
        v.processes(),
        Err(KernelError::ListTooLong { max: 2, .. })
    ));
    assert!(matches!(
        v.fds(c),
        Err(KernelError::Implausible {
            what: "fdtable.max_fds",
            ..
        })
    ));
    let _ = a;
    let (w2, p2, mut f2) = build(PagingMode::FourLevel, true);
    f2.w64(w2.etc + 0x18, w2.passwd);
    let c = w2.c;
    let v2 = KernelView::new(finish(f2), &p2).expect("view");
    // Stopped by the component or the length bound, whichever comes first.
    let e = v2.fds(c).expect_err("cycle");
    assert!(
        matches!(
            e,
            KernelError::PathTooDeep { .. } | KernelError::Implausible { .. }
        ),
        "{e}"
    );
    let v3 = v2.with_limits(Limits {
        max_path_depth: 10,
        ..Limits::default()
    });
    assert!(matches!(
        v3.fds(c),
        Err(KernelError::PathTooDeep { max: 10 })
    ));
}

#[test]
fn bad_pointers_and_missing_kernel() {
    let (w, p, mut f) = build(PagingMode::FiveLevel, true);
    // A user-space value where a kernel pointer belongs, and a NULL one.
    f.w64(w.c + 0x50, 0x1234);
    f.w64(w.a + 0x70, 0);
    let (c, a) = (w.c, w.a);
    let v = KernelView::new(finish(f), &p).expect("view");
    assert!(matches!(
        v.ppid(c),
        Err(KernelError::BadPointer { value: 0x1234, .. })
    ));
    assert!(matches!(v.threads(a), Err(KernelError::Null { .. })));

    // No banner anywhere: the kernel is not found.
    let (w, p, mut f) = build(PagingMode::FourLevel, true);
    f.bytes(START_KERNEL_MAP + SYM_BANNER, b"Xinux");
    let _ = w;
    assert!(matches!(
        KernelView::new(finish(f), &p),
        Err(KernelError::KernelNotFound)
    ));

    // A page_offset_base that contradicts __pgtable_l5_enabled.
    let (w, p, mut f) = build(PagingMode::FourLevel, true);
    f.w32(START_KERNEL_MAP + SYM_L5, 1);
    let _ = w;
    assert!(matches!(
        KernelView::new(finish(f), &p),
        Err(KernelError::BadPageOffset(_))
    ));
}

#[test]
fn paging_mode_from_page_offset_base() {
    assert_eq!(
        mode_from(0xff11_0000_0000_0000, None).expect("5"),
        PagingMode::FiveLevel
    );
    assert_eq!(
        mode_from(0xffff_8880_0000_0000, Some(false)).expect("4"),
        PagingMode::FourLevel
    );
    assert!(mode_from(0, None).is_err());
    assert!(mode_from(0xffff_8880_0000_0000, Some(true)).is_err());
}

/// Where the page tests put `struct page` (`vmemmap_base`) and what they add to the profile:
/// `page.mapping` at 0x18, `page.index` at 0x20, `address_space.host` at 0, `inode.i_dentry`
/// at 0x28 and `dentry.d_u` at 0x38.
const PAGES_VMEMMAP: u64 = 0xffff_ea00_0000_0000;
const PAGES_VMEMMAP_PA: u64 = 0xa0_0000;

fn with_pages(p: &mut KernelProfile, f: &mut Fake) {
    const SYM_VMEMMAP: u64 = 0x1120;
    p.symbols
        .insert("vmemmap_base".into(), Addr(START_KERNEL_MAP + SYM_VMEMMAP));
    p.structs.insert(
        "page".into(),
        st(64, &[("mapping", 0x18, 8), ("index", 0x20, 8)]),
    );
    p.structs
        .insert("address_space".into(), st(0x40, &[("host", 0, 8)]));
    for (s, m, offset, size) in [("inode", "i_dentry", 0x28, 8), ("dentry", "d_u", 0x38, 16)] {
        let st = p.structs.get_mut(s).unwrap();
        st.members.insert(m.into(), MemberLayout { offset, size });
    }
    f.w64(START_KERNEL_MAP + SYM_VMEMMAP, PAGES_VMEMMAP);
    f.pt.map(PAGES_VMEMMAP, PAGES_VMEMMAP_PA, 0x20_0000, 0);
}

/// Page ownership: `struct page` at `vmemmap_base + pfn * 64`, `mapping` at 0x18, `index` at
/// 0x20; `address_space.host` at 0.
#[test]
fn page_owners_follow_mapping_host_and_index() {
    use super::pages::{PageOwner, PageOwners};
    const VMEMMAP_PA: u64 = PAGES_VMEMMAP_PA;
    let (_, mut p, mut f) = build(PagingMode::FourLevel, false);
    with_pages(&mut p, &mut f);
    let sb = f.super_block("ext4");
    let file = f.inode(sb, 77, 0o100644, 9000, 1);
    let i_dir = f.inode(sb, 2, 0o040755, 4096, 2);
    let root = f.dentry("/", None, i_dir, true);
    let dir = f.dentry("data", Some(root), i_dir, false);
    let d_file = f.dentry("db.sqlite", Some(dir), file, false);
    f.w64(file + 0x28, d_file + 0x38);
    let unlinked = f.inode(sb, 78, 0o100644, 1, 0);
    let d_gone = f.dentry("gone", Some(dir), unlinked, true);
    f.w64(unlinked + 0x28, d_gone + 0x38);
    let gone_space = {
        let a = f.alloc(0x40);
        f.w64(a, unlinked);
        a
    };
    let bdev = f.inode(sb, 0, 0o060600, 1 << 30, 1);
    let space = |f: &mut Fake, host: u64| {
        let a = f.alloc(0x40);
        f.w64(a, host);
        a
    };
    let (file_space, bdev_space) = (space(&mut f, file), space(&mut f, bdev));
    let dangling = space(&mut f, 0xffff_c900_dead_0000); // host not mapped
    let mut page = |pfn: u64, mapping: u64, index: u64| {
        f.pt.write_u64(VMEMMAP_PA + pfn * 64 + 0x18, mapping);
        f.pt.write_u64(VMEMMAP_PA + pfn * 64 + 0x20, index);
    };
    page(0x100, file_space, 2);
    page(0x101, bdev_space, 7);
    page(0x102, 0, 0);
    page(0x103, 0xffff_8880_0123_4001, 0); // PAGE_MAPPING_ANON
    page(0x104, 0x1000, 0); // not a kernel pointer
    page(0x105, dangling, 0);
    page(0x106, gone_space, 1);
    let ram = finish(f);
    let view = KernelView::new(ram, &p).expect("kernel view");
    let owners = PageOwners::new(view, &p).expect("page owners");
    assert_eq!(
        owners.owner(0x100 << 12),
        PageOwner::File {
            inode: file,
            ino: 77,
            offset: 8192,
            size: 9000,
            path: Some("/data/db.sqlite".into()),
        }
    );
    assert!(
        matches!(
            owners.owner(0x106 << 12),
            PageOwner::File {
                ino: 78,
                path: None,
                ..
            }
        ),
        "an unlinked file has no path"
    );
    assert_eq!(owners.owner((0x100 << 12) + 123), owners.owner(0x100 << 12));
    assert_eq!(owners.owner(0x101 << 12), PageOwner::Metadata);
    assert_eq!(owners.owner(0x102 << 12), PageOwner::Metadata);
    assert_eq!(owners.owner(0x103 << 12), PageOwner::Anonymous);
    assert_eq!(owners.owner(0x104 << 12), PageOwner::Unknown);
    assert_eq!(owners.owner(0x105 << 12), PageOwner::Unknown);
    // Beyond guest RAM, and absurd addresses: unknown, never a panic.
    assert_eq!(owners.owner(RAM as u64 + 0x1000), PageOwner::Unknown);
    assert_eq!(owners.owner(u64::MAX), PageOwner::Unknown);
}

#[test]
fn page_owners_need_the_page_members_and_a_kernel_vmemmap() {
    use super::pages::PageOwners;
    let (_, p, f) = build(PagingMode::FourLevel, false);
    let view = KernelView::new(finish(f), &p).expect("kernel view");
    let e = PageOwners::new(view, &p).expect_err("no page members in this profile");
    assert!(e.to_string().contains("page"), "{e}");
}

proptest::proptest! {
    /// A hostile guest controls every byte the page reader follows: `struct page`, the
    /// mapping, the inode, the dentries. Whatever they hold, an answer comes back (no panic,
    /// no endless walk), and a file page's path is never longer than the kernel allows.
    #[test]
    fn page_owners_survive_arbitrary_guest_memory(
        words in proptest::collection::vec(proptest::prelude::any::<u64>(), 64),
        ptrs in proptest::collection::vec(0u64..8, 64),
        gpas in proptest::collection::vec(0u64..(RAM as u64 + 0x10000), 16),
    ) {
        use super::pages::PageOwners;
        const VMEMMAP_PA: u64 = PAGES_VMEMMAP_PA;
        let (_, mut p, mut f) = build(PagingMode::FourLevel, false);
        with_pages(&mut p, &mut f);
        // A pool of objects whose words are either arbitrary or pointers into the pool, so
        // the walks go deep, loop and wander off as a corrupt guest could make them.
        let pool = f.alloc(64 * 8);
        for (i, (w, sel)) in words.iter().zip(&ptrs).enumerate() {
            let v = match sel {
                0..=3 => pool + (w % 64) * 8,
                4 => pool + (w % 64) * 8 + 1, // anonymous-looking
                _ => *w,
            };
            f.w64(pool + i as u64 * 8, v);
        }
        for (k, w) in words.iter().enumerate().take(32) {
            let pfn = 0x100 + k as u64;
            f.pt.write_u64(VMEMMAP_PA + pfn * 64 + 0x18, pool + (w % 64) * 8);
            f.pt.write_u64(VMEMMAP_PA + pfn * 64 + 0x20, *w);
        }
        let view = KernelView::new(finish(f), &p).expect("kernel view");
        let owners = PageOwners::new(view, &p).expect("page owners");
        for g in gpas.iter().chain((0x100u64..0x120).map(|pfn| pfn << 12).collect::<Vec<_>>().iter()) {
            if let super::pages::PageOwner::File { path: Some(path), .. } = owners.owner(*g) {
                proptest::prop_assert!(path.len() <= 256 * 256 + 256);
            }
        }
    }
}
