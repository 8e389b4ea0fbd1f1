//! What the agent tests share: the programmed state in comparable form, what the offline
//! engine computes for the same objects, starting an agent, and a plain HTTP GET.
#![allow(dead_code)] // each test binary uses its own part

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;
use ordnet::agent::{self, AgentConfig, AgentHandle, Enforcer as _, NoneDatapath, WatchConfig};
use ordnet_engine::{BuildOptions, Engine, ServiceRec, Signature};
use ordnet_mapstate::{L4Prefix, OrderKey, Origin, Peer, Verdict};
use ordnet_testsuite::fakeapi::FakeApi;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub type Keys = Vec<(
    Option<Signature>,
    L4Prefix,
    Verdict,
    OrderKey,
    Vec<Origin>,
    bool,
)>;
/// Per endpoint: (ingress isolated, ingress keys, egress isolated, egress keys).
pub type Canon = BTreeMap<String, (bool, Keys, bool, Keys)>;

/// Service frontends as the datapath holds them: (address, IP protocol number, port).
pub type Frontends = Vec<(IpAddr, u8, u16)>;
/// The Services the engine knows (their backends follow from them and the pods).
pub type Services = Vec<((String, String), ServiceRec)>;
/// Everything compared: the endpoints' MapStates, the ipcache, the Service frontends, and the
/// engine's Services (the `--agent` matrix's Service columns come from them).
pub type State = (Canon, BTreeMap<IpNet, Signature>, Frontends, Services);

pub fn services(engine: &Engine) -> Services {
    engine
        .services()
        .map(|(k, r)| (k.clone(), r.clone()))
        .collect()
}

/// What the agent programmed, identities replaced by what they stand for.
pub fn programmed(h: &AgentHandle) -> Option<State> {
    h.state.with_programmed(|engine, dp| {
        let sig = |id| {
            engine
                .identity_signature(id)
                .cloned()
                .unwrap_or_else(|| panic!("programmed identity {id} is unknown to the engine"))
        };
        let side = |p: &agent::ProgrammedPolicy| -> Keys {
            let mut keys: Keys = p
                .entries
                .iter()
                .map(|(k, e)| {
                    (
                        match k.peer {
                            Peer::Any => None,
                            Peer::Id(id) => Some(sig(id)),
                        },
                        k.prefix,
                        e.verdict,
                        e.order,
                        e.origins.iter().map(|o| (**o).clone()).collect(),
                        e.synthesized,
                    )
                })
                .collect();
            keys.sort();
            keys
        };
        let canon = dp
            .programmed()
            .iter()
            .map(|(ep, [i, e])| (ep.clone(), (i.isolated, side(i), e.isolated, side(e))))
            .collect();
        let ipcache = dp.ipcache().iter().map(|(p, id)| (*p, sig(*id))).collect();
        (
            canon,
            ipcache,
            dp.plane().service_frontends(),
            services(engine),
        )
    })
}

/// The fake server's policy-relevant objects as one multi-document manifest (JSON documents).
pub fn manifests(api: &FakeApi) -> String {
    let mut docs = Vec::new();
    for (v, k) in [
        ("v1", "Namespace"),
        ("v1", "Pod"),
        ("v1", "Service"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("ordnet.io/v1alpha1", "OrderedNetworkPolicy"),
        ("ordnet.io/v1alpha1", "ClusterOrderedNetworkPolicy"),
        ("policy.networking.k8s.io/v1beta1", "ClusterNetworkPolicy"),
        ("v1", "Node"),
    ] {
        for o in api.list(v, k) {
            docs.push(serde_json::to_string(&o).unwrap());
        }
    }
    docs.join("\n---\n")
}

/// The fake server's objects as manifests, through the offline loader and validator.
pub fn offline_objects(api: &FakeApi) -> ordnet_crds::ClusterObjects {
    let outcome = ordnet_crds::load_str(Path::new("fake-api"), &manifests(api));
    ordnet_crds::validated(outcome).objects
}

/// What the offline engine computes for the agent of `node`: that node's endpoints, the whole
/// ipcache, and every Service frontend (`--datapath none` knows no node address, so no
/// NodePort frontends).
pub fn offline_on(api: &FakeApi, node: &str) -> State {
    let objects = offline_objects(api);
    let engine = Engine::build_with(
        &objects,
        &BuildOptions {
            node: Some(node.to_string()),
            ..BuildOptions::default()
        },
    );
    let snap = engine.snapshot();
    let side = |p: &ordnet_engine::PolicySnapshot| -> Keys {
        let mut keys: Keys = p
            .keys
            .iter()
            .map(|(peer, prefix, e)| {
                (
                    peer.clone(),
                    *prefix,
                    e.verdict,
                    e.order,
                    e.origins.clone(),
                    e.synthesized,
                )
            })
            .collect();
        keys.sort();
        keys
    };
    let canon = snap
        .endpoints
        .iter()
        .filter(|(_, e)| e.node.as_deref() == Some(node))
        .map(|(name, e)| {
            (
                name.clone(),
                (
                    e.ingress.isolated,
                    side(&e.ingress),
                    e.egress.isolated,
                    side(&e.egress),
                ),
            )
        })
        .collect();
    let frontends = engine
        .service_frontends()
        .into_iter()
        .map(|(ip, p, port)| (ip, p.number(), port))
        .collect();
    (canon, snap.ipcache, frontends, services(&engine))
}

pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8(buf).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, body.to_string())
}

/// [`start_agent_on`], ready within `limit`.
pub async fn start_agent_within(api: &FakeApi, node: &str, limit: Duration) -> AgentHandle {
    start_agent_with(api, node, limit, WatchConfig::default()).await
}

/// [`start_agent_within`] with the watchers configured by `watch`.
pub async fn start_agent_with(
    api: &FakeApi,
    node: &str,
    limit: Duration,
    watch: WatchConfig,
) -> AgentHandle {
    // Every programmed key is recorded: `programmed` compares them with the engine's.
    let mut dp = NoneDatapath::default();
    dp.record_keys();
    let h = agent::start(
        AgentConfig {
            node: node.into(),
            debug_addr: "127.0.0.1:0".parse().unwrap(),
            namespace: "kube-system".into(),
            lease_renew_every: Duration::from_millis(100),
            watch,
            cni_socket: None,
            metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
            follow_netlink: false,
            maintain_every: agent::MAINTAIN_EVERY,
            observe_journal: agent::observe::DEFAULT_JOURNAL,
            flow_log: None,
            traffic_window: Some(Duration::from_millis(500)),
            flow_history: agent::history::DEFAULT_FLOW_HISTORY,
        },
        api.client(),
        Box::new(dp),
    )
    .await
    .unwrap();
    let addr = h.debug_addr();
    let deadline = tokio::time::Instant::now() + limit;
    while http_get(addr, "/readyz").await.0 != 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not ready in {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    h
}

/// Whether the test runs as root; without root it is skipped (a line on stderr), unless CI is
/// set: then it fails.
pub fn root_or_skip(test: &str) -> bool {
    // SAFETY: no arguments, no memory.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{test} needs root (bpf, XDP, network namespaces), and CI is set");
    }
    eprintln!("{test}: skipped (needs root)");
    false
}

/// Runs a command line (split on whitespace), which must succeed.
pub fn run(line: &str) {
    let args: Vec<&str> = line.split_whitespace().collect();
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{line}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `f` on a new thread inside the network namespace `/var/run/netns/NS`.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    use std::os::fd::AsRawFd as _;
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a valid namespace fd; only this thread moves.
        let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
}

/// The interfaces with a pinned link in `sub` (`links` or `tc-links`) of this map layout's pin
/// directory under the pin root, sorted.
pub fn pinned_links(pin_root: &Path, sub: &str) -> Vec<String> {
    let dir = ordnet_datapath::layout_dir(pin_root).join(sub);
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| ordnet_datapath::link_pin_iface(&e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Serves `listener` on a thread until `stop` is set: every accepted connection gets
/// `greeting` and is closed.
#[allow(dead_code)]
pub fn serve_greeting(
    listener: std::net::TcpListener,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    greeting: Vec<u8>,
) {
    use std::io::Write as _;
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            match listener.accept() {
                Ok((mut s, _)) => {
                    let _ = s.set_nonblocking(false);
                    let _ = s.write_all(&greeting);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
}
