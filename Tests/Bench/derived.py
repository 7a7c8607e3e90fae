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
  - the same for eight sessions derived by refresh (`r0`..`r7`, Derivation=refresh: the parent's
    refresh token redeemed with the resource, in the parent's one lineage): 8 redemptions, 0 replays;
  - 1,000 mixed demands from 16 threads (GetToken and Recover on the derived sessions of both
    kinds, Recover of the parent's current token, which rotates its refresh token): replays (the
    goal: 0);
  - the parent's logout while 8 derivations are in flight (7 exchanges and a redemption by
    refresh, answered by the issuer, their answers held) and 7 redemptions queued in the lineage:
    how long the logout takes, every derived demand SignedOut, none installed after it, no
    derived token alive at the issuer (revoked with the parent's grant).

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
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import Server, build_tools, load  # noqa: E402
from fleet import call, eventually, spawn  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", "3"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "2"))
LIFETIME = int(os.environ.get("DERIVED_LIFETIME", "3"))
DEMANDS = int(os.environ.get("DERIVED_DEMANDS", "1000"))
DERIVED = [f"d{i}" for i in range(8)]
REFRESHED = [f"r{i}" for i in range(8)]


def dev(base, method, path):
    request = urllib.request.Request(base + path, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.load(answer)


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
""" for index, name in enumerate(DERIVED)) + "".join(f"""
[Session]
Name={name}
DerivedFrom=api
Derivation=refresh
Resource=https://s{index}.example/
RefreshAhead=0
RefreshLimitBurst=10000
""" for index, name in enumerate(REFRESHED))
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
RevocationEndpoint={base}/revoke
AllowResources=https://key.example/
{derived}""")
    socket_path = f"{work}/tokenbroker.sock"
    server = Server([os.path.join(bin_dir, "tokenbroker"), "serve", "--config", f"{work}/tokenbroker.conf",
                     "--socket", socket_path, "--state-dir", f"{work}/state"], socket_path)
    eventually("the refresh token file", lambda: os.path.exists(f"{work}/refresh-token"))
    with open(f"{work}/refresh-token") as f:
        _, error = call(socket_path, "Login", {"session": "api", "refreshToken": f.read().strip()})
    assert error is None, error
    for name in DERIVED + REFRESHED:
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
    time.sleep(LIFETIME + 1)
    before = counters(base)
    processes = [subprocess.Popen([os.path.join(bin_dir, "tokenbroker"), "ctl", "--socket", socket_path, "token", REFRESHED[i % 8]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(64)]
    failed = [p for p in processes if p.wait(timeout=120) != 0]
    after = counters(base)
    narrowed = after['narrowed_refresh'] - before['narrowed_refresh']
    print(f"64 ctl processes x 8 sessions derived by refresh, all tokens expired: {len(failed)} failed, "
          f"{narrowed} redemptions with a resource (goal 8), "
          f"{after['refresh_token'] - before['refresh_token'] - narrowed} parent refreshes, {after['replays'] - before['replays']} replays (goal 0)")

    # Mixed demands on a rotating parent.
    before = counters(base)
    errors = []
    lock = threading.Lock()

    def worker(count):
        for _ in range(count):
            kind = random.random()
            session = random.choice(DERIVED + REFRESHED)
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
          f"{after['narrowed_refresh'] - before['narrowed_refresh']} redemptions with a resource, "
          f"{after['refresh_token'] - before['refresh_token']} refresh grants in all, {after['replays'] - before['replays']} replays (goal 0)")

    # The parent's logout with 8 derivations in flight upstream: 7 exchanges and one redemption
    # by refresh answered by the issuer and their answers held, 7 more redemptions queued behind
    # that one in the parent's lineage. (Eight, not more, in flight: the daemon opens at most 8
    # connections to one host.) Tokens minted from here live long, so "none alive" is the
    # revocation's doing, not their expiry.
    dev(base, "POST", "/_dev/lifetime?seconds=600")
    call(socket_path, "Recover", {"session": "api", "rejected": call(socket_path, "GetToken", {"session": "api"})[0]["token"]})
    exchanged, redeemed = DERIVED[:7], REFRESHED
    everyone = exchanged + redeemed
    current = {name: call(socket_path, "GetToken", {"session": name})[0]["token"] for name in everyone}
    before = counters(base)
    dev(base, "POST", "/_dev/hold?count=7&grant=" + urllib.parse.quote("urn:ietf:params:oauth:grant-type:token-exchange", safe=""))
    dev(base, "POST", "/_dev/hold?count=1&grant=refresh_token")
    replies = {}

    def recover(name):
        try:
            replies[name] = call(socket_path, "Recover", {"session": name, "rejected": current[name]})[1]
        except OSError as e:
            replies[name] = repr(e)

    threads = [threading.Thread(target=recover, args=(name,)) for name in everyone]
    for thread in threads:
        thread.start()
    eventually("7 exchanges and 1 redemption held", lambda: dev(base, "GET", "/_dev/held")["held"] == 8)
    started = time.monotonic()
    _, error = call(socket_path, "Logout", {"session": "api"})
    took = time.monotonic() - started
    dev(base, "POST", "/_dev/release")
    for thread in threads:
        thread.join(timeout=60)
    signed_out = sum(1 for name in everyone if replies.get(name) == "io.tokenbroker.Broker.SignedOut")
    served = sum(1 for name in everyone if call(socket_path, "GetToken", {"session": name})[1] != "io.tokenbroker.Broker.SignedOut")
    resources = [f"https://r{index}.example/" for index in range(7)] + [f"https://s{index}.example/" for index in range(8)]
    started = time.monotonic()
    while True:
        live = sum(dev(base, "GET", "/_dev/live?target=" + urllib.parse.quote(r, safe=""))["live"] for r in resources)
        if live == 0 or time.monotonic() - started > 5:
            break
        time.sleep(0.02)
    after = counters(base)
    print(f"parent logout with 8 derivations in flight (7 exchanges, 1 redemption by refresh) and 7 redemptions queued: "
          f"{error or 'ok'} in {took * 1000:.1f} ms; {signed_out}/15 demands SignedOut (goal 15), {served} derived sessions "
          f"served after it (goal 0), {live} derived tokens alive at the issuer {time.monotonic() - started:.2f} s after it (goal 0), "
          f"{after['narrowed_refresh'] - before['narrowed_refresh']} redemptions (goal 1: the queued ones never start), "
          f"{after['revocation'] - before['revocation']} revocations, {after['replays'] - before['replays']} replays (goal 0)")
    server.stop()


if __name__ == "__main__":
    main()
