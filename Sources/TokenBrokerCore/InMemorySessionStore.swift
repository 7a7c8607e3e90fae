/// A `SessionStore` that keeps records in memory: the default until the SQLite store lands,
/// and the reference behaviour of the generation guard.
public actor InMemorySessionStore: SessionStore {
    private var records: [String: SessionRecord]

    public init(_ records: [SessionRecord] = []) {
        self.records = Dictionary(records.map { ($0.name, $0) }, uniquingKeysWith: { _, last in last })
    }

    public func load(_ session: String) -> SessionRecord? {
        records[session]
    }

    public func write(_ write: StoreWrite) -> Bool {
        guard write.applies(over: records[write.record.name]) else { return false }
        records[write.record.name] = write.record
        return true
    }
}
