// libsystemd's journal for Swift, loaded when it is needed.
//
// The daemon speaks the service manager's notification and socket-activation protocols itself
// (sd_notify(3) and sd_listen_fds(3) document them as stable interfaces: a datagram of
// `KEY=VALUE` lines, and LISTEN_PID/LISTEN_FDS), which left only the journal to libsystemd.
// Linking libsystemd.so.0 loaded it and its six dependencies (libgcrypt, liblzma, libzstd,
// liblz4, libcap, libgpg-error) between exec and READY=1 in every start, for nothing the
// start needs. libsystemd.so.0 is opened for the journal instead: by the daemon just after
// READY=1, or at an earlier entry.
#ifndef TOKENBROKER_CSYSTEMD_H
#define TOKENBROKER_CSYSTEMD_H

#include <stddef.h>
#include <sys/uio.h>

/// Opens libsystemd.so.0 and finds sd_journal_sendv (thread-safe). 0, or -1: a failed load is
/// tried again by a call at least ten seconds later.
int tb_journal_load(void);

/// sd_journal_sendv(iov, n) (loading the library first if need be): 0 or a negative errno;
/// -ENOSYS when libsystemd.so.0 could not be loaded.
int tb_journal_sendv(const struct iovec *iov, int n);

/// Why libsystemd.so.0 could not be loaded, into `reason` ("" while it has not failed).
void tb_journal_failure(char *reason, size_t size);

#endif
