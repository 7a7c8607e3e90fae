// libsystemd for Swift: sd_notify, socket activation, the watchdog and the journal.
// (sd_notifyf and sd_journal_send are variadic: format in Swift, use sd_notify and
// sd_journal_sendv.)
#ifndef TOKENBROKER_CSYSTEMD_SHIM_H
#define TOKENBROKER_CSYSTEMD_SHIM_H

#include <systemd/sd-daemon.h>
#include <systemd/sd-journal.h>

#endif
