#if canImport(Glibc)
import Glibc
#endif
import Sealing
import TokenBrokerCore
import Varlink

/// The key that seals the tokens (and DPoP keys) in the state database, and where it came from.
///
/// The sources, in order; the first one found is the key in force:
/// 1. the operator's: `StateKeyFile=` or `StateKeyCredential=`;
/// 2. the systemd credential `tokenbroker.default-state-key` in `$CREDENTIALS_DIRECTORY`: the
///    package's unit loads it with `LoadCredentialEncrypted=` from `/etc/credstore.encrypted/`,
///    where the package made it at installation with `systemd-creds encrypt` (the host key, and
///    the TPM2 where there is one);
/// 3. `state.key` in the state directory (mode 0600, the daemon's user's), made at the first
///    start that finds none of these (without systemd, or where the package could not make the
///    credential; development mode and tests with a state directory).
///
/// The keys found after the first are former keys: a database sealed under one of them (a key
/// in force before the operator set one, say) is sealed again under the key in force. A new
/// `state.key` is made only where no key is found and the database holds no sealed value, and
/// never over an existing file: a key that was used is never silently replaced.
struct StateKey: Sendable {
    enum Source: Sendable, Equatable, CustomStringConvertible {
        /// `StateKeyFile=` or `StateKeyCredential=`.
        case configured
        /// The package's credential, at this path.
        case credential(String)
        /// The state directory's key file.
        case file(String)

        var description: String {
            switch self {
            case .configured: "StateKeyFile=/StateKeyCredential="
            case let .credential(path): "the systemd credential \(path)"
            case let .file(path): path
            }
        }
    }

    let cipher: TokenCipher
    let source: Source

    /// The package's credential: its name in `$CREDENTIALS_DIRECTORY`, and in
    /// `/etc/credstore.encrypted/` (not `tokenbroker.state-key`, the name the unit's comments
    /// suggest for an operator's key in clear in `/etc/credstore/`, which
    /// `LoadCredentialEncrypted=` would find too and fail to decrypt).
    static let credentialName = "tokenbroker.default-state-key"
    /// Where the package keeps it.
    static let credentialStore = "/etc/credstore.encrypted/" + credentialName
    /// The key file in the state directory.
    static let fileName = "state.key"
}

/// Why no state key can be had, or the database does not open under any found: a configuration
/// error (exit 78), never answered by making a new key. Names files, never a key.
struct StateKeyProblem: Error, Sendable, CustomStringConvertible {
    let description: String
}

extension StateKey {
    /// Every state key found, the one in force first (an unreadable or malformed source is an
    /// error, not skipped: the next one might be a different key). `warn` hears of a key file
    /// its group may read.
    static func find(configured: SecretBytes?, directory: String, credentials: String?,
                     warn: (String) -> Void) throws(StateKeyProblem) -> [StateKey] {
        var keys: [StateKey] = []
        if let configured {
            // (Read and checked by the configuration.)
            keys.append(StateKey(cipher: try cipher(configured.reveal,
                                                    "StateKeyFile=/StateKeyCredential="), source: .configured))
        }
        if let credentials, !credentials.isEmpty {
            let path = credentials + "/" + credentialName
            switch FileSystem.readBytes(path) {
            case let .success(bytes):
                keys.append(StateKey(cipher: try cipher(bytes, path), source: .credential(path)))
            case let .failure(error) where error.errno == ENOENT:
                break
            case let .failure(error):
                throw StateKeyProblem(description: "cannot read the state key credential: \(error)")
            }
        }
        let path = directory + "/" + fileName
        // Never through a symbolic link: the file is the daemon's own, in its own directory.
        switch FileSystem.readSecret(path, flags: O_NOFOLLOW) {
        case let .success(file):
            if let refusal = file.access.refusal(path) { throw StateKeyProblem(description: "the state key file \(refusal)") }
            // The daemon's own, or the state directory owner's (root running the daemon on the
            // service's directory): nobody else may have put it there.
            var directoryInfo = stat()
            let directoryOwner = stat(directory, &directoryInfo) == 0 ? directoryInfo.st_uid : geteuid()
            guard file.owner == geteuid() || file.owner == directoryOwner else {
                throw StateKeyProblem(description: "the state key file \(path) belongs to uid \(file.owner), not to the daemon's user "
                                      + "(uid \(geteuid())) or the state directory's owner (uid \(directoryOwner))")
            }
            if let warning = file.access.warning(path) { warn("the state key file \(warning)") }
            keys.append(StateKey(cipher: try cipher(file.bytes, path), source: .file(path)))
        case let .failure(error) where error.errno == ENOENT:
            break
        case let .failure(error) where error.errno == ELOOP:
            throw StateKeyProblem(description: "the state key file \(path) is a symbolic link; refusing to follow it")
        case let .failure(error):
            throw StateKeyProblem(description: "cannot read the state key file: \(error)")
        }
        return keys
    }

    /// Makes `state.key` in `directory`: a new key written to a temporary file (0600, made
    /// exclusively, never through a link), fsynced, then linked into place — `link` fails when
    /// any file, a symbolic link included, has the name, so an existing key is never replaced —
    /// and the directory fsynced. The caller holds the state directory's lock.
    static func make(in directory: String) throws(StateKeyProblem) -> StateKey {
        let path = directory + "/" + fileName
        let temporary = directory + "/." + fileName + ".new"
        func failure(_ what: String, _ code: Int32 = errno) -> StateKeyProblem {
            StateKeyProblem(description: "cannot make the state key \(path): \(what): \(String(cString: strerror(code)))")
        }
        let material: [UInt8]
        do { material = try TokenCipher.newKeyMaterial() } catch { throw StateKeyProblem(description: "cannot make the state key \(path): \(error)") }
        // A leftover of a start that stopped half-way (under the same lock), never linked in.
        unlink(temporary)
        let fd = open(temporary, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw failure("create \(temporary)") }
        let bytes = material + [0x0A]
        var written = 0
        while written < bytes.count {
            let n = bytes[written...].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
            if n > 0 {
                written += n
            } else if n < 0 && errno != EINTR {
                let code = errno
                close(fd)
                unlink(temporary)
                throw failure("write \(temporary)", code)
            }
        }
        // (0600 whatever the umask; fsync before the name appears, so a crash leaves no empty key.)
        guard fchmod(fd, 0o600) == 0, fsync(fd) == 0 else {
            let code = errno
            close(fd)
            unlink(temporary)
            throw failure("fsync \(temporary)", code)
        }
        close(fd)
        guard link(temporary, path) == 0 else {
            let code = errno
            unlink(temporary)
            throw failure(code == EEXIST ? "a file of that name appeared" : "link", code)
        }
        unlink(temporary)
        let directoryFD = open(directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if directoryFD >= 0 {
            fsync(directoryFD)
            close(directoryFD)
        }
        return StateKey(cipher: try cipher(material, path), source: .file(path))
    }

    private static func cipher(_ bytes: [UInt8], _ origin: String) throws(StateKeyProblem) -> TokenCipher {
        do { return try TokenCipher(keyMaterial: bytes) } catch { throw StateKeyProblem(description: "the state key in \(origin): \(error)") }
    }
}
