import Basics
import Synchronization
import HTTPTransport
import WireJSON

/// etcd v3 through its JSON gateway (`/v3/kv/…`, `/v3/lease/…`), over the daemon's libcurl loop.
/// Keys and values are bytes (base64 on the wire); 64-bit numbers travel as JSON strings.
/// Endpoints are tried in order: a member that does not answer is skipped for the next one.
public struct EtcdClient: FleetBackend {
    public var endpoints: [String]
    public var tls: TLSOptions
    /// The deadline of one request to one member.
    public var timeout: Duration
    /// Largest answer accepted.
    public var maximumAnswer: Int
    /// TCP keepalive on every connection to a member (every request asks for the same, so a
    /// pooled connection has it whichever request opened it): a watch on a connection that went
    /// silent (a partition, a vanished host, a dropped NAT entry) fails within its `deadline`
    /// of the last byte the member sent, while nothing is asked of etcd.
    public var keepalive: TCPKeepalive

    /// The default keepalive: a probe after 15 quiet seconds (one empty ACK each way every 15 s
    /// on an idle connection), dead after 6 unanswered at 5 s intervals, 45 s after the last byte.
    public static let deadConnection = TCPKeepalive(idle: .seconds(15), interval: .seconds(5), count: 6)

    public init(endpoints: [String], tls: TLSOptions = TLSOptions(), timeout: Duration = .seconds(2), maximumAnswer: Int = 1 << 20,
                keepalive: TCPKeepalive = EtcdClient.deadConnection) {
        self.endpoints = endpoints
        self.tls = tls
        self.timeout = timeout
        self.maximumAnswer = maximumAnswer
        self.keepalive = keepalive
    }

    // MARK: - Keys

    /// The record of `key`, or nil when there is none; with the store's revision.
    public func get(_ key: [UInt8]) async throws(EtcdError) -> (record: EtcdKeyValue?, revision: Int64) {
        let answer = try await call("/v3/kv/range", ["key": .string(Base64.encode(key))])
        let records = try Self.records(answer["kvs"])
        return (records.first, try Self.revision(answer))
    }

    /// Every record whose key starts with `prefix` (in key order), all read at the revision of
    /// the first page, with that revision. Read in pages of `rangePage` keys, each answer bounded
    /// (`rangePage` values of the largest size a fleet value may have), at most `rangeLimit`
    /// keys in all: a prefix someone filled with junk is an error, not a daemon out of memory.
    public func range(prefix: [UInt8]) async throws(EtcdError) -> (records: [EtcdKeyValue], revision: Int64) {
        let end = Self.rangeEnd(prefix)
        var records: [EtcdKeyValue] = []
        var from = prefix
        var revision: Int64?
        while true {
            var body: JSONObject = ["key": .string(Base64.encode(from)), "range_end": .string(Base64.encode(end)),
                                    "limit": .string(String(Self.rangePage))]
            if let revision { body["revision"] = .string(String(revision)) }
            let answer = try await call("/v3/kv/range", body, maximumAnswer: max(maximumAnswer, Self.rangePageAnswer))
            let page = try Self.records(answer["kvs"])
            let read: Int64
            if let revision { read = revision } else { read = try Self.revision(answer) }
            revision = read
            records += page
            guard answer["more"]?.boolValue == true else { return (records, read) }
            // The next page starts right after this one's last key: it must have moved on.
            guard let last = page.last, last.key.starts(with: prefix), last.key.lexicographicallyPrecedes(end),
                  !last.key.lexicographicallyPrecedes(from) else {
                throw EtcdError(kind: .malformed, message: "a range page that does not move on")
            }
            guard records.count < Self.rangeLimit else {
                throw EtcdError(kind: .malformed, message: "more than \(Self.rangeLimit) keys under the prefix")
            }
            from = last.key + [0]
        }
    }

    /// Keys per page of a range read, and its largest answer: that many values of the largest
    /// size a fleet value may have, base64 on the wire, with their keys.
    static let rangePage = 128
    static let rangePageAnswer = rangePage * (FleetCodec.maximumValue * 4 / 3 + 4096)
    /// The most keys a range read takes.
    static let rangeLimit = 100_000

    /// The first key after every key that starts with `prefix`.
    static func rangeEnd(_ prefix: [UInt8]) -> [UInt8] {
        var end = prefix
        while let last = end.last {
            if last < 0xFF {
                end[end.count - 1] = last + 1
                return end
            }
            end.removeLast()
        }
        return [0]   // every key
    }

    /// Watches the keys under `prefix` from `revision` on, on the first member that takes the
    /// watch, for at most `duration` (see `FleetBackend.watch`; `changed` runs on the HTTP
    /// loop's thread). The member sends progress notes while nothing changes (etcd's
    /// `--experimental-watch-progress-notify-interval`), and, as the stream requires a leader
    /// (gRPC metadata `hasleader`), cancels the stream when it has lost its leader: a member
    /// cut off from the quorum does not keep a watch open and silent.
    public func watch(prefix: [UInt8], from revision: Int64, for duration: Duration,
                      changed: @escaping @Sendable ([EtcdEvent], Int64) -> Void) async throws(EtcdError) -> WatchEnd {
        try await watch(["key": .string(Base64.encode(prefix)), "range_end": .string(Base64.encode(Self.rangeEnd(prefix))),
                         "start_revision": .string(String(revision)), "progress_notify": .bool(true)], for: duration, changed: changed)
    }

    private func watch(_ request: JSONObject, for duration: Duration,
                       changed: @escaping @Sendable ([EtcdEvent], Int64) -> Void) async throws(EtcdError) -> WatchEnd {
        let create: JSONObject = ["create_request": .object(request)]
        var body: [UInt8] = []
        create.encode(into: &body)
        var problem = EtcdError(kind: .unavailable, message: "no endpoint")
        for endpoint in endpoints {
            let stream = EtcdWatchStream(limit: maximumAnswer, changed: changed)
            var request = HTTPRequest(method: "POST", url: endpoint + "/v3/watch",
                                      headers: [("Content-Type", "application/json"), ("Grpc-Metadata-Hasleader", "true")],
                                      body: body, connectTimeout: timeout, timeout: duration, tls: tls)
            request.onBody = { stream.take($0) }
            request.keepalive = keepalive
            switch await Self.perform(request, stream, startingWithin: timeout) {
            case .notStarted:
                problem = EtcdError(kind: .unavailable, message: "\(endpoint): the watch was not created within \(timeout)")
                continue
            case let .done(error?):
                if error is CancellationError { throw EtcdError(kind: .cancelled, message: "cancelled") }
                if let error = error as? HTTPError, error.kind == .timeout, stream.started { return .expired }
                if let ended = stream.problem { throw ended }
                problem = EtcdError(kind: .unavailable, message: "\(endpoint): \(error)")
                if stream.started { throw problem }
                continue
            case .done(nil):
                break
            }
            if let ended = stream.problem { throw ended }
            if stream.started { return .endedEarly }
            problem = EtcdError(kind: .unavailable, message: "\(endpoint): the watch ended before it started")
        }
        throw problem
    }

    /// How a watch's transfer went: done (with its error, if any), or given up because the
    /// member did not create the watch in time.
    private enum Transfer {
        case done((any Error)?)
        case notStarted
    }

    /// Runs a watch's transfer; a member that has not created the watch within `deadline` (one
    /// that accepts and then says nothing: a stopped process behind a live kernel, which TCP
    /// keepalive cannot tell from a quiet one) is given up, so that the next member is tried.
    private static func perform(_ request: HTTPRequest, _ stream: EtcdWatchStream, startingWithin deadline: Duration) async -> Transfer {
        await withTaskGroup(of: Transfer?.self) { group in
            group.addTask {
                do {
                    _ = try await CurlLoop.shared.perform(request)
                    return .done(nil)
                } catch {
                    return .done(error)
                }
            }
            group.addTask {
                // (Cancelled, and so nothing, when the transfer ends first.)
                try? await Task.sleep(for: deadline)
                return Task.isCancelled || stream.started ? nil : .notStarted
            }
            var outcome = Transfer.done(nil)
            while let next = await group.next() {
                guard let next else { continue }
                outcome = next
                group.cancelAll()
                break
            }
            return outcome
        }
    }

    /// Sets `key`; returns the revision of the change.
    @discardableResult
    public func put(_ key: [UInt8], _ value: [UInt8], lease: Int64 = 0) async throws(EtcdError) -> Int64 {
        var body: JSONObject = ["key": .string(Base64.encode(key)), "value": .string(Base64.encode(value))]
        if lease != 0 { body["lease"] = .string(String(lease)) }
        return try Self.revision(try await call("/v3/kv/put", body))
    }

    /// Runs `success` if every comparison holds, else `failure`, atomically.
    public func transaction(_ compare: [EtcdCompare], success: [EtcdOperation], failure: [EtcdOperation] = []) async throws(EtcdError)
        -> EtcdTransaction {
        let body: JSONObject = ["compare": .array(compare.map(Self.encode)), "success": .array(success.map(Self.encode)),
                                "failure": .array(failure.map(Self.encode))]
        let answer = try await call("/v3/kv/txn", body)
        let ran = answer["succeeded"]?.boolValue ?? false
        var reads: [EtcdKeyValue?] = []
        for (operation, response) in zip(ran ? success : failure, answer["responses"]?.arrayValue ?? []) {
            guard case .get = operation else { continue }
            reads.append(try Self.records(response.objectValue?["response_range"]?.objectValue?["kvs"]).first)
        }
        return EtcdTransaction(succeeded: ran, revision: try Self.revision(answer), reads: reads)
    }

    // MARK: - Leases

    /// A new lease of `ttl`; returns its id and the TTL etcd granted.
    public func grantLease(ttl: Duration) async throws(EtcdError) -> (id: Int64, ttl: Duration) {
        let answer = try await call("/v3/lease/grant", ["TTL": .string(String(ttl.components.seconds))])
        guard let id = Self.int(answer["ID"]), id != 0, let granted = Self.int(answer["TTL"]) else {
            throw EtcdError(kind: .malformed, message: "lease grant without an ID and a TTL")
        }
        return (id, .seconds(granted))
    }

    /// Renews the lease; returns its TTL, or nil when it has expired (or never existed).
    public func keepAlive(lease: Int64) async throws(EtcdError) -> Duration? {
        let answer = try await call("/v3/lease/keepalive", ["ID": .string(String(lease))])
        guard let result = answer["result"]?.objectValue else { throw EtcdError(kind: .malformed, message: "keepalive without a result") }
        let ttl = Self.int(result["TTL"]) ?? 0
        return ttl > 0 ? .seconds(ttl) : nil
    }

    /// Ends the lease at once, deleting the keys attached to it. An unknown lease is no error.
    public func revoke(lease: Int64) async throws(EtcdError) {
        do {
            _ = try await call("/v3/lease/revoke", ["ID": .string(String(lease))])
        } catch let error where error.kind == .refused(code: 5) {
            return   // NotFound: expired already
        }
    }

    // MARK: - The wire

    private func call(_ path: String, _ body: JSONObject, maximumAnswer: Int? = nil) async throws(EtcdError) -> JSONObject {
        var bytes: [UInt8] = []
        body.encode(into: &bytes)
        var problem = EtcdError(kind: .unavailable, message: "no endpoint")
        for endpoint in endpoints {
            var request = HTTPRequest(method: "POST", url: endpoint + path, headers: [("Content-Type", "application/json")], body: bytes,
                                      connectTimeout: timeout, timeout: timeout, tls: tls, maximumBodySize: maximumAnswer ?? self.maximumAnswer)
            request.keepalive = keepalive
            let response: HTTPResponse
            do {
                response = try await CurlLoop.shared.perform(request)
            } catch is CancellationError {
                throw EtcdError(kind: .cancelled, message: "cancelled")
            } catch {
                problem = EtcdError(kind: .unavailable, message: "\(endpoint): \(error)")
                continue
            }
            guard let answer = (try? JSONParser.parse(response.body))?.objectValue else {
                problem = EtcdError(kind: response.status >= 500 ? .unavailable : .malformed,
                                    message: "\(endpoint)\(path): HTTP \(response.status), not a JSON object")
                if response.status >= 500 { continue }
                throw problem
            }
            if let code = Self.int(answer["code"]), code != 0 {
                let message = FleetCodec.printable(answer["message"]?.stringValue ?? "error \(code)")
                // Unavailable (14) and deadline exceeded (4): another member may do better.
                if code == 14 || code == 4 {
                    problem = EtcdError(kind: .unavailable, message: "\(endpoint): \(message)")
                    continue
                }
                throw EtcdError(kind: .refused(code: Int(code)), message: message)
            }
            guard response.status == 200 else {
                throw EtcdError(kind: .malformed, message: "\(endpoint)\(path): HTTP \(response.status)")
            }
            return answer
        }
        throw problem
    }

    private static func encode(_ compare: EtcdCompare) -> JSON {
        switch compare {
        case let .createRevision(key, value):
            return ["key": .string(Base64.encode(key)), "target": "CREATE", "result": "EQUAL", "create_revision": .string(String(value))]
        case let .modRevision(key, value):
            return ["key": .string(Base64.encode(key)), "target": "MOD", "result": "EQUAL", "mod_revision": .string(String(value))]
        case let .value(key, value):
            return ["key": .string(Base64.encode(key)), "target": "VALUE", "result": "EQUAL", "value": .string(Base64.encode(value))]
        }
    }

    private static func encode(_ operation: EtcdOperation) -> JSON {
        switch operation {
        case let .put(key, value, lease):
            var put: JSONObject = ["key": .string(Base64.encode(key)), "value": .string(Base64.encode(value))]
            if lease != 0 { put["lease"] = .string(String(lease)) }
            return ["request_put": .object(put)]
        case let .delete(key):
            return ["request_delete_range": ["key": .string(Base64.encode(key))]]
        case let .get(key):
            return ["request_range": ["key": .string(Base64.encode(key))]]
        }
    }

    /// A 64-bit number as the gateway writes it (a string; a plain number is accepted too).
    static func int(_ value: JSON?) -> Int64? {
        switch value {
        case let .string(text)?: return Int64(text)
        case let .int(number)?: return number
        default: return nil
        }
    }

    static func revision(_ answer: JSONObject) throws(EtcdError) -> Int64 {
        // (A revision near Int64.max would make `revision + 1` trap: no real cluster gets there.)
        guard let revision = int(answer["header"]?.objectValue?["revision"]), (0..<etcdNumberLimit).contains(revision) else {
            throw EtcdError(kind: .malformed, message: "an answer without a header revision")
        }
        return revision
    }

    static func records(_ value: JSON?) throws(EtcdError) -> [EtcdKeyValue] {
        guard let value else { return [] }
        guard let array = value.arrayValue else { throw EtcdError(kind: .malformed, message: "kvs is not an array") }
        return try array.map { (item) throws(EtcdError) -> EtcdKeyValue in
            guard let object = item.objectValue else { throw EtcdError(kind: .malformed, message: "a record that is not an object") }
            return try record(object)
        }
    }

    /// One `mvccpb.KeyValue`; its revisions and version within `etcdNumberLimit`.
    static func record(_ object: JSONObject) throws(EtcdError) -> EtcdKeyValue {
        guard let key = object["key"]?.stringValue.flatMap(Base64.decode) else {
            throw EtcdError(kind: .malformed, message: "a record without a key")
        }
        // An empty value is left out of the JSON.
        var value: [UInt8] = []
        if let encoded = object["value"] {
            guard let decoded = encoded.stringValue.flatMap(Base64.decode) else {
                throw EtcdError(kind: .malformed, message: "a value that is not base64")
            }
            value = decoded
        }
        var numbers: [Int64] = []
        for field in ["create_revision", "mod_revision", "version"] {
            let number = object[field] == nil ? 0 : int(object[field])
            guard let number, (0..<etcdNumberLimit).contains(number) else {
                throw EtcdError(kind: .malformed, message: "a record whose \(field) is not a number in range")
            }
            numbers.append(number)
        }
        return EtcdKeyValue(key: key, value: value, createRevision: numbers[0], modRevision: numbers[1], version: numbers[2],
                            lease: int(object["lease"]) ?? 0)
    }
}
