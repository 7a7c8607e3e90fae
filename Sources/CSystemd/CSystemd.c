// See include/CSystemd.h: libsystemd.so.0, opened for the journal.
#define _GNU_SOURCE
#include "CSystemd.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <systemd/sd-journal.h>
#include <time.h>

// The header's own declaration checks the pointer's type. Set once, under `loading`; read
// with acquire once set.
static __typeof__(sd_journal_sendv) *send_entry;
static pthread_mutex_t loading = PTHREAD_MUTEX_INITIALIZER;
static char failure[256];
static struct timespec failed_at;
static int failed;

// A load that failed is tried again, at most every ten seconds: a failure may be passing (no
// descriptor free), and a missing library must not cost a search per entry.
int tb_journal_load(void) {
    if (__atomic_load_n(&send_entry, __ATOMIC_ACQUIRE) != NULL) return 0;
    pthread_mutex_lock(&loading);
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (send_entry == NULL && (!failed || now.tv_sec - failed_at.tv_sec >= 10)) {
        void *library = dlopen("libsystemd.so.0", RTLD_NOW | RTLD_LOCAL);
        void *found = library != NULL ? dlsym(library, "sd_journal_sendv") : NULL;
        if (found != NULL) {
            __typeof__(sd_journal_sendv) *resolved;
            *(void **)&resolved = found;
            __atomic_store_n(&send_entry, resolved, __ATOMIC_RELEASE);
            failure[0] = 0;
        } else {
            const char *why = library == NULL ? dlerror() : "libsystemd.so.0 has no sd_journal_sendv";
            snprintf(failure, sizeof failure, "%s", why ? why : "dlopen(libsystemd.so.0) failed");
            if (library != NULL) dlclose(library);
            failed = 1;
            failed_at = now;
        }
    }
    int result = send_entry != NULL ? 0 : -1;
    pthread_mutex_unlock(&loading);
    return result;
}

int tb_journal_sendv(const struct iovec *iov, int n) {
    __typeof__(sd_journal_sendv) *send = __atomic_load_n(&send_entry, __ATOMIC_ACQUIRE);
    if (send == NULL) {
        if (tb_journal_load() != 0) return -ENOSYS;
        send = __atomic_load_n(&send_entry, __ATOMIC_ACQUIRE);
    }
    return send(iov, n);
}

void tb_journal_failure(char *reason, size_t size) {
    pthread_mutex_lock(&loading);
    if (size > 0) snprintf(reason, size, "%s", failure);
    pthread_mutex_unlock(&loading);
}
