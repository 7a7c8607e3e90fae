import Foundation
import Testing

/// ARCHITECTURE.md against `Package.swift`, as `ContractTests` holds the contract module against
/// its interface text: the module tables name every target that is not a test target, each once,
/// and each row's *Depends on* column names in backticks exactly the target's dependencies in
/// the package, all of them in rows above it (the tables go bottom up). Words without backticks
/// in that column are outside the package (the standard library, Glibc). The *Layout* section
/// names every directory under `Sources/` and `Tests/` and at the top of the tree, and every
/// relative link of the Markdown pages leads to a file.
@Suite struct ArchitectureTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    static func read(_ path: String) throws -> String {
        try String(contentsOf: root.appendingPathComponent(path), encoding: .utf8)
    }

    // MARK: - Package.swift

    /// One target of `Package.swift`: its kind (`target`, `systemLibrary`, `executableTarget`,
    /// `testTarget`), its name and the names its `dependencies:` list quotes.
    struct Target: Equatable {
        var kind: String
        var name: String
        var dependencies: [String]
    }

    static let kinds = ["target", "executableTarget", "systemLibrary", "testTarget", "binaryTarget", "plugin", "macro"]

    /// A line-oriented scan: a target starts on a line that begins with `.target(` (or another
    /// kind) and runs to the next one; comment lines are skipped.
    static func targets(inPackage text: String) -> [Target] {
        var chunks: [(kind: String, text: String)] = []
        for line in text.split(separator: "\n", omittingEmptySubsequences: false) {
            let trimmed = line.drop { $0 == " " || $0 == "\t" }
            if trimmed.hasPrefix("//") { continue }
            if let kind = kinds.first(where: { trimmed.hasPrefix(".\($0)(") }) {
                chunks.append((kind, String(trimmed)))
            } else if !chunks.isEmpty {
                chunks[chunks.count - 1].text += "\n" + trimmed
            }
        }
        return chunks.compactMap { chunk in
            guard let name = quoted(after: "name:", in: chunk.text).first else { return nil }
            var dependencies: [String] = []
            if let start = chunk.text.range(of: "dependencies:"),
               let open = chunk.text[start.upperBound...].firstIndex(of: "["),
               let close = chunk.text[open...].firstIndex(of: "]") {
                dependencies = quotedStrings(in: chunk.text[chunk.text.index(after: open)..<close])
            }
            return Target(kind: chunk.kind, name: name, dependencies: dependencies)
        }
    }

    /// The string literal right after `label` (`name: "X"` → X).
    static func quoted(after label: String, in text: String) -> [String] {
        guard let range = text.range(of: label) else { return [] }
        return quotedStrings(in: text[range.upperBound...]).prefix(1).map { $0 }
    }

    static func quotedStrings(in text: Substring) -> [String] {
        text.split(separator: "\"", omittingEmptySubsequences: false).enumerated().compactMap { index, part in
            index % 2 == 1 ? String(part) : nil
        }
    }

    // MARK: - ARCHITECTURE.md

    /// One row of a module table: the modules it names (in backticks) and what its *Depends on*
    /// column names in backticks.
    struct Row: Equatable {
        var line: Int
        var modules: [String]
        var dependencies: [String]
    }

    /// The rows of every table whose header's first cell is `Module` and last is `Depends on`.
    static func moduleRows(inArchitecture text: String) -> [Row] {
        var rows: [Row] = []
        var inTable = false
        for (index, line) in text.split(separator: "\n", omittingEmptySubsequences: false).enumerated() {
            guard line.hasPrefix("|") else {
                inTable = false
                continue
            }
            let cells = self.cells(line)
            if cells.first == "Module" && cells.last == "Depends on" {
                inTable = true
                continue
            }
            guard inTable, let first = cells.first, let last = cells.last, !first.allSatisfy({ $0 == "-" || $0 == ":" }) else { continue }
            rows.append(Row(line: index + 1, modules: codeSpans(in: first), dependencies: codeSpans(in: last)))
        }
        return rows
    }

    static func cells(_ line: Substring) -> [String] {
        var parts = line.split(separator: "|", omittingEmptySubsequences: false).map { $0.trimmingCharacters(in: .whitespaces) }
        if parts.first == "" { parts.removeFirst() }
        if parts.last == "" { parts.removeLast() }
        return parts
    }

    /// The texts between pairs of backticks.
    static func codeSpans(in text: some StringProtocol) -> [String] {
        text.split(separator: "`", omittingEmptySubsequences: false).enumerated().compactMap { index, part in
            index % 2 == 1 ? String(part) : nil
        }
    }

    /// What is wrong with the module tables of `architecture` for the targets of `package`, one
    /// sentence each, naming the module.
    static func problems(package: String, architecture: String) -> [String] {
        let targets = targets(inPackage: package)
        let byName = Dictionary(targets.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
        let modules = targets.filter { $0.kind != "testTarget" }
        let rows = moduleRows(inArchitecture: architecture)
        guard !modules.isEmpty else { return ["Package.swift: no targets found (is the scan out of date?)"] }
        guard !rows.isEmpty else { return ["ARCHITECTURE.md has no module table (a header | Module | … | Depends on |)"] }
        var problems: [String] = []
        // The row each module is first listed in, for the order; then the checks row by row.
        var firstRow: [String: Int] = [:]
        for (index, row) in rows.enumerated() {
            for module in row.modules where firstRow[module] == nil { firstRow[module] = index }
        }
        var listedAt: [String: Int] = [:]
        for (index, row) in rows.enumerated() {
            if row.modules.isEmpty { problems.append("ARCHITECTURE.md:\(row.line): a module table row names no module in backticks") }
            for module in row.modules {
                guard let target = byName[module], target.kind != "testTarget" else {
                    problems.append("ARCHITECTURE.md:\(row.line) names `\(module)`, which is not a module of Package.swift")
                    continue
                }
                if let earlier = listedAt[module] {
                    problems.append("ARCHITECTURE.md:\(row.line) lists `\(module)` again (first at line \(earlier))")
                    continue
                }
                let declared = Set(target.dependencies.filter { byName[$0] != nil })
                let documented = Set(row.dependencies)
                for missing in declared.subtracting(documented).sorted() {
                    problems.append("ARCHITECTURE.md:\(row.line): `\(module)` depends on `\(missing)` in Package.swift, "
                                    + "but its Depends on column does not say so")
                }
                for extra in documented.subtracting(declared).sorted() {
                    problems.append("ARCHITECTURE.md:\(row.line): `\(module)`'s Depends on column names `\(extra)`, "
                                    + "which is not among its dependencies in Package.swift (write outside names without backticks)")
                }
                for dependency in declared.sorted() where firstRow[dependency].map({ $0 >= index }) == true {
                    problems.append("ARCHITECTURE.md:\(row.line): `\(module)` comes before `\(dependency)`, one of its dependencies "
                                    + "(the tables go bottom up)")
                }
                listedAt[module] = row.line
            }
        }
        for module in modules where listedAt[module.name] == nil {
            problems.append("`\(module.name)` (.\(module.kind) in Package.swift) is missing from ARCHITECTURE.md's module tables")
        }
        return problems
    }

    @Test("ARCHITECTURE.md's module tables list every module of Package.swift with its dependencies, bottom up")
    func moduleTablesMatchThePackage() throws {
        let package = try Self.read("Package.swift")
        let architecture = try Self.read("ARCHITECTURE.md")
        #expect(Self.targets(inPackage: package).contains(Target(kind: "target", name: "BrokerContract", dependencies: ["Basics", "Varlink"])))
        for problem in Self.problems(package: package, architecture: architecture) {
            Issue.record(Comment(rawValue: problem))
        }
    }

    @Test("the check catches a missing module, a stranger, a wrong dependency and a row above its dependency")
    func theCheckCatchesWhatItShould() {
        let package = """
            targets: [
                // A comment with .target(name: "Ignored")
                .target(name: "Core"),
                .systemLibrary(name: "CLib", pkgConfig: "lib"),
                .target(name: "Wire", dependencies: ["Core",
                                                     "CLib"], resources: [.embedInCode("x")]),
                .executableTarget(name: "tool", dependencies: ["Wire"]),
                .testTarget(name: "WireTests", dependencies: ["Wire"]),
            ]
            """
        #expect(Self.targets(inPackage: package) == [
            Target(kind: "target", name: "Core", dependencies: []),
            Target(kind: "systemLibrary", name: "CLib", dependencies: []),
            Target(kind: "target", name: "Wire", dependencies: ["Core", "CLib"]),
            Target(kind: "executableTarget", name: "tool", dependencies: ["Wire"]),
            Target(kind: "testTarget", name: "WireTests", dependencies: ["Wire"]),
        ])
        let good = """
            | Module | What | Depends on |
            |---|---|---|
            | `Core`, `CLib` | the core; a C library | standard library |
            | `Wire` | the wire | `Core`, `CLib`, Glibc |

            | Module | What | Depends on |
            |---|---|---|
            | `tool` | the command | `Wire` |
            """
        #expect(Self.problems(package: package, architecture: good) == [])
        let bad = """
            | Module | What | Depends on |
            |---|---|---|
            | `Wire` | the wire | `Core`, `Glibc` |
            | `Core` | the core | — |
            | `Ghost` | gone | — |
            | `WireTests` | tests | `Wire` |
            """
        #expect(Self.problems(package: package, architecture: bad) == [
            "ARCHITECTURE.md:3: `Wire` depends on `CLib` in Package.swift, but its Depends on column does not say so",
            "ARCHITECTURE.md:3: `Wire`'s Depends on column names `Glibc`, which is not among its dependencies in Package.swift (write outside names without backticks)",
            "ARCHITECTURE.md:3: `Wire` comes before `Core`, one of its dependencies (the tables go bottom up)",
            "ARCHITECTURE.md:5 names `Ghost`, which is not a module of Package.swift",
            "ARCHITECTURE.md:6 names `WireTests`, which is not a module of Package.swift",
            "`CLib` (.systemLibrary in Package.swift) is missing from ARCHITECTURE.md's module tables",
            "`tool` (.executableTarget in Package.swift) is missing from ARCHITECTURE.md's module tables",
        ])
    }

    // MARK: - Layout

    /// The code block of ARCHITECTURE.md's `## Layout` section.
    static func layout(inArchitecture text: String) -> String? {
        guard let section = text.range(of: "\n## Layout\n") else { return nil }
        let rest = text[section.upperBound...]
        guard let open = rest.range(of: "```\n"), let close = rest[open.upperBound...].range(of: "\n```") else { return nil }
        return String(rest[open.upperBound..<close.lowerBound])
    }

    static func directories(_ path: String) -> [String] {
        let url = root.appendingPathComponent(path)
        let names = (try? FileManager.default.contentsOfDirectory(atPath: url.path)) ?? []
        return names.filter { name in
            var isDirectory: ObjCBool = false
            return !name.hasPrefix(".") && FileManager.default.fileExists(atPath: url.appendingPathComponent(name).path, isDirectory: &isDirectory)
                && isDirectory.boolValue
        }.sorted()
    }

    @Test("ARCHITECTURE.md's Layout names every directory of the tree's top, Sources/ and Tests/")
    func layoutNamesEveryDirectory() throws {
        let architecture = try Self.read("ARCHITECTURE.md")
        let layout = try #require(Self.layout(inArchitecture: architecture), "ARCHITECTURE.md has no ## Layout section with a code block")
        let lines = layout.split(separator: "\n").map { $0.drop { $0 == " " } }
        let modules = Set(Self.moduleRows(inArchitecture: architecture).flatMap(\.modules))
        for directory in Self.directories(".") where !lines.contains(where: { $0.hasPrefix(directory + "/") }) {
            Issue.record("ARCHITECTURE.md's Layout does not name \(directory)/")
        }
        for directory in Self.directories("Sources") where !modules.contains(directory) {
            Issue.record("Sources/\(directory)/ is not a module in ARCHITECTURE.md's tables")
        }
        for directory in Self.directories("Tests") where !lines.contains(where: { $0.hasPrefix(directory + "/") }) {
            Issue.record("ARCHITECTURE.md's Layout does not name Tests/\(directory)/")
        }
    }

    // MARK: - Links

    /// The relative link targets of a Markdown text with their lines, outside code blocks and
    /// code spans: `[text](target)` and `[label]: target`, without any `#anchor`.
    static func relativeLinks(inMarkdown text: String) -> [(line: Int, target: String)] {
        var links: [(Int, String)] = []
        var fenced = false
        for (index, rawLine) in text.split(separator: "\n", omittingEmptySubsequences: false).enumerated() {
            if rawLine.drop(while: { $0 == " " }).hasPrefix("```") {
                fenced.toggle()
                continue
            }
            if fenced { continue }
            // Code spans are not links.
            let line = rawLine.split(separator: "`", omittingEmptySubsequences: false).enumerated()
                .filter { $0.offset % 2 == 0 }.map(\.element).joined(separator: " ")
            var targets: [Substring] = []
            var rest = line[...]
            while let open = rest.range(of: "](") {
                guard let close = rest[open.upperBound...].firstIndex(of: ")") else { break }
                targets.append(rest[open.upperBound..<close])
                rest = rest[close...]
            }
            let trimmed = line.drop { $0 == " " }
            if trimmed.hasPrefix("["), let definition = trimmed.range(of: "]: ") {
                targets.append(trimmed[definition.upperBound...])
            }
            for target in targets {
                var target = target.trimmingCharacters(in: .whitespaces)
                if let space = target.firstIndex(of: " ") { target = String(target[..<space]) }
                if target.hasPrefix("<"), target.hasSuffix(">") { target = String(target.dropFirst().dropLast()) }
                if let hash = target.firstIndex(of: "#") { target = String(target[..<hash]) }
                guard !target.isEmpty, !target.contains("://"), !target.hasPrefix("mailto:") else { continue }
                links.append((index + 1, target))
            }
        }
        return links
    }

    @Test("every relative link in README.md, ARCHITECTURE.md and doc/*.md leads to a file")
    func relativeLinksLeadToFiles() throws {
        let pages = ["README.md", "ARCHITECTURE.md"]
            + ((try? FileManager.default.contentsOfDirectory(atPath: Self.root.appendingPathComponent("doc").path)) ?? [])
            .filter { $0.hasSuffix(".md") }.sorted().map { "doc/" + $0 }
        #expect(pages.count > 2, "doc/ holds no Markdown page")
        for page in pages {
            let directory = Self.root.appendingPathComponent(page).deletingLastPathComponent()
            for (line, target) in Self.relativeLinks(inMarkdown: try Self.read(page)) {
                let path = target.hasPrefix("/") ? Self.root.appendingPathComponent(target).path : directory.appendingPathComponent(target).path
                if !FileManager.default.fileExists(atPath: path) { Issue.record("\(page):\(line) links to \(target), which does not exist") }
            }
        }
    }

    @Test("links are found outside code, with anchors and titles dropped")
    func linkScan() {
        let text = """
            See [the API](doc/api.md#limits) and [a site](https://example.com/x.md).
            `[not a link](nowhere.md)` and [same page](#top)
            ```
            [in a block](nowhere.md)
            ```
            [ref]: config/tokenbroker.conf "the file"
            """
        #expect(Self.relativeLinks(inMarkdown: text).map { "\($0.line) \($0.target)" } == ["1 doc/api.md", "6 config/tokenbroker.conf"])
    }

    // MARK: - The map names what exists

    /// Every Swift file of Sources and Tests, by path relative to the root.
    static func swiftFiles() throws -> [String: String] {
        var files: [String: String] = [:]
        for top in ["Sources", "Tests"] {
            let base = root.appendingPathComponent(top)
            guard let walker = FileManager.default.enumerator(atPath: base.path) else { continue }
            for case let path as String in walker where path.hasSuffix(".swift") {
                files[top + "/" + path] = try String(contentsOf: base.appendingPathComponent(path), encoding: .utf8)
            }
        }
        return files
    }

    /// What the sources declare: each type (declared or extended) with the members its files
    /// declare, and every member name anywhere.
    struct Declarations {
        var members: [String: Set<String>] = [:]
        var anywhere: Set<String> = []

        init(_ files: [String: String]) {
            let typeKeywords: Set<Substring> = ["class", "struct", "enum", "actor", "protocol", "typealias", "extension"]
            let memberKeywords: Set<Substring> = ["func", "var", "let", "case", "init"]
            for text in files.values {
                var types: Set<String> = []
                var names: Set<String> = []
                let words = text.split { !($0.isLetter || $0.isNumber || $0 == "_" || $0 == ".") }
                for (previous, word) in zip(words, words.dropFirst()) {
                    if typeKeywords.contains(previous), let type = word.split(separator: ".").first { types.insert(String(type)) }
                    if memberKeywords.contains(previous) { names.insert(String(word)) }
                }
                for type in types { members[type, default: []].formUnion(names) }
                anywhere.formUnion(names)
            }
        }
    }

    /// What a backticked name in ARCHITECTURE.md must be: a type (`Name`) or a member of one
    /// (`Name.member`, declared in a file that declares or extends it), a function
    /// (`name()`), a file (`Name+Part`, or a file's own name), a module, a folder or path
    /// (`Name/`), a method or error of the interface, or a platform type. Other code spans
    /// (settings, commands, constants) are not names.
    static func unknownNames(in text: String, files: [String: String], modules: Set<String>, interface: String) -> [String] {
        let declared = Declarations(files)
        let fileNames = Set(files.keys.map { String($0.split(separator: "/").last!.dropLast(".swift".count)) })
        let contract = Set(interface.split(whereSeparator: \.isNewline).compactMap { line -> String? in
            let words = line.split(separator: " ")
            guard words.count > 1, words[0] == "method" || words[0] == "error" else { return nil }
            return String(words[1].prefix { $0.isLetter })
        })
        let platform: Set<String> = ["Mutex", "Task", "Duration", "ContinuousClock", "AsyncStream", "URLSession"]
        func isType(_ name: String) -> Bool {
            declared.members[name] != nil || modules.contains(name) || fileNames.contains(name) || contract.contains(name) || platform.contains(name)
        }
        var unknown: [String] = []
        var seen: Set<String> = []
        // Code spans, line by line, outside fenced blocks.
        var spans: [String] = []
        var fenced = false
        for line in text.split(separator: "\n", omittingEmptySubsequences: false) {
            if line.hasPrefix("```") { fenced.toggle(); continue }
            guard !fenced else { continue }
            spans += line.split(separator: "`", omittingEmptySubsequences: false).enumerated().filter { $0.offset % 2 == 1 }.map { String($0.element) }
        }
        for span in spans where seen.insert(span).inserted {
            guard let first = span.first, span.allSatisfy({ $0.isLetter || $0.isNumber || "+._/():".contains($0) }) else { continue }
            if first.isLowercase {
                // A function, `maintain()`.
                if span.hasSuffix("()"), !span.contains("."), !declared.anywhere.contains(String(span.dropLast(2))) { unknown.append(span) }
                continue
            }
            guard first.isUppercase, !span.contains("_") || span.contains(where: \.isLowercase) else { continue }
            if span.contains("/") {
                let path = span.hasSuffix("/") ? String(span.dropLast()) : span
                let exists = FileManager.default.fileExists(atPath: root.appendingPathComponent(path).path)
                    || modules.contains(path) || files.keys.contains { $0.contains("/\(path)/") || $0.hasSuffix("/\(path).swift") }
                if !exists { unknown.append(span) }
            } else if span.contains("+") {
                if !fileNames.contains(span) { unknown.append(span) }
            } else if span.hasSuffix(".swift") || span.hasSuffix(".md") {
                if !FileManager.default.fileExists(atPath: root.appendingPathComponent(span).path) { unknown.append(span) }
            } else {
                let parts = span.split(separator: "(", maxSplits: 1)[0].split(separator: ".").map(String.init)
                guard let type = parts.first, isType(type) else { unknown.append(span); continue }
                if parts.count > 1, !modules.contains(type), !(declared.members[type]?.contains(parts[1]) ?? false) { unknown.append(span) }
            }
        }
        return unknown
    }

    @Test("ARCHITECTURE.md names only types, members, files and modules that exist (issue 34)")
    func architectureNames() throws {
        let files = try Self.swiftFiles()
        let modules = Set(Self.targets(inPackage: try Self.read("Package.swift")).map(\.name))
        let interface = try Self.read("Sources/BrokerContract/io.tokenbroker.Broker.varlink")
        let unknown = Self.unknownNames(in: try Self.read("ARCHITECTURE.md"), files: files, modules: modules, interface: interface)
        #expect(unknown.isEmpty, "ARCHITECTURE.md names what no source declares: \(unknown.joined(separator: ", "))")
        // The check itself: a name nobody declares is caught, one somebody does is not.
        #expect(Self.unknownNames(in: "`Daemon.nothingLikeThis` `NoSuchTypeAnywhere` `Latch` `Daemon.run` `Basics` `Fleet=yes` `Daemon.record` "
                                  + "`noSuchFunction()` `Config/` `GetToken`",
                                  files: files, modules: modules, interface: interface) == ["Daemon.nothingLikeThis", "NoSuchTypeAnywhere", "Daemon.record", "noSuchFunction()"])
    }

    // MARK: - Claims the map makes of the code

    /// The code lines of a Swift file (comments dropped: a line's `//` onward).
    static func codeLines(_ text: String) -> [(number: Int, text: Substring)] {
        text.split(separator: "\n", omittingEmptySubsequences: false).enumerated().compactMap { index, line in
            let code = line.range(of: "//").map { line[..<$0.lowerBound] } ?? line[...]
            return code.allSatisfy(\.isWhitespace) ? nil : (index + 1, code)
        }
    }

    /// The places in `files` whose code matches one of `patterns` (regular expressions).
    static func matches(_ patterns: [String], in files: [String: String]) -> [String] {
        let expressions = patterns.map { try! Regex($0) }
        return files.sorted { $0.key < $1.key }.flatMap { path, text in
            codeLines(text).filter { line in expressions.contains { line.text.contains($0) } }.map { "\(path):\($0.number)" }
        }
    }

    static let kindMatches = [#"case (let )?\.(oauth|test)\b"#, #"\.grant ==|grant != "#, #"configuration\.upstream\b"#]
    static let coordinatorCalls = [#"\bcoordinator\??\."#]

    @Test("what ARCHITECTURE.md says of the session kinds and the fleet's parts holds (issue 34): nothing outside Config/ and Assembly/ matches an upstream's kind, the daemon holds no HTTPTokenSource outside the factory, FleetSession calls nothing on the coordinator")
    func claimsHold() throws {
        let files = try Self.swiftFiles()
        let daemon = files.filter { $0.key.hasPrefix("Sources/TokenBrokerDaemon/") }
        let outside = daemon.filter { !$0.key.hasPrefix("Sources/TokenBrokerDaemon/Config/") && !$0.key.hasPrefix("Sources/TokenBrokerDaemon/Assembly/") }
        #expect(Self.matches(Self.kindMatches, in: outside) == [])
        let holders = Set(Self.matches([#"\bHTTPTokenSource\b"#], in: daemon).map { $0.prefix { $0 != ":" } })
        #expect(holders == ["Sources/TokenBrokerDaemon/Assembly/SessionFactory.swift"])
        let fleetSession = files.filter { $0.key.hasPrefix("Sources/Fleet/FleetSession") }
        #expect(fleetSession.count >= 4)
        #expect(Self.matches(Self.coordinatorCalls, in: fleetSession) == [])
        // The checks themselves catch what they look for, and not comments.
        let sample = ["a.swift": "switch x {\ncase let .oauth(s): break\n// case .test: in a comment\n}\nawait coordinator?.status()\nif s.grant == .refreshToken {}"]
        #expect(Self.matches(Self.kindMatches, in: sample) == ["a.swift:2", "a.swift:6"])
        #expect(Self.matches(Self.coordinatorCalls, in: sample) == ["a.swift:5"])
    }

    /// Modules outside the package a file may import without declaring them.
    static let toolchainModules: Set<String> = ["Foundation", "FoundationEssentials", "FoundationNetworking", "Testing", "XCTest", "Glibc",
                                                "Synchronization", "Dispatch", "_Concurrency"]

    /// Each file's imports of the package's modules that its target does not declare: they build
    /// only when another target happened to build the module first (a fresh clone's CI once failed so).
    static func undeclaredImports(targets: [Target], files: [String: String]) -> [String] {
        let byName = Dictionary(targets.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
        let modules = Set(byName.keys)
        var problems: [String] = []
        for (path, text) in files.sorted(by: { $0.key < $1.key }) {
            let parts = path.split(separator: "/")
            guard parts.count > 2, let target = byName[String(parts[1])] else { continue }
            for line in text.split(separator: "\n") where line.hasPrefix("import ") {
                let module = String(line.dropFirst(7).prefix { $0 != " " && $0 != "." })
                if module != target.name, modules.contains(module), !target.dependencies.contains(module) { problems.append("\(path): \(module)") }
            }
        }
        return problems
    }

    @Test("every file imports only modules its target declares (a module some other target builds first is no dependency)")
    func importsAreDeclared() throws {
        let targets = Self.targets(inPackage: try Self.read("Package.swift"))
        let undeclared = Self.undeclaredImports(targets: targets, files: try Self.swiftFiles())
        #expect(undeclared.isEmpty, "\(undeclared.joined(separator: "; "))")
        // The check itself.
        let sample = ["Tests/FleetTests/X.swift": "import Fleet\nimport Upstream\nimport Foundation\n"]
        #expect(Self.undeclaredImports(targets: targets, files: sample) == ["Tests/FleetTests/X.swift: Upstream"])
    }
}
