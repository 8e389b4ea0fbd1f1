//! ordnet API types, CRD generation, manifest loading and validation.
//!
//! | module | what |
//! |---|---|
//! | `cnp` | the upstream `policy.networking.k8s.io` `ClusterNetworkPolicy` (v1beta1 and v1alpha2) |
//! | `types` | the `ordnet.io/v1alpha1` kinds `OrderedNetworkPolicy` and `ClusterOrderedNetworkPolicy` (kube `CustomResource`s with JSON schemas) |
//! | `crd` | the CustomResourceDefinition YAML (`ordnet crd`) |
//! | `manifest` | loading `-f` paths into [`ClusterObjects`]; the kind names ([`KIND_POD`], ...) |
//! | [`validate`] | semantic validation of every kind the engine uses (public: `validate::validate_pod`, ...) |
//! | `selector`, [`syntax`] | label selectors; Kubernetes name syntax (public: `syntax::port_name`, ...) |
//! | `problem` | problems and how they print (`FILE: KIND NAMESPACE/NAME: FIELD: message`) |
//!
//! Everything but the two function collections `validate` and `syntax` is re-exported here.

use std::collections::HashSet;
use std::path::Path;

mod cnp;
mod crd;
mod manifest;
mod problem;
mod selector;
pub mod syntax;
mod types;
pub mod validate;

pub use k8s_openapi;

pub use cnp::*;
pub use crd::{cnp_crd, cnp_crd_yaml, crd_yaml, crds};
pub use manifest::{
    ClusterObjects, DEFAULT_NAMESPACE, KIND_CLUSTER_ORDERED, KIND_NAMESPACE, KIND_NETWORK_POLICY,
    KIND_NODE, KIND_ORDERED, KIND_POD, KIND_SERVICE, LoadOutcome, Loaded, Loader,
    NAMESPACE_NAME_LABEL, implied_namespace, load_bytes, load_paths, load_str,
};
pub use problem::{FieldError, ObjectRef, Problem, Severity, Source};
pub use selector::{Requirement, Selector, validate_label_selector};
pub use types::*;

/// Loads `paths` and validates everything: the outcome's `problems` holds the load problems and
/// then the validation problems (errors and warnings); its `objects` holds what the engine may
/// use (see [`validated`]). Callers that must refuse invalid input (the CLI) check
/// [`LoadOutcome::has_errors`].
pub fn load_and_validate<P: AsRef<Path>>(paths: &[P]) -> LoadOutcome {
    validated(load_paths(paths))
}

/// Validates an already loaded outcome (see [`load_and_validate`]). Namespaces, Pods and
/// Services with errors are removed from `objects`. Policies with errors are kept: the engine decides what
/// of them it can enforce (a rule it cannot enforce is enforced fail-closed, a policy it cannot
/// use at all, e.g. with an invalid subject selector, is left out and reported by the engine),
/// exactly as the agent does with an object the API server stored. Every problem is in
/// `problems` either way.
pub fn validated(mut outcome: LoadOutcome) -> LoadOutcome {
    let problems = validate::validate_objects(&outcome.objects);
    let invalid: HashSet<ObjectRef> = problems
        .iter()
        .filter(|p| p.is_error())
        .filter_map(|p| p.object.clone())
        .collect();
    if !invalid.is_empty() {
        let objects = &mut outcome.objects;
        let keep =
            |kind: &str, meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
                let name = meta.name.clone().unwrap_or_default();
                let r = match &meta.namespace {
                    Some(ns) => ObjectRef::namespaced(kind, ns, &name),
                    None => ObjectRef::cluster(kind, &name),
                };
                !invalid.contains(&r)
            };
        objects
            .namespaces
            .retain(|o| keep(manifest::KIND_NAMESPACE, &o.object.metadata));
        objects
            .pods
            .retain(|o| keep(manifest::KIND_POD, &o.object.metadata));
        objects
            .services
            .retain(|o| keep(manifest::KIND_SERVICE, &o.object.metadata));
    }
    outcome.problems.extend(problems);
    outcome
}
