// Varlink messages are JSON values; users of this module get the JSON type with it.
@_exported import WireJSON
