//! The node's flow history for `ordnet whatif --agent` (docs/cli.md): the distinct flows its
//! datapath reported (new flows and denials; `crate::whatif::SeenFlow`: addresses, protocol,
//! destination port) with the last verdict each got, the least recently seen dropped first
//! beyond `--flow-history` flows.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ordnet_mapstate::Protocol;

use crate::observe::FlowRecord;
use crate::whatif::SeenFlow;

/// How many distinct flows are kept by default (`ordnet agent --flow-history`).
pub const DEFAULT_FLOW_HISTORY: usize = 10_000;

type FlowKey = (IpAddr, IpAddr, Protocol, u16);

/// The last `capacity` distinct flows seen.
#[derive(Debug)]
pub struct FlowHistory {
    capacity: usize,
    /// Per flow: when it was last seen (a counter) and its last verdict.
    flows: BTreeMap<FlowKey, (u64, bool)>,
    /// The flows by when they were last seen.
    by_age: BTreeMap<u64, FlowKey>,
    clock: u64,
}

impl FlowHistory {
    /// An empty history of at most `capacity` flows (0: none kept).
    pub fn new(capacity: usize) -> FlowHistory {
        FlowHistory {
            capacity,
            flows: BTreeMap::new(),
            by_age: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Records the flows of `records` (a re-checked reply and ICMP are judged by the flow they
    /// belong to: not recorded).
    pub fn record(&mut self, records: &[FlowRecord]) {
        for r in records {
            let e = &r.event;
            let Some(protocol) = Protocol::from_number(e.protocol) else {
                continue;
            };
            if e.rechecked() || self.capacity == 0 {
                continue;
            }
            let key = (e.src, e.dst, protocol, e.dport);
            self.clock += 1;
            if let Some((age, _)) = self.flows.insert(key, (self.clock, e.allowed)) {
                self.by_age.remove(&age);
            }
            self.by_age.insert(self.clock, key);
            while self.flows.len() > self.capacity {
                let Some((_, oldest)) = self.by_age.pop_first() else {
                    break;
                };
                self.flows.remove(&oldest);
            }
        }
    }

    /// The flows, least recently seen first.
    pub fn flows(&self) -> Vec<SeenFlow> {
        self.by_age
            .values()
            .map(|k| SeenFlow {
                src: k.0,
                dst: k.1,
                protocol: k.2,
                port: k.3,
                allowed: self.flows[k].1,
            })
            .collect()
    }
}

/// The changes that upsert every object of `objects`.
fn upserts(objects: ordnet_crds::ClusterObjects) -> Vec<ordnet_engine::ObjectChange> {
    use ordnet_engine::{Object, ObjectChange};
    let o = objects;
    let mut out: Vec<Object> = Vec::new();
    out.extend(
        o.namespaces
            .into_iter()
            .map(|x| Object::Namespace(x.object)),
    );
    out.extend(
        o.nodes
            .into_iter()
            .map(|x| Object::Node(Box::new(x.object))),
    );
    out.extend(o.pods.into_iter().map(|x| Object::Pod(Box::new(x.object))));
    out.extend(
        o.services
            .into_iter()
            .map(|x| Object::Service(Box::new(x.object))),
    );
    out.extend(
        o.network_policies
            .into_iter()
            .map(|x| Object::NetworkPolicy(x.object)),
    );
    out.extend(
        o.ordered_policies
            .into_iter()
            .map(|x| Object::OrderedNetworkPolicy(x.object)),
    );
    out.extend(
        o.cluster_ordered_policies
            .into_iter()
            .map(|x| Object::ClusterOrderedNetworkPolicy(x.object)),
    );
    out.extend(
        o.cluster_network_policies
            .into_iter()
            .map(|x| Object::ClusterNetworkPolicy(Box::new(x.object))),
    );
    out.into_iter().map(ObjectChange::Upsert).collect()
}

impl super::AgentState {
    /// `POST /v1/whatif`: the node's flow history replayed against its current objects plus
    /// `manifests` (YAML; they replace objects of the same name), staged policies enforced.
    /// `Err`: the manifests' problems (nothing replayed when one is an error).
    pub(super) fn whatif(
        &self,
        manifests: &str,
    ) -> Result<(crate::whatif::History, Vec<crate::whatif::Changed>), String> {
        let loaded = ordnet_crds::load_str(std::path::Path::new("proposed"), manifests);
        let errors: Vec<String> = loaded
            .problems
            .iter()
            .filter(|p| p.is_error())
            .map(|p| p.to_string())
            .collect();
        if !errors.is_empty() {
            return Err(errors.join("\n"));
        }
        // The node's view with its staged policies enforced (the staged view, or a copy of the
        // engine when there is none), plus the proposed objects.
        let base = self
            .staged_view_copy()
            .or_else(|| self.with_engine(|e| e.staged_view()));
        let Some(mut engine) = base else {
            return Err("not ready: waiting for the initial lists".into());
        };
        let mut refused = Vec::new();
        for c in upserts(loaded.objects) {
            refused.extend(engine.apply(c).errors.into_iter().map(|e| e.to_string()));
        }
        if !refused.is_empty() {
            return Err(refused.join("\n"));
        }
        let flows = self
            .history
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .flows();
        let history = crate::whatif::History {
            lines: flows.len(),
            flows,
            skipped: 0,
        };
        let changed = crate::whatif::replay(&engine, &history.flows);
        Ok((history, changed))
    }
}
