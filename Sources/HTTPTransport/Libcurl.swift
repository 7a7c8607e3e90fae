import CCurl

/// libcurl, opened on first use (see CCurl.h): the daemon is ready before it is loaded.
public enum Libcurl {
    /// Why libcurl.so.4 cannot be used, or nil once it is loaded and initialised. The first
    /// access loads it (a few milliseconds: libcurl and its dependencies), later ones are free.
    public static let loadProblem: String? = {
        var reason = [CChar](repeating: 0, count: 256)
        guard tb_curl_load(&reason, reason.count) == 0 else {
            return String(decoding: reason.prefix(while: { $0 != 0 }).map { UInt8(bitPattern: $0) }, as: UTF8.self)
        }
        let code = tb_curl_global_init(Int(CURL_GLOBAL_DEFAULT))
        return code == CURLE_OK ? nil : "curl_global_init: \(String(cString: tb_curl_easy_strerror(code)))"
    }()
}
