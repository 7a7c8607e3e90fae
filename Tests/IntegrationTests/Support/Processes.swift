import Foundation
#if canImport(Glibc)
import Glibc
#endif
import Testing

/// Paths the integration tests need.
enum Paths {
    /// The directory holding the built executables (next to the test bundle).
    static let binaries = Bundle.main.bundleURL
    static let tokenbroker = binaries.appendingPathComponent("tokenbroker").path
    static let certification = binaries.appendingPathComponent("varlink-certification").path

    /// The package root (this file is Tests/IntegrationTests/Support/Processes.swift).
    static let packageRoot = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()

    /// A Python with the `varlink` package: `TB_VARLINK_PYTHON`, else the venv `make deps` makes.
    static var varlinkPython: String {
        ProcessInfo.processInfo.environment["TB_VARLINK_PYTHON"]
            ?? packageRoot.appendingPathComponent(".build/tools/venv/bin/python").path
    }

    /// A new private temporary directory (short, for socket paths).
    static func temporaryDirectory() throws -> String {
        var template = Array("/tmp/tb-test-XXXXXX".utf8CString)
        guard let path = mkdtemp(&template) else { throw POSIXError(.EIO) }
        return String(cString: path)
    }
}

/// A child process whose output goes to files, so it can never block on a full pipe.
final class Child: @unchecked Sendable {
    // @unchecked: `process` is only started, signalled and waited on; Foundation's Process is
    // thread-safe for these, and the test owns the object.
    let process = Process()
    let stdoutPath: String
    let stderrPath: String

    init(_ executable: String, _ arguments: [String], environment: [String: String]? = nil, directory: String, stdin: String? = nil) throws {
        process.executableURL = URL(fileURLWithPath: executable)
        process.arguments = arguments
        if let environment {
            process.environment = ProcessInfo.processInfo.environment.merging(environment) { _, new in new }
        }
        let name = UUID().uuidString.prefix(8)
        stdoutPath = "\(directory)/\(name).out"
        stderrPath = "\(directory)/\(name).err"
        _ = FileManager.default.createFile(atPath: stdoutPath, contents: nil)
        _ = FileManager.default.createFile(atPath: stderrPath, contents: nil)
        process.standardOutput = FileHandle(forWritingAtPath: stdoutPath)
        process.standardError = FileHandle(forWritingAtPath: stderrPath)
        if let stdin {
            let inputPath = "\(directory)/\(name).in"
            try stdin.write(toFile: inputPath, atomically: true, encoding: .utf8)
            process.standardInput = FileHandle(forReadingAtPath: inputPath)
        } else {
            process.standardInput = FileHandle.nullDevice
        }
        try process.run()
    }

    var stdout: String { (try? String(contentsOfFile: stdoutPath, encoding: .utf8)) ?? "" }
    var stderr: String { (try? String(contentsOfFile: stderrPath, encoding: .utf8)) ?? "" }

    /// Waits for the exit under a deadline (then kills it and records an issue).
    @discardableResult
    func wait(timeout: Double = 60, sourceLocation: SourceLocation = #_sourceLocation) async -> Int32 {
        let deadline = ContinuousClock.now + .seconds(timeout)
        while process.isRunning {
            if ContinuousClock.now >= deadline {
                Issue.record("\(process.executableURL?.lastPathComponent ?? "child") did not exit in \(timeout) s", sourceLocation: sourceLocation)
                Glibc.kill(process.processIdentifier, SIGKILL)
                process.waitUntilExit()
                break
            }
            try? await Task.sleep(for: .milliseconds(5))
        }
        return process.terminationStatus
    }

    func terminate() {
        if process.isRunning { Glibc.kill(process.processIdentifier, SIGTERM) }
    }

    /// Ends the process at once (for servers of other implementations, which may ignore SIGTERM).
    func kill() {
        if process.isRunning {
            Glibc.kill(process.processIdentifier, SIGKILL)
            process.waitUntilExit()
        }
    }

    /// Nothing a test started outlives it.
    deinit { kill() }
}

/// Waits until something accepts connections on `path`.
func waitForSocket(_ path: String, timeout: Double = 20, sourceLocation: SourceLocation = #_sourceLocation) async throws {
    let deadline = ContinuousClock.now + .seconds(timeout)
    while true {
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &address.sun_path) { $0.copyBytes(from: Array(path.utf8) + [0]) }
        let rc = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
        close(fd)
        if rc == 0 { return }
        if ContinuousClock.now >= deadline {
            Issue.record("nothing listens on \(path)", sourceLocation: sourceLocation)
            throw POSIXError(.ETIMEDOUT)
        }
        try await Task.sleep(for: .milliseconds(5))
    }
}
