//! An in-process fake Kubernetes API server that speaks real list/watch over HTTP, so the real
//! kube client (and `kube::runtime::watcher`) runs unmodified against it.
//!
//! What it implements (JSON only, HTTP/1.1 on `127.0.0.1` or the address given to
//! [`FakeApi::start_on`]):
//! * the resources of [`RESOURCES`]: v1 namespaces, pods, services, nodes, events;
//!   networking.k8s.io/v1 networkpolicies; ordnet.io/v1alpha1 orderednetworkpolicies and
//!   clusterorderednetworkpolicies; policy.networking.k8s.io/v1beta1 clusternetworkpolicies; coordination.k8s.io/v1 leases; events.k8s.io/v1 events —
//!   namespaced (`/namespaces/NS/…`, or across all namespaces) and cluster-scoped paths;
//! * list (`GET` on a collection; `metadata.resourceVersion` in the ListMeta; paged with
//!   `limit` and `continue`, every page as of the first page's resource version, rebuilt from the
//!   change log; a token older than the last compaction gets 410 Gone), get, create (`POST`, `generateName` too), replace (`PUT`, with a
//!   `metadata.resourceVersion` precondition → 409 Conflict), delete, and `PATCH` with
//!   `application/apply-patch+yaml` (server-side apply, simplified: the applied object is
//!   merged like a JSON merge patch, lists replaced; no managedFields), `application/merge-patch+json`
//!   and `application/strategic-merge-patch+json` (treated as a merge patch);
//! * the `/status` subresource for kinds that have one: writes through `/status` change only
//!   `status`, writes to the main resource never change `status`; `metadata.generation` starts
//!   at 1 and bumps when `spec` changes;
//! * watch (`?watch=1&resourceVersion=N`): newline-delimited JSON events `ADDED`, `MODIFIED`,
//!   `DELETED` after N (N = 0 or absent: the current objects as `ADDED` first), `BOOKMARK`s
//!   (when `allowWatchBookmarks=true`: periodically and on [`FakeApi::bookmark`]),
//!   `sendInitialEvents=true` (initial `ADDED`s then the `k8s.io/initial-events-end` bookmark),
//!   `timeoutSeconds`; an `ERROR` event with a 410 Gone Status when N is older than the
//!   compaction point ([`FakeApi::compact`]).
//!
//! Label and field selectors are not implemented: a request with one gets 400 Bad Request
//! naming the parameter (so a client relying on them fails loudly instead of seeing too much).
//!
//! What a real API server does and this one does not, and where each is covered instead:
//! * it never sees a CustomResourceDefinition, so it checks none of what a real server checks when
//!   a CRD is created: the CEL cost budget, the structural schema, list types, defaults, the
//!   `api-approved.kubernetes.io` annotation, the status subresource, printer columns —
//!   `crds/tests/api_server.rs` checks each of them on the CRDs we ship;
//! * it stores objects without admitting them: no OpenAPI schema, no CEL rule, no pruning or
//!   defaulting of custom resources, no built-in validation of Pods, Services or NetworkPolicies
//!   (the agent's tests can store what a real server would refuse, which exercises its own
//!   validation and fail-closed path) — `crds/tests/schema.rs` emulates the admission of our
//!   kinds, and `ordnet_crds::validate` repeats every check;
//! * no authentication or authorization: RBAC is checked by comparing every request the agent
//!   makes in its tests with `deploy/rbac.yaml` (`controller/tests/agent.rs`);
//! * server-side apply is a merge without field managers, and there is no `ownerReferences`
//!   garbage collection, no namespace lifecycle (objects in a deleted namespace stay), no
//!   `generateName` retries and no admission webhooks.
//!
//! These were checked by hand against a real kube-apiserver v1.36.2 (deploy/ installed, the
//! agent run under its RBAC, the scenario and invalid corpora admitted or refused as
//! `ordnet validate` says): docs/api.md, "Validation".
//!
//! Test hooks: [`FakeApi::create`], [`FakeApi::upsert`], [`FakeApi::update`],
//! [`FakeApi::delete`], [`FakeApi::get`], [`FakeApi::list`], [`FakeApi::compact`],
//! [`FakeApi::drop_watches`], [`FakeApi::restart`], [`FakeApi::bookmark`],
//! [`FakeApi::events`], [`FakeApi::requests`]. The hooks are synchronous (a `std` mutex guards
//! the store), so a test calls them from anywhere.
//!
//! Faults, for the agent's fault tests: [`FakeApi::stop`] kills the server (the port refuses
//! connections, every open connection is closed without a word) and [`FakeApi::start_again`]
//! brings it back on the same port with the same objects and resource versions (history kept,
//! or compacted so that every watch gets 410 Gone); [`Faults`] (set with
//! [`FakeApi::set_faults`]) makes every answer slow, watches silent (accepted, then nothing:
//! no event, no bookmark, no end) and the next lists fail with 410 Gone.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// One resource the fake server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceDef {
    /// API group, `""` for the core group.
    pub group: &'static str,
    /// API version, without the group (`v1`, `v1alpha1`).
    pub version: &'static str,
    /// The plural, as in the URL.
    pub plural: &'static str,
    /// The object kind (`Pod`, `NetworkPolicy`, ...).
    pub kind: &'static str,
    /// Whether the objects live in namespaces (else cluster-scoped).
    pub namespaced: bool,
    /// Whether it has a `/status` subresource.
    pub status: bool,
}

impl ResourceDef {
    /// `group/version`, or `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// Every resource served.
pub const RESOURCES: &[ResourceDef] = &[
    ResourceDef {
        group: "",
        version: "v1",
        plural: "namespaces",
        kind: "Namespace",
        namespaced: false,
        status: true,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "pods",
        kind: "Pod",
        namespaced: true,
        status: true,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "services",
        kind: "Service",
        namespaced: true,
        status: true,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "configmaps",
        kind: "ConfigMap",
        namespaced: true,
        status: false,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "events",
        kind: "Event",
        namespaced: true,
        status: false,
    },
    ResourceDef {
        group: "networking.k8s.io",
        version: "v1",
        plural: "networkpolicies",
        kind: "NetworkPolicy",
        namespaced: true,
        status: false,
    },
    ResourceDef {
        group: "ordnet.io",
        version: "v1alpha1",
        plural: "orderednetworkpolicies",
        kind: "OrderedNetworkPolicy",
        namespaced: true,
        status: true,
    },
    ResourceDef {
        group: "ordnet.io",
        version: "v1alpha1",
        plural: "clusterorderednetworkpolicies",
        kind: "ClusterOrderedNetworkPolicy",
        namespaced: false,
        status: true,
    },
    ResourceDef {
        group: "",
        version: "v1",
        plural: "nodes",
        kind: "Node",
        namespaced: false,
        status: true,
    },
    ResourceDef {
        group: "policy.networking.k8s.io",
        version: "v1beta1",
        plural: "clusternetworkpolicies",
        kind: "ClusterNetworkPolicy",
        namespaced: false,
        status: true,
    },
    ResourceDef {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        kind: "Lease",
        namespaced: true,
        status: false,
    },
    ResourceDef {
        group: "events.k8s.io",
        version: "v1",
        plural: "events",
        kind: "Event",
        namespaced: true,
        status: false,
    },
];

fn resource_index(group: &str, version: &str, plural: &str) -> Option<usize> {
    RESOURCES
        .iter()
        .position(|r| r.group == group && r.version == version && r.plural == plural)
}

fn resource_of_object(obj: &Value) -> Result<usize, String> {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    let kind = obj["kind"].as_str().unwrap_or_default();
    RESOURCES
        .iter()
        .position(|r| r.api_version() == api_version && r.kind == kind)
        .ok_or_else(|| format!("fake API server: no resource for {api_version} {kind}"))
}

/// A running fake API server. Dropping it stops the server.
pub struct FakeApi {
    inner: Arc<Inner>,
    addr: SocketAddr,
    /// The accept loop; `None` while stopped ([`FakeApi::stop`]).
    server: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Faults the server plays until they are set otherwise ([`FakeApi::set_faults`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    /// Every request is answered this late (a slow or overloaded server).
    pub delay: Duration,
    /// Watches started from now on are accepted (200, headers sent) and then never send
    /// anything: no event, no bookmark, no end at their timeout (a half-open connection, a
    /// stalled proxy). They end only with [`FakeApi::stop`] or the client going away.
    pub silent_watches: bool,
    /// The next this many paged list requests (with `limit`: the watchers' lists; any
    /// resource, any page) are answered 410 Gone. A plain list is never (a server reads it from
    /// the current state).
    pub failing_lists: usize,
    /// Resources (plurals) answered 404 Not Found, as when their CRD is not installed.
    pub absent: Vec<&'static str>,
}

/// What [`FakeApi::start_again`] keeps of the watch history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum History {
    /// Everything: a watch resumed from any resource version seen before gets the events after
    /// it (an API server restart with etcd's history intact).
    Kept,
    /// Nothing: every watch resumed from a resource version seen before gets 410 Gone and the
    /// client has to list again (etcd compacted while the server was away).
    Compacted,
}

/// An API error as the server answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status code.
    pub code: u16,
    /// The Status `reason` (`NotFound`, `Conflict`, ...).
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

impl FakeApi {
    /// Starts a server on a free port of 127.0.0.1.
    pub async fn start() -> std::io::Result<FakeApi> {
        FakeApi::start_on("127.0.0.1:0".parse().expect("address")).await
    }

    /// Starts a server on `addr` (e.g. an address another network namespace reaches; port 0:
    /// any free port). [`FakeApi::url`] and the kubeconfig name the address bound.
    pub async fn start_on(addr: SocketAddr) -> std::io::Result<FakeApi> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (signal, _) = watch::channel((0, 0, 0));
        let (generation, _) = watch::channel(0);
        let inner = Arc::new(Inner {
            state: Mutex::new(State::default()),
            signal,
            bookmark_interval: Mutex::new(Duration::from_secs(1)),
            faults: Mutex::new(Faults::default()),
            generation,
        });
        let server = serve(listener, inner.clone());
        Ok(FakeApi {
            inner,
            addr,
            server: Mutex::new(Some(server)),
        })
    }

    /// Kills the server: the port refuses connections from now on, and every open connection
    /// (watches included) is closed at once, with no answer and no end of stream (as when the
    /// process is killed). The objects and resource versions stay for [`FakeApi::start_again`].
    pub fn stop(&self) {
        // The generation first: the accept loop ends at its next turn and closes whatever it
        // accepts until then.
        self.inner.generation.send_modify(|g| *g += 1);
        if let Some(server) = self.server.lock().unwrap_or_else(|e| e.into_inner()).take() {
            server.abort();
        }
        self.inner.signal.send_modify(|s| s.1 += 1);
    }

    /// Serves again on the same address after [`FakeApi::stop`], with the same objects and
    /// resource versions; `history` says whether resumed watches get the events they missed or
    /// 410 Gone. (A no-op stop first when the server is running.)
    pub async fn start_again(&self, history: History) -> std::io::Result<()> {
        self.stop();
        if history == History::Compacted {
            self.compact();
        }
        // The stopped accept loop lets go of the port at its next turn.
        let mut tries = 0;
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 100 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => return Err(e),
            }
        };
        *self.server.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(serve(listener, self.inner.clone()));
        Ok(())
    }

    /// Plays `faults` from now on ([`Faults::default`]: none).
    pub fn set_faults(&self, faults: Faults) {
        *self.inner.faults() = faults;
    }

    /// The faults being played (`failing_lists` counts down as lists fail).
    pub fn faults(&self) -> Faults {
        self.inner.faults().clone()
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDRESS:PORT` (`127.0.0.1` unless started with [`FakeApi::start_on`]).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client configuration pointing at this server (namespace `default`).
    pub fn kube_config(&self) -> kube::Config {
        let mut config = kube::Config::new(self.url().parse().expect("url"));
        config.default_namespace = "default".to_string();
        config.read_timeout = None;
        config
    }

    /// A kube client for this server.
    pub fn client(&self) -> kube::Client {
        kube::Client::try_from(self.kube_config()).expect("kube client")
    }

    /// A kubeconfig file's text (cluster `fake`, user `fake`, context `fake`).
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\n",
            self.url()
        )
    }

    /// How often open watches that asked for bookmarks get one (default 1 s).
    pub fn set_bookmark_interval(&self, every: Duration) {
        *self
            .inner
            .bookmark_interval
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = every;
    }

    /// The current resource version.
    pub fn resource_version(&self) -> u64 {
        self.inner.lock().rv
    }

    /// Creates an object (its `apiVersion`/`kind` choose the resource). Returns the stored object.
    pub fn create(&self, obj: Value) -> Result<Value, ApiError> {
        let resource = resource_of_object(&obj).map_err(|m| err(400, "BadRequest", m))?;
        let ns = meta_str(&obj, "namespace").unwrap_or_default().to_string();
        let mut st = self.inner.lock();
        let out = st.create(resource, &ns, obj)?;
        let rv = st.rv;
        drop(st);
        self.inner.notify(rv);
        Ok(out)
    }

    /// Replaces an object, ignoring resource versions (`status` is replaced too, when given).
    pub fn update(&self, mut obj: Value) -> Result<Value, ApiError> {
        let resource = resource_of_object(&obj).map_err(|m| err(400, "BadRequest", m))?;
        let key = self.key_of(resource, &obj);
        if let Some(m) = obj["metadata"].as_object_mut() {
            m.remove("resourceVersion");
        }
        let mut st = self.inner.lock();
        let mut out = st.store_update(&key, obj.clone(), Part::Main)?;
        if RESOURCES[resource].status && obj.get("status").is_some() {
            out = st.store_update(&key, obj, Part::Status)?;
        }
        let rv = st.rv;
        drop(st);
        self.inner.notify(rv);
        Ok(out)
    }

    /// Creates or replaces an object.
    pub fn upsert(&self, obj: Value) -> Result<Value, ApiError> {
        let resource = resource_of_object(&obj).map_err(|m| err(400, "BadRequest", m))?;
        let key = self.key_of(resource, &obj);
        let exists = self.inner.lock().objects.contains_key(&key);
        if exists {
            self.update(obj)
        } else {
            self.create(obj)
        }
    }

    /// Creates a `coordination.k8s.io/v1` Lease `namespace/name` held by `holder` for an hour
    /// from now (benchmarks: another agent holds the status writer's Lease, so no status writes
    /// mix into what they time).
    pub fn hold_lease(&self, namespace: &str, name: &str, holder: &str) -> Result<Value, ApiError> {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        self.create(
            json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"namespace": namespace, "name": name},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 3600,
                     "acquireTime": now, "renewTime": now}}),
        )
    }

    /// Deletes an object; `namespace` is ignored for cluster-scoped kinds.
    pub fn delete(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        let probe = json!({"apiVersion": api_version, "kind": kind,
            "metadata": {"namespace": namespace, "name": name}});
        let resource = resource_of_object(&probe).map_err(|m| err(400, "BadRequest", m))?;
        let key = self.key_of(resource, &probe);
        let mut st = self.inner.lock();
        let out = st.delete(&key)?;
        let rv = st.rv;
        drop(st);
        self.inner.notify(rv);
        Ok(out)
    }

    /// The stored object, if any.
    pub fn get(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let probe = json!({"apiVersion": api_version, "kind": kind,
            "metadata": {"namespace": namespace, "name": name}});
        let resource = resource_of_object(&probe).ok()?;
        let key = self.key_of(resource, &probe);
        self.inner.lock().objects.get(&key).cloned()
    }

    /// Every stored object of a kind (all namespaces).
    pub fn list(&self, api_version: &str, kind: &str) -> Vec<Value> {
        let probe = json!({"apiVersion": api_version, "kind": kind});
        match resource_of_object(&probe) {
            Ok(r) => self.inner.lock().list(r, None),
            Err(_) => Vec::new(),
        }
    }

    /// Every event stored (core v1 and events.k8s.io/v1), in creation order of their keys.
    pub fn events(&self) -> Vec<Value> {
        let mut out = self.list("events.k8s.io/v1", "Event");
        out.extend(self.list("v1", "Event"));
        out
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.inner.lock().requests.clone()
    }

    /// Compacts the history: every resource version known so far becomes too old, so a watch
    /// (re)started from any of them gets 410 Gone (and a client has to re-list). Open watches
    /// that had sent everything are not affected (combine with [`FakeApi::drop_watches`]).
    pub fn compact(&self) {
        let mut st = self.inner.lock();
        let rv = st.next_rv();
        st.compacted = rv;
        st.log.clear();
    }

    /// Closes every open watch connection (the clients see the stream end).
    pub fn drop_watches(&self) {
        self.inner.signal.send_modify(|s| s.1 += 1);
    }

    /// Sends a bookmark on every open watch that asked for bookmarks.
    pub fn bookmark(&self) {
        self.inner.signal.send_modify(|s| s.2 += 1);
    }

    /// An API server restart: the watch history is lost (compaction) and every watch closes,
    /// in one step as far as the watches can tell (both under the state's lock, which a watch
    /// holds while it checks that it is still open and reads the log): no watch sends anything
    /// past the compaction point (an event or a bookmark a client could resume from without
    /// 410 Gone) before it ends.
    pub fn restart(&self) {
        let mut st = self.inner.lock();
        let rv = st.next_rv();
        st.compacted = rv;
        st.log.clear();
        self.inner.signal.send_modify(|s| s.1 += 1);
    }

    fn key_of(&self, resource: usize, obj: &Value) -> Key {
        let ns = if RESOURCES[resource].namespaced {
            meta_str(obj, "namespace")
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_string()
        } else {
            String::new()
        };
        (
            resource,
            ns,
            meta_str(obj, "name").unwrap_or_default().to_string(),
        )
    }
}

/// The accept loop: one task per connection, each closed when the server's generation moves
/// ([`FakeApi::stop`]). A connection accepted after the move (the loop ends at its next turn) is
/// closed at once, so no client reaches a stopped server.
fn serve(listener: TcpListener, inner: Arc<Inner>) -> JoinHandle<()> {
    let mut stopped = inner.generation.subscribe();
    let generation = *stopped.borrow_and_update();
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(_) => continue,
                },
                _ = stopped.changed() => return,
            };
            // As the real API server (Go sets TCP_NODELAY on every connection): with Nagle's
            // algorithm on, a watch event written while the client has not yet acknowledged
            // the one before waits for the client's delayed ACK (up to 40 ms on Linux). The
            // scale benchmark measured it: a quarter of its local relabels, written ~25 ms
            // after the previous pod event, reached the agent 5-19 ms late.
            let _ = stream.set_nodelay(true);
            let inner = inner.clone();
            let mut moved = inner.generation.subscribe();
            if *moved.borrow_and_update() != generation {
                return;
            }
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let inner = inner.clone();
                    async move { Ok::<_, Infallible>(handle(inner, req).await) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc);
                // Dropping the connection closes the socket mid-whatever.
                tokio::select! {
                    _ = conn => {}
                    _ = moved.changed() => {}
                }
            });
        }
    })
}

mod http;
mod store;
mod watches;

use http::*;
pub use store::RequestRecord;
use store::*;
use watches::*;

#[cfg(test)]
mod tests;
