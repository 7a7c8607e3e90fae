import Basics
import Testing
@testable import TokenBrokerCLI

/// The docker-credential protocol's bare host: asked for as https only where the tool cannot
/// reach the registry in clear (issue 32: real skopeo sent an https entry's token to an http
/// registry). Files, variables and the tool's command line are given here, not read.
@Suite("Registry transport")
struct RegistryTransportTests {
    static func transport(files: [String: String] = [:], variables: [String: String] = ["HOME": "/home/u"],
                          parent: [String] = ["skopeo", "inspect", "docker://registry.example.test/a"], above: [[String]] = [],
                          readable: Bool = true, engine: [String]? = nil) -> RegistryTransport {
        RegistryTransport(file: { path, limit in files[path].map { Array($0.utf8) }.flatMap { $0.count <= limit ? $0 : nil } },
                          directory: { path in
                              let names = files.keys.filter { $0.hasPrefix(path + "/") }.map { String($0.dropFirst(path.count + 1)) }
                              return names.isEmpty ? nil : names
                          },
                          variable: { variables[$0] }, toolArguments: { readable ? [parent] + above : nil }, engineArguments: { engine })
    }

    @Test("a secure registry's bare host is asked for as https; a written scheme is kept; what is no registry address is not asked")
    func secure() {
        let plain = Self.transport()
        #expect(plain.requestURL(for: "registry.example.test") == "https://registry.example.test")
        #expect(plain.requestURL(for: "registry.example.test:5000/ns") == "https://registry.example.test:5000/ns")
        #expect(plain.requestURL(for: "https://index.docker.io/v1/") == "https://index.docker.io/v1/")
        #expect(plain.requestURL(for: "http://registry.example.test") == "http://registry.example.test")
        for bad in ["", "ftp://registry.example.test", #"registry.example.test\@x"#, "a b", "127.1:5000"] {
            #expect(plain.requestURL(for: bad) == nil, "\(bad)")
        }
    }

    @Test("loopback, localhost, TLS verification off in the tool's arguments: plain HTTP")
    func insecureByTheWayIn() {
        let plain = Self.transport()
        for host in ["127.0.0.1:5000", "127.9.9.9", "[::1]:5000", "localhost:5000", "https://127.0.0.1:5000"] {
            #expect(plain.requestURL(for: host)?.hasPrefix("http://") == true, "\(host)")
        }
        for flag in ["--tls-verify=false", "--src-tls-verify=0", "--dest-tls-verify=False", "--tls-verify=f"] {
            #expect(Self.transport(parent: ["skopeo", "copy", flag, "a", "b"]).requestURL(for: "registry.example.test") == "http://registry.example.test",
                    "\(flag)")
        }
        for harmless in ["--tls-verify=true", "--tls-verify", "--insecure-policy", "tls-verify=false", "--tls-verifyx=false", "--insecure=0"] {
            #expect(Self.transport(parent: ["skopeo", harmless]).requestURL(for: "registry.example.test") == "https://registry.example.test",
                    "\(harmless)")
        }
    }

    @Test("what an adversarial review found (issue 32): a scheme in daemon.json, a network against a name, a registries.conf wildcard, --insecure and --plain-http, a shell above the tool, an unreadable tool, the docker CLI's engine, loopback spellings, too many drop-ins: plain HTTP")
    func reviewed() {
        let daemon = { (entries: String) in Self.transport(files: ["/etc/docker/daemon.json": #"{"insecure-registries": \#(entries)}"#]) }
        #expect(daemon(#"["http://registry.example.test:5000"]"#).requestURL(for: "registry.example.test:5000")?.hasPrefix("http://") == true)
        #expect(daemon(#"["https://registry.example.test:5000/"]"#).requestURL(for: "registry.example.test:5000")?.hasPrefix("http://") == true)
        #expect(daemon(#"["10.0.0.0/8"]"#).requestURL(for: "registry.example.test")?.hasPrefix("http://") == true, "a name may resolve into the network")
        #expect(daemon(#"["10.0.0.0/8"]"#).requestURL(for: "11.0.0.1")?.hasPrefix("https://") == true)
        let wildcard = "[[registry]]\nprefix = \"*.corp.example\"\ninsecure = true\n"
        #expect(Self.transport(files: ["/etc/containers/registries.conf": wildcard]).requestURL(for: "reg.corp.example") == "http://reg.corp.example")
        #expect(Self.transport(files: ["/etc/containers/registries.conf": wildcard]).requestURL(for: "reg.other.example") == "https://reg.other.example")
        for flags in [["crane", "--insecure", "pull"], ["cosign", "--insecure=true"], ["oras", "pull", "--plain-http"], ["helm", "--plain-http=1"]] {
            #expect(Self.transport(parent: flags).requestURL(for: "registry.example.test") == "http://registry.example.test", "\(flags)")
        }
        #expect(Self.transport(parent: ["crane", "--insecure=false"]).requestURL(for: "registry.example.test") == "https://registry.example.test")
        #expect(Self.transport(parent: ["sh", "-c", "skopeo …"], above: [["skopeo", "--tls-verify=false", "inspect"]])
                    .requestURL(for: "registry.example.test") == "http://registry.example.test", "a shell that did not exec")
        #expect(Self.transport(readable: false).requestURL(for: "registry.example.test") == "http://registry.example.test", "an unreadable tool is doubt")
        // The docker CLI: its engine's flags count, and an engine unseen or elsewhere is doubt.
        let docker = ["/usr/bin/docker", "pull", "registry.example.test/a"]
        #expect(Self.transport(parent: docker).requestURL(for: "registry.example.test") == "http://registry.example.test")
        let engine = ["/usr/bin/dockerd", "--insecure-registry", "registry.example.test:5000", "--config-file=/srv/d.json"]
        #expect(Self.transport(parent: docker, engine: engine).requestURL(for: "registry.example.test:5000") == "http://registry.example.test:5000")
        #expect(Self.transport(files: ["/srv/d.json": "{}"], parent: docker, engine: engine).requestURL(for: "other.test") == "https://other.test")
        #expect(Self.transport(files: ["/srv/d.json": #"{"insecure-registries": ["other.test"]}"#], parent: docker, engine: engine)
                    .requestURL(for: "other.test") == "http://other.test", "the engine's --config-file")
        #expect(Self.transport(parent: docker, engine: engine).requestURL(for: "other.test") == "http://other.test", "an unreadable --config-file is doubt")
        #expect(Self.transport(variables: ["DOCKER_HOST": "tcp://far.example:2376"], parent: docker, engine: ["dockerd"])
                    .requestURL(for: "other.test") == "http://other.test")
        for host in ["[::ffff:127.0.0.1]:5000", "localhost.:5000", "reg.localhost", "reg.localhost."] {
            #expect(Self.transport().requestURL(for: host)?.hasPrefix("http://") == true, "\(host)")
        }
        let many = Dictionary(uniqueKeysWithValues: (0...RegistryTransport.maximumDropIns).map { ("/etc/containers/registries.conf.d/\($0).conf", "") })
        #expect(Self.transport(files: many).requestURL(for: "registry.example.test") == "http://registry.example.test")
    }

    @Test("registries.conf naming the registry with an insecure setting, and daemon.json's insecure-registries: plain HTTP")
    func insecureByConfiguration() {
        let v2 = "# insecure = true in a comment does not count\n[[registry]]\nlocation = \"registry.example.test:5000\"\ninsecure = true\n"
        let v1 = "[registries.insecure]\nregistries = ['registry.example.test']\n"
        let comment = "# [[registry]]\n# location = \"registry.example.test\"\n# insecure = true\n"
        for (path, text, insecure) in [("/etc/containers/registries.conf", v2, true), ("/etc/containers/registries.conf.d/50-x.conf", v1, true),
                                       ("/home/u/.config/containers/registries.conf", v1, true), ("/etc/containers/registries.conf", comment, false),
                                       ("/etc/containers/registries.conf.d/50-x.txt", v1, false),
                                       ("/etc/containers/registries.conf", "[[registry]]\nlocation = \"other.test\"\ninsecure = true\n", false)] {
            let url = Self.transport(files: [path: text]).requestURL(for: "registry.example.test:5000")
            #expect(url == (insecure ? "http://" : "https://") + "registry.example.test:5000", "\(path): \(text)")
        }
        let chosen = Self.transport(files: ["/srv/r.conf": v1], variables: ["CONTAINERS_REGISTRIES_CONF": "/srv/r.conf"])
        #expect(chosen.requestURL(for: "registry.example.test") == "http://registry.example.test")
        let xdg = Self.transport(files: ["/x/containers/registries.conf": v1], variables: ["XDG_CONFIG_HOME": "/x"])
        #expect(xdg.requestURL(for: "registry.example.test") == "http://registry.example.test")

        for (entries, host, insecure) in [(#"["registry.example.test:5000"]"#, "registry.example.test:5000", true),
                                          (#"["registry.example.test:5000"]"#, "registry.example.test", false),
                                          (#"["registry.example.test"]"#, "registry.example.test", true),
                                          (#"["10.0.0.0/8"]"#, "10.1.2.3:5000", true), (#"["10.0.0.0/8"]"#, "11.1.2.3", false),
                                          (#"["fd00::/8"]"#, "[fd12::1]:5000", true), (#"["bad/99"]"#, "10.1.2.3", false)] {
            let url = Self.transport(files: ["/etc/docker/daemon.json": #"{"insecure-registries": \#(entries)}"#]).requestURL(for: host)
            #expect(url?.hasPrefix(insecure ? "http://" : "https://") == true, "\(entries) \(host)")
        }
        // A daemon.json that is not JSON but says insecure-registries: taken to mean this one.
        #expect(Self.transport(files: ["/etc/docker/daemon.json": #"{"insecure-registries": [,"#]).requestURL(for: "r.test") == "http://r.test")
        // Larger than the limit: unread (the other sources still count).
        let huge = String(repeating: "#", count: RegistryTransport.fileLimit + 1)
        #expect(Self.transport(files: ["/etc/containers/registries.conf": huge]).requestURL(for: "r.test") == "https://r.test")
    }
}
