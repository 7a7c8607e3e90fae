// libsystemd's journal for Swift, loaded on first use.
//
// The daemon speaks the service manager's notification and socket-activation protocols itself
// (sd_notify(3) and sd_listen_fds(3) document them as stable interfaces: a datagram of
// `KEY=VALUE` lines, and LISTEN_PID/LISTEN_FDS), which left only the journal to libsystemd.
// Linking libsystemd.so.0 loaded it and its six dependencies (libgcrypt, liblzma, libzstd,
// liblz4, libcap, libgpg-error) between exec and READY=1 in every start, for nothing the
// start needs. tb_journal_sendv() dlopens libsystemd.so.0 at the first journal entry instead
// (once, thread-safe) and calls its sd_journal_sendv.
#ifndef TOKENBROKER_CSYSTEMD_H
#define TOKENBROKER_CSYSTEMD_H

#include <stddef.h>
#include <sys/uio.h>

/// sd_journal_sendv(iov, n): 0 or a negative errno; -ENOSYS when libsystemd.so.0 could not be
/// loaded (tb_journal_failure() then says why).
int tb_journal_sendv(const struct iovec *iov, int n);

/// Why libsystemd.so.0 could not be loaded ("" while it has not failed).
const char *tb_journal_failure(void);

#endif
