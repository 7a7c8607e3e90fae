import Foundation
import Synchronization

/// Directories a test process made for its fixtures, removed when it exits: a fixture's
/// directory may be in use until the test's last line, so it is not removed when the fixture's
/// value goes away.
public enum ScratchDirectories {
    private static let paths = Mutex<[String]?>(nil)

    /// Removes `path` (and what is under it) when the process exits.
    public static func removeAtExit(_ path: String) {
        let first = paths.withLock { list -> Bool in
            defer { list = (list ?? []) + [path] }
            return list == nil
        }
        if first { atexit { ScratchDirectories.removeAll() } }
    }

    private static func removeAll() {
        for path in paths.withLock({ $0 ?? [] }) { try? FileManager.default.removeItem(atPath: path) }
    }
}
