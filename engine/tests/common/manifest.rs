//! Engines of hand-written manifests for the example-based tests.

#![allow(dead_code)]

use std::path::Path;

use ordnet_crds::ClusterObjects;
use ordnet_engine::Engine;

/// The objects of `text` (a manifest, named `t.yaml`), which must load and validate without
/// an error.
pub fn objects(text: &str) -> ClusterObjects {
    let outcome = ordnet_crds::validated(ordnet_crds::load_str(Path::new("t.yaml"), text));
    assert!(!outcome.has_errors(), "{:?}", outcome.problems);
    outcome.objects
}

/// `Engine::build` of `objects`, which must build without an error.
pub fn build(objects: &ClusterObjects) -> Engine {
    let e = Engine::build(objects);
    assert!(e.errors().is_empty(), "{:?}", e.errors());
    e
}
