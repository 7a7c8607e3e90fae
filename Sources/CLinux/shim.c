#define _GNU_SOURCE
#include <sys/xattr.h>
#include <errno.h>
#include <stddef.h>
#include <sys/auxv.h>
#include <sys/ioctl.h>
#include <malloc.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include "CLinux.h"

int tb_has_dynamic_loader(void) { return getauxval(AT_BASE) != 0; }

int tb_terminal_columns(int fd) {
    struct winsize size;
    return ioctl(fd, TIOCGWINSZ, &size) == 0 ? size.ws_col : 0;
}

int tb_terminal_rows(int fd) {
    struct winsize size;
    return ioctl(fd, TIOCGWINSZ, &size) == 0 ? size.ws_row : 0;
}

int tb_accept_nonblocking(int listen_fd) {
    return accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
}

int tb_peer_credentials(int fd, int32_t *pid, uint32_t *uid, uint32_t *gid) {
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return -1;
    *pid = cred.pid;
    *uid = cred.uid;
    *gid = cred.gid;
    return 0;
}

int tb_peer_groups(int fd, uint32_t *groups, int capacity, int *count) {
    socklen_t len = (socklen_t)(capacity * (int)sizeof(gid_t));
    int rc = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
    *count = (int)(len / sizeof(gid_t));
    return rc;
}

void tb_epoll_event_set(struct epoll_event *event, uint32_t events, uint64_t data) {
    event->events = events;
    event->data.u64 = data;
}

uint32_t tb_epoll_event_events(const struct epoll_event *event) { return event->events; }

uint64_t tb_epoll_event_data(const struct epoll_event *event) { return event->data.u64; }

int tb_set_undumpable(void) { return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); }

int tb_is_dumpable(void) { return prctl(PR_GET_DUMPABLE, 0, 0, 0, 0); }

int tb_limit_malloc_arenas(int count) { return mallopt(M_ARENA_MAX, count); }

int tb_fsetxattr(int fd, const char *name, const void *value, size_t size) {
    return fsetxattr(fd, name, value, size, 0);
}
