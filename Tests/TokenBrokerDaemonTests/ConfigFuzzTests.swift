import Testing
import TestSupport
@testable import TokenBrokerDaemon

/// Configuration text built at random from hostile pieces — huge numbers, odd units, non-ASCII
/// digits, letters whose upper case is two letters, broken sections and continuations — and
/// byte mutations of a valid file: loading ends in a configuration or a `file:line` error,
/// never a trap (a reload with a typo must keep the old configuration, not crash the daemon).
/// `TB_FUZZ_ITERATIONS` (default 20,000) and `TB_FUZZ_SEED` (printed).
@Suite("Configuration fuzzing")
struct ConfigFuzzTests {
    static let keys = ["Socket", "SocketMode", "SocketGroup", "AdminGroup", "MaxConnections", "MaxMessageSize", "StateKeyFile",
                       "Name", "Upstream", "TestTokenLifetime", "Grant", "Issuer", "TokenEndpoint", "RevocationEndpoint",
                       "DeviceAuthorizationEndpoint", "ClientID", "ClientSecretFile", "ClientSecret", "ClientAuthentication", "Scope",
                       "CAFile", "ConnectTimeout", "RequestTimeout", "RevokeOnLogout", "AllowUsers", "AllowGroups", "RefreshAhead",
                       "RefreshLimitBurst", "RefreshLimitInterval", "BackoffInitial", "BackoffMax", "Unknown", "Ä", "1"]
    static let values = ["", "0", "1", "-1", "1ß", "99999999999999G", "99999999999999999999999d", "9223372036854775807",
                         "9223372036854775808", "1e400", "nan", "inf", "1.5.5s", "٣s", "1h 30min", "5 parsecs", "0x10", "1K", "64M",
                         "1m 1m 1m 1m", ".", "s", "0660", "99999999", "root", "nobody", "65534", "4294967295", "4294967296",
                         "no-such-user", "oauth", "test", "yes", "maybe", "client_credentials", "https://as.example/token",
                         "http://127.0.0.1.attacker.example/", "http://[::1]/t", "ftp://x/", "/nonexistent/secret", "relative/path",
                         "api", "a b", "é", "\u{202E}x", String(repeating: "9", count: 300), String(repeating: "x", count: 100),
                         "\\", "=", "[", "#comment", "1 h", "2  d", "100y", "1.7976931348623157e308s"]
    static let sections = ["[Broker]", "[Session]", "[Other]", "[]", "[Se ssion]", "[Session", "Session]", ""]

    static func text(_ random: inout SeededRandom) -> String {
        var lines: [String] = []
        for _ in 0..<(1 + Int(random.next() % 12)) {
            switch random.next() % 6 {
            case 0: lines.append(random.pick(sections))
            case 1: lines.append("Name=" + random.pick(["api", "x", "", "é", "a.b-c_d"]))
            default:
                var line = random.pick(keys) + random.pick(["=", " = ", "= ", "==", ""]) + random.pick(values)
                if random.next() % 10 == 0 { line += " \\" }
                lines.append(line)
            }
        }
        return lines.joined(separator: random.pick(["\n", "\r\n", "\n\n"]))
    }

    @Test("random and mutated configuration text loads or fails at file:line, never traps")
    func configurations() {
        let iterations = SeededRandom.iterations(default: 20_000)
        let seed = SeededRandom.seed()
        print("config fuzz: \(iterations) texts, TB_FUZZ_SEED=\(seed)")
        var random = SeededRandom(seed: seed)
        let valid = Array("[Broker]\nMaxMessageSize=64K\n[Session]\nName=api\nUpstream=test\nRefreshAhead=30s\nAllowUsers=0\n".utf8)
        var loaded = 0
        for index in 0..<iterations {
            let text: String
            if index % 4 == 0 {
                var bytes = valid
                for _ in 0..<(1 + Int(random.next() % 3)) {
                    let position = Int(random.next() % UInt64(bytes.count))
                    bytes[position] = random.pick(Array("=[]\\\n#0123456789KMGsdhß ".utf8) + [0xC3, 0xFF, 0x00])
                }
                text = String(decoding: bytes, as: UTF8.self)
            } else {
                text = Self.text(&random)
            }
            do {
                let configuration = try ConfigLoader.build(try INIFile.parse(text, file: "fuzz.conf"))
                loaded += 1
                #expect(configuration.maxMessageSize >= 1024)
            } catch {
                #expect(error.file == "fuzz.conf")
            }
        }
        print("config fuzz: \(loaded) of \(iterations) texts loaded")
    }

    @Test("time spans read byte by byte read as character by character")
    func durations() {
        var random = SeededRandom(seed: SeededRandom.seed())
        let pieces = ["0", "1", "9", "12", ".", "5.5", " ", "  ", "\t", "s", "ms", "min", "m", "h", "hr", "d", "days", "usec", "x", "S", "-", "1e3"]
        for _ in 0..<SeededRandom.iterations(default: 20_000) {
            let text = (0..<(1 + Int(random.next() % 6))).map { _ in random.pick(pieces) }.joined()
            #expect(ConfigValue.duration(text) == ConfigValue.characterDuration(text), "\(text)")
        }
    }

    @Test("the values that crashed the daemon are errors at file:line")
    func crashers() throws {
        for (text, message) in [("MaxMessageSize=1ß", "MaxMessageSize= needs a size"), ("MaxMessageSize=99999999999999G", "MaxMessageSize= needs a size")] {
            #expect(throws: ConfigError.self) { try ConfigLoader.build(try INIFile.parse("[Broker]\n" + text, file: "f")) }
            do {
                _ = try ConfigLoader.build(try INIFile.parse("[Broker]\n" + text, file: "f"))
            } catch {
                #expect(error.description.hasPrefix("f:2: " + message), "\(error)")
            }
        }
        do {
            _ = try ConfigLoader.build(try INIFile.parse("[Session]\nName=a\nUpstream=test\nRefreshAhead=99999999999999999999999d", file: "f"))
            Issue.record("accepted")
        } catch {
            #expect(error.description.hasPrefix("f:4: RefreshAhead= needs a time span"), "\(error)")
        }
        #expect(ConfigValue.size("99999999999999G") == nil && ConfigValue.size("1ß") == nil && ConfigValue.size("8g") == 8 << 30)
        #expect(ConfigValue.duration("99999999999999999999999d") == nil && ConfigValue.duration("٣s") == nil)
        #expect(ConfigValue.duration("100y") == nil && ConfigValue.duration("36500d") == .seconds(36500 * 86400))
    }
}
