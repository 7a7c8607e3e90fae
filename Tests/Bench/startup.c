// startup: exec -> READY=1 of a Type=notify service, as systemd sees it.
// Usage: startup N NOTIFY_SOCKET_PATH COMMAND [ARG...]
// Binds a datagram socket at NOTIFY_SOCKET_PATH, then N times: spawns COMMAND with
// NOTIFY_SOCKET set, waits (at most 10 s) for a datagram holding a READY=1 line, stops the
// process with SIGTERM and waits for it. Prints {"p50_ms":…,"p90_ms":…,"min_ms":…}.
#define _GNU_SOURCE
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int is_ready(const char *message) {
    return strncmp(message, "READY=1", 7) == 0 || strstr(message, "\nREADY=1") != NULL;
}

int main(int argc, char **argv) {
    if (argc < 4 || atoi(argv[1]) < 1) { fprintf(stderr, "usage: startup N NOTIFY_SOCKET_PATH COMMAND [ARG...]\n"); return 64; }
    int n = atoi(argv[1]);
    const char *path = argv[2];
    struct sockaddr_un address = { .sun_family = AF_UNIX };
    if (strlen(path) >= sizeof address.sun_path) { fprintf(stderr, "socket path too long\n"); return 64; }
    strcpy(address.sun_path, path);
    unlink(path);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&address, sizeof address) < 0) { perror("notify socket"); return 1; }
    setenv("NOTIFY_SOCKET", path, 1);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    double *ms = calloc((size_t)n, sizeof *ms);
    char message[4096];
    for (int i = 0; i < n; i++) {
        double start = now_ms();
        pid_t pid;
        if (posix_spawn(&pid, argv[3], &actions, NULL, argv + 3, environ) != 0) { perror(argv[3]); return 1; }
        int ready = 0;
        while (!ready) {
            struct pollfd p = { .fd = fd, .events = POLLIN };
            int left = (int)(start + 10000 - now_ms());
            if (left <= 0 || poll(&p, 1, left) <= 0) break;
            ssize_t got = recv(fd, message, sizeof message - 1, 0);
            if (got < 0) break;
            message[got] = 0;
            ready = is_ready(message);
        }
        ms[i] = now_ms() - start;
        kill(pid, SIGTERM);
        int status;
        waitpid(pid, &status, 0);
        if (!ready) { fprintf(stderr, "no READY=1 within 10 s\n"); return 1; }
        // Drain what the stop sent (STOPPING=1, STATUS=...).
        while (recv(fd, message, sizeof message, MSG_DONTWAIT) > 0) {}
    }
    unlink(path);
    qsort(ms, (size_t)n, sizeof *ms, compare);
    printf("{\"p50_ms\":%.3f,\"p90_ms\":%.3f,\"min_ms\":%.3f}\n", ms[n / 2], ms[n * 9 / 10], ms[0]);
    return 0;
}
