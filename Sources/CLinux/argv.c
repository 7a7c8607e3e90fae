// The process's arguments for Swift's `CommandLine`, kept by a constructor.
//
// The Swift runtime finds argv outside main() with a static constructor of its own
// (CommandLine.cpp in libswiftCore): it reads /proc/self/maps line by line with sscanf to find
// the stack, then walks back from `environ`. That is about 50,000 instructions, a file the
// kernel writes out for each reader, and the pages of stdio's scanf, in every process before
// main — a fifth of what a `ctl token` does. glibc passes argc and argv to every constructor, so
// this one keeps them, and defines the two functions of that runtime file: a static link then
// finds them here and leaves the runtime's file, and its constructor, out. (Where the runtime
// is a shared library, its own are internal to it and these are not called.)
#include <stddef.h>

static char **saved_argv;
static int saved_argc;
static char **override_argv;
static int override_argc;

__attribute__((constructor(101))) static void tb_keep_arguments(int argc, char **argv, char **envp) {
    (void)envp;
    saved_argc = argc;
    saved_argv = argv;
}

// The runtime's declarations (stdlib/public/stubs/CommandLine.cpp): Swift's calling convention.
__attribute__((swiftcall)) char **_swift_stdlib_getUnsafeArgvArgc(int *outArgLen);
__attribute__((swiftcall)) void _swift_stdlib_overrideUnsafeArgvArgc(char **argv, int argc);

__attribute__((swiftcall)) char **_swift_stdlib_getUnsafeArgvArgc(int *outArgLen) {
    static char *empty[] = { NULL };
    if (override_argv != NULL) {
        *outArgLen = override_argc;
        return override_argv;
    }
    if (saved_argv == NULL) {
        *outArgLen = 0;
        return empty;
    }
    *outArgLen = saved_argc;
    return saved_argv;
}

__attribute__((swiftcall)) void _swift_stdlib_overrideUnsafeArgvArgc(char **argv, int argc) {
    override_argv = argv;
    override_argc = argc;
}
