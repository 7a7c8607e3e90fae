#if canImport(Glibc)
import Glibc
#endif
import Basics
import Varlink

/// Which scheme a registry's credential request stands for. The docker-credential protocol names
/// a registry by its bare host (`registry.example.com:5000`), and the tools speaking it (docker,
/// podman, skopeo, buildah) go over plain HTTP to a registry they take as insecure, after or
/// instead of HTTPS. So a bare host is asked for as `https://` only when the registry cannot be
/// reached in clear by the tool that asks; otherwise as `http://`, which only a `Serves=` entry
/// written `http://` answers. When in doubt, plain HTTP (and so, for an https entry, not found).
///
/// A registry may be plain HTTP when:
/// - its host is a loopback address or `localhost` (docker's engine treats 127.0.0.0/8 as insecure
///   without being told);
/// - the tool that runs this helper was started with TLS verification off (`--tls-verify=false`,
///   `--src-tls-verify=false`, `--dest-tls-verify=false`: skopeo, podman, buildah), read from its
///   command line (`/proc/PPID/cmdline`);
/// - a containers `registries.conf` (`$CONTAINERS_REGISTRIES_CONF`, `/etc/containers/`,
///   `~/.config/containers/`, their `registries.conf.d/*.conf`) names the host and sets `insecure`
///   anywhere (read as text: any file that could mark it insecure does);
/// - docker's `daemon.json` (`/etc/docker/`, `~/.config/docker/`) lists it, or a network holding its
///   address, in `insecure-registries`.
///
/// Every file is read up to `fileLimit` bytes, at most `maximumDropIns` drop-ins per directory.
struct RegistryTransport {
    /// Reads a whole file, up to a limit (nil: missing, unreadable, or larger).
    var file: (String, Int) -> [UInt8]?
    /// The names in a directory (nil: none).
    var directory: (String) -> [String]?
    var variable: (String) -> String?
    /// The arguments of the process that runs this helper.
    var parentArguments: () -> [String]

    static let fileLimit = 1 << 20
    static let maximumDropIns = 64

    static var process: RegistryTransport {
        RegistryTransport(file: readFile, directory: listDirectory, variable: { getenv($0).map { String(cString: $0) } },
                          parentArguments: { readFile("/proc/\(getppid())/cmdline", 1 << 16).map(arguments) ?? [] })
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
        if url.host == "localhost" || Self.isLoopback(url.host) { return true }
        if parentArguments().contains(where: Self.turnsVerificationOff) { return true }
        return registriesConfigurations().contains { Self.containersMarkInsecure($0, host: url.host) }
            || dockerConfigurations().contains { Self.dockerMarksInsecure($0, url) }
    }

    // MARK: - The tool's command line

    /// `--tls-verify=false` and its `--src-`/`--dest-` forms, with every false value Go's
    /// `strconv.ParseBool` reads (pflag's booleans take their value after `=` only).
    static func turnsVerificationOff(_ argument: String) -> Bool {
        guard argument.hasPrefix("--"), let equals = argument.firstIndex(of: "="), argument[..<equals].hasSuffix("tls-verify") else { return false }
        return ["0", "f", "F", "false", "FALSE", "False"].contains(argument[argument.index(after: equals)...])
    }

    // MARK: - containers-registries.conf(5)

    private func registriesConfigurations() -> [[UInt8]] {
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
            let names = (directory(folder) ?? []).filter { $0.hasSuffix(".conf") }.sorted().prefix(Self.maximumDropIns)
            files += names.map { folder + "/" + $0 }
        }
        return files.compactMap { file($0, Self.fileLimit) }
    }

    /// A file that names `host` (anywhere outside comments) and says `insecure` anywhere: its
    /// tables are not read, so a file that might mark the registry insecure is taken to.
    static func containersMarkInsecure(_ text: [UInt8], host: String) -> Bool {
        let lines = text.split(separator: UInt8(ascii: "\n")).filter { line in line.first { $0 != 0x20 && $0 != 0x09 } != UInt8(ascii: "#") }
        let content = lines.map { String(decoding: $0, as: UTF8.self).lowercased() }
        return content.contains { $0.contains("insecure") } && content.contains { $0.contains(host) }
    }

    // MARK: - docker's daemon.json

    private func dockerConfigurations() -> [[UInt8]] {
        let home = variable("HOME").flatMap { $0.isEmpty ? nil : $0 }
        let user = variable("XDG_CONFIG_HOME").flatMap { $0.hasPrefix("/") ? $0 : nil } ?? home.map { $0 + "/.config" }
        return (["/etc/docker/daemon.json"] + (user.map { [$0 + "/docker/daemon.json"] } ?? [])).compactMap { file($0, Self.fileLimit) }
    }

    /// `insecure-registries` lists the registry (`host[:port]`) or a network holding its address;
    /// a file that cannot be read as JSON is taken to, when it says `insecure-registries` at all.
    static func dockerMarksInsecure(_ text: [UInt8], _ url: StrictURL) -> Bool {
        guard case let .object(settings)? = try? JSONParser.parse(text[...]) else {
            return String(decoding: text, as: UTF8.self).contains("insecure-registries")
        }
        guard case let .array(entries)? = settings["insecure-registries"] else { return false }
        return entries.contains { entry in
            guard let entry = entry.stringValue?.lowercased() else { return false }
            if entry.contains("/") { return contains(network: entry, url.host) }
            return entry == url.host || entry == url.authority
        }
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

    static func isLoopback(_ host: String) -> Bool {
        contains(network: "127.0.0.0/8", host) || contains(network: "::1/128", host)
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

    private static func listDirectory(_ path: String) -> [String]? {
        guard let handle = opendir(path) else { return nil }
        defer { closedir(handle) }
        var names: [String] = []
        while let entry = readdir(handle), names.count < 4 * maximumDropIns {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            if name != "." && name != ".." { names.append(name) }
        }
        return names
    }

    private static func arguments(_ bytes: [UInt8]) -> [String] {
        bytes.split(separator: 0).map { String(decoding: $0, as: UTF8.self) }
    }
}
