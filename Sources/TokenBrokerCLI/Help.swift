/// Help texts. `-h`, `--help` and `help <subcommand>` print the same text.
public enum Help {
    public static let main = """
        OVERVIEW: tokenbroker — one OAuth 2.0 refresh flight per session, shared by every local worker

        A long-running daemon owns the OAuth sessions of this machine and hands out current
        access tokens over a varlink Unix socket. All workers share one refresh flight and one
        logout boundary per session, so parallel 401s never rotate a refresh token twice and a
        logout is never undone by a late refresh.

        USAGE: tokenbroker <subcommand> [options]

        OPTIONS:
          -h, --help              Show this help.
          -V, --version           Show the version.

        SUBCOMMANDS:
          serve                   Run the daemon.
          ctl <verb>              Talk to the running daemon (status, token, login, logout).
          check-config            Validate the configuration and exit.
          credential <protocol>   Be git's, kubectl's, docker's, Terraform's or Bazel's credential helper.
          version                 Show this command's version and the running broker's.
          help [<subcommand>]     Show help for a subcommand, e.g. `tokenbroker help ctl token`.

        Exit codes: 0 ok, 1 failure, 64 usage, 69 broker unreachable or stopping, 77 permission denied,
        78 configuration error.

        """

    public static let version = """
        OVERVIEW: Show this command's version and the running broker's.

        The broker's is what its socket's varlink service info says (org.varlink.service.GetInfo):
        after an upgrade it is the old one until the daemon restarts. A broker that cannot be
        reached is said so; the exit status is 0 either way.

        USAGE: tokenbroker version [--socket <path>]

        OPTIONS:
          --socket <path>         The broker's socket (default $TOKENBROKER_SOCKET, else this
                                  user's own broker if one listens, else the system's).
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker version

        """

    public static let credential: String = """
        OVERVIEW: Hand the broker's tokens to tools, in their credential-helper protocols.

        Each call asks the broker for the token of the session that serves the URL (Serves= in
        the daemon's configuration; among the sessions this user may use). It never refreshes by
        itself: every process shares the session's one refresh. A URL no session serves gets the
        protocol's "not found", so the tool asks its next helper. A registry's bare host means
        https, unless the tool may reach it in clear (loopback, --tls-verify=false, insecure in
        registries.conf or daemon.json): then http, which only an http:// entry serves.

        USAGE: \(CredentialProtocol.all.map(\.usage).joined(separator: "\n       "))

        OPTIONS:
          --username <name>       The user name git or a registry is given (default oauth2;
                                  some servers want x-access-token).
          --url <url>             kubectl: the URL to find the session by (else the cluster's
                                  server, with provideClusterInfo: true).
          --session <name>        kubectl: the session itself.
          --resource <url>, --scope <words>
                                  The session's token narrowed to this key (one it allows:
                                  AllowResources=, AllowScopes=), e.g. a read-only token for git.
          --socket <path>         The broker's socket (default $TOKENBROKER_SOCKET, else this
                                  user's own broker if one listens, else the system's:
                                  /run/tokenbroker/io.tokenbroker.Broker).
          -h, --help              Show this help.

        CONFIGURATION:
          git        git config --global credential.https://git.example.com.helper ''
                     git config --global --add credential.https://git.example.com.helper \
                       '/usr/bin/tokenbroker credential git'
                     (the empty value first: no storing helper keeps the token; with a
                     path in Serves=, also credential.useHttpPath true)
          kubectl    users: [{name: n, user: {exec: {apiVersion: client.authentication.k8s.io/v1beta1,
                       command: tokenbroker, args: [credential, kubectl, --url, https://k8s.example.com:6443]}}}]
          docker     "credHelpers": {"registry.example.com": "tokenbroker"} (runs docker-credential-tokenbroker)
          terraform  credentials_helper "tokenbroker" {} (runs terraform-credentials-tokenbroker)
          bazel      --credential_helper=*.example.com=/usr/bin/bazel-credential-tokenbroker

        The package installs git-credential-tokenbroker, docker-credential-tokenbroker,
        terraform-credentials-tokenbroker and bazel-credential-tokenbroker as links to tokenbroker.

        """

    public static let serve = """
        OVERVIEW: Run the tokenbroker daemon.

        Reads the configuration, listens on the varlink socket and serves io.tokenbroker.Broker
        until SIGTERM or SIGINT. SIGHUP re-reads the configuration. Logs go to stderr with <N>
        priority prefixes (journald reads them).

        USAGE: tokenbroker serve [--user] [--config <path>] [--socket <path>] [--state-dir <path>] [--log-level <level>] [--dev]

        OPTIONS:
          --user                  This user's own broker, of which the user is the admin: the
                                  configuration in $XDG_CONFIG_HOME/tokenbroker/tokenbroker.conf,
                                  the state in $XDG_STATE_HOME/tokenbroker, the socket in
                                  $XDG_RUNTIME_DIR/tokenbroker/ (where not given; what the user
                                  units run: systemctl --user enable --now tokenbroker.socket).
          --config <path>         Configuration file (default /etc/tokenbroker/tokenbroker.conf;
                                  drop-ins in <path>.d/*.conf).
          --socket <path>         Socket to listen on (overrides Socket=; default
                                  /run/tokenbroker/io.tokenbroker.Broker).
          --state-dir <path>      Where the state database lives (default $STATE_DIRECTORY, else
                                  /var/lib/tokenbroker).
          --log-level <level>     emerg, alert, crit, err, warning, notice, info (default), debug.
          --dev                   Development mode: start a development OAuth server in this
                                  process and serve two logged-in sessions against it, `demo`
                                  and `demo-dpop` (DPoP-bound tokens); no configuration file is
                                  read, and state stays in memory unless --state-dir is given.
          -h, --help              Show this help.

        EXAMPLES:
          tokenbroker serve --dev --socket ./tokenbroker.sock
                                  (in a directory of yours: the socket's directory must be
                                  writable by no other user, so not /tmp itself)
          tokenbroker serve --user

        """

    public static let checkConfig = """
        OVERVIEW: Validate the configuration.

        Prints how many sessions it defines (the first few by name) and any warnings; an error
        reads `file:line: message` and exits 78.

        USAGE: tokenbroker check-config [--config <path>] [--verbose]
               tokenbroker check-config --keys

        OPTIONS:
          --config <path>         Configuration file (default /etc/tokenbroker/tokenbroker.conf).
          -v, --verbose           Name every session, one per line.
          --keys                  List every key by section: what it takes, its default, and
                                  what a change does at a reload.
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker check-config --config ./tokenbroker.conf

        """

    public static let ctl: String = """
        OVERVIEW: Talk to the running tokenbroker daemon.

        USAGE: tokenbroker ctl [--socket <path>] [--json] <verb> [<session>] [<verb options>]

        OPTIONS:
          --socket <path>         The broker's socket (default $TOKENBROKER_SOCKET, else this
                                  user's own broker if one listens, else the system's:
                                  /run/tokenbroker/io.tokenbroker.Broker).
          --json                  Machine-readable output.
          -h, --help              Show this help (or a verb's, after the verb).

        SUBCOMMANDS:

        """ + CtlVerb.listing + """

        EXAMPLE:
          curl -H "Authorization: Bearer $(tokenbroker ctl token api)" https://api.example.com/

        """

    public static let ctlStatus = """
        OVERVIEW: Show the sessions this user may use.

        One row per session: state, generation, when the token expires, the last refresh, and
        counts of refreshes, joined waiters, failures and stale rejections. Never shows a token.

        USAGE: tokenbroker ctl [--socket <path>] status [--json]

        OPTIONS:
          --json                  The Status reply as JSON.
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl status

        """

    public static let ctlToken = """
        OVERVIEW: Print the session's current access token.

        Prints the token alone on stdout (refreshed first if it has expired), for use in $(…).
        With --min-valid, a token that stays valid that long: one that ends sooner is refreshed
        first, in the session's one refresh; if the issuer's tokens live less, it fails saying
        how long they live. With --resource and/or --scope, the session's token narrowed to that
        key (one the session allows: AllowResources=, AllowScopes=), with its own token and refresh.

        USAGE: tokenbroker ctl [--socket <path>] token <session> [--min-valid <duration>]
                                   [--resource <url>] [--scope <words>] [--json]

        OPTIONS:
          --min-valid <duration>  How long the token must stay valid: 90s, 10m, 1h30m (at most a year).
          --resource <url>        An RFC 8707 resource the token is narrowed to (AllowResources=).
          --scope <words>         Scope words the token is narrowed to, one argument (AllowScopes=).
          --json                  The whole GetToken reply as JSON (token, type, expiry, generation).
          -h, --help              Show this help.

        EXAMPLES:
          export TOKEN=$(tokenbroker ctl token api)
          TOKEN=$(tokenbroker ctl token api --min-valid 10m) && ./job-of-ten-minutes
          TOKEN=$(tokenbroker ctl token api --resource https://storage.example.com/ --scope read)

        """

    public static let ctlLogout = """
        OVERVIEW: Log a session out (admin).

        Bumps the session's generation, clears its tokens, cancels any refresh in flight and
        answers its waiters with SignedOut. Returns once the logout is durable.

        USAGE: tokenbroker ctl [--socket <path>] logout <session>

        OPTIONS:
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl logout api

        """

    public static let ctlLogin = """
        OVERVIEW: Log a session in (admin).

        Runs an interactive login, then waits until the daemon has the new tokens: the device
        flow (RFC 8628) where the server offers it, else the authorization code flow with PKCE
        (RFC 7636), unless the session's LoginFlow= or --flow says which. With
        --refresh-token-stdin, installs the refresh token read from standard input instead.
        Either way the session starts a new generation.

        Device flow: prints where to approve the login and the code to enter.

        Code flow: prints the address to open in a browser (and a QR code on a terminal). The
        daemon listens on 127.0.0.1 for the browser's redirect (LoginRedirectPorts=, else any
        free port) until LoginTimeout= (5 min). A browser on another machine either reaches
        that port through `ssh -L PORT:127.0.0.1:PORT host`, or, with no forwarding at all,
        ends on an address that does not load: paste that address here, on standard input.

        USAGE: tokenbroker ctl [--socket <path>] login <session> [--flow=code|device | --refresh-token-stdin]

        OPTIONS:
          --flow <flow>           code or device: the interactive login to run.
          --refresh-token-stdin   Read a refresh token from standard input (not from argv, where
                                  other users could see it).
          -h, --help              Show this help.

        EXAMPLES:
          tokenbroker ctl login api
          tokenbroker ctl login api --flow=code
          tokenbroker ctl login api --refresh-token-stdin < /run/secrets/api-refresh-token

        """

    public static let ctlRecover = """
        OVERVIEW: Get the token to retry with after a request was rejected.

        Reads the access token the rejected request carried from standard input. If it is no
        longer the session's current token, prints the current one at once; otherwise joins the
        session's single refresh and prints the new token.

        USAGE: tokenbroker ctl [--socket <path>] recover <session> [--resource <url>] [--scope <words>] [--json]

        OPTIONS:
          --resource <url>, --scope <words>
                                  The key the token was asked for with (as for ctl token).
          --json                  The whole Recover reply as JSON.
          -h, --help              Show this help.

        EXAMPLE:
          TOKEN=$(printf %s "$TOKEN" | tokenbroker ctl recover api)

        """

    public static let ctlProof = """
        OVERVIEW: Print the headers of one request with a DPoP-bound token (RFC 9449).

        Prints `Authorization: DPoP <token>` and `DPoP: <proof>`, one per line: the session's
        current token (refreshed first if it has expired) and a proof for this request alone,
        signed in the daemon with the session's key (DPoP=yes), which never leaves it. A proof
        names the method and the URL (without query and fragment) and is good once, for about a
        minute. A bearer session prints `Authorization: Bearer <token>` alone.

        USAGE: tokenbroker ctl [--socket <path>] proof <session> <method> <url> [--nonce <nonce>] [--min-valid <duration>]
                                   [--resource <url>] [--scope <words>] [--json]

        OPTIONS:
          --nonce <nonce>         The nonce the resource server asked for (its DPoP-Nonce header,
                                  with a 401 use_dpop_nonce).
          --min-valid <duration>  How long the token must stay valid, as for ctl token.
          --resource <url>, --scope <words>
                                  A key of the session, as for ctl token.
          --json                  The whole GetProof reply as JSON.
          -h, --help              Show this help.

        EXAMPLE:
          curl -H @<(tokenbroker ctl proof api GET https://api.example.com/items) https://api.example.com/items

        """

    public static let ctlForget = """
        OVERVIEW: Remove a stored session the configuration no longer names (admin).

        A session removed from the configuration keeps its stored state (ctl status shows it
        as inert) until it is forgotten; its tokens are then erased from the state database.
        A configured session cannot be forgotten: remove it from the configuration and reload
        first.

        USAGE: tokenbroker ctl [--socket <path>] forget <session>

        OPTIONS:
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl forget old-api

        """

    public static let ctlWatch = """
        OVERVIEW: Follow a session's events.

        Prints one line per event: the current token at once, every new token, and the logout,
        after which it exits. Lines name tokens by serial; the token itself is printed only with
        --show-token.

        USAGE: tokenbroker ctl [--socket <path>] watch <session> [--json] [--show-token]

        OPTIONS:
          --json                  One JSON object per event.
          --show-token            Include the access token.
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl watch api

        """

    public static let ctlRefresh = """
        OVERVIEW: Refresh a session's token now (admin).

        Starts a refresh whatever the token's expiry, or joins the one under way. Backoff and
        the refresh limit still apply. Prints the new token's serial, never the token.

        USAGE: tokenbroker ctl [--socket <path>] refresh <session> [--json]

        OPTIONS:
          --json                  The Refresh reply as JSON.
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl refresh api

        """

    public static let ctlResetFleetHistory = """
        OVERVIEW: Start a fleet session's history anew (admin).

        The way out of a fleet generation at its limit (the journal says when to use it): writes
        a signed-out state in a new history to etcd, whose generations start low again, and
        logs the session out on every broker, each of which says so in its journal and moves
        its mark of the session there. Values of the earlier history are refused from then on,
        as rollbacks. The refresh token in force is revoked, as at a logout. Log in afterwards.
        Needs etcd; for fleet sessions (Fleet=yes) only.

        USAGE: tokenbroker ctl [--socket <path>] reset-fleet-history <session> [--json]

        OPTIONS:
          --json                  The ResetFleetHistory reply as JSON.
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl reset-fleet-history billing && tokenbroker ctl login billing

        """

    public static let ctlReload = """
        OVERVIEW: Make the daemon re-read its configuration (admin).

        The same as SIGHUP: a bad configuration is reported (file:line, exit 78) and the old one
        stays in force; sessions whose settings did not change keep their tokens.

        USAGE: tokenbroker ctl [--socket <path>] reload

        OPTIONS:
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl reload

        """

    public static let ctlDelegate = """
        OVERVIEW: Serve sessions on a socket of their own, or a token file, for a container or a host (admin).

        Binds a socket that serves only these sessions' tokens: GetToken, Recover, GetProof,
        Watch, Credential and Status answer there, for these sessions alone; every admin call,
        every other session and every key (resource, scope) is refused, whoever the peer is —
        root in a container without a user namespace, or the far side of `ssh -R`, included.
        Bind-mount the socket's directory into a container, or forward the socket with ssh.

        With --file, keeps one session's current token in a file instead (or as well), for
        programs that read a token from a file ($BEARER_TOKEN_FILE): replaced whole at each new
        token (a reader never sees a part), renewed before the token expires, zeroed and removed
        at a logout and when the delegation ends. Bind its directory into a container, not the
        file: a bound file keeps its old content once a new one is renamed over it.

        It lasts until `ctl undelegate`, --ttl, or the daemon's stop (at a restart, only the
        ones in [Delegation] and [Output] sections come back). A logout of a session reaches its
        workers there as everywhere: SignedOut, and its file is erased.

        The socket's and the file's directory must be one only root or the daemon's user can
        change (as for the broker's own socket); --socket here names the delegation's socket
        (the broker's is given before the verb, or by $TOKENBROKER_SOCKET).

        USAGE: tokenbroker ctl [--socket <path>] delegate <session>... [--socket <path>] [--file <path>]
                                   [--format token|header|json] [--readers <users>] [--file-mode <octal>] [--ttl <duration>]
                                   [--name <name>] [--mode <octal>] [--owner <user>] [--group <group>]
                                   [--allow-users <users>] [--allow-groups <groups>] [--max-connections <n>]

        OPTIONS:
          --socket <path>         Where the delegation's socket is bound (after the verb).
          --file <path>           Where the session's token file is kept (one session).
          --format <format>       The file holds the bare token (token, the default), an
                                  "Authorization: Bearer ..." line (header), or JSON with
                                  the token, its type, expiry and serial (json).
          --readers <users>       Users (comma-separated) who may read the file besides its
                                  owner: a POSIX ACL entry each, no privilege needed.
          --ttl <duration>        It ends by itself after this long: 30m, 1h, 2d (at most a year).
          --name <name>           Its name (default: one the daemon picks, printed).
          --file-mode <octal>     The token file's mode (default 0600; read bits and its
                                  owner's write bit only).
          --mode <octal>          The socket file's mode (default 0660).
          --owner <user>, --group <group>
                                  Their owner and group (default the daemon's; another owner
                                  of a token file needs a daemon run as root).
          --allow-users <users>, --allow-groups <groups>
                                  Only these peers (by uid/gid as the kernel reports them,
                                  comma-separated) may use the socket; default whoever opens it.
          --max-connections <n>   Connections open on the socket at once (default 64).
          --json                  The Delegate reply as JSON.
          -h, --help              Show this help.

        EXAMPLES:
          tokenbroker ctl delegate ci-read --socket /run/tokenbroker/delegations/ci/io.tokenbroker.Broker --ttl 1h --name ci
          systemd-nspawn --bind-ro=/run/tokenbroker/delegations/ci:/run/tokenbroker ...
          tokenbroker ctl delegate dev --socket /run/tokenbroker/delegations/dev.sock --allow-users alice --mode 0666
          ssh -o StreamLocalBindUnlink=yes -R /run/user/1000/tokenbroker/io.tokenbroker.Broker:/run/tokenbroker/delegations/dev.sock dev-host
          tokenbroker ctl delegate batch --file /run/tokenbroker/files/batch/token --readers condor --name batch

        """

    public static let ctlDelegations = """
        OVERVIEW: List the delegations, their sockets and token files (admin).

        Each delegation's (and [Output]'s) name, sessions, socket, token file, when it ends, and
        whether it comes from a [Delegation] or [Output] section (config) or from
        `ctl delegate` (ctl); then, for a file that cannot be kept now, why (a symlink at its
        path, a directory others can write…).

        USAGE: tokenbroker ctl [--socket <path>] delegations [--json]

        OPTIONS:
          --json                  The Delegations reply as JSON.
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl delegations

        """

    public static let ctlUndelegate = """
        OVERVIEW: End a delegation (admin).

        Removes its socket and closes every connection on it, and zeroes and removes its token
        file, before it returns: a worker there gets no other token. A configured one (a
        [Delegation] or [Output] section) comes back at the next reload unless its section is
        gone.

        USAGE: tokenbroker ctl [--socket <path>] undelegate <name>

        OPTIONS:
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl undelegate ci

        """

    public static let ctlAudit = """
        OVERVIEW: Show who was handed which token lately (admin).

        The audit trail: one record per token and peer (a worker's thousand GetToken calls
        with one token are one record, with its count), newest first — the session (and key),
        the token's serial and generation (never the token), the peer's pid, uid and gid as the
        kernel reported them, its systemd unit, the delegation it came through, the methods and
        how often. The daemon keeps the newest 512; each new record is also a journal entry
        (MESSAGE_ID=5f8c2a4e9b1d4c7a8e3f6b0d2c9a7e14, at most 10 per peer a minute, then one
        line saying how many were left out):

          journalctl -u tokenbroker MESSAGE_ID=5f8c2a4e9b1d4c7a8e3f6b0d2c9a7e14

        USAGE: tokenbroker ctl [--socket <path>] audit [--session <name>] [--limit <n>] [--json]

        OPTIONS:
          --session <name>        Only this session's records.
          --limit <n>             At most this many (default 50, at most 512).
          --json                  The Audit reply as JSON.
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl audit --session api --limit 20

        """

    public static let ctlMetrics = """
        OVERVIEW: Print the daemon's metrics (admin).

        The same exposition MetricsListen= serves to Prometheus (text format 0.0.4): calls,
        refreshes and their durations, waiters, stale rejections, token expiry, session states,
        connections, state writes, reloads. No token, secret or client id appears in it.

        USAGE: tokenbroker ctl [--socket <path>] metrics

        OPTIONS:
          -h, --help              Show this help.

        EXAMPLE:
          tokenbroker ctl metrics | grep tokenbroker_refreshes_total

        """

    public static let ctlClientKey = """
        OVERVIEW: Print the JWKS of a private_key_jwt session's client keys to register; rotate them (admin).

        A session with ClientAuthentication=private_key_jwt and no ClientKeyFile= or
        ClientAssertionFile= signs its client assertions (RFC 7523) with a key the daemon makes
        the first time it is needed (P-256; RSA where the server's metadata lists only RSA
        algorithms, or as ClientAssertionAlgorithm= says) and keeps sealed in its state. Only
        the public keys ever leave it: this prints them as a JWKS ({"keys": [...]}, each with
        its kid, the RFC 7638 thumbprint), to register with the server as the client's keys.

        A rotation is three steps, so that the server knows a key before it signs:
          --rotate    make a next key: published (in the JWKS) beside the signing one, not
                      used yet; register the new JWKS with the server
          --promote   the next key signs from now on; the old one retires, still published
          --retire    drop the retiring keys from the JWKS (register it once more)

        A session with ClientKeyFile= shows that key (replace the file and reload to rotate
        it); one with ClientAssertionFile= holds no key.

        USAGE: tokenbroker ctl [--socket <path>] client-key <session> [--rotate | --promote | --retire] [--jwk] [--json]

        OPTIONS:
          --rotate                Make a next key, published before it signs.
          --promote               The next key signs; the signing one retires.
          --retire                Drop the retiring keys.
          --jwk                   Print the signing key's JWK alone, not the JWKS.
          --json                  The ClientKey reply as JSON (each key's role: signing, next,
                                  retiring, or operator for ClientKeyFile='s).
          -h, --help              Show this help.

        EXAMPLES:
          tokenbroker ctl client-key api > api.jwks.json
          tokenbroker ctl client-key api --rotate > api.jwks.json   # register it, then:
          tokenbroker ctl client-key api --promote

        """

    public static func ctlVerb(_ verb: String) -> String? { CtlVerb.named(verb)?.help }

    /// `help <words>`: the text for a subcommand or ctl verb.
    public static func topic(_ words: [String]) -> String? {
        switch words.first {
        case "serve": return words.count == 1 ? serve : nil
        case "check-config": return words.count == 1 ? checkConfig : nil
        case "credential": return words.count == 1 ? credential : nil
        case "version": return words.count == 1 ? version : nil
        case "help": return words.count == 1 ? main : nil
        case "ctl":
            if words.count == 1 { return ctl }
            return words.count == 2 ? ctlVerb(words[1]) : nil
        default: return nil
        }
    }
}
