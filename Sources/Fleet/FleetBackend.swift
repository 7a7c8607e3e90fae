/// What a fleet needs of the store it shares: etcd v3's data model — keys with revisions and
/// versions, atomic compare-and-swap transactions, and watches of a prefix. `EtcdClient` is the
/// implementation the daemon uses; the tests drive an in-memory one, whose every request they
/// can hold, fail or answer late. (etcd's leases are not among them: anyone who can write the
/// prefix can delete a key on a lease, so who refreshes is part of the sealed state instead.)
///
/// Nothing a backend returns is trusted: a fleet session opens every value with the fleet key,
/// checks where in its key's history it was written, and bounds every number (`FleetCodec`).
public protocol FleetBackend: Sendable {
    /// The record of `key`, or nil when there is none; with the store's revision.
    func get(_ key: [UInt8]) async throws(EtcdError) -> (record: EtcdKeyValue?, revision: Int64)
    /// Runs `success` if every comparison holds, else `failure`, atomically.
    func transaction(_ compare: [EtcdCompare], success: [EtcdOperation], failure: [EtcdOperation]) async throws(EtcdError)
        -> EtcdTransaction
    /// Every record whose key starts with `prefix` (in key order), all read at one revision,
    /// with that revision: a fleet's keys in one read (in bounded pages behind this call).
    func range(prefix: [UInt8]) async throws(EtcdError) -> (records: [EtcdKeyValue], revision: Int64)
    /// Watches the keys under `prefix` from `revision` on, for at most `duration`: `changed` gets
    /// every batch of events with the revision it brings (it must not block; a batch without
    /// events is a progress note: nothing under the prefix changed up to its revision). Returns
    /// how the stream ended; throws when no member would watch, or when the watch was cancelled
    /// (its history before `revision` compacted, a member that lost its leader, say): the
    /// caller reads the prefix again.
    func watch(prefix: [UInt8], from revision: Int64, for duration: Duration,
               changed: @escaping @Sendable ([EtcdEvent], Int64) -> Void) async throws(EtcdError) -> WatchEnd
}

/// How a watch that did not fail ended.
public enum WatchEnd: Sendable, Equatable {
    /// Its duration was over.
    case expired
    /// The member ended the stream first (a restart, a proxy, a member that is misbehaving).
    case endedEarly
}

/// A key's record as etcd holds it.
public struct EtcdKeyValue: Sendable, Equatable {
    public var key: [UInt8]
    public var value: [UInt8]
    public var createRevision: Int64
    public var modRevision: Int64
    /// How many times the key was written since it was created (1 for its first write).
    public var version: Int64
    /// The lease the key is attached to (0: none).
    public var lease: Int64

    public init(key: [UInt8], value: [UInt8], createRevision: Int64, modRevision: Int64, version: Int64, lease: Int64) {
        self.key = key
        self.value = value
        self.createRevision = createRevision
        self.modRevision = modRevision
        self.version = version
        self.lease = lease
    }
}

/// One change a watch reports.
public struct EtcdEvent: Sendable, Equatable {
    public enum Kind: Sendable, Equatable { case put, delete }
    public var kind: Kind
    /// A put's new record; a delete's key, with the revision of the deletion as `modRevision`.
    public var record: EtcdKeyValue

    public init(kind: Kind, record: EtcdKeyValue) {
        self.kind = kind
        self.record = record
    }
}

/// What went wrong talking to the fleet's store.
public struct EtcdError: Error, Sendable, Equatable, CustomStringConvertible {
    public enum Kind: Sendable, Equatable {
        /// No member answered (network, timeout, no quorum behind the gateway): try again later.
        case unavailable
        /// etcd refused the request (its gRPC code): retrying the same request will not help.
        case refused(code: Int)
        /// The answer was not what etcd's JSON gateway sends.
        case malformed
        /// The calling task was cancelled (nothing is known of etcd).
        case cancelled
    }

    public var kind: Kind
    public var message: String
    public var description: String { "etcd: \(message)" }

    public init(kind: Kind, message: String) {
        self.kind = kind
        self.message = message
    }
}

/// One comparison of a transaction (all must hold for `success` to run).
public enum EtcdCompare: Sendable, Equatable {
    /// The key's create revision (0: the key does not exist).
    case createRevision(key: [UInt8], equals: Int64)
    /// The key's last modification revision (0: the key does not exist).
    case modRevision(key: [UInt8], equals: Int64)
    case value(key: [UInt8], equals: [UInt8])
}

/// One operation of a transaction.
public enum EtcdOperation: Sendable, Equatable {
    /// (`lease` 0: none; a fleet session attaches nothing to a lease.)
    case put(key: [UInt8], value: [UInt8], lease: Int64)
    case delete(key: [UInt8])
    case get(key: [UInt8])
}

/// The outcome of a transaction: which branch ran, at which revision, and the records that
/// its `get` operations read (in order).
public struct EtcdTransaction: Sendable, Equatable {
    public var succeeded: Bool
    public var revision: Int64
    public var reads: [EtcdKeyValue?]

    public init(succeeded: Bool, revision: Int64, reads: [EtcdKeyValue?]) {
        self.succeeded = succeeded
        self.revision = revision
        self.reads = reads
    }
}

/// Revisions, versions and lease ids beyond this are refused wherever they are read: no sum or
/// successor computed from them can overflow.
public let etcdNumberLimit: Int64 = 1 << 62
