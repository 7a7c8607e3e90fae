import Foundation
import Testing
import TestSupport

/// Runs the real `tokenbroker` binary (the test target depends on it, so it sits next to the
/// test bundle).
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
}
