//! Security identities (SEMANTICS.md §4).
//!
//! An identity is allocated per distinct [`Signature`]. A pod address's signature is everything
//! a selector in use can tell about it: namespace labels, pod labels, the CIDR prefixes in use
//! that contain the address, and what each named port used by an egress rule resolves to on the
//! pod. Two addresses with one signature are indistinguishable to every selector, so they can
//! share one identity; two addresses that some selector tells apart never do.

use std::collections::{BTreeMap, BTreeSet};

use crate::fast::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use ordnet_mapstate::{Identity, Protocol};
use serde::Serialize;

use crate::model::Labels;
use ordnet_crds::NAMESPACE_NAME_LABEL;

/// The signature of a pod address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct PodSig {
    /// The labels of the pod's namespace (with `kubernetes.io/metadata.name` always set).
    pub namespace_labels: Arc<Labels>,
    /// The pod's labels.
    pub labels: Arc<Labels>,
    /// The CIDR prefixes in use that contain the address, sorted.
    pub cidrs: Vec<IpNet>,
    /// For each (name, protocol) used as a named port by an egress rule and served by the pod:
    /// the port numbers it resolves to. Names the pod does not serve are left out.
    pub named_ports: Vec<((String, Protocol), Vec<u16>)>,
}

impl PodSig {
    /// The namespace name (from the `kubernetes.io/metadata.name` label).
    pub fn namespace(&self) -> &str {
        self.namespace_labels
            .get(NAMESPACE_NAME_LABEL)
            .map(String::as_str)
            .unwrap_or("")
    }

    /// What the named port `(name, proto)` resolves to (empty when not served or not in use).
    pub fn resolve(&self, name: &str, proto: Protocol) -> &[u16] {
        self.named_ports
            .iter()
            .find(|((n, p), _)| n == name && *p == proto)
            .map(|(_, v)| v.as_slice())
            .unwrap_or(&[])
    }
}

/// What an identity stands for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Signature {
    /// A pod address.
    Pod(Arc<PodSig>),
    /// The external addresses whose longest containing prefix in use is this one (an ipBlock
    /// `cidr` or `except` entry).
    Cidr(IpNet),
    /// The external addresses that no prefix in use contains.
    World,
}

/// The kind of an identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IdentityKind {
    /// Pod addresses of one [`PodSig`].
    Pod,
    /// External addresses whose longest containing prefix in use is this one.
    Cidr(IpNet),
    /// External addresses that no prefix in use contains.
    World,
}

/// What an identity stands for, for `trace` and `dump`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IdentityInfo {
    /// The identity number (never 0: that is the datapath wildcard).
    pub id: Identity,
    /// What kind of addresses it stands for.
    pub kind: IdentityKind,
    /// Pod labels (empty for CIDR and world identities).
    pub labels: BTreeMap<String, String>,
    /// Namespace labels (empty for CIDR and world identities).
    pub namespace_labels: BTreeMap<String, String>,
    /// `ns/pod` of the pods whose addresses have this identity, or the CIDR text.
    pub members: Vec<String>,
}

impl IdentityInfo {
    /// What the identity stands for, as people read it in `trace` and `dump`:
    /// `prod/app=api [prod/api]` (namespace / pod labels [up to three members]), `cidr 10.0.0.0/8`,
    /// `world`.
    pub fn label(&self) -> String {
        match &self.kind {
            IdentityKind::Pod => {
                let ns = self
                    .namespace_labels
                    .get("kubernetes.io/metadata.name")
                    .map(String::as_str)
                    .unwrap_or("?");
                let labels = if self.labels.is_empty() {
                    "(no labels)".to_string()
                } else {
                    self.labels
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(",")
                };
                const SHOWN: usize = 3;
                let mut members = self.members.iter().take(SHOWN).cloned().collect::<Vec<_>>();
                if self.members.len() > SHOWN {
                    members.push(format!("+{} more", self.members.len() - SHOWN));
                }
                format!("{ns}/{labels} [{}]", members.join(", "))
            }
            IdentityKind::Cidr(net) => format!("cidr {net}"),
            IdentityKind::World => "world".to_string(),
        }
    }
}

/// A named container port of a pod: (name, protocol, number).
pub type NamedPort = (String, Protocol, u16);

/// The numbers `(name, proto)` resolves to among a pod's container ports (sorted, distinct).
pub fn resolve_named(ports: &[NamedPort], name: &str, proto: Protocol) -> Vec<u16> {
    let mut out: Vec<u16> = ports
        .iter()
        .filter(|(n, p, _)| n == name && *p == proto)
        .map(|(_, _, num)| *num)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The signature of one pod address given the CIDRs and egress named ports in use.
pub fn pod_signature(
    ns_labels: &Arc<Labels>,
    labels: &Arc<Labels>,
    ports: &[NamedPort],
    addr: IpAddr,
    cidrs_in_use: &BTreeMap<IpNet, u32>,
    named_in_use: &BTreeMap<(String, Protocol), u32>,
) -> PodSig {
    let cidrs = containing_prefixes(addr, cidrs_in_use);
    let mut named_ports = Vec::new();
    if !ports.is_empty() {
        for (name, proto) in named_in_use.keys() {
            let r = resolve_named(ports, name, *proto);
            if !r.is_empty() {
                named_ports.push(((name.clone(), *proto), r));
            }
        }
    }
    PodSig {
        namespace_labels: ns_labels.clone(),
        labels: labels.clone(),
        cidrs,
        named_ports,
    }
}

/// The prefixes of `set` that contain `addr`, sorted.
pub fn containing_prefixes<V>(addr: IpAddr, set: &BTreeMap<IpNet, V>) -> Vec<IpNet> {
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let mut out = Vec::new();
    if set.is_empty() {
        return out;
    }
    for len in 0..=max {
        if let Ok(net) = IpNet::new(addr, len) {
            let net = net.trunc();
            if set.contains_key(&net) {
                out.push(net);
            }
        }
    }
    out.sort();
    out
}

/// The longest prefix of `set` that contains `addr`.
pub fn longest_prefix<V: Copy>(addr: IpAddr, set: &BTreeMap<IpNet, V>) -> Option<(IpNet, V)> {
    if set.is_empty() {
        return None;
    }
    let max = if addr.is_ipv4() { 32u8 } else { 128 };
    for len in (0..=max).rev() {
        if let Ok(net) = IpNet::new(addr, len) {
            let net = net.trunc();
            if let Some(v) = set.get(&net) {
                return Some((net, *v));
            }
        }
    }
    None
}

#[derive(Debug, Clone)]
pub(crate) struct IdRec {
    pub sig: Signature,
    pub info: IdentityInfo,
    /// Member -> number of addresses of that member with this identity.
    pub members: BTreeMap<String, u32>,
    pub refs: u32,
}

/// The identity allocator and index.
#[derive(Debug, Clone, Default)]
pub(crate) struct Identities {
    by_sig: HashMap<Signature, Identity>,
    pub recs: BTreeMap<Identity, IdRec>,
    next: Identity,
    /// Pod identities per namespace name.
    pub by_namespace: HashMap<String, BTreeSet<Identity>>,
    /// Pod identities whose addresses lie in at least one CIDR prefix in use.
    pub pods_in_cidrs: BTreeSet<Identity>,
    /// CIDR identities (and world).
    pub non_pod: BTreeSet<Identity>,
}

impl Identities {
    pub fn sig(&self, id: Identity) -> Option<&Signature> {
        self.recs.get(&id).map(|r| &r.sig)
    }

    pub fn info(&self, id: Identity) -> Option<&IdentityInfo> {
        self.recs.get(&id).map(|r| &r.info)
    }

    /// Takes a reference on the identity of `sig` for `member`, allocating it if needed.
    /// Returns the identity and whether it is new.
    pub fn acquire(&mut self, sig: Signature, member: &str) -> (Identity, bool) {
        if let Some(&id) = self.by_sig.get(&sig) {
            let rec = self.recs.get_mut(&id).expect("indexed");
            rec.refs += 1;
            let n = rec.members.entry(member.to_string()).or_default();
            *n += 1;
            if *n == 1 {
                rec.info.members = rec.members.keys().cloned().collect();
            }
            return (id, false);
        }
        self.next = self.next.wrapping_add(1).max(1);
        while self.recs.contains_key(&self.next) {
            self.next = self.next.wrapping_add(1).max(1);
        }
        let id = self.next;
        let (kind, labels, namespace_labels) = match &sig {
            Signature::Pod(p) => (
                IdentityKind::Pod,
                (*p.labels).clone(),
                (*p.namespace_labels).clone(),
            ),
            Signature::Cidr(net) => (IdentityKind::Cidr(*net), Labels::new(), Labels::new()),
            Signature::World => (IdentityKind::World, Labels::new(), Labels::new()),
        };
        match &sig {
            Signature::Pod(p) => {
                self.by_namespace
                    .entry(p.namespace().to_string())
                    .or_default()
                    .insert(id);
                if !p.cidrs.is_empty() {
                    self.pods_in_cidrs.insert(id);
                }
            }
            _ => {
                self.non_pod.insert(id);
            }
        }
        let members = BTreeMap::from([(member.to_string(), 1)]);
        self.recs.insert(
            id,
            IdRec {
                sig: sig.clone(),
                info: IdentityInfo {
                    id,
                    kind,
                    labels,
                    namespace_labels,
                    members: members.keys().cloned().collect(),
                },
                members,
                refs: 1,
            },
        );
        self.by_sig.insert(sig, id);
        (id, true)
    }

    /// Gives identity `id` the pod signature `sig` in place of its own, keeping its number, its
    /// members and references: for a change that moves **every** address of `id` to `sig`, a
    /// signature no identity has, and that only changes labels (namespace, CIDR prefixes and
    /// named ports as they were). The selectors that tell the two signatures apart then gain or
    /// lose `id`; nothing else about it changes (no address changes identity). Returns the
    /// signature it had, or `None` (nothing changed) when `id` is not such a pod identity or
    /// `sig` is taken.
    pub fn relabel(&mut self, id: Identity, sig: Arc<PodSig>) -> Option<Signature> {
        let new = Signature::Pod(sig.clone());
        if self.by_sig.contains_key(&new) {
            return None;
        }
        let rec = self.recs.get_mut(&id)?;
        let Signature::Pod(old) = &rec.sig else {
            return None;
        };
        if old.namespace() != sig.namespace()
            || old.cidrs != sig.cidrs
            || old.named_ports != sig.named_ports
        {
            return None;
        }
        let old = std::mem::replace(&mut rec.sig, new.clone());
        rec.info.labels = (*sig.labels).clone();
        rec.info.namespace_labels = (*sig.namespace_labels).clone();
        self.by_sig.remove(&old);
        self.by_sig.insert(new, id);
        Some(old)
    }

    /// Drops a reference of `member`; returns the identity's record when it is gone.
    pub fn release(&mut self, id: Identity, member: &str) -> Option<IdRec> {
        let rec = self.recs.get_mut(&id)?;
        rec.refs = rec.refs.saturating_sub(1);
        if let Some(n) = rec.members.get_mut(member) {
            *n -= 1;
            if *n == 0 {
                rec.members.remove(member);
                rec.info.members = rec.members.keys().cloned().collect();
            }
        }
        if rec.refs > 0 {
            return None;
        }
        let rec = self.recs.remove(&id)?;
        self.by_sig.remove(&rec.sig);
        match &rec.sig {
            Signature::Pod(p) => {
                if let Some(set) = self.by_namespace.get_mut(p.namespace()) {
                    set.remove(&id);
                    if set.is_empty() {
                        self.by_namespace.remove(p.namespace());
                    }
                }
                self.pods_in_cidrs.remove(&id);
            }
            _ => {
                self.non_pod.remove(&id);
            }
        }
        Some(rec)
    }
}
