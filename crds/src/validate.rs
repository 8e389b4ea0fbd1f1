//! Semantic validation of the objects, beyond what the CRD schema can say.
//!
//! Every check reports a [`FieldError`] with the field path (`spec.ingress[0].ports[1].endPort`);
//! all problems of all objects are reported at once. The rules are listed in `docs/api.md`
//! ("Validation"). In short:
//!
//! * For `NetworkPolicy` the checks are exactly those of the Kubernetes API server (so that every
//!   policy the cluster accepts is enforced), plus warnings for things that are legal but
//!   probably not meant (rules of a direction missing from `policyTypes`, duplicate rules).
//! * Ordered policies get the same peer, port, CIDR and selector checks, plus: namespaced
//!   priority >= 0. A rule that can never decide a packet (one that matches exactly the same
//!   traffic as an earlier rule of the same list, or comes after a match-everything rule) is
//!   only a warning: the policy is valid and enforced, and the agent reports such rules in
//!   `status.shadowedRules`. A policy with no rules and no `defaultDeny` is warned about.
//! * CIDRs: `address/prefix` is required; IPv4 octets with leading zeros and IPv4-mapped IPv6
//!   addresses are errors (ambiguous); host bits set after the prefix are accepted like the API
//!   server does (the address is truncated to the network), with a warning.

use std::collections::HashMap;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, Service};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::cnp::{
    CNP_MAX_ITEMS, CNP_MAX_RULES, ClusterNetworkPolicy, CnpAction, CnpEgressPeer, CnpProtocol,
    KIND_CLUSTER_NETWORK_POLICY, NamespacedPod,
};
use crate::manifest::{
    ClusterObjects, KIND_CLUSTER_ORDERED, KIND_NAMESPACE, KIND_NETWORK_POLICY, KIND_NODE,
    KIND_ORDERED, KIND_POD, KIND_SERVICE, Loaded,
};
use crate::problem::{FieldError, ObjectRef, Problem};
use crate::selector::validate_label_selector;
use crate::syntax;
use crate::types::{
    ClusterOrderedNetworkPolicy, Direction, MAX_EXCEPT, MAX_MATCH_EXPRESSIONS, MAX_MATCH_LABELS,
    MAX_PEERS, MAX_PORTS, MAX_RULES, MAX_SELECTOR_VALUES, OrderedNetworkPolicy, OrderedSpec, Peer,
    Port, Protocol,
};

/// A parsed `ipBlock` CIDR.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParsedCidr {
    /// The network (host bits cleared).
    pub net: IpNet,
    /// Whether the text had bits set after the prefix (`10.0.0.1/8`).
    pub host_bits_set: bool,
}

/// Parses an `ipBlock` CIDR as ordnet accepts it (see the module documentation).
pub fn parse_cidr(text: &str) -> Result<ParsedCidr, String> {
    let Some((addr_text, prefix_text)) = text.split_once('/') else {
        return Err(format!(
            "{text:?} is not a CIDR: write address/prefix-length, e.g. 10.0.0.0/8 (a single address is 10.1.2.3/32)"
        ));
    };
    let addr: IpAddr = match addr_text.parse() {
        Ok(a) => a,
        Err(_) => {
            let leading_zero = addr_text.split('.').count() == 4
                && addr_text.split('.').any(|o| {
                    o.len() > 1 && o.starts_with('0') && o.bytes().all(|b| b.is_ascii_digit())
                });
            return Err(if leading_zero {
                format!(
                    "{text:?} is not a valid CIDR: IPv4 octets with leading zeros are ambiguous (octal or decimal?); remove the zeros"
                )
            } else {
                format!("{text:?} is not a valid CIDR: {addr_text:?} is not an IP address")
            });
        }
    };
    if let IpAddr::V6(v6) = addr
        && v6.to_ipv4_mapped().is_some()
    {
        return Err(format!(
            "{text:?} is not a valid CIDR: IPv4-mapped IPv6 addresses are not allowed; write the IPv4 form"
        ));
    }
    let max = if addr.is_ipv4() { 32 } else { 128 };
    // As the API server's CIDR parser: digits only, no leading zero (`/08`), at most `max`.
    let prefix: u8 = match prefix_text.parse::<u8>() {
        Ok(p)
            if p <= max
                && !prefix_text.is_empty()
                && prefix_text.bytes().all(|b| b.is_ascii_digit())
                && !(prefix_text.len() > 1 && prefix_text.starts_with('0')) =>
        {
            p
        }
        _ => {
            return Err(format!(
                "{text:?} is not a valid CIDR: the prefix length must be a number from 0 to {max}"
            ));
        }
    };
    let net = IpNet::new(addr, prefix)
        .map_err(|e| format!("{text:?} is not a valid CIDR: {e}"))?
        .trunc();
    Ok(ParsedCidr {
        net,
        host_bits_set: net.addr() != addr,
    })
}

fn join(base: &str, field: &str) -> String {
    if base.is_empty() {
        field.to_string()
    } else {
        format!("{base}.{field}")
    }
}

/// Checks `metadata`: name (DNS-1123 subdomain, or label for namespaces), namespace, labels.
fn validate_metadata(meta: &ObjectMeta, name_is_label: bool, out: &mut Vec<FieldError>) {
    match meta.name.as_deref() {
        None | Some("") => out.push(FieldError::error("metadata.name", "required")),
        Some(name) => {
            let check = if name_is_label {
                syntax::dns1123_label(name)
            } else {
                syntax::dns1123_subdomain(name)
            };
            if let Err(e) = check {
                out.push(FieldError::error("metadata.name", e));
            }
        }
    }
    if let Some(ns) = meta.namespace.as_deref()
        && let Err(e) = syntax::dns1123_label(ns)
    {
        out.push(FieldError::error("metadata.namespace", e));
    }
    for (key, value) in meta.labels.iter().flatten() {
        let field = format!("metadata.labels.{key}");
        if let Err(e) = syntax::label_key(key) {
            out.push(FieldError::error(field.clone(), e));
        }
        if let Err(e) = syntax::label_value(value) {
            out.push(FieldError::error(field, e));
        }
    }
}

fn validate_ip_block(cidr: &str, except: &[String], path: &str, out: &mut Vec<FieldError>) {
    let parsed = match parse_cidr(cidr) {
        Ok(p) => p,
        Err(e) => {
            out.push(FieldError::error(join(path, "cidr"), e));
            // The except entries cannot be checked against an invalid cidr; still check syntax.
            for (i, ex) in except.iter().enumerate() {
                if let Err(e) = parse_cidr(ex) {
                    out.push(FieldError::error(format!("{path}.except[{i}]"), e));
                }
            }
            return;
        }
    };
    if parsed.host_bits_set {
        out.push(FieldError::warning(
            join(path, "cidr"),
            format!(
                "{cidr:?} has bits set after the prefix; it is used as {}",
                parsed.net
            ),
        ));
    }
    for (i, ex) in except.iter().enumerate() {
        let field = format!("{path}.except[{i}]");
        let ex_parsed = match parse_cidr(ex) {
            Ok(p) => p,
            Err(e) => {
                out.push(FieldError::error(field, e));
                continue;
            }
        };
        let (net, exn) = (parsed.net, ex_parsed.net);
        if net.addr().is_ipv4() != exn.addr().is_ipv4() {
            out.push(FieldError::error(
                field,
                format!("{ex:?} is not of the same IP family as cidr {cidr:?}"),
            ));
        } else if !(net.contains(&exn) && exn.prefix_len() > net.prefix_len()) {
            out.push(FieldError::error(
                field,
                format!("{ex:?} must be a strict subset of cidr {}", parsed.net),
            ));
        } else if ex_parsed.host_bits_set {
            out.push(FieldError::warning(
                field,
                format!(
                    "{ex:?} has bits set after the prefix; it is used as {}",
                    ex_parsed.net
                ),
            ));
        }
    }
}

/// Checks one peer given as its three parts.
fn validate_peer_parts(
    pod_selector: Option<&LabelSelector>,
    namespace_selector: Option<&LabelSelector>,
    ip_block: Option<(&str, &[String])>,
    path: &str,
    out: &mut Vec<FieldError>,
) {
    let selectors = usize::from(pod_selector.is_some()) + usize::from(namespace_selector.is_some());
    if selectors == 0 && ip_block.is_none() {
        out.push(FieldError::error(
            path,
            "an empty peer matches nothing useful: set podSelector, namespaceSelector or ipBlock (to match every peer, leave out the whole from/to list)",
        ));
    }
    if selectors > 0 && ip_block.is_some() {
        out.push(FieldError::error(
            path,
            "ipBlock may not be combined with podSelector or namespaceSelector in one peer (use two peers to match either)",
        ));
    }
    if let Some(s) = pod_selector {
        validate_label_selector(s, &join(path, "podSelector"), out);
    }
    if let Some(s) = namespace_selector {
        validate_label_selector(s, &join(path, "namespaceSelector"), out);
    }
    if let Some((cidr, except)) = ip_block {
        validate_ip_block(cidr, except, &join(path, "ipBlock"), out);
    }
}

/// Checks one port given as its parts (`protocol` as text; `None` = default TCP).
fn validate_port_parts(
    protocol: Option<&str>,
    port: Option<&IntOrString>,
    end_port: Option<i32>,
    path: &str,
    out: &mut Vec<FieldError>,
) {
    if let Some(p) = protocol
        && Protocol::from_api(p).is_none()
    {
        let hint = match Protocol::from_api(&p.to_ascii_uppercase()) {
            Some(_) => " (protocol names are upper case)",
            None => "",
        };
        out.push(FieldError::error(
            join(path, "protocol"),
            format!("{p:?} is not supported: use TCP, UDP or SCTP{hint}"),
        ));
    }
    match port {
        Some(IntOrString::Int(n)) => {
            if let Err(e) = syntax::port_number(i64::from(*n)) {
                out.push(FieldError::error(join(path, "port"), e));
            }
            if let Some(end) = end_port {
                if let Err(e) = syntax::port_number(i64::from(end)) {
                    out.push(FieldError::error(join(path, "endPort"), e));
                } else if end < *n {
                    out.push(FieldError::error(
                        join(path, "endPort"),
                        format!("{end} must be greater than or equal to port ({n})"),
                    ));
                }
            }
        }
        Some(IntOrString::String(name)) => {
            if let Err(e) = syntax::port_name(name) {
                let message = if name.parse::<u32>().is_ok() {
                    format!(
                        "{name:?} is a string, not a number: write the port number without quotes"
                    )
                } else {
                    e
                };
                out.push(FieldError::error(join(path, "port"), message));
            }
            if end_port.is_some() {
                out.push(FieldError::error(
                    join(path, "endPort"),
                    format!(
                        "not allowed with the named port {name:?}: a range needs a numeric port"
                    ),
                ));
            }
        }
        None => {
            if end_port.is_some() {
                out.push(FieldError::error(
                    join(path, "endPort"),
                    "not allowed without port: a range needs a numeric port",
                ));
            }
        }
    }
}

/// For each item, the index of the first earlier item equal to it (compared by canonical JSON,
/// so that long lists stay linear).
fn first_equal<T: serde::Serialize>(items: impl Iterator<Item = T>) -> Vec<Option<usize>> {
    let mut first: HashMap<String, usize> = HashMap::new();
    items
        .enumerate()
        .map(|(i, item)| {
            let key = serde_json::to_string(&item).ok()?;
            match first.get(&key) {
                Some(&j) => Some(j),
                None => {
                    first.insert(key, i);
                    None
                }
            }
        })
        .collect()
}

fn too_many(field: String, n: usize, max: usize, out: &mut Vec<FieldError>) {
    if n > max {
        out.push(FieldError::error(
            field,
            format!("{n} entries: at most {max} are allowed"),
        ));
    }
}

/// The bounds the ordered kinds' CRD schema puts on a label selector (for its CEL cost budget;
/// a NetworkPolicy's selectors have none).
fn ordered_selector_bounds(s: &LabelSelector, path: &str, out: &mut Vec<FieldError>) {
    too_many(
        join(path, "matchLabels"),
        s.match_labels.as_ref().map_or(0, |m| m.len()),
        MAX_MATCH_LABELS,
        out,
    );
    let exprs = s.match_expressions.as_deref().unwrap_or_default();
    too_many(
        join(path, "matchExpressions"),
        exprs.len(),
        MAX_MATCH_EXPRESSIONS,
        out,
    );
    for (i, e) in exprs.iter().enumerate() {
        too_many(
            join(path, &format!("matchExpressions[{i}].values")),
            e.values.as_ref().map_or(0, |v| v.len()),
            MAX_SELECTOR_VALUES,
            out,
        );
    }
}

fn validate_ordered_peer(peer: &Peer, path: &str, out: &mut Vec<FieldError>) {
    for (name, s) in [
        ("podSelector", &peer.pod_selector),
        ("namespaceSelector", &peer.namespace_selector),
    ] {
        if let Some(s) = s {
            ordered_selector_bounds(s, &join(path, name), out);
        }
    }
    if let Some(block) = &peer.ip_block {
        too_many(
            format!("{path}.ipBlock.except"),
            block.except.len(),
            MAX_EXCEPT,
            out,
        );
    }
    validate_peer_parts(
        peer.pod_selector.as_ref(),
        peer.namespace_selector.as_ref(),
        peer.ip_block
            .as_ref()
            .map(|b| (b.cidr.as_str(), b.except.as_slice())),
        path,
        out,
    );
}

fn validate_ordered_port(port: &Port, path: &str, out: &mut Vec<FieldError>) {
    validate_port_parts(
        Some(port.protocol.as_str()),
        port.port.as_ref(),
        port.end_port,
        path,
        out,
    );
}

/// The checks shared by both ordered kinds; `cluster` selects the cluster-scoped rules.
fn validate_ordered_spec<S: OrderedSpec>(spec: &S, cluster: bool, out: &mut Vec<FieldError>) {
    if !cluster && spec.priority() < 0 {
        out.push(FieldError::error(
            "spec.priority",
            format!(
                "{} is negative: an OrderedNetworkPolicy needs priority >= 0 (only a ClusterOrderedNetworkPolicy may go below 0)",
                spec.priority()
            ),
        ));
    }
    for direction in [Direction::Ingress, Direction::Egress] {
        let peers_field = match direction {
            Direction::Ingress => "from",
            Direction::Egress => "to",
        };
        let rules = spec.rules(direction);
        too_many(
            format!("spec.{}", direction.field()),
            rules.len(),
            MAX_RULES,
            out,
        );
        let same_as = first_equal(rules.iter().map(|r| (r.peers, r.ports)));
        let match_all = rules
            .iter()
            .position(|r| r.peers.is_empty() && r.ports.is_empty());
        for rule in &rules {
            let base = format!("spec.{}[{}]", direction.field(), rule.index);
            too_many(
                format!("{base}.{peers_field}"),
                rule.peers.len(),
                MAX_PEERS,
                out,
            );
            too_many(format!("{base}.ports"), rule.ports.len(), MAX_PORTS, out);
            for (j, peer) in rule.peers.iter().enumerate() {
                validate_ordered_peer(peer, &format!("{base}.{peers_field}[{j}]"), out);
            }
            for (j, port) in rule.ports.iter().enumerate() {
                validate_ordered_port(port, &format!("{base}.ports[{j}]"), out);
            }
            // A rule can never decide a packet if an earlier rule of the same list matches
            // exactly the same traffic, or matches all traffic. Such a rule is unwise, not
            // meaningless: the policy is valid and enforced (the agent lists the rule in
            // `status.shadowedRules`), so this is a warning.
            if let Some(same) = same_as[rule.index].map(|i| &rules[i]) {
                let first = format!("spec.{}[{}]", direction.field(), same.index);
                out.push(FieldError::warning(
                    base,
                    if same.action == rule.action {
                        format!("duplicate of {first}: the earlier identical rule always matches first, so this one can never decide a packet")
                    } else {
                        format!(
                            "matches exactly the same traffic as {first} ({}), which always matches first, so this {} can never decide a packet",
                            same.action, rule.action
                        )
                    },
                ));
            } else if let Some(all) = match_all.filter(|&i| i < rule.index).map(|i| &rules[i]) {
                out.push(FieldError::warning(
                    base,
                    format!(
                        "can never decide a packet: spec.{}[{}] matches all traffic and comes first",
                        direction.field(),
                        all.index
                    ),
                ));
            }
        }
    }
    if spec.ingress().is_empty() && spec.egress().is_empty() && spec.default_deny().is_none() {
        out.push(FieldError::warning(
            "spec",
            "no ingress or egress rules and no defaultDeny: this policy has no effect",
        ));
    }
}

/// Validates an OrderedNetworkPolicy (metadata and spec).
pub fn validate_ordered_network_policy(policy: &OrderedNetworkPolicy) -> Vec<FieldError> {
    let mut out = Vec::new();
    validate_metadata(&policy.metadata, false, &mut out);
    validate_label_selector(&policy.spec.pod_selector, "spec.podSelector", &mut out);
    ordered_selector_bounds(&policy.spec.pod_selector, "spec.podSelector", &mut out);
    validate_ordered_spec(&policy.spec, false, &mut out);
    out
}

/// Validates a ClusterOrderedNetworkPolicy (metadata and spec).
pub fn validate_cluster_ordered_network_policy(
    policy: &ClusterOrderedNetworkPolicy,
) -> Vec<FieldError> {
    let mut out = Vec::new();
    validate_metadata(&policy.metadata, false, &mut out);
    validate_label_selector(
        &policy.spec.namespace_selector,
        "spec.namespaceSelector",
        &mut out,
    );
    validate_label_selector(&policy.spec.pod_selector, "spec.podSelector", &mut out);
    for (field, s) in [
        ("spec.namespaceSelector", &policy.spec.namespace_selector),
        ("spec.podSelector", &policy.spec.pod_selector),
    ] {
        ordered_selector_bounds(s, field, &mut out);
    }
    validate_ordered_spec(&policy.spec, true, &mut out);
    out
}

fn validate_np_peer(peer: &NetworkPolicyPeer, path: &str, out: &mut Vec<FieldError>) {
    validate_peer_parts(
        peer.pod_selector.as_ref(),
        peer.namespace_selector.as_ref(),
        peer.ip_block
            .as_ref()
            .map(|b| (b.cidr.as_str(), b.except.as_deref().unwrap_or_default())),
        path,
        out,
    );
}

fn validate_np_port(port: &NetworkPolicyPort, path: &str, out: &mut Vec<FieldError>) {
    validate_port_parts(
        port.protocol.as_deref(),
        port.port.as_ref(),
        port.end_port,
        path,
        out,
    );
}

/// Validates a standard NetworkPolicy as the API server does, plus warnings.
pub fn validate_network_policy(policy: &NetworkPolicy) -> Vec<FieldError> {
    let mut out = Vec::new();
    validate_metadata(&policy.metadata, false, &mut out);
    let Some(spec) = &policy.spec else {
        return out;
    };
    if let Some(sel) = &spec.pod_selector {
        validate_label_selector(sel, "spec.podSelector", &mut out);
    }
    let types = spec.policy_types.as_deref();
    if let Some(types) = types {
        if types.len() > 2 {
            out.push(FieldError::error(
                "spec.policyTypes",
                "may not list more than two policy types (Ingress, Egress)",
            ));
        }
        for (i, t) in types.iter().enumerate() {
            if t != "Ingress" && t != "Egress" {
                out.push(FieldError::error(
                    format!("spec.policyTypes[{i}]"),
                    format!("{t:?} is not supported: use Ingress or Egress"),
                ));
            }
        }
    }
    let ingress = spec.ingress.as_deref().unwrap_or_default();
    let egress = spec.egress.as_deref().unwrap_or_default();
    let ingress_same = first_equal(ingress.iter());
    let egress_same = first_equal(egress.iter());
    for (i, rule) in ingress.iter().enumerate() {
        for (j, peer) in rule.from.iter().flatten().enumerate() {
            validate_np_peer(peer, &format!("spec.ingress[{i}].from[{j}]"), &mut out);
        }
        for (j, port) in rule.ports.iter().flatten().enumerate() {
            validate_np_port(port, &format!("spec.ingress[{i}].ports[{j}]"), &mut out);
        }
        if let Some(first) = ingress_same[i] {
            out.push(FieldError::warning(
                format!("spec.ingress[{i}]"),
                format!("duplicate of spec.ingress[{first}]"),
            ));
        }
    }
    for (i, rule) in egress.iter().enumerate() {
        for (j, peer) in rule.to.iter().flatten().enumerate() {
            validate_np_peer(peer, &format!("spec.egress[{i}].to[{j}]"), &mut out);
        }
        for (j, port) in rule.ports.iter().flatten().enumerate() {
            validate_np_port(port, &format!("spec.egress[{i}].ports[{j}]"), &mut out);
        }
        if let Some(first) = egress_same[i] {
            out.push(FieldError::warning(
                format!("spec.egress[{i}]"),
                format!("duplicate of spec.egress[{first}]"),
            ));
        }
    }
    if let Some(types) = types {
        if !ingress.is_empty() && !types.iter().any(|t| t == "Ingress") {
            out.push(FieldError::warning(
                "spec.ingress",
                "ignored: policyTypes does not include Ingress",
            ));
        }
        if !egress.is_empty() && !types.iter().any(|t| t == "Egress") {
            out.push(FieldError::warning(
                "spec.egress",
                "ignored: policyTypes does not include Egress",
            ));
        }
    }
    out
}

fn validate_container_ports(containers: &[Container], list: &str, out: &mut Vec<FieldError>) {
    for (i, c) in containers.iter().enumerate() {
        for (j, p) in c.ports.iter().flatten().enumerate() {
            let base = format!("spec.{list}[{i}].ports[{j}]");
            if let Err(e) = syntax::port_number(i64::from(p.container_port)) {
                out.push(FieldError::error(format!("{base}.containerPort"), e));
            }
            if let Some(proto) = p.protocol.as_deref()
                && Protocol::from_api(proto).is_none()
            {
                out.push(FieldError::error(
                    format!("{base}.protocol"),
                    format!("{proto:?} is not supported: use TCP, UDP or SCTP"),
                ));
            }
            if let Some(name) = p.name.as_deref()
                && let Err(e) = syntax::port_name(name)
            {
                out.push(FieldError::error(format!("{base}.name"), e));
            }
        }
    }
}

/// The pod's IPs as ordnet reads them: `status.podIP` first, then the other `status.podIPs`
/// (duplicates and invalid entries skipped; validation reports the invalid ones).
pub fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = Vec::new();
    let candidates = status
        .pod_ip
        .iter()
        .chain(status.pod_ips.iter().flatten().map(|p| &p.ip));
    for ip in candidates.filter_map(|s| s.parse::<IpAddr>().ok()) {
        if !ips.contains(&ip) {
            ips.push(ip);
        }
    }
    ips
}

/// Whether the pod has terminated (`status.phase` `Succeeded` or `Failed`). A terminated pod is
/// not an endpoint: it holds no identity and no address (its IPs may already belong to a live
/// pod, and Kubernetes NetworkPolicy implementations leave terminated pods out too).
pub fn pod_is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Validates a Pod: metadata, IPs and container ports.
pub fn validate_pod(pod: &Pod) -> Vec<FieldError> {
    let mut out = Vec::new();
    validate_metadata(&pod.metadata, false, &mut out);
    if let Some(spec) = &pod.spec {
        validate_container_ports(&spec.containers, "containers", &mut out);
        if let Some(init) = &spec.init_containers {
            validate_container_ports(init, "initContainers", &mut out);
        }
    }
    let host_network = pod
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false);
    let status = pod.status.as_ref();
    let pod_ip = status
        .and_then(|s| s.pod_ip.as_deref())
        .filter(|s| !s.is_empty());
    let mut primary = None;
    if let Some(text) = pod_ip {
        match text.parse::<IpAddr>() {
            Ok(ip) => primary = Some(ip),
            Err(_) => out.push(FieldError::error(
                "status.podIP",
                format!("{text:?} is not an IP address"),
            )),
        }
    }
    let pod_ips = status
        .and_then(|s| s.pod_ips.as_deref())
        .unwrap_or_default();
    let mut families = [0usize; 2];
    for (i, entry) in pod_ips.iter().enumerate() {
        let field = format!("status.podIPs[{i}].ip");
        match entry.ip.parse::<IpAddr>() {
            Ok(ip) => {
                families[usize::from(ip.is_ipv6())] += 1;
                if i == 0
                    && let Some(p) = primary
                    && p != ip
                {
                    out.push(FieldError::error(
                        field,
                        format!("{ip} must equal status.podIP ({p}): the first pod IP is the primary one"),
                    ));
                }
            }
            Err(_) => out.push(FieldError::error(
                field,
                format!("{:?} is not an IP address", entry.ip),
            )),
        }
    }
    if families.iter().any(|&n| n > 1) {
        out.push(FieldError::error(
            "status.podIPs",
            "at most one IPv4 and one IPv6 address",
        ));
    }
    if pod_ip.is_none() && pod_ips.is_empty() && !host_network {
        out.push(FieldError::warning(
            "status.podIP",
            "not set: the pod has no address yet, so it is not an endpoint",
        ));
    }
    out
}

/// Validates a Service: what kube-proxy (and ordnet) read of it: `spec.clusterIP(s)` (an
/// address, `None` for a headless Service, or empty), `spec.externalIPs`, the ports (number
/// 1-65535, protocol, `targetPort` a number or an IANA service name, `nodePort`), and the
/// selector's labels.
pub fn validate_service(svc: &Service) -> Vec<FieldError> {
    let mut out = Vec::new();
    validate_metadata(&svc.metadata, false, &mut out);
    let Some(spec) = &svc.spec else {
        return out;
    };
    let address = |text: &str, field: String, out: &mut Vec<FieldError>| {
        if text.parse::<IpAddr>().is_err() {
            out.push(FieldError::error(
                field,
                format!("{text:?} is not an IP address"),
            ));
        }
    };
    if let Some(ip) = spec.cluster_ip.as_deref()
        && !ip.is_empty()
        && ip != "None"
    {
        address(ip, "spec.clusterIP".into(), &mut out);
    }
    for (i, ip) in spec.cluster_ips.iter().flatten().enumerate() {
        if ip != "None" {
            address(ip, format!("spec.clusterIPs[{i}]"), &mut out);
        }
    }
    for (i, ip) in spec.external_ips.iter().flatten().enumerate() {
        address(ip, format!("spec.externalIPs[{i}]"), &mut out);
    }
    for (k, v) in spec.selector.iter().flatten() {
        let field = format!("spec.selector.{k}");
        if let Err(e) = syntax::label_key(k) {
            out.push(FieldError::error(field.clone(), e));
        }
        if let Err(e) = syntax::label_value(v) {
            out.push(FieldError::error(field, e));
        }
    }
    for (i, port) in spec.ports.iter().flatten().enumerate() {
        let base = format!("spec.ports[{i}]");
        if let Err(e) = syntax::port_number(i64::from(port.port)) {
            out.push(FieldError::error(format!("{base}.port"), e));
        }
        if let Some(p) = port.protocol.as_deref()
            && Protocol::from_api(p).is_none()
        {
            out.push(FieldError::error(
                format!("{base}.protocol"),
                format!("{p:?} is not supported: use TCP, UDP or SCTP"),
            ));
        }
        match &port.target_port {
            Some(IntOrString::Int(n)) => {
                if let Err(e) = syntax::port_number(i64::from(*n)) {
                    out.push(FieldError::error(format!("{base}.targetPort"), e));
                }
            }
            Some(IntOrString::String(name)) => {
                if let Err(e) = syntax::port_name(name) {
                    out.push(FieldError::error(format!("{base}.targetPort"), e));
                }
            }
            None => {}
        }
        if let Some(n) = port.node_port
            && let Err(e) = syntax::port_number(i64::from(n))
        {
            out.push(FieldError::error(format!("{base}.nodePort"), e));
        }
    }
    out
}

/// The port a ClusterNetworkPolicy protocol entry matches, checked: `(protocol, first, last)`,
/// or the named port, or the problem. `Ok(None)` for an entry with no field ordnet knows (a
/// newer API version: enforced fail-closed).
pub fn cnp_protocol(p: &CnpProtocol) -> Result<Option<CnpPortMatch>, String> {
    let set = [
        p.tcp.as_ref().map(|x| (Protocol::Tcp, x)),
        p.udp.as_ref().map(|x| (Protocol::Udp, x)),
        p.sctp.as_ref().map(|x| (Protocol::Sctp, x)),
    ];
    let known = set.iter().flatten().count() + usize::from(p.destination_named_port.is_some());
    if known > 1 {
        return Err("exactly one of tcp, udp, sctp or destinationNamedPort may be set".into());
    }
    if let Some(name) = &p.destination_named_port {
        if name.is_empty() {
            return Err("destinationNamedPort: must not be empty".into());
        }
        return Ok(Some(CnpPortMatch::Named(name.clone())));
    }
    let Some((proto, ports)) = set.into_iter().flatten().next() else {
        return Ok(None);
    };
    let field = proto.as_str().to_ascii_lowercase();
    let Some(port) = &ports.destination_port else {
        return Err(format!("{field}.destinationPort: required"));
    };
    let number = |n: i32, f: &str| {
        u16::try_from(n).ok().filter(|&n| n >= 1).ok_or_else(|| {
            format!("{field}.destinationPort.{f}: {n} is not a port number (1-65535)")
        })
    };
    match (port.number, &port.range) {
        (Some(n), None) => {
            let n = number(n, "number")?;
            Ok(Some(CnpPortMatch::Ports(proto, n, n)))
        }
        (None, Some(r)) => {
            let (start, end) = (number(r.start, "range.start")?, number(r.end, "range.end")?);
            if start >= end {
                return Err(format!(
                    "{field}.destinationPort.range: start ({start}) must be less than end ({end})"
                ));
            }
            Ok(Some(CnpPortMatch::Ports(proto, start, end)))
        }
        _ => Err(format!(
            "{field}.destinationPort: exactly one of number or range must be set"
        )),
    }
}

/// What one ClusterNetworkPolicy protocol entry matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CnpPortMatch {
    /// A protocol and an inclusive port range.
    Ports(Protocol, u16, u16),
    /// A named container port of the destination pod.
    Named(String),
}

/// What one ClusterNetworkPolicy peer is.
#[derive(Clone, Debug, PartialEq)]
pub enum CnpPeerKind<'a> {
    /// `namespaces`.
    Namespaces(&'a LabelSelector),
    /// `pods`.
    Pods(&'a NamespacedPod),
    /// `nodes`.
    Nodes(&'a LabelSelector),
    /// `networks`.
    Networks(&'a [String]),
    /// `domainNames` (not supported: fail-closed).
    DomainNames,
    /// No field ordnet knows (fail-closed); the unknown field names.
    Unknown(Vec<&'a str>),
}

/// The kind of a peer; `Err` when more than one field is set.
pub fn cnp_peer(p: &CnpEgressPeer) -> Result<CnpPeerKind<'_>, String> {
    let mut kinds = Vec::new();
    if let Some(s) = &p.namespaces {
        kinds.push(CnpPeerKind::Namespaces(s));
    }
    if let Some(s) = &p.pods {
        kinds.push(CnpPeerKind::Pods(s));
    }
    if let Some(s) = &p.nodes {
        kinds.push(CnpPeerKind::Nodes(s));
    }
    if let Some(n) = &p.networks {
        kinds.push(CnpPeerKind::Networks(n));
    }
    if p.domain_names.is_some() {
        kinds.push(CnpPeerKind::DomainNames);
    }
    match kinds.len() {
        0 => Ok(CnpPeerKind::Unknown(
            p.other.keys().map(String::as_str).collect(),
        )),
        1 => Ok(kinds.remove(0)),
        _ => {
            Err("exactly one of namespaces, pods, nodes, networks or domainNames may be set".into())
        }
    }
}

/// Validates an upstream ClusterNetworkPolicy: what its CRD checks (ranges, exactly-one fields,
/// CIDRs without host bits, port ranges, named ports only towards pods), so that manifests the
/// API server would refuse are refused here too. Peers ordnet cannot enforce (`domainNames`,
/// unknown fields) are warnings: the rule is enforced fail-closed.
pub fn validate_cluster_network_policy(policy: &ClusterNetworkPolicy) -> Vec<FieldError> {
    let mut out = Vec::new();
    validate_metadata(&policy.metadata, false, &mut out);
    let spec = &policy.spec;
    if !(0..=1000).contains(&spec.priority) {
        out.push(FieldError::error(
            "spec.priority",
            format!("{} is out of range: 0-1000", spec.priority),
        ));
    }
    let pods = |p: &NamespacedPod, path: &str, out: &mut Vec<FieldError>| {
        validate_label_selector(
            &p.namespace_selector,
            &format!("{path}.namespaceSelector"),
            out,
        );
        validate_label_selector(&p.pod_selector, &format!("{path}.podSelector"), out);
    };
    match (&spec.subject.namespaces, &spec.subject.pods) {
        (Some(s), None) => validate_label_selector(s, "spec.subject.namespaces", &mut out),
        (None, Some(p)) => pods(p, "spec.subject.pods", &mut out),
        _ => out.push(FieldError::error(
            "spec.subject",
            "exactly one of namespaces or pods must be set",
        )),
    }
    for direction in [Direction::Ingress, Direction::Egress] {
        let list = direction.field();
        let peers_field = match direction {
            Direction::Ingress => "from",
            Direction::Egress => "to",
        };
        let rules = spec.rules(direction);
        too_many(format!("spec.{list}"), rules.len(), CNP_MAX_RULES, &mut out);
        for rule in &rules {
            let base = format!("spec.{list}[{}]", rule.index);
            if let Some(name) = rule.name
                && name.len() > 100
            {
                out.push(FieldError::error(
                    format!("{base}.name"),
                    "longer than 100 characters",
                ));
            }
            if rule.peers.is_empty() {
                out.push(FieldError::error(
                    format!("{base}.{peers_field}"),
                    "at least one peer is required",
                ));
            }
            too_many(
                format!("{base}.{peers_field}"),
                rule.peers.len(),
                CNP_MAX_ITEMS,
                &mut out,
            );
            let mut address_peer = false;
            for (j, peer) in rule.peers.iter().enumerate() {
                let path = format!("{base}.{peers_field}[{j}]");
                match cnp_peer(peer) {
                    Err(e) => out.push(FieldError::error(path, e)),
                    Ok(CnpPeerKind::Namespaces(s)) => {
                        validate_label_selector(s, &format!("{path}.namespaces"), &mut out)
                    }
                    Ok(CnpPeerKind::Pods(p)) => pods(p, &format!("{path}.pods"), &mut out),
                    Ok(CnpPeerKind::Nodes(s)) => {
                        address_peer = true;
                        validate_label_selector(s, &format!("{path}.nodes"), &mut out)
                    }
                    Ok(CnpPeerKind::Networks(nets)) => {
                        address_peer = true;
                        if nets.is_empty() {
                            out.push(FieldError::error(
                                format!("{path}.networks"),
                                "at least one CIDR is required",
                            ));
                        }
                        too_many(
                            format!("{path}.networks"),
                            nets.len(),
                            CNP_MAX_ITEMS,
                            &mut out,
                        );
                        for (k, n) in nets.iter().enumerate() {
                            let f = format!("{path}.networks[{k}]");
                            match parse_cidr(n) {
                                Err(e) => out.push(FieldError::error(f, e)),
                                Ok(c) if c.host_bits_set => out.push(FieldError::error(
                                    f,
                                    format!("{n:?} has bits set after the prefix: write {}", c.net),
                                )),
                                Ok(_) => {}
                            }
                        }
                    }
                    Ok(CnpPeerKind::DomainNames) => {
                        address_peer = true;
                        out.push(FieldError::warning(
                            format!("{path}.domainNames"),
                            fail_closed_text(
                                rule.action,
                                direction,
                                "domainNames peers are not supported by ordnet",
                            ),
                        ))
                    }
                    Ok(CnpPeerKind::Unknown(fields)) if fields.is_empty() => out.push(
                        FieldError::error(path, "an empty peer: set exactly one field"),
                    ),
                    Ok(CnpPeerKind::Unknown(fields)) => out.push(FieldError::warning(
                        path,
                        fail_closed_text(
                            rule.action,
                            direction,
                            &format!(
                                "unknown peer field {} (a newer API version?)",
                                fields.join(", ")
                            ),
                        ),
                    )),
                }
            }
            if let Some(protocols) = rule.protocols {
                if protocols.is_empty() {
                    out.push(FieldError::error(
                        format!("{base}.protocols"),
                        "at least one entry is required (leave protocols out to match all traffic)",
                    ));
                }
                too_many(
                    format!("{base}.protocols"),
                    protocols.len(),
                    CNP_MAX_ITEMS,
                    &mut out,
                );
                for (j, p) in protocols.iter().enumerate() {
                    let path = format!("{base}.protocols[{j}]");
                    match cnp_protocol(p) {
                        Err(e) => out.push(FieldError::error(path, e)),
                        Ok(Some(CnpPortMatch::Named(_))) if address_peer => {
                            out.push(FieldError::error(
                                format!("{path}.destinationNamedPort"),
                                "networks/nodes/domainNames peers cannot be combined with a named port: they have no named ports",
                            ))
                        }
                        Ok(Some(_)) => {}
                        Ok(None) if p.other.is_empty() => out.push(FieldError::error(
                            path,
                            "an empty entry: set exactly one of tcp, udp, sctp or destinationNamedPort",
                        )),
                        Ok(None) => out.push(FieldError::warning(
                            path,
                            fail_closed_text(
                                rule.action,
                                direction,
                                &format!(
                                    "unknown protocol field {} (a newer API version?)",
                                    p.other.keys().cloned().collect::<Vec<_>>().join(", ")
                                ),
                            ),
                        )),
                    }
                }
            }
        }
    }
    out
}

/// The text of a rule enforced fail-closed: an Accept matches nothing, a Deny or Pass denies
/// everything in its direction.
pub fn fail_closed_text(action: CnpAction, direction: Direction, why: &str) -> String {
    match action {
        CnpAction::Accept => {
            format!("{why}: this Accept rule is enforced fail-closed and matches nothing")
        }
        CnpAction::Deny | CnpAction::Pass => format!(
            "{why}: this {} rule is enforced fail-closed and denies all {}",
            action.as_str(),
            direction.field()
        ),
    }
}

/// Validates a Node: its metadata (its addresses are read as given; those that are not IP
/// addresses, such as `Hostname`, are not used).
pub fn validate_node(node: &k8s_openapi::api::core::v1::Node) -> Vec<FieldError> {
    let mut out = Vec::new();
    validate_metadata(&node.metadata, false, &mut out);
    out
}

/// Validates a Namespace: name (DNS-1123 label) and labels.
pub fn validate_namespace(namespace: &Namespace) -> Vec<FieldError> {
    let mut out = Vec::new();
    validate_metadata(&namespace.metadata, true, &mut out);
    out
}

fn meta_ref(kind: &str, meta: &ObjectMeta) -> ObjectRef {
    let name = meta.name.clone().unwrap_or_default();
    match &meta.namespace {
        Some(ns) => ObjectRef::namespaced(kind, ns, &name),
        None => ObjectRef::cluster(kind, &name),
    }
}

/// The reference of a loaded object of `kind`.
pub fn object_ref<T: kube::Resource<DynamicType = ()>>(object: &T) -> ObjectRef {
    meta_ref(&T::kind(&()), object.meta())
}

fn push_all<T>(
    kind: &str,
    items: &[Loaded<T>],
    meta: impl Fn(&T) -> &ObjectMeta,
    validate: impl Fn(&T) -> Vec<FieldError>,
    out: &mut Vec<Problem>,
) {
    for item in items {
        let errors = validate(&item.object);
        if errors.is_empty() {
            continue;
        }
        let object = meta_ref(kind, meta(&item.object));
        out.extend(
            errors
                .into_iter()
                .map(|e| Problem::from_field_error(e, item.source.as_ref(), &object)),
        );
    }
}

/// Validates every object, and the pods against each other (no two pods, other than
/// host-network pods, may share an IP). Implied namespaces are not checked.
pub fn validate_objects(objects: &ClusterObjects) -> Vec<Problem> {
    let mut out = Vec::new();
    let given_namespaces: Vec<Loaded<Namespace>> = objects
        .namespaces
        .iter()
        .filter(|n| n.source.is_some())
        .cloned()
        .collect();
    push_all(
        KIND_NAMESPACE,
        &given_namespaces,
        |o| &o.metadata,
        validate_namespace,
        &mut out,
    );
    push_all(
        KIND_POD,
        &objects.pods,
        |o| &o.metadata,
        validate_pod,
        &mut out,
    );
    push_all(
        KIND_NETWORK_POLICY,
        &objects.network_policies,
        |o| &o.metadata,
        validate_network_policy,
        &mut out,
    );
    push_all(
        KIND_ORDERED,
        &objects.ordered_policies,
        |o| &o.metadata,
        validate_ordered_network_policy,
        &mut out,
    );
    push_all(
        KIND_CLUSTER_ORDERED,
        &objects.cluster_ordered_policies,
        |o| &o.metadata,
        validate_cluster_ordered_network_policy,
        &mut out,
    );
    push_all(
        KIND_SERVICE,
        &objects.services,
        |o| &o.metadata,
        validate_service,
        &mut out,
    );
    push_all(
        KIND_CLUSTER_NETWORK_POLICY,
        &objects.cluster_network_policies,
        |o| &o.metadata,
        validate_cluster_network_policy,
        &mut out,
    );
    push_all(
        KIND_NODE,
        &objects.nodes,
        |o| &o.metadata,
        validate_node,
        &mut out,
    );
    // Two pods with one address would make every verdict about that address ambiguous.
    let mut owners: HashMap<IpAddr, ObjectRef> = HashMap::new();
    for pod in &objects.pods {
        let host_network = pod
            .object
            .spec
            .as_ref()
            .and_then(|s| s.host_network)
            .unwrap_or(false);
        // Host-network pods use the node's address; terminated pods hold none (their IPs are
        // free for reuse by live pods).
        if host_network || pod_is_terminal(&pod.object) {
            continue;
        }
        let me = meta_ref(KIND_POD, &pod.object.metadata);
        for ip in pod_ips(&pod.object) {
            if let Some(other) = owners.get(&ip) {
                out.push(Problem::at(
                    crate::problem::Severity::Error,
                    pod.source.as_ref(),
                    Some(me.clone()),
                    Some("status.podIP".into()),
                    format!(
                        "{ip} is also the address of pod {}/{}",
                        other.namespace.as_deref().unwrap_or_default(),
                        other.name
                    ),
                ));
            } else {
                owners.insert(ip, me.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
