//! `ordnet agent`: the node agent.
//!
//! * Five watchers (`kube::runtime::watcher` with the default backoff) on Namespaces, Pods,
//!   NetworkPolicies, OrderedNetworkPolicies and ClusterOrderedNetworkPolicies feed one channel.
//! * The agent keeps a view of every object it was told about (with its resource version and
//!   whether it is valid). Nothing is computed until every watcher finished its initial list;
//!   then the engine is built from the valid objects (MapStates for this node's pods only) and
//!   the datapath is programmed in one go.
//! * After that, each burst of watch events is coalesced per object and applied with
//!   `Engine::apply`; the datapath gets the deltas of the whole batch in one update. A batch
//!   takes events until none arrived for [`COALESCE_QUIET`] (2 ms), at most
//!   [`COALESCE_MAX_WAIT`] (20 ms) after its first event and at most [`COALESCE_MAX_EVENTS`]
//!   events, so a steady stream cannot starve programming; the change latency metric counts
//!   from the batch's first event, window included. A re-list (after 410 Gone or
//!   an API server restart) is diffed against the view, so only real differences reach the
//!   engine, and the last good state stays programmed meanwhile.
//! * What the API server stored is enforced (SEMANTICS.md §7). A policy with rules the engine
//!   cannot enforce as written is enforced with those rules failing closed (an `Allow` rule
//!   matches nothing, a `Deny` rule denies everything in its direction); only an object the
//!   engine cannot use at all (a policy with an invalid subject selector, a pod with an
//!   unreadable address) is left out. Either way it is recorded in [`AgentState::problems`],
//!   counted, reported in the policy's status and as an Event; everything else keeps working.
//!
//! The debug API ([`debug`]) serves health, metrics and the matrix/trace/dump answers from the
//! programmed state.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockWriteGuard};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use ordnet_crds::validate;
use ordnet_crds::{ClusterObjects, ClusterOrderedNetworkPolicy, Loaded, OrderedNetworkPolicy};
use ordnet_engine::{BuildOptions, Engine, EngineDelta, Object, ObjectChange, ObjectKind};
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub mod bpf;
pub mod client;
pub mod datapath;
pub mod debug;
pub mod metrics;
pub mod status;

pub use datapath::{Datapath, NoneDatapath, ProgrammedEndpoint, ProgrammedPolicy};
use metrics::Metrics;

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
}

/// Burst coalescing (see `Applier::coalesce`): a batch closes once no watch event arrived for
/// this long...
pub const COALESCE_QUIET: Duration = Duration::from_millis(2);
/// ...or this long after its first event at the latest...
pub const COALESCE_MAX_WAIT: Duration = Duration::from_millis(20);
/// ...or when it holds this many events.
pub const COALESCE_MAX_EVENTS: usize = 5000;

/// The kinds the agent watches, in the order the engine prefers to see them.
pub const KINDS: [ObjectKind; 6] = ObjectKind::ALL;

fn kind_index(k: ObjectKind) -> usize {
    k.index()
}

/// The name of a kind as Kubernetes spells it.
pub fn kind_name(k: ObjectKind) -> &'static str {
    k.name()
}

/// An object's identity in the view: (kind index, namespace or "", name).
pub type ObjKey = (usize, String, String);

/// One object the agent was told about.
#[derive(Debug, Clone)]
struct ViewEntry {
    resource_version: Option<String>,
    object: Object,
    /// What the engine does with it (everything but [`Enforcement::None`] is in the engine
    /// once synced).
    enforcement: Enforcement,
}

impl ViewEntry {
    fn usable(&self) -> bool {
        self.enforcement != Enforcement::None
    }
}

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

fn object_key(o: &Object) -> ObjKey {
    let (ns, name) = o.key();
    (o.kind().index(), ns, name)
}

/// The validation errors of an object and what the engine can enforce of it. Pods and
/// namespaces with errors are left out; a policy is left out only when the engine cannot use it
/// at all, and otherwise enforced with its unusable rules failing closed.
fn assess(o: &Object) -> (Vec<String>, Enforcement) {
    let mut problems = validate_object(o);
    let enforcement = match o.translate() {
        None if problems.is_empty() => Enforcement::Full,
        None => Enforcement::None,
        Some(Err(e)) => {
            let text = format!("{}: {}", e.field, e.message);
            if !problems.contains(&text) {
                problems.push(text);
            }
            Enforcement::None
        }
        Some(Ok(p)) if p.failed_rules.is_empty() => Enforcement::Full,
        Some(Ok(p)) => Enforcement::Partial(p.failed_rules),
    };
    (problems, enforcement)
}

fn validate_object(o: &Object) -> Vec<String> {
    let errors = match o {
        Object::Service(x) => validate::validate_service(x),
        Object::Namespace(x) => validate::validate_namespace(x),
        Object::Pod(x) => validate::validate_pod(x),
        Object::NetworkPolicy(x) => validate::validate_network_policy(x),
        Object::OrderedNetworkPolicy(x) => validate::validate_ordered_network_policy(x),
        Object::ClusterOrderedNetworkPolicy(x) => {
            validate::validate_cluster_ordered_network_policy(x)
        }
    };
    // Warnings do not make an object invalid (the offline loader keeps it too).
    errors
        .iter()
        .filter(|e| e.severity == ordnet_crds::Severity::Error)
        .map(|e| e.to_string())
        .collect()
}

/// One watch event, typed.
#[derive(Debug)]
enum WatchMsg {
    Init(ObjectKind),
    InitApply(Object),
    InitDone(ObjectKind),
    Apply(Object),
    Delete(Object),
    Error(ObjectKind, String),
}

/// An object with problems: validation errors, rules enforced fail-closed, or not enforced at
/// all.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectProblem {
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub name: String,
    pub resource_version: Option<String>,
    /// `no` (left out), `partly` (some rules fail closed) or `yes`.
    pub enforced: &'static str,
    pub errors: Vec<String>,
    /// The rules enforced fail-closed, e.g. `spec.ingress[1] (Deny) denies all ingress: ...`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failed_closed_rules: Vec<String>,
}

/// Everything the agent shares with the debug API and with tests.
pub struct AgentState {
    pub node: String,
    /// `None` until the initial sync is done and the datapath programmed.
    engine: RwLock<Option<Engine>>,
    datapath: Mutex<Box<dyn Datapath>>,
    problems: RwLock<BTreeMap<ObjKey, ObjectProblem>>,
    pub metrics: Metrics,
    /// Whether this agent holds the status writer Lease.
    leader: Arc<AtomicBool>,
    /// The apply loop's change number (every view change counts one) that the engine has
    /// applied; the status writer uses it to tell which object versions a shadowed-rule report
    /// describes (`status.rs`).
    applied: AtomicU64,
}

impl AgentState {
    /// Whether the initial sync is done and the datapath programmed.
    pub fn ready(&self) -> bool {
        self.engine
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
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
    pub fn with_programmed<T>(&self, f: impl FnOnce(&Engine, &dyn Datapath) -> T) -> Option<T> {
        let engine = self.engine.read().unwrap_or_else(|e| e.into_inner());
        let dp = self.datapath.lock().unwrap_or_else(|e| e.into_inner());
        engine.as_ref().map(|e| f(e, dp.as_ref()))
    }

    /// The engine slot for writing and the datapath, locked in the one order used everywhere
    /// (engine, then datapath), so no two paths can deadlock.
    fn lock_for_update(
        &self,
    ) -> (
        RwLockWriteGuard<'_, Option<Engine>>,
        MutexGuard<'_, Box<dyn Datapath>>,
    ) {
        let engine = self.engine.write().unwrap_or_else(|e| e.into_inner());
        let dp = self.datapath.lock().unwrap_or_else(|e| e.into_inner());
        (engine, dp)
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
    pub state: Arc<AgentState>,
    debug_addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl AgentHandle {
    /// Where the debug API listens.
    pub fn debug_addr(&self) -> SocketAddr {
        self.debug_addr
    }

    /// Stops every task of the agent.
    pub fn shutdown(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
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

fn spawn_watch<K>(
    client: Client,
    kind: ObjectKind,
    wrap: fn(K) -> Object,
    tx: mpsc::UnboundedSender<WatchMsg>,
) -> JoinHandle<()>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    tokio::spawn(async move {
        let api: Api<K> = Api::all(client);
        let mut stream = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(ev) = stream.next().await {
            let msg = match ev {
                Ok(Event::Init) => WatchMsg::Init(kind),
                Ok(Event::InitApply(o)) => WatchMsg::InitApply(wrap(o)),
                Ok(Event::InitDone) => WatchMsg::InitDone(kind),
                Ok(Event::Apply(o)) => WatchMsg::Apply(wrap(o)),
                Ok(Event::Delete(o)) => WatchMsg::Delete(wrap(o)),
                Err(e) => WatchMsg::Error(kind, e.to_string()),
            };
            if tx.send(msg).is_err() {
                return;
            }
        }
    })
}

/// Starts the agent on `client` with `datapath`: watchers, the apply loop and the debug API.
pub async fn start(
    config: AgentConfig,
    client: Client,
    datapath: Box<dyn Datapath>,
) -> std::io::Result<AgentHandle> {
    let state = Arc::new(AgentState {
        node: config.node.clone(),
        engine: RwLock::new(None),
        datapath: Mutex::new(datapath),
        problems: RwLock::new(BTreeMap::new()),
        metrics: Metrics::default(),
        leader: Arc::new(AtomicBool::new(false)),
        applied: AtomicU64::new(0),
    });
    let (wanted_tx, wanted_rx) = watch::channel(BTreeMap::new());
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (debug_addr, debug_task) = debug::serve(config.debug_addr, state.clone()).await?;
    let (tx, rx) = mpsc::unbounded_channel();
    let mut tasks = vec![
        debug_task,
        spawn_watch::<Namespace>(
            client.clone(),
            ObjectKind::Namespace,
            Object::Namespace,
            tx.clone(),
        ),
        spawn_watch::<Pod>(client.clone(), ObjectKind::Pod, Object::Pod, tx.clone()),
        spawn_watch::<Service>(
            client.clone(),
            ObjectKind::Service,
            Object::Service,
            tx.clone(),
        ),
        spawn_watch::<NetworkPolicy>(
            client.clone(),
            ObjectKind::NetworkPolicy,
            Object::NetworkPolicy,
            tx.clone(),
        ),
        spawn_watch::<OrderedNetworkPolicy>(
            client.clone(),
            ObjectKind::OrderedNetworkPolicy,
            Object::OrderedNetworkPolicy,
            tx.clone(),
        ),
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
        )),
        tokio::spawn(status::event_loop(
            client.clone(),
            config.node.clone(),
            events_rx,
        )),
        spawn_watch::<ClusterOrderedNetworkPolicy>(
            client,
            ObjectKind::ClusterOrderedNetworkPolicy,
            Object::ClusterOrderedNetworkPolicy,
            tx,
        ),
    ];
    tasks.push(tokio::spawn(maintain_loop(state.clone())));
    let loop_state = state.clone();
    tasks.push(tokio::spawn(async move {
        Applier::new(loop_state, config.node, wanted_tx, events_tx)
            .run(rx)
            .await;
    }));
    Ok(AgentHandle {
        state,
        debug_addr,
        tasks,
    })
}

/// How often the datapath's upkeep runs ([`Datapath::maintain`]).
pub const MAINTAIN_EVERY: Duration = Duration::from_secs(2);

/// Calls [`Datapath::maintain`] every [`MAINTAIN_EVERY`] once the initial sync is done.
async fn maintain_loop(state: Arc<AgentState>) {
    let mut tick = tokio::time::interval(MAINTAIN_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let state = state.clone();
        let _ = tokio::task::spawn_blocking(move || {
            // Lock order everywhere: engine, then datapath.
            let engine = state.engine.read().unwrap_or_else(|e| e.into_inner());
            let Some(engine) = engine.as_ref() else {
                return;
            };
            let mut dp = state.datapath.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(e) = dp.maintain(engine) {
                state.metrics.datapath_errors.inc();
                eprintln!("ordnet agent: datapath upkeep: {e}");
            }
            state.metrics.set_sizes(engine, dp.as_ref());
        })
        .await;
    }
}

/// The apply loop's own state.
struct Applier {
    state: Arc<AgentState>,
    node: String,
    view: BTreeMap<ObjKey, ViewEntry>,
    /// Per kind: whether its initial list is done (ever).
    synced: [bool; KINDS.len()],
    /// Per kind: the re-list being collected (`Some` between `Init` and `InitDone`).
    relist: [Option<BTreeMap<ObjKey, Object>>; KINDS.len()],
    /// Keys touched since the last apply: their current view entry (or absence) is what the
    /// engine must get.
    dirty: BTreeSet<ObjKey>,
    /// Keys the engine has (valid objects applied).
    in_engine: BTreeSet<ObjKey>,
    /// The wanted status of every ordered policy (for the status writer).
    wanted: watch::Sender<BTreeMap<ObjKey, status::WantedStatus>>,
    /// Problems to publish as Events.
    events: mpsc::UnboundedSender<status::ProblemEvent>,
    /// Change number: one more for every view change (see `AgentState::applied`).
    seq: u64,
}

impl Applier {
    fn new(
        state: Arc<AgentState>,
        node: String,
        wanted: watch::Sender<BTreeMap<ObjKey, status::WantedStatus>>,
        events: mpsc::UnboundedSender<status::ProblemEvent>,
    ) -> Applier {
        Applier {
            state,
            node,
            view: BTreeMap::new(),
            synced: [false; KINDS.len()],
            relist: Default::default(),
            dirty: BTreeSet::new(),
            in_engine: BTreeSet::new(),
            wanted,
            events,
            seq: 0,
        }
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<WatchMsg>) {
        while let Some(first) = rx.recv().await {
            let observed = Instant::now();
            self.handle(first);
            if !self.state.ready() {
                // Initial sync: take everything queued, build once every list is done.
                while let Ok(msg) = rx.try_recv() {
                    self.handle(msg);
                }
                if self.synced.iter().all(|s| *s) {
                    self.initial_program();
                    self.state.applied.store(self.seq, Ordering::SeqCst);
                }
                continue;
            }
            self.coalesce(&mut rx, observed).await;
            self.apply_dirty(observed);
            self.state.applied.store(self.seq, Ordering::SeqCst);
        }
    }

    /// Burst coalescing: after the first event of a batch (observed at `observed`), keeps
    /// taking events while they keep coming, i.e. until no event arrived for
    /// [`COALESCE_QUIET`], but never past [`COALESCE_MAX_WAIT`] after the first event nor beyond
    /// [`COALESCE_MAX_EVENTS`] events, so a steady stream cannot hold programming back. The
    /// batch is then applied as one datapath update; its latency is measured from `observed`,
    /// so the time spent waiting here is part of it.
    async fn coalesce(&mut self, rx: &mut mpsc::UnboundedReceiver<WatchMsg>, observed: Instant) {
        let deadline = tokio::time::Instant::from_std(observed + COALESCE_MAX_WAIT);
        let mut events = 1;
        while events < COALESCE_MAX_EVENTS {
            // Everything already queued first, without waiting.
            let msg = match rx.try_recv() {
                Ok(msg) => msg,
                Err(_) => {
                    let quiet = (tokio::time::Instant::now() + COALESCE_QUIET).min(deadline);
                    match tokio::time::timeout_at(quiet, rx.recv()).await {
                        Ok(Some(msg)) => msg,
                        // Quiet (or past the deadline), or every watcher is gone.
                        Ok(None) | Err(_) => return,
                    }
                }
            };
            self.handle(msg);
            events += 1;
            if tokio::time::Instant::now() >= deadline {
                return;
            }
        }
    }

    fn handle(&mut self, msg: WatchMsg) {
        match msg {
            WatchMsg::Init(kind) => {
                let k = kind_index(kind);
                if self.synced[k] {
                    self.state.metrics.relists.inc();
                }
                self.relist[k] = Some(BTreeMap::new());
            }
            WatchMsg::InitApply(o) => {
                let key = object_key(&o);
                match self.relist[key.0].as_mut() {
                    Some(buf) => {
                        buf.insert(key, o);
                    }
                    // Not expected (the watcher always sends Init first); treat as an update.
                    None => self.upsert(key, o),
                }
            }
            WatchMsg::InitDone(kind) => {
                let k = kind_index(kind);
                let listed = self.relist[k].take().unwrap_or_default();
                let gone: Vec<ObjKey> = self
                    .view
                    .keys()
                    .filter(|key| key.0 == k && !listed.contains_key(*key))
                    .cloned()
                    .collect();
                for key in gone {
                    self.remove(key);
                }
                for (key, o) in listed {
                    self.upsert(key, o);
                }
                self.synced[k] = true;
            }
            WatchMsg::Apply(o) => {
                let key = object_key(&o);
                self.upsert(key, o);
            }
            WatchMsg::Delete(o) => {
                let key = object_key(&o);
                self.remove(key);
            }
            WatchMsg::Error(kind, e) => {
                self.state.metrics.watch_errors.inc();
                eprintln!("ordnet agent: watch {}: {e}", kind_name(kind));
            }
        }
    }

    fn upsert(&mut self, key: ObjKey, object: Object) {
        let rv = object.meta().resource_version.clone();
        if let Some(old) = self.view.get(&key)
            && rv.is_some()
            && old.resource_version == rv
        {
            return;
        }
        self.seq += 1;
        let (problems, enforcement) = assess(&object);
        let failed: Vec<String> = match &enforcement {
            Enforcement::Partial(rules) => rules.iter().map(|r| r.to_string()).collect(),
            _ => Vec::new(),
        };
        {
            let mut p = self
                .state
                .problems
                .write()
                .unwrap_or_else(|e| e.into_inner());
            if problems.is_empty() && failed.is_empty() {
                p.remove(&key);
            } else {
                let name = format!(
                    "{} {}{}",
                    kind_name(KINDS[key.0]),
                    if key.1.is_empty() {
                        String::new()
                    } else {
                        format!("{}/", key.1)
                    },
                    key.2
                );
                match &enforcement {
                    Enforcement::None => {
                        self.state.metrics.invalid_objects.inc();
                        eprintln!(
                            "ordnet agent: not enforcing invalid {name}: {}",
                            problems.join("; ")
                        );
                    }
                    Enforcement::Partial(_) => eprintln!(
                        "ordnet agent: enforcing {name} with rules failing closed: {}",
                        failed.join("; ")
                    ),
                    Enforcement::Full => eprintln!(
                        "ordnet agent: enforcing {name} as written despite: {}",
                        problems.join("; ")
                    ),
                }
                p.insert(
                    key.clone(),
                    ObjectProblem {
                        kind: kind_name(KINDS[key.0]),
                        namespace: (!key.1.is_empty()).then(|| key.1.clone()),
                        name: key.2.clone(),
                        resource_version: rv.clone(),
                        enforced: enforcement.as_str(),
                        errors: problems.clone(),
                        failed_closed_rules: failed,
                    },
                );
            }
        }
        if !problems.is_empty() || enforcement != Enforcement::Full {
            let _ = self.events.send(status::ProblemEvent {
                object: object.clone(),
                errors: problems.clone(),
                enforcement: enforcement.clone(),
            });
        }
        if let Some(w) = status::wanted(&object, &problems, &enforcement, self.seq) {
            self.wanted.send_modify(|m| {
                m.insert(key.clone(), w);
            });
        }
        self.view.insert(
            key.clone(),
            ViewEntry {
                resource_version: rv,
                object,
                enforcement,
            },
        );
        self.dirty.insert(key);
    }

    fn remove(&mut self, key: ObjKey) {
        if self.view.remove(&key).is_some() {
            self.seq += 1;
            self.wanted.send_if_modified(|m| m.remove(&key).is_some());
            self.state
                .problems
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
            self.dirty.insert(key);
        }
    }

    fn options(&self) -> BuildOptions {
        BuildOptions {
            node: Some(self.node.clone()),
        }
    }

    /// The usable objects of the view, as the offline loader would give them.
    fn cluster_objects(&self) -> ClusterObjects {
        let mut objects = ClusterObjects::default();
        for entry in self.view.values().filter(|e| e.usable()) {
            match entry.object.clone() {
                Object::Namespace(o) => objects.namespaces.push(loaded(o)),
                Object::Pod(o) => objects.pods.push(loaded(o)),
                Object::NetworkPolicy(o) => objects.network_policies.push(loaded(o)),
                Object::OrderedNetworkPolicy(o) => objects.ordered_policies.push(loaded(o)),
                Object::ClusterOrderedNetworkPolicy(o) => {
                    objects.cluster_ordered_policies.push(loaded(o))
                }
                Object::Service(o) => objects.services.push(loaded(o)),
            }
        }
        objects
    }

    fn initial_program(&mut self) {
        let started = Instant::now();
        let objects = self.cluster_objects();
        let engine = Engine::build_with(&objects, &self.options());
        self.state
            .metrics
            .compile_seconds
            .observe(started.elapsed().as_secs_f64());
        for e in engine.errors() {
            self.state.metrics.engine_errors.inc();
            eprintln!("ordnet agent: left out: {e}");
        }
        self.in_engine = self
            .view
            .iter()
            .filter(|(_, e)| e.usable())
            .map(|(k, _)| k.clone())
            .collect();
        self.dirty.clear();
        let (mut slot, mut dp) = self.state.lock_for_update();
        if let Err(e) = dp.program_full(&engine) {
            self.state.metrics.datapath_errors.inc();
            eprintln!("ordnet agent: programming the datapath: {e}");
        }
        self.state.metrics.set_sizes(&engine, dp.as_ref());
        *slot = Some(engine);
        self.state
            .metrics
            .apply_seconds
            .observe(started.elapsed().as_secs_f64());
    }

    fn apply_dirty(&mut self, observed: Instant) {
        if self.dirty.is_empty() {
            return;
        }
        let dirty = std::mem::take(&mut self.dirty);
        let mut upserts = Vec::new();
        let mut deletes = Vec::new();
        for key in dirty {
            match self.view.get(&key) {
                Some(e) if e.usable() => {
                    self.in_engine.insert(key);
                    upserts.push(ObjectChange::Upsert(e.object.clone()));
                }
                _ => {
                    if self.in_engine.remove(&key) {
                        let kind = KINDS[key.0];
                        deletes.push(ObjectChange::Delete {
                            kind,
                            namespace: (!key.1.is_empty()).then_some(key.1),
                            name: key.2,
                        });
                    }
                }
            }
        }
        // Deletions of policies before pods before namespaces; upserts in kind order.
        deletes.reverse();
        let changes = upserts.len() + deletes.len();
        if changes == 0 {
            return;
        }
        let started = Instant::now();
        let (mut slot, mut dp) = self.state.lock_for_update();
        let Some(engine) = slot.as_mut() else {
            return;
        };
        let deltas: Vec<EngineDelta> = upserts
            .into_iter()
            .chain(deletes)
            .map(|c| engine.apply(c))
            .collect();
        for d in &deltas {
            for e in &d.errors {
                self.state.metrics.engine_errors.inc();
                eprintln!("ordnet agent: not applied: {e}");
            }
        }
        self.state
            .metrics
            .compile_seconds
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = dp.apply(engine, &deltas) {
            // The recorded state no longer follows the engine: program everything again.
            self.state.metrics.datapath_errors.inc();
            eprintln!("ordnet agent: applying to the datapath: {e}; reprogramming");
            if let Err(e) = dp.program_full(engine) {
                eprintln!("ordnet agent: programming the datapath: {e}");
            }
        }
        self.state.metrics.set_sizes(engine, dp.as_ref());
        self.state.metrics.object_changes.add(changes as u64);
        self.state
            .metrics
            .apply_seconds
            .observe(started.elapsed().as_secs_f64());
        self.state
            .metrics
            .change_latency_seconds
            .observe(observed.elapsed().as_secs_f64());
        // Last: a batch counted is a batch fully recorded.
        self.state.metrics.batches.inc();
    }
}

fn loaded<T>(object: T) -> Loaded<T> {
    Loaded {
        object,
        source: None,
    }
}

/// The kube client for `--kubeconfig PATH`, or the default (in-cluster, then the usual
/// kubeconfig lookup).
pub async fn client_for(kubeconfig: Option<&std::path::Path>) -> Result<Client, String> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("--kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| format!("--kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| format!("no cluster configuration: {e}"))?,
    };
    Client::try_from(config).map_err(|e| format!("kube client: {e}"))
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

/// The `ordnet agent` command line, as parsed.
#[derive(Debug, Clone)]
pub struct CommandLine {
    pub node: String,
    pub kubeconfig: Option<std::path::PathBuf>,
    /// `--datapath bpf` (otherwise `none`).
    pub bpf: bool,
    pub uplink: Option<String>,
    pub debug_addr: String,
}

/// Runs `ordnet agent` until SIGTERM/SIGINT (exit 0) or a fatal error (exit 1); usage errors
/// exit 2.
pub fn run_command(cmd: CommandLine) -> std::process::ExitCode {
    use std::process::ExitCode;
    if cmd.uplink.is_some() && !cmd.bpf {
        eprintln!("ordnet agent: --uplink only applies to --datapath bpf");
        return ExitCode::from(2);
    }
    if cmd.uplink.as_deref() == Some("") {
        eprintln!("ordnet agent: --uplink must not be empty");
        return ExitCode::from(2);
    }
    if cmd.node.is_empty() {
        eprintln!("ordnet agent: --node must not be empty");
        return ExitCode::from(2);
    }
    let debug_addr: SocketAddr = match cmd.debug_addr.parse() {
        Ok(a) => a,
        Err(_) => {
            eprintln!(
                "ordnet agent: --debug-addr {}: expected IP:PORT",
                cmd.debug_addr
            );
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ordnet agent: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        let client = match client_for(cmd.kubeconfig.as_deref()).await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("ordnet agent: {e}");
                return ExitCode::from(1);
            }
        };
        let config = AgentConfig {
            node: cmd.node,
            debug_addr,
            namespace: std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "kube-system".into()),
            lease_renew_every: status::RENEW_EVERY,
        };
        let (datapath, kind): (Box<dyn Datapath>, &str) = if cmd.bpf {
            let pin_dir = bpf::pin_dir_from_env();
            match bpf::BpfDatapath::open(&pin_dir, cmd.uplink.clone()) {
                Ok(dp) => {
                    match dp.opened() {
                        bpf::Opened::Created => eprintln!(
                            "ordnet agent: datapath bpf: new maps pinned in {}",
                            pin_dir.display()
                        ),
                        bpf::Opened::Adopted {
                            endpoints,
                            rulesets,
                            links,
                        } => eprintln!(
                            "ordnet agent: datapath bpf: adopted the pins in {} ({endpoints} endpoints, {rulesets} rule sets, attached to {}); enforcing them until the initial sync",
                            pin_dir.display(),
                            if links.is_empty() { "nothing".to_string() } else { links.join(", ") }
                        ),
                    }
                    (Box::new(dp), "bpf")
                }
                Err(e) => {
                    eprintln!("ordnet agent: --datapath bpf: {e}");
                    return ExitCode::from(1);
                }
            }
        } else {
            (Box::new(NoneDatapath::default()), "none")
        };
        let mut handle = match start(config, client, datapath).await {
            Ok(h) => h,
            Err(e) => {
                eprintln!("ordnet agent: --debug-addr {debug_addr}: {e}");
                return ExitCode::from(1);
            }
        };
        eprintln!(
            "ordnet agent: node {}, datapath {kind}, debug API on http://{}",
            handle.state.node,
            handle.debug_addr()
        );
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("ordnet agent: {e}");
                    return ExitCode::from(1);
                }
            };
        let stopped = |kind: &str| {
            if kind == "bpf" {
                eprintln!(
                    "ordnet agent: stopping; the pinned maps and attachments stay (enforcement continues, a restarted agent adopts them)"
                );
            }
            ExitCode::SUCCESS
        };
        tokio::select! {
            _ = term.recv() => stopped(kind),
            _ = tokio::signal::ctrl_c() => stopped(kind),
            _ = handle.wait() => {
                eprintln!("ordnet agent: a task ended unexpectedly");
                ExitCode::from(1)
            }
        }
    })
}
