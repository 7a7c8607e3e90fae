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
        #expect(Self.targets(inPackage: package).contains(Target(kind: "target", name: "BrokerContract", dependencies: ["Basics", "TokenBrokerCore", "Varlink"])))
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
}
