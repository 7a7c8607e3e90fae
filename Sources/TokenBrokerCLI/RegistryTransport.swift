#if canImport(Glibc)
import Glibc
#endif
import Basics
import Varlink

/// Which scheme a registry's credential request stands for. The docker-credential protocol names
/// a registry by its bare host (`registry.example.com:5000`), and the tools speaking it (docker,
/// podman, skopeo, buildah, crane, oras, …) go over plain HTTP to a registry they take as
/// insecure, after or instead of HTTPS. So a bare host is asked for as `https://` only when
/// nothing says the tool could reach the registry in clear; otherwise as `http://`, which only a
/// `Serves=` entry written `http://` answers. When in doubt, plain HTTP (and so, for an https
/// entry, not found).
///
/// A registry may be plain HTTP when:
/// - its host is a loopback address (in any spelling: `[::ffff:127.0.0.1]` too) or `localhost`,
///   `*.localhost` (docker's engine treats loopback as insecure without being told);
/// - the tool that runs this helper, or a process above it (a shell that did not `exec`, up to
///   `mostAncestors`), was started with TLS verification off: `--tls-verify=false` and its
///   `--src-`/`--dest-` forms (skopeo, podman, buildah), `--insecure` (crane, cosign, ko),
///   `--plain-http` (oras, helm); or its command line cannot be read (`/proc/PID/cmdline`);
/// - the tool is the docker CLI and the engine's command line names the registry with
///   `--insecure-registry`, or cannot be read, or `DOCKER_HOST` names an engine elsewhere;
/// - a containers `registries.conf` (`$CONTAINERS_REGISTRIES_CONF`, `/etc/containers/`,
///   `~/.config/containers/`, their `registries.conf.d/*.conf`, more than `maximumDropIns` of
///   which is doubt) names the host, or a `*.domain` holding it, and sets `insecure` anywhere
///   (read as text: any file that could mark it insecure does);
/// - docker's `daemon.json` (`/etc/docker/`, `~/.config/docker/`, the engine's `--config-file`)
///   lists it, with or without a scheme, in `insecure-registries`, or lists a network there (a
///   name may resolve into it).
///
/// Not read: settings the engine or a tool takes from elsewhere (a `--registries-conf` of
/// another path, a remote engine's own settings beyond `DOCKER_HOST`). Every file is read up to
/// `fileLimit` bytes.
struct RegistryTransport {
    /// Reads a whole file, up to a limit (nil: missing, unreadable, or larger).
    var file: (String, Int) -> [UInt8]?
    /// The names in a directory (nil: none).
    var directory: (String) -> [String]?
    var variable: (String) -> String?
    /// The command lines of the process that runs this helper and of those above it, nearest
    /// first (nil: the nearest cannot be read).
    var toolArguments: () -> [[String]]?
    /// The docker engine's command line (nil: no engine runs here, or it cannot be read).
    var engineArguments: () -> [String]?

    static let fileLimit = 1 << 20
    static let maximumDropIns = 64
    static let mostAncestors = 8
    static let longestCommandLine = 1 << 16

    static var process: RegistryTransport {
        RegistryTransport(file: readFile, directory: listDirectory, variable: { getenv($0).map { String(cString: $0) } },
                          toolArguments: { commandLines(from: getppid()) }, engineArguments: engineCommandLine)
    }

    /// The URL to ask the broker for, for the server a docker-protocol tool named (a bare host,
    /// or a URL such as `https://index.docker.io/v1/`); nil when it is no registry address.
    func requestURL(for server: String) -> String? {
        guard let url = StrictURL(server, requiringScheme: false, maximumLength: 2048), url.scheme == nil || url.scheme == "https" || url.scheme == "http"
        else { return nil }
        let scheme = url.scheme == "http" || mayBePlainHTTP(url) ? "http" : "https"
        return scheme + "://" + url.authority + url.path
    }

    /// Whether a tool could reach the registry at `url` over plain HTTP.
    func mayBePlainHTTP(_ url: StrictURL) -> Bool {
        if Self.isLocal(url.host) { return true }
        guard let tools = toolArguments() else { return true }
        if tools.joined().contains(where: Self.turnsVerificationOff) { return true }
        var dockerFiles = dockerConfigurations()
        if tools.contains(where: { $0.first.map(Self.isDockerCLI) ?? false }) {
            if let host = variable("DOCKER_HOST"), !host.isEmpty, !host.hasPrefix("unix://") { return true }
            guard let engine = engineArguments() else { return true }
            let (insecure, configFile) = Self.engineSettings(engine)
            if insecure.contains(where: { Self.entry($0, covers: url) }) { return true }
            if let configFile {
                guard let text = file(configFile, Self.fileLimit) else { return true }
                dockerFiles.append(text)
            }
        }
        guard let registries = registriesConfigurations() else { return true }
        return registries.contains { Self.containersMarkInsecure($0, host: url.host) } || dockerFiles.contains { Self.dockerMarksInsecure($0, url) }
    }

    // MARK: - The tool's command line

    /// What turns TLS off, or verification: `--tls-verify=false` and its `--src-`/`--dest-`
    /// forms, with every false value Go's `strconv.ParseBool` reads (pflag's booleans take their
    /// value after `=` only); `--insecure` and `--plain-http`, bare or with a true value.
    static func turnsVerificationOff(_ argument: String) -> Bool {
        guard argument.hasPrefix("--") else { return false }
        let (name, value) = argument.firstIndex(of: "=").map { (argument[..<$0], Optional(argument[argument.index(after: $0)...])) } ?? (argument[...], nil)
        if name.hasSuffix("tls-verify") { return value.map { ["0", "f", "F", "false", "FALSE", "False"].contains($0) } ?? false }
        guard name == "--insecure" || name == "--plain-http" else { return false }
        return value.map { ["1", "t", "T", "true", "TRUE", "True"].contains($0) } ?? true
    }

    static func isDockerCLI(_ argument0: String) -> Bool {
        (argument0.split(separator: "/").last.map(String.init) ?? argument0) == "docker"
    }

    /// The engine's `--insecure-registry` values and its `--config-file`.
    static func engineSettings(_ arguments: [String]) -> (insecure: [String], configFile: String?) {
        var insecure: [String] = [], configFile: String?
        var index = 1
        while index < arguments.count {
            let argument = arguments[index]
            for (flag, keep) in [("--insecure-registry", true), ("--config-file", false)] {
                var value: String?
                if argument == flag, index + 1 < arguments.count {
                    value = arguments[index + 1]
                    index += 1
                } else if argument.hasPrefix(flag + "=") {
                    value = String(argument.dropFirst(flag.count + 1))
                }
                if let value { if keep { insecure.append(value) } else { configFile = value } }
            }
            index += 1
        }
        return (insecure, configFile)
    }

    // MARK: - containers-registries.conf(5)

    /// The registries.conf files there are (nil: more drop-ins than `maximumDropIns`: doubt).
    private func registriesConfigurations() -> [[UInt8]]? {
        let home = variable("HOME").flatMap { $0.isEmpty ? nil : $0 }
        let user = variable("XDG_CONFIG_HOME").flatMap { $0.hasPrefix("/") ? $0 : nil } ?? home.map { $0 + "/.config" }
        var files = ["/etc/containers/registries.conf"]
        var directories = ["/etc/containers/registries.conf.d"]
        if let chosen = variable("CONTAINERS_REGISTRIES_CONF"), !chosen.isEmpty { files.append(chosen) }
        if let user {
            files.append(user + "/containers/registries.conf")
            directories.append(user + "/containers/registries.conf.d")
        }
        for folder in directories {
            let names = (directory(folder) ?? []).filter { $0.hasSuffix(".conf") }
            guard names.count <= Self.maximumDropIns else { return nil }
            files += names.sorted().map { folder + "/" + $0 }
        }
        return files.compactMap { file($0, Self.fileLimit) }
    }

    /// A file that names `host`, or a `*.domain` holding it (anywhere outside comments), and says
    /// `insecure` anywhere: its tables are not read, so a file that might mark the registry
    /// insecure is taken to.
    static func containersMarkInsecure(_ text: [UInt8], host: String) -> Bool {
        let lines = text.split(separator: UInt8(ascii: "\n")).filter { line in line.first { $0 != 0x20 && $0 != 0x09 } != UInt8(ascii: "#") }
        let content = lines.map { String(decoding: $0, as: UTF8.self).lowercased() }
        guard content.contains(where: { $0.contains("insecure") }) else { return false }
        return content.contains { line in
            if line.contains(host) { return true }
            // Wildcards: `*.corp.example` holds `registry.corp.example`.
            return line.ranges(of: "*.").contains { found in
                let suffix = line[found.upperBound...].prefix { $0.isLetter || $0.isNumber || $0 == "." || $0 == "-" || $0 == "_" }
                return !suffix.isEmpty && host.hasSuffix("." + suffix)
            }
        }
    }

    // MARK: - docker's daemon.json

    private func dockerConfigurations() -> [[UInt8]] {
        let home = variable("HOME").flatMap { $0.isEmpty ? nil : $0 }
        let user = variable("XDG_CONFIG_HOME").flatMap { $0.hasPrefix("/") ? $0 : nil } ?? home.map { $0 + "/.config" }
        return (["/etc/docker/daemon.json"] + (user.map { [$0 + "/docker/daemon.json"] } ?? [])).compactMap { file($0, Self.fileLimit) }
    }

    /// `insecure-registries` lists the registry (`host[:port]`, with or without a scheme) or a
    /// network (which a name may resolve into); a file that cannot be read as JSON is taken to,
    /// when it says `insecure-registries` at all.
    static func dockerMarksInsecure(_ text: [UInt8], _ url: StrictURL) -> Bool {
        guard case let .object(settings)? = try? JSONParser.parse(text[...]) else {
            return String(decoding: text, as: UTF8.self).contains("insecure-registries")
        }
        guard case let .array(entries)? = settings["insecure-registries"] else { return false }
        return entries.contains { $0.stringValue.map { entry($0, covers: url) } ?? false }
    }

    /// Whether an insecure-registry entry (docker's: `host[:port]`, a URL of one, or a network)
    /// covers the registry at `url`.
    static func entry(_ text: String, covers url: StrictURL) -> Bool {
        var entry = Substring(text.lowercased())
        for scheme in ["http://", "https://"] where entry.hasPrefix(scheme) { entry = entry.dropFirst(scheme.count) }
        while entry.hasSuffix("/") { entry = entry.dropLast() }
        if entry.contains("/") {
            // A network: an address inside it, or any name (which may resolve into it).
            return bytes(of: url.host.hasPrefix("[") ? String(url.host.dropFirst().dropLast()) : url.host) == nil
                || contains(network: String(entry), url.host)
        }
        return entry == url.host || entry == url.authority
    }

    /// Whether `host` is an address inside `network` (`a.b.c.d/n` or `x::/n`).
    static func contains(network: String, _ host: String) -> Bool {
        let parts = network.split(separator: "/", maxSplits: 1)
        guard parts.count == 2, let bits = Int(parts[1]) else { return false }
        let bare = host.hasPrefix("[") ? String(host.dropFirst().dropLast()) : host
        guard let address = bytes(of: bare), let prefix = bytes(of: String(parts[0])), address.count == prefix.count,
              (0...address.count * 8).contains(bits) else { return false }
        for bit in 0..<bits where (address[bit / 8] ^ prefix[bit / 8]) & (0x80 >> UInt8(bit % 8)) != 0 { return false }
        return true
    }

    /// An IPv4 or IPv6 address's bytes (nil: not an address).
    private static func bytes(of text: String) -> [UInt8]? {
        var v4 = in_addr()
        if inet_pton(AF_INET, text, &v4) == 1 { return withUnsafeBytes(of: &v4) { Array($0) } }
        var v6 = in6_addr()
        if inet_pton(AF_INET6, text, &v6) == 1 { return withUnsafeBytes(of: &v6) { Array($0) } }
        return nil
    }

    /// Loopback, in any spelling docker reads as such: `localhost` and `*.localhost` (with or
    /// without the final dot), 127.0.0.0/8, `::1`, and 127.0.0.0/8 mapped into IPv6.
    static func isLocal(_ host: String) -> Bool {
        let name = host.hasSuffix(".") ? String(host.dropLast()) : host
        return name == "localhost" || name.hasSuffix(".localhost") || contains(network: "127.0.0.0/8", host) || contains(network: "::1/128", host)
            || contains(network: "::ffff:127.0.0.0/104", host)
    }

    // MARK: - Reading

    private static func readFile(_ path: String, _ limit: Int) -> [UInt8]? {
        let fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 8192)
        while true {
            let n = chunk.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
            if n < 0 && errno == EINTR { continue }
            guard n >= 0 else { return nil }
            if n == 0 { return bytes }
            bytes += chunk[0..<n]
            guard bytes.count <= limit else { return nil }
        }
    }

    /// The `.conf` names in a directory, one more than `maximumDropIns` at most (nil: none).
    private static func listDirectory(_ path: String) -> [String]? {
        guard let handle = opendir(path) else { return nil }
        defer { closedir(handle) }
        var names: [String] = []
        while let entry = readdir(handle), names.count <= maximumDropIns {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            if name.hasSuffix(".conf") { names.append(name) }
        }
        return names
    }

    /// The command lines of `pid` and the processes above it, nearest first, up to
    /// `mostAncestors` or the service manager (nil: `pid`'s own cannot be read, or is longer
    /// than `longestCommandLine`: doubt).
    static func commandLines(from pid: pid_t) -> [[String]]? {
        var lines: [[String]] = []
        var next = pid
        while next > 1, lines.count < mostAncestors {
            guard let line = readFile("/proc/\(next)/cmdline", longestCommandLine).map(arguments) else {
                if lines.isEmpty { return nil }
                break
            }
            lines.append(line)
            // The parent: the field after the command's name, which ends at the last ')'.
            guard let stat = readFile("/proc/\(next)/stat", 4096), let close = stat.lastIndex(of: UInt8(ascii: ")")) else { break }
            let fields = stat[(close + 1)...].split(separator: 0x20)
            guard fields.count > 1, let parent = Int32(String(decoding: fields[1], as: UTF8.self)) else { break }
            next = parent
        }
        return lines
    }

    /// The command line of the docker engine (`dockerd`) running here, if one is seen.
    static func engineCommandLine() -> [String]? {
        guard let handle = opendir("/proc") else { return nil }
        defer { closedir(handle) }
        var looked = 0
        while let entry = readdir(handle), looked < 100_000 {
            looked += 1
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            guard let first = name.utf8.first, (0x30...0x39).contains(first),
                  let comm = readFile("/proc/\(name)/comm", 64), comm == Array("dockerd\n".utf8) else { continue }
            return readFile("/proc/\(name)/cmdline", longestCommandLine).map(arguments)
        }
        return nil
    }

    private static func arguments(_ bytes: [UInt8]) -> [String] {
        bytes.split(separator: 0).map { String(decoding: $0, as: UTF8.self) }
    }
}
