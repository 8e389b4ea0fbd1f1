//! `ordnet agent`: its command line, and running the agent library until a signal.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::builder::NonEmptyStringValueParser;
use clap::{Args, CommandFactory, ValueEnum};
use ordnet::agent;

use super::Cli;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatapathArg {
    Bpf,
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line (for log collectors).
    Json,
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// The name of the node this agent runs on.
    #[arg(long, env = "NODE_NAME", value_parser = NonEmptyStringValueParser::new(),
          required_unless_present = "uninstall")]
    pub node: Option<String>,
    /// Remove ordnet from this node instead of running: take `ordnet-cni` out of the conflists
    /// of --cni-conf-dir and out of --cni-bin-dir (when given), detach the XDP and TC programs
    /// from every interface and remove every pin ($ORDNET_PIN_DIR, default
    /// /sys/fs/bpf/ordnet). Run it after the agent's DaemonSet is gone (deploy/uninstall/).
    #[arg(long, conflicts_with_all = ["kubeconfig", "uplink", "debug_addr", "watch_timeout", "cni_socket", "metrics_addr", "upkeep_interval", "observe_buffer", "flow_log", "events_per_sec", "rule_counters", "traffic_window", "flow_history"])]
    pub uninstall: bool,
    /// Kubeconfig to use (default: in-cluster config, then the usual kubeconfig lookup).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "bpf")]
    pub datapath: DatapathArg,
    /// An interface that carries traffic from other nodes (--datapath bpf only): the programs
    /// are attached there too. Repeatable; a glob pattern (`*`, `?`) names every interface it
    /// matches, now or later (`--uplink 'eth*' --uplink bond0`). VXLAN and Geneve devices (the
    /// overlays of flannel and others) are attached without being named.
    #[arg(long, value_name = "IFACE|PATTERN", value_parser = NonEmptyStringValueParser::new())]
    pub uplink: Vec<String>,
    /// Address of the debug API (health, metrics, matrix/trace/dump), as IP:PORT.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9090")]
    pub debug_addr: SocketAddr,
    /// Where Prometheus scrapes `GET /metrics` (all addresses of the node by default; the debug
    /// API, loopback only, serves it too). `none`: only on the debug API.
    #[arg(long, value_name = "ADDR|none", default_value = "[::]:9091",
          value_parser = parse_metrics_addr)]
    pub metrics_addr: MetricsAddr,
    /// The datapath's upkeep (attachments, host addresses, retries) runs on every route, link
    /// or address change of the node, and at least this often, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub upkeep_interval: u64,
    /// How many verdict events (new flows and denials, attributed to their rules) the agent
    /// keeps for `ordnet observe --agent` (the oldest go first).
    #[arg(long, value_name = "EVENTS", default_value_t = ordnet::agent::observe::DEFAULT_JOURNAL as u64,
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub observe_buffer: u64,
    /// Verdict events (new flows, denied packets: `ordnet observe`) the node's programs may
    /// emit per second at most, shared by its CPUs; more are counted as suppressed. 0: none.
    #[arg(long, value_name = "N", default_value_t = ordnet_datapath::common::event::DEFAULT_EVENTS_PER_SEC)]
    pub events_per_sec: u64,
    /// Count every new flow and denied packet for the rule that decided it, in the kernel
    /// (`ordnet observe --counters`, the `ordnet_rule_*` metrics). Off, a new flow or a denied
    /// packet costs less when the events are off too (docs/observe.md §8).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub rule_counters: bool,
    /// Every this many seconds, publish what the rules decided on this node (the per-rule
    /// counters' growth: a ConfigMap `ordnet-traffic-<node>` in the agent's namespace); the
    /// status writer sums the nodes' reports into each ordered policy's `status.traffic`
    /// (docs/observe.md §9). 0: neither.
    #[arg(long, value_name = "SECONDS", default_value_t = ordnet::agent::traffic::DEFAULT_WINDOW.as_secs(),
          value_parser = clap::value_parser!(u64).range(0..=86400))]
    pub traffic_window: u64,
    /// How many distinct flows (addresses, protocol, port; the last verdict of each) the agent
    /// keeps for `ordnet whatif --agent`, the least recently seen dropped first. 0: none.
    #[arg(long, value_name = "FLOWS", default_value_t = ordnet::agent::history::DEFAULT_FLOW_HISTORY as u64,
          value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    pub flow_history: u64,
    /// Write every verdict event (attributed to its rules, as `ordnet observe -o json` shows
    /// it) as a JSON line to this file, for log collectors.
    #[arg(long, value_name = "PATH")]
    pub flow_log: Option<std::path::PathBuf>,
    /// Rotate the flow log when it reaches this size (the file becomes PATH.1, ...).
    #[arg(long, value_name = "BYTES", default_value_t = ordnet::agent::flowlog::DEFAULT_MAX_BYTES,
          requires = "flow_log")]
    pub flow_log_max_bytes: u64,
    /// Flow log files kept, the current one included.
    #[arg(long, value_name = "N", default_value_t = ordnet::agent::flowlog::DEFAULT_FILES,
          value_parser = clap::value_parser!(u32).range(1..=1000), requires = "flow_log")]
    pub flow_log_files: u32,
    /// The log format (to stderr).
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// What to log: a level (error, warn, info, debug, trace) or a tracing filter such as
    /// `info,kube=debug`; RUST_LOG, when set, wins.
    #[arg(long, value_name = "FILTER", default_value = "info")]
    pub log_level: String,
    /// The server-side timeout of every watch, in seconds (at least 1); a watch that heard
    /// nothing, not even a bookmark, for this plus 5 s is taken for dead and restarted.
    #[arg(long, value_name = "SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub watch_timeout: u64,
    /// Where to serve the `ordnet-cni` plugin (a unix socket in a host directory; the plugin's
    /// network configuration names the same path). `none`: do not serve it.
    #[arg(long, value_name = "PATH", default_value = ordnet_cni::DEFAULT_SOCKET)]
    pub cni_socket: String,
    /// Capacity of the policy map, in keys (--datapath bpf; all rule sets of the node's
    /// endpoints). An endpoint whose rules do not fit gets a deny-all policy in both
    /// directions (and is reported) until they do. Maps pinned with another size are replaced
    /// at start without a moment unenforced.
    #[arg(long, value_name = "KEYS", default_value_t = ordnet_datapath::common::layout::DEFAULT_POLICY_ENTRIES,
          value_parser = clap::value_parser!(u32).range(1..=(1 << 26)))]
    pub policy_map_entries: u32,
    /// Node-local identity classes: the policy map holds keys per class of identities that no
    /// rule set of the node tells apart instead of per identity (a fraction of the keys in
    /// large clusters; docs/datapath.md §13). Traces, dumps and metrics keep showing
    /// identities. Maps pinned with (or without) classes keep them until they are replaced.
    /// --datapath none keeps the same translation in memory.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub policy_classes: bool,
    /// What the policy map may grow to, in keys (--datapath bpf): while an endpoint is denied
    /// for lack of room or the map is 90 % full, it doubles up to this (new maps are
    /// programmed and take the attachments over; nothing is unenforced meanwhile). At most
    /// --policy-map-entries: it does not grow.
    #[arg(long, value_name = "KEYS", default_value_t = agent::bpf::DEFAULT_POLICY_ENTRIES_MAX,
          value_parser = clap::value_parser!(u32).range(1..=(1 << 26)))]
    pub policy_map_max_entries: u32,
    /// Capacity of the ipcache, in addresses per family (--datapath bpf; every pod and node
    /// address of the cluster).
    #[arg(long, value_name = "ADDRESSES", default_value_t = ordnet_datapath::common::layout::DEFAULT_IPCACHE_ENTRIES,
          value_parser = clap::value_parser!(u32).range(16..=(1 << 26)))]
    pub ipcache_entries: u32,
    /// Rule set slots (--datapath bpf; distinct policies of the node's endpoints, plus the
    /// ones being replaced; 1.5 KiB of kernel memory each).
    #[arg(long, value_name = "SLOTS", default_value_t = ordnet_datapath::common::layout::DEFAULT_MAX_RULESETS,
          value_parser = clap::value_parser!(u32).range(2..=(1 << 16)))]
    pub max_rulesets: u32,
    /// Capacity of the IPv4 connection-tracking table, in flows (--datapath bpf; 104 bytes
    /// of kernel memory each, allocated at creation). A smaller table pinned by an earlier
    /// start is replaced at start, its tracked flows carried over; a larger one is kept.
    #[arg(long, value_name = "FLOWS", default_value_t = ordnet_datapath::common::layout::DEFAULT_CT4_ENTRIES,
          value_parser = clap::value_parser!(u32).range(1024..=(1 << 26)))]
    pub conntrack_entries_v4: u32,
    /// Capacity of the IPv6 connection-tracking table, in flows (128 bytes each).
    #[arg(long, value_name = "FLOWS", default_value_t = ordnet_datapath::common::layout::DEFAULT_CT6_ENTRIES,
          value_parser = clap::value_parser!(u32).range(1024..=(1 << 26)))]
    pub conntrack_entries_v6: u32,
    /// Idle lifetime of an established TCP flow, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = ordnet_datapath::common::layout::CT_LIFETIME_TCP_SECS,
          value_parser = clap::value_parser!(u64).range(1..=7 * 86400))]
    pub conntrack_tcp_timeout: u64,
    /// Idle lifetime of a TCP flow that never got past its SYN, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = ordnet_datapath::common::layout::CT_LIFETIME_SYN_SECS,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub conntrack_syn_timeout: u64,
    /// Idle lifetime of a closed TCP flow (an RST, or a FIN each way), in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = ordnet_datapath::common::layout::CT_LIFETIME_CLOSE_SECS,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub conntrack_close_timeout: u64,
    /// Idle lifetime of a UDP, SCTP or ICMP echo flow, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = ordnet_datapath::common::layout::CT_LIFETIME_OTHER_SECS,
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub conntrack_other_timeout: u64,
    /// Install the `ordnet-cni` plugin (the binary next to this one) into this CNI bin
    /// directory at start (the host's /opt/cni/bin, mounted).
    #[arg(long, value_name = "DIR")]
    pub cni_bin_dir: Option<PathBuf>,
    /// Chain `ordnet-cni` into the conflist the runtime uses (the first *.conflist of this
    /// directory, the host's /etc/cni/net.d, mounted) once the agent serves its socket.
    #[arg(long, value_name = "DIR")]
    pub cni_conf_dir: Option<PathBuf>,
}

/// The map sizes of `--policy-map-entries`, `--ipcache-entries`, `--max-rulesets`,
/// `--conntrack-entries-v4/-v6`.
fn map_sizes(args: &AgentArgs) -> agent::bpf::MapSizes {
    agent::bpf::MapSizes {
        policy_entries: args.policy_map_entries,
        policy_entries_max: args.policy_map_max_entries,
        ipcache_entries: args.ipcache_entries,
        max_rulesets: args.max_rulesets,
        ct_entries: [args.conntrack_entries_v4, args.conntrack_entries_v6],
    }
}

/// The program settings of the `--conntrack-*` and `--events-per-sec` flags.
fn program_options(args: &AgentArgs) -> agent::bpf::ProgramOptions {
    let secs = std::time::Duration::from_secs;
    agent::bpf::ProgramOptions {
        conntrack: agent::bpf::ConntrackOptions {
            tcp: secs(args.conntrack_tcp_timeout),
            syn: secs(args.conntrack_syn_timeout),
            close: secs(args.conntrack_close_timeout),
            other: secs(args.conntrack_other_timeout),
        },
        events_per_sec: args.events_per_sec,
        rule_counters: args.rule_counters,
        classes: args.policy_classes,
    }
}

/// `ordnet agent --uninstall`: exit 0 when this node has no ordnet left (any more), 1 when
/// something could not be removed. The CNI chain first (so no new pod waits for an agent that
/// is gone), then the programs and pins.
fn uninstall(args: &AgentArgs) -> ExitCode {
    let mut failed = false;
    if let Some(dir) = &args.cni_conf_dir {
        match ordnet_cni::install::unchain(dir) {
            Ok(changed) if changed.is_empty() => {}
            Ok(changed) => tracing::info!(
                conflists = %changed.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(","),
                "ordnet-cni taken out of the CNI chain"
            ),
            Err(e) => {
                tracing::error!(error = %e, "taking ordnet-cni out of the CNI chain failed");
                failed = true;
            }
        }
    }
    if let Some(dir) = &args.cni_bin_dir {
        match ordnet_cni::install::remove_binary(dir) {
            Ok(true) => tracing::info!(dir = %dir.display(), "ordnet-cni removed"),
            Ok(false) => {}
            Err(e) => {
                tracing::error!(error = %e, "removing ordnet-cni failed");
                failed = true;
            }
        }
    }
    let pin_dir = agent::bpf::pin_dir_from_env();
    match agent::bpf::uninstall(&pin_dir) {
        Ok(r) if r.objects == 0 && r.xdp_links.is_empty() && r.tc_links.is_empty() => {
            tracing::info!(pins = %pin_dir.display(), "nothing to uninstall");
        }
        Ok(r) => {
            tracing::info!(
                pins = %pin_dir.display(),
                maps_and_programs = r.objects,
                xdp_detached_from = %r.xdp_links.join(","),
                tc_detached_from = %r.tc_links.join(","),
                "uninstalled: every program detached, every pin removed"
            );
        }
        Err(e) => {
            tracing::error!(error = %e, "uninstall failed");
            failed = true;
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// Installs the plugin binary (`--cni-bin-dir`): the `ordnet-cni` next to this binary.
fn install_cni_binary(dir: &std::path::Path) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("this binary: {e}"))?;
    let plugin = exe.with_file_name(ordnet_cni::install::PLUGIN);
    if ordnet_cni::install::install_binary(&plugin, dir)? {
        tracing::info!(from = %plugin.display(), dir = %dir.display(), "ordnet-cni installed");
    }
    Ok(())
}

/// The CNI chain (`--cni-conf-dir`) is checked on every change of the directory (inotify), and
/// at least this often (a safety net for lost events; the only check when inotify is
/// unavailable).
const CNI_RECHAIN_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Keeps `ordnet-cni` in the first conflist of `dir`: a main CNI that rewrites its conflist
/// (many do when they restart) drops the entry; it is checked on every change of the directory
/// and put back (our own write is one more change, after which nothing is written).
async fn keep_chained(dir: std::path::PathBuf, socket: std::path::PathBuf) {
    use futures::StreamExt as _;
    let mut changes = watch_conf_dir(&dir)
        .inspect_err(|e| {
            tracing::warn!(
                dir = %dir.display(),
                error = %e,
                "--cni-conf-dir: cannot watch it; checking the chain every {} s",
                CNI_RECHAIN_EVERY.as_secs()
            )
        })
        .ok();
    loop {
        match changes.as_mut() {
            Some(stream) => {
                tokio::select! {
                    _ = stream.next() => {}
                    _ = tokio::time::sleep(CNI_RECHAIN_EVERY) => {}
                }
            }
            None => tokio::time::sleep(CNI_RECHAIN_EVERY).await,
        }
        match ordnet_cni::install::chain(&dir, &socket) {
            Ok(Some(path)) => tracing::warn!(
                conflist = %path.display(),
                "the conflist had lost ordnet-cni (rewritten by the main CNI?): chained again"
            ),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "--cni-conf-dir: checking the chain failed"),
        }
    }
}

/// A stream of the changes of `dir`'s files (written, created, moved in, deleted).
fn watch_conf_dir(dir: &std::path::Path) -> std::io::Result<inotify::EventStream<[u8; 4096]>> {
    use inotify::{Inotify, WatchMask};
    let inotify = Inotify::init()?;
    inotify.watches().add(
        dir,
        WatchMask::CLOSE_WRITE | WatchMask::CREATE | WatchMask::MOVED_TO | WatchMask::DELETE,
    )?;
    inotify.into_event_stream([0u8; 4096])
}

/// `--metrics-addr`: an address, or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsAddr(pub Option<SocketAddr>);

fn parse_metrics_addr(s: &str) -> Result<MetricsAddr, String> {
    if s == "none" {
        return Ok(MetricsAddr(None));
    }
    s.parse()
        .map(|a| MetricsAddr(Some(a)))
        .map_err(|e| format!("{s:?}: {e} (an IP:PORT, [IPv6]:PORT, or none)"))
}

/// Logs to stderr through `tracing` (the agent's own events and kube-rs's).
fn init_logging(args: &AgentArgs) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&args.log_level));
    let filter = match filter {
        Ok(f) => f,
        Err(e) => Cli::command()
            .error(
                clap::error::ErrorKind::InvalidValue,
                format!("--log-level {:?}: {e}", args.log_level),
            )
            .exit(),
    };
    // netlink-packet-route warns about every attribute a newer kernel made longer than it
    // knows (IFLA_INET6_CONF on every link, at every look at the node's interfaces): errors
    // only, unless the filter names it.
    let names_netlink = std::env::var("RUST_LOG")
        .unwrap_or_else(|_| args.log_level.clone())
        .contains("netlink_packet_route");
    let filter = if names_netlink {
        filter
    } else {
        filter.add_directive(
            "netlink_packet_route=error"
                .parse()
                .expect("a valid directive"),
        )
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => builder.with_ansi(false).init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// Runs `ordnet agent` until SIGTERM/SIGINT (exit 0) or a fatal error (exit 1); usage errors
/// exit 2.
pub fn run(args: AgentArgs) -> ExitCode {
    if !args.uplink.is_empty() && args.datapath != DatapathArg::Bpf {
        Cli::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--uplink only applies to --datapath bpf",
            )
            .exit();
    }
    if args.cni_conf_dir.is_some() && args.cni_socket == "none" {
        Cli::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--cni-conf-dir chains ordnet-cni, which needs --cni-socket (not none)",
            )
            .exit();
    }
    init_logging(&args);
    if args.uninstall {
        return uninstall(&args);
    }

    let Some(node) = args.node.clone() else {
        Cli::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "--node is required",
            )
            .exit();
    };
    let debug_addr = args.debug_addr;
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "starting the runtime failed");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        let client = match agent::client_for(args.kubeconfig.as_deref()).await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "no kube client");
                return ExitCode::from(1);
            }
        };
        if let Some(dir) = &args.cni_bin_dir
            && let Err(e) = install_cni_binary(dir)
        {
            tracing::error!(error = %e, "--cni-bin-dir: installing ordnet-cni failed");
            return ExitCode::from(1);
        }
        // The DaemonSet sets POD_NAMESPACE; an agent run by hand takes the namespace of its
        // credentials (the service account's, or the kubeconfig context's), which is where
        // deploy/rbac.yaml lets it hold the Lease.
        let lease_namespace = std::env::var("POD_NAMESPACE")
            .unwrap_or_else(|_| client.default_namespace().to_string());
        let config = agent::AgentConfig {
            node,
            debug_addr,
            namespace: lease_namespace.clone(),
            lease_renew_every: agent::status::RENEW_EVERY,
            watch: agent::WatchConfig {
                timeout: std::time::Duration::from_secs(args.watch_timeout),
                ..agent::WatchConfig::default()
            },
            cni_socket: (args.cni_socket != "none").then(|| args.cni_socket.clone().into()),
            metrics_addr: args.metrics_addr.0,
            follow_netlink: args.datapath == DatapathArg::Bpf,
            maintain_every: std::time::Duration::from_secs(args.upkeep_interval),
            observe_journal: args.observe_buffer as usize,
            flow_log: args.flow_log.clone().map(|path| agent::FlowLogConfig {
                path,
                max_bytes: args.flow_log_max_bytes,
                files: args.flow_log_files,
            }),
            traffic_window: (args.traffic_window > 0)
                .then(|| std::time::Duration::from_secs(args.traffic_window)),
            flow_history: args.flow_history as usize,
        };
        let (datapath, kind): (Box<dyn agent::Enforcer>, &str) = if args.datapath == DatapathArg::Bpf {
            let pin_dir = agent::bpf::pin_dir_from_env();
            match agent::bpf::BpfDatapath::open(
                &pin_dir,
                args.uplink.clone(),
                program_options(&args),
                map_sizes(&args),
            ) {
                Ok(dp) => {
                    match dp.opened() {
                        agent::bpf::Opened::Created => tracing::info!(
                            pins = %pin_dir.display(),
                            "datapath bpf: new maps pinned"
                        ),
                        agent::bpf::Opened::Adopted {
                            endpoints,
                            rulesets,
                            links,
                        } => tracing::info!(
                            pins = %pin_dir.display(),
                            endpoints,
                            rulesets,
                            attached = %if links.is_empty() { "nothing".to_string() } else { links.join(", ") },
                            "datapath bpf: adopted the pins; enforcing them until the initial sync"
                        ),
                    }
                    (Box::new(dp), "bpf")
                }
                Err(e) => {
                    tracing::error!(error = %e, "--datapath bpf failed");
                    return ExitCode::from(1);
                }
            }
        } else {
            // The in-memory datapath keeps what the bpf one keeps in userspace, classes
            // included (so the scale benchmark's memory and latency are the bpf agent's).
            let dp = if args.policy_classes {
                agent::NoneDatapath::with_classes()
            } else {
                agent::NoneDatapath::default()
            };
            (Box::new(dp), "none")
        };
        let mut handle = match agent::start(config, client, datapath).await {
            Ok(h) => h,
            Err(e) => {
                tracing::error!(error = %e, "--debug-addr {debug_addr}: cannot listen");
                return ExitCode::from(1);
            }
        };
        tracing::info!(
            node = %handle.state.node,
            datapath = kind,
            debug_api = %format!("http://{}", handle.debug_addr()),
            metrics = %handle.metrics_addr().map_or("none".to_string(), |a| format!("http://{a}/metrics")),
            version = env!("CARGO_PKG_VERSION"),
            lease_namespace = %lease_namespace,
            "agent started"
        );
        if let Some(dir) = &args.cni_conf_dir {
            let socket = std::path::PathBuf::from(&args.cni_socket);
            match ordnet_cni::install::chain(dir, &socket) {
                Ok(Some(path)) => tracing::info!(conflist = %path.display(), "ordnet-cni chained"),
                Ok(None) => {}
                Err(e) => {
                    tracing::error!(error = %e, "--cni-conf-dir: chaining ordnet-cni failed");
                    return ExitCode::from(1);
                }
            }
            tokio::spawn(keep_chained(dir.clone(), socket));
        }
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "no SIGTERM handler");
                    return ExitCode::from(1);
                }
            };
        let signalled = tokio::select! {
            _ = term.recv() => true,
            _ = tokio::signal::ctrl_c() => true,
            _ = handle.wait() => false,
        };
        if !signalled {
            tracing::error!("a task ended unexpectedly");
            return ExitCode::from(1);
        }
        if kind == "bpf" {
            tracing::info!(
                "stopping; the pinned maps and attachments stay (enforcement continues, a restarted agent adopts them)"
            );
        }
        handle.stop(std::time::Duration::from_secs(2)).await;
        ExitCode::SUCCESS
    })
}
