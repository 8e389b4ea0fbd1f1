//! `ordnet agent`: the node agent.
//!
//! * One watcher per kind of `ObjectKind::ALL` (`watchers`: paged list, then watch with
//!   bookmarks; a bounded reconnect backoff, watches that go silent are restarted, and each
//!   kind's staleness is kept in [`WatchHealth`]) feeds one channel.
//! * The agent keeps a view of every object it was told about (with its resource version and
//!   whether it is valid). Nothing is computed until every watcher finished its initial list;
//!   then the engine is built from the valid objects (MapStates for this node's pods only) and
//!   the datapath is programmed in one go.
//! * After that, each burst of watch events is coalesced per object and applied with
//!   `Engine::apply`; the datapath gets the deltas of the whole batch in one update. A batch
//!   takes the events that are queued (and those the watchers deliver within
//!   [`COALESCE_YIELDS`] turns of the scheduler), at most [`COALESCE_MAX_WAIT`] (20 ms) after
//!   its first event and at most [`COALESCE_MAX_EVENTS`] events, so a steady stream cannot
//!   starve programming; events that arrive while a batch is applied form the next one, so
//!   batches grow with the load and an isolated change waits for nothing. The change latency
//!   metric counts from the batch's first event. A re-list (after 410 Gone or
//!   an API server restart) is diffed against the view, so only real differences reach the
//!   engine, and the last good state stays programmed meanwhile.
//! * What the API server stored is enforced (SEMANTICS.md §7). A policy with rules the engine
//!   cannot enforce as written is enforced with those rules failing closed (an `Allow` rule
//!   matches nothing, a `Deny` rule denies everything in its direction); only an object the
//!   engine cannot use at all (a policy with an invalid subject selector, a pod with an
//!   unreadable address) is left out. Either way it is recorded in [`AgentState::problems`],
//!   counted, reported in the policy's status and as an Event; everything else keeps working.
//!
//! The apply loop is `applier`; the datapath it programs is an [`Enforcer`] ([`bpf`] or the
//! in-memory [`NoneDatapath`]); [`status`] writes policy status under a Lease and emits Events;
//! [`observe`] reads the datapath's verdict events and attributes them to rules;
//! the debug API ([`debug`]) serves health, metrics and the matrix/trace/dump answers from the
//! programmed state. The command line is the binary's (`src/cli/agent.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockWriteGuard};
use std::time::{Duration, Instant};

use kube::Client;
use ordnet_engine::{Engine, ObjectKind};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

mod applier;
pub mod bpf;
pub mod client;
mod cni;
pub mod datapath;
pub mod debug;
mod denied;
mod error;
pub mod flowlog;
mod heap;
pub mod history;
pub mod metrics;
mod netview;
pub mod observe;
mod reclaim;
mod staged;
pub mod status;
pub mod traffic;
mod watchers;

pub use datapath::{Enforcer, NoneDatapath, ProgrammedEndpoint, ProgrammedPolicy};
pub use error::AgentError;
use metrics::Metrics;
pub use watchers::{KindHealth, WatchConfig, WatchHealth};

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// This node's name: its pods are the local endpoints.
    pub node: String,
    /// The debug API's address (port 0: any free port; see [`AgentHandle::debug_addr`]).
    pub debug_addr: SocketAddr,
    /// The namespace of the status writer's Lease (the agent's own namespace).
    pub namespace: String,
    /// How often the Lease is renewed or tried ([`status::RENEW_EVERY`] by default; it must
    /// stay well below [`status::LEASE_SECONDS`]).
    pub lease_renew_every: Duration,
    /// Watch timeouts and the reconnect backoff.
    pub watch: WatchConfig,
    /// Where the CNI plugin's requests are served (`None`: not served).
    pub cni_socket: Option<std::path::PathBuf>,
    /// Where `GET /metrics` is served besides the debug API (`None`: only there).
    pub metrics_addr: Option<SocketAddr>,
    /// Run the datapath's upkeep on every route, link or address change (the bpf datapath:
    /// attach a pod as soon as its route appears).
    pub follow_netlink: bool,
    /// The upkeep's interval otherwise ([`MAINTAIN_EVERY`]).
    pub maintain_every: Duration,
    /// How many attributed verdict events the debug API keeps ([`observe::DEFAULT_JOURNAL`]).
    pub observe_journal: usize,
    /// The flow log: every attributed verdict event as a JSON line (`None`: none), rotated at
    /// `max_bytes`, `files` files kept ([`flowlog`]).
    pub flow_log: Option<FlowLogConfig>,
    /// Every this long, the agent publishes what its datapath counted per rule (its node
    /// report), and the status writer sums the nodes' reports into the policies'
    /// `status.traffic` ([`traffic`]; `None`: neither).
    pub traffic_window: Option<Duration>,
    /// How many distinct flows the agent keeps for `ordnet whatif --agent`
    /// ([`history::DEFAULT_FLOW_HISTORY`]).
    pub flow_history: usize,
}

/// Where and how the flow log is written ([`AgentConfig::flow_log`]).
#[derive(Debug, Clone)]
pub struct FlowLogConfig {
    /// The current file (rotated ones get `.1`, `.2`, ...).
    pub path: std::path::PathBuf,
    /// Size at which it is rotated.
    pub max_bytes: u64,
    /// Files kept, the current one included.
    pub files: u32,
}

/// Burst coalescing (see `Applier::coalesce`): a batch closes once no watch event is queued and
/// none arrived while the watchers had this many turns of the scheduler...
pub const COALESCE_YIELDS: usize = 8;
/// ...or this long after its first event at the latest...
pub const COALESCE_MAX_WAIT: Duration = Duration::from_millis(20);
/// ...or when it holds this many events.
pub const COALESCE_MAX_EVENTS: usize = 5000;

/// An object's identity in the view: (kind, namespace or "", name).
pub type ObjKey = (ObjectKind, String, String);

/// What the agent does with an object the API server stored (SEMANTICS.md §7: what the API
/// server admits is enforced; what cannot be enforced fails closed).
#[derive(Debug, Clone, PartialEq)]
pub enum Enforcement {
    /// Enforced as written (an object may still have validation errors that do not change what
    /// it means, e.g. a list longer than the CRD schema's `maxItems`).
    Full,
    /// Enforced; these rules cannot be enforced as written and fail closed (an `Allow` rule
    /// matches nothing, a `Deny` rule denies everything in its direction).
    Partial(Vec<ordnet_engine::FailedRule>),
    /// Not usable at all (e.g. a policy whose subject selector is invalid, a pod with an
    /// unreadable address): left out of the engine.
    None,
}

impl Enforcement {
    /// `yes`, `partly` or `no` (the debug API's `enforced`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Enforcement::Full => "yes",
            Enforcement::Partial(_) => "partly",
            Enforcement::None => "no",
        }
    }
}

/// An object with problems: validation errors, rules enforced fail-closed, or not enforced at
/// all.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectProblem {
    /// The object's kind as Kubernetes spells it.
    pub kind: &'static str,
    /// `None` for cluster-scoped kinds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The object's name.
    pub name: String,
    /// `metadata.resourceVersion` of the version these problems are about.
    pub resource_version: Option<String>,
    /// `no` (left out), `partly` (some rules fail closed) or `yes`.
    pub enforced: &'static str,
    /// Validation errors (warnings left out), `field: message`, plus the engine's reason when
    /// it cannot use the object at all.
    pub errors: Vec<String>,
    /// The rules enforced fail-closed, e.g. `spec.ingress[1] (Deny) denies all ingress: ...`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failed_closed_rules: Vec<String>,
}

/// Everything the agent shares with the debug API and with tests.
pub struct AgentState {
    /// This node's name ([`AgentConfig::node`]).
    pub node: String,
    /// `None` until the initial sync is done and the datapath programmed.
    engine: RwLock<Option<Engine>>,
    /// Whether `engine` is `Some`: read without the engine's lock, which a change holds for as
    /// long as the engine and the datapath take (seconds for a full programming at 50,000
    /// pods), so that `/readyz` and `/metrics` answer meanwhile.
    ready: AtomicBool,
    /// The batches of changes programmed so far (`ordnet_update_batches_total`), for the debug
    /// API's `/v1/batches`, which waits for the next one.
    programmed: watch::Sender<u64>,
    /// When the datapath next has released rule sets to clear, as of the last programming
    /// ([`reclaim`]).
    reclaim_due: watch::Sender<Option<std::time::Instant>>,
    datapath: Mutex<Box<dyn Enforcer>>,
    problems: RwLock<BTreeMap<ObjKey, ObjectProblem>>,
    /// The agent's counters and gauges (served by the debug API).
    pub metrics: Metrics,
    /// Each kind's watch: in step or stale since when, and why.
    pub watch: Arc<WatchHealth>,
    /// Whether this agent holds the status writer Lease.
    leader: Arc<AtomicBool>,
    /// The apply loop's change number (every view change counts one) that the engine has
    /// applied; the status writer uses it to tell which object versions a shadowed-rule report
    /// describes (`status.rs`).
    applied: AtomicU64,
    /// When the apply loop last finished applying changes (`applied`): the status writer copies
    /// its analysis' inputs under the engine's read lock only once the loop has been idle for a
    /// moment (`status.rs`, `analysis_due`).
    applied_at: Mutex<Instant>,
    /// The endpoints denied for lack of room, as last reported.
    denied: Mutex<denied::DeniedReport>,
    /// The last verdict events, attributed (`observe`; the debug API's `/v1/observe`).
    pub journal: Mutex<crate::observe::Journal>,
    /// The flow log, if one is written.
    flow_log: Mutex<Option<flowlog::FlowLog>>,
    /// The staged view and what it would change ([`staged`]).
    staged: staged::Staged,
    /// The distinct flows the datapath reported, for `ordnet whatif --agent` ([`history`]).
    history: Mutex<history::FlowHistory>,
}

impl AgentState {
    /// The state of an agent on `node` that has not synced yet (`journal`, `history`: the
    /// sizes [`AgentConfig::observe_journal`] and [`AgentConfig::flow_history`]).
    fn new(
        node: &str,
        datapath: Box<dyn Enforcer>,
        flow_log: Option<flowlog::FlowLog>,
        journal: usize,
        history: usize,
    ) -> AgentState {
        AgentState {
            node: node.to_string(),
            engine: RwLock::new(None),
            ready: AtomicBool::new(false),
            programmed: watch::Sender::new(0),
            reclaim_due: watch::Sender::new(None),
            datapath: Mutex::new(datapath),
            problems: RwLock::new(BTreeMap::new()),
            metrics: Metrics::default(),
            watch: Arc::new(WatchHealth::default()),
            leader: Arc::new(AtomicBool::new(false)),
            applied: AtomicU64::new(0),
            applied_at: Mutex::new(Instant::now()),
            denied: Mutex::new(denied::DeniedReport::default()),
            journal: Mutex::new(crate::observe::Journal::new(journal)),
            flow_log: Mutex::new(flow_log),
            staged: staged::Staged::default(),
            history: Mutex::new(history::FlowHistory::new(history)),
        }
    }

    /// Records that the apply loop has applied change number `seq` (now).
    fn mark_applied(&self, seq: u64) {
        self.applied.store(seq, std::sync::atomic::Ordering::SeqCst);
        *self.applied_at.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// How long the apply loop has not applied a change.
    fn idle_for(&self) -> Duration {
        self.applied_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }

    /// After every programming of the datapath (initial, a batch of changes, upkeep): records
    /// the sizes and metrics, and reports changes of the endpoints denied for lack of room.
    fn after_programming(&self, engine: &Engine, dp: &dyn Enforcer) {
        self.publish_reclaim_due(dp);
        self.metrics.set_sizes(engine, dp);
        self.denied
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(engine, dp.denied());
    }

    /// Datapath work between changes (upkeep, clearing released rule sets): `work` runs on the
    /// programmed engine and the datapath, locked in the one order (engine, then datapath);
    /// its error is counted and logged as `failed`, and the programming recorded — unless it
    /// did nothing (`None`). Nothing before the initial sync.
    fn between_changes(
        &self,
        failed: &'static str,
        work: impl FnOnce(&Engine, &mut dyn Enforcer) -> Option<Result<(), AgentError>>,
    ) {
        let engine = self.engine.read().unwrap_or_else(|e| e.into_inner());
        let Some(engine) = engine.as_ref() else {
            return;
        };
        let mut dp = self.datapath.lock().unwrap_or_else(|e| e.into_inner());
        let Some(result) = work(engine, dp.as_mut()) else {
            return;
        };
        if let Err(e) = result {
            self.metrics.datapath_errors.inc();
            tracing::error!(error = %e, "{failed}");
        }
        self.after_programming(engine, dp.as_ref());
    }

    /// Publishes when the datapath next has released rule sets to clear ([`reclaim`]).
    fn publish_reclaim_due(&self, dp: &dyn Enforcer) {
        let due = dp.reclaim_due();
        self.reclaim_due
            .send_if_modified(|d| std::mem::replace(d, due) != due);
    }

    /// Whether the initial sync is done and the datapath programmed. Never waits for a change
    /// being applied.
    pub fn ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Makes `engine`, programmed, the agent's engine (`slot`: the engine's place, locked for
    /// writing) and says so to [`AgentState::ready`].
    fn install_engine(&self, slot: &mut Option<Engine>, engine: Engine) {
        *slot = Some(engine);
        self.ready.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Runs `f` on the engine (after the initial sync).
    pub fn with_engine<T>(&self, f: impl FnOnce(&Engine) -> T) -> Option<T> {
        self.engine
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(f)
    }

    /// Runs `f` on the engine and the datapath together (a consistent view).
    pub fn with_programmed<T>(&self, f: impl FnOnce(&Engine, &dyn Enforcer) -> T) -> Option<T> {
        let engine = self.engine.read().unwrap_or_else(|e| e.into_inner());
        let dp = self.datapath.lock().unwrap_or_else(|e| e.into_inner());
        engine.as_ref().map(|e| f(e, dp.as_ref()))
    }

    /// The engine slot for writing and the datapath, locked in the one order used everywhere
    /// (engine, then datapath), so no two paths can deadlock.
    /// The datapath alone (the engine untouched).
    fn datapath(&self) -> MutexGuard<'_, Box<dyn Enforcer>> {
        self.datapath.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_for_update(
        &self,
    ) -> (
        RwLockWriteGuard<'_, Option<Engine>>,
        MutexGuard<'_, Box<dyn Enforcer>>,
    ) {
        let engine = self.engine.write().unwrap_or_else(|e| e.into_inner());
        let dp = self.datapath.lock().unwrap_or_else(|e| e.into_inner());
        (engine, dp)
    }

    /// Counts one more batch of changes programmed (after everything about it is recorded) and
    /// wakes the requests waiting for it.
    fn count_batch(&self) {
        self.metrics.batches.inc();
        self.programmed.send_replace(self.metrics.batches.get());
    }

    /// Waits until more than `after` batches of changes have been programmed, at most for
    /// `timeout`; the count then.
    pub async fn batches_after(&self, after: u64, timeout: Duration) -> u64 {
        let mut seen = self.programmed.subscribe();
        let _ = tokio::time::timeout(timeout, seen.wait_for(|n| *n > after)).await;
        *seen.borrow()
    }

    /// Whether this agent is the status writer (holds the Lease).
    pub fn is_status_writer(&self) -> bool {
        self.leader.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The objects that currently have problems (left out, partly enforced, or with validation
    /// errors).
    pub fn problems(&self) -> Vec<ObjectProblem> {
        self.problems
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

/// A running agent. Dropping it stops it.
pub struct AgentHandle {
    /// The running agent's shared state.
    pub state: Arc<AgentState>,
    debug_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
    /// For releasing the status writer Lease at the end: the client and the Lease's namespace.
    lease: (Client, String),
}

impl AgentHandle {
    /// Where the debug API listens.
    pub fn debug_addr(&self) -> SocketAddr {
        self.debug_addr
    }

    /// Where the metrics listener listens (`--metrics-addr`), if any.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Stops every task of the agent.
    pub fn shutdown(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }

    /// Stops every task, then gives up the status writer Lease if this agent holds it, so
    /// another agent takes over at once (SIGTERM). At most `limit` is spent on the API server.
    pub async fn stop(&mut self, limit: Duration) {
        let was_writer = self.state.is_status_writer();
        self.shutdown();
        if !was_writer {
            return;
        }
        let (client, namespace) = self.lease.clone();
        match tokio::time::timeout(
            limit,
            status::release_lease(client, &namespace, &self.state.node),
        )
        .await
        {
            Ok(Ok(true)) => tracing::info!("released the status writer lease"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "releasing the status writer lease failed"),
            Err(_) => tracing::warn!("releasing the status writer lease: no answer in time"),
        }
        self.state
            .leader
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Waits until one of the agent's tasks ends (they only end on a fatal error).
    pub async fn wait(&mut self) {
        if self.tasks.is_empty() {
            return;
        }
        let tasks = std::mem::take(&mut self.tasks);
        let (_, _, rest) = futures::future::select_all(tasks).await;
        self.tasks = rest;
    }
}

impl Drop for AgentHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts the agent on `client` with `datapath`: watchers, the apply loop and the debug API.
pub async fn start(
    config: AgentConfig,
    client: Client,
    datapath: Box<dyn Enforcer>,
) -> std::io::Result<AgentHandle> {
    let flow_log = match &config.flow_log {
        Some(f) => Some(
            flowlog::FlowLog::open(&f.path, f.max_bytes, f.files).map_err(|e| {
                std::io::Error::new(e.kind(), format!("the flow log {}: {e}", f.path.display()))
            })?,
        ),
        None => None,
    };
    let state = Arc::new(AgentState::new(
        &config.node,
        datapath,
        flow_log,
        config.observe_journal,
        config.flow_history,
    ));
    let (wanted_tx, wanted_rx) = watch::channel(BTreeMap::new());
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    *state.denied.lock().unwrap_or_else(|e| e.into_inner()) =
        denied::DeniedReport::new(events_tx.clone());
    let (debug_addr, debug_task) = debug::serve(config.debug_addr, state.clone()).await?;
    let mut metrics_addr = None;
    let mut metrics_task = None;
    if let Some(addr) = config.metrics_addr {
        let (bound, task) = debug::serve_metrics(addr, state.clone()).await?;
        metrics_addr = Some(bound);
        metrics_task = Some(task);
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let mut tasks = vec![
        debug_task,
        tokio::spawn(status::lease_loop(
            client.clone(),
            config.namespace.clone(),
            config.node.clone(),
            state.leader.clone(),
            config.lease_renew_every,
        )),
        tokio::spawn(status::status_loop(
            client.clone(),
            state.clone(),
            wanted_rx,
            config.namespace.clone(),
            config.traffic_window,
        )),
        tokio::spawn(status::event_loop(
            client.clone(),
            config.node.clone(),
            events_rx,
        )),
    ];
    tasks.extend(watchers::spawn_all(
        &client,
        &config.watch,
        &state.watch,
        &tx,
    ));
    tasks.extend(metrics_task);
    if let Some(path) = &config.cni_socket {
        tasks.push(cni::serve(path, state.clone(), tx.clone())?);
    }
    drop(tx);
    let events = Arc::new(tokio::sync::Notify::new());
    if config.follow_netlink {
        tasks.push(follow_netlink(events.clone())?);
    }
    tasks.push(tokio::spawn(observe::observe_loop(state.clone())));
    if let Some(window) = config.traffic_window {
        tasks.push(tokio::spawn(traffic::report_loop(
            client.clone(),
            state.clone(),
            config.namespace.clone(),
            window,
        )));
    }
    tasks.push(tokio::spawn(maintain_loop(
        state.clone(),
        events,
        config.maintain_every,
    )));
    tasks.push(tokio::spawn(heap::give_back_when_grown(
        state.programmed.subscribe(),
        heap::QUIET,
        heap::grown_by,
        heap::give_back,
    )));
    tasks.push(tokio::spawn(reclaim::reclaim_loop(
        state.clone(),
        state.reclaim_due.subscribe(),
    )));
    let loop_state = state.clone();
    tasks.push(tokio::spawn(async move {
        applier::Applier::new(loop_state, config.node, wanted_tx, events_tx)
            .run(rx)
            .await;
    }));
    Ok(AgentHandle {
        state,
        debug_addr,
        metrics_addr,
        tasks,
        lease: (client, config.namespace),
    })
}

/// How often the datapath's upkeep runs ([`Enforcer::maintain`]) at least: it also runs at
/// once on every route, link or address change of the node and on the neighbour events that
/// find bridged pods (netlink, [`follow_netlink`]).
pub const MAINTAIN_EVERY: Duration = Duration::from_secs(10);

/// Runs [`Enforcer::maintain`] once the initial sync is done: on every netlink event (after 5 ms,
/// so a burst, e.g. a veth with its address and route, is one run) and every `every`.
async fn maintain_loop(state: Arc<AgentState>, events: Arc<tokio::sync::Notify>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = events.notified() => tokio::time::sleep(Duration::from_millis(5)).await,
        }
        let state = state.clone();
        let _ = tokio::task::spawn_blocking(move || {
            state.between_changes("datapath upkeep failed", |engine, dp| {
                Some(dp.maintain(engine))
            })
        })
        .await;
    }
}

/// Follows the node's links, addresses and routes (rtnetlink multicast groups): every message
/// wakes `events`, so a pod whose route appears is attached at once instead of at the next
/// upkeep.
fn follow_netlink(events: Arc<tokio::sync::Notify>) -> std::io::Result<JoinHandle<()>> {
    use futures::StreamExt as _;
    use rtnetlink::constants::{
        RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE, RTMGRP_LINK,
        RTMGRP_NEIGH,
    };
    let (mut connection, _, mut messages) = rtnetlink::new_connection()?;
    let groups = RTMGRP_LINK
        | RTMGRP_IPV4_IFADDR
        | RTMGRP_IPV4_ROUTE
        | RTMGRP_IPV6_IFADDR
        | RTMGRP_IPV6_ROUTE
        | RTMGRP_NEIGH;
    use netlink_sys::AsyncSocket as _;
    connection
        .socket_mut()
        .socket_mut()
        .bind(&netlink_sys::SocketAddr::new(0, groups))?;
    Ok(tokio::spawn(async move {
        let connection = tokio::spawn(connection);
        while let Some((message, _)) = messages.next().await {
            if wakes_upkeep(&message.payload) {
                events.notify_one();
            }
        }
        connection.abort();
        tracing::error!("the netlink event stream ended; upkeep runs on its interval only");
    }))
}

/// Whether a netlink event may change where a pod's traffic passes: every link, address and
/// route event; of the neighbour events (frequent on a busy node: every state change of every
/// neighbour) only a bridge learning or forgetting an address and one of the agent's own
/// managed entries becoming reachable (how a bridged pod's port is found: `netview`).
fn wakes_upkeep(
    payload: &netlink_packet_core::NetlinkPayload<netlink_packet_route::RouteNetlinkMessage>,
) -> bool {
    use netlink_packet_core::NetlinkPayload;
    use netlink_packet_route::{AddressFamily, RouteNetlinkMessage, neighbour::NeighbourState};
    match payload {
        NetlinkPayload::InnerMessage(
            RouteNetlinkMessage::NewNeighbour(n) | RouteNetlinkMessage::DelNeighbour(n),
        ) => {
            n.header.family == AddressFamily::Bridge
                || (n.header.state == NeighbourState::Reachable && netview::is_managed(n))
        }
        _ => true,
    }
}

/// The kube client for `--kubeconfig PATH`, or the default (in-cluster, then the usual
/// kubeconfig lookup).
pub async fn client_for(kubeconfig: Option<&std::path::Path>) -> Result<Client, AgentError> {
    let config = match kubeconfig {
        Some(path) => {
            let what = || format!("--kubeconfig {}", path.display());
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| AgentError::Config {
                what: what(),
                message: e.to_string(),
            })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| AgentError::Config {
                    what: what(),
                    message: e.to_string(),
                })?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| AgentError::Config {
                what: "no cluster configuration".into(),
                message: e.to_string(),
            })?,
    };
    Client::try_from(config).map_err(AgentError::Client)
}

/// Waits until `f` holds, polling every 20 ms, for at most `limit`.
pub async fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
