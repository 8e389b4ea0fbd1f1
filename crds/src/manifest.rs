//! Loading Kubernetes manifests (`-f PATH`) into [`ClusterObjects`].
//!
//! * Paths are files or directories; directories are read recursively, taking the files that end
//!   in `.yaml`, `.yml` or `.json` (any case), in sorted order. A file named explicitly is read
//!   whatever its name (as JSON if it ends in `.json`, else as YAML).
//! * A YAML file may hold many documents; a JSON file one or more concatenated values. Empty
//!   documents are skipped. A `List` (or any `*List` kind with `items`) is unpacked.
//! * Kinds used: `v1` `Namespace` and `Pod`, `networking.k8s.io/v1` `NetworkPolicy`,
//!   `ordnet.io/v1alpha1` `OrderedNetworkPolicy` and `ClusterOrderedNetworkPolicy`. Other kinds
//!   are skipped with a warning; one of these kinds under another `apiVersion` is an error.
//! * Namespaced objects without `metadata.namespace` go to `default` (as `kubectl apply` does);
//!   a namespace on a cluster-scoped object is dropped with a warning (as the API server does).
//! * Every Namespace carries `kubernetes.io/metadata.name: <name>` (the API server sets it and
//!   it cannot be changed); a namespace used by an object but not given is created with only
//!   that label.
//! * Fields that the object's type does not know are errors for policies (the policy would not
//!   mean what was written; `kubectl apply` also rejects them) and warnings for other kinds.
//!   Keys whose value is `null`, `[]` or `{}` are not reported.
//! * Duplicates (same kind, namespace and name) are errors.
//!
//! Loading collects every problem it can instead of stopping at the first; an object with an
//! error is left out of [`ClusterObjects`]. Nothing here panics, whatever the input.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::cnp::{CNP_API_VERSIONS, ClusterNetworkPolicy, KIND_CLUSTER_NETWORK_POLICY};
use crate::problem::{ObjectRef, Problem, Severity, Source};
use crate::types::{API_VERSION, ClusterOrderedNetworkPolicy, OrderedNetworkPolicy};

/// The label every namespace carries, with the namespace's name as value.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";
/// The namespace of namespaced objects that do not name one.
pub const DEFAULT_NAMESPACE: &str = "default";

/// `Namespace` kind name.
pub const KIND_NAMESPACE: &str = "Namespace";
/// `Pod` kind name.
pub const KIND_POD: &str = "Pod";
/// `Service` (`v1`): kube-proxy translates its addresses to the pods it selects.
pub const KIND_SERVICE: &str = "Service";
/// `NetworkPolicy` kind name.
pub const KIND_NETWORK_POLICY: &str = "NetworkPolicy";
/// `OrderedNetworkPolicy` kind name.
pub const KIND_ORDERED: &str = "OrderedNetworkPolicy";
/// `ClusterOrderedNetworkPolicy` kind name.
pub const KIND_CLUSTER_ORDERED: &str = "ClusterOrderedNetworkPolicy";
/// `Node` kind name (the `nodes` peers of a ClusterNetworkPolicy match their addresses).
pub const KIND_NODE: &str = "Node";

/// An object and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded<T> {
    /// The object, with `metadata.namespace` set for namespaced kinds (defaulted to `default`)
    /// and absent for cluster-scoped kinds.
    pub object: T,
    /// Where it was read; `None` for a namespace the loader created because an object used it.
    pub source: Option<Source>,
}

/// Every object the engine needs, each list sorted by (namespace, name).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterObjects {
    /// Namespaces, given or implied.
    pub namespaces: Vec<Loaded<Namespace>>,
    /// Pods.
    pub pods: Vec<Loaded<Pod>>,
    /// Standard NetworkPolicies.
    pub network_policies: Vec<Loaded<NetworkPolicy>>,
    /// OrderedNetworkPolicies.
    pub ordered_policies: Vec<Loaded<OrderedNetworkPolicy>>,
    /// ClusterOrderedNetworkPolicies.
    pub cluster_ordered_policies: Vec<Loaded<ClusterOrderedNetworkPolicy>>,
    /// Upstream ClusterNetworkPolicies (`v1alpha2` ones read as `v1beta1`: same schema).
    pub cluster_network_policies: Vec<Loaded<ClusterNetworkPolicy>>,
    /// Nodes.
    pub nodes: Vec<Loaded<Node>>,
    /// Services.
    pub services: Vec<Loaded<Service>>,
}

impl ClusterObjects {
    /// The namespace called `name`.
    pub fn namespace(&self, name: &str) -> Option<&Loaded<Namespace>> {
        self.namespaces
            .iter()
            .find(|n| n.object.metadata.name.as_deref() == Some(name))
    }

    /// The pod `namespace/name`.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<&Loaded<Pod>> {
        self.pods.iter().find(|p| {
            p.object.metadata.namespace.as_deref() == Some(namespace)
                && p.object.metadata.name.as_deref() == Some(name)
        })
    }

    /// The labels of namespace `name` (empty if there is no such namespace).
    pub fn namespace_labels(&self, name: &str) -> BTreeMap<String, String> {
        self.namespace(name)
            .and_then(|n| n.object.metadata.labels.clone())
            .unwrap_or_default()
    }

    /// Whether an object with this reference was loaded (implied namespaces included).
    pub fn contains(&self, r: &ObjectRef) -> bool {
        fn has<T>(list: &[Loaded<T>], r: &ObjectRef, meta: impl Fn(&T) -> &ObjectMeta) -> bool {
            list.iter().any(|o| {
                let m = meta(&o.object);
                m.name.as_deref() == Some(r.name.as_str()) && m.namespace == r.namespace
            })
        }
        match r.kind.as_str() {
            KIND_NAMESPACE => has(&self.namespaces, r, |o| &o.metadata),
            KIND_POD => has(&self.pods, r, |o| &o.metadata),
            KIND_NETWORK_POLICY => has(&self.network_policies, r, |o| &o.metadata),
            KIND_ORDERED => has(&self.ordered_policies, r, |o| &o.metadata),
            KIND_CLUSTER_ORDERED => has(&self.cluster_ordered_policies, r, |o| &o.metadata),
            KIND_CLUSTER_NETWORK_POLICY => has(&self.cluster_network_policies, r, |o| &o.metadata),
            KIND_NODE => has(&self.nodes, r, |o| &o.metadata),
            KIND_SERVICE => has(&self.services, r, |o| &o.metadata),
            _ => false,
        }
    }

    /// How many objects were read from manifests (implied namespaces not counted).
    pub fn loaded_count(&self) -> usize {
        self.namespaces
            .iter()
            .filter(|n| n.source.is_some())
            .count()
            + self.pods.len()
            + self.network_policies.len()
            + self.ordered_policies.len()
            + self.cluster_ordered_policies.len()
            + self.cluster_network_policies.len()
            + self.nodes.len()
            + self.services.len()
    }

    fn sort(&mut self) {
        fn key(m: &ObjectMeta) -> (String, String) {
            (
                m.namespace.clone().unwrap_or_default(),
                m.name.clone().unwrap_or_default(),
            )
        }
        self.namespaces.sort_by_key(|o| key(&o.object.metadata));
        self.pods.sort_by_key(|o| key(&o.object.metadata));
        self.network_policies
            .sort_by_key(|o| key(&o.object.metadata));
        self.ordered_policies
            .sort_by_key(|o| key(&o.object.metadata));
        self.cluster_ordered_policies
            .sort_by_key(|o| key(&o.object.metadata));
        self.cluster_network_policies
            .sort_by_key(|o| key(&o.object.metadata));
        self.nodes.sort_by_key(|o| key(&o.object.metadata));
        self.services.sort_by_key(|o| key(&o.object.metadata));
    }
}

/// The result of loading: the objects that loaded, and every problem found on the way
/// (errors and warnings, in the order of the input).
#[derive(Clone, Debug, Default)]
pub struct LoadOutcome {
    /// The objects without load errors.
    pub objects: ClusterObjects,
    /// Load errors and warnings.
    pub problems: Vec<Problem>,
}

impl LoadOutcome {
    /// Whether any problem is an error.
    pub fn has_errors(&self) -> bool {
        crate::problem::has_errors(&self.problems)
    }

    /// Whether the object `problem` is about is still in [`LoadOutcome::objects`] (a policy
    /// with validation errors is kept for the engine, see [`crate::validated`]); `false` for
    /// problems that are about no object (a file that does not parse).
    pub fn kept(&self, problem: &Problem) -> bool {
        problem
            .object
            .as_ref()
            .is_some_and(|o| self.objects.contains(o))
    }
}

/// Loads every manifest under `paths` (files or directories).
pub fn load_paths<P: AsRef<Path>>(paths: &[P]) -> LoadOutcome {
    let mut loader = Loader::default();
    for path in paths {
        loader.add_path(path.as_ref());
    }
    loader.finish()
}

/// Loads manifests from text, as if read from `file` (JSON if `file` ends in `.json`, else YAML).
pub fn load_str(file: &Path, text: &str) -> LoadOutcome {
    let mut loader = Loader::default();
    loader.add_text(file, text);
    loader.finish()
}

/// Loads manifests from raw bytes (which must be UTF-8), as if read from `file`.
pub fn load_bytes(file: &Path, bytes: &[u8]) -> LoadOutcome {
    let mut loader = Loader::default();
    loader.add_bytes(file, bytes);
    loader.finish()
}

/// An incremental loader: add paths or texts, then [`Loader::finish`].
#[derive(Debug, Default)]
pub struct Loader {
    objects: ClusterObjects,
    problems: Vec<Problem>,
    seen: HashMap<ObjectRef, Source>,
    files_read: HashSet<PathBuf>,
}

impl Loader {
    /// Adds a file, or every manifest file under a directory.
    pub fn add_path(&mut self, path: &Path) {
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) => {
                self.problems.push(Problem::file(
                    Severity::Error,
                    path,
                    format!("cannot read: {e}"),
                ));
                return;
            }
        };
        if meta.is_dir() {
            let mut files = Vec::new();
            let mut visited = HashSet::new();
            self.collect_dir(path, &mut files, &mut visited);
            if files.is_empty() {
                self.problems.push(Problem::file(
                    Severity::Warning,
                    path,
                    "no .yaml, .yml or .json files in this directory",
                ));
            }
            for file in files {
                self.add_file(&file);
            }
        } else {
            self.add_file(path);
        }
    }

    fn collect_dir(
        &mut self,
        dir: &Path,
        files: &mut Vec<PathBuf>,
        visited: &mut HashSet<PathBuf>,
    ) {
        // Guard against symlink loops.
        if let Ok(canonical) = std::fs::canonicalize(dir)
            && !visited.insert(canonical)
        {
            return;
        }
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) => {
                self.problems.push(Problem::file(
                    Severity::Error,
                    dir,
                    format!("cannot read directory: {e}"),
                ));
                return;
            }
        };
        let mut paths: Vec<PathBuf> = Vec::new();
        for entry in entries {
            match entry {
                Ok(entry) => paths.push(entry.path()),
                Err(e) => self.problems.push(Problem::file(
                    Severity::Error,
                    dir,
                    format!("cannot read directory: {e}"),
                )),
            }
        }
        paths.sort();
        for path in paths {
            // Follows symlinks; a broken link is reported when it looks like a manifest.
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_dir() => self.collect_dir(&path, files, visited),
                Ok(_) if is_manifest_name(&path) => files.push(path),
                Ok(_) => {}
                Err(e) if is_manifest_name(&path) => self.problems.push(Problem::file(
                    Severity::Error,
                    &path,
                    format!("cannot read: {e}"),
                )),
                Err(_) => {}
            }
        }
    }

    /// Adds one file.
    pub fn add_file(&mut self, path: &Path) {
        // The same file named twice (directly and through a directory) is read once.
        let key = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        if !self.files_read.insert(key) {
            return;
        }
        match std::fs::read(path) {
            Ok(bytes) => self.add_bytes(path, &bytes),
            Err(e) => self.problems.push(Problem::file(
                Severity::Error,
                path,
                format!("cannot read: {e}"),
            )),
        }
    }

    /// Adds the content of one file given as bytes.
    pub fn add_bytes(&mut self, file: &Path, bytes: &[u8]) {
        match std::str::from_utf8(bytes) {
            Ok(text) => self.add_text(file, text),
            Err(e) => self.problems.push(Problem::file(
                Severity::Error,
                file,
                format!(
                    "not UTF-8 text (byte {}): not a YAML or JSON manifest",
                    e.valid_up_to()
                ),
            )),
        }
    }

    /// Adds the content of one file given as text.
    pub fn add_text(&mut self, file: &Path, text: &str) {
        let documents = if is_json_name(file) {
            parse_json_documents(text)
        } else {
            parse_yaml_documents(text)
        };
        for (index, document) in documents.into_iter().enumerate() {
            let source = Source {
                file: file.to_path_buf(),
                document: index + 1,
                item: None,
            };
            match document {
                Ok(value) => self.add_value(value, source),
                Err(message) => self.problems.push(Problem::at(
                    Severity::Error,
                    Some(&source),
                    None,
                    None,
                    message,
                )),
            }
        }
    }

    /// Adds one already-parsed document.
    pub fn add_value(&mut self, value: Value, source: Source) {
        let map = match value {
            Value::Null => return,
            Value::Object(map) => map,
            other => {
                self.problems.push(Problem::at(
                    Severity::Error,
                    Some(&source),
                    None,
                    None,
                    format!(
                        "expected a Kubernetes object (a mapping with apiVersion and kind), found {}",
                        describe(&other)
                    ),
                ));
                return;
            }
        };
        if map.is_empty() {
            return;
        }
        let api_version = match string_field(&map, "apiVersion") {
            Ok(v) => v,
            Err(message) => {
                self.error(&source, None, "apiVersion", message);
                return;
            }
        };
        let kind = match string_field(&map, "kind") {
            Ok(v) => v,
            Err(message) => {
                self.error(&source, None, "kind", message);
                return;
            }
        };
        let known = KnownKind::from_kind(&kind);
        let Some(known) = known else {
            self.add_unknown_kind(map, &kind, &api_version, source);
            return;
        };
        if !known.accepts(&api_version) {
            self.error(
                &source,
                None,
                "apiVersion",
                format!(
                    "{kind} must have apiVersion {}, not {api_version:?}",
                    known.api_version()
                ),
            );
            return;
        }
        // metadata.name and metadata.namespace, checked before typing for clearer messages.
        let (name, namespace) = match read_identity(&map, known) {
            Ok(v) => v,
            Err((field, message)) => {
                self.error(&source, None, field, format!("{message} (kind {kind})"));
                return;
            }
        };
        let object = match &namespace {
            Some(ns) => ObjectRef::namespaced(&kind, ns, &name),
            None => ObjectRef::cluster(&kind, &name),
        };
        let value = Value::Object(map);
        let ok = match known {
            KnownKind::Namespace => self.typed::<Namespace>(&value, &source, &object, false),
            KnownKind::Pod => self.typed::<Pod>(&value, &source, &object, false),
            KnownKind::NetworkPolicy => self.typed::<NetworkPolicy>(&value, &source, &object, true),
            KnownKind::Ordered => {
                self.typed::<OrderedNetworkPolicy>(&value, &source, &object, true)
            }
            KnownKind::ClusterOrdered => {
                self.typed::<ClusterOrderedNetworkPolicy>(&value, &source, &object, true)
            }
            KnownKind::Service => self.typed::<Service>(&value, &source, &object, false),
            KnownKind::ClusterNetwork => {
                self.typed::<ClusterNetworkPolicy>(&value, &source, &object, true)
            }
            KnownKind::Node => self.typed::<Node>(&value, &source, &object, false),
        };
        let Some(typed) = ok else {
            return;
        };
        if let Some(first) = self.seen.get(&object) {
            self.problems.push(Problem::at(
                Severity::Error,
                Some(&source),
                Some(object.clone()),
                None,
                format!("duplicate object: already defined in {first}"),
            ));
            return;
        }
        self.seen.insert(object.clone(), source.clone());
        self.store(typed, namespace, source, &object);
    }

    /// A document of a kind ordnet does not read: a `List` is unpacked, an unknown kind of
    /// ordnet's own group is a typo (an error: a skipped guardrail would silently not be
    /// enforced), anything else is ignored with a warning.
    fn add_unknown_kind(
        &mut self,
        map: Map<String, Value>,
        kind: &str,
        api_version: &str,
        source: Source,
    ) {
        if kind.ends_with("List") && map.contains_key("items") {
            self.add_list(map, kind, source);
            return;
        }
        // ordnet's own group has no other kinds: an unknown one is a typo, not something
        // to skip (a skipped guardrail would silently not be enforced).
        if api_version.split('/').next() == Some(crate::types::GROUP) {
            let meant = closest(kind, KnownKind::ORDNET.iter().map(|k| k.kind()));
            self.error(
                &source,
                None,
                "kind",
                match meant {
                    Some(m) => format!(
                        "{kind:?} is not a kind of {}: did you mean {m}?",
                        crate::types::GROUP
                    ),
                    None => format!(
                        "{kind:?} is not a kind of {} (its kinds: {})",
                        crate::types::GROUP,
                        KnownKind::ORDNET.map(|k| k.kind()).join(", ")
                    ),
                },
            );
            return;
        }
        let name = map
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(Value::as_str)
            .unwrap_or("");
        self.problems.push(Problem::at(
            Severity::Warning,
            Some(&source),
            None,
            None,
            format!("ignored {kind} {name} ({api_version}): ordnet does not use this kind")
                .replace("  ", " "),
        ));
    }

    fn add_list(&mut self, mut map: Map<String, Value>, kind: &str, source: Source) {
        if source.item.is_some() {
            self.error(
                &source,
                None,
                "kind",
                format!("a {kind} inside a List is not supported"),
            );
            return;
        }
        match map.remove("items") {
            Some(Value::Array(items)) => {
                for (i, item) in items.into_iter().enumerate() {
                    let item_source = Source {
                        item: Some(i),
                        ..source.clone()
                    };
                    self.add_value(item, item_source);
                }
            }
            Some(Value::Null) => {}
            Some(other) => self.error(
                &source,
                None,
                "items",
                format!("must be a list of objects, found {}", describe(&other)),
            ),
            None => {}
        }
    }

    /// Deserializes `value` as `T`, reporting type errors and unknown fields.
    fn typed<T>(
        &mut self,
        value: &Value,
        source: &Source,
        object: &ObjectRef,
        strict: bool,
    ) -> Option<Typed>
    where
        T: DeserializeOwned + Serialize + Into<Typed>,
    {
        let typed: T = match serde_path_to_error::deserialize(value) {
            Ok(t) => t,
            Err(e) => {
                let (field, message) =
                    describe_serde_error(value, &e.path().to_string(), &e.inner().to_string());
                self.problems.push(Problem::at(
                    Severity::Error,
                    Some(source),
                    Some(object.clone()),
                    Some(field),
                    message,
                ));
                return None;
            }
        };
        let mut unknown = Vec::new();
        if let Ok(round_trip) = serde_json::to_value(&typed) {
            unknown_fields(value, &round_trip, "", &mut unknown);
        }
        let severity = if strict {
            Severity::Error
        } else {
            Severity::Warning
        };
        for field in &unknown {
            self.problems.push(Problem::at(
                severity,
                Some(source),
                Some(object.clone()),
                Some(field.clone()),
                if strict {
                    "unknown field (misspelled?)"
                } else {
                    "unknown field, ignored"
                },
            ));
        }
        if strict && !unknown.is_empty() {
            return None;
        }
        Some(typed.into())
    }

    fn store(
        &mut self,
        typed: Typed,
        namespace: Option<String>,
        source: Source,
        object: &ObjectRef,
    ) {
        let source = Some(source);
        match typed {
            Typed::Namespace(mut ns) => {
                let problem = ensure_namespace_label(&mut ns);
                if let Some(message) = problem {
                    self.problems.push(Problem::at(
                        Severity::Warning,
                        source.as_ref(),
                        Some(object.clone()),
                        Some(format!("metadata.labels.{NAMESPACE_NAME_LABEL}")),
                        message,
                    ));
                }
                self.drop_namespace_of_cluster_object(&mut ns.metadata, source.as_ref(), object);
                self.objects.namespaces.push(Loaded {
                    object: *ns,
                    source,
                });
            }
            Typed::Pod(mut pod) => {
                pod.metadata.namespace = namespace;
                self.objects.pods.push(Loaded {
                    object: *pod,
                    source,
                });
            }
            Typed::NetworkPolicy(mut np) => {
                np.metadata.namespace = namespace;
                self.objects.network_policies.push(Loaded {
                    object: *np,
                    source,
                });
            }
            Typed::Ordered(mut onp) => {
                onp.metadata.namespace = namespace;
                self.objects.ordered_policies.push(Loaded {
                    object: *onp,
                    source,
                });
            }
            Typed::ClusterOrdered(mut conp) => {
                self.drop_namespace_of_cluster_object(&mut conp.metadata, source.as_ref(), object);
                self.objects.cluster_ordered_policies.push(Loaded {
                    object: *conp,
                    source,
                });
            }
            Typed::ClusterNetwork(mut cnp) => {
                self.drop_namespace_of_cluster_object(&mut cnp.metadata, source.as_ref(), object);
                self.objects.cluster_network_policies.push(Loaded {
                    object: *cnp,
                    source,
                });
            }
            Typed::Node(mut node) => {
                self.drop_namespace_of_cluster_object(&mut node.metadata, source.as_ref(), object);
                self.objects.nodes.push(Loaded {
                    object: *node,
                    source,
                });
            }
            Typed::Service(mut svc) => {
                svc.metadata.namespace = namespace;
                self.objects.services.push(Loaded {
                    object: *svc,
                    source,
                });
            }
        }
    }

    fn drop_namespace_of_cluster_object(
        &mut self,
        meta: &mut ObjectMeta,
        source: Option<&Source>,
        object: &ObjectRef,
    ) {
        if let Some(ns) = meta.namespace.take()
            && !ns.is_empty()
        {
            self.problems.push(Problem::at(
                Severity::Warning,
                source,
                Some(object.clone()),
                Some("metadata.namespace".into()),
                format!("{ns:?} ignored: {} is cluster-scoped", object.kind),
            ));
        }
    }

    fn error(
        &mut self,
        source: &Source,
        object: Option<ObjectRef>,
        field: &str,
        message: impl Into<String>,
    ) {
        self.problems.push(Problem::at(
            Severity::Error,
            Some(source),
            object,
            Some(field.to_string()),
            message,
        ));
    }

    /// Adds the implied namespaces, sorts, and returns everything.
    pub fn finish(mut self) -> LoadOutcome {
        let given: BTreeSet<String> = self
            .objects
            .namespaces
            .iter()
            .filter_map(|n| n.object.metadata.name.clone())
            .collect();
        let mut used: BTreeSet<String> = BTreeSet::new();
        let objects = &self.objects;
        used.extend(
            objects
                .pods
                .iter()
                .filter_map(|o| o.object.metadata.namespace.clone()),
        );
        used.extend(
            objects
                .network_policies
                .iter()
                .filter_map(|o| o.object.metadata.namespace.clone()),
        );
        used.extend(
            objects
                .ordered_policies
                .iter()
                .filter_map(|o| o.object.metadata.namespace.clone()),
        );
        for name in used.difference(&given) {
            self.objects.namespaces.push(Loaded {
                object: implied_namespace(name),
                source: None,
            });
        }
        self.objects.sort();
        LoadOutcome {
            objects: self.objects,
            problems: self.problems,
        }
    }
}

/// A namespace as the API server would have it with no labels given.
pub fn implied_namespace(name: &str) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(BTreeMap::from([(
                NAMESPACE_NAME_LABEL.to_string(),
                name.to_string(),
            )])),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    }
}

/// Sets `kubernetes.io/metadata.name` to the namespace's name; returns a warning message if a
/// different value was overwritten.
fn ensure_namespace_label(ns: &mut Namespace) -> Option<String> {
    let name = ns.metadata.name.clone().unwrap_or_default();
    let labels = ns.metadata.labels.get_or_insert_with(BTreeMap::new);
    let previous = labels.insert(NAMESPACE_NAME_LABEL.to_string(), name.clone());
    match previous {
        Some(old) if old != name => Some(format!(
            "{old:?} replaced by {name:?}: the API server always sets this label to the namespace's name"
        )),
        _ => None,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KnownKind {
    Namespace,
    Pod,
    NetworkPolicy,
    Ordered,
    ClusterOrdered,
    Service,
    ClusterNetwork,
    Node,
}

impl KnownKind {
    /// The kinds of ordnet's own API group.
    const ORDNET: [KnownKind; 2] = [KnownKind::Ordered, KnownKind::ClusterOrdered];

    fn kind(self) -> &'static str {
        match self {
            KnownKind::Namespace => KIND_NAMESPACE,
            KnownKind::Pod => KIND_POD,
            KnownKind::NetworkPolicy => KIND_NETWORK_POLICY,
            KnownKind::Ordered => KIND_ORDERED,
            KnownKind::ClusterOrdered => KIND_CLUSTER_ORDERED,
            KnownKind::Service => KIND_SERVICE,
            KnownKind::ClusterNetwork => KIND_CLUSTER_NETWORK_POLICY,
            KnownKind::Node => KIND_NODE,
        }
    }

    fn from_kind(kind: &str) -> Option<KnownKind> {
        Some(match kind {
            KIND_NAMESPACE => KnownKind::Namespace,
            KIND_POD => KnownKind::Pod,
            KIND_NETWORK_POLICY => KnownKind::NetworkPolicy,
            KIND_ORDERED => KnownKind::Ordered,
            KIND_CLUSTER_ORDERED => KnownKind::ClusterOrdered,
            KIND_SERVICE => KnownKind::Service,
            KIND_CLUSTER_NETWORK_POLICY => KnownKind::ClusterNetwork,
            KIND_NODE => KnownKind::Node,
            _ => return None,
        })
    }

    fn api_version(self) -> &'static str {
        match self {
            KnownKind::Namespace | KnownKind::Pod | KnownKind::Service | KnownKind::Node => "v1",
            KnownKind::NetworkPolicy => "networking.k8s.io/v1",
            KnownKind::Ordered | KnownKind::ClusterOrdered => API_VERSION,
            KnownKind::ClusterNetwork => CNP_API_VERSIONS[0],
        }
    }

    /// Whether objects of this kind may have `api_version` (a ClusterNetworkPolicy has two
    /// versions of one schema).
    fn accepts(self, api_version: &str) -> bool {
        match self {
            KnownKind::ClusterNetwork => CNP_API_VERSIONS.contains(&api_version),
            _ => api_version == self.api_version(),
        }
    }

    fn namespaced(self) -> bool {
        matches!(
            self,
            KnownKind::Pod | KnownKind::NetworkPolicy | KnownKind::Ordered | KnownKind::Service
        )
    }
}

/// A typed object of one of the known kinds.
enum Typed {
    Namespace(Box<Namespace>),
    Pod(Box<Pod>),
    NetworkPolicy(Box<NetworkPolicy>),
    Ordered(Box<OrderedNetworkPolicy>),
    ClusterOrdered(Box<ClusterOrderedNetworkPolicy>),
    Service(Box<Service>),
    ClusterNetwork(Box<ClusterNetworkPolicy>),
    Node(Box<Node>),
}

impl From<ClusterNetworkPolicy> for Typed {
    fn from(v: ClusterNetworkPolicy) -> Self {
        Typed::ClusterNetwork(Box::new(v))
    }
}

impl From<Node> for Typed {
    fn from(v: Node) -> Self {
        Typed::Node(Box::new(v))
    }
}

impl From<Service> for Typed {
    fn from(v: Service) -> Self {
        Typed::Service(Box::new(v))
    }
}

impl From<Namespace> for Typed {
    fn from(v: Namespace) -> Self {
        Typed::Namespace(Box::new(v))
    }
}
impl From<Pod> for Typed {
    fn from(v: Pod) -> Self {
        Typed::Pod(Box::new(v))
    }
}
impl From<NetworkPolicy> for Typed {
    fn from(v: NetworkPolicy) -> Self {
        Typed::NetworkPolicy(Box::new(v))
    }
}
impl From<OrderedNetworkPolicy> for Typed {
    fn from(v: OrderedNetworkPolicy) -> Self {
        Typed::Ordered(Box::new(v))
    }
}
impl From<ClusterOrderedNetworkPolicy> for Typed {
    fn from(v: ClusterOrderedNetworkPolicy) -> Self {
        Typed::ClusterOrdered(Box::new(v))
    }
}

/// Reads `metadata.name` and the effective namespace (None for cluster-scoped kinds).
fn read_identity(
    map: &Map<String, Value>,
    kind: KnownKind,
) -> Result<(String, Option<String>), (&'static str, String)> {
    let meta = match map.get("metadata") {
        None | Some(Value::Null) => {
            return Err((
                "metadata.name",
                "required: every object needs a name".into(),
            ));
        }
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err((
                "metadata",
                format!("must be a mapping, found {}", describe(other)),
            ));
        }
    };
    let name = match meta.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        None | Some(Value::Null) | Some(Value::String(_)) => {
            let hint = if meta.contains_key("generateName") {
                " (generateName is not supported: the manifest must say which object it is)"
            } else {
                ""
            };
            return Err((
                "metadata.name",
                format!("required: every object needs a name{hint}"),
            ));
        }
        Some(other) => {
            return Err((
                "metadata.name",
                format!("must be a string, found {}", describe(other)),
            ));
        }
    };
    let namespace = match meta.get("namespace") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err((
                "metadata.namespace",
                format!("must be a string, found {}", describe(other)),
            ));
        }
    };
    let namespace = if kind.namespaced() {
        Some(namespace.unwrap_or_else(|| DEFAULT_NAMESPACE.to_string()))
    } else {
        None
    };
    Ok((name, namespace))
}

fn string_field(map: &Map<String, Value>, field: &str) -> Result<String, String> {
    match map.get(field) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        None | Some(Value::Null) | Some(Value::String(_)) => {
            Err("required: every object needs apiVersion and kind".into())
        }
        Some(other) => Err(format!("must be a string, found {}", describe(other))),
    }
}

fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {:?}", truncate(s)),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "a mapping".into(),
    }
}

fn truncate(s: &str) -> String {
    if s.chars().count() > 60 {
        let mut t: String = s.chars().take(60).collect();
        t.push_str("...");
        t
    } else {
        s.to_string()
    }
}

/// Turns a serde error and its path into (field, message), naming the missing field itself,
/// or, when a field next to it looks like a misspelling of it (`podSelecter` for the required
/// `podSelector`), that field as the likely typo.
fn describe_serde_error(input: &Value, path: &str, message: &str) -> (String, String) {
    let path = if path == "." { "" } else { path };
    let join = |field: &str| {
        if path.is_empty() {
            field.to_string()
        } else {
            format!("{path}.{field}")
        }
    };
    if let Some(rest) = message.strip_prefix("missing field `")
        && let Some(field) = rest.strip_suffix('`')
    {
        let siblings = value_at(input, path)
            .and_then(Value::as_object)
            .map(|o| o.keys().map(String::as_str).collect::<Vec<_>>())
            .unwrap_or_default();
        if let Some(typo) = closest(field, siblings.iter().copied().filter(|k| *k != field)) {
            return (
                join(typo),
                format!(
                    "unknown field: probably a misspelling of {field:?}, which is required and missing"
                ),
            );
        }
        return (join(field), "required field is missing".into());
    }
    (path.to_string(), message.to_string())
}

/// The value at a serde path (`spec.ingress[0].ports`), if there is one.
fn value_at<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    let mut v = value;
    if path.is_empty() {
        return Some(v);
    }
    for part in path.split('.') {
        let (key, indexes) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !key.is_empty() {
            v = v.get(key)?;
        }
        for index in indexes.split('[').filter(|s| !s.is_empty()) {
            v = v.get(index.trim_end_matches(']').parse::<usize>().ok()?)?;
        }
    }
    Some(v)
}

/// The candidate closest to `word` if it is close enough to be a misspelling of it: equal but
/// for case, `-`/`_`, or within an edit distance of 2 (1 for words of up to 4 letters).
pub(crate) fn closest<'a>(
    word: &str,
    candidates: impl Iterator<Item = &'a str>,
) -> Option<&'a str> {
    let norm = |s: &str| s.to_ascii_lowercase().replace(['-', '_'], "");
    let limit = if word.chars().count() <= 4 { 1 } else { 2 };
    candidates
        .map(|c| {
            let d = if norm(c) == norm(word) {
                0
            } else {
                strsim::damerau_levenshtein(word, c)
            };
            (d, c)
        })
        .filter(|(d, _)| *d <= limit)
        .min()
        .map(|(_, c)| c)
}

/// Fields present (and not null or empty) in `input` that the typed round trip dropped.
fn unknown_fields(input: &Value, output: &Value, path: &str, out: &mut Vec<String>) {
    match (input, output) {
        (Value::Object(i), Value::Object(o)) => {
            for (key, value) in i {
                let field = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match o.get(key) {
                    Some(ov) => unknown_fields(value, ov, &field, out),
                    None if is_empty_value(value) => {}
                    None => out.push(field),
                }
            }
        }
        (Value::Array(i), Value::Array(o)) if i.len() == o.len() => {
            for (n, (iv, ov)) in i.iter().zip(o).enumerate() {
                unknown_fields(iv, ov, &format!("{path}[{n}]"), out);
            }
        }
        _ => {}
    }
}

fn is_empty_value(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

fn extension(path: &Path) -> Option<String> {
    path.extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
}

fn is_manifest_name(path: &Path) -> bool {
    matches!(extension(path).as_deref(), Some("yaml" | "yml" | "json"))
}

fn is_json_name(path: &Path) -> bool {
    extension(path).as_deref() == Some("json")
}

/// Splits a YAML stream into documents converted to JSON values. A syntax error ends the file
/// (the parser cannot resynchronise); it is returned as the last element.
fn parse_yaml_documents(text: &str) -> Vec<Result<Value, String>> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for document in yaml_serde::Deserializer::from_str(text) {
        match yaml_serde::Value::deserialize(document) {
            Ok(mut value) => {
                let converted = value
                    .apply_merge()
                    .map_err(|e| format!("invalid YAML merge key: {e}"))
                    .and_then(|()| yaml_to_json(value, "", 0));
                out.push(converted);
            }
            Err(e) => {
                out.push(Err(format!("invalid YAML: {e}")));
                break;
            }
        }
    }
    out
}

/// Splits a stream of JSON values.
fn parse_json_documents(text: &str) -> Vec<Result<Value, String>> {
    let mut out = Vec::new();
    for value in serde_json::Deserializer::from_str(text).into_iter::<StrictJson>() {
        match value {
            Ok(StrictJson(v)) => out.push(Ok(v)),
            Err(e) => {
                out.push(Err(format!("invalid JSON: {e}")));
                break;
            }
        }
    }
    out
}

/// A JSON value whose objects must not repeat a key (the Kubernetes decoder rejects duplicate
/// fields; `serde_json::Value` would silently keep the last one).
struct StrictJson(Value);

impl<'de> serde::Deserialize<'de> for StrictJson {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(StrictJsonVisitor)
            .map(StrictJson)
    }
}

struct StrictJsonVisitor;

impl<'de> serde::de::Visitor<'de> for StrictJsonVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(StrictJsonVisitor)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictJson(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let StrictJson(value) = map.next_value()?;
            if out.contains_key(&key) {
                return Err(serde::de::Error::custom(format!("duplicate field {key:?}")));
            }
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

/// The nesting depth past which a document is rejected (the parsers stop at 128 already).
const MAX_DEPTH: usize = 200;

/// Converts a YAML value to JSON as the Kubernetes YAML decoder does: scalar keys become
/// strings; tags and non-scalar keys are errors.
fn yaml_to_json(value: yaml_serde::Value, path: &str, depth: usize) -> Result<Value, String> {
    use yaml_serde::Value as Y;
    if depth > MAX_DEPTH {
        return Err("document nested too deeply".into());
    }
    let at = |path: &str| {
        if path.is_empty() {
            String::new()
        } else {
            format!(" at {path}")
        }
    };
    Ok(match value {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                match serde_json::Number::from_f64(f) {
                    Some(num) => Value::Number(num),
                    None => {
                        return Err(format!("the number {n}{} is not a finite number", at(path)));
                    }
                }
            }
        }
        Y::String(s) => Value::String(s),
        Y::Sequence(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                out.push(yaml_to_json(item, &format!("{path}[{i}]"), depth + 1)?);
            }
            Value::Array(out)
        }
        Y::Mapping(mapping) => {
            let mut out = Map::new();
            for (key, item) in mapping {
                let key = match key {
                    Y::String(s) => s,
                    Y::Bool(b) => b.to_string(),
                    Y::Number(n) => n.to_string(),
                    Y::Null => "null".to_string(),
                    _ => {
                        return Err(format!(
                            "a mapping key{} is a list or mapping; keys must be strings",
                            at(path)
                        ));
                    }
                };
                let field = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                let item = yaml_to_json(item, &field, depth + 1)?;
                out.insert(key, item);
            }
            Value::Object(out)
        }
        Y::Tagged(tagged) => {
            return Err(format!(
                "YAML tag {}{} is not supported",
                tagged.tag,
                at(path)
            ));
        }
    })
}

#[cfg(test)]
mod tests;
