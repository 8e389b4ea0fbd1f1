//! The fake server's object store: objects by (resource, namespace, name), resource versions,
//! the change log watches replay, and the write semantics (generation, `/status`, conflicts).

use super::*;
use std::collections::HashMap;

/// The store key: (resource index, namespace or "" for cluster-scoped, name).
pub(crate) type Key = (usize, String, String);

/// One entry of the watch history.
#[derive(Debug, Clone)]
pub(crate) struct LogEntry {
    pub(crate) rv: u64,
    pub(crate) resource: usize,
    pub(crate) namespace: String,
    pub(crate) kind: &'static str,
    pub(crate) object: Value,
}

/// One recorded request (method, path and query, content type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    /// The HTTP method.
    pub method: String,
    /// The request URI: path and query.
    pub uri: String,
    /// The `Content-Type` header, if any.
    pub content_type: Option<String>,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) rv: u64,
    pub(crate) uid: u64,
    pub(crate) objects: BTreeMap<Key, Value>,
    pub(crate) log: Vec<LogEntry>,
    /// Watches from a resource version older than this get 410 Gone.
    pub(crate) compacted: u64,
    pub(crate) requests: Vec<RequestRecord>,
}

pub(crate) struct Inner {
    pub(crate) state: Mutex<State>,
    /// (last resource version, watch epoch, bookmark epoch): every change, every
    /// `drop_watches` and every `bookmark` moves it.
    pub(crate) signal: watch::Sender<(u64, u64, u64)>,
    pub(crate) bookmark_interval: Mutex<Duration>,
    /// The faults the server plays (see [`Faults`]).
    pub(crate) faults: Mutex<Faults>,
    /// Moves on every [`FakeApi::stop`]: every open connection is closed (no answer, no
    /// end of stream: the socket goes away as when the process is killed).
    pub(crate) generation: watch::Sender<u64>,
}

impl Inner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn notify(&self, rv: u64) {
        self.signal.send_modify(|s| s.0 = rv);
    }
}

pub(crate) fn err(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        code,
        reason,
        message: message.into(),
    }
}

pub(crate) fn status_json(e: &ApiError) -> Value {
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
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
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

pub(crate) fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
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
pub(crate) enum Part {
    /// The main resource: `status` is kept as stored (when the kind has a status subresource).
    Main,
    /// The `/status` subresource: only `status` changes.
    Status,
}

impl State {
    pub(crate) fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    pub(crate) fn record(
        &mut self,
        resource: usize,
        namespace: &str,
        kind: &'static str,
        object: &Value,
    ) {
        let rv = self.rv;
        self.log.push(LogEntry {
            rv,
            resource,
            namespace: namespace.to_string(),
            kind,
            object: object.clone(),
        });
    }

    pub(crate) fn create(
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
    pub(crate) fn store_update(
        &mut self,
        key: &Key,
        new: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
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

    pub(crate) fn delete(&mut self, key: &Key) -> Result<Value, ApiError> {
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

    /// One page of a list, as of resource version `at` (`None`: now): the objects after
    /// `after` (namespace, name) in key order, at most `limit` (0: all), and whether more
    /// remain (their number). A past version is rebuilt from the change log, like etcd serving a
    /// revision; one older than the last compaction is 410 Gone (`Expired`), as for an expired
    /// continue token.
    pub(crate) fn list_page(
        &self,
        resource: usize,
        namespace: Option<&str>,
        at: Option<u64>,
        after: Option<&(String, String)>,
        limit: usize,
    ) -> Result<(Vec<Value>, usize), ApiError> {
        let in_scope = |ns: &str, name: &str| {
            namespace.is_none_or(|n| n == ns)
                && after.is_none_or(|(a_ns, a_name)| (ns, name) > (a_ns.as_str(), a_name.as_str()))
        };
        let take = if limit == 0 { usize::MAX } else { limit };
        if at.is_none_or(|at| at >= self.rv) {
            // The current state: a page straight from the store (no copy of the keys; a
            // 50,000-pod list is 100 pages).
            let mut rest = self
                .objects
                .range((resource, String::new(), String::new())..)
                .take_while(|((r, _, _), _)| *r == resource)
                .filter(|((_, ns, name), _)| in_scope(ns, name));
            let page: Vec<Value> = rest.by_ref().take(take).map(|(_, v)| v.clone()).collect();
            return Ok((page, rest.count()));
        }
        let mut items: BTreeMap<(String, String), &Value> = self
            .objects
            .range((resource, String::new(), String::new())..)
            .take_while(|((r, _, _), _)| *r == resource)
            .filter(|((_, ns, name), _)| in_scope(ns, name))
            .map(|((_, ns, name), v)| ((ns.clone(), name.clone()), v))
            .collect();
        if let Some(at) = at.filter(|&at| at < self.rv) {
            let expired = || {
                err(
                    410,
                    "Expired",
                    format!(
                        "the resource version {at} of this list is older than the last compaction ({})",
                        self.compacted
                    ),
                )
            };
            if at < self.compacted {
                return Err(expired());
            }
            // Per key changed after `at`: its last state at or before `at`, and the first
            // change after it.
            let mut before: HashMap<(String, String), (&str, &Value)> = HashMap::new();
            let mut first_after: BTreeMap<(String, String), &str> = BTreeMap::new();
            for e in self.log.iter().filter(|e| e.resource == resource) {
                let name = meta_str(&e.object, "name").unwrap_or_default().to_string();
                let key = (e.namespace.clone(), name);
                if e.rv <= at {
                    before.insert(key, (e.kind, &e.object));
                } else {
                    first_after.entry(key).or_insert(e.kind);
                }
            }
            for (key, first) in first_after {
                if !in_scope(&key.0, &key.1) {
                    continue;
                }
                match before.get(&key) {
                    Some(("DELETED", _)) => {
                        items.remove(&key);
                    }
                    Some((_, v)) => {
                        items.insert(key, v);
                    }
                    None if first == "ADDED" => {
                        items.remove(&key);
                    }
                    // Changed after `at` but its state at `at` predates the log.
                    None => return Err(expired()),
                }
            }
        }
        let total = items.len();
        let page: Vec<Value> = items.into_values().take(take).cloned().collect();
        let remaining = total - page.len();
        Ok((page, remaining))
    }

    pub(crate) fn list(&self, resource: usize, namespace: Option<&str>) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|((r, ns, _), _)| *r == resource && namespace.is_none_or(|n| n == ns))
            .map(|(_, v)| v.clone())
            .collect()
    }
}
