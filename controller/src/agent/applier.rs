//! The apply loop: the view of every object the agent was told about, the initial sync gate,
//! burst coalescing, and incremental application to the engine and the datapath.
//!
//! The view keeps only each object's resourceVersion, what the engine does with it and, for the
//! policies whose status the agent writes, a mark of their spec (a status write's echo changes
//! nothing); the object itself waits in `pending` until it is applied and is then moved into
//! the engine, which keeps what it reads of it (so the cluster is never held twice).
//!
//! The CNI plugin's requests come through the same loop (`WatchMsg::Cni`): a pod the runtime
//! just gave addresses becomes an endpoint with those addresses (its latest version as watched,
//! `ReadPod::with_runtime_ips`) until the API server reports them, and the answer goes back
//! once the batch that made it so is programmed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Instant;

use ordnet_crds::validate;
use ordnet_crds::{ClusterObjects, Loaded};
use ordnet_engine::{BuildOptions, Engine, EngineDelta, Object, ObjectChange, ObjectKind, ReadPod};
use tokio::sync::{mpsc, watch};

use super::cni::{CniOp, CniReply};
use super::watchers::WatchMsg;
use super::{
    AgentState, COALESCE_MAX_EVENTS, COALESCE_MAX_WAIT, COALESCE_YIELDS, Enforcement, ObjKey,
    ObjectProblem, status,
};

fn object_key(o: &Object) -> ObjKey {
    let (ns, name) = o.key();
    (o.kind(), ns, name)
}

/// One object the agent was told about (the object itself is in the engine, or pending).
#[derive(Debug, Clone)]
struct ViewEntry {
    resource_version: Option<String>,
    /// What the engine does with it (everything but [`Enforcement::None`] is in the engine
    /// once synced).
    enforcement: Enforcement,
    /// [`spec_mark`] of the version seen.
    spec: Option<NonZeroU64>,
}

/// For the kinds whose status the agent writes, a mark of everything the engine reads of an
/// object but its name: its uid, labels and `metadata.generation`, which moves with every change
/// of the spec and never with the status (`None` for other kinds). Two versions with the same
/// mark differ only in their status or in metadata the engine does not read: a status write's
/// echo.
fn spec_mark(o: &Object) -> Option<NonZeroU64> {
    use std::hash::{Hash, Hasher};
    if !matches!(
        o,
        Object::OrderedNetworkPolicy(_)
            | Object::ClusterOrderedNetworkPolicy(_)
            | Object::ClusterNetworkPolicy(_)
    ) {
        return None;
    }
    let meta = o.meta();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (meta.generation?, &meta.uid, &meta.labels).hash(&mut h);
    NonZeroU64::new(h.finish() | 1)
}

impl ViewEntry {
    fn usable(&self) -> bool {
        self.enforcement != Enforcement::None
    }
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
        // Read (and validated) when it arrived.
        Object::ReadPod(x) => return x.errors().to_vec(),
        Object::NetworkPolicy(x) => validate::validate_network_policy(x),
        Object::OrderedNetworkPolicy(x) => validate::validate_ordered_network_policy(x),
        Object::ClusterOrderedNetworkPolicy(x) => {
            validate::validate_cluster_ordered_network_policy(x)
        }
        Object::ClusterNetworkPolicy(x) => validate::validate_cluster_network_policy(x),
        Object::Node(x) => validate::validate_node(x),
    };
    // Warnings do not make an object invalid (the offline loader keeps it too).
    errors
        .iter()
        .filter(|e| e.severity == ordnet_crds::Severity::Error)
        .map(|e| e.to_string())
        .collect()
}

/// The apply loop's own state.
pub(crate) struct Applier {
    state: Arc<AgentState>,
    node: String,
    view: BTreeMap<ObjKey, ViewEntry>,
    /// Per kind: whether its initial list is done (ever).
    synced: [bool; ObjectKind::ALL.len()],
    /// Per kind: the re-list being collected (`Some` between `Init` and `InitDone`).
    relist: [Option<BTreeMap<ObjKey, Object>>; ObjectKind::ALL.len()],
    /// Keys touched since the last apply: their current view entry (or absence) is what the
    /// engine must get.
    dirty: BTreeSet<ObjKey>,
    /// The latest object of every dirty key that is in the view (moved into the engine when
    /// applied).
    pending: HashMap<ObjKey, Object>,
    /// Keys the engine has (valid objects applied).
    in_engine: BTreeSet<ObjKey>,
    /// The wanted status of every ordered policy (for the status writer).
    wanted: watch::Sender<BTreeMap<ObjKey, status::WantedStatus>>,
    /// Problems to publish as Events.
    events: mpsc::UnboundedSender<status::AgentEvent>,
    /// Change number: one more for every view change (see `AgentState::applied`) but a status
    /// write's echo.
    seq: u64,
    /// One more for every version recorded, echoes too ([`status::WantedStatus::stamp`]).
    stamp: u64,
    /// The latest version of every pod scheduled to this node (not terminated): what a CNI ADD
    /// gives addresses to.
    local_pods: BTreeMap<ObjKey, ReadPod>,
    /// Addresses the container runtime gave a local pod (CNI ADD: container id, addresses)
    /// that the API server does not report yet.
    runtime_ips: BTreeMap<ObjKey, (String, Vec<IpAddr>)>,
    /// CNI requests to answer once the current batch is programmed.
    cni_waiting: Vec<(CniOp, tokio::sync::oneshot::Sender<CniReply>)>,
    /// The staged policies the engine has left out (usable ones, latest version): what the
    /// staged view (`AgentState::staged`) adds to the engine.
    staged: BTreeMap<ObjKey, Object>,
}

impl Applier {
    pub(crate) fn new(
        state: Arc<AgentState>,
        node: String,
        wanted: watch::Sender<BTreeMap<ObjKey, status::WantedStatus>>,
        events: mpsc::UnboundedSender<status::AgentEvent>,
    ) -> Applier {
        Applier {
            state,
            node,
            view: BTreeMap::new(),
            synced: [false; ObjectKind::ALL.len()],
            relist: Default::default(),
            dirty: BTreeSet::new(),
            pending: HashMap::new(),
            in_engine: BTreeSet::new(),
            wanted,
            events,
            seq: 0,
            stamp: 0,
            local_pods: BTreeMap::new(),
            runtime_ips: BTreeMap::new(),
            cni_waiting: Vec::new(),
            staged: BTreeMap::new(),
        }
    }

    pub(crate) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<WatchMsg>) {
        while let Some(first) = rx.recv().await {
            let observed = Instant::now();
            let seq = self.seq;
            self.handle(first);
            if !self.state.ready() {
                // Initial sync: take everything queued, build once every list is done.
                while let Ok(msg) = rx.try_recv() {
                    self.handle(msg);
                }
                if self.synced.iter().all(|s| *s) {
                    self.initial_program();
                    self.state.mark_applied(self.seq);
                }
                self.answer_cni();
                continue;
            }
            self.coalesce(&mut rx, observed).await;
            self.apply_dirty(observed);
            if self.seq != seq {
                // (Not for a batch of status echoes: no change, and no end of a quiet moment.)
                self.state.mark_applied(self.seq);
            }
            self.answer_cni();
        }
    }

    /// Burst coalescing: after the first event of a batch (observed at `observed`), takes the
    /// events that are queued, giving the watchers [`COALESCE_YIELDS`] turns of the scheduler
    /// to deliver what they are decoding (a burst read from the API server at once arrives so),
    /// and closes the batch when nothing more came — but never past [`COALESCE_MAX_WAIT`]
    /// after the first event nor beyond [`COALESCE_MAX_EVENTS`] events, so a steady stream
    /// cannot hold programming back. The batch is then applied as one datapath update; what
    /// arrives meanwhile is queued and forms the next batch, so batches grow with the load
    /// while an isolated change is applied at once (a fixed quiet window of 2 ms, 2-3 ms with
    /// the timer's granularity, was most of the latency of a cheap change: 5.9 ms at 10k pods
    /// / 5k policies for a remote relabel whose engine and datapath take 1 ms). Its latency is
    /// measured from `observed`.
    async fn coalesce(&mut self, rx: &mut mpsc::UnboundedReceiver<WatchMsg>, observed: Instant) {
        let deadline = observed + COALESCE_MAX_WAIT;
        take_burst(rx, deadline, COALESCE_MAX_EVENTS - 1, |msg| {
            self.handle(msg)
        })
        .await;
    }

    /// Takes one message; whether it keeps the batch open (all do but a status write's echo:
    /// [`Applier::upsert`], [`take_burst`]).
    fn handle(&mut self, msg: WatchMsg) -> bool {
        match msg {
            WatchMsg::Init(kind) => {
                // A new list (the first, a re-list, or a list tried again after a failure: any
                // partial one is dropped here).
                self.relist[kind.index()] = Some(BTreeMap::new());
                true
            }
            WatchMsg::InitApply(o) => {
                let key = object_key(&o);
                match self.relist[key.0.index()].as_mut() {
                    Some(buf) => {
                        buf.insert(key, o);
                        true
                    }
                    // Not expected (the watcher always sends Init first); treat as an update.
                    None => self.upsert(key, o),
                }
            }
            WatchMsg::InitDone(kind) => {
                let k = kind.index();
                let listed = self.relist[k].take().unwrap_or_default();
                let gone: Vec<ObjKey> = self
                    .view
                    .keys()
                    .filter(|key| key.0 == kind && !listed.contains_key(*key))
                    .cloned()
                    .collect();
                for key in gone {
                    self.remove(key);
                }
                for (key, o) in listed {
                    self.upsert(key, o);
                }
                self.synced[k] = true;
                true
            }
            WatchMsg::Apply(o) => {
                let key = object_key(&o);
                self.upsert(key, o)
            }
            WatchMsg::Delete(o) => {
                let key = object_key(&o);
                self.remove(key);
                true
            }
            WatchMsg::Cni(op, reply) => {
                self.cni(op, reply);
                true
            }
        }
    }

    /// Records a version of an object; whether it can change what is enforced (not for a version
    /// the view has, nor for one that changed only the status: [`spec_mark`]). Such an echo of a
    /// status write is not a change for the engine, the shadowed-rule analysis or the Events:
    /// only the view and the wanted status (the status as now stored) follow it.
    fn upsert(&mut self, key: ObjKey, object: Object) -> bool {
        let rv = object.meta().resource_version.clone();
        let old = self.view.get(&key);
        if rv.is_some() && old.is_some_and(|o| o.resource_version == rv) {
            return false;
        }
        let spec = spec_mark(&object);
        let status_only = spec.is_some() && old.is_some_and(|o| o.spec == spec);
        let object = self.with_runtime_ips(&key, object);
        if !status_only {
            self.seq += 1;
        }
        self.stamp += 1;
        let (problems, enforcement) = assess(&object);
        if status_only {
            self.record_status_only(key, object, rv, enforcement, &problems);
            return false;
        }
        self.record_problems(&key, &rv, &problems, &enforcement);
        if !problems.is_empty() || enforcement != Enforcement::Full {
            let _ = self.events.send(status::AgentEvent::Problem(Box::new(
                status::ProblemEvent {
                    object: object.clone(),
                    errors: problems.clone(),
                    enforcement: enforcement.clone(),
                },
            )));
        }
        if let Some(w) = status::wanted(&object, &problems, &enforcement, self.seq, self.stamp) {
            self.wanted.send_modify(|m| {
                m.insert(key.clone(), w);
            });
        }
        self.view.insert(
            key.clone(),
            ViewEntry {
                resource_version: rv,
                enforcement,
                spec,
            },
        );
        self.pending.insert(key.clone(), object);
        self.dirty.insert(key);
        true
    }

    /// A status write's echo ([`Applier::upsert`]): the view's resource version, the problem's,
    /// and the wanted status with the stored status (its change number kept); the engine gets
    /// it only with a change of the same object still pending.
    fn record_status_only(
        &mut self,
        key: ObjKey,
        object: Object,
        rv: Option<String>,
        enforcement: Enforcement,
        problems: &[String],
    ) {
        if let Some(p) = self
            .state
            .problems
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&key)
        {
            p.resource_version = rv.clone();
        }
        if let Some(mut w) = status::wanted(&object, problems, &enforcement, self.seq, self.stamp) {
            self.wanted.send_modify(|m| {
                if let Some(old) = m.get(&key) {
                    w.seq = old.seq;
                }
                m.insert(key.clone(), w);
            });
        }
        if let Some(v) = self.view.get_mut(&key) {
            v.resource_version = rv;
        }
        if self.dirty.contains(&key) {
            self.pending.insert(key, object);
        }
    }

    /// The object's problems as `/v1/problems` and the metrics show them, logged.
    fn record_problems(
        &mut self,
        key: &ObjKey,
        rv: &Option<String>,
        problems: &[String],
        enforcement: &Enforcement,
    ) {
        let failed: Vec<String> = match enforcement {
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
                p.remove(key);
            } else {
                let name = format!(
                    "{} {}{}",
                    key.0.name(),
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
                        tracing::warn!(
                            object = %name,
                            problems = %problems.join("; "),
                            "not enforcing an object the engine cannot use"
                        );
                    }
                    Enforcement::Partial(_) => tracing::warn!(
                        object = %name,
                        rules = %failed.join("; "),
                        "enforcing with rules failing closed"
                    ),
                    Enforcement::Full => tracing::info!(
                        object = %name,
                        problems = %problems.join("; "),
                        "enforcing as written despite validation problems"
                    ),
                }
                p.insert(
                    key.clone(),
                    ObjectProblem {
                        kind: key.0.name(),
                        namespace: (!key.1.is_empty()).then(|| key.1.clone()),
                        name: key.2.clone(),
                        resource_version: rv.clone(),
                        enforced: enforcement.as_str(),
                        errors: problems.to_vec(),
                        failed_closed_rules: failed,
                    },
                );
            }
        }
    }

    /// A pod of this node: remembered (its latest version) for CNI ADDs, and given the
    /// addresses the runtime gave it while the API server reports none or others.
    fn with_runtime_ips(&mut self, key: &ObjKey, object: Object) -> Object {
        let Object::ReadPod(pod) = &object else {
            return object;
        };
        let local = pod
            .placement()
            .is_some_and(|(_, node, _, terminal)| node == Some(self.node.as_str()) && !terminal);
        if !local {
            self.local_pods.remove(key);
            self.runtime_ips.remove(key);
            return object;
        }
        self.local_pods.insert(key.clone(), (**pod).clone());
        let reported: &[IpAddr] = pod.placement().map_or(&[], |p| p.2);
        match self.runtime_ips.get(key) {
            Some((_, ips)) if ips.as_slice() == reported => {
                // The API server caught up.
                self.runtime_ips.remove(key);
                object
            }
            Some((_, ips)) => Object::ReadPod(Box::new(pod.with_runtime_ips(ips))),
            None => object,
        }
    }

    /// Applies `object` even if its resource version is the one the view has (a CNI ADD or
    /// DEL changes what the agent makes of the same version).
    fn force_upsert(&mut self, key: ObjKey, object: Object) {
        if let Some(v) = self.view.get_mut(&key) {
            v.resource_version = None;
        }
        self.upsert(key, object);
    }

    /// A CNI request: ADD gives the pod the runtime's addresses, DEL takes them back; every
    /// request is answered after the batch it is part of is programmed.
    fn cni(&mut self, op: CniOp, reply: tokio::sync::oneshot::Sender<CniReply>) {
        if let Some(key) = op.pod_key() {
            let endpoint = format!("{}/{}", key.1, key.2);
            match &op {
                CniOp::Add(a) => self
                    .state
                    .datapath()
                    .cni_interfaces(&endpoint, Some(&a.host_interfaces)),
                CniOp::Del(_) => self.state.datapath().cni_interfaces(&endpoint, None),
                CniOp::Check(_) => {}
            }
            match &op {
                // A pod not seen yet: the answer says so and the CNI server asks again.
                CniOp::Add(a) => {
                    if let Some(pod) = self.local_pods.get(&key).cloned() {
                        let reported: &[IpAddr] = pod.placement().map_or(&[], |p| p.2);
                        let known = self
                            .runtime_ips
                            .get(&key)
                            .is_some_and(|(_, ips)| ips == &a.ips);
                        if reported != a.ips.as_slice() && !known {
                            self.runtime_ips
                                .insert(key.clone(), (a.container_id.clone(), a.ips.clone()));
                            self.force_upsert(key, Object::ReadPod(Box::new(pod)));
                        }
                    }
                }
                CniOp::Del(a) => {
                    let ours = self
                        .runtime_ips
                        .get(&key)
                        .is_some_and(|(id, _)| id == &a.container_id);
                    if ours {
                        self.runtime_ips.remove(&key);
                        if let Some(pod) = self.local_pods.get(&key).cloned() {
                            self.force_upsert(key, Object::ReadPod(Box::new(pod)));
                        }
                    }
                }
                CniOp::Check(_) => {}
            }
        }
        self.cni_waiting.push((op, reply));
    }

    /// Answers the CNI requests of the batch just programmed (before the initial sync: "not
    /// yet", and the CNI server asks again).
    fn answer_cni(&mut self) {
        for (op, reply) in std::mem::take(&mut self.cni_waiting) {
            let answer = match (&op, op.pod_key()) {
                (CniOp::Del(_), _) => CniReply::Done("forgotten".into()),
                (CniOp::Add(a) | CniOp::Check(a), None) => CniReply::NotYet(format!(
                    "{}: the runtime did not say which pod it is (K8S_POD_NAMESPACE, K8S_POD_NAME)",
                    a.who()
                )),
                (CniOp::Add(a) | CniOp::Check(a), Some(key)) => self
                    .state
                    .with_programmed(|engine, dp| {
                        let Some(ep) = engine.endpoint(&key.1, &key.2) else {
                            return CniReply::NotYet(if self.local_pods.contains_key(&key) {
                                format!("{} is no endpoint", a.who())
                            } else {
                                format!(
                                    "the agent has not seen {} scheduled to node {} yet",
                                    a.who(),
                                    self.node
                                )
                            });
                        };
                        let missing: Vec<String> = a
                            .ips
                            .iter()
                            .filter(|ip| !ep.ips.contains(ip))
                            .map(|ip| ip.to_string())
                            .collect();
                        if !missing.is_empty() {
                            return CniReply::NotYet(format!(
                                "{} does not have {} yet",
                                a.who(),
                                missing.join(", ")
                            ));
                        }
                        match dp.endpoint_ready(&ep.id()) {
                            Ok(()) => CniReply::Done(format!(
                                "{} is enforced on {}",
                                a.who(),
                                a.host_interfaces.join(", ")
                            )),
                            Err(why) => CniReply::NotYet(why),
                        }
                    })
                    .unwrap_or_else(|| {
                        CniReply::NotYet("the agent's initial sync is not done".into())
                    }),
            };
            let _ = reply.send(answer);
        }
    }

    fn remove(&mut self, key: ObjKey) {
        self.local_pods.remove(&key);
        self.runtime_ips.remove(&key);
        if self.view.remove(&key).is_some() {
            self.seq += 1;
            self.pending.remove(&key);
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
            ..BuildOptions::default()
        }
    }

    /// The usable objects of the view, as the offline loader would give them, moved out of
    /// `pending` (which is empty afterwards).
    fn take_cluster_objects(&mut self) -> (ClusterObjects, Vec<ReadPod>) {
        let mut objects = ClusterObjects::default();
        let mut read_pods = Vec::new();
        for (key, object) in std::mem::take(&mut self.pending) {
            if !self.view.get(&key).is_some_and(|e| e.usable()) {
                continue;
            }
            match object {
                Object::Namespace(o) => objects.namespaces.push(loaded(o)),
                Object::Pod(o) => objects.pods.push(loaded(*o)),
                Object::ReadPod(o) => read_pods.push(*o),
                Object::NetworkPolicy(o) => objects.network_policies.push(loaded(o)),
                Object::OrderedNetworkPolicy(o) => objects.ordered_policies.push(loaded(o)),
                Object::ClusterOrderedNetworkPolicy(o) => {
                    objects.cluster_ordered_policies.push(loaded(o))
                }
                Object::ClusterNetworkPolicy(o) => {
                    objects.cluster_network_policies.push(loaded(*o))
                }
                Object::Node(o) => objects.nodes.push(loaded(*o)),
                Object::Service(o) => objects.services.push(loaded(*o)),
            }
        }
        (objects, read_pods)
    }

    fn initial_program(&mut self) {
        let started = Instant::now();
        let (objects, read_pods) = self.take_cluster_objects();
        let staged = objects
            .ordered_policies
            .iter()
            .filter(|p| !p.object.spec.mode.is_enforce())
            .map(|p| Object::OrderedNetworkPolicy(p.object.clone()))
            .chain(
                objects
                    .cluster_ordered_policies
                    .iter()
                    .filter(|p| !p.object.spec.mode.is_enforce())
                    .map(|p| Object::ClusterOrderedNetworkPolicy(p.object.clone())),
            );
        self.staged = staged.map(|o| (object_key(&o), o)).collect();
        let engine = Engine::build_with_read_pods(&objects, read_pods, &self.options());
        drop(objects);
        self.state
            .metrics
            .compile_seconds
            .observe(started.elapsed().as_secs_f64());
        for e in engine.errors() {
            self.state.metrics.engine_errors.inc();
            tracing::warn!(error = %e, "left out of the engine");
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
            tracing::error!(error = %e, "programming the datapath failed");
        }
        self.state.after_programming(&engine, dp.as_ref());
        let view = (!self.staged.is_empty()).then(|| engine.staged_view());
        self.state.install_engine(&mut slot, engine);
        drop((slot, dp));
        if let Some(view) = view {
            self.publish_staged_view(view);
        }
        self.state
            .metrics
            .apply_seconds
            .observe(started.elapsed().as_secs_f64());
        super::heap::release_after_initial_sync();
    }

    /// Adds the staged policies to `view` (a staged copy of the engine, made under its lock)
    /// and makes it the staged view.
    fn publish_staged_view(&self, mut view: Engine) {
        for o in self.staged.values() {
            view.apply(ObjectChange::Upsert(o.clone()));
        }
        self.state
            .set_staged_view(Some((view, self.staged.keys().cloned().collect())));
    }

    fn apply_dirty(&mut self, observed: Instant) {
        if self.dirty.is_empty() {
            return;
        }
        let dirty = std::mem::take(&mut self.dirty);
        let mut upserts = Vec::new();
        let mut deletes = Vec::new();
        for key in dirty {
            let object = self.pending.remove(&key);
            match (self.view.get(&key), object) {
                (Some(e), Some(object)) if e.usable() => {
                    self.in_engine.insert(key);
                    upserts.push(ObjectChange::Upsert(object));
                }
                _ => {
                    if self.in_engine.remove(&key) {
                        let kind = key.0;
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
        let had_staged = !self.staged.is_empty();
        for c in upserts.iter().chain(&deletes) {
            match c {
                ObjectChange::Upsert(o) if o.staged() => {
                    self.staged.insert(object_key(o), o.clone());
                }
                ObjectChange::Upsert(o) => {
                    self.staged.remove(&object_key(o));
                }
                ObjectChange::Delete {
                    kind,
                    namespace,
                    name,
                } => {
                    self.staged.remove(&(
                        *kind,
                        namespace.clone().unwrap_or_default(),
                        name.clone(),
                    ));
                }
            }
        }
        // The staged view follows the same changes (made before they are consumed).
        let for_view = (had_staged && !self.staged.is_empty())
            .then(|| upserts.iter().chain(&deletes).cloned().collect::<Vec<_>>());
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
                tracing::warn!(error = %e, "change not applied");
            }
        }
        self.state
            .metrics
            .compile_seconds
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = dp.apply(engine, &deltas) {
            // The recorded state no longer follows the engine: program everything again.
            self.state.metrics.datapath_errors.inc();
            tracing::error!(error = %e, "applying to the datapath failed; reprogramming");
            if let Err(e) = dp.program_full(engine) {
                tracing::error!(error = %e, "programming the datapath failed");
            }
        }
        self.state.after_programming(engine, dp.as_ref());
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
        self.state.count_batch();
        // The staged view: the same changes, or a copy of the engine plus the staged policies
        // when the first one appears; none when the last one goes.
        let fresh = (!had_staged && !self.staged.is_empty()).then(|| engine.staged_view());
        drop((slot, dp));
        if let Some(changes) = for_view {
            self.state
                .update_staged_view(changes, self.staged.keys().cloned().collect());
        } else if let Some(view) = fresh {
            self.publish_staged_view(view);
        } else if self.staged.is_empty() && had_staged {
            self.state.set_staged_view(None);
        }
    }
}

fn loaded<T>(object: T) -> Loaded<T> {
    Loaded {
        object,
        source: None,
    }
}

/// The rest of a burst (see `Applier::coalesce`): takes what `rx` holds, giving the senders
/// [`COALESCE_YIELDS`] turns of the scheduler whenever it is empty, and stops when they sent
/// nothing in them, at `deadline`, after `max` messages, or when every sender is gone. `take`
/// says whether a message keeps the batch open: one that does not (a status write's echo,
/// which changes nothing) is taken without giving the senders new turns, so a stream of them
/// cannot hold a change back.
async fn take_burst<T>(
    rx: &mut mpsc::UnboundedReceiver<T>,
    deadline: Instant,
    max: usize,
    mut take: impl FnMut(T) -> bool,
) {
    let mut taken = 0;
    // The turns given since the last message that keeps the batch open.
    let mut turns = 0;
    while taken < max && Instant::now() < deadline {
        let mut next = rx.try_recv();
        while matches!(next, Err(mpsc::error::TryRecvError::Empty)) && turns < COALESCE_YIELDS {
            tokio::task::yield_now().await;
            next = rx.try_recv();
            turns += 1;
        }
        let Ok(msg) = next else {
            return;
        };
        if take(msg) {
            turns = 0;
        }
        taken += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(3600)
    }

    /// A channel holding `0..n`.
    fn queued(n: u32) -> (mpsc::UnboundedSender<u32>, mpsc::UnboundedReceiver<u32>) {
        let (tx, rx) = mpsc::unbounded_channel();
        for i in 0..n {
            tx.send(i).unwrap();
        }
        (tx, rx)
    }

    /// What is queued is one batch; an empty queue closes it without waiting for the next
    /// message (the senders stay alive: a wait would never end).
    #[tokio::test(flavor = "current_thread")]
    async fn takes_what_is_queued_and_does_not_wait() {
        let (tx, mut rx) = queued(5);
        let mut got = Vec::new();
        take_burst(&mut rx, far(), 100, |m| {
            got.push(m);
            true
        })
        .await;
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        let mut more = Vec::new();
        // A hang guard, not a measure: a batch that waited for the next message never ends.
        tokio::time::timeout(
            std::time::Duration::from_secs(60),
            take_burst(&mut rx, far(), 100, |m| {
                more.push(m);
                true
            }),
        )
        .await
        .expect("an empty queue closes the batch");
        assert!(more.is_empty());
        tx.send(9).unwrap();
        assert_eq!(
            rx.try_recv().ok(),
            Some(9),
            "nothing taken beyond the batch"
        );
    }

    /// A sender that delivers within its turns (a watcher decoding the rest of a burst) joins
    /// the batch; one that needs more turns than that starts the next batch.
    #[tokio::test(flavor = "current_thread")]
    async fn the_senders_get_their_turns() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let late = tx.clone();
        tokio::spawn(async move {
            for i in 0..3 {
                tx.send(i).unwrap();
                tokio::task::yield_now().await;
            }
        });
        tokio::spawn(async move {
            for _ in 0..(COALESCE_YIELDS * 2 + 8) {
                tokio::task::yield_now().await;
            }
            late.send(100).unwrap();
        });
        let mut got = Vec::new();
        take_burst(&mut rx, far(), 100, |m| {
            got.push(m);
            true
        })
        .await;
        assert_eq!(got, vec![0, 1, 2]);
        assert_eq!(rx.recv().await, Some(100));
    }

    /// The limits: a batch stops at `max` messages and at its deadline.
    #[tokio::test(flavor = "current_thread")]
    async fn stops_at_the_limits() {
        let (_tx, mut rx) = queued(10);
        let mut got = Vec::new();
        take_burst(&mut rx, far(), 4, |m| {
            got.push(m);
            true
        })
        .await;
        assert_eq!(got, vec![0, 1, 2, 3]);
        got.clear();
        take_burst(&mut rx, Instant::now(), 100, |m| {
            got.push(m);
            true
        })
        .await;
        assert!(got.is_empty(), "past the deadline nothing more is taken");
        assert_eq!(rx.try_recv().ok(), Some(4));
    }

    /// Messages that do not keep the batch open (status echoes, odd here) give the senders no
    /// new turns: a sender streaming them, one a turn, does not hold the batch until its limits,
    /// while the same stream of messages that do keep it open would.
    #[tokio::test(flavor = "current_thread")]
    async fn echoes_do_not_hold_a_batch_open() {
        async fn batch(echo: u32) -> Vec<u32> {
            let (tx, mut rx) = mpsc::unbounded_channel();
            tx.send(0).unwrap();
            let stream = tokio::spawn(async move {
                for i in 1..1000u32 {
                    tokio::task::yield_now().await;
                    if tx.send(i * 2 + echo).is_err() {
                        return;
                    }
                }
            });
            let mut got = Vec::new();
            take_burst(&mut rx, far(), 500, |m| {
                got.push(m);
                m % 2 == 0
            })
            .await;
            stream.abort();
            got
        }
        let echoes = batch(1).await;
        assert!(
            echoes.len() <= COALESCE_YIELDS + 1,
            "a stream of echoes ended the batch after the turns: {echoes:?}"
        );
        assert_eq!(
            batch(0).await.len(),
            500,
            "a stream of changes reaches the limit"
        );
    }
}
