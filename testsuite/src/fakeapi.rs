//! An in-process fake Kubernetes API server that speaks real list/watch over HTTP, so the real
//! kube client (and `kube::runtime::watcher`) runs unmodified against it.
//!
//! What it implements (JSON only, HTTP/1.1 on `127.0.0.1` or the address given to
//! [`FakeApi::start_on`]):
//! * the resources of [`RESOURCES`]: v1 namespaces, pods, events; networking.k8s.io/v1
//!   networkpolicies; ordnet.io/v1alpha1 orderednetworkpolicies and
//!   clusterorderednetworkpolicies; coordination.k8s.io/v1 leases; events.k8s.io/v1 events —
//!   namespaced (`/namespaces/NS/…`, or across all namespaces) and cluster-scoped paths;
//! * list (`GET` on a collection; `metadata.resourceVersion` in the ListMeta, no paging: the
//!   whole list in one page), get, create (`POST`, `generateName` too), replace (`PUT`, with a
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
//! Test hooks: [`FakeApi::create`], [`FakeApi::upsert`], [`FakeApi::update`],
//! [`FakeApi::delete`], [`FakeApi::get`], [`FakeApi::list`], [`FakeApi::compact`],
//! [`FakeApi::drop_watches`], [`FakeApi::restart`], [`FakeApi::bookmark`],
//! [`FakeApi::events`], [`FakeApi::requests`]. The hooks are synchronous (a `std` mutex guards
//! the store), so a test calls them from anywhere.

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
    pub version: &'static str,
    /// The plural, as in the URL.
    pub plural: &'static str,
    pub kind: &'static str,
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

/// The store key: (resource index, namespace or "" for cluster-scoped, name).
type Key = (usize, String, String);

/// One entry of the watch history.
#[derive(Debug, Clone)]
struct LogEntry {
    rv: u64,
    resource: usize,
    namespace: String,
    kind: &'static str,
    object: Value,
}

/// One recorded request (method, path and query, content type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub method: String,
    pub uri: String,
    pub content_type: Option<String>,
}

#[derive(Default)]
struct State {
    rv: u64,
    uid: u64,
    objects: BTreeMap<Key, Value>,
    log: Vec<LogEntry>,
    /// Watches from a resource version older than this get 410 Gone.
    compacted: u64,
    requests: Vec<RequestRecord>,
}

struct Inner {
    state: Mutex<State>,
    /// (last resource version, watch epoch, bookmark epoch): every change, every
    /// `drop_watches` and every `bookmark` moves it.
    signal: watch::Sender<(u64, u64, u64)>,
    bookmark_interval: Mutex<Duration>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self, rv: u64) {
        self.signal.send_modify(|s| s.0 = rv);
    }
}

/// A running fake API server. Dropping it stops the server.
pub struct FakeApi {
    inner: Arc<Inner>,
    addr: SocketAddr,
    server: JoinHandle<()>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.server.abort();
        self.inner.signal.send_modify(|s| s.1 += 1);
    }
}

/// An API error as the server answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

fn err(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        code,
        reason,
        message: message.into(),
    }
}

fn status_json(e: &ApiError) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": e.message,
        "reason": e.reason,
        "code": e.code,
    })
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            let t = target.as_object_mut().expect("object");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj["metadata"][field].as_str()
}

/// Like the API server: every Namespace carries `kubernetes.io/metadata.name: <name>`.
fn name_label(def: ResourceDef, obj: &mut Value) {
    if def.group.is_empty() && def.plural == "namespaces" {
        let name = obj["metadata"]["name"].clone();
        if !obj["metadata"]["labels"].is_object() {
            obj["metadata"]["labels"] = json!({});
        }
        obj["metadata"]["labels"]["kubernetes.io/metadata.name"] = name;
    }
}

/// How a write treats `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// The main resource: `status` is kept as stored (when the kind has a status subresource).
    Main,
    /// The `/status` subresource: only `status` changes.
    Status,
}

impl State {
    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, resource: usize, namespace: &str, kind: &'static str, object: &Value) {
        let rv = self.rv;
        self.log.push(LogEntry {
            rv,
            resource,
            namespace: namespace.to_string(),
            kind,
            object: object.clone(),
        });
    }

    fn create(
        &mut self,
        resource: usize,
        namespace: &str,
        mut obj: Value,
    ) -> Result<Value, ApiError> {
        let def = RESOURCES[resource];
        if !obj.is_object() {
            return Err(err(400, "BadRequest", "the body is not a JSON object"));
        }
        let mut name = meta_str(&obj, "name").unwrap_or_default().to_string();
        if name.is_empty() {
            match meta_str(&obj, "generateName") {
                Some(prefix) => {
                    self.uid += 1;
                    name = format!("{prefix}{:05x}", self.uid);
                }
                None => return Err(err(422, "Invalid", "metadata.name: Required value")),
            }
        }
        let ns = if def.namespaced {
            let given = meta_str(&obj, "namespace").unwrap_or(namespace);
            if !namespace.is_empty() && given != namespace {
                return Err(err(
                    400,
                    "BadRequest",
                    "the namespace of the object does not match the namespace of the request",
                ));
            }
            if given.is_empty() {
                "default".to_string()
            } else {
                given.to_string()
            }
        } else {
            String::new()
        };
        let key = (resource, ns.clone(), name.clone());
        if self.objects.contains_key(&key) {
            return Err(err(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", def.plural),
            ));
        }
        let rv = self.next_rv();
        self.uid += 1;
        let uid = format!("00000000-0000-4000-8000-{:012x}", self.uid);
        obj["apiVersion"] = json!(def.api_version());
        obj["kind"] = json!(def.kind);
        let meta = obj["metadata"]
            .as_object_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        let mut meta = Value::Object(meta);
        meta["name"] = json!(name);
        if def.namespaced {
            meta["namespace"] = json!(ns);
        } else if let Some(m) = meta.as_object_mut() {
            m.remove("namespace");
        }
        meta["uid"] = json!(uid);
        meta["resourceVersion"] = json!(rv.to_string());
        meta["generation"] = json!(1);
        meta["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        obj["metadata"] = meta;
        name_label(def, &mut obj);
        self.objects.insert(key, obj.clone());
        self.record(resource, &ns, "ADDED", &obj);
        Ok(obj)
    }

    /// Replaces (or, through `patch`, rewrites) a stored object with `new` (the full object).
    fn store_update(&mut self, key: &Key, new: Value, part: Part) -> Result<Value, ApiError> {
        let def = RESOURCES[key.0];
        let old = self.objects.get(key).cloned().ok_or_else(|| {
            err(
                404,
                "NotFound",
                format!("{} \"{}\" not found", def.plural, key.2),
            )
        })?;
        if let Some(want) = meta_str(&new, "resourceVersion")
            && want != meta_str(&old, "resourceVersion").unwrap_or_default()
        {
            return Err(err(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} \"{}\": the object has been modified; \
                     please apply your changes to the latest version and try again",
                    def.plural, key.2
                ),
            ));
        }
        let mut obj = match part {
            Part::Status => {
                let mut o = old.clone();
                match new.get("status") {
                    Some(s) if !s.is_null() => o["status"] = s.clone(),
                    _ => {
                        if let Some(m) = o.as_object_mut() {
                            m.remove("status");
                        }
                    }
                }
                o
            }
            Part::Main => {
                let mut o = new;
                if def.status {
                    match old.get("status") {
                        Some(s) => o["status"] = s.clone(),
                        None => {
                            if let Some(m) = o.as_object_mut() {
                                m.remove("status");
                            }
                        }
                    }
                }
                o
            }
        };
        // Identity fields stay as stored.
        obj["apiVersion"] = json!(def.api_version());
        obj["kind"] = json!(def.kind);
        for field in ["name", "namespace", "uid", "creationTimestamp"] {
            match old["metadata"].get(field) {
                Some(v) => obj["metadata"][field] = v.clone(),
                None => {
                    if let Some(m) = obj["metadata"].as_object_mut() {
                        m.remove(field);
                    }
                }
            }
        }
        name_label(def, &mut obj);
        let mut generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
        if old.get("spec") != obj.get("spec") {
            generation += 1;
        }
        obj["metadata"]["generation"] = json!(generation);
        obj["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if obj == old {
            return Ok(old);
        }
        let rv = self.next_rv();
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.objects.insert(key.clone(), obj.clone());
        self.record(key.0, &key.1, "MODIFIED", &obj);
        Ok(obj)
    }

    fn delete(&mut self, key: &Key) -> Result<Value, ApiError> {
        let def = RESOURCES[key.0];
        let mut obj = self.objects.remove(key).ok_or_else(|| {
            err(
                404,
                "NotFound",
                format!("{} \"{}\" not found", def.plural, key.2),
            )
        })?;
        let rv = self.next_rv();
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.record(key.0, &key.1, "DELETED", &obj);
        Ok(obj)
    }

    fn list(&self, resource: usize, namespace: Option<&str>) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|((r, ns, _), _)| *r == resource && namespace.is_none_or(|n| n == ns))
            .map(|(_, v)| v.clone())
            .collect()
    }
}

/// A parsed request path.
#[derive(Debug)]
struct Target {
    resource: usize,
    /// `None`: all namespaces (or a cluster-scoped resource).
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

fn parse_path(path: &str) -> Result<Target, ApiError> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => {
            return Err(err(
                404,
                "NotFound",
                format!("the server could not find {path}"),
            ));
        }
    };
    let not_found = || err(404, "NotFound", format!("the server could not find {path}"));
    let (namespace, rest) = match rest {
        ["namespaces", ns, plural, tail @ ..]
            if resource_index(group, version, plural).is_some_and(|i| RESOURCES[i].namespaced) =>
        {
            (Some(ns.to_string()), {
                let mut v = vec![*plural];
                v.extend_from_slice(tail);
                v
            })
        }
        _ => (None, rest.to_vec()),
    };
    let (plural, name, sub) = match rest.as_slice() {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some(name.to_string()), None),
        [plural, name, sub] => (*plural, Some(name.to_string()), Some(*sub)),
        _ => return Err(not_found()),
    };
    let resource = resource_index(group, version, plural).ok_or_else(not_found)?;
    let status = match sub {
        None => false,
        Some("status") if RESOURCES[resource].status => true,
        Some(_) => return Err(not_found()),
    };
    if RESOURCES[resource].namespaced && name.is_some() && namespace.is_none() {
        return Err(not_found());
    }
    Ok(Target {
        resource,
        namespace,
        name,
        status,
    })
}

fn query_map(query: Option<&str>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        out.insert(percent_decode(k), percent_decode(v));
    }
    out
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = (bytes[i] == b'%' && i + 2 < bytes.len())
            .then(|| std::str::from_utf8(&bytes[i + 1..i + 3]).ok())
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (hex, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

type BoxBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn json_response(code: u16, body: &Value) -> Response<BoxBody> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .expect("response")
}

fn error_response(e: &ApiError) -> Response<BoxBody> {
    json_response(e.code, &status_json(e))
}

/// A streaming body fed by a channel (one watch).
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

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
        let inner = Arc::new(Inner {
            state: Mutex::new(State::default()),
            signal,
            bookmark_interval: Mutex::new(Duration::from_secs(1)),
        });
        let server_inner = inner.clone();
        let server = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let inner = server_inner.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let inner = inner.clone();
                        async move { Ok::<_, Infallible>(handle(inner, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(FakeApi {
            inner,
            addr,
            server,
        })
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

    /// An API server restart: the watch history is lost (compaction) and every watch closes.
    pub fn restart(&self) {
        self.compact();
        self.drop_watches();
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

async fn handle(inner: Arc<Inner>, req: Request<Incoming>) -> Response<BoxBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = query_map(req.uri().query());
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or(s).trim().to_string());
    inner.lock().requests.push(RequestRecord {
        method: method.to_string(),
        uri: req.uri().to_string(),
        content_type: content_type.clone(),
    });
    let target = match parse_path(&path) {
        Ok(t) => t,
        Err(e) => return error_response(&e),
    };
    for unsupported in ["labelSelector", "fieldSelector"] {
        if query.get(unsupported).is_some_and(|v| !v.is_empty()) {
            return error_response(&err(
                400,
                "BadRequest",
                format!("fake API server: {unsupported} is not implemented"),
            ));
        }
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error_response(&err(400, "BadRequest", e.to_string())),
    };
    let parse_body = || -> Result<Value, ApiError> {
        serde_json::from_slice::<Value>(&body)
            .or_else(|_| serde_yaml::from_slice::<Value>(&body))
            .map_err(|e| err(400, "BadRequest", format!("invalid body: {e}")))
    };
    let def = RESOURCES[target.resource];
    let ns = target.namespace.clone().unwrap_or_default();
    let result: Result<(u16, Value), ApiError> = match (&method, &target.name) {
        (&Method::GET, None) => {
            if query.get("watch").is_some_and(|w| w == "1" || w == "true") {
                return start_watch(inner, &target, &query);
            }
            let st = inner.lock();
            let items = st.list(target.resource, target.namespace.as_deref());
            Ok((
                200,
                json!({
                    "apiVersion": def.api_version(),
                    "kind": format!("{}List", def.kind),
                    "metadata": {"resourceVersion": st.rv.to_string()},
                    "items": items,
                }),
            ))
        }
        (&Method::GET, Some(name)) => {
            let st = inner.lock();
            st.objects
                .get(&(target.resource, ns.clone(), name.clone()))
                .cloned()
                .map(|o| (200, o))
                .ok_or_else(|| {
                    err(
                        404,
                        "NotFound",
                        format!("{} \"{name}\" not found", def.plural),
                    )
                })
        }
        (&Method::POST, None) => parse_body().and_then(|obj| {
            let mut st = inner.lock();
            st.create(target.resource, &ns, obj).map(|o| (201, o))
        }),
        (&Method::PUT, Some(name)) => parse_body().and_then(|obj| {
            if meta_str(&obj, "name").is_some_and(|n| n != name) {
                return Err(err(
                    400,
                    "BadRequest",
                    "the name of the object does not match the name in the URL",
                ));
            }
            let key = (target.resource, ns.clone(), name.clone());
            let part = if target.status {
                Part::Status
            } else {
                Part::Main
            };
            let mut st = inner.lock();
            st.store_update(&key, obj, part).map(|o| (200, o))
        }),
        (&Method::PATCH, Some(name)) => parse_body().and_then(|patch| {
            let key = (target.resource, ns.clone(), name.clone());
            let part = if target.status {
                Part::Status
            } else {
                Part::Main
            };
            let mut st = inner.lock();
            match content_type.as_deref() {
                Some("application/apply-patch+yaml") => {
                    if query.get("fieldManager").is_none_or(|m| m.is_empty()) {
                        return Err(err(
                            422,
                            "Invalid",
                            "fieldManager: Required value: is required for apply patch",
                        ));
                    }
                    match st.objects.get(&key).cloned() {
                        Some(mut current) => {
                            merge_patch(&mut current, &patch);
                            if let Some(m) = current["metadata"].as_object_mut() {
                                m.remove("resourceVersion");
                            }
                            st.store_update(&key, current, part).map(|o| (200, o))
                        }
                        None if target.status => Err(err(
                            404,
                            "NotFound",
                            format!("{} \"{name}\" not found", def.plural),
                        )),
                        None => {
                            let mut obj = patch;
                            obj["metadata"]["name"] = json!(name);
                            st.create(target.resource, &ns, obj).map(|o| (201, o))
                        }
                    }
                }
                Some("application/merge-patch+json")
                | Some("application/strategic-merge-patch+json") => {
                    match st.objects.get(&key).cloned() {
                        Some(mut current) => {
                            let precondition =
                                meta_str(&patch, "resourceVersion").map(str::to_string);
                            merge_patch(&mut current, &patch);
                            match precondition {
                                Some(rv) => current["metadata"]["resourceVersion"] = json!(rv),
                                None => {
                                    if let Some(m) = current["metadata"].as_object_mut() {
                                        m.remove("resourceVersion");
                                    }
                                }
                            }
                            st.store_update(&key, current, part).map(|o| (200, o))
                        }
                        None => Err(err(
                            404,
                            "NotFound",
                            format!("{} \"{name}\" not found", def.plural),
                        )),
                    }
                }
                other => Err(err(
                    415,
                    "UnsupportedMediaType",
                    format!("fake API server: patch type {other:?} is not implemented"),
                )),
            }
        }),
        (&Method::DELETE, Some(name)) => {
            let mut st = inner.lock();
            st.delete(&(target.resource, ns.clone(), name.clone()))
                .map(|o| (200, o))
        }
        _ => Err(err(
            405,
            "MethodNotAllowed",
            format!("{method} {path} is not supported"),
        )),
    };
    match result {
        Ok((code, value)) => {
            let rv = inner.lock().rv;
            inner.notify(rv);
            json_response(code, &value)
        }
        Err(e) => error_response(&e),
    }
}

fn watch_event(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn bookmark(def: &ResourceDef, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    watch_event(
        "BOOKMARK",
        &json!({"apiVersion": def.api_version(), "kind": def.kind, "metadata": meta}),
    )
}

fn start_watch(
    inner: Arc<Inner>,
    target: &Target,
    query: &BTreeMap<String, String>,
) -> Response<BoxBody> {
    let def = RESOURCES[target.resource];
    let resource = target.resource;
    let namespace = target.namespace.clone();
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let send_initial = query.get("sendInitialEvents").is_some_and(|v| v == "true");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(1800));
    let from: Option<u64> = match query.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(v) => match v.parse() {
            Ok(n) => Some(n),
            Err(_) => {
                return error_response(&err(
                    400,
                    "BadRequest",
                    format!("invalid resourceVersion {v:?}"),
                ));
            }
        },
    };
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let mut signal = inner.signal.subscribe();
    let epoch = signal.borrow().1;
    let mut bookmark_epoch = signal.borrow().2;
    let interval = *inner
        .bookmark_interval
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let mut first: Vec<Bytes> = Vec::new();
    let mut cursor: u64;
    {
        let st = inner.lock();
        match from {
            Some(n) if n < st.compacted => {
                let e = err(
                    410,
                    "Expired",
                    format!("too old resource version: {n} ({})", st.compacted),
                );
                first.push(watch_event("ERROR", &status_json(&e)));
                cursor = u64::MAX;
            }
            Some(n) => cursor = n,
            None => {
                for obj in st.list(resource, namespace.as_deref()) {
                    first.push(watch_event("ADDED", &obj));
                }
                cursor = st.rv;
            }
        }
        if send_initial && from.is_none() {
            first.push(bookmark(&def, cursor, true));
        }
    }
    tokio::spawn(async move {
        for b in first {
            if tx.send(b).await.is_err() {
                return;
            }
        }
        if cursor == u64::MAX {
            return;
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut ticker = tokio::time::interval(interval);
        ticker.tick().await;
        loop {
            // Everything after the cursor.
            let mut expired = false;
            let pending: Vec<Bytes> = {
                let st = inner.lock();
                if cursor.saturating_add(1) < st.compacted {
                    // History this watch had not sent yet was compacted away: tell the client.
                    expired = true;
                    let e = err(
                        410,
                        "Expired",
                        format!("too old resource version: {cursor}"),
                    );
                    vec![watch_event("ERROR", &status_json(&e))]
                } else {
                    let start = st.log.partition_point(|e| e.rv <= cursor);
                    let out = st.log[start..]
                        .iter()
                        .filter(|e| {
                            e.resource == resource
                                && namespace.as_deref().is_none_or(|n| n == e.namespace)
                        })
                        .map(|e| watch_event(e.kind, &e.object))
                        .collect();
                    cursor = st.rv;
                    out
                }
            };
            for b in pending {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
            if expired {
                return;
            }
            tokio::select! {
                changed = signal.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let (_, e, b) = *signal.borrow_and_update();
                    if e != epoch {
                        return;
                    }
                    if b != bookmark_epoch {
                        bookmark_epoch = b;
                        if bookmarks && tx.send(bookmark(&def, cursor, false)).await.is_err() {
                            return;
                        }
                    }
                }
                _ = ticker.tick() => {
                    // The cursor: everything up to it has been sent.
                    if bookmarks && tx.send(bookmark(&def, cursor, false)).await.is_err() {
                        return;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return,
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(ChannelBody(rx).boxed())
        .expect("response")
}

#[cfg(test)]
mod tests;
