import TokenBrokerCore

/// Derived sessions (`DerivedFrom=`) follow their parent's boundaries: one logout boundary for
/// the parent and all it derives. A parent's logout signs each of them out (their tokens with
/// it, their watchers told) before the logout returns; a parent's login logs each in anew (a
/// new generation, nothing cached: its first demand derives a token from the new login). After
/// a start or reload, `reconcile` puts each as its parent is.
enum DerivedSessions {
    /// The sessions derived from `parent`, in configuration order.
    static func children(of parent: String, in snapshot: SessionTable.Snapshot) -> [SessionTable.Session] {
        snapshot.derived[parent]?.compactMap { snapshot.sessions[$0] } ?? []
    }

    /// `parent` crossed `boundary`: its derived sessions cross one too, all at once.
    static func follow(_ parent: String, _ boundary: SessionBoundary, in table: SessionTable, logger: Logger) async {
        // Keys asked for call by call end with the generation they were derived in.
        await table.snapshot.sessions[parent]?.keys?.endAll()
        let children = children(of: parent, in: table.snapshot)
        guard !children.isEmpty else { return }
        await withTaskGroup(of: Void.self) { group in
            for child in children {
                group.addTask {
                    switch boundary {
                    case .loggedOut, .ended:
                        await signOut(child, with: parent, logger: logger)
                    case .loggedIn:
                        await logIn(child, with: parent, in: table.snapshot, logger: logger)
                        // A logout of the parent that came while this login was under way has
                        // signed the child out already, or will: whichever landed last, the
                        // child ends as the parent is now.
                        if table.snapshot.sessions[parent]?.coordinator.statusSnapshot().state != .active {
                            await signOut(child, with: parent, logger: logger)
                        }
                    }
                }
            }
        }
    }

    /// After a start or a reload (the new table in place, under the boundary gate): a derived
    /// session made anew (at start, or rebuilt by changed settings: what it held was derived
    /// before) is logged in anew when its parent is logged in; any other follows its parent's
    /// state.
    static func reconcile(_ snapshot: SessionTable.Snapshot, previous: SessionTable.Snapshot, logger: Logger) async {
        await withTaskGroup(of: Void.self) { group in
            for name in snapshot.derived.values.joined() {
                guard let child = snapshot.sessions[name], let parent = child.kind.parent else { continue }
                let parentActive = snapshot.sessions[parent]?.coordinator.statusSnapshot().state == .active
                let fresh = previous.sessions[name]?.coordinator !== child.coordinator
                let state = child.coordinator.statusSnapshot().state
                group.addTask {
                    if parentActive, fresh || state != .active {
                        await logIn(child, with: parent, in: snapshot, logger: logger)
                    } else if !parentActive, state != .signedOut {
                        await signOut(child, with: parent, logger: logger)
                    }
                }
            }
        }
    }

    /// (Also when it shows as signed out: a login of it may be under way, which this ends.)
    private static func signOut(_ child: SessionTable.Session, with parent: String, logger: Logger) async {
        let name = child.configuration.name
        defer { child.replies.clear() }
        do {
            try await child.coordinator.logout()
            logger.info("session \(name): signed out with its parent \(parent)", session: name)
        } catch {
            logger.error("session \(name): signed out with its parent \(parent), but not yet stored: \(error)", session: name)
        }
    }

    /// A DPoP parent's key is the child's too, for the child's generation: its requests prove
    /// it, its tokens are bound to it, GetProof on the child signs with it. A parent that logged
    /// in anew while the child did (another key) is followed again.
    private static func logIn(_ child: SessionTable.Session, with parent: String, in snapshot: SessionTable.Snapshot,
                              logger: Logger) async {
        let name = child.configuration.name
        defer { child.replies.clear() }
        let parentCoordinator = snapshot.sessions[parent]?.coordinator
        do {
            var key = parentCoordinator?.proofKey
            for _ in 0..<4 {
                try await child.coordinator.login(refreshToken: nil, proofKey: key)
                let now = parentCoordinator?.proofKey
                if now == key { break }
                key = now
            }
            logger.info("session \(name): logged in with its parent \(parent); its tokens are derived from the parent's", session: name)
        } catch {
            logger.error("session \(name): cannot log in with its parent \(parent): \(error)", session: name)
        }
    }
}
