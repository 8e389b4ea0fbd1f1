//! Arbitrary bytes through the manifest loader and the validator, then through the helpers the
//! engine uses on what loaded. Nothing may panic, whatever the input.
//!
//! The first byte picks the format (even: YAML, odd: JSON); the rest is the file content.

#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use ordnet_crds::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use ordnet_crds::k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use ordnet_crds::Selector;
use ordnet_crds::{Direction, OrderedSpec};
use ordnet_crds::validate::{parse_cidr, pod_ips};

fuzz_target!(|data: &[u8]| {
    let Some((&format, content)) = data.split_first() else {
        return;
    };
    let file = if format % 2 == 0 { "f.yaml" } else { "f.json" };
    let outcome =
        ordnet_crds::validated(ordnet_crds::load_bytes(Path::new(file), content));
    for problem in &outcome.problems {
        let line = problem.to_string();
        assert!(
            line.starts_with(file),
            "every problem names the file: {line}"
        );
    }
    let objects = &outcome.objects;
    for pod in &objects.pods {
        let _ = pod_ips(&pod.object);
    }
    // Policies with errors stay in `objects` (the engine enforces what it can of them); every
    // policy without an error must be fully usable.
    let has_error = |meta: &ObjectMeta, kind: &str| {
        let name = meta.name.clone().unwrap_or_default();
        outcome.problems.iter().any(|p| {
            p.is_error()
                && p.object.as_ref().is_some_and(|o| {
                    o.kind == kind && o.name == name && o.namespace == meta.namespace
                })
        })
    };
    for policy in &objects.ordered_policies {
        let spec = &policy.object.spec;
        let _ = serde_json::to_string(&policy.object);
        if has_error(&policy.object.metadata, "OrderedNetworkPolicy") {
            continue;
        }
        assert!(
            spec.priority >= 0,
            "a negative namespaced priority passed validation"
        );
        exercise(spec);
        let _ = Selector::parse(&spec.pod_selector).expect("validated selector parses");
    }
    for policy in &objects.cluster_ordered_policies {
        let spec = &policy.object.spec;
        let _ = serde_json::to_string(&policy.object);
        if has_error(&policy.object.metadata, "ClusterOrderedNetworkPolicy") {
            continue;
        }
        exercise(spec);
        let _ = Selector::parse(&spec.namespace_selector).expect("validated selector parses");
    }
});

fn exercise<S: OrderedSpec>(spec: &S) {
    for direction in [Direction::Ingress, Direction::Egress] {
        let _ = spec.isolates(direction);
        for rule in spec.rules(direction) {
            for peer in rule.peers {
                for selector in [&peer.pod_selector, &peer.namespace_selector]
                    .into_iter()
                    .flatten()
                {
                    let _ = Selector::parse(selector).expect("validated selector parses");
                }
                if let Some(block) = &peer.ip_block {
                    let net = parse_cidr(&block.cidr).expect("validated cidr parses").net;
                    for except in &block.except {
                        let ex = parse_cidr(except).expect("validated except parses").net;
                        assert!(net.contains(&ex) && ex.prefix_len() > net.prefix_len());
                    }
                }
            }
            for port in rule.ports {
                match (&port.port, port.end_port) {
                    (Some(IntOrString::Int(p)), end) => {
                        assert!((1..=65535).contains(p));
                        if let Some(end) = end {
                            assert!(*p <= end && end <= 65535);
                        }
                    }
                    (Some(IntOrString::String(name)), end) => {
                        assert!(end.is_none() && !name.is_empty() && name.len() <= 15);
                    }
                    (None, end) => assert!(end.is_none()),
                }
            }
        }
    }
}
