/* hylics.h: libhylics, the guest side of Hylics (docs/hylics.md).
 *
 * Send offload: a program that keeps its data in the shared in-memory file system (mounted at
 * /hylics by the image's init when the VM runs with `vmsight run --shared-mem SIZE`) asks
 * vmsight to send a file to a client: vmsight sends it from the host's copy of the share with
 * sendfile(2), so the bytes never pass through the guest's CPUs or its network device (the
 * paper's "module" scheme).
 *
 * Task reports: when the VM also runs with vmsight's SLO controller (`vmsight run --shared-mem
 * SIZE --hylics-slo ...`), the controller sizes the share (the tmpfs size limit) from the
 * response times of the guest's tasks. The program reports each task's arrival and completion
 * (hylics_task_arrived, hylics_task_done); when the controller shrinks the share it advises
 * which files to move out, and hylics_evict moves them to a directory of the guest's own.
 *
 * Socket scheme: a program that accepted a TCP connection (a client's request) hands that very
 * connection to vmsight for the body of its answer (hylics_sendfile). The library waits until
 * everything the program wrote was acknowledged, asks vmsight to hold the connection (its
 * frames are dropped both ways; TCP recovers them), freezes the socket with TCP_REPAIR and
 * dumps its state (sequence numbers, MSS, options, window scales, timestamp, windows), resets
 * it silently and sends the state to vmsight. vmsight recreates the connection on the host,
 * sends the share's file on it with sendfile(2), waits for the peer's acknowledgements,
 * freezes it and answers with its state (and the bytes the peer sent meanwhile). The library
 * restores the socket from that state on the same descriptor, asks vmsight to release the
 * connection and thaws it: the peer sees one ordinary connection, and the program goes on
 * writing and reading. TCP_REPAIR needs root or CAP_NET_ADMIN in the guest.
 *
 * Every request and its answer travel over vsock (host CID 2, port HYLICS_PORT), one JSON
 * object per line each way. hylics_send_file opens a connection per call, hylics_sendfile one
 * per hand-over; the task reports and hylics_evict share one connection per process
 * (thread-safe; a forked child makes its own).
 *
 * Testing aid: when the environment variable HYLICS_SERVICE_UNIX names a Unix stream socket,
 * the library connects there instead of to vsock (same protocol), e.g. to a fake service.
 *
 * Link with -lhylics. Command-line forms: `hylics-send DEST PATH [OFFSET [LEN]]`,
 * `hylics-evict DEST_DIR`; `hylics-workload` is a synthetic workload that reports its tasks;
 * `hylics-sockserve PORT PATH [HEADER [TRAILER]]` serves one connection with hylics_sendfile. */
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

/* Socket scheme: vmsight sends `len` bytes (0: to the end of the file) of the share's file
 * `path` from `offset` (path as for hylics_send_file) on the established IPv4 TCP connection
 * `sockfd` itself, from the host; afterwards `sockfd` is the same descriptor, connected as
 * before, with its file status flags (O_NONBLOCK ...) and the options SO_KEEPALIVE,
 * SO_REUSEADDR, TCP_NODELAY, TCP_KEEPIDLE/KEEPINTVL/KEEPCNT and TCP_USER_TIMEOUT as they were.
 * Bytes the peer sent and the program has not read yet stay readable, followed by what the
 * peer sent during the transfer (up to 16 KiB).
 * Needs root or CAP_NET_ADMIN (TCP_REPAIR). Blocks until the transfer is done and the peer
 * acknowledged it; no other thread may use `sockfd` meanwhile. Before the hand-over it waits
 * (up to 10 s) until the peer acknowledged every byte the program wrote on `sockfd`.
 * Returns the number of bytes sent, or -1 with errno set: EBUSY when the send queue did not
 * drain; EAFNOSUPPORT when `sockfd` is no IPv4 TCP socket; ENOTCONN when the connection is not
 * established; EPERM without CAP_NET_ADMIN; ECONNREFUSED (or another connect(2) errno) when
 * there is no vmsight Hylics service; EPROTO when it refused or failed (the library then
 * restores the connection as it was before the call, which is right when nothing was sent);
 * ETIMEDOUT when it did not answer a hold or release in 10 s (the send itself has no time
 * limit); see hylics_last_error() for the sentence. Whatever fails, the connection is released
 * and out of repair mode on return. */
long long hylics_sendfile(int sockfd, const char *path, unsigned long long offset,
                          unsigned long long len);

/* Reports that one task arrived now (request {"op":"arrive"}). Returns 0, or -1 with errno set:
 * the errno of connect(2) when there is no vmsight Hylics service (e.g. ECONNREFUSED,
 * ECONNRESET, ENODEV), ETIMEDOUT when it did not answer within 10 s, EPROTO when it refused
 * (e.g. the VM runs without a controller) or answered something malformed; then
 * hylics_last_error() has the sentence. Cheap enough to call per task: the connection is kept
 * open (and reopened once when it broke). */
int hylics_task_arrived(void);

/* Reports that one task completed, `response_secs` seconds after it arrived (finite, >= 0;
 * EINVAL otherwise; vmsight refuses more than a day, EPROTO). Request
 * {"op":"task","response_secs":R}; returns as hylics_task_arrived. */
int hylics_task_done(double response_secs);

/* Moves out of the share the files vmsight's controller advises (request {"op":"advice"}, the
 * coldest first) into `dest_dir` under the same relative path: /hylics/a/b.dat goes to
 * DEST_DIR/a/b.dat (directories created with mode 0755; an existing file is replaced). Each move
 * copies the file (mode and times kept), fsyncs the copy, checks its size and only then removes
 * the share's file. Advised paths with ".." components, symlinks (also as directories on the
 * way) and anything that is not a regular file are skipped; so are files that vanished or
 * changed during the copy. Asks again after every round that moved something, until the advice
 * is empty (at most 64 rounds). `dest_dir` must not be on the share (EINVAL); it is created
 * when missing (not its parents). The share is $HYLICS_ROOT, default /hylics.
 * Returns the number of files moved, or -1 with errno set (as hylics_task_arrived, or the
 * errno of a failed move; hylics_last_error() says which file). *bytes_moved (may be NULL)
 * gets the bytes moved, also those moved before a failure. */
long hylics_evict(const char *dest_dir, unsigned long long *bytes_moved);

/* The service's last error sentence in this thread ("" if none). */
const char *hylics_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
