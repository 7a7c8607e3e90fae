// SQLite for Swift. SQLITE_TRANSIENT is a macro cast of -1 to a function pointer, which Swift
// does not import; bind text through this wrapper instead.
#ifndef TOKENBROKER_CSQLITE_SHIM_H
#define TOKENBROKER_CSQLITE_SHIM_H

#include <sqlite3.h>

static inline int tb_sqlite3_bind_text_transient(sqlite3_stmt *statement, int index, const char *text) {
    return sqlite3_bind_text(statement, index, text, -1, SQLITE_TRANSIENT);
}

/// Each connection's page cache takes its pages one at a time, as it needs them: without this,
/// every connection allocates (and touches) SQLITE_DEFAULT_PCACHE_INITSZ pages up front, 87 KB
/// of private memory per connection with Debian's build. It must come before SQLite's first
/// use, and says SQLITE_MISUSE after. (sqlite3_config is variadic: Swift cannot call it.)
static inline int tb_sqlite3_config_pages_on_demand(void) {
    return sqlite3_config(SQLITE_CONFIG_PAGECACHE, (void *)0, 0, 0);
}

#endif
