#!/usr/bin/env python3
"""make bench-scale: what many sessions cost (release build, `Upstream=test` sessions, one run each).

For each session count it prints:
  - exec -> READY=1 and exec -> first Status answered, cold (no state database) and warm (the
    database the cold start wrote);
  - one Status call with every session in it (the median of a few);
  - a reload (SIGHUP -> READY=1) that changes one session, and one that adds one;
  - resident memory, and per session over the first count;
  - CPU used while idle for IDLE seconds.
The goals for 10,000 sessions (issue 23): READY <= 1 s cold and warm, a reload changing one
session <= 50 ms, idle CPU about 0, Status <= 20 ms.

Knobs (environment): SCALE_SESSIONS ("1 1000 10000"), SCALE_IDLE (seconds, 5),
SCALE_STATUS (Status calls, 5).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "PyCommon"))
from checks import stop  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
COUNTS = [int(c) for c in os.environ.get("SCALE_SESSIONS", "1 1000 10000").split()]
IDLE = float(os.environ.get("SCALE_IDLE", "5"))
STATUS_CALLS = int(os.environ.get("SCALE_STATUS", "5"))
TICKS = os.sysconf("SC_CLK_TCK")
DEADLINE = 120


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_kib(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1])
    return 0


def write_config(path, count, changed=0, extra=0):
    """`count` test sessions; the first `changed` of them with another token lifetime, plus `extra` more."""
    with open(path, "w") as f:
        for i in range(count + extra):
            lifetime = "2h" if i < changed else "1h"
            f.write(f"[Session]\nName=s{i}\nUpstream=test\nTestTokenLifetime={lifetime}\n\n")


def call(path, method, timeout=30):
    """One varlink call on a fresh connection; returns (seconds, reply)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        started = time.monotonic()
        s.sendall(json.dumps({"method": method}).encode() + b"\0")
        data = b""
        while not data.endswith(b"\0"):
            chunk = s.recv(1 << 20)
            if not chunk:
                raise RuntimeError(f"{method}: connection closed")
            data += chunk
        return time.monotonic() - started, json.loads(data[:-1])


class Notify:
    """The notify socket systemd would hold: READY=1, RELOADING=1 datagrams."""

    def __init__(self, path):
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(path)

    def wait_for(self, word, process, deadline=DEADLINE):
        end = time.monotonic() + deadline
        while True:
            left = end - time.monotonic()
            if left <= 0 or process.poll() is not None:
                sys.exit(f"scale: no {word} (daemon {'exited' if process.poll() is not None else 'silent'})")
            self.socket.settimeout(left)
            try:
                message = self.socket.recv(65536).decode()
            except socket.timeout:
                continue
            if word in message.split("\n"):
                return time.monotonic()


def start(daemon, config, scratch, state, notify):
    socket_path = os.path.join(scratch, "tb.sock")
    env = dict(os.environ, NOTIFY_SOCKET=notify.path)
    started = time.monotonic()
    process = subprocess.Popen([daemon, "serve", "--config", config, "--socket", socket_path, "--state-dir", state,
                                "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ready = notify.wait_for("READY=1", process)
    seconds, reply = call(socket_path, "io.tokenbroker.Broker.Status")
    answered = time.monotonic()
    if "parameters" not in reply:
        sys.exit(f"scale: Status failed: {reply}")
    return process, socket_path, ready - started, answered - started


def reload(process, notify):
    started = time.monotonic()
    process.send_signal(signal.SIGHUP)
    notify.wait_for("RELOADING=1", process)
    return notify.wait_for("READY=1", process) - started


def measure(daemon, scratch, count):
    config = os.path.join(scratch, f"scale-{count}.conf")
    state = os.path.join(scratch, f"state-{count}")
    write_config(config, count)
    notify = Notify(os.path.join(scratch, f"notify-{count}.sock"))
    row = {}
    process, socket_path, row["cold_ready"], row["cold_status"] = start(daemon, config, scratch, state, notify)
    status = []
    for _ in range(STATUS_CALLS):
        seconds, reply = call(socket_path, "io.tokenbroker.Broker.Status")
        status.append(seconds)
        if len(reply["parameters"]["sessions"]) != count:
            sys.exit(f"scale: Status lists {len(reply['parameters']['sessions'])} sessions, not {count}")
    row["status"] = sorted(status)[len(status) // 2]
    time.sleep(1)
    before = cpu_seconds(process.pid)
    time.sleep(IDLE)
    row["idle_cpu"] = cpu_seconds(process.pid) - before
    row["rss"] = rss_kib(process.pid)
    write_config(config, count, changed=1)
    row["reload_change"] = reload(process, notify)
    write_config(config, count, changed=1, extra=1)
    row["reload_add"] = reload(process, notify)
    write_config(config, count)
    stop(process)
    process, socket_path, row["warm_ready"], row["warm_status"] = start(daemon, config, scratch, state, notify)
    stop(process)
    return row


def main():
    bin_dir = sys.argv[1] if len(sys.argv) > 1 else subprocess.run(
        ["swift", "build", "-c", "release", "--show-bin-path"], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    daemon = os.path.join(bin_dir, "tokenbroker-daemon")
    scratch = tempfile.mkdtemp(prefix="tb-scale-")
    print(f"# {os.cpu_count()} CPUs, {os.uname().release}; Upstream=test sessions, one run each; idle CPU over {IDLE:g} s")
    print(f"{'sessions':>8} {'READY cold':>10} {'READY warm':>10} {'1st Status':>10} {'Status':>8} "
          f"{'reload ±1':>9} {'reload +1':>9} {'RSS MiB':>7} {'idle CPU':>8}")
    rows = {}
    try:
        for count in COUNTS:
            row = measure(daemon, scratch, count)
            rows[count] = row
            print(f"{count:>8} {row['cold_ready'] * 1e3:>8.0f}ms {row['warm_ready'] * 1e3:>8.0f}ms {row['cold_status'] * 1e3:>8.0f}ms "
                  f"{row['status'] * 1e3:>6.1f}ms {row['reload_change'] * 1e3:>7.1f}ms {row['reload_add'] * 1e3:>7.1f}ms "
                  f"{row['rss'] / 1024:>7.1f} {row['idle_cpu']:>7.2f}s", flush=True)
    finally:
        subprocess.run(["rm", "-rf", scratch])
    if len(rows) >= 2:
        low, high = min(rows), max(rows)
        per = (rows[high]["rss"] - rows[low]["rss"]) / (high - low)
        print(f"memory per session: {per:.2f} KiB ({low} -> {high} sessions)")


if __name__ == "__main__":
    main()
