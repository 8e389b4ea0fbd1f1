//! CustomResourceDefinition generation for the ordnet kinds.
//!
//! The committed copy is `deploy/crds/ordnet.io_crds.yaml`; a test fails when it differs from
//! [`crd_yaml`]. Regenerate it with `cargo run -q -p ordnet -- crd > deploy/crds/ordnet.io_crds.yaml`
//! (or `ORDNET_UPDATE_CRDS=1 cargo test -p ordnet-crds committed_crd_yaml`).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};
use kube::CustomResourceExt;
use serde_json::Value;

use crate::cnp::{CNP_API_APPROVED, CNP_BUNDLE_VERSION, ClusterNetworkPolicy};
use crate::types::{ClusterOrderedNetworkPolicy, OrderedNetworkPolicy};

/// Path of the committed CRD YAML, relative to the workspace root.
#[cfg(test)]
const COMMITTED_CRD_PATH: &str = "deploy/crds/ordnet.io_crds.yaml";
/// Path of the committed upstream ClusterNetworkPolicy CRD, relative to the workspace root.
#[cfg(test)]
const COMMITTED_CNP_CRD_PATH: &str =
    "deploy/crds/upstream/policy.networking.k8s.io_clusternetworkpolicies.yaml";

/// The CustomResourceDefinitions of the ordnet kinds, in a fixed order.
///
/// Use this rather than `OrderedNetworkPolicy::crd()`: the schema is post-processed here so that
/// no field is `nullable`. An explicit `null` is then pruned by the API server before defaulting
/// and validation, exactly like an absent field, which keeps the CEL rules (`has(self.port)` ...)
/// meaningful.
pub fn crds() -> Vec<CustomResourceDefinition> {
    let mut crds = vec![
        OrderedNetworkPolicy::crd(),
        ClusterOrderedNetworkPolicy::crd(),
    ];
    for crd in &mut crds {
        for version in &mut crd.spec.versions {
            if let Some(validation) = version.schema.as_mut()
                && let Some(schema) = validation.open_api_v3_schema.take()
            {
                validation.open_api_v3_schema = Some(post_process(schema));
            }
        }
    }
    crds
}

/// A label key as a schema pattern: an optional DNS-1123 subdomain prefix and `/`, then a name of
/// 1-63 letters, digits, `-`, `_` and `.` that starts and ends with a letter or digit
/// (`syntax::label_key`; the prefix's length is checked by [`LABEL_PREFIX_PATTERN`]).
pub const LABEL_KEY_PATTERN: &str = "^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$";
/// A label key's prefix is at most 253 characters (DNS-1123 subdomain).
pub const LABEL_PREFIX_PATTERN: &str = "^([^/]{1,253}/)?[^/]{1,63}$";
/// A label value: empty, or up to 63 letters, digits, `-`, `_` and `.`, starting and ending with
/// a letter or digit (`syntax::label_value`).
pub const LABEL_VALUE_PATTERN: &str = "^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$";

/// The schema of every label selector (subjects and peers): what the API server checks for a
/// NetworkPolicy's selectors, expressed as bounds, patterns, an enum and three CEL rules (map keys
/// can only be checked by CEL), each within the CEL cost budget.
fn label_selector_schema(description: Option<Value>) -> Value {
    use crate::types::{MAX_MATCH_EXPRESSIONS, MAX_MATCH_LABELS, MAX_SELECTOR_VALUES};
    let mut schema = serde_json::json!({
        "type": "object",
        "properties": {
            "matchLabels": {
                "description": "Labels that must all be present with these values.",
                "type": "object",
                "maxProperties": MAX_MATCH_LABELS,
                "additionalProperties": {
                    "type": "string",
                    "maxLength": 63,
                    "pattern": LABEL_VALUE_PATTERN
                },
                "x-kubernetes-validations": [{
                    "rule": format!("self.all(k, k.matches('{LABEL_KEY_PATTERN}') && (!k.contains('/') || k.matches('^[^/]{{1,253}}/')))"),
                    "message": "matchLabels keys must be label keys: an optional DNS-1123 subdomain prefix of at most 253 characters and '/', then a name of 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
                }]
            },
            "matchExpressions": {
                "description": "Requirements that must all hold.",
                "type": "array",
                "maxItems": MAX_MATCH_EXPRESSIONS,
                "items": {
                    "type": "object",
                    "required": ["key", "operator"],
                    "properties": {
                        "key": {
                            "type": "string",
                            "maxLength": 317,
                            "pattern": LABEL_KEY_PATTERN,
                            "allOf": [{"pattern": LABEL_PREFIX_PATTERN}]
                        },
                        "operator": {
                            "type": "string",
                            "enum": ["In", "NotIn", "Exists", "DoesNotExist"]
                        },
                        "values": {
                            "type": "array",
                            "maxItems": MAX_SELECTOR_VALUES,
                            "items": {
                                "type": "string",
                                "maxLength": 63,
                                "pattern": LABEL_VALUE_PATTERN
                            }
                        }
                    },
                    "x-kubernetes-validations": [
                        {
                            "rule": "!(self.operator == 'In' || self.operator == 'NotIn') || (has(self.values) && size(self.values) > 0)",
                            "message": "values must not be empty when operator is In or NotIn",
                            "fieldPath": ".values"
                        },
                        {
                            "rule": "!(self.operator == 'Exists' || self.operator == 'DoesNotExist') || !has(self.values) || size(self.values) == 0",
                            "message": "values must be empty when operator is Exists or DoesNotExist",
                            "fieldPath": ".values"
                        }
                    ]
                }
            }
        }
    });
    if let (Some(d), Value::Object(map)) = (description, &mut schema) {
        map.insert("description".into(), d);
    }
    schema
}

/// Whether a schema node is the generated `LabelSelector` (an object with exactly the
/// properties `matchExpressions` and `matchLabels`).
fn is_label_selector(map: &serde_json::Map<String, Value>) -> bool {
    map.get("properties")
        .and_then(Value::as_object)
        .is_some_and(|p| {
            p.len() == 2 && p.contains_key("matchLabels") && p.contains_key("matchExpressions")
        })
}

/// The CustomResourceDefinition of the upstream `ClusterNetworkPolicy`, for clusters that do
/// not have the one of the network-policy-api project (`ordnet crd --upstream`): the same
/// fields and checks as upstream's experimental channel (the `nodes` and `domainNames` peers
/// and `destinationNamedPort` included), versions `v1beta1` (stored) and `v1alpha2` (served,
/// same schema). A CRD of a `*.k8s.io` group must carry `api-approved.kubernetes.io` with the
/// approving API review (else the API server marks it non-conformant): this is upstream's API,
/// so it cites upstream's. Label selectors keep the plain Kubernetes schema (no ordnet bounds:
/// what upstream's CRD admits, this one admits).
pub fn cnp_crd() -> CustomResourceDefinition {
    fn walk(value: &mut Value) {
        match value {
            Value::Object(map) => {
                map.remove("nullable");
                map.values_mut().for_each(walk);
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    let mut crd = ClusterNetworkPolicy::crd();
    for version in &mut crd.spec.versions {
        if let Some(validation) = version.schema.as_mut()
            && let Some(schema) = validation.open_api_v3_schema.take()
        {
            let mut value = serde_json::to_value(&schema).expect("a schema serializes to JSON");
            walk(&mut value);
            validation.open_api_v3_schema =
                Some(serde_json::from_value(value).expect("still a schema"));
        }
    }
    crd.metadata.annotations = Some(
        [
            ("api-approved.kubernetes.io", CNP_API_APPROVED),
            (
                "policy.networking.k8s.io/bundle-version",
                CNP_BUNDLE_VERSION,
            ),
            ("policy.networking.k8s.io/channel", "experimental"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
    );
    let mut alpha = crd.spec.versions[0].clone();
    alpha.name = "v1alpha2".into();
    alpha.storage = false;
    crd.spec.versions.push(alpha);
    crd
}

/// [`cnp_crd`] as YAML (what `ordnet crd --upstream` prints and what is committed under
/// `deploy/crds/upstream/`).
pub fn cnp_crd_yaml() -> String {
    format!(
        "---\n{}",
        yaml_serde::to_string(&cnp_crd()).expect("a CRD serializes to YAML")
    )
}

/// Post-processes a generated schema: removes every `nullable: true` (an explicit `null` is then
/// pruned by the API server before defaulting and validation, exactly like an absent field,
/// which keeps the CEL rules' `has(...)` meaningful) and replaces every label selector with
/// [`label_selector_schema`].
fn post_process(schema: JSONSchemaProps) -> JSONSchemaProps {
    fn walk(value: &mut Value) {
        match value {
            Value::Object(map) => {
                map.remove("nullable");
                if is_label_selector(map) {
                    let default = map.remove("default");
                    *value = label_selector_schema(map.remove("description"));
                    if let (Some(d), Value::Object(m)) = (default, &mut *value) {
                        m.insert("default".into(), d);
                    }
                    return;
                }
                map.values_mut().for_each(walk);
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    // JSONSchemaProps is plain data: the round trip through serde_json::Value cannot fail.
    let mut value = serde_json::to_value(&schema).expect("a schema serializes to JSON");
    walk(&mut value);
    serde_json::from_value(value).expect("a post-processed schema is still a schema")
}

/// The CRDs as one multi-document YAML stream (what `ordnet crd` prints and what is committed).
pub fn crd_yaml() -> String {
    let mut out = String::new();
    for crd in crds() {
        out.push_str("---\n");
        // Serializing a CustomResourceDefinition (plain data, string map keys) cannot fail.
        out.push_str(&yaml_serde::to_string(&crd).expect("a CRD serializes to YAML"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn committed_path() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(COMMITTED_CRD_PATH)
    }

    #[test]
    fn committed_upstream_crd_yaml_is_current() {
        let expected = cnp_crd_yaml();
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(COMMITTED_CNP_CRD_PATH);
        if std::env::var_os("ORDNET_UPDATE_CRDS").is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &expected).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == expected,
            "{} is out of date: run `cargo run -q -p ordnet -- crd --upstream > {}`",
            COMMITTED_CNP_CRD_PATH,
            COMMITTED_CNP_CRD_PATH
        );
    }

    #[test]
    fn upstream_crd_has_both_versions_and_the_approval() {
        let crd = cnp_crd();
        let versions: Vec<(&str, bool, bool)> = crd
            .spec
            .versions
            .iter()
            .map(|v| (v.name.as_str(), v.served, v.storage))
            .collect();
        assert_eq!(
            versions,
            [("v1beta1", true, true), ("v1alpha2", true, false)]
        );
        assert_eq!(crd.spec.group, "policy.networking.k8s.io");
        assert_eq!(crd.spec.scope, "Cluster");
        let ann = crd.metadata.annotations.unwrap();
        assert!(ann["api-approved.kubernetes.io"].starts_with("https://github.com/"));
    }

    #[test]
    fn committed_crd_yaml_is_current() {
        let expected = crd_yaml();
        let path = committed_path();
        if std::env::var_os("ORDNET_UPDATE_CRDS").is_some() {
            std::fs::write(&path, &expected).expect("write the CRD YAML");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == expected,
            "{} differs from the generated CRDs; regenerate it with \
             `cargo run -q -p ordnet -- crd > {COMMITTED_CRD_PATH}` \
             (or `ORDNET_UPDATE_CRDS=1 cargo test -p ordnet-crds committed_crd_yaml`)",
            path.display()
        );
    }

    fn schema(crd: &CustomResourceDefinition) -> Value {
        serde_json::to_value(
            crd.spec.versions[0]
                .schema
                .as_ref()
                .and_then(|s| s.open_api_v3_schema.as_ref())
                .expect("schema"),
        )
        .expect("json")
    }

    fn rule_props(schema: &Value, dir: &str) -> Value {
        schema["properties"]["spec"]["properties"][dir]["items"].clone()
    }

    #[test]
    fn crds_have_names_scope_columns_and_status() {
        let crds = crds();
        assert_eq!(crds.len(), 2);
        let (onp, conp) = (&crds[0], &crds[1]);
        assert_eq!(
            onp.metadata.name.as_deref(),
            Some("orderednetworkpolicies.ordnet.io")
        );
        assert_eq!(onp.spec.scope, "Namespaced");
        assert_eq!(onp.spec.names.short_names, Some(vec!["onp".to_string()]));
        assert_eq!(
            conp.metadata.name.as_deref(),
            Some("clusterorderednetworkpolicies.ordnet.io")
        );
        assert_eq!(conp.spec.scope, "Cluster");
        assert_eq!(conp.spec.names.short_names, Some(vec!["conp".to_string()]));
        for crd in &crds {
            let v = &crd.spec.versions[0];
            assert_eq!(v.name, "v1alpha1");
            assert!(v.served && v.storage);
            assert!(
                v.subresources
                    .as_ref()
                    .and_then(|s| s.status.as_ref())
                    .is_some()
            );
            let columns: Vec<(&str, &str)> = v
                .additional_printer_columns
                .iter()
                .flatten()
                .map(|c| (c.name.as_str(), c.json_path.as_str()))
                .collect();
            assert_eq!(
                columns,
                [
                    ("Priority", ".spec.priority"),
                    ("Mode", ".spec.mode"),
                    ("Subject", ".status.subject"),
                    ("Rules", ".status.rules"),
                    ("Age", ".metadata.creationTimestamp"),
                    (
                        "Status",
                        ".status.conditions[?(@.type==\"Accepted\")].status"
                    ),
                ]
            );
            let s = schema(crd);
            assert!(!s.to_string().contains("nullable"), "no nullable fields");
            let conditions = &s["properties"]["status"]["properties"]["conditions"];
            assert_eq!(conditions["x-kubernetes-list-type"], "map");
            assert_eq!(
                conditions["x-kubernetes-list-map-keys"],
                serde_json::json!(["type"])
            );
        }
    }

    #[test]
    fn schema_expresses_what_a_schema_can() {
        let crds = crds();
        let onp = schema(&crds[0]);
        let conp = schema(&crds[1]);
        let prio = &onp["properties"]["spec"]["properties"]["priority"];
        assert_eq!(prio["minimum"], 0.0);
        assert_eq!(prio["format"], "int32");
        assert_eq!(prio["maximum"], 2147483647.0);
        let cprio = &conp["properties"]["spec"]["properties"]["priority"];
        assert_eq!(cprio["minimum"], -2147483648.0);
        assert_eq!(cprio["maximum"], 2147483647.0);
        assert_eq!(
            onp["properties"]["spec"]["required"],
            serde_json::json!(["podSelector", "priority"])
        );
        assert_eq!(
            conp["properties"]["spec"]["required"],
            serde_json::json!(["priority"])
        );
        assert_eq!(
            conp["properties"]["spec"]["properties"]["namespaceSelector"]["default"],
            serde_json::json!({})
        );
        for s in [&onp, &conp] {
            for dir in ["ingress", "egress"] {
                let rule = rule_props(s, dir);
                assert_eq!(rule["required"], serde_json::json!(["action"]));
                assert_eq!(
                    rule["properties"]["action"]["enum"],
                    serde_json::json!(["Allow", "Deny"])
                );
                let port = &rule["properties"]["ports"]["items"];
                assert_eq!(
                    port["properties"]["protocol"]["enum"],
                    serde_json::json!(["TCP", "UDP", "SCTP"])
                );
                assert_eq!(port["properties"]["protocol"]["default"], "TCP");
                assert_eq!(port["properties"]["endPort"]["minimum"], 1.0);
                assert_eq!(port["properties"]["endPort"]["maximum"], 65535.0);
                assert_eq!(
                    port["properties"]["port"]["x-kubernetes-int-or-string"],
                    true
                );
                let rules = port["x-kubernetes-validations"].to_string();
                assert!(rules.contains("self.port >= 1 && self.port <= 65535"));
                assert!(rules.contains("has(self.port) && type(self.port) == int"));
                assert!(rules.contains("self.endPort >= self.port"));
                let peers = if dir == "ingress" { "from" } else { "to" };
                let peer = &rule["properties"][peers]["items"];
                let peer_rules = peer["x-kubernetes-validations"].to_string();
                assert!(peer_rules.contains("an empty peer"));
                assert!(peer_rules.contains("ipBlock may not be combined"));
                assert_eq!(
                    peer["properties"]["ipBlock"]["required"],
                    serde_json::json!(["cidr"])
                );
            }
        }
    }
}
