#!/usr/bin/env python3
"""make link-order: writes Sources/tokenbroker/link-order.txt and
Sources/tokenbroker-daemon/link-order.txt, the order in which the linker lays out the functions
and data each executable touches on its short path.

A `ctl token`, a credential helper and a daemon's start to READY=1 each touch a few hundred
functions and a few hundred variables scattered over a 7 MB text and 1 MB of data: each 64 KB
window of code they touch costs a page fault (the kernel maps the page cache around it), and
each 4 KB page of data they write one more. Laid out together (lld's --symbol-ordering-file,
given by `make static`), they share far fewer pages.

What is recorded, by valgrind on the static release build (BINDIR, `make static`'s):
  - callgrind: every function run by `ctl token`, a git credential helper's `get` and a
    daemon's exec -> READY=1 (the dev configuration);
  - lackey: every variable in .data and .bss that `ctl token` and the helper read or write.
The lists hold symbol names only (no addresses, no tokens). A name the code no longer has is
skipped by the linker, so a stale list costs speed, never correctness. Re-run after changes
to those paths.
"""

import bisect
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLI_OUTPUT = os.path.join(ROOT, "Sources", "tokenbroker", "link-order.txt")
DAEMON_OUTPUT = os.path.join(ROOT, "Sources", "tokenbroker-daemon", "link-order.txt")
CONFIG = os.path.join(ROOT, "config", "dev.conf")
DEADLINE = 120


def functions(callgrind_out):
    """The function names of a callgrind profile (run with --demangle=no), first seen first."""
    names = {}
    with open(callgrind_out) as f:
        for line in f:
            m = re.match(r"^c?fn=\(\d+\) (.+)$", line.strip())
            if m:
                name = m.group(1).split("'")[0]
                if not name.startswith("0x") and name != "(below main)":
                    names.setdefault(name, None)
    return list(names)


def variables(binary, lackey_log):
    """The .data/.bss symbols a lackey memory trace touches, by address."""
    symbols = []
    for line in subprocess.run(["nm", "-n", "-S", binary], capture_output=True, text=True, check=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "bBdD":
            symbols.append((int(parts[0], 16), int(parts[1], 16), parts[3]))
    symbols.sort()
    starts = [s[0] for s in symbols]
    touched = {}
    with open(lackey_log) as f:
        for line in f:
            parts = line.split()
            if len(parts) != 2 or parts[0] not in ("L", "S", "M"):
                continue
            address = int(parts[1].split(",")[0], 16)
            i = bisect.bisect_right(starts, address) - 1
            if i >= 0 and symbols[i][0] <= address < symbols[i][0] + max(symbols[i][1], 1):
                touched.setdefault(symbols[i][2], None)
    return list(touched)


def main():
    if len(sys.argv) != 2 or not shutil.which("valgrind"):
        sys.exit("usage: link_order.py BINDIR  (the static release build; needs valgrind)")
    bindir = sys.argv[1]
    scratch = tempfile.mkdtemp(prefix="tb-order-")
    # valgrind cannot read the toolchain's DWARF 5: profile copies without debug information.
    cli, daemon = os.path.join(scratch, "tokenbroker"), os.path.join(scratch, "tokenbroker-daemon")
    subprocess.run(["strip", "--strip-debug", "-o", cli, os.path.join(bindir, "tokenbroker")], check=True)
    subprocess.run(["strip", "--strip-debug", "-o", daemon, os.path.join(bindir, "tokenbroker-daemon")], check=True)
    sock = os.path.join(scratch, "tb.sock")
    serve = [daemon, "serve", "--config", CONFIG, "--socket", sock, "--state-dir", os.path.join(scratch, "state"), "--log-level", "warning"]
    server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE
        while not os.path.exists(sock):
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit("the daemon did not start")
            time.sleep(0.05)
        runs = {"ctl": ([cli, "ctl", "--socket", sock, "token", "demo"], b""),
                "helper": ([cli, "credential", "--socket", sock, "git", "get"], b"protocol=https\nhost=demo.example.test\n\n")}
        cli_order = []
        for name, (command, stdin) in runs.items():
            profile = os.path.join(scratch, f"{name}.callgrind")
            subprocess.run(["valgrind", "--tool=callgrind", "--demangle=no", f"--callgrind-out-file={profile}"] + command,
                           input=stdin, capture_output=True, check=True, timeout=DEADLINE)
            cli_order += functions(profile)
        for name, (command, stdin) in runs.items():
            log = os.path.join(scratch, f"{name}.lackey")
            subprocess.run(["valgrind", "--tool=lackey", "--trace-mem=yes", f"--log-file={log}"] + command,
                           input=stdin, capture_output=True, check=True, timeout=DEADLINE)
            cli_order += variables(cli, log)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=DEADLINE)

    # The daemon from exec to READY=1 (a notify socket of our own), under callgrind.
    notify_path = os.path.join(scratch, "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(DEADLINE)
    profile = os.path.join(scratch, "start.callgrind")
    started = subprocess.Popen(["valgrind", "--tool=callgrind", "--demangle=no", f"--callgrind-out-file={profile}"] + serve,
                               env=dict(os.environ, NOTIFY_SOCKET=notify_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while b"READY=1" not in notify.recv(4096):
            pass
    finally:
        started.send_signal(signal.SIGTERM)
        started.wait(timeout=DEADLINE)
    for output, order in ((CLI_OUTPUT, cli_order), (DAEMON_OUTPUT, functions(profile))):
        names = list(dict.fromkeys(order))
        with open(output, "w") as f:
            f.write("".join(n + "\n" for n in names))
        print(f"{output}: {len(names)} symbols")
    shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
