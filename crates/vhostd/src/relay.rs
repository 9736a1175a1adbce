//! A relay between QEMU and a backend that holds back `SET_VRING_ENABLE` messages sent before
//! `SET_FEATURES` until `SET_FEATURES` has passed.
//!
//! Why: QEMU's virtio-net enables its vhost-user rings (`peer_attach`) while it negotiates
//! with the guest, before it sends `SET_FEATURES`, and does not send them again when it starts
//! the device; the vhost crate refuses the message until `VHOST_USER_F_PROTOCOL_FEATURES` is
//! acked and ends the connection. So the relay answers such a message itself (with success,
//! when it asked for a reply), keeps the last one per ring, and passes them to the backend
//! right after `SET_FEATURES`, without asking for a reply. Every other message, with its file
//! descriptors, passes unchanged.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// `VHOST_USER_SET_FEATURES`.
const SET_FEATURES: u32 = 2;
/// `VHOST_USER_SET_VRING_ENABLE`.
const SET_VRING_ENABLE: u32 = 18;
/// Header flags: protocol version 1, a reply, a reply wanted.
const VERSION_1: u32 = 0x1;
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;
/// The message header: request, flags, payload size.
const HDR: usize = 12;
/// Largest payload the protocol allows (the vhost crate's MAX_MSG_SIZE).
const MAX_PAYLOAD: usize = 0x1000;
/// Most file descriptors one message carries (VHOST_MEMORY_BASELINE_NREGIONS).
const MAX_FDS: usize = 32;

/// One message and the descriptors that came with it.
struct Msg {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl Msg {
    fn request(&self) -> u32 {
        u32::from_le_bytes([self.bytes[0], self.bytes[1], self.bytes[2], self.bytes[3]])
    }

    fn flags(&self) -> u32 {
        u32::from_le_bytes([self.bytes[4], self.bytes[5], self.bytes[6], self.bytes[7]])
    }

    /// The ring index of a vring-state message (0 if the payload is short).
    fn ring(&self) -> u32 {
        match self.bytes.get(HDR..HDR + 4) {
            Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            None => 0,
        }
    }

    /// The same message without `NEED_REPLY` (its reply was already given).
    fn without_reply(mut self) -> Msg {
        let f = (self.flags() & !NEED_REPLY).to_le_bytes();
        self.bytes[4..8].copy_from_slice(&f);
        self
    }
}

/// Reads one message: the header (with any descriptors), then its payload. `None` at EOF
/// or on a malformed message (the relay then ends, which ends the connection).
fn read_msg(sock: &UnixStream) -> Option<Msg> {
    let mut hdr = [0u8; HDR];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < HDR {
        let mut iov = [IoSliceMut::new(&mut hdr[got..])];
        let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
        let msg = recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .ok()?;
        if msg.bytes == 0 {
            return None;
        }
        got += msg.bytes;
        for c in msg.cmsgs().ok()? {
            if let ControlMessageOwned::ScmRights(v) = c {
                // SAFETY: the kernel just installed these descriptors in this process for
                // us; nobody else owns them.
                fds.extend(
                    v.into_iter()
                        .map(|fd| unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }),
                );
            }
        }
    }
    let size = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]) as usize;
    if size > MAX_PAYLOAD {
        return None;
    }
    let mut bytes = hdr.to_vec();
    bytes.resize(HDR + size, 0);
    (&*sock).read_exact(&mut bytes[HDR..]).ok()?;
    Some(Msg { bytes, fds })
}

fn write_msg(sock: &UnixStream, m: &Msg) -> std::io::Result<()> {
    let raw: Vec<RawFd> = m.fds.iter().map(AsRawFd::as_raw_fd).collect();
    let cmsgs: Vec<ControlMessage<'_>> = if raw.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&raw)]
    };
    let mut sent = sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(&m.bytes)],
        &cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(std::io::Error::from)?;
    // The descriptors went with the first byte; the rest is plain data.
    while sent < m.bytes.len() {
        sent += (&*sock).write(&m.bytes[sent..])?;
    }
    Ok(())
}

/// The success reply to a dropped message that wanted one.
fn ack(request: u32) -> Msg {
    let mut bytes = Vec::with_capacity(HDR + 8);
    bytes.extend_from_slice(&request.to_le_bytes());
    bytes.extend_from_slice(&(VERSION_1 | REPLY).to_le_bytes());
    bytes.extend_from_slice(&8u32.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes());
    Msg {
        bytes,
        fds: Vec::new(),
    }
}

/// Relays between `frontend` (QEMU) and `backend` until either side closes; returns when
/// both directions are done. Counts of dropped messages go to the log.
pub(crate) fn run(frontend: UnixStream, backend: UnixStream) {
    let to_front = Arc::new(Mutex::new(match frontend.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    }));
    let (Ok(back_reader), Ok(front_closer), Ok(back_closer)) = (
        backend.try_clone(),
        frontend.try_clone(),
        backend.try_clone(),
    ) else {
        return;
    };
    let replies = to_front.clone();
    let upstream = std::thread::Builder::new()
        .name("vmsight-vu-relay".into())
        .spawn(move || {
            crate::seccomp::install_once(crate::seccomp::ThreadClass::GuestService);
            while let Some(m) = read_msg(&back_reader) {
                let sock = replies.lock().unwrap_or_else(|p| p.into_inner());
                if write_msg(&sock, &m).is_err() {
                    break;
                }
            }
            let _ = front_closer.shutdown(std::net::Shutdown::Both);
        });
    let mut features_seen = false;
    let mut held: std::collections::BTreeMap<u32, Msg> = std::collections::BTreeMap::new();
    let mut dropped = 0u64;
    while let Some(m) = read_msg(&frontend) {
        let req = m.request();
        tracing::trace!(
            req,
            flags = m.flags(),
            fds = m.fds.len(),
            features_seen,
            "vhost-user message"
        );
        if req == SET_FEATURES {
            features_seen = true;
        }
        if req == SET_VRING_ENABLE && !features_seen {
            dropped += 1;
            if m.flags() & NEED_REPLY != 0 {
                let sock = to_front.lock().unwrap_or_else(|p| p.into_inner());
                if write_msg(&sock, &ack(req)).is_err() {
                    break;
                }
            }
            held.insert(m.ring(), m.without_reply());
            continue;
        }
        if write_msg(&backend, &m).is_err() {
            break;
        }
        if req == SET_FEATURES && held.values().any(|h| write_msg(&backend, h).is_err()) {
            break;
        }
        if req == SET_FEATURES {
            held.clear();
        }
    }
    let _ = back_closer.shutdown(std::net::Shutdown::Both);
    if let Ok(t) = upstream {
        let _ = t.join();
    }
    tracing::debug!(dropped, "vhost-user relay ended");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(req: u32, flags: u32, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&req.to_le_bytes());
        b.extend_from_slice(&flags.to_le_bytes());
        b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        b.extend_from_slice(payload);
        b
    }

    fn read_one(s: &mut UnixStream) -> Vec<u8> {
        let mut h = [0u8; HDR];
        s.read_exact(&mut h).expect("header");
        let n = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let mut p = vec![0u8; n];
        s.read_exact(&mut p).expect("payload");
        let mut all = h.to_vec();
        all.extend(p);
        all
    }

    #[test]
    fn early_vring_enable_is_answered_and_held_until_set_features() {
        let (mut qemu, relay_front) = UnixStream::pair().expect("pair");
        let (relay_back, mut backend) = UnixStream::pair().expect("pair");
        let t = std::thread::spawn(move || run(relay_front, relay_back));
        let early = msg(
            SET_VRING_ENABLE,
            VERSION_1 | NEED_REPLY,
            &[0, 0, 0, 0, 1, 0, 0, 0],
        );
        qemu.write_all(&early).expect("send");
        // QEMU gets a success reply from the relay; the backend never sees the message.
        let reply = read_one(&mut qemu);
        assert_eq!(reply, ack(SET_VRING_ENABLE).bytes);
        let features = msg(SET_FEATURES, VERSION_1, &7u64.to_le_bytes());
        qemu.write_all(&features).expect("send");
        assert_eq!(read_one(&mut backend), features);
        // The held enable follows SET_FEATURES, without asking for a reply.
        assert_eq!(
            read_one(&mut backend),
            msg(SET_VRING_ENABLE, VERSION_1, &[0, 0, 0, 0, 1, 0, 0, 0])
        );
        // After SET_FEATURES, SET_VRING_ENABLE goes through.
        let late = msg(SET_VRING_ENABLE, VERSION_1, &[0, 0, 0, 0, 1, 0, 0, 0]);
        qemu.write_all(&late).expect("send");
        assert_eq!(read_one(&mut backend), late);
        // Replies flow back.
        let r = msg(1, VERSION_1 | REPLY, &9u64.to_le_bytes());
        backend.write_all(&r).expect("reply");
        assert_eq!(read_one(&mut qemu), r);
        drop(qemu);
        t.join().expect("relay ends when QEMU goes");
    }

    #[test]
    fn descriptors_travel_with_their_message() {
        let (qemu, relay_front) = UnixStream::pair().expect("pair");
        let (relay_back, backend) = UnixStream::pair().expect("pair");
        let t = std::thread::spawn(move || run(relay_front, relay_back));
        let file = tempfile::tempfile().expect("file");
        let m = Msg {
            bytes: msg(SET_FEATURES + 10, VERSION_1, &[1, 2, 3, 4, 5, 6, 7, 8]),
            fds: vec![OwnedFd::from(file)],
        };
        write_msg(&qemu, &m).expect("send with fd");
        let got = read_msg(&backend).expect("message");
        assert_eq!(got.bytes, m.bytes);
        assert_eq!(got.fds.len(), 1);
        drop(qemu);
        t.join().expect("ends");
    }

    #[test]
    fn an_oversized_message_ends_the_relay() {
        let (mut qemu, relay_front) = UnixStream::pair().expect("pair");
        let (relay_back, _backend) = UnixStream::pair().expect("pair");
        let t = std::thread::spawn(move || run(relay_front, relay_back));
        let mut bad = msg(SET_FEATURES, VERSION_1, &[]);
        bad[8..12].copy_from_slice(&(1u32 << 20).to_le_bytes());
        qemu.write_all(&bad).expect("send");
        t.join().expect("the relay gives up on garbage");
    }
}
