//! Helpers shared by the MapState tests.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;

use ordnet_mapstate::*;

/// A policy entry with a test origin named after its id.
pub fn entry(
    id: u64,
    priority: i32,
    index: u32,
    verdict: Verdict,
    selector: Selector,
    l4: L4Match,
) -> PolicyEntry {
    tiered_entry(
        id,
        Tier::Ordnet,
        priority,
        index,
        verdict.into(),
        selector,
        l4,
    )
}

/// A policy entry of any tier and action, with a test origin named after its id.
pub fn tiered_entry(
    id: u64,
    tier: Tier,
    priority: i32,
    index: u32,
    action: Action,
    selector: Selector,
    l4: L4Match,
) -> PolicyEntry {
    PolicyEntry {
        id: EntryId(id),
        order: OrderKey::tiered(tier, priority, index),
        action,
        selector,
        l4,
        origin: Arc::new(Origin {
            kind: "Test".into(),
            namespace: None,
            name: format!("e{id}"),
            direction: Direction::Ingress,
            rule_index: index,
            rule_name: None,
            priority,
            action,
            tier,
            passed_by: None,
        }),
    }
}

/// Keys and covered notes, for comparing two states entry for entry.
pub type Snapshot = (Vec<(Key, StateEntry)>, Vec<Covered>);

pub fn snapshot(ms: &MapState) -> Snapshot {
    (
        ms.iter().into_iter().map(|(k, e)| (k, e.clone())).collect(),
        ms.covered(),
    )
}

/// Checks that `changes` is exactly the difference between `before` and `after`: applying it to
/// the keys of `before` gives the keys of `after`, every removed/changed key held the old value,
/// and no key is listed twice.
pub fn check_change_set(
    before: &MapState,
    after: &MapState,
    changes: &ChangeSet,
) -> Result<(), String> {
    let mut keys: HashMap<Key, StateEntry> = before
        .iter()
        .into_iter()
        .map(|(k, e)| (k, e.clone()))
        .collect();
    let mut seen = std::collections::HashSet::new();
    for (k, e) in &changes.added {
        if !seen.insert(*k) || keys.insert(*k, e.clone()).is_some() {
            return Err(format!("added key {k:?} was present or listed twice"));
        }
    }
    for (k, old, new) in &changes.changed {
        if !seen.insert(*k) || keys.get(k) != Some(old) || old == new {
            return Err(format!("changed key {k:?}: wrong old value or no change"));
        }
        keys.insert(*k, new.clone());
    }
    for (k, old) in &changes.removed {
        if !seen.insert(*k) || keys.remove(k).as_ref() != Some(old) {
            return Err(format!("removed key {k:?}: wrong old value"));
        }
    }
    let mut replay: Vec<(Key, StateEntry)> = keys.into_iter().collect();
    replay.sort_by_key(|e| e.0);
    if replay != snapshot(after).0 {
        return Err("change set does not describe the difference".into());
    }
    Ok(())
}

/// A datapath map as a plain key → value table, with the MapState's lookup contract (the
/// packet's identity first, longest prefix; then `*`; then the default). It is what the
/// datapath holds while the ops of a change set are being written.
#[derive(Debug, Clone)]
pub struct MapModel {
    pub keys: HashMap<Key, StateEntry>,
    pub default: Verdict,
}

impl MapModel {
    pub fn of(ms: &MapState) -> MapModel {
        MapModel {
            keys: ms.iter().into_iter().map(|(k, e)| (k, e.clone())).collect(),
            default: ms.default_verdict(),
        }
    }

    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Upsert(k, e) => {
                self.keys.insert(*k, e.clone());
            }
            Op::Delete(k) => {
                self.keys.remove(k);
            }
        }
    }

    pub fn lookup(&self, id: Option<Identity>, proto: u8, port: u16) -> Verdict {
        let probe = L4Prefix::packet(proto, port);
        for peer in id.map(Peer::Id).into_iter().chain([Peer::Any]) {
            let best = self
                .keys
                .iter()
                .filter(|(k, _)| k.peer == peer && k.prefix.covers(&probe))
                .max_by_key(|(k, _)| k.prefix.len());
            if let Some((_, e)) = best {
                return e.verdict;
            }
        }
        self.default
    }
}

/// Writes `ops` one by one into a model of `before`'s maps and checks, before and after every
/// write, that no probe is allowed that both `before` and `after` deny; and that the model ends
/// equal to `after`.
pub fn check_write_order(
    before: &MapState,
    after: &MapState,
    ops: &[Op],
    ids: &[Option<Identity>],
    probes: &[(u8, u16)],
) -> Result<(), String> {
    let mut model = MapModel::of(before);
    model.default = after.default_verdict();
    // The probes that both states deny: the only ones a write order can get wrong.
    let mut denied = Vec::new();
    for &id in ids {
        for &(proto, port) in probes {
            if before.lookup(id, proto, port).verdict() == Verdict::Deny
                && after.lookup(id, proto, port).verdict() == Verdict::Deny
            {
                denied.push((id, proto, port));
            }
        }
    }
    for step in 0..=ops.len() {
        if step > 0 {
            model.apply(&ops[step - 1]);
        }
        for &(id, proto, port) in &denied {
            if model.lookup(id, proto, port) == Verdict::Allow {
                return Err(format!(
                    "transient allow after {step} of {} writes: id {id:?} proto {proto} port \
                     {port}\nops: {ops:#?}",
                    ops.len()
                ));
            }
        }
    }
    let mut end: Vec<(Key, StateEntry)> = model.keys.into_iter().collect();
    end.sort_by_key(|e| e.0);
    if end != snapshot(after).0 {
        return Err("the writes do not end in the new state".into());
    }
    Ok(())
}

/// Probe ports: 0, 1, 65535 and the edges (±1) of every given port range.
pub fn probe_ports(ranges: impl IntoIterator<Item = (u16, u16)>) -> Vec<u16> {
    let mut ports: std::collections::BTreeSet<u16> = [0u16, 1, 80, 65534, 65535].into();
    for (first, last) in ranges {
        for p in [first, last] {
            ports.insert(p);
            ports.insert(p.saturating_sub(1));
            ports.insert(p.saturating_add(1));
        }
    }
    ports.into_iter().collect()
}

/// Probes of every protocol (and ICMP, which only "any" rules match) at these ports.
pub fn probes_at(ports: &[u16]) -> Vec<(u8, u16)> {
    let mut out = Vec::new();
    for proto in [6u8, 17, 132] {
        for &p in ports {
            out.push((proto, p));
        }
    }
    out.push((1, 0));
    out
}

/// The port ranges of every key of a state.
pub fn key_ranges(ms: &MapState) -> Vec<(u16, u16)> {
    ms.iter()
        .into_iter()
        .filter_map(|(k, _)| k.prefix.port_range())
        .collect()
}

/// One key as a line: `peer prefix verdict (priority, index) [entries]`, plus ` synthesized`.
pub fn render_entry(k: &Key, e: &StateEntry) -> String {
    let ids: Vec<String> = e.entries.iter().map(|id| id.to_string()).collect();
    format!(
        "{} {} {} {} [{}]{}",
        k.peer,
        k.prefix,
        e.verdict,
        e.order,
        ids.join(","),
        if e.synthesized { " synthesized" } else { "" }
    )
}

/// Every key of a state, in key order (`*` first, parents before children).
pub fn render_keys(ms: &MapState) -> Vec<String> {
    ms.iter().iter().map(|(k, e)| render_entry(k, e)).collect()
}

/// Every covered note: `entry at peer prefix by peer prefix`.
pub fn render_covered(ms: &MapState) -> Vec<String> {
    ms.covered()
        .iter()
        .map(|c| {
            format!(
                "{} at {} {} by {} {}",
                c.entry, c.key.peer, c.key.prefix, c.covered_by.peer, c.covered_by.prefix
            )
        })
        .collect()
}

/// A change set as lines: `+ key`, `~ old -> new`, `- key`, sorted.
pub fn render_changes(c: &ChangeSet) -> Vec<String> {
    let mut out: Vec<String> = c
        .added
        .iter()
        .map(|(k, e)| format!("+ {}", render_entry(k, e)))
        .chain(
            c.changed
                .iter()
                .map(|(k, o, n)| format!("~ {} -> {}", render_entry(k, o), render_entry(k, n))),
        )
        .chain(
            c.removed
                .iter()
                .map(|(k, e)| format!("- {}", render_entry(k, e))),
        )
        .collect();
    out.sort();
    out
}
