// Linux system calls that Swift's Glibc module does not expose (epoll, eventfd) or hides
// behind _GNU_SOURCE (accept4, struct ucred, SO_PEERGROUPS). Thin wrappers, no logic.
#ifndef TOKENBROKER_CLINUX_H
#define TOKENBROKER_CLINUX_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>

/// accept4 with SOCK_NONBLOCK | SOCK_CLOEXEC.
int tb_accept_nonblocking(int listen_fd);

/// The peer's pid, uid and gid (SO_PEERCRED). Returns 0 or -1 with errno.
int tb_peer_credentials(int fd, int32_t *pid, uint32_t *uid, uint32_t *gid);

/// The peer's supplementary groups at connect time (SO_PEERGROUPS). Fills up to `capacity`
/// entries and stores the total count in `*count`. Returns 0, or -1 with errno (ERANGE when
/// `capacity` is too small; `*count` then holds the needed size).
int tb_peer_groups(int fd, uint32_t *groups, int capacity, int *count);

/// epoll_event accessors (the struct is packed on x86_64).
void tb_epoll_event_set(struct epoll_event *event, uint32_t events, uint64_t data);
uint32_t tb_epoll_event_events(const struct epoll_event *event);
uint64_t tb_epoll_event_data(const struct epoll_event *event);

/// prctl(PR_SET_DUMPABLE, 0): no core file, no ptrace attach and no /proc/PID/mem or environ
/// reads by the same uid. prctl is variadic, so Swift cannot call it. Returns 0 or -1 with errno.
int tb_set_undumpable(void);

/// prctl(PR_GET_DUMPABLE): 1 when the process may dump core, 0 when not, -1 with errno.
int tb_is_dumpable(void);

/// mallopt(M_ARENA_MAX, count): at most `count` malloc arenas (<malloc.h>, which Glibc's module
/// leaves out). 1 when it took.
int tb_limit_malloc_arenas(int count);

/// The width of the terminal `fd` is, in columns (ioctl TIOCGWINSZ, variadic in C); 0 when it
/// is not a terminal or does not say.
int tb_terminal_columns(int fd);

/// The height of the terminal `fd` is, in rows; 0 when it is not a terminal or does not say.
int tb_terminal_rows(int fd);

/// 1 when a dynamic loader is mapped into this process (getauxval(AT_BASE)), 0 in a static
/// executable.
int tb_has_dynamic_loader(void);

/// fsetxattr(2) (from <sys/xattr.h>, which Swift's Glibc module leaves out): sets extended
/// attribute `name` (a POSIX ACL: "system.posix_acl_access") on `fd`. 0 or -1 with errno.
int tb_fsetxattr(int fd, const char *name, const void *value, size_t size);

#endif
