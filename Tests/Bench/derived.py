#!/usr/bin/env python3
"""make bench-derived: the figures of derived sessions (issue 35), on real processes.

Starts the development issuer (`dev-issuer`, access tokens that live DERIVED_LIFETIME seconds)
and a broker with a parent session `api` and eight sessions derived from it (`d0`..`d7`, each
narrowed to a resource of its own, RFC 8693 token exchange). Prints:
  - GetToken on a derived session against the parent, at 1 and 16 connections, alternated run
    by run, medians: req/s and the ratio (the goal: within 10 %);
  - after every token has expired, 64 `tokenbroker ctl token` processes at once, eight per
    derived session: the exchanges at the issuer (the goal: exactly 8) and the parent's refreshes
    (its one flight), and refresh token replays the issuer saw (the goal: 0);
  - 1,000 mixed demands from 16 threads (GetToken and Recover on the derived sessions, Recover
    of the parent's current token, which rotates its refresh token): replays (the goal: 0).

Knobs (environment): BENCH_RUNS (3), BENCH_SECONDS (2), DERIVED_LIFETIME (3), DERIVED_DEMANDS (1000).
"""

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import Server, build_tools, load  # noqa: E402
from fleet import call, eventually, spawn  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", "3"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "2"))
LIFETIME = int(os.environ.get("DERIVED_LIFETIME", "3"))
DEMANDS = int(os.environ.get("DERIVED_DEMANDS", "1000"))
DERIVED = [f"d{i}" for i in range(8)]


def counters(base):
    with urllib.request.urlopen(base + "/_dev/counters", timeout=5) as answer:
        return json.load(answer)


def message(session, resource=None):
    parameters = {"session": session}
    if resource:
        parameters["resource"] = resource
    return json.dumps({"method": "io.tokenbroker.Broker.GetToken", "parameters": parameters}, separators=(",", ":"))


def main():
    bin_dir = sys.argv[1]
    tools = build_tools(os.path.join(tempfile.gettempdir(), "tb-bench-tools"))
    work = tempfile.mkdtemp(prefix="tb-derived-")
    with open(os.open(f"{work}/client-secret", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("dev-secret\n")
    issuer = spawn([os.path.join(bin_dir, "dev-issuer"), "--client-secret-file", f"{work}/client-secret",
                    "--refresh-token-file", f"{work}/refresh-token", "--access-token-lifetime", str(LIFETIME)],
                   stdout=subprocess.PIPE, text=True)
    base = issuer.stdout.readline().split()[1]
    derived = "".join(f"""
[Session]
Name={name}
DerivedFrom=api
Resource=https://r{index}.example/
RefreshAhead=0
RefreshLimitBurst=10000
""" for index, name in enumerate(DERIVED))
    with open(f"{work}/tokenbroker.conf", "w") as f:
        f.write(f"""[Broker]
SocketMode=0600

[Session]
Name=api
TokenEndpoint={base}/token
ClientID=tokenbroker
ClientSecretFile={work}/client-secret
RefreshAhead=0
RefreshLimitBurst=10000
AllowResources=https://key.example/
{derived}""")
    socket_path = f"{work}/tokenbroker.sock"
    server = Server([os.path.join(bin_dir, "tokenbroker"), "serve", "--config", f"{work}/tokenbroker.conf",
                     "--socket", socket_path, "--state-dir", f"{work}/state"], socket_path)
    eventually("the refresh token file", lambda: os.path.exists(f"{work}/refresh-token"))
    with open(f"{work}/refresh-token") as f:
        _, error = call(socket_path, "Login", {"session": "api", "refreshToken": f.read().strip()})
    assert error is None, error
    for name in DERIVED:
        _, error = call(socket_path, "GetToken", {"session": name})
        assert error is None, (name, error)

    # GetToken: derived against plain, alternated. (The tokens live LIFETIME seconds: each run
    # may include one refresh of each, as both sides do.)
    _, error = call(socket_path, "GetToken", {"session": "api", "resource": "https://key.example/"})
    assert error is None, error
    print("GetToken: derived session d0, and api's key resource=https://key.example/, against api itself (medians of", RUNS, "runs):")
    messages = {"api": message("api"), "d0": message("d0"), "key": message("api", "https://key.example/")}
    for conns in (1, 16):
        runs = {name: [] for name in messages}
        for _ in range(RUNS):
            for name, text in messages.items():
                runs[name].append(load(tools, server, conns, seconds=SECONDS, message=text))
        med = {name: {key: statistics.median(run[key] for run in runs[name]) for key in ("req_per_s", "cpu_us", "errors")}
               for name in runs}
        plain = med["api"]
        line = f"  {conns:>2} connections: api {plain['req_per_s']:,.0f} req/s {plain['cpu_us']:.1f} us CPU/req"
        for name in ("d0", "key"):
            m = med[name]
            line += (f"; {name} {m['req_per_s']:,.0f} req/s {m['cpu_us']:.1f} us CPU/req, ratio {m['req_per_s'] / plain['req_per_s']:.3f} (req/s) "
                     f"{m['cpu_us'] / max(plain['cpu_us'], 0.001):.3f} (CPU)")
        errors = sum(med[name]["errors"] for name in med)
        print(line + f"; errors {errors:.0f}")

    # After expiry: 64 processes, 8 per derived session.
    time.sleep(LIFETIME + 1)   # every token has expired (the bench measures expiry; no test waits so)
    before = counters(base)
    processes = [subprocess.Popen([os.path.join(bin_dir, "tokenbroker"), "ctl", "--socket", socket_path, "token", DERIVED[i % 8]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(64)]
    failed = [p for p in processes if p.wait(timeout=120) != 0]
    after = counters(base)
    print(f"64 ctl processes x 8 derived sessions, all tokens expired: {len(failed)} failed, "
          f"{after['token_exchange'] - before['token_exchange']} exchanges (goal 8), "
          f"{after['refresh_token'] - before['refresh_token']} parent refreshes, {after['replays'] - before['replays']} replays")

    # Mixed demands on a rotating parent.
    before = counters(base)
    errors = []
    lock = threading.Lock()

    def worker(count):
        for _ in range(count):
            kind = random.random()
            session = random.choice(DERIVED)
            if kind < 0.6:
                _, error = call(socket_path, "GetToken", {"session": session})
            else:
                target = "api" if kind > 0.9 else session
                parameters, error = call(socket_path, "GetToken", {"session": target})
                if error is None:
                    _, error = call(socket_path, "Recover", {"session": target, "rejected": parameters["token"]})
            if error is not None:
                with lock:
                    errors.append(error)

    threads = [threading.Thread(target=worker, args=(DEMANDS // 16 + (1 if index < DEMANDS % 16 else 0),)) for index in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    after = counters(base)
    print(f"{DEMANDS} mixed demands on a rotating parent (16 threads): {len(errors)} errors "
          f"({', '.join(sorted(set(errors))) or 'none'}), {after['token_exchange'] - before['token_exchange']} exchanges, "
          f"{after['refresh_token'] - before['refresh_token']} parent refreshes, {after['replays'] - before['replays']} replays (goal 0)")
    server.stop()


if __name__ == "__main__":
    main()
