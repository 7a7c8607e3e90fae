#if canImport(Glibc)
import Glibc
#endif

/// Where command output goes: standard output or error in the binary, a string in tests.
public protocol TextOutput {
    mutating func write(_ text: String)
}

/// A file descriptor as a `TextOutput`.
public struct FileOutput: TextOutput, Sendable {
    public let fd: Int32
    public static let standardOutput = FileOutput(fd: 1)
    public static let standardError = FileOutput(fd: 2)

    public mutating func write(_ text: String) {
        var bytes = Array(text.utf8)
        var offset = 0
        while offset < bytes.count {
            let n = bytes.withUnsafeMutableBytes { Glibc.write(fd, $0.baseAddress! + offset, $0.count - offset) }
            if n > 0 { offset += n } else if n < 0 && errno == EINTR { continue } else { return }
        }
    }
}

extension String: TextOutput {}
