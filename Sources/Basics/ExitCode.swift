/// Exit codes (sysexits), shared by the command line and the daemon.
public enum ExitCode {
    public static let ok: Int32 = 0
    public static let failure: Int32 = 1
    public static let usage: Int32 = 64
    public static let unavailable: Int32 = 69
    public static let permission: Int32 = 77
    public static let config: Int32 = 78
}
