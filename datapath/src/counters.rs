//! Per-rule counters: which element of the kernel's rule counter array
//! ([`MAP_RULE_COUNTERS`]) each policy key and isolation default counts in, and the totals per
//! rule that userspace sums from it (`docs/observe.md` §8).
//!
//! [`MAP_RULE_COUNTERS`]: ordnet_datapath_common::layout::MAP_RULE_COUNTERS
//!
//! A key of a rule set comes from one or more rules (the MapState merges entries of equal rank
//! and verdict: [`StateEntry::origins`]); [`RuleCounters`] gives each distinct set of rules
//! one element, stored in the key's value ([`PolicyValue::counter`]), so rule sets of different
//! endpoints that come from the same rules share it. The isolation defaults have fixed
//! elements, one per direction and verdict. The kernel adds to the element of whatever decided
//! (`ordnet-xdp`'s `observe`): new flows allowed, denied flows and denied packets.
//! [`RuleTotals`] turns the elements' growth into totals per rule: a flow a key of two rules
//! decided counts for both.
//!
//! Elements are reused: [`RuleCounters::retain`] frees the ones no key names any more. The
//! kernel's element then keeps counting from where it was; [`RuleTotals`] works on the growth
//! between two reads, so what the old rules counted before the read that precedes the reuse
//! stays theirs.

use std::collections::BTreeMap;
use std::sync::Arc;

use ordnet_datapath_common::layout::{
    self, DEFAULT_RULE_COUNTERS, PolicyValue, RuleCount, V_ALLOW,
};
use ordnet_mapstate::{Direction, FastMap, FastSet, Origin, StateEntry};
use serde::Serialize;

use crate::flat::verdict_code;

pub use ordnet_datapath_common::layout::{COUNTER_UNATTRIBUTED, FIRST_RULE_COUNTER};

/// The element of the isolation default of `direction` whose verdict is `default`
/// ([`layout::default_counter`]).
///
/// [`layout::default_counter`]: ordnet_datapath_common::layout::default_counter
pub fn default_counter(direction: Direction, default: u8) -> u16 {
    layout::default_counter(direction == Direction::Egress, default == V_ALLOW)
}

/// The rules an element counts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CounterOwner<'a> {
    /// Nothing known (element 0, or a free element).
    Unattributed,
    /// The isolation default of the endpoints' `direction`.
    Default {
        /// The direction.
        direction: Direction,
        /// Whether the default allows (an endpoint no policy isolates) or denies.
        allow: bool,
    },
    /// The rules a key comes from.
    Rules(&'a [Arc<Origin>]),
}

/// A set of rules a key comes from (`StateEntry::origins`).
type Rules = Arc<[Arc<Origin>]>;

/// The elements given to sets of rules.
#[derive(Debug)]
pub struct RuleCounters {
    /// Elements of the kernel array (0: no counters, every key gets element 0).
    capacity: u32,
    by_rules: FastMap<Arc<[Arc<Origin>]>, u16>,
    /// The same by the address of the slice (values share one slice per MapState key and its
    /// copies): most lookups skip hashing the rules. The held `Arc` keeps the address unique.
    by_address: FastMap<usize, (Rules, u16)>,
    /// The rules of element `FIRST_RULE_COUNTER + i`.
    owners: Vec<Option<Arc<[Arc<Origin>]>>>,
    free: Vec<u16>,
    /// Sets of rules that got element 0 because every element was taken.
    refused: u64,
}

impl Default for RuleCounters {
    fn default() -> Self {
        RuleCounters::new(DEFAULT_RULE_COUNTERS)
    }
}

impl RuleCounters {
    /// Elements for an array of `capacity` (at most 65,536).
    pub fn new(capacity: u32) -> RuleCounters {
        RuleCounters {
            capacity: capacity.min(1 << 16),
            by_rules: FastMap::default(),
            by_address: FastMap::default(),
            owners: Vec::new(),
            free: Vec::new(),
            refused: 0,
        }
    }

    /// No counters: every key gets element 0 (rule sets that never reach the kernel).
    pub fn none() -> RuleCounters {
        RuleCounters::new(0)
    }

    /// The policy map value of a MapState value: its verdict and its rules' element.
    pub fn value(&mut self, entry: &StateEntry) -> PolicyValue {
        PolicyValue::counted(verdict_code(entry.verdict), self.counter(&entry.origins))
    }

    /// The element of a set of rules (given one if it has none; 0 when all are taken).
    pub fn counter(&mut self, rules: &Arc<[Arc<Origin>]>) -> u16 {
        if self.capacity <= u32::from(FIRST_RULE_COUNTER) || rules.is_empty() {
            return COUNTER_UNATTRIBUTED;
        }
        let address = Arc::as_ptr(rules).cast::<()>() as usize;
        if let Some((_, c)) = self.by_address.get(&address) {
            return *c;
        }
        let c = match self.by_rules.get(rules) {
            Some(c) => *c,
            None => match self.allocate(rules) {
                Some(c) => c,
                None => {
                    self.refused += 1;
                    return COUNTER_UNATTRIBUTED;
                }
            },
        };
        if self.by_address.len() > 4 * self.by_rules.len() + 1024 {
            self.by_address.clear();
        }
        self.by_address.insert(address, (rules.clone(), c));
        c
    }

    fn allocate(&mut self, rules: &Arc<[Arc<Origin>]>) -> Option<u16> {
        let c = match self.free.pop() {
            Some(c) => c,
            None => {
                let next = u32::from(FIRST_RULE_COUNTER) + self.owners.len() as u32;
                if next >= self.capacity {
                    return None;
                }
                self.owners.push(None);
                next as u16
            }
        };
        self.owners[usize::from(c - FIRST_RULE_COUNTER)] = Some(rules.clone());
        self.by_rules.insert(rules.clone(), c);
        Some(c)
    }

    /// What element `index` counts for.
    pub fn owner(&self, index: u16) -> CounterOwner<'_> {
        match index {
            1..=4 => CounterOwner::Default {
                direction: if index <= 2 {
                    Direction::Ingress
                } else {
                    Direction::Egress
                },
                allow: index.is_multiple_of(2),
            },
            _ => index
                .checked_sub(FIRST_RULE_COUNTER)
                .and_then(|i| self.owners.get(usize::from(i)))
                .and_then(|o| o.as_deref())
                .map_or(CounterOwner::Unattributed, CounterOwner::Rules),
        }
    }

    /// One past the highest element ever given out: the kernel array's elements beyond it
    /// have counted nothing.
    pub fn high_water(&self) -> u32 {
        u32::from(FIRST_RULE_COUNTER) + self.owners.len() as u32
    }

    /// Elements in use by sets of rules.
    pub fn in_use(&self) -> usize {
        self.by_rules.len()
    }

    /// Elements of the kernel array.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Sets of rules counted as unattributed because every element was taken.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Whether most elements are taken (time to [`RuleCounters::retain`]).
    pub fn nearly_full(&self) -> bool {
        self.capacity > 0 && self.in_use() * 4 >= self.capacity as usize * 3
    }

    /// Frees the elements of sets of rules not in `live`; how many it freed. The caller reads
    /// the kernel's counts first ([`RuleTotals::add`]) so that they stay with the old rules.
    pub fn retain(&mut self, live: &FastSet<u16>) -> usize {
        let before = self.by_rules.len();
        self.by_rules.retain(|_, c| live.contains(c));
        for (i, o) in self.owners.iter_mut().enumerate() {
            let c = FIRST_RULE_COUNTER + i as u16;
            if o.is_some() && !live.contains(&c) {
                *o = None;
                self.free.push(c);
            }
        }
        self.by_address.clear();
        before - self.by_rules.len()
    }
}

/// What a total counts for ([`RuleTotals`]): a rule, an isolation default, or nothing known.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(
    tag = "kind",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum RuleId {
    /// One rule of a policy.
    Rule {
        /// The policy's kind.
        policy_kind: String,
        /// Its namespace (a cluster-wide policy has none).
        #[serde(skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        /// Its name.
        name: String,
        /// The rule's direction.
        direction: Direction,
        /// The rule's index in the policy's rules of that direction.
        index: u32,
    },
    /// The isolation default of the endpoints' `direction`.
    Default {
        /// The direction.
        direction: Direction,
        /// Whether it allows (endpoints no policy isolates in that direction).
        allow: bool,
    },
    /// Counted without a known rule (see [`COUNTER_UNATTRIBUTED`]).
    Unattributed,
}

impl RuleId {
    /// The rule of an origin.
    pub fn of(o: &Origin) -> RuleId {
        RuleId::Rule {
            policy_kind: o.kind.clone(),
            namespace: o.namespace.clone(),
            name: o.name.clone(),
            direction: o.direction,
            index: o.rule_index,
        }
    }
}

/// Totals per rule: the sums of what the kernel's elements counted while they belonged to it.
#[derive(Debug, Default, Clone)]
pub struct RuleTotals {
    /// The kernel's sums at the last read, per element.
    last: Vec<RuleCount>,
    totals: BTreeMap<RuleId, RuleCount>,
    /// The last origin seen for each rule (its priority, action, ...), for display.
    origins: BTreeMap<RuleId, Arc<Origin>>,
}

fn minus(a: RuleCount, b: RuleCount) -> RuleCount {
    RuleCount {
        flows_allowed: a.flows_allowed.wrapping_sub(b.flows_allowed),
        flows_denied: a.flows_denied.wrapping_sub(b.flows_denied),
        packets_denied: a.packets_denied.wrapping_sub(b.packets_denied),
    }
}

impl RuleTotals {
    /// Adds what the elements counted since the last read: `sums` are the kernel's sums per
    /// element (index = element, summed over CPUs), `counters` tells whose they are now.
    pub fn add(&mut self, sums: &[RuleCount], counters: &RuleCounters) {
        if self.last.len() < sums.len() {
            self.last.resize(sums.len(), RuleCount::default());
        }
        for (i, now) in sums.iter().enumerate() {
            let grown = minus(*now, self.last[i]);
            self.last[i] = *now;
            if grown.is_zero() {
                continue;
            }
            match counters.owner(i as u16) {
                CounterOwner::Unattributed => self.count(RuleId::Unattributed, grown),
                CounterOwner::Default { direction, allow } => {
                    self.count(RuleId::Default { direction, allow }, grown)
                }
                CounterOwner::Rules(rules) => {
                    for o in rules {
                        let id = RuleId::of(o);
                        self.origins.insert(id.clone(), o.clone());
                        self.count(id, grown);
                    }
                }
            }
        }
    }

    fn count(&mut self, id: RuleId, grown: RuleCount) {
        let t = self.totals.entry(id).or_default();
        *t = t.plus(grown);
    }

    /// The kernel's elements start again from zero (new programs and maps: the agent grew the
    /// policy map, or started): the next [`RuleTotals::add`] counts all they hold as new.
    pub fn reloaded(&mut self) {
        self.last.clear();
    }

    /// Forgets the totals of rules that no element counts for any more (a deleted policy's,
    /// a changed rule's old index): the totals, and the metrics made from them, stay bounded
    /// by the rules the elements name. Run after [`RuleCounters::retain`] freed elements.
    pub fn forget_unowned(&mut self, counters: &RuleCounters) {
        let mut owned: std::collections::BTreeSet<RuleId> = std::collections::BTreeSet::new();
        for i in 0..counters.high_water() {
            if let CounterOwner::Rules(rules) = counters.owner(i as u16) {
                owned.extend(rules.iter().map(|o| RuleId::of(o)));
            }
        }
        self.totals
            .retain(|id, _| !matches!(id, RuleId::Rule { .. }) || owned.contains(id));
        self.origins.retain(|id, _| owned.contains(id));
    }

    /// The totals, by rule.
    pub fn totals(&self) -> &BTreeMap<RuleId, RuleCount> {
        &self.totals
    }

    /// The last origin seen for a rule.
    pub fn origin(&self, id: &RuleId) -> Option<&Arc<Origin>> {
        self.origins.get(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ordnet_mapstate::{Action, Tier};

    fn origin(name: &str, index: u32) -> Arc<Origin> {
        Arc::new(Origin {
            kind: "NetworkPolicy".into(),
            namespace: Some("ns".into()),
            name: name.into(),
            direction: Direction::Ingress,
            rule_index: index,
            rule_name: None,
            priority: 0,
            action: Action::Allow,
            tier: Tier::Ordnet,
            passed_by: None,
        })
    }

    #[test]
    fn equal_rule_sets_share_an_element_and_free_ones_are_reused() {
        let mut c = RuleCounters::new(8);
        let a: Arc<[Arc<Origin>]> = vec![origin("a", 0)].into();
        let a2: Arc<[Arc<Origin>]> = vec![origin("a", 0)].into();
        let b: Arc<[Arc<Origin>]> = vec![origin("a", 0), origin("b", 1)].into();
        let ca = c.counter(&a);
        assert_eq!(ca, FIRST_RULE_COUNTER);
        assert_eq!(c.counter(&a2), ca, "the same rules in another slice");
        let cb = c.counter(&b);
        assert_eq!(cb, FIRST_RULE_COUNTER + 1);
        let d: Arc<[Arc<Origin>]> = vec![origin("d", 0)].into();
        let cd = c.counter(&d);
        let e: Arc<[Arc<Origin>]> = vec![origin("e", 0)].into();
        assert_eq!(c.counter(&e), COUNTER_UNATTRIBUTED, "the array is full");
        assert_eq!(c.refused(), 1);
        assert_eq!(c.counter(&Arc::from(Vec::new())), COUNTER_UNATTRIBUTED);
        let live: FastSet<u16> = [ca, cd].into_iter().collect();
        assert_eq!(c.retain(&live), 1);
        assert_eq!(c.owner(cb), CounterOwner::Unattributed);
        assert_eq!(c.counter(&e), cb, "the freed element is reused");
        assert_eq!(c.counter(&a), ca);
    }

    #[test]
    fn defaults_have_fixed_elements() {
        let c = RuleCounters::none();
        for dir in [Direction::Ingress, Direction::Egress] {
            for (v, allow) in [(V_ALLOW, true), (2, false)] {
                let i = default_counter(dir, v);
                assert!(i > 0 && i < FIRST_RULE_COUNTER);
                assert_eq!(
                    c.owner(i),
                    CounterOwner::Default {
                        direction: dir,
                        allow
                    }
                );
            }
        }
    }

    #[test]
    fn totals_follow_the_growth_and_split_merged_rules() {
        let mut c = RuleCounters::new(16);
        let ab: Arc<[Arc<Origin>]> = vec![origin("a", 0), origin("b", 1)].into();
        let i = usize::from(c.counter(&ab));
        let mut t = RuleTotals::default();
        let mut sums = vec![RuleCount::default(); 16];
        sums[i].flows_allowed = 3;
        sums[1].packets_denied = 2;
        t.add(&sums, &c);
        sums[i].flows_allowed = 5;
        t.add(&sums, &c);
        let a = RuleId::of(&origin("a", 0));
        let b = RuleId::of(&origin("b", 1));
        assert_eq!(t.totals()[&a].flows_allowed, 5);
        assert_eq!(t.totals()[&b].flows_allowed, 5);
        let deny_in = RuleId::Default {
            direction: Direction::Ingress,
            allow: false,
        };
        assert_eq!(t.totals()[&deny_in].packets_denied, 2);
        // Reused: only the growth after the reuse counts for the new rules.
        c.retain(&FastSet::default());
        let x: Arc<[Arc<Origin>]> = vec![origin("x", 0)].into();
        assert_eq!(usize::from(c.counter(&x)), i);
        sums[i].flows_allowed = 6;
        t.add(&sums, &c);
        assert_eq!(t.totals()[&RuleId::of(&origin("x", 0))].flows_allowed, 1);
        assert_eq!(t.totals()[&a].flows_allowed, 5);
        // Rules no element names any more are forgotten; the defaults stay.
        t.forget_unowned(&c);
        assert!(!t.totals().contains_key(&a) && !t.totals().contains_key(&b));
        assert_eq!(t.totals()[&RuleId::of(&origin("x", 0))].flows_allowed, 1);
        assert_eq!(t.totals()[&deny_in].packets_denied, 2);
        // New programs count from zero: all they hold is new.
        t.reloaded();
        let mut fresh = vec![RuleCount::default(); 16];
        fresh[i].flows_allowed = 2;
        t.add(&fresh, &c);
        assert_eq!(t.totals()[&RuleId::of(&origin("x", 0))].flows_allowed, 3);
    }
}
