#if canImport(Glibc)
import Glibc
#endif
import Foundation
import Testing

/// The smallest root a `systemd-nspawn` container runs a shell in: the host's /usr bound
/// read-only over it (`--bind-ro=/usr`), the usual links into it, an os-release and an empty
/// machine-id, and `directories` made for the test's binds.
enum ContainerRoot {
    /// Whether systemd-nspawn is here; when not, an issue says so (make test-deps installs it).
    static func nspawnAvailable(sourceLocation: SourceLocation = #_sourceLocation) -> Bool {
        guard access("/usr/bin/systemd-nspawn", X_OK) == 0 else {
            Issue.record("systemd-nspawn is missing (make test-deps installs systemd-container)", sourceLocation: sourceLocation)
            return false
        }
        return true
    }

    static func make(at root: String, directories: [String]) throws {
        for directory in ["etc", "usr", "proc", "sys", "dev", "run", "tmp", "var/tmp"] + directories {
            try FileManager.default.createDirectory(atPath: root + "/" + directory, withIntermediateDirectories: true)
        }
        for (name, target) in [("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")] {
            try FileManager.default.createSymbolicLink(atPath: root + "/" + name, withDestinationPath: target)
        }
        try FileManager.default.copyItem(atPath: "/usr/lib/os-release", toPath: root + "/etc/os-release")
        _ = FileManager.default.createFile(atPath: root + "/etc/machine-id", contents: Data())
    }
}
