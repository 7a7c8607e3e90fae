import Foundation
#if canImport(Glibc)
import Glibc
#endif
import Testing

/// A child process whose output goes to files, so it can never block on a full pipe.
public final class Child: @unchecked Sendable {
    // @unchecked: `process` is only started, signalled and waited on; Foundation's Process is
    // thread-safe for these, and the test owns the object.
    public let process = Process()
    public let stdoutPath: String
    public let stderrPath: String
    /// The write end of the child's standard input, with `pipeInput` (`write(toInput:)`).
    private let input: FileHandle?

    /// Runs `executable`; its output files go to `directory`, and it runs in
    /// `workingDirectory` (the test's own when nil).
    /// With `pipeInput`, its standard input is a pipe the test writes to (`write(toInput:)`).
    public init(_ executable: String, _ arguments: [String], environment: [String: String]? = nil, directory: String, stdin: String? = nil,
                pipeInput: Bool = false, workingDirectory: String? = nil) throws {
        process.executableURL = URL(fileURLWithPath: executable)
        process.arguments = arguments
        if let workingDirectory { process.currentDirectoryURL = URL(fileURLWithPath: workingDirectory) }
        if let environment {
            process.environment = ProcessInfo.processInfo.environment.merging(environment) { _, new in new }
        }
        let name = UUID().uuidString.prefix(8)
        stdoutPath = "\(directory)/\(name).out"
        stderrPath = "\(directory)/\(name).err"
        _ = FileManager.default.createFile(atPath: stdoutPath, contents: nil)
        _ = FileManager.default.createFile(atPath: stderrPath, contents: nil)
        // The child gets its own copies of these descriptors: the test process closes its own at
        // once. (Left open, they piled up by the thousand over the suite; Foundation's Process.run
        // on Linux over-reads /proc/self/fd when it lists that many, and crashes now and then.)
        var handles: [FileHandle] = []
        defer { for handle in handles { try? handle.close() } }
        if let output = FileHandle(forWritingAtPath: stdoutPath), let errors = FileHandle(forWritingAtPath: stderrPath) {
            handles += [output, errors]
            process.standardOutput = output
            process.standardError = errors
        }
        var pipe: Pipe?
        if pipeInput {
            pipe = Pipe()
            process.standardInput = pipe
        } else if let stdin {
            let inputPath = "\(directory)/\(name).in"
            try stdin.write(toFile: inputPath, atomically: true, encoding: .utf8)
            if let input = FileHandle(forReadingAtPath: inputPath) {
                handles.append(input)
                process.standardInput = input
            }
        } else {
            process.standardInput = FileHandle.nullDevice
        }
        input = pipe?.fileHandleForWriting
        try process.run()
        try? pipe?.fileHandleForReading.close()
    }

    /// Writes to the child's standard input (a pipe: `pipeInput`).
    public func write(toInput text: String) {
        try? input?.write(contentsOf: Array(text.utf8))
    }

    /// Closes the child's standard input (it reads its end).
    public func closeInput() {
        try? input?.close()
    }

    public var stdout: String { (try? String(contentsOfFile: stdoutPath, encoding: .utf8)) ?? "" }
    public var stderr: String { (try? String(contentsOfFile: stderrPath, encoding: .utf8)) ?? "" }

    /// Waits for the exit under a deadline (then kills it and records an issue).
    @discardableResult
    public func wait(timeout: Double = 60, sourceLocation: SourceLocation = #_sourceLocation) async -> Int32 {
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

    public func terminate() {
        if process.isRunning { Glibc.kill(process.processIdentifier, SIGTERM) }
    }

    /// Ends the process at once (for servers of other implementations, which may ignore SIGTERM).
    public func kill() {
        if process.isRunning {
            Glibc.kill(process.processIdentifier, SIGKILL)
            process.waitUntilExit()
        }
    }

    /// Nothing a test started outlives it.
    deinit { kill() }
}

extension Child {
    /// Runs `executable` to its end (under the deadline of `wait`) in a scratch directory of
    /// its own, and returns its exit status and output.
    public static func run(_ executable: String, _ arguments: [String], environment: [String: String]? = nil,
                           stdin: String? = nil, timeout: Double = 60, workingDirectory: String? = nil,
                           sourceLocation: SourceLocation = #_sourceLocation) async throws -> (code: Int32, stdout: String, stderr: String) {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("tb-child-\(UUID().uuidString.prefix(8))").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let child = try Child(executable, arguments, environment: environment, directory: directory, stdin: stdin,
                              workingDirectory: workingDirectory)
        let code = await child.wait(timeout: timeout, sourceLocation: sourceLocation)
        return (code, child.stdout, child.stderr)
    }
}
