import Foundation
import Testing

/// Runs the real `tokenbroker` binary (the test target depends on it, so it sits next to the
/// test bundle).
struct Run {
    let status: Int32
    let stdout: String
    let stderr: String

    static let binary = Bundle.main.bundleURL.appendingPathComponent("tokenbroker")

    init(_ arguments: String...) throws {
        let process = Process()
        process.executableURL = Self.binary
        process.arguments = arguments
        let out = Pipe()
        let err = Pipe()
        process.standardOutput = out
        process.standardError = err
        process.standardInput = FileHandle.nullDevice
        try process.run()
        let outData = out.fileHandleForReading.readDataToEndOfFile()
        let errData = err.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        status = process.terminationStatus
        stdout = String(decoding: outData, as: UTF8.self)
        stderr = String(decoding: errData, as: UTF8.self)
    }
}

@Suite("tokenbroker command line")
struct CommandLineTests {
    @Test("-h, --help and help print the same help, with every section, and exit 0")
    func help() throws {
        let runs = try [Run("-h"), Run("--help"), Run("help")]
        for run in runs {
            #expect(run.status == 0)
            #expect(run.stdout == runs[0].stdout)
            #expect(run.stderr.isEmpty)
        }
        for section in ["OVERVIEW:", "USAGE: tokenbroker", "OPTIONS:", "SUBCOMMANDS:"] {
            #expect(runs[0].stdout.contains(section), "missing \(section)")
        }
    }

    @Test("--version prints the name and a semantic version")
    func version() throws {
        let run = try Run("--version")
        #expect(run.status == 0)
        #expect(run.stdout.wholeMatch(of: /tokenbroker \d+\.\d+\.\d+\n/) != nil)
    }

    @Test("bad usage: `Error: …` and the usage on stderr, exit 64", arguments: [[], ["frobnicate"], ["--nope"]])
    func usage(arguments: [String]) throws {
        let process = Process()
        process.executableURL = Run.binary
        process.arguments = arguments
        let err = Pipe()
        process.standardError = err
        process.standardOutput = FileHandle.nullDevice
        try process.run()
        let text = String(decoding: err.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        process.waitUntilExit()
        #expect(process.terminationStatus == 64)
        #expect(text.hasPrefix("Error: "))
        #expect(text.contains("USAGE: tokenbroker"))
    }
}
