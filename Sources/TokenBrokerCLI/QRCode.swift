#if canImport(Glibc)
import Glibc
#endif
import CLinux

/// A QR code of a login's URL, for a phone to open, drawn with Unicode half blocks for a
/// terminal. The encoder is libqrencode (Debian's libqrencode4), loaded only when a code is
/// drawn: `ctl` and the credential helpers, which run by the thousand, never load it, and
/// without it `ctl login` prints the URL alone. Only a dynamically linked process loads it
/// (the static `tokenbroker` hands a `ctl login` on a terminal to `tokenbroker-daemon`):
/// glibc's dlopen from a static executable is not to be relied on.
enum QRCode {
    /// The modules of `text` (true: dark), row by row; nil when libqrencode is not installed or
    /// cannot encode it (byte mode, error correction level L: up to 2,953 bytes).
    static func modules(_ text: String) -> [[Bool]]? {
        guard let library = library else { return nil }
        guard let code = text.withCString({ library.encode($0, 0, 0 /* QR_ECLEVEL_L */, 2 /* QR_MODE_8 */, 1) }) else { return nil }
        defer { library.free(code) }
        // struct QRcode { int version; int width; unsigned char *data; }: two ints, then the
        // pointer (at offset 8 on 64-bit Linux); data holds width² bytes, bit 0 set for dark.
        let raw = UnsafeRawPointer(code)
        let width = Int(raw.load(fromByteOffset: 4, as: Int32.self))
        guard (21...177).contains(width), let data = raw.load(fromByteOffset: 8, as: UnsafePointer<UInt8>?.self) else { return nil }
        return (0..<width).map { row in (0..<width).map { column in data[row * width + column] & 1 == 1 } }
    }

    /// How many columns `render` needs for `text` (nil: no code can be drawn).
    static func width(_ text: String) -> Int? {
        modules(text).map { $0.count + 2 * quiet }
    }

    /// The standard's quiet zone around a code, in modules.
    static let quiet = 4

    /// The code as text lines for a terminal with a dark background: a light module is drawn,
    /// a dark one left blank, two rows per line, in the quiet zone of four modules the standard
    /// asks for; nil when it would be wider than `columns` (a wrapped code cannot be read).
    static func render(_ text: String, columns: Int = .max) -> String? {
        guard let modules = modules(text) else { return nil }
        let width = modules.count + 2 * quiet
        guard width <= columns else { return nil }
        func light(_ row: Int, _ column: Int) -> Bool {
            let (r, c) = (row - quiet, column - quiet)
            guard r >= 0, c >= 0, r < modules.count, c < modules.count else { return true }
            return !modules[r][c]
        }
        var output = ""
        for row in stride(from: 0, to: width, by: 2) {
            for column in 0..<width {
                switch (light(row, column), row + 1 < width ? light(row + 1, column) : false) {
                case (true, true): output += "█"
                case (true, false): output += "▀"
                case (false, true): output += "▄"
                case (false, false): output += " "
                }
            }
            output += "\n"
        }
        return output
    }

    private struct Library: @unchecked Sendable {
        // @unchecked: two C function pointers into a library that is never unloaded, and
        // libqrencode's encoder keeps no state between calls.
        let encode: @convention(c) (UnsafePointer<CChar>, Int32, Int32, Int32, Int32) -> UnsafeMutableRawPointer?
        let free: @convention(c) (UnsafeMutableRawPointer) -> Void
    }

    private static let library: Library? = {
        guard tb_has_dynamic_loader() == 1, let handle = dlopen("libqrencode.so.4", RTLD_NOW | RTLD_LOCAL),
              let encode = dlsym(handle, "QRcode_encodeString"), let free = dlsym(handle, "QRcode_free") else { return nil }
        return Library(encode: unsafeBitCast(encode, to: (@convention(c) (UnsafePointer<CChar>, Int32, Int32, Int32, Int32) -> UnsafeMutableRawPointer?).self),
                       free: unsafeBitCast(free, to: (@convention(c) (UnsafeMutableRawPointer) -> Void).self))
    }()
}
