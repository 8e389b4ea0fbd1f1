//! Node-local identity classes (`ordnet_datapath::classes`), against the identity-level
//! tables the control plane writes: random sequences of endpoint policies, relabels, remote
//! identities and removals; after every single class-level write no (endpoint, direction,
//! peer address, port) is allowed that neither the identity-level state before the batch nor
//! the one after it allows, after every batch the verdicts are exactly the identity-level ones,
//! and the classes are minimal (no two with equal keys) and exact (each member's keys are its
//! class's).

mod common;

use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
    time::Duration,
};

use common::*;
use ordnet_datapath::{
    Control, EndpointAddresses, EndpointSpec, IpNet, MemTables, Store, TableWriter, Write,
    WriteError,
    classes::{Addr, ClassTables, ClassWrite, Classes, EGRESS, INGRESS},
    common::{
        layout::{CELLS_PER_RULESET, IpInfo, IpKey, PolicyRef, PolicyValue, State},
        lookup::{cell_index, policy_lookup},
    },
    leafmap::LeafMap,
};
use ordnet_mapstate::{ChangeSet, Direction, MapState, Selector, Update, Verdict};

/// What is checked: (endpoint record, direction, peer address, probe index) → allowed.
type Verdicts = HashMap<(IpKey, usize, Addr, usize), bool>;

/// The peers: every address with a record, and its identity.
fn peers(t: &MemTables) -> Vec<(Addr, u32)> {
    t.ipcache
        .iter()
        .map(|(k, i)| (Addr::Exact(*k), i.identity))
        .chain(
            t.cidr
                .iter()
                .map(|(&(k, l), i)| (Addr::Cidr(k, l), i.identity)),
        )
        .collect()
}

fn endpoints(t: &MemTables) -> Vec<(IpKey, IpInfo)> {
    t.ipcache
        .iter()
        .filter(|(_, i)| i.is_endpoint())
        .map(|(k, i)| (*k, *i))
        .collect()
}

fn policy(info: &IpInfo, d: usize) -> PolicyRef {
    if d == INGRESS {
        info.ingress
    } else {
        info.egress
    }
}

/// Identity-level verdicts.
fn identity_verdicts(t: &MemTables, probes: &[(u8, u16)]) -> Verdicts {
    let mut out = Verdicts::new();
    for (ep, info) in endpoints(t) {
        for d in [INGRESS, EGRESS] {
            for (addr, id) in peers(t) {
                for (i, &(proto, port)) in probes.iter().enumerate() {
                    let v = policy_lookup(t, policy(&info, d), id, proto, port).allow;
                    out.insert((ep, d, addr, i), v);
                }
            }
        }
    }
    out
}

/// Class-level verdicts of the endpoints in `eps` (all if `None`) and the peers in `addrs`
/// (all if `None`).
fn class_verdicts(
    t: &ClassTables,
    probes: &[(u8, u16)],
    eps: Option<&BTreeSet<IpKey>>,
    addrs: Option<&BTreeSet<Addr>>,
    cell: Option<u32>,
    low: Option<u16>,
) -> Verdicts {
    let mut out = Verdicts::new();
    for (ep, info) in endpoints(&t.tables) {
        if eps.is_some_and(|e| !e.contains(&ep)) {
            continue;
        }
        for d in [INGRESS, EGRESS] {
            for (addr, _) in peers(&t.tables) {
                if addrs.is_some_and(|a| !a.contains(&addr)) {
                    continue;
                }
                let class = t.classes_of(&addr).map_or(0, |c| c[d]);
                for (i, &(proto, port)) in probes.iter().enumerate() {
                    if cell.is_some_and(|c| cell_index(0, proto, port) != Some(c))
                        || low.is_some_and(|l| port & 0xff != l || !matches!(proto, 6 | 17 | 132))
                    {
                        continue;
                    }
                    let v = policy_lookup(&t.tables, policy(&info, d), class, proto, port).allow;
                    out.insert((ep, d, addr, i), v);
                }
            }
        }
    }
    out
}

/// Writes identity-level tables and translates every batch into class-level tables, checking
/// them after every class-level write.
struct Checked {
    id: MemTables,
    /// The identity-level verdicts of `id` (as of the last batch).
    last: Verdicts,
    classes: Classes,
    class: ClassTables,
    probes: Vec<(u8, u16)>,
    context: String,
    class_writes: usize,
    checks: usize,
    /// Rule set writes after which the store took the model's keys.
    shared: std::cell::Cell<usize>,
}

impl Checked {
    /// The (endpoint, peer) pairs a class-level write can change: a key only its class's peers
    /// of the endpoints using its rule set, a cell word only the endpoints using its rule set;
    /// anything else all.
    fn affected(&self, w: &ClassWrite) -> (Option<BTreeSet<IpKey>>, Option<BTreeSet<Addr>>) {
        let using = |slot: u32| -> BTreeSet<IpKey> {
            endpoints(&self.class.tables)
                .into_iter()
                .filter(|(_, i)| i.ingress.ruleset == slot || i.egress.ruleset == slot)
                .map(|(k, _)| k)
                .collect()
        };
        match *w {
            ClassWrite::Key(Write::PolicyUpsert(k, _) | Write::PolicyDelete(k)) => {
                let addrs = self
                    .class
                    .classes()
                    .filter(|(_, c)| c.contains(&k.identity))
                    .map(|(a, _)| a)
                    .collect();
                (Some(using(k.ruleset)), Some(addrs))
            }
            ClassWrite::Plain(Write::Cell(i, _)) => (Some(using(i / CELLS_PER_RULESET)), None),
            ClassWrite::Plain(Write::PolicyUpsert(..) | Write::PolicyDelete(..)) => {
                (Some(BTreeSet::new()), None)
            }
            // A record: as a peer, for every endpoint; as an endpoint, for every peer.
            ClassWrite::Record { write, .. } => {
                let addr = match write {
                    Write::IpUpsert(k, _) | Write::IpDelete(k) => Addr::Exact(k),
                    Write::CidrUpsert(k, l, _) | Write::CidrDelete(k, l) => Addr::Cidr(k, l),
                    _ => return (None, None),
                };
                let endpoint = matches!(addr, Addr::Exact(k) if self.id.ipcache.get(&k)
                    .is_some_and(|i| i.is_endpoint())
                    || self.class.tables.ipcache.get(&k).is_some_and(|i| i.is_endpoint()));
                if endpoint {
                    (None, None)
                } else {
                    (None, Some(BTreeSet::from([addr])))
                }
            }
            _ => (None, None),
        }
    }
}

impl Checked {
    /// Rebuilding the classes from the class-level tables after a complete batch (an agent
    /// restart): nothing to repair, the same classes, and identity-level tables with the same
    /// verdicts.
    fn adopt_complete(&self, after: &Verdicts) {
        let a = Classes::adopt(&self.class.tables, Duration::ZERO);
        let what = &self.context;
        assert!(a.repairs.is_empty(), "{what}: repairs {:?}", a.repairs);
        a.classes
            .check()
            .unwrap_or_else(|e| panic!("{what}: adopted: {e}"));
        let (mine, theirs) = (self.classes.stats(), a.classes.stats());
        assert_eq!(
            (mine.classes, mine.keys),
            (theirs.classes, theirs.keys),
            "{what}: adopted classes"
        );
        assert!(
            identity_verdicts(&a.identity, &self.probes) == *after,
            "{what}: the adopted identity-level tables decide otherwise"
        );
    }

    /// Rebuilding the classes from tables holding half of a batch's class-level writes (a
    /// batch the maps refused part-way, or an agent stopped in the middle of it): with the
    /// repairs written, the classes hold, the class-level verdicts are exactly those of the
    /// identity-level tables rebuilt with them, and none allows what neither the state before
    /// the batch nor the one after it allows.
    fn adopt_half_done(&self, out: &[ClassWrite], before: &Verdicts, after: &Verdicts) {
        if out.len() < 2 {
            return;
        }
        let mut cut = self.class.clone();
        for w in &out[..out.len() / 2] {
            cut.apply(w);
        }
        let a = Classes::adopt(&cut.tables, Duration::ZERO);
        for w in &a.repairs {
            cut.apply(w);
        }
        let what = &self.context;
        a.classes
            .check()
            .unwrap_or_else(|e| panic!("{what}: adopted half-done: {e}"));
        let now = class_verdicts(&cut, &self.probes, None, None, None, None);
        assert!(
            identity_verdicts(&a.identity, &self.probes) == now,
            "{what}: half-done: the rebuilt identity-level tables decide otherwise"
        );
        for (k, allowed) in now {
            assert!(
                !allowed
                    || before.get(&k).copied().unwrap_or(false)
                    || after.get(&k).copied().unwrap_or(false),
                "{what}: half-done and repaired: transient allow of {k:?}"
            );
        }
    }
}

impl TableWriter for Checked {
    fn write(&mut self, writes: &[Write]) -> Result<(), WriteError> {
        let before = std::mem::take(&mut self.last);
        self.id.write(writes)?;
        let after = identity_verdicts(&self.id, &self.probes);
        let mut out = Vec::new();
        self.classes.translate(writes, &mut out);
        self.adopt_half_done(&out, &before, &after);
        for w in &out {
            self.class.apply(w);
            self.class_writes += 1;
            let (eps, addrs) = self.affected(w);
            let cell = match *w {
                ClassWrite::Plain(Write::Cell(i, _)) => Some(i % CELLS_PER_RULESET),
                _ => None,
            };
            // A block word: only its own low port byte.
            let low = match *w {
                ClassWrite::Plain(Write::Block(i, _)) => Some((i % 256) as u16),
                _ => None,
            };
            let now = class_verdicts(
                &self.class,
                &self.probes,
                eps.as_ref(),
                addrs.as_ref(),
                cell,
                low,
            );
            for (k, allowed) in now {
                self.checks += 1;
                assert!(
                    !allowed
                        || before.get(&k).copied().unwrap_or(false)
                        || after.get(&k).copied().unwrap_or(false),
                    "{}: transient allow of {k:?} (probe {:?}) after {w:?}\nbatch {writes:?}",
                    self.context,
                    self.probes[k.3]
                );
            }
        }
        let now = class_verdicts(&self.class, &self.probes, None, None, None, None);
        if now != after {
            let bad: Vec<_> = after
                .iter()
                .filter(|(k, v)| now.get(k) != Some(v))
                .take(5)
                .map(|(k, v)| (k, self.probes[k.3], v, now.get(k)))
                .collect();
            panic!(
                "{}: after the batch the class verdicts differ, e.g. (key, probe, identity, \
                 class) {bad:?}\nbatch {writes:?}\nclass writes {out:?}",
                self.context
            );
        }
        if let Err(e) = self.classes.check() {
            panic!("{}: {e}\nbatch {writes:?}", self.context);
        }
        self.adopt_complete(&after);
        self.last = after;
        Ok(())
    }

    fn tables(&self) -> &MemTables {
        &self.id
    }

    /// After every write of a slot the translation's model of its identity keys is what the
    /// identity-level tables hold, so the store takes the model's leaves as its keys (one copy
    /// of the keys, issue 25; in a debug build the store checks them against its own diff).
    fn identity_keys(&self, slot: u32) -> Option<LeafMap<(u32, u32), PolicyValue>> {
        let keys = self.classes.identity_keys(slot);
        let held: Vec<((u32, u32), PolicyValue)> = self
            .id
            .policy_of(slot)
            .into_iter()
            .filter(|(k, _)| k.identity != 0)
            .map(|(k, v)| ((k.identity, k.prefix), v))
            .collect();
        assert!(
            keys.iter().map(|(k, v)| (*k, *v)).eq(held.iter().copied()),
            "{}: the model of slot {slot} differs from the identity-level tables' keys {held:?}",
            self.context
        );
        self.shared.set(self.shared.get() + 1);
        Some(keys)
    }
}

const ENDPOINTS: u32 = 3;

fn endpoint_ip(e: u32) -> IpAddr {
    IpAddr::from([10, 0, 0, e as u8])
}

fn remote_ip(r: u8) -> IpNet {
    IpNet::from(IpAddr::from([10, 1, 0, r]))
}

/// A random world: a pool of MapStates per direction (endpoints pick from it, so rule sets are
/// shared and change in place as well as anew) and a writer checking every class-level write
/// at probes of the pool's keys.
fn world(rng: &mut Rng) -> (Vec<[MapState; 2]>, Checked) {
    let pool: Vec<[MapState; 2]> = (0..5)
        .map(|_| {
            [
                arb_mapstate(rng, Direction::Ingress, 8),
                arb_mapstate(rng, Direction::Egress, 8),
            ]
        })
        .collect();
    let all: Vec<&MapState> = pool.iter().flatten().collect();
    // (A selector gaining or losing an identity, `relabel_in_place`, changes no key's prefix.)
    let probes: Vec<(u8, u16)> = probe_points(&all)
        .into_iter()
        .filter(|&(p, _)| matches!(p, 6 | 1))
        .collect();
    // At most 48 of them, evenly spread (the test runs unoptimised).
    let step = probes.len().div_ceil(48);
    let probes: Vec<(u8, u16)> = probes.into_iter().step_by(step).collect();
    let w = Checked {
        id: MemTables::new(16 * 769, 256 * 256),
        last: Verdicts::new(),
        classes: Classes::new(Duration::ZERO),
        class: ClassTables::new(16 * 769, 256 * 256),
        probes,
        context: String::new(),
        class_writes: 0,
        checks: 0,
        shared: Default::default(),
    };
    (pool, w)
}

#[test]
fn classes_follow_every_change_without_a_transient_allow() {
    let (mut splits, mut merges, mut joins, mut max_classes) = (0usize, 0usize, 0usize, 0usize);
    let mut total = (0usize, 0usize);
    let mut shared = 0usize;
    let cases: u64 = std::env::var("ORDNET_CLASS_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    let first: u64 = std::env::var("ORDNET_CLASS_FIRST")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    for case in first..first + cases {
        let mut rng = Rng::new(0x0c1a_55e5 ^ case.wrapping_mul(0x9e37_79b9));
        let (mut pool, mut w) = world(&mut rng);
        let mut control = Control::new(Store::new(16, 256, Duration::ZERO), State::default());
        let ips: Vec<[IpAddr; 1]> = (1..=ENDPOINTS).map(|e| [endpoint_ip(e)]).collect();
        let mut live: BTreeSet<u32> = BTreeSet::new();
        // The pool states each live endpoint uses: [ingress, egress].
        let mut uses: HashMap<u32, [usize; 2]> = HashMap::new();
        for step in 0..30 {
            let op = rng.below(8);
            w.context = format!("case {case} step {step} op {op}");
            match op {
                // An endpoint (new or existing) gets MapStates of the pool and an identity.
                0 | 1 => {
                    let e = 1 + rng.below(ENDPOINTS as usize) as u32;
                    let [i, o] = [rng.below(pool.len()), rng.below(pool.len())];
                    let spec = EndpointSpec {
                        ips: &ips[e as usize - 1],
                        identity: 1 + rng.below(IDS as usize + 1) as u32,
                        identities: &[],
                        ingress: &pool[i][0],
                        egress: &pool[o][1],
                    };
                    control.update_endpoints(&mut w, &[(e, spec)]).unwrap();
                    live.insert(e);
                    uses.insert(e, [i, o]);
                }
                // A relabel: a live endpoint's identity changes.
                2 if !live.is_empty() => {
                    let e = rng.pick(&live.iter().copied().collect::<Vec<_>>());
                    let a = EndpointAddresses {
                        ips: &ips[e as usize - 1],
                        identity: 1 + rng.below(IDS as usize + 1) as u32,
                        identities: &[],
                    };
                    control.set_endpoint_addresses(&mut w, &[(e, a)]).unwrap();
                }
                // Remote addresses and a CIDR come, change identity or go.
                3 | 4 => {
                    let n = 1 + rng.below(3);
                    let entries: Vec<(IpNet, Option<u32>)> = (0..n)
                        .map(|_| {
                            let net = if rng.chance(5) {
                                "10.2.0.0/16".parse().unwrap()
                            } else {
                                remote_ip(1 + rng.below(6) as u8)
                            };
                            let id =
                                (!rng.chance(4)).then(|| 1 + rng.below(IDS as usize + 1) as u32);
                            (net, id)
                        })
                        .collect();
                    control.set_identities(&mut w, &entries).unwrap();
                }
                // Selectors gain or lose one identity (a relabel in place, in the engine): only
                // that identity's keys change, in place, in every endpoint of the states
                // changed ([`relabel_in_place`]).
                5 | 6 => {
                    let (d, changed) = relabel_in_place(&mut rng, &mut pool, op == 5);
                    let (live, uses) = (&live, &uses);
                    let batch: Vec<_> = (changed.iter())
                        .flat_map(|&(p, ref cs, dir, dv)| {
                            let users = live.iter().copied().filter(move |e| uses[e][d] == p);
                            users.map(move |e| (e, dir, cs.view(), dv))
                        })
                        .collect();
                    control.apply_changes(&mut w, &batch).unwrap();
                }
                _ if !live.is_empty() => {
                    let e = rng.pick(&live.iter().copied().collect::<Vec<_>>());
                    control.remove_endpoints(&mut w, &[e]).unwrap();
                    live.remove(&e);
                    uses.remove(&e);
                }
                _ => {}
            }
            let s = w.classes.stats();
            max_classes = max_classes.max(s.classes[0] + s.classes[1]);
        }
        total = (total.0 + w.class_writes, total.1 + w.checks);
        shared += w.shared.get();
        let s = w.classes.stats();
        splits += s.splits;
        merges += s.merges;
        joins += s.joins;
    }
    println!(
        "{} class-level writes, {} (endpoint, direction, peer, probe) checks; {splits} splits, \
         {merges} merges, {joins} joins, at most {max_classes} classes at once; the store took the \
         model's keys after {shared} rule set writes",
        total.0, total.1
    );
    assert!(shared >= 100, "too few rule set writes: {shared}");
    assert!(max_classes >= 4, "too few classes: {max_classes}");
    assert!(splits >= 50 && merges >= 50, "too few splits or merges");
    assert!(joins >= 4, "too few groups joined a class at once: {joins}");
}

/// The pool's states changed as a relabel in place changes an engine's MapStates, in one
/// direction (returned): `one`: one selector of one state gains or loses an identity; else an
/// identity becomes like another in every state (every entry selects both or neither), as a
/// relabelled namespace's identity becomes like the other namespaces' of its new team. Returns
/// each changed state's pool index, ChangeSet, direction and default.
fn relabel_in_place(
    rng: &mut Rng,
    pool: &mut [[MapState; 2]],
    one: bool,
) -> (usize, Vec<(usize, ChangeSet, Direction, Verdict)>) {
    let d = rng.below(2);
    let id = 1 + rng.below(IDS as usize) as u32;
    let like = 1 + rng.below(IDS as usize) as u32;
    let only = rng.below(pool.len());
    let mut changed = Vec::new();
    for (p, states) in pool.iter_mut().enumerate() {
        if one && p != only {
            continue;
        }
        let ms = &mut states[d];
        let entries: Vec<_> = ms
            .policy_entries()
            .into_iter()
            .filter(|e| matches!(e.selector, Selector::Ids(_)))
            .collect();
        let flip = |e: &ordnet_mapstate::PolicyEntry, select: bool| {
            let ids = vec![id];
            if select {
                Update::Select { entry: e.id, ids }
            } else {
                Update::Deselect { entry: e.id, ids }
            }
        };
        let updates: Vec<Update> = if one {
            let Some(e) = entries.get(rng.below(entries.len().max(1))) else {
                continue;
            };
            vec![flip(e, !e.selector.selects(id))]
        } else {
            entries
                .iter()
                .filter(|e| e.selector.selects(id) != e.selector.selects(like))
                .map(|e| flip(e, e.selector.selects(like)))
                .collect()
        };
        if !updates.is_empty() {
            let cs = ms.apply(updates).unwrap();
            changed.push((p, cs, ms.direction(), ms.default_verdict()));
        }
    }
    (d, changed)
}

/// An entry of `ids` with `action` on TCP port `port`.
fn tcp_entry(id: u64, ids: &[u32], port: u16, allow: bool) -> ordnet_mapstate::PolicyEntry {
    use ordnet_mapstate::{L4Match, Protocol, Selector, Verdict};
    let mut rng = Rng::new(id + 1);
    let mut e = arb_entry(&mut rng, id, IDS);
    e.selector = Selector::Ids(ids.iter().copied().collect());
    e.l4 = L4Match::port(Protocol::Tcp, port);
    e.action = if allow { Verdict::Allow } else { Verdict::Deny }.into();
    e.order = ordnet_mapstate::OrderKey::new(0, id as u32);
    e
}

/// A control plane writing through [`Classed`](ordnet_datapath::classes::Classed), with remote
/// addresses of identities `1..=n`.
fn classed_with_remotes(n: u8) -> (Control, ordnet_datapath::classes::Classed) {
    let mut control = Control::new(Store::new(16, 256, Duration::ZERO), State::default());
    let mut w =
        ordnet_datapath::classes::Classed::new(MemTables::new(16 * 769, 256 * 256), Duration::ZERO);
    let remote: Vec<(IpNet, Option<u32>)> = (1..=n)
        .map(|i| (remote_ip(i), Some(u32::from(i))))
        .collect();
    control.set_identities(&mut w, &remote).unwrap();
    (control, w)
}

/// One class per distinct set of keys: identities the policies do not tell apart share one,
/// its keys are written once; an in-place change that tells one apart splits it off, the
/// change back merges it again; an identity whose last address goes leaves its class.
#[test]
fn identities_the_policies_do_not_tell_apart_share_a_class() {
    use ordnet_datapath::classes::Classed;
    use ordnet_mapstate::Verdict;
    let ingress = |entries: &[ordnet_mapstate::PolicyEntry]| {
        build(Direction::Ingress, Verdict::Deny, entries)
    };
    let egress = build(
        Direction::Egress,
        Verdict::Deny,
        &[tcp_entry(10, &[4], 53, true)],
    );
    let same = ingress(&[tcp_entry(1, &[1, 2, 3], 80, true)]);
    let apart = ingress(&[
        tcp_entry(1, &[1, 2], 80, true),
        tcp_entry(2, &[3], 443, true),
    ]);
    let (mut control, mut w) = classed_with_remotes(6);
    let ips = [endpoint_ip(1)];
    let spec = |ingress| EndpointSpec {
        ips: &ips,
        identity: 9,
        identities: &[],
        ingress,
        egress: &egress,
    };
    control
        .update_endpoints(&mut w, &[(1, spec(&same))])
        .unwrap();
    let c = |w: &Classed, id: u32| w.classes.classes_of(id);
    let s = w.classes.stats();
    assert_eq!(s.classes, [1, 1], "{s:?}");
    assert_eq!(s.keys, [1, 1], "one key per class: {s:?}");
    assert_eq!(c(&w, 1), c(&w, 2));
    assert_eq!(c(&w, 2), c(&w, 3));
    assert_ne!(c(&w, 1)[INGRESS], 0);
    assert_eq!(c(&w, 1)[EGRESS], 0, "no egress key for identity 1");
    assert_eq!(c(&w, 4)[INGRESS], 0, "no ingress key for identity 4");
    assert_ne!(c(&w, 4)[EGRESS], 0);
    assert_eq!(c(&w, 5), [0, 0]);
    // The identity-level tables hold 4 identity keys, the class-level ones 2 (the `*` keys are
    // the same in both).
    let keyed = |t: &MemTables| t.policy.keys().filter(|k| k.identity != 0).count();
    assert_eq!((keyed(&w.identity), keyed(&w.class_tables.tables)), (4, 2));

    // Identity 3 told apart: split off (its own class), then merged back.
    control
        .update_endpoints(&mut w, &[(1, spec(&apart))])
        .unwrap();
    let s = w.classes.stats();
    assert_eq!(s.classes, [2, 1], "{s:?}");
    assert_eq!(c(&w, 1), c(&w, 2));
    assert_ne!(c(&w, 1)[INGRESS], c(&w, 3)[INGRESS]);
    assert!(s.splits >= 1, "{s:?}");
    control
        .update_endpoints(&mut w, &[(1, spec(&same))])
        .unwrap();
    let s = w.classes.stats();
    assert_eq!(s.classes, [1, 1], "{s:?}");
    assert_eq!(c(&w, 1), c(&w, 3));
    assert!(s.merges >= 1, "{s:?}");

    // Identity 4's only address becomes identity 5's: 4 leaves its class, which goes; its
    // keys are deleted (grace period zero) with the next batch.
    control
        .set_identities(&mut w, &[(remote_ip(4), Some(5))])
        .unwrap();
    assert_eq!(c(&w, 4), [0, 0]);
    assert_eq!(w.classes.stats().classes, [1, 0]);
    w.reclaim();
    assert_eq!(
        keyed(&w.class_tables.tables),
        1,
        "the egress class's key is deleted"
    );
    w.classes.check().unwrap();
}

/// An identity whose keys become those of another class joins it at once: its records are
/// rewritten, and no class key is written (no copy of its old class, nothing retired).
#[test]
fn an_identity_that_becomes_like_another_class_joins_it() {
    use ordnet_datapath::classes::Classed;
    use ordnet_mapstate::Verdict;
    let ingress = |entries: &[ordnet_mapstate::PolicyEntry]| {
        build(Direction::Ingress, Verdict::Deny, entries)
    };
    let egress = build(Direction::Egress, Verdict::Deny, &[]);
    let before = ingress(&[
        tcp_entry(1, &[1, 2], 80, true),
        tcp_entry(2, &[3], 443, true),
    ]);
    let mut after = before.clone();
    let cs = after
        .apply(vec![
            Update::Deselect {
                entry: ordnet_mapstate::EntryId(1),
                ids: vec![2],
            },
            Update::Select {
                entry: ordnet_mapstate::EntryId(2),
                ids: vec![2],
            },
        ])
        .unwrap();
    let (mut control, mut w) = classed_with_remotes(3);
    let ips = [endpoint_ip(1)];
    let spec = EndpointSpec {
        ips: &ips,
        identity: 9,
        identities: &[],
        ingress: &before,
        egress: &egress,
    };
    control.update_endpoints(&mut w, &[(1, spec)]).unwrap();
    let c = |w: &Classed, id: u32| w.classes.classes_of(id)[INGRESS];
    assert_eq!(c(&w, 1), c(&w, 2));
    assert_ne!(c(&w, 2), c(&w, 3));
    let s0 = w.classes.stats();
    assert_eq!(s0.classes[INGRESS], 2, "{s0:?}");

    // Identity 2 leaves entry 1 for entry 2, in place: its keys become identity 3's.
    control
        .apply_changes(&mut w, &[(1, Direction::Ingress, cs.view(), Verdict::Deny)])
        .unwrap();
    w.reclaim();
    let s = w.classes.stats();
    assert_eq!(c(&w, 2), c(&w, 3), "{s:?}");
    assert_ne!(c(&w, 1), c(&w, 2));
    assert_eq!(s.classes[INGRESS], 2, "{s:?}");
    // Out of its class (its keys deleted: no class of those keys) and into identity 3's.
    assert_eq!(s.joins - s0.joins, 2, "{s:?}");
    assert_eq!((s.splits, s.merges), (s0.splits, s0.merges), "{s:?}");
    assert_eq!(s.key_writes, s0.key_writes, "no class key written: {s:?}");
    let keyed = |t: &MemTables| t.policy.keys().filter(|k| k.identity != 0).count();
    assert_eq!((keyed(&w.identity), keyed(&w.class_tables.tables)), (3, 2));
    w.classes.check().unwrap();
}
