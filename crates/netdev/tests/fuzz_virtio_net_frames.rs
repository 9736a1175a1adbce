//! The virtio-net frames fuzz target on stable Rust: the committed corpus, then proptest over
//! mutations and random inputs from a fresh seed (docs/fuzzing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use vmsight_netdev::fuzzing::{
    encode_net, virtio_net_frames, Edit, NetOp, Segment, ACK, BAD_CSUM, FIN, NET_EVICTED,
    NET_EXPIRED, NET_NOT_TCP, NET_REWRITTEN, NET_TCP_UNCHANGED, OPTIONS, RST, SYN, TO_GUEST, V6,
};

const TARGET: &str = "virtio_net_frames";
const ALL: u32 = NET_NOT_TCP | NET_TCP_UNCHANGED | NET_REWRITTEN | NET_EVICTED | NET_EXPIRED;

const GUEST_ISN: u32 = 1000;
const PEER_ISN: u32 = 5_000_000;

fn tcp(flags: u8, port: u8, seq: u32, ack: u32, window: u16, payload: u16) -> NetOp {
    NetOp::Tcp {
        seg: Segment {
            flags,
            port,
            seq,
            ack,
            window,
            mss: 1460,
            wscale: 7,
            payload,
        },
        edit: Edit::default(),
        dt_us: 500,
    }
}

/// With the virtio-net header flags `hdr_flags` (1: the receiver computes the checksum).
fn with_hdr(op: NetOp, hdr_flags: u8) -> NetOp {
    match op {
        NetOp::Tcp { seg, edit, dt_us } => NetOp::Tcp {
            seg,
            edit: Edit { hdr_flags, ..edit },
            dt_us,
        },
        other => other,
    }
}

/// A guest-opened handshake on port `port` (`v6`: `V6` or 0), 1000 bytes of data and the
/// peer's ACK with a full window (FoxyVegas lowers it).
fn connection(v6: u8, port: u8) -> Vec<NetOp> {
    let (g, p) = (GUEST_ISN + 1, PEER_ISN + 1);
    vec![
        tcp(v6 | SYN | OPTIONS, port, GUEST_ISN, 0, 64240, 0),
        tcp(
            v6 | TO_GUEST | SYN | ACK | OPTIONS,
            port,
            PEER_ISN,
            g,
            65160,
            0,
        ),
        tcp(v6 | ACK, port, g, p, 502, 1000),
        tcp(v6 | TO_GUEST | ACK, port, p, g + 1000, 65535, 0),
    ]
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut offload = connection(V6, 1);
    offload.push(with_hdr(
        tcp(
            V6 | TO_GUEST | ACK,
            1,
            PEER_ISN + 1,
            GUEST_ISN + 1001,
            65535,
            0,
        ),
        1,
    ));
    let mut closing = connection(0, 2);
    closing.extend([
        tcp(FIN | ACK, 2, GUEST_ISN + 1001, PEER_ISN + 1, 502, 0),
        tcp(
            TO_GUEST | FIN | ACK,
            2,
            PEER_ISN + 1,
            GUEST_ISN + 1002,
            65535,
            0,
        ),
        tcp(RST, 3, 1, 0, 0, 0),
        NetOp::Tick { ms: 6000 },
    ]);
    let mut evicting = connection(0, 4);
    evicting.extend(connection(0, 5));
    evicting.push(NetOp::Tick { ms: 1000 });
    let mut arp = vec![0xffu8; 6];
    arp.extend([2, 0, 0, 0, 0, 1, 0x08, 0x06]);
    arp.extend([0u8; 28]);
    let raw = |dir: u8, cut: u16, bytes: Vec<u8>| NetOp::Raw {
        dir,
        edit: Edit {
            cut,
            ..Edit::default()
        },
        bytes,
    };
    let truncated = NetOp::Tcp {
        seg: Segment {
            flags: ACK | TO_GUEST,
            ..Segment::default()
        },
        edit: Edit {
            cut: 40,
            ..Edit::default()
        },
        dt_us: 1,
    };
    let mid = vec![
        tcp(ACK, 6, 77_000, 9_000, 502, 1448),
        tcp(TO_GUEST | ACK | BAD_CSUM, 6, 9_000, 78_448, 65535, 0),
        tcp(ACK | BAD_CSUM, 6, 78_448, 9_000, 502, 1448),
    ];
    vec![
        (
            "handshake-data-rewritten-ack",
            encode_net(7, &connection(0, 0)),
        ),
        ("ipv6-and-checksum-offload", encode_net(7, &offload)),
        ("fin-rst-and-linger", encode_net(3, &closing)),
        ("one-flow-table-evicts", encode_net(0, &evicting)),
        ("mid-connection-bad-checksums", encode_net(7, &mid)),
        (
            "arp-garbage-and-cut-segment",
            encode_net(
                1,
                &[
                    raw(0, 0, arp),
                    raw(1, 0, vec![0x5a; 90]),
                    raw(0, 10, vec![0x08; 60]),
                    truncated,
                ],
            ),
        ),
    ]
}

#[test]
fn generated_seeds_are_committed_and_reach_every_outcome() {
    let seen = driver::check_seeds(TARGET, seeds(), virtio_net_frames);
    assert_eq!(seen, ALL, "outcomes reached by the seeds: {seen:#b}");
}

#[test]
fn corpus_and_mutations_pass_every_frame_touching_at_most_its_window() {
    driver::corpus_and_mutations(TARGET, virtio_net_frames, ALL, ALL, 600_000, 4096);
}
