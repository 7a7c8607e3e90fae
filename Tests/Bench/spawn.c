// spawn: the cost of running a command once, as a script would: fork + exec + wait.
// Usage: spawn N COMMAND [ARG...]   Prints {"p50_ms":…,"p90_ms":…,"p99_ms":…,"min_ms":…} over N runs;
// exits 1 if any run fails. Output of the command goes to /dev/null.
#define _GNU_SOURCE
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>

extern char **environ;

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 3 || atoi(argv[1]) < 1) { fprintf(stderr, "usage: spawn N COMMAND [ARG...]\n"); return 64; }
    int n = atoi(argv[1]);
    double *ms = calloc((size_t)n, sizeof *ms);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    for (int i = 0; i < n; i++) {
        struct timespec start, end;
        clock_gettime(CLOCK_MONOTONIC, &start);
        pid_t pid;
        if (posix_spawn(&pid, argv[2], &actions, NULL, argv + 2, environ) != 0) { perror(argv[2]); return 1; }
        int status;
        if (waitpid(pid, &status, 0) < 0) { perror("waitpid"); return 1; }
        clock_gettime(CLOCK_MONOTONIC, &end);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) { fprintf(stderr, "%s failed (status %d)\n", argv[2], status); return 1; }
        ms[i] = (double)(end.tv_sec - start.tv_sec) * 1e3 + (double)(end.tv_nsec - start.tv_nsec) / 1e6;
    }
    qsort(ms, (size_t)n, sizeof *ms, compare);
    printf("{\"p50_ms\":%.3f,\"p90_ms\":%.3f,\"p99_ms\":%.3f,\"min_ms\":%.3f}\n", ms[n / 2], ms[n * 9 / 10], ms[n * 99 / 100], ms[0]);
    return 0;
}
