import Synchronization
import WireJSON

/// The lines of one watch answer (one JSON object per line), cut and read on the HTTP loop's
/// thread as they arrive. Each line is bounded before it is buffered; events are decoded with
/// the same checks as a range's records.
final class EtcdWatchStream: Sendable {
    private struct State {
        var line: [UInt8] = []
        var started = false
        var problem: EtcdError?
    }

    private let state = Mutex(State())
    private let limit: Int
    private let changed: @Sendable ([EtcdEvent], Int64) -> Void

    init(limit: Int, changed: @escaping @Sendable ([EtcdEvent], Int64) -> Void) {
        self.limit = limit
        self.changed = changed
    }

    var started: Bool { state.withLock { $0.started } }
    var problem: EtcdError? { state.withLock { $0.problem } }

    /// Returns false to end the transfer (a line too long, an error, a cancelled watch).
    func take(_ bytes: UnsafeRawBufferPointer) -> Bool {
        var batches: [([EtcdEvent], Int64)] = []
        let going = state.withLock { state -> Bool in
            for byte in bytes {
                guard byte == 0x0A else {
                    state.line.append(byte)
                    if state.line.count > limit {
                        state.problem = EtcdError(kind: .malformed, message: "a watch message larger than \(limit) bytes")
                        return false
                    }
                    continue
                }
                defer { state.line.removeAll(keepingCapacity: true) }
                do throws(EtcdError) {
                    if let batch = try Self.batch(state.line, started: &state.started) { batches.append(batch) }
                } catch {
                    state.problem = error
                    return false
                }
            }
            return true
        }
        for (events, revision) in batches { changed(events, revision) }
        return going
    }

    /// One line of the stream: nil for `created`; a progress note (no events: nothing changed up
    /// to its header's revision) is a batch without events.
    static func batch(_ line: [UInt8], started: inout Bool) throws(EtcdError) -> ([EtcdEvent], Int64)? {
        guard let message = (try? JSONParser.parse(line))?.objectValue else {
            throw EtcdError(kind: .malformed, message: "a watch message that is not a JSON object")
        }
        guard let result = message["result"]?.objectValue else {
            let text = message["error"]?.objectValue?["message"]?.stringValue ?? "an error"
            throw EtcdError(kind: .unavailable, message: "watch: \(text.prefix(200))")
        }
        if result["canceled"]?.boolValue == true || EtcdClient.int(result["compact_revision"]).map({ $0 > 0 }) == true {
            throw EtcdError(kind: .refused(code: 11), message: "the watch was cancelled (history compacted)")
        }
        let created = result["created"]?.boolValue == true
        if created { started = true }
        guard let items = result["events"] else {
            // A progress note: its revision, once the watch is under way (else ignored).
            guard !created, started, let header = result["header"]?.objectValue else { return nil }
            return ([], try EtcdClient.revision(["header": .object(header)]))
        }
        guard let items = items.arrayValue, let header = result["header"]?.objectValue else {
            throw EtcdError(kind: .malformed, message: "watch events without a header")
        }
        let revision = try EtcdClient.revision(["header": .object(header)])
        started = true
        var events: [EtcdEvent] = []
        for item in items {
            guard let event = item.objectValue, let kv = event["kv"]?.objectValue else {
                throw EtcdError(kind: .malformed, message: "a watch event without a record")
            }
            let kind: EtcdEvent.Kind
            switch event["type"]?.stringValue {
            case nil, "PUT": kind = .put
            case "DELETE": kind = .delete
            default: throw EtcdError(kind: .malformed, message: "a watch event of an unknown type")
            }
            events.append(EtcdEvent(kind: kind, record: try EtcdClient.record(kv)))
        }
        return (events, revision)
    }
}
