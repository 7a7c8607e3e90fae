/// What the product says of itself: its version (`--version`, the varlink service info, the
/// metrics' build info), shared by the command line and the daemon.
public enum Product {
    public static let version = "0.1.0"
    public static let url = "https://github.com/tokenbroker/tokenbroker"
}
