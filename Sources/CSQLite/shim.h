// SQLite for Swift. SQLITE_TRANSIENT is a macro cast of -1 to a function pointer, which Swift
// does not import; bind text through this wrapper instead.
#ifndef TOKENBROKER_CSQLITE_SHIM_H
#define TOKENBROKER_CSQLITE_SHIM_H

#include <sqlite3.h>

static inline int tb_sqlite3_bind_text_transient(sqlite3_stmt *statement, int index, const char *text) {
    return sqlite3_bind_text(statement, index, text, -1, SQLITE_TRANSIENT);
}

#endif
