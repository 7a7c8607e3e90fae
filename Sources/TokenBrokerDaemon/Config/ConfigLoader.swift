#if canImport(Glibc)
import Glibc
#endif
import DPoP
import Fleet
import Sealing
import SQLiteStore
import TokenBrokerCore
import Upstream
import Varlink
import HTTPTransport

/// Reads `tokenbroker.conf` and the drop-ins in `tokenbroker.conf.d/*.conf` (in name order) into
/// a `BrokerConfiguration`.
///
/// Later assignments override earlier ones. `[Session]` sections with the same `Name=` merge;
/// list keys (`AllowUsers=`, `AllowGroups=`) accumulate, and an empty assignment clears them.
/// Unknown keys are warnings; bad values are errors at `file:line`. Every file is read to its
/// end: the error thrown carries every other error and every warning, in file order.
public enum ConfigLoader {
    /// - Parameter memo: the sessions of the last load, which this one takes where their lines
    ///   are the same (`SessionMemo`).
    public static func load(path: String = BrokerConfiguration.defaultPath, requireMainFile: Bool = true) throws(ConfigError) -> BrokerConfiguration {
        try load(path: path, requireMainFile: requireMainFile, memo: .shared)
    }

    static func load(path: String, requireMainFile: Bool, memo: SessionMemo) throws(ConfigError) -> BrokerConfiguration {
        var files: [(String, String)] = []
        switch FileSystem.readText(path) {
        case let .success(text): files.append((path, text))
        case let .failure(error):
            if requireMainFile || error.errno != ENOENT { throw ConfigError(file: path, line: 0, "cannot read: \(error)") }
        }
        let dropInDirectory = path + ".d"
        for name in FileSystem.list(dropInDirectory).filter({ $0.hasSuffix(".conf") }).sorted() {
            let file = dropInDirectory + "/" + name
            switch FileSystem.readText(file) {
            case let .success(text): files.append((file, text))
            case let .failure(error): throw ConfigError(file: file, line: 0, "cannot read: \(error)")
            }
        }
        var sections: [INISection] = []
        var errors: [ConfigError] = []
        for (file, text) in files { sections += INIFile.parse(text, file: file, errors: &errors) }
        return try build(sections, errors: errors, mainFile: path, memo: memo)
    }

    /// - Parameter mainFile: the file read first (the drop-ins follow it by name).
    static func build(_ sections: [INISection], errors: [ConfigError] = [], mainFile: String? = nil,
                      memo: SessionMemo = SessionMemo()) throws(ConfigError) -> BrokerConfiguration {
        var configuration = BrokerConfiguration()
        var context = ConfigContext()
        for error in errors { context.record(error) }
        var fleetFailed = false
        var sessionEntries: [(name: String, origin: INISection, entries: [INIEntry])] = []
        var sessionIndex: [String: Int] = [:]
        sessionIndex.reserveCapacity(sections.count)
        var delegationSections: [INISection] = []
        var outputSections: [INISection] = []
        for section in sections {
            switch section.name {
            case "Broker":
                for entry in section.entries { apply(entry, ConfigSchema.brokerKeys, ConfigSchema.broker, to: &configuration, in: "[Broker]", &context) }
            case "Fleet":
                do {
                    configuration.fleet = try fleetSection(section, &context)
                } catch {
                    context.record(error)
                }
                fleetFailed = configuration.fleet == nil
            case "Session":
                guard let nameEntry = section.entries.last(where: { $0.key == "Name" }) else {
                    context.record(ConfigError(file: section.file, line: section.line, "[Session] needs Name="))
                    continue
                }
                guard ConfigValue.isSessionName(nameEntry.value) else {
                    context.record(ConfigError(file: nameEntry.file, line: nameEntry.line,
                                               "invalid session name '\(nameEntry.value)' (1-64 of A-Z a-z 0-9 - _ .)"))
                    continue
                }
                if let index = sessionIndex[nameEntry.value] {
                    sessionEntries[index].entries += section.entries
                } else {
                    sessionIndex[nameEntry.value] = sessionEntries.count
                    sessionEntries.append((nameEntry.value, section, section.entries))
                }
            case "Delegation":
                delegationSections.append(section)
            case "Output":
                outputSections.append(section)
            case "":
                continue   // (its header could not be read: an error already)
            default:
                context.warnings.append(ConfigError(file: section.file, line: section.line, "unknown section [\(section.name)], ignored"))
            }
        }
        configuration.sessions.reserveCapacity(sessionEntries.count)
        var derivedFrom: [String: INIEntry] = [:]
        var keyEntries: [String: INIEntry] = [:]
        let previous = memo.take()
        var read = SessionMemo.Reads(minimumCapacity: sessionEntries.count)
        defer { memo.keep(read) }
        for (name, origin, entries) in sessionEntries {
            var session: SessionConfiguration
            if let same = previous[name], same.file == origin.file, same.line == origin.line, same.entries == entries {
                session = same.session
                read[name] = same
            } else {
                let before = (context.errors.count, context.omittedErrors, context.warnings.count)
                guard let made = self.session(name, origin: origin, entries: entries, &context) else { continue }
                session = made
                if (context.errors.count, context.omittedErrors, context.warnings.count) == before, SessionMemo.linesOnly(entries) {
                    read[name] = SessionMemo.Read(file: origin.file, line: origin.line, entries: entries, session: made)
                }
            }
            if session.settings.derivedFrom != nil { derivedFrom[name] = entries.last { $0.key == "DerivedFrom" } }
            if !session.settings.allowResources.isEmpty || !session.settings.allowScopes.isEmpty {
                keyEntries[name] = entries.last { $0.key == "AllowResources" || $0.key == "AllowScopes" }
            }
            if session.settings.fleet, let entry = entries.last(where: { $0.key == "Fleet" }) {
                guard let fleet = configuration.fleet else {
                    if !fleetFailed { context.record(fail(entry, "Fleet=yes needs a [Fleet] section with Endpoints= and KeyFile= or KeyCredential=")) }
                    continue
                }
                // Whether the session can be shared, and with this fleet, is its kind's to say.
                if let refusal = SessionFactory.kind(of: session).fleetRefusal(fleet) {
                    context.record(fail(entry, refusal))
                    continue
                }
                session.fleet = fleet
            }
            configuration.sessions.append(session)
        }
        configuration.sessions = derive(configuration.sessions, derivedFrom, keyEntries: keyEntries, &context)
        configuration.delegations = delegations(delegationSections, of: configuration, &context)
        configuration.outputs = outputs(outputSections, of: configuration, &context)
        // In file order, whatever check found them.
        configuration.warnings = ConfigError.inFileOrder(context.warnings, main: mainFile) { $0 }
        if let error = ConfigError.combined(ConfigError.inFileOrder(context.errors, main: mainFile) { $0 }, omitted: context.omittedErrors,
                                            warnings: configuration.warnings) { throw error }
        return configuration
    }

    /// Each section's keys applied to `empty`: those read without an error and with a `Name=`,
    /// each with its section (for errors about the whole of it).
    private static func read<Settings>(_ sections: [INISection], _ index: ConfigKeyIndex<Settings>, _ keys: [ConfigKey<Settings>],
                                       _ name: String, _ empty: Settings, _ named: KeyPath<Settings, String>,
                                       _ context: inout ConfigContext) -> [(Settings, INISection)] {
        var result: [(Settings, INISection)] = []
        for section in sections {
            var settings = empty
            let before = context.errors.count
            for entry in section.entries { apply(entry, index, keys, to: &settings, in: "[\(name)]", &context) }
            guard context.errors.count == before else { continue }
            guard !settings[keyPath: named].isEmpty else {
                context.record(ConfigError(file: section.file, line: section.line, "[\(name)] needs Name="))
                continue
            }
            result.append((settings, section))
        }
        return result
    }

    /// The `[Delegation]` sections: each names itself, sessions that are configured and a socket
    /// of its own. One that fails records its error (the configuration is then refused).
    private static func delegations(_ sections: [INISection], of configuration: BrokerConfiguration,
                                    _ context: inout ConfigContext) -> [DelegationConfiguration] {
        var result: [DelegationConfiguration] = []
        // (None is the usual case: no set of every session's name for it.)
        guard !sections.isEmpty else { return result }
        var sockets: [String: String] = [configuration.socketPath: "the broker's own socket (Socket=)"]
        let known = Set(configuration.sessions.map(\.name))
        for (delegation, section) in read(sections, ConfigSchema.delegationKeys, ConfigSchema.delegation, "Delegation",
                                          DelegationConfiguration(name: ""), \.name, &context) {
            func fail(_ message: String) { context.record(ConfigError(file: section.file, line: section.line, message)) }
            let label = "[Delegation] \(delegation.name)"
            if result.contains(where: { $0.name == delegation.name }) { fail("\(label): another [Delegation] has this Name="); continue }
            guard !delegation.sessions.isEmpty else { fail("\(label) needs Sessions= (the sessions its socket serves)"); continue }
            guard !delegation.socket.isEmpty else { fail("\(label) needs Socket= (where its socket is bound)"); continue }
            if let other = sockets[delegation.socket] { fail("\(label): Socket= is \(other)'s too"); continue }
            let unknown = delegation.sessions.filter { !known.contains($0) }
            if !unknown.isEmpty { fail("\(label): Sessions= names \(unknown.prefix(8).joined(separator: ", ")), not configured"); continue }
            guard result.count < DelegationConfiguration.mostDelegations else {
                fail("more than \(DelegationConfiguration.mostDelegations) delegations")
                break
            }
            sockets[delegation.socket] = label
            result.append(delegation)
        }
        return result
    }

    /// The `[Output]` sections: each names itself (apart from every delegation), a configured
    /// session whose tokens are bearer tokens (a DPoP-bound token is worth nothing without the
    /// broker's key), and a path no other output has. One that fails records its error.
    private static func outputs(_ sections: [INISection], of configuration: BrokerConfiguration,
                                _ context: inout ConfigContext) -> [TokenFileConfiguration] {
        // (None is the common case: no index of thousands of sessions to build.)
        guard !sections.isEmpty else { return [] }
        var result: [TokenFileConfiguration] = []
        var paths: [String: String] = [:]
        // Indices, not copies: a session's configuration is large.
        let sessionIndex = Dictionary(configuration.sessions.indices.map { (configuration.sessions[$0].name, $0) }, uniquingKeysWith: { first, _ in first })
        let delegations = Set(configuration.delegations.map(\.name))
        for (output, section) in read(sections, ConfigSchema.outputKeys, ConfigSchema.output, "Output", TokenFileConfiguration(name: ""),
                                      \.name, &context) {
            func fail(_ message: String) { context.record(ConfigError(file: section.file, line: section.line, message)) }
            let label = "[Output] \(output.name)"
            if result.contains(where: { $0.name == output.name }) { fail("\(label): another [Output] has this Name="); continue }
            if delegations.contains(output.name) { fail("\(label): a [Delegation] has this Name= (they share one namespace)"); continue }
            guard !output.session.isEmpty else { fail("\(label) needs Session= (the session whose token it holds)"); continue }
            guard !output.path.isEmpty else { fail("\(label) needs Path= (where the file is kept)"); continue }
            if let other = paths[output.path] { fail("\(label): Path= is \(other)'s too"); continue }
            guard let index = sessionIndex[output.session] else { fail("\(label): Session= names \(output.session), not configured"); continue }
            if configuration.sessions[index].settings.oauth.dpop != .off {
                fail("\(label): session \(output.session) has DPoP tokens, bound to the broker's key: a file cannot carry their proofs")
                continue
            }
            if output.readers.count > TokenFileConfiguration.mostReaders {
                fail("\(label): Readers= names more than \(TokenFileConfiguration.mostReaders) users")
                continue
            }
            guard result.count < TokenFileConfiguration.mostFiles else {
                fail("more than \(TokenFileConfiguration.mostFiles) outputs")
                break
            }
            paths[output.path] = label
            result.append(output)
        }
        return result
    }

    /// Derived sessions against their parents: a parent must be a configured OAuth session of
    /// its own (not derived, not a test session, not a fleet's), whose settings the derived
    /// session then carries (a DPoP parent's: its derived tokens are bound to the parent's key).
    /// One that fails is left out, with its error.
    private static func derive(_ sessions: [SessionConfiguration], _ entries: [String: INIEntry], keyEntries: [String: INIEntry],
                               _ context: inout ConfigContext) -> [SessionConfiguration] {
        // A parent's logins ask for the resources its derived sessions by refresh narrow to
        // (RFC 8707): servers such as Glewlwyd let a refresh name only a resource the grant has.
        var loginResources: [String: [String]] = [:]
        for session in sessions {
            // A derived session by refresh's resources are its parent's to ask for; keys by
            // refresh (KeyDerivation=refresh) are the session's own.
            let (parent, resources): (String?, [String]) = session.settings.derivation == .refresh && session.settings.derivedFrom != nil
                ? (session.settings.derivedFrom, session.settings.resources)
                : (session.settings.keyDerivation == .refresh ? (session.name, session.settings.allowResources) : (nil, []))
            guard let parent else { continue }
            for resource in resources where !(loginResources[parent]?.contains(resource) ?? false) {
                loginResources[parent, default: []].append(resource)
            }
        }
        // Nothing to derive, no key, no resource to ask for (the common case): as they are.
        if entries.isEmpty && keyEntries.isEmpty && loginResources.isEmpty { return sessions }
        // Indices, not copies: a session's configuration is large, and a reload of thousands
        // of sessions spent a fifth of its time copying them here.
        let byName = Dictionary(sessions.indices.map { (sessions[$0].name, $0) }, uniquingKeysWith: { first, _ in first })
        return sessions.compactMap { session in
            var session = session
            if let resources = loginResources[session.name], session.settings.derivedFrom == nil {
                session.settings.oauth.client.loginResources = resources
            }
            if let entry = keyEntries[session.name] {
                // Keys are derived like derived sessions: from a session of its own, on this host.
                guard session.settings.derivedFrom == nil, case let .oauth(oauth) = session.upstream, session.fleet == nil else {
                    context.record(fail(entry, "\(entry.key)= needs an Upstream=oauth session of its own, without Fleet=yes "
                                        + "(its keys are derived from its tokens)"))
                    return nil
                }
                if session.settings.keyDerivation == .refresh, oauth.grant != .refreshToken {
                    context.record(fail(entry, "KeyDerivation=refresh redeems the session's refresh token, and Grant=\(oauth.grant.rawValue) "
                                        + "has none (use KeyDerivation=exchange)"))
                    return nil
                }
            }
            guard let parentName = session.settings.derivedFrom, let entry = entries[session.name] else { return session }
            guard let parent = byName[parentName].map({ sessions[$0] }), parentName != session.name else {
                context.record(fail(entry, "DerivedFrom=\(parentName): no such session is configured"
                                    + (parentName == session.name ? " (a session cannot derive from itself)" : "")))
                return nil
            }
            guard parent.settings.derivedFrom == nil, case let .oauth(oauth) = parent.upstream else {
                context.record(fail(entry, "DerivedFrom=\(parentName): the parent must be an Upstream=oauth session of its own "
                                    + "(not a derived or test session)"))
                return nil
            }
            if session.settings.derivation == .refresh, oauth.grant != .refreshToken {
                context.record(fail(entry, "DerivedFrom=\(parentName): Derivation=refresh redeems the parent's refresh token, and "
                                    + "Grant=\(oauth.grant.rawValue) has none (use Derivation=exchange)"))
                return nil
            }
            guard parent.fleet == nil else {
                context.record(fail(entry, "DerivedFrom=\(parentName): the parent is shared with a fleet (Fleet=yes); derived sessions of "
                                    + "fleet sessions are not supported yet"))
                return nil
            }
            var derived = session
            derived.parentOAuth = oauth
            return derived
        }
    }

    /// The keys a derived session takes from its parent: it may not set them itself.
    static let parentKeys: Set<String> = [
        "Upstream", "TestTokenLifetime", "Grant", "Issuer", "TokenEndpoint", "RevocationEndpoint", "DeviceAuthorizationEndpoint",
        "AuthorizationEndpoint", "LoginFlow", "LoginRedirectPorts", "LoginTimeout", "ClientID", "ClientSecretFile", "ClientSecretCredential",
        "ClientSecret", "ClientAuthentication", "CAFile", "ClientCertificate", "ClientKey", "ConnectTimeout", "RequestTimeout",
        "RevokeOnLogout", "DPoP", "ClientKeyFile", "ClientKeyCredential", "ClientAssertionFile", "ClientAssertionCredential",
        "ClientAssertionAudience", "ClientAssertionAlgorithm", "AssertionFile", "AssertionCredential",
    ]

    /// The keys only a derived session takes.
    /// (An array: three names compared cost less than one hashed, for every line of a session.)
    static let derivedKeys: [String] = ["Derivation", "Audience", "Resource"]

    /// One assignment, by its key's entry in `index` (the table `keys`); an unknown key warns,
    /// with the key it probably meant.
    private static func apply<Settings>(_ entry: INIEntry, _ index: ConfigKeyIndex<Settings>, _ keys: [ConfigKey<Settings>],
                                        to settings: inout Settings, in section: @autoclosure () -> String, _ context: inout ConfigContext) {
        guard let key = index[entry.key] else {
            let hint = ConfigSchema.suggestion(for: entry.key, in: keys).map { " (did you mean \($0)=?)" } ?? ""
            context.warn(entry, "unknown key \(entry.key)= in \(section()), ignored\(hint)")
            return
        }
        do {
            try key.apply(&settings, entry, &context)
        } catch {
            context.record(error)
        }
    }

    /// `[Fleet]`: the etcd cluster shared by the brokers of a fleet, and the key that seals what
    /// they put there.
    private static func fleetSection(_ section: INISection, _ context: inout ConfigContext) throws(ConfigError) -> FleetSettings? {
        var draft = FleetDraft()
        let before = context.errors.count
        for entry in section.entries { apply(entry, ConfigSchema.fleetKeys, ConfigSchema.fleet, to: &draft, in: "[Fleet]", &context) }
        func fail(_ message: String) -> ConfigError { ConfigError(file: section.file, line: section.line, message) }
        guard context.errors.count == before else { return nil }   // (its errors recorded)
        guard !draft.endpoints.isEmpty else { throw fail("[Fleet] needs Endpoints= (etcd client URLs)") }
        guard let key = draft.key else { throw fail("[Fleet] needs KeyFile= or KeyCredential= (the fleet key, 32 bytes or 64 hex digits)") }
        if (draft.tls.clientCertificate == nil) != (draft.tls.clientKey == nil) { throw fail("[Fleet] ClientCertificate= and ClientKey= go together") }
        return FleetSettings(endpoints: draft.endpoints, prefix: draft.prefix, tls: draft.tls, key: key, flightLease: draft.flightLease,
                             requestTimeout: draft.requestTimeout, member: draft.member)
    }

    /// A `[Session]` from its assignments (those of every section with its name, in order),
    /// then checked as a whole.
    private static func session(_ name: String, origin: INISection, entries: [INIEntry],
                                _ context: inout ConfigContext) -> SessionConfiguration? {
        var settings = SessionSettings(name: name)
        let before = context.errors.count
        for entry in entries {
            apply(entry, ConfigSchema.sessionKeys, ConfigSchema.session, to: &settings, in: "[Session] \(name)", &context)
        }
        func record(_ error: ConfigError) { context.record(error) }
        // A session missing a key it needs: the line that misspelt it, if one did.
        func missing(_ message: String, _ names: String...) -> ConfigError {
            let typo = entries.first { entry in
                ConfigSchema.sessionKeys[entry.key] == nil
                    && ConfigSchema.suggestion(for: entry.key, in: ConfigSchema.session).map(names.contains) == true
            }
            let hint = typo.map { "; line \($0.line)\($0.file == origin.file ? "" : " of \($0.file)") has \($0.key)=: "
                + "did you mean \(ConfigSchema.suggestion(for: $0.key, in: ConfigSchema.session)!)=?" } ?? ""
            return ConfigError(file: origin.file, line: origin.line, "[Session] \(name) needs \(message)\(hint)")
        }
        // A bad Upstream=: what the session needs is unknown. (Looked for only when the
        // session has errors: a reload reads thousands of sessions that have none.)
        if context.errors.count > before {
            let upstreamLines = Set(entries.filter { $0.key == "Upstream" }.map { "\($0.file):\($0.line)" })
            guard !context.errors[before...].contains(where: { upstreamLines.contains("\($0.file):\($0.line)") }) else { return nil }
        }
        if settings.policy.backoff.maximum < settings.policy.backoff.initial, let entry = entries.last(where: { $0.key == "BackoffMax" }) {
            record(fail(entry, "BackoffMax= is shorter than BackoffInitial="))
        }
        if settings.derivedFrom != nil {
            for entry in entries where parentKeys.contains(entry.key) {
                record(fail(entry, "\(entry.key)= is the parent's: a derived session asks its parent's server (DerivedFrom=)"))
            }
            if settings.derivation == .refresh, !settings.audiences.isEmpty, let entry = entries.last(where: { $0.key == "Audience" }) {
                record(fail(entry, "Audience= is an RFC 8693 token exchange parameter: Derivation=refresh narrows by Resource= and Scope="))
            }
            if settings.audiences.isEmpty, settings.resources.isEmpty, settings.oauth.client.scope == nil {
                record(missing("Audience=, Resource= or Scope= (a derived session narrows its parent's tokens)", "Audience", "Resource", "Scope"))
            }
            guard context.errors.count == before else { return nil }
            return SessionConfiguration(settings: settings, origin: "\(origin.file):\(origin.line)")
        }
        for entry in entries where derivedKeys.contains(entry.key) {
            record(fail(entry, "\(entry.key)= needs DerivedFrom= (only a derived session narrows tokens)"))
        }
        if settings.kind == .test, settings.oauth.dpop != .off, let entry = entries.last(where: { $0.key == "DPoP" }) {
            record(fail(entry, "DPoP=\(entry.value) needs Upstream=oauth (the test upstream mints bearer tokens)"))
        }
        if settings.kind == .oauth, settings.oauth.dpop == .auto, settings.oauth.issuer == nil, let entry = entries.last(where: { $0.key == "DPoP" }) {
            record(fail(entry, "DPoP=auto needs Issuer= (the server's metadata says whether it takes DPoP)"))
        }
        if settings.kind == .oauth {
            clientAuthentication(&settings, entries, context: &context, missing: missing)
            let oauth = settings.oauth
            // (A JWT-bearer grant may have no client: the platform's JWT is the credential.)
            if oauth.client.clientID.isEmpty, !(oauth.grant == .jwtBearer && oauth.client.authentication == .none) {
                record(missing("ClientID= (or Upstream=test)", "ClientID"))
            }
            if oauth.issuer == nil && oauth.tokenEndpoint == nil {
                record(missing("TokenEndpoint= or Issuer=", "TokenEndpoint", "Issuer"))
            }
            if (oauth.client.tls.clientCertificate == nil) != (oauth.client.tls.clientKey == nil),
               let entry = entries.last(where: { $0.key == "ClientCertificate" || $0.key == "ClientKey" }) {
                record(fail(entry, "ClientCertificate= and ClientKey= go together"))
            }
            if let source = settings.secretSource {
                if oauth.client.authentication == .privateKeyJWT {
                    record(fail(source, "\(source.key)=: ClientAuthentication=private_key_jwt authenticates with a key, not a secret "
                                + "(leave the secret out: none is needed, and none should lie on disk)"))
                } else {
                    do {
                        settings.oauth.client.clientSecret = try ConfigParsing.readSecret(source, &context)
                    } catch {
                        record(error)
                    }
                }
            } else if oauth.client.authentication != .none && oauth.client.authentication != .privateKeyJWT {
                record(missing("ClientSecretFile= or ClientSecretCredential= (or ClientAuthentication=none)",
                               "ClientSecretFile", "ClientSecretCredential", "ClientSecret"))
            }
        }
        settings.secretSource = nil
        settings.clientKeySource = nil
        guard context.errors.count == before else { return nil }
        return SessionConfiguration(settings: settings, origin: "\(origin.file):\(origin.line)")
    }

    /// The client's authentication as a whole: `ClientKeyFile=` or `ClientAssertionFile=` mean
    /// `private_key_jwt` (an explicit other method is an error), one of the two at most, the
    /// key read and checked; `Grant=jwt-bearer` with no `ClientID=` is no client at all, and
    /// `AssertionFile=` is that grant's alone.
    private static func clientAuthentication(_ settings: inout SessionSettings, _ entries: [INIEntry], context: inout ConfigContext,
                                             missing: (String, String...) -> ConfigError) {
        let explicit = entries.last { $0.key == "ClientAuthentication" }
        let keyEntry = settings.clientKeySource
        // (By what the keys left: a drop-in that empties ClientAssertionFile= takes it away.)
        let fileEntry = settings.oauth.client.assertionFile == nil ? nil
            : entries.last { ($0.key == "ClientAssertionFile" || $0.key == "ClientAssertionCredential") && !$0.value.isEmpty }
        if keyEntry != nil || fileEntry != nil {
            if let explicit, settings.oauth.client.authentication != .privateKeyJWT {
                context.record(fail(explicit, "ClientAuthentication=\(explicit.value): \((keyEntry ?? fileEntry)!.key)= is for "
                                    + "ClientAuthentication=private_key_jwt"))
            }
            settings.oauth.client.authentication = .privateKeyJWT
        }
        if let keyEntry, let fileEntry, settings.oauth.client.assertionFile != nil {
            context.record(fail(fileEntry.line > keyEntry.line || fileEntry.file != keyEntry.file ? fileEntry : keyEntry,
                                "\(keyEntry.key)= and \(fileEntry.key)= both say where assertions come from: keep one"))
        }
        if let keyEntry {
            do {
                let pem = try ConfigParsing.readSecret(keyEntry, &context)
                do {
                    let key = try SigningKey(pem: Array(pem.reveal.utf8))
                    settings.oauth.client.clientKey = pem
                    if let algorithm = settings.oauth.client.assertionAlgorithm, !key.signs(algorithm),
                       let entry = entries.last(where: { $0.key == "ClientAssertionAlgorithm" }) {
                        context.record(fail(entry, "ClientAssertionAlgorithm=\(algorithm.rawValue): the \(key.family.rawValue) key of "
                                            + "\(keyEntry.key)= cannot sign it"))
                    }
                } catch {
                    context.record(fail(keyEntry, "\(keyEntry.key)=: \(error.description)"))
                }
            } catch {
                context.record(error)
            }
        }
        if settings.oauth.grant == .jwtBearer {
            if settings.oauth.grantAssertionFile == nil {
                context.record(missing("AssertionFile= or AssertionCredential= (the JWT Grant=jwt-bearer presents)", "AssertionFile", "AssertionCredential"))
            }
            // No client at all: neither id nor a way to authenticate one.
            if settings.oauth.client.clientID.isEmpty, explicit == nil, settings.secretSource == nil, keyEntry == nil, fileEntry == nil {
                settings.oauth.client.authentication = .none
            }
        } else if settings.oauth.grantAssertionFile != nil,
                  let entry = entries.last(where: { ($0.key == "AssertionFile" || $0.key == "AssertionCredential") && !$0.value.isEmpty }) {
            context.record(fail(entry, "\(entry.key)= is the grant of Grant=jwt-bearer (for client authentication by a platform's JWT, "
                                + "use ClientAssertionFile=)"))
        }
    }
}
