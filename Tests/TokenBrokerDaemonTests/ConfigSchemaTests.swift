import Foundation
import Testing
import TokenBrokerCore
@testable import TokenBrokerDaemon
@testable import TokenBrokerDaemonCommand

/// The configuration table is the one list of keys: the shipped files, the man page and
/// doc/configuration.md name exactly its keys, section by section; reload equality and
/// `check-config --keys` follow it.
@Suite("The configuration table")
struct ConfigSchemaTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    static func read(_ path: String) throws -> String {
        try String(contentsOf: root.appendingPathComponent(path), encoding: .utf8)
    }

    static var table: [String: Set<String>] {
        [
            "Broker": Set(ConfigSchema.broker.map(\.name)),
            "Session": Set(ConfigSchema.session.map(\.name)),
            "Fleet": Set(ConfigSchema.fleet.map(\.name)),
            "Delegation": Set(ConfigSchema.delegation.map(\.name)),
            "Output": Set(ConfigSchema.output.map(\.name)),
        ]
    }

    /// `Key=` at the start of a line, commented out or not, by the section above it (`[X]` or `#[X]`).
    static func assignments(_ text: String) -> [String: Set<String>] {
        var found: [String: Set<String>] = [:]
        var section = ""
        for line in text.split(separator: "\n") {
            var body = Substring(line)
            if body.hasPrefix("#") { body = body.dropFirst() }
            if body.hasPrefix("["), let end = body.firstIndex(of: "]") {
                section = String(body[body.index(after: body.startIndex)..<end])
                continue
            }
            guard let equals = body.firstIndex(of: "="), !body[..<equals].isEmpty,
                  body[..<equals].allSatisfy({ $0.isLetter || $0.isNumber }), body.first?.isUppercase == true else { continue }
            found[section, default: []].insert(String(body[..<equals]))
        }
        return found
    }

    @Test("config/tokenbroker.conf and the example drop-in show exactly the table's keys, each in its section")
    func shippedFiles() throws {
        var shown = Self.assignments(try Self.read("config/tokenbroker.conf"))
        shown.merge(Self.assignments(try Self.read("config/tokenbroker.conf.d/example.conf"))) { $0.union($1) }
        let example = try Self.read("config/tokenbroker.conf.d/example.conf")
        for (section, keys) in Self.table {
            // ClientSecret= is named in a comment only: putting a secret in the file is discouraged.
            let mentioned = section == "Session" ? keys.filter { example.contains("\($0)=") } : keys
            #expect(mentioned == keys, "[\(section)] keys the shipped files never name: \(keys.subtracting(mentioned).sorted())")
            let assigned = shown[section] ?? []
            #expect(assigned.isSubset(of: keys), "[\(section)] keys the shipped files show that the table lacks: \(assigned.subtracting(keys).sorted())")
            #expect(keys.subtracting(assigned).isSubset(of: ["ClientSecret"]),
                    "[\(section)] keys not shown at their default: \(keys.subtracting(assigned).sorted())")
        }
    }

    @Test("the man page lists exactly the table's keys, section by section")
    func manPage() throws {
        let page = try Self.read("doc/tokenbroker.8")
        var listed: [String: Set<String>] = [:]
        let lines = page.split(separator: "\n", omittingEmptySubsequences: false)
        for (index, line) in lines.enumerated() where line.hasPrefix(".B [") && index + 1 < lines.count {
            let section = String(line.dropFirst(4).dropLast())
            listed[section] = Set(lines[index + 1].split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }
                .map { $0.hasSuffix("=") ? String($0.dropLast()) : $0 })
        }
        for (section, keys) in Self.table {
            let missing = keys.subtracting(listed[section] ?? []).sorted(), unknown = (listed[section] ?? []).subtracting(keys).sorted()
            #expect(listed[section] == keys, "man page [\(section)]: missing \(missing), unknown \(unknown)")
        }
    }

    @Test("doc/configuration.md has a row for exactly the table's keys; [Broker] rows say *start* exactly for keys read at start")
    func referencePage() throws {
        let page = try Self.read("doc/configuration.md")
        var rows: [String: Set<String>] = [:]
        var atStart: Set<String> = []
        var section = ""
        for line in page.split(separator: "\n") {
            if line.hasPrefix("## ["), let end = line.firstIndex(of: "]") {
                section = String(line[line.index(line.startIndex, offsetBy: 4)..<end])
                continue
            }
            guard line.hasPrefix("| `"), let first = line.dropFirst(2).split(separator: "|").first else { continue }
            let keys = first.split(separator: "`").filter { $0.hasSuffix("=") }.map { String($0.dropLast()) }
            rows[section, default: []].formUnion(keys)
            if section == "Broker", line.contains("*start*") { atStart.formUnion(keys) }
        }
        for (section, keys) in Self.table {
            let missing = keys.subtracting(rows[section] ?? []).sorted(), unknown = (rows[section] ?? []).subtracting(keys).sorted()
            #expect(rows[section] == keys, "doc/configuration.md [\(section)]: missing \(missing), unknown \(unknown)")
        }
        #expect(atStart == Set(ConfigSchema.broker.filter { $0.change == .atStart }.map(\.name)))
    }

    @Test("check-config --keys prints every key of the table under its section")
    func keyReference() {
        var out = ""
        var err = ""
        #expect(TokenBrokerCommand.run(["check-config", "--keys"], output: &out, errors: &err) == 0)
        var section = ""
        var printed: [String: Set<String>] = [:]
        for line in out.split(separator: "\n") {
            if line.hasPrefix("[") {
                section = String(line.dropFirst().dropLast())
            } else if line.hasPrefix("  "), !line.hasPrefix("   "), let equals = line.firstIndex(of: "=") {
                printed[section, default: []].insert(String(line[..<equals].dropFirst(2)))
            }
        }
        #expect(printed == Self.table)
        #expect(out.contains("  RefreshAhead=  a time span from 0s to 1d; default 60s; a reload rebuilds the session"))
    }

    @Test("reload equality follows the table: access lists keep the session, every other session key rebuilds it")
    func reloadEquality() throws {
        func session(_ lines: String) throws -> SessionConfiguration {
            try #require(ConfigLoader.build(INIFile.parse("[Session]\nName=api\nUpstream=test\n" + lines, file: "f")).sessions.first)
        }
        let base = try session("")
        #expect(!(try session("AllowUsers=0\nAllowGroups=0\n")).needsNewCoordinator(comparedTo: base))
        #expect(try session("AllowUsers=0\n") != base)
        for change in ["RefreshAhead=30s", "TestTokenLifetime=2h", "BackoffMax=10min", "RefreshLimitBurst=3", "Scope=x", "ClientID=other"] {
            #expect(try session(change + "\n").needsNewCoordinator(comparedTo: base), "\(change)")
        }
        // The same values written differently are the same setting.
        #expect(!(try session("RefreshAhead=1min\n")).needsNewCoordinator(comparedTo: try session("RefreshAhead=60s\n")))
        // Every key that rebuilds is seen to differ by its own comparison.
        for key in ConfigSchema.session where key.change == .rebuildsSession {
            #expect(key.same(base.settings, base.settings), "\(key.name)")
        }
    }

    @Test("an unknown key names the key it probably meant")
    func suggestion() throws {
        let configuration = try ConfigLoader.build(INIFile.parse("[Broker]\nMaxConection=5\n[Session]\nName=a\nUpstream=test\nrefreshahead=1s\n",
                                                                 file: "f"))
        #expect(configuration.warnings.map(\.description) == [
            "f:2: unknown key MaxConection= in [Broker], ignored (did you mean MaxConnections=?)",
            "f:6: unknown key refreshahead= in [Session] a, ignored (did you mean RefreshAhead=?)",
        ])
    }

    @Test("Serves= entries: a bare one means https on any port; http only when written; a request must name its scheme; one user part at most; ports are digits; paths at segment boundaries; nothing two URL readers read differently")
    func servedURLs() throws {
        func matches(_ entry: String, _ url: String) throws -> Bool {
            try #require(ServedURL(entry)).specificity(for: try #require(ServedURL(url))) != nil
        }
        #expect(try matches("git.example.test", "https://git.example.test:8443/a"))
        #expect(try !matches("git.example.test", "http://git.example.test/a"))
        #expect(try matches("http://127.0.0.1:8080", "http://127.0.0.1:8080/x"))
        #expect(try !matches("http://127.0.0.1:8080", "https://127.0.0.1:8080"))
        // A request without a scheme may go over either: no entry answers it (issue 32: pip's
        // netloc and skopeo's bare host took an https entry's token to a plain-http server).
        #expect(try !matches("git.example.test", "git.example.test") && !matches("127.0.0.1:8443", "127.0.0.1:8443"))
        #expect(try !matches("http://127.0.0.1:8080", "127.0.0.1:8080"))
        #expect(try matches("https://h/org", "https://h/org/repo") && !matches("https://h/org", "https://h/organization"))
        #expect(try matches("h:6443", "https://h:6443") && !matches("h:6443", "https://h"))
        #expect(try matches("https://h", "https://user@h/x"))
        for refused in ["https://a@b@h/", "h:+443", "h:0", "https://h/a/../b", "https://h/./a", "", "h h", "https://[zz]/",
                        // WHATWG and urllib3 end the authority at a backslash: they reach 127.0.0.1.
                        #"http://127.0.0.1:8080\@good.test/api"#, #"https://good.test\.evil.test/"#, #"https://good.test/org\..\x"#,
                        // Encoded dot segments and slashes a server may resolve out of a path scope.
                        "https://h/org/%2e%2e/x", "https://h/org/%2E%2e/x", "https://h/org/..%2fx", "https://h/org/%2fx", "https://h/org/%5c..",
                        "https://h/org/..;/x", "https://h/org/%zz", "https://h/org/%2",
                        // What a proxy that decodes twice, or a lenient UTF-8 decoder, reads as a dot.
                        "https://h/org/%252e%252e/x", "https://h/org/..%00/x", "https://h/org/%c0%ae%c0%ae/x", "https://h/org/%C1%9C",
                        // Numbers that are IPv4 addresses to WHATWG and libcurl, names to RFC 3986.
                        "http://127.1/", "http://0x7f.0.0.1/", "http://2130706433/", "http://127.0.0.01/", "http://1.2.3.256/", "http://127.0.0.1./",
                        "h:8080:80", "https://h:/", "https://h:123456/"] {
            #expect(ServedURL(refused) == nil, "\(refused)")
        }
        for kept in ["https://h/org/%41", "https://h/org/a.b", "https://h/org/...", "https://v1.example.test/", "https://127.0.0.1/", "https://[::1]:8443/",
                     "https://h/org/caf%C3%A9"] {
            #expect(ServedURL(kept) != nil, "\(kept)")
        }
    }

    /// Each written default, read by its own key, leaves a fresh section's settings as they
    /// were: the default the table documents is the one in force (written once, in the
    /// settings; the table's text must agree with it).
    static func defaultsDisagreeing<Settings>(_ keys: [ConfigKey<Settings>], fresh: Settings) -> [String] {
        var context = ConfigContext()
        // (A default told in words, "the host name", is no value to read.)
        return keys.filter { !$0.defaultValue.isEmpty && !$0.defaultValue.hasPrefix("the ") }.compactMap { key in
            var settings = fresh
            do {
                try key.apply(&settings, INIEntry(key: key.name, value: key.defaultValue, file: "default", line: 1), &context)
            } catch {
                return "\(key.name)=\(key.defaultValue): \(error)"
            }
            return key.same(settings, fresh) ? nil : "\(key.name)=\(key.defaultValue) differs from the setting in force when it is not written"
        }
    }

    @Test("every default the table documents is the one in force when the key is not written (issue 34)")
    func defaultsAgree() {
        var problems = Self.defaultsDisagreeing(ConfigSchema.broker, fresh: BrokerConfiguration())
        problems += Self.defaultsDisagreeing(ConfigSchema.session, fresh: SessionSettings(name: "s"))
        problems += Self.defaultsDisagreeing(ConfigSchema.fleet, fresh: FleetDraft())
        #expect(problems.isEmpty, "\(problems)")
        #expect(ConfigSchema.reference.flatMap(\.keys).filter { !$0.defaultValue.isEmpty }.count > 20)
    }
}
