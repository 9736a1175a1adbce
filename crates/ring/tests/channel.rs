//! Channel tests on real `MAP_SHARED` mappings of temporary files.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;

use vmsight_ring::{layout, Channel, Counter, Error, Record};

fn rec(vcpu: u32, seq: u64) -> Record {
    Record::syscall_entry(
        vcpu,
        seq,
        0x1000,
        0x40_1000,
        seq,
        [seq, 1, 2, 3, 4, 5],
        0x7ff0,
    )
}

fn tmp() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("plugin.shm");
    (dir, p)
}

#[test]
fn create_attach_push_drain() {
    let (_d, path) = tmp();
    let mut host = Channel::create(&path, 2, 8).expect("create");
    assert!(!host.plugin_attached());
    let plugin = Channel::attach(&path).expect("attach");
    assert!(host.plugin_attached());
    assert_eq!(plugin.max_vcpus(), 2);
    let mut p0 = plugin.producer(0).expect("producer 0");
    let mut p1 = plugin.producer(1).expect("producer 1");
    assert!(p0.push(&rec(0, 1)));
    assert!(p1.push(&rec(1, 2)));
    assert!(p0.push(&rec(0, 3)));
    let mut seen = Vec::new();
    assert_eq!(host.drain(|r| seen.push((r.vcpu, r.syscall_nr()))), 3);
    assert_eq!(seen, vec![(0, 1), (0, 3), (1, 2)]);
    assert_eq!(host.drain(|_| {}), 0);
    let t = host.totals();
    assert_eq!(t.records_written, 3);
    assert_eq!(t.records_dropped, 0);
    plugin.finish();
    assert!(host.plugin_finished());
}

#[test]
fn second_producer_and_out_of_range_are_rejected() {
    let (_d, path) = tmp();
    let _host = Channel::create(&path, 2, 8).expect("create");
    let plugin = Channel::attach(&path).expect("attach");
    let _p = plugin.producer(0).expect("first");
    assert!(matches!(
        plugin.producer(0),
        Err(Error::ProducerTaken { vcpu: 0 })
    ));
    assert!(matches!(
        plugin.producer(2),
        Err(Error::VcpuOutOfRange { vcpu: 2, .. })
    ));
}

#[test]
fn full_ring_drops_and_counts_then_wraps() {
    let (_d, path) = tmp();
    let mut host = Channel::create(&path, 1, 4).expect("create");
    let plugin = Channel::attach(&path).expect("attach");
    let mut p = plugin.producer(0).expect("producer");
    for i in 0..4 {
        assert!(p.push(&rec(0, i)));
    }
    assert!(!p.push(&rec(0, 99)));
    assert!(!p.push(&rec(0, 100)));
    let c = host.counters()[0];
    assert_eq!(c.records_written, 4);
    assert_eq!(c.records_dropped, 2);
    // Drain half, push across the wrap point, and check order.
    let mut got = Vec::new();
    assert_eq!(host.drain(|r| got.push(r.syscall_nr())), 4);
    for i in 4..7 {
        assert!(p.push(&rec(0, i)));
    }
    assert_eq!(host.drain(|r| got.push(r.syscall_nr())), 3);
    assert_eq!(got, (0..7).collect::<Vec<_>>());
}

#[test]
fn two_threads_many_wraparounds_in_order() {
    let (_d, path) = tmp();
    let mut host = Channel::create(&path, 1, 64).expect("create");
    let plugin = Channel::attach(&path).expect("attach");
    let mut p = plugin.producer(0).expect("producer");
    const N: u64 = 200_000;
    let producer = std::thread::spawn(move || {
        let mut pushed = 0u64;
        let mut seq = 0u64;
        while seq < N {
            if p.push(&rec(0, seq)) {
                pushed += 1;
                seq += 1;
            } else {
                std::thread::yield_now();
            }
        }
        (pushed, p.counters().get(Counter::RecordsDropped))
    });
    let mut expect = 0u64;
    while expect < N {
        host.drain(|r| {
            assert_eq!(r.syscall_nr(), expect, "records out of order");
            assert_eq!(r.syscall_args()[0], expect);
            expect += 1;
        });
    }
    let (pushed, dropped) = producer.join().expect("producer thread");
    assert_eq!(pushed, N);
    let c = host.counters()[0];
    assert_eq!(c.records_written, N);
    assert_eq!(c.records_dropped, dropped);
    drop(plugin);
}

#[test]
fn counters_are_shared() {
    let (_d, path) = tmp();
    let host = Channel::create(&path, 3, 8).expect("create");
    let plugin = Channel::attach(&path).expect("attach");
    let c2 = plugin.counters(2).expect("sink");
    c2.add(Counter::Syscalls, 5);
    c2.add_single_writer(Counter::Callbacks, 2);
    c2.set(Counter::Instrumented, 7);
    c2.set_max(Counter::Instrumented, 3);
    let all = host.counters();
    assert_eq!(all.len(), 3);
    assert_eq!(all[2].syscalls, 5);
    assert_eq!(all[2].callbacks, 2);
    assert_eq!(all[2].instrumented, 7);
    assert_eq!(host.totals().syscalls, 5);
    plugin.report_vcpus(2);
    plugin.set_plugin_info(4, layout::plugin_flags::RECORDS);
    let s = host.plugin_status();
    assert_eq!(
        (s.vcpus, s.api_version, s.state),
        (2, 4, layout::producer_state::RUNNING)
    );
}

fn write_at(path: &std::path::Path, off: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).expect("open");
    f.write_all_at(bytes, off).expect("write");
}

#[test]
fn corrupt_headers_are_rejected() {
    let (_d, path) = tmp();
    let host = Channel::create(&path, 2, 8).expect("create");
    drop(host);

    // Wrong magic.
    write_at(&path, 0, &0xdead_beefu64.to_ne_bytes());
    assert!(matches!(
        Channel::attach(&path),
        Err(Error::BadMagic { .. })
    ));

    // Wrong version.
    let _host = Channel::create(&path, 2, 8).expect("create");
    write_at(&path, 8, &99u32.to_ne_bytes());
    assert!(matches!(
        Channel::attach(&path),
        Err(Error::Version { found: 99, .. })
    ));

    // Ring size not a power of two / huge vCPU count / lying offsets.
    for (off, val) in [(20u64, 1000u32), (16, 100_000), (16, 0)] {
        let _host = Channel::create(&path, 2, 8).expect("create");
        write_at(&path, off, &val.to_ne_bytes());
        let e = Channel::attach(&path).err().expect("must fail");
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("corrupt header"), "{e}");
    }
    let _host = Channel::create(&path, 2, 8).expect("create");
    write_at(&path, 40, &12345u64.to_ne_bytes()); // rings_offset
    assert!(matches!(Channel::attach(&path), Err(Error::Corrupt { .. })));

    // Header claims more vCPUs than the file holds (consistent header, short file).
    let _host = Channel::create(&path, 2, 8).expect("create");
    let g = layout::Geometry::new(4, 8).expect("geometry");
    write_at(&path, 16, &4u32.to_ne_bytes());
    write_at(&path, 40, &g.rings_offset.to_ne_bytes());
    write_at(&path, 48, &g.ring_stride.to_ne_bytes());
    write_at(&path, 56, &g.total_size.to_ne_bytes());
    let e = Channel::attach(&path).err().expect("must fail");
    assert!(e.to_string().contains("file has only"), "{e}");

    // Truncated file and missing file.
    let mut f = OpenOptions::new().write(true).open(&path).expect("open");
    f.set_len(100).expect("truncate");
    f.seek(SeekFrom::Start(0)).expect("seek");
    f.write_all(b"x").expect("write");
    assert!(matches!(
        Channel::attach(&path),
        Err(Error::TooSmall { size: 100, .. })
    ));
    assert!(matches!(
        Channel::attach(path.with_extension("missing")),
        Err(Error::Io { op: "open", .. })
    ));
}

#[test]
fn bad_geometry_is_rejected_at_create() {
    let (_d, path) = tmp();
    assert!(matches!(
        Channel::create(&path, 0, 8),
        Err(Error::Geometry(_))
    ));
    assert!(matches!(
        Channel::create(&path, 1, 6),
        Err(Error::Geometry(_))
    ));
}

#[test]
fn scribbled_indices_never_go_out_of_bounds() {
    let (_d, path) = tmp();
    let mut host = Channel::create(&path, 1, 8).expect("create");
    let plugin = Channel::attach(&path).expect("attach");
    let g = plugin.geometry();
    let head_off = g.rings_offset;
    let tail_off = g.rings_offset + 128;

    // Producer head scribbled far ahead: the consumer counts a corruption and resyncs.
    write_at(&path, head_off, &1_000_000u64.to_ne_bytes());
    assert_eq!(host.drain(|_| panic!("no record may be delivered")), 0);
    assert_eq!(host.corrupt_events(), 1);

    // Tail scribbled ahead of head: the producer treats the ring as full, never indexes out.
    write_at(&path, head_off, &0u64.to_ne_bytes());
    write_at(&path, tail_off, &u64::MAX.to_ne_bytes());
    let mut p = plugin.producer(0).expect("producer");
    // Producer creation resynchronised head to the tail; pushes work with masked indices.
    assert!(p.push(&rec(0, 1)));
    write_at(&path, tail_off, &(u64::MAX / 2).to_ne_bytes());
    let mut pushed = 0;
    for i in 0..20 {
        if p.push(&rec(0, i)) {
            pushed += 1;
        }
    }
    assert!(pushed <= 8);
    assert!(host.counters()[0].records_dropped > 0);
}

#[test]
fn filters_flow_from_host_to_plugin_and_reports_back() {
    use vmsight_ring::MonitorFilters;
    let (_d, path) = tmp();
    let mut host = Channel::create(&path, 2, 64).expect("create");
    // Filters set before the plugin attaches are visible at attach.
    let f = MonitorFilters::none()
        .with_comm("getppid_loop")
        .and_then(|f| f.with_tgid(42))
        .expect("valid");
    let g = host.set_filters(&f).expect("set");
    assert_eq!(g, 1);
    let plugin = Channel::attach(&path).expect("attach");
    assert_eq!(plugin.filter_generation(), 1);
    assert_eq!(plugin.read_filters(), Some((1, f.clone())));
    assert!(!host.wait_filters_applied(1, std::time::Duration::from_millis(5)));
    plugin.ack_filters(1);
    plugin.report_monitored(&[42, 77]);
    assert!(host.wait_filters_applied(1, std::time::Duration::from_millis(5)));
    let r = host.plugin_report().expect("report");
    assert_eq!(
        (r.applied_generation, r.tgids, r.overflow),
        (1, vec![42, 77], false)
    );
    // A change bumps the generation; invalid filters are refused without a bump.
    let bad = MonitorFilters {
        tgids: vec![0],
        ..Default::default()
    };
    assert!(matches!(host.set_filters(&bad), Err(Error::Filters(_))));
    assert_eq!(host.set_filters(&MonitorFilters::none()).expect("set"), 2);
    assert_eq!(plugin.read_filters(), Some((2, MonitorFilters::none())));
}

#[test]
fn producer_free_space_supports_all_or_nothing_batches() {
    let (_d, path) = tmp();
    let mut host = Channel::create(&path, 1, 4).expect("create");
    let plugin = Channel::attach(&path).expect("attach");
    let mut p = plugin.producer(0).expect("producer");
    assert_eq!(p.free(1), 4);
    assert!(p.push(&rec(0, 1)) && p.push(&rec(0, 2)) && p.push(&rec(0, 3)));
    assert_eq!(p.free(2), 1);
    assert_eq!(host.drain(|_| {}), 3);
    assert_eq!(p.free(1), 1); // cached tail suffices
    assert_eq!(p.free(4), 4); // refreshes the consumer's tail
}

/// How many of the file's pages are in the page cache (mincore over a fresh mapping).
fn resident_pages(path: &std::path::Path) -> usize {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a fresh read-only shared mapping of a file we hold open; checked for failure
    // below and unmapped before returning.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let mut v = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `p` maps `len` bytes; `v` has one byte per page of them.
    let rc = unsafe { libc::mincore(p, len, v.as_mut_ptr()) };
    // SAFETY: `p` and `len` are the mapping made above, not used after this.
    unsafe { libc::munmap(p, len) };
    assert_eq!(rc, 0);
    v.iter().filter(|&&b| b & 1 != 0).count()
}

#[test]
fn rings_nobody_writes_to_stay_unallocated() {
    // On tmpfs, as /run normally is: a disk file system's read-ahead would fill the page
    // cache with the file's holes whatever the mappings do.
    let d = tempfile::tempdir_in("/dev/shm").expect("a tempdir on /dev/shm (tmpfs)");
    let path = d.path().join("plugin.shm");
    let mut host = Channel::create(&path, 2, 65536).expect("create");
    let plugin = Channel::attach(&path).expect("attach");
    let mut p0 = plugin.producer(0).expect("producer 0");
    let _p1 = plugin.producer(1).expect("producer 1");
    // 16 MiB of rings, 4096 pages: only the header, counters and ring controls are touched.
    let idle = resident_pages(&path);
    assert!(idle <= 8, "{idle} pages resident with no record written");
    // 320 records of 128 bytes fill the first 10 pages of ring 0.
    for i in 0..320 {
        assert!(p0.push(&rec(0, i)));
    }
    let mut n = 0;
    host.drain(|_| n += 1);
    assert_eq!(n, 320);
    let busy = resident_pages(&path);
    assert!(
        (idle + 10..=idle + 12).contains(&busy),
        "{busy} pages resident after 10 pages of records ({idle} before)"
    );
}
