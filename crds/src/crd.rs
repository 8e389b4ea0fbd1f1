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

use crate::types::{ClusterOrderedNetworkPolicy, OrderedNetworkPolicy};

/// Path of the committed CRD YAML, relative to the workspace root.
pub const COMMITTED_CRD_PATH: &str = "deploy/crds/ordnet.io_crds.yaml";

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
                validation.open_api_v3_schema = Some(strip_nullable(schema));
            }
        }
    }
    crds
}

/// Removes every `nullable: true` from a schema.
fn strip_nullable(schema: JSONSchemaProps) -> JSONSchemaProps {
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
    // JSONSchemaProps is plain data: the round trip through serde_json::Value cannot fail.
    let mut value = serde_json::to_value(&schema).expect("a schema serializes to JSON");
    walk(&mut value);
    serde_json::from_value(value).expect("a schema without `nullable` is still a schema")
}

/// The CRDs as one multi-document YAML stream (what `ordnet crd` prints and what is committed).
pub fn crd_yaml() -> String {
    let mut out = String::new();
    for crd in crds() {
        out.push_str("---\n");
        // Serializing a CustomResourceDefinition (plain data, string map keys) cannot fail.
        out.push_str(&serde_yaml::to_string(&crd).expect("a CRD serializes to YAML"));
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
        assert!(
            conp["properties"]["spec"]["properties"]["priority"]
                .get("minimum")
                .is_none()
        );
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
                assert_eq!(peer["minProperties"], 1);
                assert!(
                    peer["x-kubernetes-validations"]
                        .to_string()
                        .contains("ipBlock")
                );
                assert_eq!(
                    peer["properties"]["ipBlock"]["required"],
                    serde_json::json!(["cidr"])
                );
            }
        }
    }
}
