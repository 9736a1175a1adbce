//! Frames as they cross the device: the virtio-net header, the Ethernet frame, and a parsed
//! view of the TCP/IP headers stages look at.
//!
//! The device speaks the virtio 1.0 header (12 bytes, with `num_buffers`) to the guest and to
//! the tap (`IFF_VNET_HDR` with `TUNSETVNETHDRSZ` 12), so a frame keeps its header unchanged
//! from one side to the other: checksum and segmentation offloads are done by whichever kernel
//! receives the frame, never by vmsight.

use std::net::IpAddr;

use etherparse::{NetSlice, SlicedPacket, TcpOptionElement, TransportSlice};

/// Length of the virtio-net header both sides use (`struct virtio_net_hdr_v1`).
pub const VNET_HDR_LEN: usize = 12;
/// Largest Ethernet frame the device carries: a 64 KiB GSO frame plus link headers.
pub const MAX_FRAME_LEN: usize = 65_535 + 14 + 4;

/// `flags`: the checksum at `csum_start + csum_offset` still has to be computed; the field
/// holds the pseudo-header sum only.
pub const FLAG_NEEDS_CSUM: u8 = 1;
/// `flags`: the checksum was verified by the sender's side.
pub const FLAG_DATA_VALID: u8 = 2;
/// `gso_type` values.
pub const GSO_NONE: u8 = 0;
pub const GSO_TCPV4: u8 = 1;
pub const GSO_UDP: u8 = 3;
pub const GSO_TCPV6: u8 = 4;
pub const GSO_ECN: u8 = 0x80;

/// Which way a frame is going.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Sent by the guest (TX virtqueue), on its way to the tap.
    FromGuest,
    /// Read from the tap, on its way to the guest (RX virtqueue).
    ToGuest,
}

/// `struct virtio_net_hdr_v1`, little-endian on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
    pub num_buffers: u16,
}

impl VnetHdr {
    /// Decodes the 12 header bytes.
    pub fn parse(b: &[u8; VNET_HDR_LEN]) -> Self {
        let le = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        Self {
            flags: b[0],
            gso_type: b[1],
            hdr_len: le(2),
            gso_size: le(4),
            csum_start: le(6),
            csum_offset: le(8),
            num_buffers: le(10),
        }
    }

    /// Encodes the header.
    pub fn to_bytes(self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_le_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_le_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_le_bytes());
        b[10..12].copy_from_slice(&self.num_buffers.to_le_bytes());
        b
    }

    /// Whether the receiver still has to compute the transport checksum.
    pub fn needs_csum(&self) -> bool {
        self.flags & FLAG_NEEDS_CSUM != 0
    }

    /// Whether the header describes something the device can pass on: a known GSO type with a
    /// non-zero segment size, and a checksum position inside the frame.
    pub fn is_sane(&self, frame_len: usize) -> bool {
        let gso_ok = match self.gso_type & !GSO_ECN {
            GSO_NONE => self.gso_type & GSO_ECN == 0,
            GSO_TCPV4 | GSO_TCPV6 | GSO_UDP => self.gso_size > 0,
            _ => false,
        };
        let csum_ok = !self.needs_csum()
            || usize::from(self.csum_start) + usize::from(self.csum_offset) + 2 <= frame_len;
        gso_ok && csum_ok
    }
}

/// One frame in the pipeline: its virtio-net header and the Ethernet frame.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frame {
    pub hdr: VnetHdr,
    pub data: Vec<u8>,
}

/// TCP flags of a segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpFlags {
    pub syn: bool,
    pub ack: bool,
    pub fin: bool,
    pub rst: bool,
}

/// The TCP/IP header fields of a frame that carries a TCP segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSegment {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    pub flags: TcpFlags,
    /// The window field as sent (not scaled).
    pub window: u16,
    /// Bytes of payload (for a GSO frame, the whole super-segment's).
    pub payload_len: usize,
    /// Offset of the TCP header in the frame.
    pub tcp_offset: usize,
    /// MSS option (SYN segments).
    pub mss: Option<u16>,
    /// Window scale option (SYN segments).
    pub wscale: Option<u8>,
}

impl TcpSegment {
    /// Offset of the window field in the frame.
    pub fn window_offset(&self) -> usize {
        self.tcp_offset + 14
    }

    /// Offset of the checksum field in the frame.
    pub fn checksum_offset(&self) -> usize {
        self.tcp_offset + 16
    }

    /// Sequence number just past this segment's payload (SYN and FIN count one).
    pub fn seq_end(&self) -> u32 {
        let extra = u32::from(self.flags.syn) + u32::from(self.flags.fin);
        self.seq
            .wrapping_add(u32::try_from(self.payload_len).unwrap_or(u32::MAX))
            .wrapping_add(extra)
    }
}

/// Whether a frame can be passed on: IPv4 and IPv6 frames must parse (headers complete, the
/// IP length within the frame, a transport header that fits); other ethertypes pass as they
/// are (the receiver's business).
pub fn well_formed(frame: &[u8]) -> bool {
    if frame.len() < 14 {
        return false;
    }
    let mut ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let mut off = 14;
    // 802.1Q / 802.1ad tags.
    while matches!(ethertype, 0x8100 | 0x88a8) {
        let Some(b) = frame.get(off + 2..off + 4) else {
            return false;
        };
        ethertype = u16::from_be_bytes([b[0], b[1]]);
        off += 4;
    }
    match ethertype {
        0x0800 | 0x86dd => SlicedPacket::from_ethernet(frame).is_ok(),
        _ => true,
    }
}

/// Parses the TCP/IP headers of an Ethernet frame; `None` for anything that is not a
/// well-formed IPv4 or IPv6 TCP segment (those frames pass through untouched).
pub fn tcp_segment(frame: &[u8]) -> Option<TcpSegment> {
    let p = SlicedPacket::from_ethernet(frame).ok()?;
    let (src, dst) = match p.net.as_ref()? {
        NetSlice::Ipv4(v4) => (
            IpAddr::V4(v4.header().source_addr()),
            IpAddr::V4(v4.header().destination_addr()),
        ),
        NetSlice::Ipv6(v6) => (
            IpAddr::V6(v6.header().source_addr()),
            IpAddr::V6(v6.header().destination_addr()),
        ),
        NetSlice::Arp(_) => return None,
    };
    let TransportSlice::Tcp(tcp) = p.transport.as_ref()? else {
        return None;
    };
    let tcp_offset = (tcp.slice().as_ptr() as usize).checked_sub(frame.as_ptr() as usize)?;
    let mut mss = None;
    let mut wscale = None;
    for opt in tcp.options_iterator() {
        match opt {
            Ok(TcpOptionElement::MaximumSegmentSize(m)) => mss = Some(m),
            Ok(TcpOptionElement::WindowScale(s)) => wscale = Some(s),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    Some(TcpSegment {
        src,
        dst,
        sport: tcp.source_port(),
        dport: tcp.destination_port(),
        seq: tcp.sequence_number(),
        ack: tcp.acknowledgment_number(),
        flags: TcpFlags {
            syn: tcp.syn(),
            ack: tcp.ack(),
            fin: tcp.fin(),
            rst: tcp.rst(),
        },
        window: tcp.window_size(),
        payload_len: tcp.payload().len(),
        tcp_offset,
        mss,
        wscale,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use etherparse::PacketBuilder;

    /// An IPv4 TCP frame from `src:sport` to `dst:dport` (checksums filled in).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn tcp4(
        src: [u8; 4],
        sport: u16,
        dst: [u8; 4],
        dport: u16,
        seq: u32,
        ack: Option<u32>,
        window: u16,
        syn: bool,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut b = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv4(src, dst, 64)
            .tcp(sport, dport, seq, window);
        if syn {
            b = b.syn();
        }
        if let Some(a) = ack {
            b = b.ack(a);
        }
        let mut out = Vec::new();
        b.write(&mut out, payload).expect("builds");
        out
    }

    #[test]
    fn header_round_trips() {
        let h = VnetHdr {
            flags: 1,
            gso_type: GSO_TCPV4,
            hdr_len: 66,
            gso_size: 1448,
            csum_start: 34,
            csum_offset: 16,
            num_buffers: 3,
        };
        assert_eq!(VnetHdr::parse(&h.to_bytes()), h);
    }

    #[test]
    fn insane_headers_are_recognised() {
        let ok = VnetHdr::default();
        assert!(ok.is_sane(60));
        let bad_gso = VnetHdr { gso_type: 9, ..ok };
        assert!(!bad_gso.is_sane(60));
        let zero_seg = VnetHdr {
            gso_type: GSO_TCPV4,
            ..ok
        };
        assert!(!zero_seg.is_sane(60));
        let csum_outside = VnetHdr {
            flags: FLAG_NEEDS_CSUM,
            csum_start: 50,
            csum_offset: 16,
            ..ok
        };
        assert!(!csum_outside.is_sane(60));
        assert!(csum_outside.is_sane(70));
    }

    #[test]
    fn a_tcp_frame_is_parsed() {
        let f = tcp4(
            [10, 0, 2, 15],
            40000,
            [10, 0, 2, 1],
            5201,
            7,
            Some(9),
            512,
            false,
            b"hello",
        );
        let s = tcp_segment(&f).expect("tcp");
        assert_eq!(s.sport, 40000);
        assert_eq!(s.dport, 5201);
        assert_eq!(s.seq, 7);
        assert_eq!(s.ack, 9);
        assert_eq!(s.window, 512);
        assert_eq!(s.payload_len, 5);
        assert_eq!(s.tcp_offset, 34);
        assert_eq!(s.seq_end(), 12);
        assert_eq!(u16::from_be_bytes([f[48], f[49]]), 512);
        assert_eq!(s.window_offset(), 48);
    }

    #[test]
    fn truncated_ip_frames_are_not_well_formed_other_ethertypes_are() {
        let f = tcp4([1, 1, 1, 1], 1, [2, 2, 2, 2], 2, 0, None, 0, true, b"data");
        assert!(well_formed(&f));
        for n in 0..f.len() {
            assert!(!well_formed(&f[..n]), "prefix of {n} bytes");
        }
        let mut arp = vec![0xffu8; 42];
        arp[12] = 0x08;
        arp[13] = 0x06;
        assert!(well_formed(&arp));
        assert!(!well_formed(&arp[..10]));
    }

    #[test]
    fn garbage_and_truncated_frames_are_not_tcp() {
        let f = tcp4([1, 1, 1, 1], 1, [2, 2, 2, 2], 2, 0, None, 0, true, b"");
        for n in 0..f.len() {
            assert!(tcp_segment(&f[..n]).is_none(), "prefix of {n} bytes");
        }
        assert!(tcp_segment(&[0xff; 100]).is_none());
    }
}
