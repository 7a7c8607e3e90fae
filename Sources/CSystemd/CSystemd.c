// See include/CSystemd.h: libsystemd.so.0, opened at the first journal entry.
#define _GNU_SOURCE
#include "CSystemd.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <systemd/sd-journal.h>

static pthread_once_t once = PTHREAD_ONCE_INIT;
// The header's own declaration checks the pointer's type.
static __typeof__(sd_journal_sendv) *send_entry;
static char failure[256];

static void load(void) {
    void *library = dlopen("libsystemd.so.0", RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        const char *why = dlerror();
        snprintf(failure, sizeof failure, "%s", why ? why : "dlopen(libsystemd.so.0) failed");
        return;
    }
    *(void **)&send_entry = dlsym(library, "sd_journal_sendv");
    if (send_entry == NULL) snprintf(failure, sizeof failure, "libsystemd.so.0 has no sd_journal_sendv");
}

int tb_journal_sendv(const struct iovec *iov, int n) {
    pthread_once(&once, load);
    return send_entry != NULL ? send_entry(iov, n) : -ENOSYS;
}

const char *tb_journal_failure(void) {
    pthread_once(&once, load);
    return failure;
}
