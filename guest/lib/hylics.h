/* hylics.h: libhylics, the guest side of Hylics' send offload (docs/hylics.md).
 *
 * A program that keeps its data in the shared in-memory file system (mounted at /hylics by the
 * image's init when the VM runs with `vmsight run --shared-mem SIZE`) asks vmsight to send a
 * file to a client: vmsight sends it from the host's copy of the share with sendfile(2), so the
 * bytes never pass through the guest's CPUs or its network device (the paper's "module"
 * scheme). The request and its answer travel over vsock (host CID 2, port HYLICS_PORT).
 *
 * Link with -lhylics. The command-line form is `hylics-send DEST PATH [OFFSET [LEN]]`. */
#ifndef HYLICS_H
#define HYLICS_H

#ifdef __cplusplus
extern "C" {
#endif

/* vmsight's Hylics service: vsock port on the host (CID 2). */
#define HYLICS_PORT 5100
/* Where the share is mounted unless $HYLICS_ROOT says otherwise. */
#define HYLICS_DEFAULT_ROOT "/hylics"

/* Sends `len` bytes (0: to the end of the file) of the share's file `path` from `offset` to
 * the TCP server `dest` ("IP:PORT"), on a new connection the host opens from the VM's network.
 * `path` is either under the share's mount point ($HYLICS_ROOT, default /hylics) or relative
 * to the share's root. Returns the number of bytes sent, or -1 with errno set (ECONNREFUSED:
 * no vmsight Hylics service; EPROTO: the service refused or failed, see hylics_last_error()). */
long long hylics_send_file(const char *dest, const char *path, unsigned long long offset,
                           unsigned long long len);

/* The service's last error sentence in this thread ("" if none). */
const char *hylics_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
