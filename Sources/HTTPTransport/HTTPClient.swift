#if canImport(Glibc)
import Glibc
#endif
import CCurl
import Basics
import Synchronization

/// One HTTP request. Bodies and header values may hold secrets: nothing here is ever logged.
public struct HTTPRequest: Sendable {
    public var method: String
    public var url: String
    public var headers: [(name: String, value: String)]
    public var body: [UInt8]?
    /// Time allowed for the TCP (and TLS) connection.
    public var connectTimeout: Duration
    /// Total deadline for the whole exchange: no answer, however slow, takes longer.
    public var timeout: Duration
    public var tls: TLSOptions
    /// Largest response body accepted.
    public var maximumBodySize: Int
    /// A streaming answer (etcd's watch): each piece of the body is handed here, on the loop
    /// thread, instead of being collected (so `maximumBodySize` does not apply); it must not
    /// block. Returning false ends the transfer.
    public var onBody: (@Sendable (UnsafeRawBufferPointer) -> Bool)?
    /// TCP keepalive on the connection this request opens (nil: none). A pooled connection
    /// keeps what the request that opened it asked for: give every request to a host the same.
    public var keepalive: TCPKeepalive?

    public init(method: String = "GET", url: String, headers: [(name: String, value: String)] = [], body: [UInt8]? = nil,
                connectTimeout: Duration = .seconds(5), timeout: Duration = .seconds(30), tls: TLSOptions = TLSOptions(),
                maximumBodySize: Int = 1 << 20) {
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.connectTimeout = connectTimeout
        self.timeout = timeout
        self.tls = tls
        self.maximumBodySize = maximumBodySize
    }
}

/// Trust and client identity for HTTPS.
public struct TLSOptions: Sendable, Equatable {
    /// Trust only the CAs in this PEM file (the system store is not consulted).
    public var caFile: String?
    /// A client certificate and key (PEM) for mutual TLS (RFC 8705).
    public var clientCertificate: String?
    public var clientKey: String?

    public init(caFile: String? = nil, clientCertificate: String? = nil, clientKey: String? = nil) {
        self.caFile = caFile
        self.clientCertificate = clientCertificate
        self.clientKey = clientKey
    }
}

public struct HTTPResponse: Sendable {
    public var status: Int
    /// Header names lower-cased.
    public var headers: [(name: String, value: String)]
    public var body: [UInt8]
    /// The server's `Retry-After`, in seconds (libcurl parses both forms).
    public var retryAfter: Int?
    /// The whole second (Unix) the request this answers was sent in, or a first one of the
    /// same exchange (a token answer's lifetime counts from it: `OAuthClient.tokenEndpointPost`).
    public var requestedAt: Int64?

    public init(status: Int, headers: [(name: String, value: String)], body: [UInt8], retryAfter: Int? = nil, requestedAt: Int64? = nil) {
        (self.status, self.headers, self.body, self.retryAfter, self.requestedAt) = (status, headers, body, retryAfter, requestedAt)
    }

    public func header(_ name: String) -> String? {
        let lower = name.lowercased()
        return headers.last { $0.name == lower }?.value
    }

}

/// A transfer that produced no HTTP response.
public struct HTTPError: Error, Sendable, Equatable, CustomStringConvertible {
    public enum Kind: Sendable, Equatable {
        case timeout, connectionFailed, tls, bodyTooLarge, invalidRequest, other
    }

    public var kind: Kind
    /// libcurl's message (names hosts and ports, never request content).
    public var message: String
    public var code: Int32

    public var description: String { message }
}

/// One thread that owns one libcurl multi handle for the whole process; every request is
/// an easy handle added to it. Connections are pooled there. A request's task can be
/// cancelled at any time: the loop is woken and drops the transfer at once.
public final class CurlLoop: Sendable {
    fileprivate struct Submission: @unchecked Sendable {
        // @unchecked: the continuation is resumed exactly once, on the loop thread; the
        // request is an immutable value.
        let request: HTTPRequest
        let flag: CancelFlag
        let continuation: CheckedContinuation<HTTPResponse, any Error>
    }

    final class CancelFlag: Sendable {
        private let value = Atomic<Bool>(false)
        func cancel() { value.store(true, ordering: .releasing) }
        var isCancelled: Bool { value.load(ordering: .acquiring) }
    }

    /// The multi handle. Only `curl_multi_wakeup` is called from other threads, which libcurl
    /// allows; everything else happens on the loop thread.
    private struct Multi: @unchecked Sendable {
        let raw: UnsafeMutableRawPointer
    }

    /// Submissions waiting for the loop thread, and whether the loop is to end.
    private final class Inbox: Sendable {
        /// Closed by the loop thread when it ends: nothing is accepted after that.
        let queue = Mutex<(submissions: [Submission], closed: Bool)>(([], false))
        let stopped = Atomic<Bool>(false)
    }

    /// The multi handle, or why there is none (libcurl could not be loaded).
    private let engine: Result<Multi, HTTPError>
    private let inbox = Inbox()

    /// The process's loop, made on first use: libcurl is loaded (and `curl_global_init` runs)
    /// before the loop thread starts.
    public static let shared = CurlLoop()

    /// Whether `shared` was made: stopping a loop nobody used must not load libcurl.
    private static let made = Atomic<Bool>(false)

    private init() {
        CurlLoop.made.store(true, ordering: .releasing)
        guard Libcurl.loadProblem == nil, let raw = tb_curl_multi_init() else {
            engine = .failure(HTTPError(kind: .other, message: "libcurl cannot be used: \(Libcurl.loadProblem ?? "curl_multi_init failed")", code: -1))
            return
        }
        let multi = Multi(raw: raw)
        engine = .success(multi)
        tb_multi_setopt_long(raw, CURLMOPT_MAX_HOST_CONNECTIONS, 8)
        let inbox = self.inbox
        spawnThread { CurlLoop.run(multi, inbox) }
    }

    /// Why no request can be made (libcurl could not be loaded), or nil.
    public var problem: String? {
        if case let .failure(error) = engine { return error.message }
        return nil
    }

    /// Ends the process's loop if it was ever made (see `stop`).
    public static func stopShared() {
        if made.load(ordering: .acquiring) { shared.stop() }
    }

    /// Performs the request. Throws `HTTPError` when no response came, `CancellationError`
    /// when the calling task was cancelled.
    public func perform(_ request: HTTPRequest) async throws -> HTTPResponse {
        let multi = try engine.get()
        let flag = CancelFlag()
        return try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { continuation in
                let accepted = inbox.queue.withLock { queue -> Bool in
                    guard !queue.closed else { return false }
                    queue.submissions.append(Submission(request: request, flag: flag, continuation: continuation))
                    return true
                }
                guard accepted else {
                    return continuation.resume(throwing: HTTPError(kind: .other, message: "the HTTP loop has stopped", code: -1))
                }
                tb_curl_multi_wakeup(multi.raw)
            }
        } onCancel: {
            flag.cancel()
            tb_curl_multi_wakeup(multi.raw)
        }
    }

    /// Ends the loop: transfers under way and submitted later fail at once. The daemon stops
    /// it last, once nothing needs it any more.
    public func stop() {
        inbox.stopped.store(true, ordering: .releasing)
        if case let .success(multi) = engine { tb_curl_multi_wakeup(multi.raw) }
    }

    private static func run(_ multi: Multi, _ inbox: Inbox) {
        var active: [UnsafeMutableRawPointer: CurlTransfer] = [:]
        var running: Int32 = 0
        while true {
            if inbox.stopped.load(ordering: .acquiring) {
                let stopped = HTTPError(kind: .other, message: "the HTTP loop has stopped", code: -1)
                for (easy, transfer) in active {
                    tb_curl_multi_remove_handle(multi.raw, easy)
                    tb_curl_easy_cleanup(easy)
                    transfer.submission.continuation.resume(throwing: stopped)
                }
                let left = inbox.queue.withLock { queue in
                    queue.closed = true
                    defer { queue.submissions.removeAll() }
                    return queue.submissions
                }
                for submission in left { submission.continuation.resume(throwing: stopped) }
                return
            }
            for submission in inbox.queue.withLock({ queue in defer { queue.submissions.removeAll() }; return queue.submissions }) {
                if submission.flag.isCancelled {
                    submission.continuation.resume(throwing: CancellationError())
                    continue
                }
                let transfer = CurlTransfer(submission)
                guard let easy = tb_curl_easy_init() else {
                    submission.continuation.resume(throwing: HTTPError(kind: .other, message: "curl_easy_init failed", code: -1))
                    continue
                }
                if let problem = configure(easy, transfer) {
                    tb_curl_easy_cleanup(easy)
                    submission.continuation.resume(throwing: problem)
                    continue
                }
                active[easy] = transfer
                tb_curl_multi_add_handle(multi.raw, easy)
            }
            for (easy, transfer) in active where transfer.submission.flag.isCancelled {
                tb_curl_multi_remove_handle(multi.raw, easy)
                tb_curl_easy_cleanup(easy)
                active[easy] = nil
                transfer.submission.continuation.resume(throwing: CancellationError())
            }
            tb_curl_multi_perform(multi.raw, &running)
            var left: Int32 = 0
            while let message = tb_curl_multi_info_read(multi.raw, &left) {
                guard message.pointee.msg == CURLMSG_DONE, let easy = message.pointee.easy_handle,
                      let transfer = active.removeValue(forKey: easy) else { continue }
                let result = finish(easy, message.pointee.data.result, transfer)
                tb_curl_multi_remove_handle(multi.raw, easy)
                tb_curl_easy_cleanup(easy)
                transfer.submission.continuation.resume(with: result)
            }
            tb_curl_multi_poll(multi.raw, nil, 0, 1000, nil)
        }
    }

    private static func configure(_ easy: UnsafeMutableRawPointer, _ transfer: CurlTransfer) -> HTTPError? {
        let request = transfer.submission.request
        func check(_ code: CURLcode, _ what: String) -> HTTPError? {
            code == CURLE_OK ? nil : HTTPError(kind: .invalidRequest, message: "\(what): \(String(cString: tb_curl_easy_strerror(code)))",
                                               code: Int32(code.rawValue))
        }
        let context = Unmanaged.passUnretained(transfer).toOpaque()
        var problems: [HTTPError?] = [
            check(tb_easy_setopt_string(easy, CURLOPT_URL, request.url), "URL"),
            check(tb_easy_setopt_string(easy, CURLOPT_PROTOCOLS_STR, "http,https"), "protocols"),
            check(tb_easy_setopt_long(easy, CURLOPT_NOSIGNAL, 1), "nosignal"),
            check(tb_easy_setopt_long(easy, CURLOPT_CONNECTTIMEOUT_MS, milliseconds(request.connectTimeout)), "connect timeout"),
            check(tb_easy_setopt_long(easy, CURLOPT_TIMEOUT_MS, milliseconds(request.timeout)), "timeout"),
            check(tb_easy_setopt_pointer(easy, CURLOPT_ERRORBUFFER, transfer.errorBuffer), "error buffer"),
            check(tb_easy_setopt_write_callback(easy, CURLOPT_WRITEFUNCTION, bodyCallback), "write callback"),
            check(tb_easy_setopt_pointer(easy, CURLOPT_WRITEDATA, context), "write data"),
            check(tb_easy_setopt_write_callback(easy, CURLOPT_HEADERFUNCTION, headerCallback), "header callback"),
            check(tb_easy_setopt_pointer(easy, CURLOPT_HEADERDATA, context), "header data"),
            check(tb_easy_setopt_string(easy, CURLOPT_USERAGENT, "tokenbroker"), "user agent"),
            check(tb_easy_setopt_long(easy, CURLOPT_FOLLOWLOCATION, 0), "redirects"),
        ]
        if let keepalive = request.keepalive {
            problems.append(check(tb_easy_setopt_long(easy, CURLOPT_TCP_KEEPALIVE, 1), "keepalive"))
            problems.append(check(tb_easy_setopt_long(easy, CURLOPT_TCP_KEEPIDLE, keepalive.idleSeconds), "keepalive idle"))
            problems.append(check(tb_easy_setopt_long(easy, CURLOPT_TCP_KEEPINTVL, keepalive.intervalSeconds), "keepalive interval"))
            problems.append(check(tb_easy_setopt_sockopt_callback(easy, CURLOPT_SOCKOPTFUNCTION, socketCallback), "keepalive count"))
            problems.append(check(tb_easy_setopt_pointer(easy, CURLOPT_SOCKOPTDATA, context), "socket data"))
        }
        if request.url.lowercased().hasPrefix("http://") {
            // Plain HTTP is allowed only to a loopback address: never through a proxy from the
            // environment (http_proxy, all_proxy), which would see the credential in clear.
            problems.append(check(tb_easy_setopt_string(easy, CURLOPT_PROXY, ""), "no proxy"))
        }
        if let caFile = request.tls.caFile {
            // Only this CA: clear Debian's default CA path too, which would otherwise still apply.
            problems.append(check(tb_easy_setopt_string(easy, CURLOPT_CAINFO, caFile), "CA file"))
            problems.append(check(tb_easy_setopt_string(easy, CURLOPT_CAPATH, nil), "CA path"))
        }
        if let certificate = request.tls.clientCertificate {
            problems.append(check(tb_easy_setopt_string(easy, CURLOPT_SSLCERT, certificate), "client certificate"))
        }
        if let key = request.tls.clientKey {
            problems.append(check(tb_easy_setopt_string(easy, CURLOPT_SSLKEY, key), "client key"))
        }
        var list: UnsafeMutablePointer<curl_slist>?
        for header in request.headers { list = tb_curl_slist_append(list, "\(header.name): \(header.value)") }
        // No `Expect: 100-continue` pause, whatever the body size.
        list = tb_curl_slist_append(list, "Expect:")
        transfer.headerList = list
        problems.append(check(tb_easy_setopt_slist(easy, CURLOPT_HTTPHEADER, list), "headers"))
        if let body = request.body {
            problems.append(check(tb_easy_setopt_off(easy, CURLOPT_POSTFIELDSIZE_LARGE, curl_off_t(body.count)), "body size"))
            // COPYPOSTFIELDS: libcurl keeps its own copy of the body.
            problems.append(body.withUnsafeBytes { bytes in
                check(tb_easy_setopt_pointer(easy, CURLOPT_COPYPOSTFIELDS, UnsafeMutableRawPointer(mutating: bytes.baseAddress ?? UnsafeRawPointer(bitPattern: 1)!)), "body")
            })
        }
        if request.method != "GET" && request.method != "POST" {
            problems.append(check(tb_easy_setopt_string(easy, CURLOPT_CUSTOMREQUEST, request.method), "method"))
        } else if request.method == "POST" && request.body == nil {
            problems.append(check(tb_easy_setopt_long(easy, CURLOPT_POST, 1), "method"))
            problems.append(check(tb_easy_setopt_off(easy, CURLOPT_POSTFIELDSIZE_LARGE, 0), "body size"))
        }
        return problems.compactMap { $0 }.first
    }

    private static func finish(_ easy: UnsafeMutableRawPointer, _ code: CURLcode, _ transfer: CurlTransfer) -> Result<HTTPResponse, any Error> {
        guard code == CURLE_OK else {
            let detail = String(cString: transfer.errorBuffer)
            let message = detail.isEmpty ? String(cString: tb_curl_easy_strerror(code)) : detail
            let kind: HTTPError.Kind
            switch code {
            case CURLE_OPERATION_TIMEDOUT: kind = .timeout
            case CURLE_COULDNT_CONNECT, CURLE_COULDNT_RESOLVE_HOST, CURLE_COULDNT_RESOLVE_PROXY: kind = .connectionFailed
            case CURLE_PEER_FAILED_VERIFICATION, CURLE_SSL_CONNECT_ERROR, CURLE_SSL_CERTPROBLEM, CURLE_SSL_CACERT_BADFILE: kind = .tls
            case CURLE_WRITE_ERROR where transfer.tooLarge: kind = .bodyTooLarge
            default: kind = .other
            }
            return .failure(HTTPError(kind: kind, message: message, code: Int32(code.rawValue)))
        }
        var status = 0
        tb_easy_getinfo_long(easy, CURLINFO_RESPONSE_CODE, &status)
        var retryAfter: curl_off_t = 0
        tb_easy_getinfo_off(easy, CURLINFO_RETRY_AFTER, &retryAfter)
        return .success(HTTPResponse(status: status, headers: transfer.headers, body: transfer.body,
                                     retryAfter: retryAfter > 0 ? Int(retryAfter) : nil))
    }

    private static func milliseconds(_ duration: Duration) -> Int {
        max(1, Int(duration.components.seconds * 1000 + duration.components.attoseconds / 1_000_000_000_000_000))
    }
}

/// State of one transfer, touched only by the loop thread (and libcurl's callbacks on it).
fileprivate final class CurlTransfer {
    let submission: CurlLoop.Submission
    var body: [UInt8] = []
    var headers: [(name: String, value: String)] = []
    var tooLarge = false
    let errorBuffer = UnsafeMutablePointer<CChar>.allocate(capacity: Int(CURL_ERROR_SIZE) + 1)
    var headerList: UnsafeMutablePointer<curl_slist>?

    init(_ submission: CurlLoop.Submission) {
        self.submission = submission
        errorBuffer.initialize(repeating: 0, count: Int(CURL_ERROR_SIZE) + 1)
    }

    deinit {
        errorBuffer.deallocate()
        tb_curl_slist_free_all(headerList)
    }

    /// Returns false (which aborts the transfer) past the body limit.
    func appendBody(_ bytes: UnsafeRawBufferPointer) -> Bool {
        if let onBody = submission.request.onBody { return onBody(bytes) }
        guard body.count + bytes.count <= submission.request.maximumBodySize else {
            tooLarge = true
            return false
        }
        body.append(contentsOf: bytes)
        return true
    }

    /// One header line; a new status line (a redirect or 1xx answer) starts the list afresh.
    func appendHeader(_ bytes: UnsafeRawBufferPointer) {
        if bytes.starts(with: "HTTP/".utf8) {
            headers.removeAll()
            return
        }
        guard let colon = bytes.firstIndex(of: UInt8(ascii: ":")) else { return }
        let name = String(decoding: bytes[..<colon], as: UTF8.self).lowercased()
        var value = bytes[(colon + 1)...]
        while let first = value.first, first == 0x20 || first == 0x09 { value = value.dropFirst() }
        while let last = value.last, last == 0x20 || last == 0x09 || last == 0x0D || last == 0x0A { value = value.dropLast() }
        headers.append((name, String(decoding: value, as: UTF8.self)))
    }
}

private let bodyCallback: curl_write_callback = { pointer, size, count, context in
    let transfer = Unmanaged<CurlTransfer>.fromOpaque(context!).takeUnretainedValue()
    let length = size * count
    guard let pointer else { return 0 }
    return transfer.appendBody(UnsafeRawBufferPointer(start: pointer, count: length)) ? length : 0
}

private let headerCallback: curl_write_callback = { pointer, size, count, context in
    let transfer = Unmanaged<CurlTransfer>.fromOpaque(context!).takeUnretainedValue()
    let length = size * count
    guard let pointer else { return 0 }
    transfer.appendHeader(UnsafeRawBufferPointer(start: pointer, count: length))
    return length
}

/// A new connection's socket, before it connects: what `TCPKeepalive` sets beyond libcurl's
/// options (only set for a request with keepalive).
private let socketCallback: curl_sockopt_callback = { context, socket, purpose in
    let transfer = Unmanaged<CurlTransfer>.fromOpaque(context!).takeUnretainedValue()
    guard purpose == CURLSOCKTYPE_IPCXN, let keepalive = transfer.submission.request.keepalive else { return CURL_SOCKOPT_OK }
    return keepalive.apply(to: socket) ? CURL_SOCKOPT_OK : CURL_SOCKOPT_ERROR
}
