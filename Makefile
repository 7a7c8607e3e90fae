# tokenbroker — build, run and test on Debian 12 with the Swift toolchain on PATH.
#
#   make run    installs what building needs, when it is missing, builds, and runs the daemon
#               (development mode)
#   make test   installs what building and testing need, when it is missing, builds with
#               warnings as errors, runs every test

SWIFT       ?= swift
SWIFT_FLAGS ?= -Xswiftc -warnings-as-errors
# What building (and so running) needs: the C libraries the package links through
# system-library targets, and libqrencode4 (ctl login draws the QR code of a code login's URL
# with it, loaded only then).
BUILD_PACKAGES = pkg-config libsystemd-dev libsqlite3-dev libcurl4-openssl-dev libssl-dev libqrencode4
# What testing needs beside: systemd's tools (systemd-analyze, systemd-socket-activate),
# setpriv, kill (procps) and openssl, the independent varlink implementation the conformance
# tests run against (Go), etcd (the fleet tests start their own etcd clusters on loopback ports;
# where systemd runs, the package also starts its own etcd service on localhost:2379, which the
# tests do not use; the same for docker-registry's on :5000), Prometheus, and git, skopeo and
# docker-registry (real clients and a real registry for the credential-helper tests), and
# openssh-server (the delegation tests start their own sshd on a loopback port and forward a
# delegation's socket to it with ssh -R; where systemd runs, the package also starts its own
# ssh service on port 22, which the tests do not use: apt-install stops and disables it, as it
# does etcd's, Prometheus's and docker-registry's), and iproute2 and iptables (a test runs an
# etcd member in a network namespace and drops its packets). `make run` installs none of these.
TEST_PACKAGES = varlink-go python3-venv systemd systemd-container util-linux procps openssl etcd-server prometheus git skopeo docker-registry openssh-server iproute2 iptables
# The Python varlink implementation, for the conformance tests and the IDL check.
VENV = .build/tools/venv
PY_VARLINK = varlink==31.0.0

.PHONY: all apt-install deps build-deps test-deps build release run test python-test system-test interop-test bench bench-derived bench-delegations bench-fleet bench-scale static link-order install install-files deb clean

all: build

# Installs the Debian packages that are not installed yet (as root, or through sudo).
apt-install:
	@missing=""; \
	for p in $(PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "make: installing$$missing"; \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing && \
	  for service in etcd prometheus docker-registry ssh; do \
	    case " $$missing " in *" $$service "*|*" $$service-server "*|*" open$$service-server "*) \
	      [ -d /run/systemd/system ] && $$sudo systemctl disable --now $$service >/dev/null 2>&1 || true;; \
	    esac; \
	  done; \
	fi

# What building needs (make run, make build, the package).
build-deps:
	@$(MAKE) --no-print-directory apt-install PACKAGES="$(BUILD_PACKAGES)"

# What testing needs beside.
test-deps: build-deps
	@$(MAKE) --no-print-directory apt-install PACKAGES="$(TEST_PACKAGES)"
	@# kubectl for the credential-helper tests: Debian's, unless one is installed already (another
	@# package's kubectl would conflict with it).
	@command -v kubectl >/dev/null || $(MAKE) --no-print-directory apt-install PACKAGES="kubernetes-client"
	@[ -x $(VENV)/bin/python ] && $(VENV)/bin/python -c "import varlink" 2>/dev/null || { \
	  echo "make test-deps: creating $(VENV) with $(PY_VARLINK)"; \
	  python3 -m venv $(VENV) && $(VENV)/bin/pip install -q $(PY_VARLINK); }

# Everything (what `make test` installs).
deps: test-deps

build: build-deps
	$(SWIFT) build $(SWIFT_FLAGS)

release: build-deps
	$(SWIFT) build -c release $(RELEASE_FLAGS) $(SWIFT_FLAGS)

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
test: test-deps
	$(SWIFT) test --no-parallel $(SWIFT_FLAGS)
	@$(MAKE) --no-print-directory python-test
	@$(MAKE) --no-print-directory interop-test
	@$(MAKE) --no-print-directory system-test

# The package under a real systemd: boots systemd as PID 1 in a container (systemd-nspawn),
# installs the .deb with apt and checks the service as users meet it (Tests/RealSystemd/run.py).
# Skipped, saying so, where no container can boot (not root, no systemd-nspawn).
system-test: test-deps deb
	@$(MAKE) --no-print-directory apt-install PACKAGES="systemd-container"
	$(SWIFT) build $(SWIFT_FLAGS) --product dev-issuer
	python3 Tests/RealSystemd/run.py $(DEB_DIR)/tokenbroker_$$(dpkg-parsechangelog -S Version)_$$(dpkg --print-architecture).deb \
	  $$($(SWIFT) build --show-bin-path)/dev-issuer

# tokenbroker against Glewlwyd, a real authorization server from Debian (Tests/Interop/glewlwyd.py):
# on loopback, provisioned through its admin API, with a SQLite database in a temporary directory.
# The fixture installs the package when it is missing (answering its debconf question "no
# configuration"); the suite is skipped, saying so, only when it cannot be installed.
# The Python client (clients/python) installed with pip into its own venv, tested with pytest
# against the real daemon and the development issuer.
PY_CLIENT_VENV = .build/tools/python-client
python-test: test-deps build
	@[ -x $(PY_CLIENT_VENV)/bin/keyring ] && $(PY_CLIENT_VENV)/bin/python -c 'import pydpop, zxingcpp, ada_url' 2>/dev/null || { python3 -m venv $(PY_CLIENT_VENV) && \
	  $(PY_CLIENT_VENV)/bin/pip install -q pytest requests httpx keyring pydpop zxing-cpp numpy ada-url; }
	$(PY_CLIENT_VENV)/bin/pip install -q --force-reinstall --no-deps ./clients/python
	cd clients/python && TOKENBROKER_BIN="$$($(SWIFT) build --show-bin-path)" $(CURDIR)/$(PY_CLIENT_VENV)/bin/pytest -q -p no:cacheprovider tests

interop-test: build
	python3 Tests/Interop/glewlwyd.py "$$($(SWIFT) build --show-bin-path)"
	python3 Tests/Interop/assertions.py "$$($(SWIFT) build --show-bin-path)"

clean:
	rm -rf .build

# The benchmark (`Tests/Bench/bench.py`): GetToken against the C echo floor of `../shared/bench`
# at 1/16/64/256 connections, `ctl token` against /bin/true, exec -> READY=1 and memory, all
# in one run, as ratios. Not part of `make test`; knobs in the script's header.
# It measures the executables `make install` and the package install (`make static`).
# BENCH_BASELINE=<dir> measures another build beside them in the same run (before and after),
# e.g. an earlier commit's:  git worktree add /tmp/base <commit> && make -C /tmp/base static &&
#   make bench BENCH_BASELINE=/tmp/base/.build/static/x86_64-unknown-linux-gnu/release
BENCH_DIR ?= $(CURDIR)/../shared/bench
bench: deps static
	BENCH_DIR=$(BENCH_DIR) BENCH_BASELINE=$(BENCH_BASELINE) python3 Tests/Bench/bench.py "$$($(SWIFT) build $(STATIC_BUILD) --show-bin-path)"
	@$(MAKE) --no-print-directory bench-derived
	@$(MAKE) --no-print-directory bench-delegations

# Derived sessions' figures (`Tests/Bench/derived.py`, issue 35): GetToken on a derived session
# against its parent, one exchange per derived session for 64 processes after expiry, no replay.
bench-derived: deps static
	$(SWIFT) build $(STATIC_BUILD) $(SWIFT_FLAGS) --product dev-issuer
	BENCH_DIR=$(BENCH_DIR) python3 Tests/Bench/derived.py "$$($(SWIFT) build $(STATIC_BUILD) --show-bin-path)"

# Delegations' and token files' figures (`Tests/Bench/delegations.py`, issue 36): GetToken
# through a delegation's socket against the broker's own, memory and idle CPU of 100 delegations
# and 100 token files, refreshes per token lifetime with the files kept fresh.
bench-delegations: deps static
	BENCH_DIR=$(BENCH_DIR) python3 Tests/Bench/delegations.py "$$($(SWIFT) build $(STATIC_BUILD) --show-bin-path)"

# Fleet mode's figures (`Tests/Bench/fleet.py`): propagation between brokers, etcd requests per
# refresh, GetToken on a fleet session vs a local one, exec -> READY=1 with 1,000 fleet sessions
# and the etcd requests of an idle minute (FLEET_SESSIONS, FLEET_IDLE_SECONDS); a real 3-member
# etcd on loopback.
bench-fleet: deps static
	$(SWIFT) build $(STATIC_BUILD) $(SWIFT_FLAGS) --product dev-issuer
	BENCH_DIR=$(BENCH_DIR) python3 Tests/Bench/fleet.py "$$($(SWIFT) build $(STATIC_BUILD) --show-bin-path)"

# What many sessions cost (`Tests/Bench/scale.py`): for 1, 1,000 and 10,000 `Upstream=test`
# sessions, exec -> READY=1 cold and warm, one Status call, a reload that changes or adds one
# session, memory per session and idle CPU. Knobs in the script's header (SCALE_SESSIONS=…).
bench-scale: deps static
	python3 Tests/Bench/scale.py "$$($(SWIFT) build $(STATIC_BUILD) --show-bin-path)"

# Installation: `tokenbroker` (the command, one static executable) in BINDIR, the daemon
# `tokenbroker-daemon` (Swift standard library linked in) in LIBEXECDIR/tokenbroker, units, sysusers/tmpfiles
# snippets, the user units (each user enables them), the configuration (never over an existing one), the example drop-in and the man page.
# `make static` builds both (in their own build directory, so that it does not take turns
# with `make release`); `make install-files` only copies (debian/rules uses both).
PREFIX      ?= /usr/local
DESTDIR     ?=
BINDIR      ?= $(PREFIX)/bin
LIBEXECDIR  ?= $(PREFIX)/libexec
UNITDIR     ?= $(PREFIX)/lib/systemd/system
USERUNITDIR ?= $(PREFIX)/lib/systemd/user
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
TMPFILESDIR ?= $(PREFIX)/lib/tmpfiles.d
MANDIR      ?= $(PREFIX)/share/man
DOCDIR      ?= $(PREFIX)/share/doc/tokenbroker
SYSCONFDIR  ?= /etc
# --disable-local-rpath: no RUNPATH $ORIGIN. Nothing is installed beside the executables (the
# Swift runtime is linked in, the rest is the system's), and with it the loader looked for every
# library in some 20 hwcaps directories beside the daemon first: 40-odd failed opens and stats
# at each start.
#
# RELEASE_FLAGS: the modules fetch their generic types' metadata by direct accessor calls rather
# than by demangling a name at its first use. The runtime's demangler was a sixth of a start's
# instructions, and a seventh of a `ctl token`'s. A compiler flag, so given here rather than in
# Package.swift: a package that depends on this one cannot build a target with unsafe flags.
# Each function in a section of its own, so that LINK_ORDER can place it (a build made before
# this flag keeps its objects: `rm -rf .build/static` for a layout by function).
RELEASE_FLAGS = -Xswiftc -Xfrontend -Xswiftc -disable-concrete-type-metadata-mangled-name-accessors -Xswiftc -Xfrontend -Xswiftc -function-sections
#
# STATIC_CXX: the C++ library the Swift runtime needs is linked in, not loaded (loading it, and
# running its constructors, was a third of a millisecond of each daemon start). The linker takes
# the first libstdc++ it finds on its search path, so a directory holding only the archive comes
# first. Without the archive (clang finds none) the link falls back to libstdc++.so.
STATIC_CXX = $(CURDIR)/.build/static-libstdc++
STATIC_BUILD = -c release --static-swift-stdlib --disable-local-rpath --scratch-path $(CURDIR)/.build/static $(RELEASE_FLAGS) \
               -Xlinker -L$(STATIC_CXX)

# LINK_ORDER: each executable (linked by lld) lays out first the functions and variables its
# short path touches (Sources/<executable>/link-order.txt, written by `make link-order`): those
# of `ctl token` and a credential helper, those of a daemon's start. They then share a few pages
# instead of faulting in scores (a page fault costs about 10 µs on this kind of virtual machine).
LINK_ORDER = -Xlinker --symbol-ordering-file=$(CURDIR)/Sources/$(1)/link-order.txt -Xlinker --no-warn-symbol-ordering

static: $(STATIC_CXX)/libstdc++.a
	$(SWIFT) build $(STATIC_BUILD) $(call LINK_ORDER,tokenbroker-daemon) $(SWIFT_FLAGS) --product tokenbroker-daemon
	$(SWIFT) build $(STATIC_BUILD) $(call LINK_ORDER,tokenbroker) $(SWIFT_FLAGS) --product tokenbroker

# Records link-order.txt anew from the static build (valgrind; see Tests/Bench/link_order.py).
link-order: deps static
	@$(MAKE) --no-print-directory apt-install PACKAGES="valgrind"
	python3 Tests/Bench/link_order.py "$$($(SWIFT) build $(STATIC_BUILD) --show-bin-path)"

$(STATIC_CXX)/libstdc++.a:
	mkdir -p $(@D) && ln -sfn "$$(clang -print-file-name=libstdc++.a)" $@

install: build-deps static install-files

install-files:
	install -Dm755 "$$($(SWIFT) build $(STATIC_BUILD) --show-bin-path)/tokenbroker" "$(DESTDIR)$(BINDIR)/tokenbroker"
	for helper in git-credential-tokenbroker docker-credential-tokenbroker terraform-credentials-tokenbroker bazel-credential-tokenbroker; do \
	  ln -sf tokenbroker "$(DESTDIR)$(BINDIR)/$$helper"; done
	install -Dm755 "$$($(SWIFT) build $(STATIC_BUILD) --show-bin-path)/tokenbroker-daemon" "$(DESTDIR)$(LIBEXECDIR)/tokenbroker/tokenbroker-daemon"
	install -d "$(DESTDIR)$(UNITDIR)"
	sed 's|/usr/local/libexec/tokenbroker/|$(LIBEXECDIR)/tokenbroker/|' systemd/tokenbroker.service > "$(DESTDIR)$(UNITDIR)/tokenbroker.service"
	chmod 644 "$(DESTDIR)$(UNITDIR)/tokenbroker.service"
	install -Dm644 systemd/tokenbroker.socket "$(DESTDIR)$(UNITDIR)/tokenbroker.socket"
	install -d "$(DESTDIR)$(USERUNITDIR)"
	sed 's|/usr/local/libexec/tokenbroker/|$(LIBEXECDIR)/tokenbroker/|' systemd/user/tokenbroker.service > "$(DESTDIR)$(USERUNITDIR)/tokenbroker.service"
	chmod 644 "$(DESTDIR)$(USERUNITDIR)/tokenbroker.service"
	install -Dm644 systemd/user/tokenbroker.socket "$(DESTDIR)$(USERUNITDIR)/tokenbroker.socket"
	install -Dm644 systemd/sysusers.d/tokenbroker.conf "$(DESTDIR)$(SYSUSERSDIR)/tokenbroker.conf"
	install -Dm644 systemd/tmpfiles.d/tokenbroker.conf "$(DESTDIR)$(TMPFILESDIR)/tokenbroker.conf"
	install -d "$(DESTDIR)$(SYSCONFDIR)/tokenbroker/tokenbroker.conf.d"
	[ -e "$(DESTDIR)$(SYSCONFDIR)/tokenbroker/tokenbroker.conf" ] || \
	  install -m644 config/tokenbroker.conf "$(DESTDIR)$(SYSCONFDIR)/tokenbroker/tokenbroker.conf"
	install -Dm644 config/tokenbroker.conf.d/example.conf "$(DESTDIR)$(DOCDIR)/examples/example.conf"
	install -Dm644 doc/tokenbroker.8 "$(DESTDIR)$(MANDIR)/man8/tokenbroker.8"

# The Debian package, built by Debian's tooling (dpkg-buildpackage, debhelper) from this tree:
# .build/deb/tokenbroker_VERSION_ARCH.deb. Install it with `apt install ./.build/deb/tokenbroker_…deb`.
DEB_PACKAGES = debhelper dpkg-dev build-essential
DEB_DIR = $(CURDIR)/.build/deb
deb: build-deps
	@$(MAKE) --no-print-directory apt-install PACKAGES="$(DEB_PACKAGES)"
	rm -rf $(DEB_DIR) && mkdir -p $(DEB_DIR)
	env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL DEB_OUTPUT_DIR=$(DEB_DIR) SWIFT=$(SWIFT) dpkg-buildpackage --build=binary --no-sign \
	  --buildinfo-file=$(DEB_DIR)/tokenbroker.buildinfo --buildinfo-option=-u$(DEB_DIR) \
	  --changes-file=$(DEB_DIR)/tokenbroker.changes --changes-option=-u$(DEB_DIR)
	@ls $(DEB_DIR)/*.deb
