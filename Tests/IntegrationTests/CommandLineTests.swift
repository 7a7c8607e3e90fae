import Foundation
import Testing
import TestSupport

/// Runs the real `tokenbroker` binary (built with the tests, it sits next to the test bundle).
func run(_ arguments: String...) async throws -> (code: Int32, stdout: String, stderr: String) {
    try await Child.run(Paths.tokenbroker, arguments)
}

@Suite("tokenbroker command line")
struct CommandLineTests {
    @Test("-h, --help and help print the same help, with every section, and exit 0")
    func help() async throws {
        let runs = [try await run("-h"), try await run("--help"), try await run("help")]
        for run in runs {
            #expect(run.code == 0)
            #expect(run.stdout == runs[0].stdout)
            #expect(run.stderr.isEmpty)
        }
        for section in ["OVERVIEW:", "USAGE: tokenbroker", "OPTIONS:", "SUBCOMMANDS:"] {
            #expect(runs[0].stdout.contains(section), "missing \(section)")
        }
    }

    @Test("--version prints the name and a semantic version")
    func version() async throws {
        let version = try await run("--version")
        #expect(version.code == 0)
        #expect(version.stdout.wholeMatch(of: /tokenbroker \d+\.\d+\.\d+\n/) != nil)
    }

    @Test("bad usage: `Error: …` and the usage on stderr, exit 64", arguments: [[], ["frobnicate"], ["--nope"]])
    func usage(arguments: [String]) async throws {
        let result = try await Child.run(Paths.tokenbroker, arguments)
        #expect(result.code == 64)
        #expect(result.stderr.hasPrefix("Error: "))
        #expect(result.stderr.contains("USAGE: tokenbroker"))
    }

    @Test("tokenbroker is one static executable: no program interpreter, so no dynamic loader and no shared library to map")
    func staticExecutable() throws {
        let image = try Data(contentsOf: URL(fileURLWithPath: Paths.tokenbroker))
        #expect(image.count > 64 && image.prefix(4) == Data([0x7f, 0x45, 0x4c, 0x46]) && image[4] == 2, "not a 64-bit ELF file")
        func integer(_ offset: Int, _ size: Int) -> Int {
            (0..<size).reduce(0) { $0 | Int(image[offset + $1]) << (8 * $1) }
        }
        let (table, entrySize, count) = (integer(0x20, 8), integer(0x36, 2), integer(0x38, 2))
        #expect(table > 0 && entrySize >= 56 && table + entrySize * count <= image.count)
        let types = (0..<count).map { integer(table + $0 * entrySize, 4) }
        #expect(!types.isEmpty)
        #expect(!types.contains(3), "PT_INTERP: the executable asks for a dynamic loader")
        #expect(!types.contains(2), "PT_DYNAMIC: the executable has dynamic linking information")
    }

    @Test("installed layout: bin/tokenbroker runs ../libexec/tokenbroker/tokenbroker-daemon for check-config and serve; without it, says so and exits 1; ctl needs no daemon executable")
    func daemonExecutable() async throws {
        let root = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: root) }
        let files = FileManager.default
        try files.createDirectory(atPath: root + "/bin", withIntermediateDirectories: true)
        try files.copyItem(atPath: Paths.tokenbroker, toPath: root + "/bin/tokenbroker")
        let config = Paths.packageRoot.appendingPathComponent("config/tokenbroker.conf").path

        let missing = try await Child.run(root + "/bin/tokenbroker", ["check-config", "--config", config])
        #expect(missing.code == 1)
        #expect(missing.stderr.contains("cannot find tokenbroker-daemon"), "\(missing.stderr)")
        let serve = try await Child.run(root + "/bin/tokenbroker", ["serve", "--socket", root + "/s"])
        #expect(serve.code == 1 && serve.stderr.contains("cannot find tokenbroker-daemon"))
        // ctl is the command's own: no daemon executable, no daemon, exit 69 (unavailable).
        let ctl = try await Child.run(root + "/bin/tokenbroker", ["ctl", "--socket", root + "/none", "status"])
        #expect(ctl.code == 69, "\(ctl.code): \(ctl.stderr)")

        try files.createDirectory(atPath: root + "/libexec/tokenbroker", withIntermediateDirectories: true)
        try files.copyItem(atPath: Paths.daemon, toPath: root + "/libexec/tokenbroker/tokenbroker-daemon")
        let check = try await Child.run(root + "/bin/tokenbroker", ["check-config", "--config", config])
        #expect(check.code == 0, "\(check.stderr)")
        #expect(check.stdout.hasPrefix(config + ": OK, "), "\(check.stdout)")
    }
}
