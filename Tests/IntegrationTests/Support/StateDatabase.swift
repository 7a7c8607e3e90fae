import Foundation
import Sealing
import SQLiteStore

/// A daemon's state database as a test reads it: sealed under the key the daemon made in its
/// state directory (`state.key`), as every database is without a configured key.
enum StateDatabase {
    static func open(_ directory: String) throws -> SQLiteSessionStore {
        let key = try Data(contentsOf: URL(fileURLWithPath: directory + "/state.key"))
        return try SQLiteSessionStore(directory: directory, cipher: TokenCipher(keyMaterial: Array(key)))
    }
}
