//! The watchers: one list-then-watch loop per kind the engine consumes, each turning what it
//! hears into [`WatchMsg`]s on one channel, and keeping its kind's [`KindHealth`].
//!
//! Why not `kube::runtime::watcher`: it hides bookmarks and its connection state, and the agent
//! has to say how old its view of each kind is (metrics, `/readyz`); its default backoff also
//! grows to 30 s, so the agent could stay out of step for that long after the API server came
//! back. The loop here is the same protocol (paged list, watch from the list's resource version
//! with bookmarks, resume from the last version heard, re-list only on 410 Gone) with:
//!
//! * a bounded reconnect backoff with jitter ([`WatchConfig::backoff_min`] doubling up to
//!   [`WatchConfig::backoff_max`], plus up to as much again at random), reset whenever a
//!   request succeeds, so a kind is back in step within about `2 × backoff_max` of the API
//!   server answering again;
//! * a server-side watch timeout ([`WatchConfig::timeout`]; the watch is resumed at once when
//!   it ends) and a client-side one: a watch that heard nothing, no event and no bookmark, for
//!   `timeout + idle_grace` is taken for dead (a half-open connection, a stalled proxy) and
//!   resumed from its resource version on a new connection;
//! * a timeout on every request's answer ([`WatchConfig::request_timeout`]);
//! * staleness per kind: when it fell out of step, the last error, the last time it heard
//!   anything, and counts of reconnects, silent watches and re-lists.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use backon::BackoffBuilder;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::{Api, Client, Resource, ResourceExt};
use ordnet_crds::{ClusterNetworkPolicy, ClusterOrderedNetworkPolicy, OrderedNetworkPolicy};
use ordnet_engine::{Object, ObjectKind};
use serde::de::DeserializeOwned;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// One watch event, typed.
#[derive(Debug)]
pub(crate) enum WatchMsg {
    /// A (re-)list starts: what follows up to `InitDone` is the whole current set.
    Init(ObjectKind),
    InitApply(Object),
    InitDone(ObjectKind),
    Apply(Object),
    Delete(Object),
    /// Not from a watch: a request of the CNI plugin, answered once programmed.
    Cni(
        super::cni::CniOp,
        tokio::sync::oneshot::Sender<super::cni::CniReply>,
    ),
}

/// How the watchers talk to the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchConfig {
    /// The server-side watch timeout (`timeoutSeconds`, whole seconds, at least 1): a watch
    /// that ends at it is resumed at once from its resource version.
    pub timeout: Duration,
    /// A watch that heard nothing (no event, no bookmark) for `timeout + idle_grace` is taken
    /// for dead and resumed on a new connection.
    pub idle_grace: Duration,
    /// The first delay before a failed request is tried again; it doubles...
    pub backoff_min: Duration,
    /// ...up to this, and each delay gets a random jitter of up to as much again.
    pub backoff_max: Duration,
    /// The longest wait for the answer to one request (a list page, the start of a watch).
    pub request_timeout: Duration,
    /// Objects per list page.
    pub page_size: u32,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            timeout: Duration::from_secs(60),
            idle_grace: Duration::from_secs(5),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_millis(500),
            request_timeout: Duration::from_secs(30),
            page_size: 500,
        }
    }
}

impl WatchConfig {
    fn timeout_secs(&self) -> u32 {
        u32::try_from(self.timeout.as_secs())
            .unwrap_or(u32::MAX)
            .max(1)
    }

    /// How long a watch may stay silent before it is taken for dead.
    pub fn idle_limit(&self) -> Duration {
        Duration::from_secs(u64::from(self.timeout_secs())) + self.idle_grace
    }

    fn backoff(&self) -> backon::ExponentialBackoff {
        backon::ExponentialBuilder::default()
            .with_min_delay(self.backoff_min)
            .with_max_delay(self.backoff_max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
    }
}

/// One kind's watch, as the agent knows it.
#[derive(Debug, Clone, Default)]
pub struct KindHealth {
    /// Whether the first list is done.
    pub listed: bool,
    /// Since when the view of this kind may be behind the API server (a failed request, a
    /// watch taken for dead, a re-list under way); `None` while in step.
    pub stale_since: Option<Instant>,
    /// The last error, for as long as the kind is stale.
    pub last_error: Option<String>,
    /// When the watcher last heard from the API server for this kind (a list page, an event,
    /// a bookmark, the normal end of a watch).
    pub last_heard: Option<Instant>,
    /// Failed requests (lists, watch starts, broken or dead watches).
    pub errors: u64,
    /// Watches started again after a failure.
    pub reconnects: u64,
    /// Watches taken for dead after hearing nothing for the idle limit.
    pub silent: u64,
    /// Lists after the first (410 Gone).
    pub relists: u64,
    /// The API server does not serve the kind (an optional CRD, the upstream
    /// ClusterNetworkPolicy, is not installed): the view holds none, and the kind is looked for
    /// again every [`ABSENT_POLL`].
    pub absent: bool,
}

impl KindHealth {
    /// For how long the kind has been stale (`None`: in step).
    pub fn stale_for(&self, now: Instant) -> Option<Duration> {
        self.stale_since.map(|s| now.saturating_duration_since(s))
    }
}

/// Every kind's [`KindHealth`], shared by the watchers, the debug API and the tests.
#[derive(Debug, Default)]
pub struct WatchHealth {
    kinds: [Mutex<KindHealth>; ObjectKind::ALL.len()],
}

impl WatchHealth {
    /// A copy of `kind`'s health.
    pub fn kind(&self, kind: ObjectKind) -> KindHealth {
        self.slot(kind).clone()
    }

    /// Every kind's health, in [`ObjectKind::ALL`] order.
    pub fn all(&self) -> Vec<(ObjectKind, KindHealth)> {
        ObjectKind::ALL
            .iter()
            .map(|k| (*k, self.kind(*k)))
            .collect()
    }

    /// The stale kinds: (kind, for how long, the last error).
    pub fn stale(&self, now: Instant) -> Vec<(ObjectKind, Duration, Option<String>)> {
        self.all()
            .into_iter()
            .filter_map(|(k, h)| Some((k, h.stale_for(now)?, h.last_error)))
            .collect()
    }

    fn slot(&self, kind: ObjectKind) -> std::sync::MutexGuard<'_, KindHealth> {
        self.kinds[kind.index()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn heard(&self, kind: ObjectKind) {
        self.slot(kind).last_heard = Some(Instant::now());
    }

    /// The kind is in step again (a watch is open from a version it had heard, or right after
    /// a complete list).
    fn in_step(&self, kind: ObjectKind) {
        let mut h = self.slot(kind);
        let now = Instant::now();
        if let Some(since) = h.stale_since.take() {
            tracing::info!(
                kind = kind.name(),
                stale_seconds = now.duration_since(since).as_secs_f64(),
                "watch back in step"
            );
        }
        h.last_error = None;
        h.last_heard = Some(now);
    }

    /// A request failed: the kind is stale from now on (or from `since`, when it is known to
    /// have heard nothing since then).
    fn failed(&self, kind: ObjectKind, what: &str, error: &str, since: Option<Instant>) {
        let mut h = self.slot(kind);
        h.errors += 1;
        let first = h.stale_since.is_none();
        if first {
            h.stale_since = Some(since.unwrap_or_else(Instant::now));
        }
        if first || h.last_error.as_deref() != Some(error) {
            tracing::warn!(kind = kind.name(), error, "{what} failed; retrying");
        }
        h.last_error = Some(error.to_string());
    }
}

/// One watcher per kind of [`ObjectKind::ALL`].
pub(crate) fn spawn_all(
    client: &Client,
    config: &WatchConfig,
    health: &Arc<WatchHealth>,
    tx: &mpsc::UnboundedSender<WatchMsg>,
) -> Vec<JoinHandle<()>> {
    ObjectKind::ALL
        .into_iter()
        .map(|kind| {
            let w = Watcher {
                kind,
                config: config.clone(),
                health: health.clone(),
                tx: tx.clone(),
            };
            let c = client.clone();
            match kind {
                ObjectKind::Namespace => w.spawn::<Namespace>(c, Object::Namespace),
                ObjectKind::Pod => w.spawn::<Pod>(c, |p| Object::Pod(Box::new(p))),
                ObjectKind::Service => w.spawn::<Service>(c, |s| Object::Service(Box::new(s))),
                ObjectKind::NetworkPolicy => w.spawn::<NetworkPolicy>(c, Object::NetworkPolicy),
                ObjectKind::OrderedNetworkPolicy => {
                    w.spawn::<OrderedNetworkPolicy>(c, Object::OrderedNetworkPolicy)
                }
                ObjectKind::ClusterOrderedNetworkPolicy => {
                    w.spawn::<ClusterOrderedNetworkPolicy>(c, Object::ClusterOrderedNetworkPolicy)
                }
                ObjectKind::ClusterNetworkPolicy => w.spawn::<ClusterNetworkPolicy>(c, |p| {
                    Object::ClusterNetworkPolicy(Box::new(p))
                }),
                ObjectKind::Node => w.spawn::<Node>(c, |n| Object::Node(Box::new(n))),
            }
        })
        .collect()
}

/// The receiving side went away (the agent stops).
struct Closed;

/// How often a kind the API server does not serve (an optional CRD not installed) is looked for
/// again.
pub(crate) const ABSENT_POLL: Duration = Duration::from_secs(10);

/// Whether the API server serves ClusterNetworkPolicy as `v1alpha2` (an older bundle, another
/// schema) although not as `v1beta1`.
async fn only_v1alpha2_served(client: Client, config: &WatchConfig) -> bool {
    let ar = kube::core::ApiResource {
        group: ordnet_crds::CNP_GROUP.into(),
        version: "v1alpha2".into(),
        api_version: format!("{}/v1alpha2", ordnet_crds::CNP_GROUP),
        kind: ordnet_crds::KIND_CLUSTER_NETWORK_POLICY.into(),
        plural: "clusternetworkpolicies".into(),
    };
    let api: Api<kube::core::DynamicObject> = Api::all_with(client, &ar);
    matches!(
        tokio::time::timeout(
            config.request_timeout,
            api.list(&ListParams::default().limit(1))
        )
        .await,
        Ok(Ok(_))
    )
}

/// Why a list failed.
enum ListError {
    /// The API server does not serve the kind (404 for an optional kind).
    Absent(String),
    /// Anything else: retried after the backoff.
    Failed(String),
}

/// How a watch ended.
enum WatchEnd {
    /// Normally (its timeout): resume at once.
    Ended,
    /// Broken, failed to start, or taken for dead: resume after a backoff.
    Failed,
    /// 410 Gone: list again.
    Gone,
}

struct Watcher {
    kind: ObjectKind,
    config: WatchConfig,
    health: Arc<WatchHealth>,
    tx: mpsc::UnboundedSender<WatchMsg>,
}

impl Watcher {
    fn spawn<K>(self, client: Client, wrap: fn(K) -> Object) -> JoinHandle<()>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        tokio::spawn(async move {
            let api: Api<K> = Api::all(client);
            let _ = self.run(&api, wrap).await;
        })
    }

    fn send(&self, msg: WatchMsg) -> Result<(), Closed> {
        self.tx.send(msg).map_err(|_| Closed)
    }

    /// List, then watch from the list's version for as long as the version stays valid; list
    /// again on 410 Gone. Failed requests are retried after the backoff.
    async fn run<K>(&self, api: &Api<K>, wrap: fn(K) -> Object) -> Result<(), Closed>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        let mut backoff = self.config.backoff();
        let mut first = true;
        loop {
            let mut version = match self.list(api, wrap).await? {
                Ok(version) => version,
                Err(ListError::Absent(e)) => {
                    // The upstream ClusterNetworkPolicy CRD is not installed: there are no such
                    // objects (an empty, complete list), and the kind is looked for again.
                    self.send(WatchMsg::Init(self.kind))?;
                    self.send(WatchMsg::InitDone(self.kind))?;
                    let newly = !self.health.slot(self.kind).absent;
                    // An older network-policy-api bundle serves only v1alpha2, with another
                    // schema: its objects cannot be read, so say so loudly (not enforced).
                    let older = if newly && self.kind == ObjectKind::ClusterNetworkPolicy {
                        only_v1alpha2_served(api.clone().into_client(), &self.config).await
                    } else {
                        false
                    };
                    {
                        let mut h = self.health.slot(self.kind);
                        if older {
                            let e = "ClusterNetworkPolicy is served only as v1alpha2, by a \
                                     network-policy-api CRD older than v0.2.0 whose schema ordnet \
                                     does not read: those policies are NOT enforced; install \
                                     network-policy-api v0.2.0 or later (or `ordnet crd --upstream`)";
                            tracing::error!(kind = self.kind.name(), "{e}");
                            h.last_error = Some(e.to_string());
                            h.stale_since.get_or_insert_with(Instant::now);
                        } else if newly {
                            tracing::info!(
                                kind = self.kind.name(),
                                error = e,
                                "the API server does not serve this kind (its CRD is not installed); \
                                 looking again every {} s",
                                ABSENT_POLL.as_secs()
                            );
                        }
                        if !older && newly {
                            h.stale_since = None;
                        }
                        h.absent = true;
                        h.listed = true;
                    }
                    first = false;
                    tokio::time::sleep(ABSENT_POLL).await;
                    continue;
                }
                Err(ListError::Failed(e)) => {
                    self.health.failed(self.kind, "list", &e, None);
                    self.pause(&mut backoff).await;
                    continue;
                }
            };
            self.health.slot(self.kind).absent = false;
            backoff = self.config.backoff();
            {
                let mut h = self.health.slot(self.kind);
                if !first {
                    h.relists += 1;
                }
                h.listed = true;
            }
            first = false;
            // In step once the first watch from the list's version is open.
            loop {
                match self.watch(api, wrap, &mut version).await? {
                    WatchEnd::Ended => backoff = self.config.backoff(),
                    WatchEnd::Failed => {
                        self.pause(&mut backoff).await;
                        self.health.slot(self.kind).reconnects += 1;
                    }
                    WatchEnd::Gone => break,
                }
            }
        }
    }

    async fn pause(&self, backoff: &mut backon::ExponentialBackoff) {
        let delay = backoff.next().unwrap_or(self.config.backoff_max);
        tokio::time::sleep(delay).await;
    }

    /// One complete paged list, sent as `Init`, `InitApply`s, `InitDone`; the list's resource
    /// version, or why it failed (the applier drops a partial list at the next `Init`). The
    /// next page is requested as soon as a page arrives, so the API server builds (and the
    /// client decodes) page N+1 while the objects of page N are slimmed and sent.
    async fn list<K>(
        &self,
        api: &Api<K>,
        wrap: fn(K) -> Object,
    ) -> Result<Result<String, ListError>, Closed>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        self.send(WatchMsg::Init(self.kind))?;
        let fetch = |token: Option<String>| {
            let api = api.clone();
            let mut params = ListParams::default().limit(self.config.page_size);
            if let Some(t) = token {
                params = params.continue_token(&t);
            }
            let limit = self.config.request_timeout;
            tokio::spawn(async move { tokio::time::timeout(limit, api.list(&params)).await })
        };
        /// Aborts the page still being fetched when the list ends early.
        struct Pending<T>(JoinHandle<T>);
        impl<T> Drop for Pending<T> {
            fn drop(&mut self) {
                self.0.abort();
            }
        }
        let mut pending = Pending(fetch(None));
        loop {
            let page = match (&mut pending.0).await {
                Err(e) => {
                    return Ok(Err(ListError::Failed(format!(
                        "the list request failed: {e}"
                    ))));
                }
                Ok(Err(_)) => return Ok(Err(ListError::Failed(self.timed_out()))),
                Ok(Ok(Err(kube::Error::Api(s)))) if s.code == 404 && self.kind.optional() => {
                    return Ok(Err(ListError::Absent(s.message)));
                }
                Ok(Ok(Err(e))) => return Ok(Err(ListError::Failed(e.to_string()))),
                Ok(Ok(Ok(page))) => page,
            };
            self.health.heard(self.kind);
            let next = page.metadata.continue_.clone().filter(|c| !c.is_empty());
            if let Some(token) = &next {
                pending = Pending(fetch(Some(token.clone())));
            }
            for o in page.items {
                // Slimmed at once: what waits in the channel and in the applier until the
                // engine has it is only what the engine reads.
                self.send(WatchMsg::InitApply(wrap(o).slimmed()))?;
            }
            if next.is_none() {
                self.send(WatchMsg::InitDone(self.kind))?;
                return Ok(Ok(page.metadata.resource_version.unwrap_or_default()));
            }
        }
    }

    fn timed_out(&self) -> String {
        format!(
            "no answer within {} s",
            self.config.request_timeout.as_secs_f64()
        )
    }

    /// One watch from `version`, advancing it with every event and bookmark.
    async fn watch<K>(
        &self,
        api: &Api<K>,
        wrap: fn(K) -> Object,
        version: &mut String,
    ) -> Result<WatchEnd, Closed>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        let params = WatchParams::default().timeout(self.config.timeout_secs());
        let stream =
            match tokio::time::timeout(self.config.request_timeout, api.watch(&params, version))
                .await
            {
                Err(_) => {
                    self.health
                        .failed(self.kind, "watch", &self.timed_out(), None);
                    return Ok(WatchEnd::Failed);
                }
                Ok(Err(kube::Error::Api(s))) if s.code == 410 => return Ok(self.gone(&s.message)),
                Ok(Err(e)) => {
                    self.health.failed(self.kind, "watch", &e.to_string(), None);
                    return Ok(WatchEnd::Failed);
                }
                Ok(Ok(stream)) => stream,
            };
        self.health.in_step(self.kind);
        self.follow(stream, wrap, version).await
    }

    async fn follow<K>(
        &self,
        stream: impl Stream<Item = kube::Result<WatchEvent<K>>>,
        wrap: fn(K) -> Object,
        version: &mut String,
    ) -> Result<WatchEnd, Closed>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        let idle = self.config.idle_limit();
        let mut stream = std::pin::pin!(stream);
        loop {
            let event = match tokio::time::timeout(idle, stream.next()).await {
                Err(_) => {
                    let since = self.health.kind(self.kind).last_heard;
                    self.health.slot(self.kind).silent += 1;
                    let e = format!(
                        "the watch heard nothing (no event, no bookmark) for {} s",
                        idle.as_secs_f64()
                    );
                    self.health.failed(self.kind, "watch", &e, since);
                    return Ok(WatchEnd::Failed);
                }
                Ok(None) => {
                    self.health.heard(self.kind);
                    return Ok(WatchEnd::Ended);
                }
                Ok(Some(Err(e))) => {
                    self.health.failed(self.kind, "watch", &e.to_string(), None);
                    return Ok(WatchEnd::Failed);
                }
                Ok(Some(Ok(event))) => event,
            };
            self.health.heard(self.kind);
            let (msg, rv) = match event {
                WatchEvent::Added(o) | WatchEvent::Modified(o) => {
                    let rv = o.resource_version();
                    (Some(WatchMsg::Apply(wrap(o).slimmed())), rv)
                }
                WatchEvent::Deleted(o) => {
                    let rv = o.resource_version();
                    (Some(WatchMsg::Delete(wrap(o).slimmed())), rv)
                }
                WatchEvent::Bookmark(b) => (None, Some(b.metadata.resource_version)),
                WatchEvent::Error(s) if s.code == 410 => return Ok(self.gone(&s.message)),
                WatchEvent::Error(s) => {
                    let e = format!("{} ({}): {}", s.code, s.reason, s.message);
                    self.health.failed(self.kind, "watch", &e, None);
                    return Ok(WatchEnd::Failed);
                }
            };
            if let Some(rv) = rv.filter(|v| !v.is_empty()) {
                *version = rv;
            }
            if let Some(msg) = msg {
                self.send(msg)?;
            }
        }
    }

    /// 410 Gone: the version is too old; the kind is stale until the next list is done.
    fn gone(&self, message: &str) -> WatchEnd {
        let mut h = self.health.slot(self.kind);
        if h.stale_since.is_none() {
            h.stale_since = Some(Instant::now());
        }
        h.last_error = Some(format!("410 Gone: {message}; listing again"));
        tracing::warn!(
            kind = self.kind.name(),
            error = message,
            "watch: resource version gone (410); listing again"
        );
        WatchEnd::Gone
    }
}
