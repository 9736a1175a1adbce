//! vmsight's side of the ivshmem client-server protocol (QEMU's docs/specs/ivshmem-spec.rst;
//! Debian ships no ivshmem-server). vmsight is the server and also the only other peer, so
//! QEMU's `ivshmem-doorbell` device gets exactly one shared memory (the region) and one peer:
//!
//! 1. protocol version 0; 2. QEMU's own peer id ([`GUEST_PEER`]); 3. -1 with the region's
//!    memfd; 4. [`VMM_PEER`] once per vector with the eventfd QEMU writes when the guest rings
//!    vmsight (Doorbell register `VMM_PEER << 16 | vector`); 5. [`GUEST_PEER`] once per vector
//!    with the eventfd on which QEMU raises the guest's MSI-X vector (vmsight writes it to
//!    ring the guest).
//!
//! Every message is an 8-byte little-endian signed number, with at most one descriptor
//! (SCM_RIGHTS). Hand-written because it is these 40 lines; no crate speaks it.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmsight_proto::sym::VECTORS;

/// The ivshmem protocol version this server speaks.
pub const PROTOCOL_VERSION: i64 = 0;
/// vmsight's peer id (the guest rings it in the Doorbell register).
pub const VMM_PEER: u32 = 0;
/// QEMU's (the guest's) peer id.
pub const GUEST_PEER: u32 = 1;

/// The eventfds of both peers, one per vector.
pub struct Doorbells {
    /// Written by QEMU when the guest rings vmsight; read by vmsight.
    pub to_vmm: Vec<EventFd>,
    /// Written by vmsight to interrupt the guest; QEMU turns them into MSI-X interrupts.
    pub to_guest: Vec<EventFd>,
}

impl Doorbells {
    pub fn new() -> std::io::Result<Doorbells> {
        let make = || {
            (0..VECTORS)
                .map(|_| EventFd::new(EFD_NONBLOCK))
                .collect::<std::io::Result<Vec<_>>>()
        };
        Ok(Doorbells {
            to_vmm: make()?,
            to_guest: make()?,
        })
    }

    /// Rings the guest's `vector`.
    pub fn ring_guest(&self, vector: u32) -> std::io::Result<()> {
        match self.to_guest.get(vector as usize) {
            Some(e) => e.write(1),
            None => Ok(()),
        }
    }

    /// Consumes the pending rings of vmsight's `vector`: how many arrived since the last call.
    pub fn drain_vmm(&self, vector: u32) -> u64 {
        self.to_vmm
            .get(vector as usize)
            .and_then(|e| e.read().ok())
            .unwrap_or(0)
    }
}

/// An eventfd as a borrowed descriptor (vmm-sys-util's `EventFd` only offers `AsRawFd`).
pub fn borrow(e: &EventFd) -> BorrowedFd<'_> {
    // SAFETY: the descriptor is open for as long as `e`, which the result borrows.
    unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) }
}

fn send(sock: &UnixStream, value: i64, fd: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
    let bytes = value.to_le_bytes();
    let raw = fd.map(|f| [f.as_raw_fd()]);
    let cmsgs: Vec<ControlMessage<'_>> = raw
        .as_ref()
        .map(|r| ControlMessage::ScmRights(r))
        .into_iter()
        .collect();
    let sent = sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(&bytes)],
        &cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(std::io::Error::from)?;
    if sent != bytes.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            "short write of an ivshmem message",
        ));
    }
    Ok(())
}

/// Sends QEMU everything it needs, in the protocol's order.
pub fn setup_client(
    sock: &UnixStream,
    shm: BorrowedFd<'_>,
    bells: &Doorbells,
) -> std::io::Result<()> {
    send(sock, PROTOCOL_VERSION, None)?;
    send(sock, GUEST_PEER.into(), None)?;
    send(sock, -1, Some(shm))?;
    for e in &bells.to_vmm {
        send(sock, VMM_PEER.into(), Some(borrow(e)))?;
    }
    for e in &bells.to_guest {
        send(sock, GUEST_PEER.into(), Some(borrow(e)))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{recvmsg, ControlMessageOwned};
    use std::io::IoSliceMut;
    use std::os::fd::{FromRawFd, OwnedFd};

    /// What a client receives: (value, descriptor) per message.
    fn receive(sock: &UnixStream, n: usize) -> Vec<(i64, Option<OwnedFd>)> {
        (0..n)
            .map(|_| {
                let mut buf = [0u8; 8];
                let mut iov = [IoSliceMut::new(&mut buf)];
                let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
                let msg = recvmsg::<()>(
                    sock.as_raw_fd(),
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::empty(),
                )
                .unwrap();
                let mut fd = None;
                for c in msg.cmsgs().unwrap() {
                    if let ControlMessageOwned::ScmRights(v) = c {
                        // SAFETY: the kernel installed this descriptor for us.
                        fd = v.first().map(|&r| unsafe { OwnedFd::from_raw_fd(r) });
                    }
                }
                (i64::from_le_bytes(buf), fd)
            })
            .collect()
    }

    /// The messages follow the spec's order, and the descriptors work: a write on the
    /// guest-side eventfd QEMU receives is what vmsight's ring does.
    #[test]
    fn client_gets_version_id_memory_peer_and_own_vectors_in_order() {
        let (a, b) = UnixStream::pair().unwrap();
        let region = super::super::region::Region::create("t").unwrap();
        let bells = Doorbells::new().unwrap();
        setup_client(&a, region.fd(), &bells).unwrap();
        let got = receive(&b, 3 + 2 * VECTORS as usize);
        let values: Vec<i64> = got.iter().map(|(v, _)| *v).collect();
        assert_eq!(values, vec![0, 1, -1, 0, 0, 1, 1]);
        assert!(got[0].1.is_none() && got[1].1.is_none());
        assert!(got[2..].iter().all(|(_, f)| f.is_some()));
        // QEMU would write the to_vmm descriptor (message 3) when the guest rings vector 0.
        let to_vmm0 = got[3].1.as_ref().unwrap();
        nix::unistd::write(to_vmm0, &1u64.to_ne_bytes()).unwrap();
        assert_eq!(bells.drain_vmm(0), 1);
        assert_eq!(bells.drain_vmm(0), 0);
    }
}
