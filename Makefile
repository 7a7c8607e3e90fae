# tokenbroker — build, run and test on Debian 12 with the Swift toolchain on PATH.
#
#   make run    installs what is missing, builds, and runs the daemon (development mode)
#   make test   installs what is missing, builds with warnings as errors, runs every test

SWIFT       ?= swift
SWIFT_FLAGS ?= -Xswiftc -warnings-as-errors
# C libraries the package links through system-library targets, systemd's tools (systemd-analyze,
# systemd-socket-activate), setpriv and openssl for the tests, and the
# independent varlink implementation the conformance tests run against (Go).
APT_PACKAGES = pkg-config libsystemd-dev libsqlite3-dev libcurl4-openssl-dev libssl-dev varlink-go python3-venv systemd util-linux openssl
# The Python varlink implementation, for the conformance tests and the IDL check.
VENV = .build/tools/venv
PY_VARLINK = varlink==31.0.0

.PHONY: all deps build release run test bench install clean

all: build

# Installs the Debian packages that are not installed yet (as root, or through sudo).
deps:
	@missing=""; \
	for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "make deps: installing$$missing"; \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@[ -x $(VENV)/bin/python ] && $(VENV)/bin/python -c "import varlink" 2>/dev/null || { \
	  echo "make deps: creating $(VENV) with $(PY_VARLINK)"; \
	  python3 -m venv $(VENV) && $(VENV)/bin/pip install -q $(PY_VARLINK); }

build: deps
	$(SWIFT) build $(SWIFT_FLAGS)

release: deps
	$(SWIFT) build -c release $(SWIFT_FLAGS)

# Runs the daemon in the foreground in development mode: a development OAuth server in the
# same process and a logged-in session `demo`. It prints what to try next, e.g.
#   .build/debug/tokenbroker ctl --socket $(RUN_SOCKET) token demo
RUN_SOCKET ?= $(CURDIR)/.build/run/tokenbroker.sock
run: build
	$$($(SWIFT) build --show-bin-path)/tokenbroker serve --dev --socket $(RUN_SOCKET)

# Race tests repeat TB_RACE_ITERATIONS times each (default 500), the crash test
# TB_CRASH_ITERATIONS times (default 300). Suites run one after another: several use blocking
# socket clients against servers in the same process, and on a 2-core machine the cooperative
# thread pool has only two threads to share between them.
test: deps
	$(SWIFT) test --no-parallel $(SWIFT_FLAGS)

clean:
	rm -rf .build

# Round-trip benchmark: the release daemon and the C echo floor, measured by the same load
# generator in the same run (`../shared/bench`). Not part of `make test`.
BENCH_DIR ?= $(CURDIR)/../shared/bench
BENCH_SOCKET ?= /tmp/tokenbroker-bench.sock
BENCH_CONNS ?= 1 16 64 256
bench: release
	@$$($(SWIFT) build -c release --show-bin-path)/tokenbroker serve --config $(CURDIR)/config/dev.conf \
	  --socket $(BENCH_SOCKET) --state-dir $$(mktemp -d) --log-level warning & pid=$$!; \
	trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null' EXIT; \
	for i in $$(seq 100); do [ -S $(BENCH_SOCKET) ] && break; sleep 0.05; done; \
	$$($(SWIFT) build -c release --show-bin-path)/tokenbroker ctl --socket $(BENCH_SOCKET) token demo >/dev/null; \
	echo "== tokenbroker (GetToken, fresh token)"; $(BENCH_DIR)/run_baseline.sh --socket $(BENCH_SOCKET) --conns "$(BENCH_CONNS)"; \
	echo "== C echo floor"; $(BENCH_DIR)/run_baseline.sh --modes epoll --conns "$(BENCH_CONNS)"; \
	echo "== tokenbroker RSS (KiB): $$(ps -o rss= -p $$pid)"

# Installation: the binary (Swift standard library linked in), units, sysusers/tmpfiles
# snippets, the configuration (never over an existing one), the example drop-in and the man page.
PREFIX      ?= /usr/local
DESTDIR     ?=
BINDIR      ?= $(PREFIX)/bin
UNITDIR     ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
TMPFILESDIR ?= $(PREFIX)/lib/tmpfiles.d
MANDIR      ?= $(PREFIX)/share/man
DOCDIR      ?= $(PREFIX)/share/doc/tokenbroker
SYSCONFDIR  ?= /etc
install: deps
	$(SWIFT) build -c release --static-swift-stdlib $(SWIFT_FLAGS) --product tokenbroker
	install -Dm755 "$$($(SWIFT) build -c release --static-swift-stdlib --show-bin-path)/tokenbroker" "$(DESTDIR)$(BINDIR)/tokenbroker"
	install -d "$(DESTDIR)$(UNITDIR)"
	sed 's|/usr/local/bin/tokenbroker|$(BINDIR)/tokenbroker|' systemd/tokenbroker.service > "$(DESTDIR)$(UNITDIR)/tokenbroker.service"
	chmod 644 "$(DESTDIR)$(UNITDIR)/tokenbroker.service"
	install -Dm644 systemd/tokenbroker.socket "$(DESTDIR)$(UNITDIR)/tokenbroker.socket"
	install -Dm644 systemd/sysusers.d/tokenbroker.conf "$(DESTDIR)$(SYSUSERSDIR)/tokenbroker.conf"
	install -Dm644 systemd/tmpfiles.d/tokenbroker.conf "$(DESTDIR)$(TMPFILESDIR)/tokenbroker.conf"
	install -d "$(DESTDIR)$(SYSCONFDIR)/tokenbroker/tokenbroker.conf.d"
	[ -e "$(DESTDIR)$(SYSCONFDIR)/tokenbroker/tokenbroker.conf" ] || \
	  install -m644 config/tokenbroker.conf "$(DESTDIR)$(SYSCONFDIR)/tokenbroker/tokenbroker.conf"
	install -Dm644 config/tokenbroker.conf.d/example.conf "$(DESTDIR)$(DOCDIR)/examples/example.conf"
	install -Dm644 doc/tokenbroker.8 "$(DESTDIR)$(MANDIR)/man8/tokenbroker.8"
