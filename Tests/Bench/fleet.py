#!/usr/bin/env python3
"""make bench-fleet: the figures of fleet mode, on real processes.

Starts a 3-member etcd cluster on loopback, the development issuer (`dev-issuer`) and two
brokers, A and B, sharing session `api` (Fleet=yes); A also serves `local`, a session of its
own (Upstream=test). Prints:
  - token propagation: A's refresh committed (its Recover answered) -> B's GetToken returns the
    new token, p50/p99 over FLEET_ROUNDS refreshes (B polls its socket);
  - etcd requests per refresh, fleet-wide, by gRPC method (summed over the members'
    grpc_server_handled_total, before and after the rounds) and the issuer's token requests;
  - GetToken throughput on A, fleet session vs local session, 16 connections, alternated, medians;
  - at scale, a third broker C with FLEET_SESSIONS fleet sessions (each logged in once, so that
    etcd holds a sealed state for each): exec -> READY=1 (every session's first read applied
    before it), against the same broker with as many local sessions, the etcd requests its start
    made, and that every session is active and healthy right after READY=1;
  - the etcd requests made fleet-wide in an idle window of FLEET_IDLE_SECONDS, all three brokers
    running (grpc_server_started_total and grpc_server_handled_total summed over the members, by
    method: a long-lived watch stream counts as started once, and as handled when it ends).

Knobs (environment): FLEET_ROUNDS (50), BENCH_RUNS (3), BENCH_SECONDS (2), FLEET_SESSIONS (1000;
0 leaves the scale part out), FLEET_IDLE_SECONDS (65), FLEET_SEED_BIN (the build whose daemon logs
the sessions in before the measured start, in a state directory of its own: the measured build by
default; an earlier build that cannot log 1,000 fleet sessions in is measured on states another
one wrote).
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "PyCommon"))
from bench import RUNNING, Server, build_tools, load, pin  # noqa: E402
from checks import stop  # noqa: E402

ROUNDS = int(os.environ.get("FLEET_ROUNDS", "50"))
RUNS = int(os.environ.get("BENCH_RUNS", "3"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "2"))
SESSIONS = int(os.environ.get("FLEET_SESSIONS", "1000"))
IDLE_SECONDS = float(os.environ.get("FLEET_IDLE_SECONDS", "65"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv, **kwargs):
    process = subprocess.Popen(argv, **kwargs)
    RUNNING.append(process)
    return process


def call(path, method, parameters):
    """One varlink call on a new connection; returns (parameters, error)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(json.dumps({"method": "io.tokenbroker.Broker." + method, "parameters": parameters}).encode() + b"\0")
        data = b""
        while not data.endswith(b"\0"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data.rstrip(b"\0"))
    return reply.get("parameters", {}), reply.get("error")


def eventually(what, check, timeout=30):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            sys.exit(f"bench-fleet: timed out waiting for {what}")
        time.sleep(0.005)


def etcd_requests(urls, counter="grpc_server_handled_total"):
    """`counter` by method, summed over the members."""
    totals = {}
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith(counter + "{"):
                    labels, value = line.rsplit(" ", 1)
                    method = labels.split('grpc_method="', 1)[1].split('"', 1)[0]
                    totals[method] = totals.get(method, 0) + float(value)
    return totals


def main():
    bin_dir = sys.argv[1]
    tools = build_tools(os.path.join(tempfile.gettempdir(), "tb-bench-tools"))
    work = tempfile.mkdtemp(prefix="tb-fleet-")
    print(f"# work directory {work}", file=sys.stderr)
    ports = [free_port() for _ in range(6)]
    clients = [f"http://127.0.0.1:{ports[2 * i]}" for i in range(3)]
    peers = [f"http://127.0.0.1:{ports[2 * i + 1]}" for i in range(3)]
    initial = ",".join(f"m{i}={peers[i]}" for i in range(3))
    for i in range(3):
        spawn(["etcd", "--name", f"m{i}", "--data-dir", f"{work}/m{i}", "--listen-client-urls", clients[i],
               "--advertise-client-urls", clients[i], "--listen-peer-urls", peers[i], "--initial-advertise-peer-urls", peers[i],
               "--initial-cluster", initial, "--initial-cluster-state", "new", "--log-level", "warn"],
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Secret files readable by their owner only (the daemon refuses one every user may read).
    with open(os.open(f"{work}/client-secret", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("dev-secret\n")
    with open(os.open(f"{work}/fleet.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(os.urandom(32).hex())
    issuer = spawn([os.path.join(bin_dir, "dev-issuer"), "--client-secret-file", f"{work}/client-secret",
                    "--refresh-token-file", f"{work}/refresh-token"], stdout=subprocess.PIPE, text=True)
    base = issuer.stdout.readline().split()[1]
    eventually("etcd", lambda: all(_answers(url) for url in clients))

    brokers = {}
    for name in ("a", "b"):
        with open(f"{work}/{name}.conf", "w") as f:
            f.write(f"""[Broker]
SocketMode=0600

[Fleet]
Endpoints={' '.join(clients)}
KeyFile={work}/fleet.key
Name=host-{name}

[Session]
Name=api
Fleet=yes
TokenEndpoint={base}/token
ClientID=tokenbroker
ClientSecretFile={work}/client-secret
RefreshLimitBurst=10000

[Session]
Name=local
Upstream=test
""")
        path = f"{work}/{name}.sock"
        brokers[name] = Server([os.path.join(bin_dir, "tokenbroker"), "serve", "--config", f"{work}/{name}.conf",
                                "--socket", path, "--state-dir", f"{work}/{name}-state"], path)
    a, b = brokers["a"].socket, brokers["b"].socket
    eventually("the refresh token file", lambda: os.path.exists(f"{work}/refresh-token"))
    with open(f"{work}/refresh-token") as f:
        _, error = call(a, "Login", {"session": "api", "refreshToken": f.read().strip()})
    assert error is None, error
    current = call(a, "GetToken", {"session": "api"})[0]["token"]
    eventually("B follows the login", lambda: call(b, "GetToken", {"session": "api"})[0].get("token") == current)

    # Propagation: A refreshes; how long until B hands out the new token?
    before_etcd = etcd_requests(clients)
    before_issuer = json.load(urllib.request.urlopen(base + "/_dev/counters"))["token_requests"]
    delays = []
    for _ in range(ROUNDS):
        parameters, error = call(a, "Recover", {"session": "api", "rejected": current})
        assert error is None, error
        committed = time.monotonic()
        current = parameters["token"]
        while call(b, "GetToken", {"session": "api"})[0].get("token") != current:
            pass
        delays.append((time.monotonic() - committed) * 1000)
    time.sleep(0.5)  # let the last watch events and lease revocations land before counting
    after_etcd = etcd_requests(clients)
    after_issuer = json.load(urllib.request.urlopen(base + "/_dev/counters"))["token_requests"]
    delays.sort()
    print(f"propagation A committed -> B serves it, {ROUNDS} refreshes: p50 {statistics.median(delays):.2f} ms, "
          f"p99 {delays[min(len(delays) - 1, int(len(delays) * 0.99))]:.2f} ms, max {delays[-1]:.2f} ms")
    print(f"issuer token requests per refresh: {(after_issuer - before_issuer) / ROUNDS:.2f}")
    per = {m: (after_etcd.get(m, 0) - before_etcd.get(m, 0)) / ROUNDS for m in after_etcd}
    shown = {m: v for m, v in per.items() if v > 0}
    print("etcd requests per refresh, fleet-wide (2 brokers): " + ", ".join(f"{m} {v:.1f}" for m, v in sorted(shown.items()))
          + f"; total {sum(shown.values()):.1f}")

    # The hot path stays local: GetToken on the fleet session vs a local one.
    import bench
    results = {"api": [], "local": []}
    for _ in range(RUNS):
        for session in ("local", "api"):
            bench.GET_TOKEN = json.dumps({"method": "io.tokenbroker.Broker.GetToken", "parameters": {"session": session}})
            results[session].append(load(tools, brokers["a"], 16, seconds=SECONDS))
    for session in ("local", "api"):
        rps = statistics.median(r["req_per_s"] for r in results[session])
        cpu = statistics.median(r["cpu_us"] for r in results[session])
        print(f"GetToken 16 conns, {session:5} session: {rps:,.0f} req/s, {cpu:.2f} CPU µs/req")
    ratio = statistics.median(r["req_per_s"] for r in results["api"]) / statistics.median(r["req_per_s"] for r in results["local"])
    print(f"fleet / local throughput: {ratio:.2f}")
    if SESSIONS > 0:
        scale(bin_dir, work, clients, base)
    for server in brokers.values():
        server.stop()
    for process in RUNNING:
        if process.poll() is None:
            stop(process)


def delta(before, after):
    return {m: after.get(m, 0) - before.get(m, 0) for m in after if after.get(m, 0) - before.get(m, 0) > 0}


def shown(counts):
    return ", ".join(f"{m} {v:.0f}" for m, v in sorted(counts.items())) + f"; total {sum(counts.values()):.0f}"


class Notify:
    """The notify socket systemd would hold."""

    def __init__(self, path):
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(path)
        self.path = path

    def wait_ready(self, process, deadline=120):
        end = time.monotonic() + deadline
        while True:
            left = end - time.monotonic()
            if left <= 0 or process.poll() is not None:
                sys.exit("bench-fleet: no READY=1")
            self.socket.settimeout(left)
            try:
                message = self.socket.recv(65536).decode()
            except socket.timeout:
                continue
            if "READY=1" in message.split("\n"):
                return time.monotonic()


def start_c(bin_dir, work, name, config, notify, state=None):
    """Starts a broker with `config`; returns (process, socket, exec -> READY=1 in seconds)."""
    path = f"{work}/{name}.sock"
    started = time.monotonic()
    process = spawn([os.path.join(bin_dir, "tokenbroker-daemon"), "serve", "--config", config, "--socket", path,
                     "--state-dir", f"{work}/{state or name}-state", "--log-level", "warning"],
                    env=dict(os.environ, NOTIFY_SOCKET=notify.path), stdout=subprocess.DEVNULL,
                    stderr=open(f"{work}/{name}.log", "a"))
    return process, path, notify.wait_ready(process) - started


def scale(bin_dir, work, clients, base):
    """A broker C with SESSIONS fleet sessions: its start, and the fleet's idle traffic."""
    fleet_conf, local_conf = f"{work}/c.conf", f"{work}/c-local.conf"
    with open(fleet_conf, "w") as f:
        f.write(f"[Broker]\nSocketMode=0600\n\n[Fleet]\nEndpoints={' '.join(clients)}\nKeyFile={work}/fleet.key\nName=host-c\n\n")
        for i in range(SESSIONS):
            f.write(f"[Session]\nName=s{i}\nFleet=yes\nTokenEndpoint={base}/token\nClientID=tokenbroker\n"
                    f"ClientSecretFile={work}/client-secret\n\n")
    with open(local_conf, "w") as f:
        f.write("[Broker]\nSocketMode=0600\n\n")
        for i in range(SESSIONS):
            f.write(f"[Session]\nName=s{i}\nUpstream=test\n\n")
    notify = Notify(f"{work}/notify.sock")
    # First start: every session logged in once (a sealed state in etcd for each).
    process, path, _ = start_c(os.environ.get("FLEET_SEED_BIN", bin_dir), work, "c", fleet_conf, notify, state="c-seed")
    failed = sum(1 for i in range(SESSIONS) if call(path, "Login", {"session": f"s{i}", "refreshToken": f"bench-refresh-{i}"})[1])
    if failed:
        print(f"logins that failed while seeding: {failed}/{SESSIONS}")
    stop(process)
    # Measured starts: the fleet sessions on the state the first start left, then as many local ones.
    before = etcd_requests(clients, "grpc_server_started_total")
    process, path, ready = start_c(bin_dir, work, "c", fleet_conf, notify)
    entries = call(path, "Status", {})[0]["sessions"]
    synced = sum(1 for e in entries if e.get("state") == "active" and e.get("fleetHealth") == "healthy")
    time.sleep(1)
    made = delta(before, etcd_requests(clients, "grpc_server_started_total"))
    local_process, _, local_ready = start_c(bin_dir, work, "c-local", local_conf, notify)
    stop(local_process)
    print(f"{SESSIONS} fleet sessions: exec -> READY=1 {ready * 1000:.0f} ms ({local_ready * 1000:.0f} ms with {SESSIONS} local "
          f"sessions: {(ready - local_ready) * 1000:+.0f} ms for etcd); active and healthy at READY=1: {synced}/{SESSIONS}")
    print(f"etcd requests started by C's start (and its first second): {shown(made)}")
    # Idle: A and B (one fleet session each) and C (SESSIONS) running, nothing asked of them.
    time.sleep(5)
    started, handled = etcd_requests(clients, "grpc_server_started_total"), etcd_requests(clients)
    time.sleep(IDLE_SECONDS)
    started = delta(started, etcd_requests(clients, "grpc_server_started_total"))
    handled = delta(handled, etcd_requests(clients))
    print(f"etcd requests in {IDLE_SECONDS:.0f} idle seconds, 3 brokers, {SESSIONS + 2} fleet sessions: started {shown(started)}; "
          f"handled {shown(handled)}")
    stop(process)


def _answers(url):
    try:
        request = urllib.request.Request(url + "/v3/kv/range", data=b'{"key":"cmVhZHk="}', method="POST")
        urllib.request.urlopen(request, timeout=1).read()
        return True
    except Exception:
        return False


if __name__ == "__main__":
    main()
