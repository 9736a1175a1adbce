//! The host end of the device: a Linux tap with the virtio-net header (`IFF_VNET_HDR`).
//!
//! Hand-written on purpose: four ioctls (`TUNSETIFF`, `TUNSETVNETHDRSZ`, `TUNSETOFFLOAD`) on
//! `/dev/net/tun`, with the constants from `libc`. The tap crates on crates.io either lack the
//! vnet header and offload ioctls or bring an async runtime; Cloud Hypervisor's `net_util`,
//! which has them, is not published.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use crate::error::NetError;
use crate::packet::VNET_HDR_LEN;

/// Longest interface name Linux accepts (IFNAMSIZ - 1).
pub const MAX_IFNAME: usize = 15;

/// An open tap device.
#[derive(Debug)]
pub struct Tap {
    fd: OwnedFd,
    name: String,
}

/// Offloads the tap may hand to the device (TUNSETOFFLOAD): what the guest accepted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TapOffloads {
    pub csum: bool,
    pub tso4: bool,
    pub tso6: bool,
    pub ecn: bool,
}

impl TapOffloads {
    fn bits(self) -> libc::c_uint {
        let mut b = 0;
        if self.csum {
            b |= libc::TUN_F_CSUM;
            // Segmentation offloads need checksum offload (the kernel refuses them alone).
            if self.tso4 {
                b |= libc::TUN_F_TSO4;
            }
            if self.tso6 {
                b |= libc::TUN_F_TSO6;
            }
            if self.ecn && (self.tso4 || self.tso6) {
                b |= libc::TUN_F_TSO_ECN;
            }
        }
        b
    }
}

/// Checks an interface name: 1 to 15 bytes of ASCII letters, digits, `-`, `_` and `.`.
pub fn check_ifname(name: &str) -> Result<(), NetError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_IFNAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(NetError::BadIfname {
            name: name.to_owned(),
        })
    }
}

impl Tap {
    /// Creates (or attaches to a persistent) tap `name` in the current network namespace, or
    /// in the namespace at `netns` (e.g. `/run/netns/NAME`) when given: the device lives in
    /// the namespace of the thread that opened `/dev/net/tun`, so the open happens on a
    /// short-lived thread that entered it.
    pub fn open(name: &str, netns: Option<&Path>) -> Result<Tap, NetError> {
        check_ifname(name)?;
        match netns {
            None => Self::open_here(name),
            Some(ns) => {
                let ns = ns.to_owned();
                let name = name.to_owned();
                std::thread::Builder::new()
                    .name("vmsight-tapns".into())
                    .spawn(move || {
                        enter_netns(&ns)?;
                        Self::open_here(&name)
                    })
                    .map_err(|source| NetError::Thread { source })?
                    .join()
                    .map_err(|_| NetError::Panicked)?
            }
        }
    }

    fn open_here(name: &str) -> Result<Tap, NetError> {
        let err = |op: &'static str, source: io::Error| NetError::Tap {
            name: name.to_owned(),
            op,
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags_cloexec_nonblock()
            .open("/dev/net/tun")
            .map_err(|e| err("open /dev/net/tun", e))?;
        let fd = OwnedFd::from(file);
        // SAFETY: an all-zero `ifreq` is a valid value (a C struct of integers and a union).
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
        // SAFETY: TUNSETIFF reads and writes an `ifreq`; `req` is a valid, exclusively
        // borrowed one and `fd` is an open tun file.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut req) };
        if rc < 0 {
            return Err(err("TUNSETIFF", io::Error::last_os_error()));
        }
        let hdr = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which is valid.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr) };
        if rc < 0 {
            return Err(err("TUNSETVNETHDRSZ", io::Error::last_os_error()));
        }
        let actual: Vec<u8> = req
            .ifr_name
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        let tap = Tap {
            fd,
            name: String::from_utf8_lossy(&actual).into_owned(),
        };
        tap.set_offloads(TapOffloads::default())?;
        Ok(tap)
    }

    /// Lets a child process (QEMU's `-netdev tap,fd=N`) inherit the descriptor.
    pub fn set_inheritable(&self) -> Result<(), NetError> {
        let fd = self.fd.as_raw_fd();
        // SAFETY: F_GETFD/F_SETFD on an open descriptor we own; no memory is involved.
        let rc = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags < 0 {
                flags
            } else {
                libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC)
            }
        };
        if rc < 0 {
            return Err(NetError::Tap {
                name: self.name.clone(),
                op: "F_SETFD",
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// The interface's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tells the kernel which offloaded frames it may hand us (what the guest accepts).
    pub fn set_offloads(&self, o: TapOffloads) -> Result<(), NetError> {
        let bits = o.bits();
        // SAFETY: TUNSETOFFLOAD takes its argument by value; the fd is an open tap.
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                libc::c_ulong::from(bits),
            )
        };
        if rc < 0 {
            return Err(NetError::Tap {
                name: self.name.clone(),
                op: "TUNSETOFFLOAD",
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// A second handle on the same tap (a dup of its file descriptor).
    pub fn try_clone(&self) -> io::Result<Tap> {
        Ok(Tap {
            fd: self.fd.try_clone()?,
            name: self.name.clone(),
        })
    }

    /// Reads one frame (virtio-net header + Ethernet frame) into `buf`; `WouldBlock` when
    /// none is waiting.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n.unsigned_abs())
        }
    }

    /// Writes one frame: `hdr` then `data`, in one writev (a tap takes one frame per write).
    pub fn write(&self, hdr: &[u8; VNET_HDR_LEN], data: &[u8]) -> io::Result<usize> {
        let iov = [
            libc::iovec {
                iov_base: hdr.as_ptr() as *mut libc::c_void,
                iov_len: hdr.len(),
            },
            libc::iovec {
                iov_base: data.as_ptr() as *mut libc::c_void,
                iov_len: data.len(),
            },
        ];
        // SAFETY: both iovecs point to live buffers of the given lengths, which writev only
        // reads.
        let n = unsafe { libc::writev(self.fd.as_raw_fd(), iov.as_ptr(), 2) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n.unsigned_abs())
        }
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Moves the calling thread into the network namespace at `path`.
pub fn enter_netns(path: &Path) -> Result<(), NetError> {
    let f = File::open(path).map_err(|source| NetError::Netns {
        path: path.to_owned(),
        source,
    })?;
    // SAFETY: setns on an open namespace file descriptor affects only the calling thread.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc < 0 {
        return Err(NetError::Netns {
            path: path.to_owned(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// `/run/netns/NAME`, where `ip netns` keeps named namespaces.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new("/run/netns").join(name)
}

trait OpenFlags {
    fn custom_flags_cloexec_nonblock(&mut self) -> &mut Self;
}

impl OpenFlags for std::fs::OpenOptions {
    fn custom_flags_cloexec_nonblock(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
    }
}

impl Tap {
    /// A device over any message-oriented descriptor (a `SOCK_SEQPACKET` socket in tests).
    #[cfg(test)]
    pub(crate) fn from_fd(fd: OwnedFd, name: &str) -> Tap {
        Tap {
            fd,
            name: name.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_are_checked() {
        assert!(check_ifname("vmtap0").is_ok());
        assert!(check_ifname("a.b-c_d").is_ok());
        assert!(check_ifname("").is_err());
        assert!(check_ifname("0123456789abcdef").is_err());
        assert!(check_ifname("bad/name").is_err());
        assert!(check_ifname("sp ace").is_err());
    }

    #[test]
    fn offload_bits_follow_the_kernel_rules() {
        assert_eq!(TapOffloads::default().bits(), 0);
        let tso_without_csum = TapOffloads {
            tso4: true,
            ..Default::default()
        };
        assert_eq!(tso_without_csum.bits(), 0);
        let all = TapOffloads {
            csum: true,
            tso4: true,
            tso6: true,
            ecn: true,
        };
        assert_eq!(
            all.bits(),
            libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_TSO_ECN
        );
    }
}
