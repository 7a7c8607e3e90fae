import Foundation
#if canImport(Glibc)
import Glibc
#endif
import Testing
import TestSupport

/// Paths the integration tests need.
enum Paths {
    /// The directory holding the executables under test: the ones built next to the test
    /// bundle, or `TB_BINARIES` (another build's, to show that a test fails on it).
    static let binaries = ProcessInfo.processInfo.environment["TB_BINARIES"].map { URL(fileURLWithPath: $0) } ?? Bundle.main.bundleURL
    static let tokenbroker = binaries.appendingPathComponent("tokenbroker").path
    /// What `tokenbroker serve` and `check-config` become (exec).
    static let daemon = binaries.appendingPathComponent("tokenbroker-daemon").path
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
        // (Removed at the test process's exit too, for the tests that leave theirs.)
        ScratchDirectories.removeAtExit(String(cString: path))
        return String(cString: path)
    }
}

/// Waits until something accepts connections on `path`. With the `server` that should
/// listen there, a server that exits first fails the wait at once, and a failure quotes its log.
func waitForSocket(_ path: String, server: Child? = nil, timeout: Double = 20, sourceLocation: SourceLocation = #_sourceLocation) async throws {
    let deadline = ContinuousClock.now + .seconds(timeout)
    func log() -> String { server.map { ": server log:\n\($0.stderr)" } ?? "" }
    while true {
        if let server, !server.process.isRunning {
            Issue.record("the server exited (\(server.process.terminationStatus)) before listening on \(path)\(log())", sourceLocation: sourceLocation)
            throw POSIXError(.ECHILD)
        }
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
            Issue.record("nothing listens on \(path) after \(timeout) s\(log())", sourceLocation: sourceLocation)
            throw POSIXError(.ETIMEDOUT)
        }
        try await Task.sleep(for: .milliseconds(5))
    }
}
