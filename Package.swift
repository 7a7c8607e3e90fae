// swift-tools-version:6.0
import PackageDescription

// One list of settings for every target: Swift 6 language mode (strict concurrency is part of it)
// and explicit `any` for existentials. Warnings are turned into errors by the Makefile
// (`-Xswiftc -warnings-as-errors`), not here, so the package stays usable as a dependency.
let swiftSettings: [SwiftSetting] = [
    .enableUpcomingFeature("ExistentialAny"),
    .enableUpcomingFeature("MemberImportVisibility"),
]

var package = Package(
    name: "tokenbroker",
    platforms: [.macOS(.v15)],
    products: [
        .executable(name: "tokenbroker", targets: ["tokenbroker"]),
        .executable(name: "tokenbroker-daemon", targets: ["tokenbroker-daemon"]),
        .library(name: "TokenBrokerCore", targets: ["TokenBrokerCore"]),
        .library(name: "Varlink", targets: ["Varlink"]),
        .library(name: "TokenBrokerClient", targets: ["TokenBrokerClient"]),
        .library(name: "TokenBrokerURLSession", targets: ["TokenBrokerURLSession"]),
    ],
    targets: [
        // Pure: the refresh coordinator, its state machine, policies and errors. Standard library only
        // (plus Synchronization): no sockets, no HTTP, no files.
        .target(name: "TokenBrokerCore"),
        // Linux calls Swift's Glibc module lacks: epoll, eventfd, accept4, SO_PEERCRED/PEERGROUPS, prctl.
        .target(name: "CLinux"),
        // Small shared pieces, one file each: threads, SerialThread, AsyncSerializer, Latch, SynchronizedBox,
        // TerminationSignal, form encoding, Base64, UTCTime.
        .target(name: "Basics"),
        // A strict JSON value type with its parser and compact encoder (standard library only).
        .target(name: "WireJSON"),
        // The varlink protocol: NUL framing, calls and replies, org.varlink.service, an epoll
        // server and a blocking client. Knows nothing of tokens.
        .target(name: "Varlink", dependencies: ["Basics", "CLinux", "WireJSON"]),
        // libcurl (headers from libcurl4-openssl-dev), opened with dlopen on first use rather than
        // linked: its dependencies were most of the daemon's start-up. Typed wrappers of the
        // variadic setopt/getinfo functions.
        .target(name: "CCurl"),
        // HTTP over libcurl: one loop thread for every transfer, bounded requests and answers,
        // TLS options (the OAuth client's and etcd's transport).
        .target(name: "HTTPTransport", dependencies: ["Basics", "CCurl"]),
        // The OAuth 2.0 client: token requests and their classification, discovery,
        // revocation, the device and code flows.
        .target(name: "Upstream", dependencies: ["Basics", "CCurl", "DPoP", "HTTPTransport", "TokenBrokerCore", "WireJSON"]),
        // Fleet mode: sessions shared by brokers on many hosts through etcd v3 (its JSON
        // gateway, over the libcurl loop).
        .target(name: "Fleet", dependencies: ["Basics", "HTTPTransport", "Sealing", "TokenBrokerCore", "WireJSON"]),
        // A development OAuth 2.0 authorization server on loopback HTTP (`tokenbroker serve --dev`, tests).
        .target(name: "DevIssuer", dependencies: ["Basics", "DPoP", "WireJSON"]),
        // libsystemd's journal (sd_journal_sendv), opened at the first journal entry (the daemon
        // speaks sd_notify and socket activation itself). Its header comes from libsystemd-dev.
        .target(name: "CSystemd"),
        // libcrypto (OpenSSL), for AES-256-GCM of tokens at rest.
        .target(name: "CCrypto"),
        // SQLite, for the durable session state.
        .systemLibrary(name: "CSQLite", pkgConfig: "sqlite3", providers: [.apt(["libsqlite3-dev"])]),
        // AES-256-GCM sealing under an operator's key (`TokenCipher`): the state database's token
        // columns and what a fleet shares through etcd.
        .target(name: "Sealing", dependencies: ["Basics", "CCrypto"]),
        // DPoP (RFC 9449): a session's P-256 key (through libcrypto) and the proofs signed with it.
        .target(name: "DPoP", dependencies: ["Basics", "CCrypto", "WireJSON"]),
        // The SQLite session store: generation-guarded writes, WAL + synchronous=FULL, migrations.
        .target(name: "SQLiteStore", dependencies: ["Basics", "CSQLite", "Sealing", "TokenBrokerCore"]),
        // The wire contract of io.tokenbroker.Broker — its text, methods, typed requests and replies,
        // and its errors with their names — shared by the daemon's service, ctl and the client library.
        .target(name: "BrokerContract", dependencies: ["Basics", "Varlink"], resources: [.embedInCode("io.tokenbroker.Broker.varlink")]),
        // The command line without the daemon: help, --version, every ctl verb (no libcurl, SQLite,
        // libcrypto or libsystemd: see `Command`). (Built for release with RELEASE_FLAGS, as every
        // module: see the Makefile.)
        .target(name: "TokenBrokerCLI", dependencies: ["Basics", "BrokerContract", "CLinux", "Varlink"]),
        // The daemon: configuration, the io.tokenbroker.Broker service, peer authorization, serve,
        // check-config.
        .target(name: "TokenBrokerDaemon", dependencies: ["Fleet", "Basics", "BrokerContract", "CLinux", "DPoP", "TokenBrokerCore",
                                                         "Varlink", "Upstream", "HTTPTransport", "Sealing", "SQLiteStore", "CSystemd"]),
        // `tokenbroker-daemon`'s command line: `serve` and `check-config` parsed and run, every
        // other subcommand handed to the CLI's. (The daemon itself knows nothing of the CLI.)
        .target(name: "TokenBrokerDaemonCommand", dependencies: ["Basics", "BrokerContract", "Fleet", "TokenBrokerCLI", "TokenBrokerDaemon"]),
        // `serve --dev`: the development issuer beside the daemon. Only the executable links it.
        .target(name: "TokenBrokerDevelopment", dependencies: ["DevIssuer", "DPoP", "TokenBrokerCore", "TokenBrokerDaemon", "Upstream"]),
        // The Swift client library for workers: typed calls, reconnection, watch streams, and the
        // one-refresh-one-retry helper for business requests.
        .target(name: "TokenBrokerClient", dependencies: ["Basics", "BrokerContract", "TokenBrokerCore", "Varlink"]),
        // The helper on URLSession, for workers that use FoundationNetworking.
        .target(name: "TokenBrokerURLSession", dependencies: ["TokenBrokerClient", "TokenBrokerCore"]),
        // An example worker: a protected resource called through the broker.
        .executableTarget(name: "example-worker", dependencies: ["TokenBrokerClient", "TokenBrokerURLSession"]),
        // `tokenbroker`: the command line users and scripts run, fully static (no dynamic loader, no
        // shared library), so that `ctl token` starts about as fast as /bin/true. `serve` and
        // `check-config` exec `tokenbroker-daemon`. Linked by lld with warnings off: the one warning
        // is glibc's on any static link that contains dlopen (libswiftCore.a's optional lookup of
        // a prespecialization library, which finds none), and `make test` shows no warnings.
        .executableTarget(name: "tokenbroker", dependencies: ["Basics", "TokenBrokerCLI"], exclude: ["link-order.txt"],
                          linkerSettings: [.unsafeFlags(["-static-executable", "-use-ld=lld", "-Xlinker", "--no-warnings"])]),
        // `tokenbroker-daemon`: serve and check-config (and the rest of the command line too).
        // Packed relative relocations (DT_RELR, glibc 2.36): the loader reads 5 KB instead of
        // 640 KB of them at each start.
        .executableTarget(name: "tokenbroker-daemon", dependencies: ["TokenBrokerDaemon", "TokenBrokerDaemonCommand", "TokenBrokerDevelopment"],
                          exclude: ["link-order.txt"],
                          linkerSettings: [.unsafeFlags(["-use-ld=lld", "-Xlinker", "-z", "-Xlinker", "pack-relative-relocs"])]),
        // The development issuer as a process of its own, for the real-systemd test (not installed).
        .executableTarget(name: "dev-issuer", dependencies: ["Basics", "DevIssuer"]),
        // org.varlink.certification served and called on our varlink layer, for conformance tests
        // against independent implementations (Go, Python).
        .executableTarget(name: "varlink-certification", dependencies: ["Basics", "Varlink"]),

        // What the test targets share: waiting for a state, a seeded random generator, permutations,
        // child processes.
        .target(name: "TestSupport", path: "Tests/TestSupport"),
        .testTarget(name: "TokenBrokerCoreTests", dependencies: ["TokenBrokerCore", "TestSupport"]),
        .testTarget(name: "VarlinkTests", dependencies: ["Varlink", "TestSupport"]),
        .testTarget(name: "SQLiteStoreTests", dependencies: ["SQLiteStore", "Sealing", "TokenBrokerCore", "TestSupport"]),
        .testTarget(name: "DPoPTests", dependencies: ["DPoP", "Basics", "WireJSON", "TestSupport"]),
        .testTarget(name: "FleetTests", dependencies: ["Fleet", "HTTPTransport", "Sealing", "TokenBrokerCore", "Basics", "WireJSON", "TestSupport"]),
        .testTarget(name: "UpstreamTests", dependencies: ["Upstream", "HTTPTransport", "DevIssuer", "DPoP", "TokenBrokerCore", "Basics", "TestSupport", "WireJSON"]),
        .testTarget(name: "TokenBrokerDaemonTests", dependencies: ["TokenBrokerDaemon", "DPoP", "TokenBrokerDaemonCommand", "TokenBrokerCLI", "Basics", "BrokerContract", "WireJSON", "TokenBrokerCore", "HTTPTransport", "Varlink", "Fleet", "Upstream", "TestSupport"]),
        // Spawns the real binaries; depends on the daemon's so `swift test` builds it first (not on the
        // static `tokenbroker`, whose link flags would apply to the test bundle: `swift test` builds
        // every product anyway).
        .testTarget(name: "IntegrationTests", dependencies: ["tokenbroker-daemon", "varlink-certification", "example-worker",
                                                            "TokenBrokerClient", "TokenBrokerURLSession", "WireJSON", "Varlink", "DevIssuer", "DPoP", "Basics", "Upstream", "HTTPTransport", "Sealing", "SQLiteStore", "TokenBrokerCore", "Fleet",
                                                            "TestSupport"]),
    ],
    swiftLanguageModes: [.v6]
)

for target in package.targets where target.type != .system {
    target.swiftSettings = (target.swiftSettings ?? []) + swiftSettings
}

