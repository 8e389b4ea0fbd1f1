//! Hand-written MapState cases: the examples of the ordered-policy CFP (1a-1d, 2a, 2b and the
//! incremental example 1) and the allow/deny scenarios of Cilium's mapstate tests (research
//! notes §3), translated to this model. Each asserts the exact keys, their flags, the covered
//! notes, the change sets and verdicts; every state is also checked against its definition
//! (`reference::state`), the reverse input order, additions one by one in both orders, and the
//! reference evaluator.
//!
//! Notation of the expectations: `peer prefix verdict (priority, index) [entries]`; `*` is the
//! wildcard peer and, as a prefix, "every protocol and port"; `TCP/0-1023 (/6)` is the block of
//! TCP ports 0-1023 (6 port bits fixed). The CFP's "prio N" is our priority N (lower wins).
//! Cilium's scenarios run at "priority 0 everything", i.e. equal order keys here (deny wins the
//! tie); their "precedence levels" are our priorities.
//!
//! Cilium rows not translated, because ordnet has no such verdicts: 8, 9 and the redirect half
//! of 10 (L7 proxy redirects and listener priorities), 15 and 16 (mutual-auth propagation).
//! Tiers and Pass (Cilium's 23-25) have their own cases at the end, with the bug Cilium fixed in
//! #43916 (a wildcard allow of a lower tier lost for an identity with a higher-tier Pass).

mod common;

use common::*;
use ordnet_mapstate::reference;
use ordnet_mapstate::*;

const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;

use Verdict::{Allow, Deny};

fn any() -> Selector {
    Selector::Any
}

fn ids(ids: &[Identity]) -> Selector {
    Selector::ids(ids.iter().copied())
}

fn tcp(port: u16) -> L4Match {
    L4Match::port(Protocol::Tcp, port)
}

fn udp(port: u16) -> L4Match {
    L4Match::port(Protocol::Udp, port)
}

fn tcp_range(first: u16, last: u16) -> L4Match {
    L4Match::Ports {
        proto: Protocol::Tcp,
        first,
        last,
    }
}

fn tcp_all() -> L4Match {
    L4Match::Proto(Protocol::Tcp)
}

fn l3() -> L4Match {
    L4Match::Any
}

/// `entry` at rule index 0.
fn e(id: u64, priority: i32, verdict: Verdict, selector: Selector, l4: L4Match) -> PolicyEntry {
    entry(id, priority, 0, verdict, selector, l4)
}

/// Identities the consistency checks probe.
fn probe_ids(entries: &[PolicyEntry]) -> Vec<Option<Identity>> {
    let mut out: Vec<Option<Identity>> = vec![None, Some(99)];
    for e in entries {
        if let Selector::Ids(s) = &e.selector {
            out.extend(s.iter().map(Some));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Builds the state (ingress, default deny) and checks it against its definition, the reverse
/// input order, one-by-one additions in both orders and the reference evaluator.
fn build(entries: &[PolicyEntry]) -> MapState {
    let ms = MapState::build(Direction::Ingress, Deny, entries.to_vec()).unwrap();
    check(&ms, entries);
    ms
}

fn check(ms: &MapState, entries: &[PolicyEntry]) {
    let snap = snapshot(ms);
    assert_eq!(
        snap,
        reference::state(&ms.resolved_entries()),
        "state != definition"
    );
    let rev: Vec<PolicyEntry> = entries.iter().rev().cloned().collect();
    let built = MapState::build(ms.direction(), ms.default_verdict(), rev.clone()).unwrap();
    assert_eq!(snapshot(&built), snap, "reverse input order");
    for order in [entries.to_vec(), rev] {
        let mut inc = MapState::new(ms.direction(), ms.default_verdict());
        for e in order {
            inc.apply([Update::AddEntry(e)]).unwrap();
        }
        assert_eq!(snapshot(&inc), snap, "one-by-one additions");
    }
    let mut ranges = key_ranges(ms);
    ranges.extend(entries.iter().filter_map(|e| match e.l4 {
        L4Match::Ports { first, last, .. } => Some((first, last)),
        _ => None,
    }));
    for id in probe_ids(entries) {
        for (proto, port) in probes_at(&probe_ports(ranges.clone())) {
            assert_eq!(
                ms.lookup(id, proto, port).verdict(),
                reference::evaluate(entries, ms.default_verdict(), id, proto, port),
                "id {id:?} proto {proto} port {port}"
            );
        }
    }
}

/// Applies one batch, checks the change set against the difference and the state against a
/// from-scratch build of `now` (the entries after the batch); returns the rendered changes.
fn step(ms: &mut MapState, updates: Vec<Update>, now: &[PolicyEntry]) -> Vec<String> {
    let before = ms.clone();
    let changes = ms.apply(updates).unwrap();
    check_change_set(&before, ms, &changes).unwrap();
    check(ms, now);
    let mut ids = probe_ids(now);
    ids.extend(probe_ids(&before.policy_entries()));
    let ports = probe_ports(key_ranges(&before).into_iter().chain(key_ranges(ms)));
    check_write_order(&before, ms, &changes.safe_order(), &ids, &probes_at(&ports)).unwrap();
    render_changes(&changes)
}

/// "allow" / "deny" for a matched key, "default" when nothing matched.
fn verdict(ms: &MapState, id: Option<Identity>, proto: u8, port: u16) -> &'static str {
    match ms.lookup(id, proto, port) {
        Decision::Matched { entry, .. } => entry.verdict.as_str(),
        Decision::Default(_) => "default",
    }
}

fn none() -> Vec<String> {
    Vec::new()
}

// ---------------------------------------------------------------------------------------------
// CFP-23380, "MapState conflict resolution". The MapState contains (tcp, 0-1023, *) at prio 1.

#[test]
fn cfp_1a_specific_key_equal_to_a_stronger_wildcard_key_is_covered() {
    // Can we insert (tcp, 0-1023, id 5) at prio 2? No: it would hide the stronger `*` key.
    let e1 = e(1, 1, Allow, any(), tcp_range(0, 1023));
    let e2 = e(2, 2, Deny, ids(&[5]), tcp_range(0, 1023));
    let mut ms = build(std::slice::from_ref(&e1));
    let changes = step(&mut ms, vec![Update::AddEntry(e2.clone())], &[e1, e2]);
    assert_eq!(changes, none(), "nothing is written");
    assert_eq!(render_keys(&ms), ["* TCP/0-1023 (/6) allow (1, 0) [#1]"]);
    assert_eq!(
        render_covered(&ms),
        ["#2 at 5 TCP/0-1023 (/6) by * TCP/0-1023 (/6)"]
    );
    assert_eq!(verdict(&ms, Some(5), TCP, 80), "allow");
    assert_eq!(verdict(&ms, Some(5), TCP, 1024), "default");
}

#[test]
fn cfp_1b_narrower_weaker_wildcard_key_is_covered() {
    // Can we insert (tcp, 80, *) at prio 2? No, for the same reason.
    let e1 = e(1, 1, Allow, any(), tcp_range(0, 1023));
    let e2 = e(2, 2, Deny, any(), tcp(80));
    let mut ms = build(std::slice::from_ref(&e1));
    let changes = step(&mut ms, vec![Update::AddEntry(e2.clone())], &[e1, e2]);
    assert_eq!(changes, none());
    assert_eq!(render_keys(&ms), ["* TCP/0-1023 (/6) allow (1, 0) [#1]"]);
    assert_eq!(render_covered(&ms), ["#2 at * TCP/80 by * TCP/0-1023 (/6)"]);
    assert_eq!(verdict(&ms, Some(5), TCP, 80), "allow");
    assert_eq!(verdict(&ms, None, TCP, 80), "allow");
}

#[test]
fn cfp_1c_broader_weaker_specific_key_gets_a_covering_copy() {
    // Can we insert (tcp, *, id 5) at prio 2? Yes: it is broader and weaker. Under the lookup
    // contract (identity first) the stronger `*` key inside it must be copied under 5.
    let e1 = e(1, 1, Allow, any(), tcp_range(0, 1023));
    let e2 = e(2, 2, Deny, ids(&[5]), tcp_all());
    let mut ms = build(std::slice::from_ref(&e1));
    let changes = step(&mut ms, vec![Update::AddEntry(e2.clone())], &[e1, e2]);
    assert_eq!(
        changes,
        [
            "+ 5 TCP/* deny (2, 0) [#2]",
            "+ 5 TCP/0-1023 (/6) allow (1, 0) [#1] synthesized",
        ]
    );
    assert_eq!(
        render_keys(&ms),
        [
            "* TCP/0-1023 (/6) allow (1, 0) [#1]",
            "5 TCP/* deny (2, 0) [#2]",
            "5 TCP/0-1023 (/6) allow (1, 0) [#1] synthesized",
        ]
    );
    assert_eq!(render_covered(&ms), none());
    assert_eq!(verdict(&ms, Some(5), TCP, 80), "allow");
    assert_eq!(verdict(&ms, Some(5), TCP, 1023), "allow");
    assert_eq!(verdict(&ms, Some(5), TCP, 1024), "deny");
    assert_eq!(verdict(&ms, Some(5), UDP, 53), "default");
    assert_eq!(verdict(&ms, Some(6), TCP, 1024), "default");
}

#[test]
fn cfp_1d_disjoint_specific_key_is_inserted_alone() {
    // Can we insert (udp, 53, id 5) at prio 2? Yes: it covers nothing stronger.
    let e1 = e(1, 1, Allow, any(), tcp_range(0, 1023));
    let e2 = e(2, 2, Deny, ids(&[5]), udp(53));
    let mut ms = build(std::slice::from_ref(&e1));
    let changes = step(&mut ms, vec![Update::AddEntry(e2.clone())], &[e1, e2]);
    assert_eq!(changes, ["+ 5 UDP/53 deny (2, 0) [#2]"]);
    assert_eq!(
        render_keys(&ms),
        [
            "* TCP/0-1023 (/6) allow (1, 0) [#1]",
            "5 UDP/53 deny (2, 0) [#2]"
        ]
    );
    assert_eq!(verdict(&ms, Some(5), TCP, 80), "allow");
    assert_eq!(verdict(&ms, Some(5), UDP, 53), "deny");
    assert_eq!(verdict(&ms, Some(5), UDP, 54), "default");
}

#[test]
fn cfp_2a_ancestor_wildcard_covers_and_incremental_updates_stay_covered() {
    // (tcp, *, {*}) prio 1; (tcp, 80, {*}) prio 2; (tcp, 80, {5}) prio 3: rules 2 and 3 may not
    // be inserted, and rule 3 stays "disabled" when its selector grows.
    let e1 = e(1, 1, Allow, any(), tcp_all());
    let e2 = e(2, 2, Deny, any(), tcp(80));
    let e3 = e(3, 3, Deny, ids(&[5]), tcp(80));
    let mut ms = build(&[e1.clone(), e2.clone(), e3.clone()]);
    assert_eq!(render_keys(&ms), ["* TCP/* allow (1, 0) [#1]"]);
    assert_eq!(
        render_covered(&ms),
        ["#2 at * TCP/80 by * TCP/*", "#3 at 5 TCP/80 by * TCP/*"]
    );
    assert_eq!(verdict(&ms, Some(5), TCP, 80), "allow");

    // The selector of rule 3 now also selects 6: nothing is written, 6 is covered too.
    let e3_6 = PolicyEntry {
        selector: ids(&[5, 6]),
        ..e3.clone()
    };
    let select = Update::Select {
        entry: e3.id,
        ids: vec![6],
    };
    let changes = step(
        &mut ms,
        vec![select],
        &[e1.clone(), e2.clone(), e3_6.clone()],
    );
    assert_eq!(changes, none());
    assert_eq!(
        render_covered(&ms),
        [
            "#2 at * TCP/80 by * TCP/*",
            "#3 at 5 TCP/80 by * TCP/*",
            "#3 at 6 TCP/80 by * TCP/*"
        ]
    );

    // Removing rule 1 re-exposes rule 2; rule 3 is now covered by rule 2.
    let changes = step(
        &mut ms,
        vec![Update::RemoveEntry(e1.id)],
        &[e2.clone(), e3_6.clone()],
    );
    assert_eq!(
        changes,
        ["+ * TCP/80 deny (2, 0) [#2]", "- * TCP/* allow (1, 0) [#1]"]
    );
    assert_eq!(
        render_covered(&ms),
        ["#3 at 5 TCP/80 by * TCP/80", "#3 at 6 TCP/80 by * TCP/80"]
    );

    // Removing rule 2 re-exposes rule 3 for 5 and 6.
    let changes = step(&mut ms, vec![Update::RemoveEntry(e2.id)], &[e3_6]);
    assert_eq!(
        changes,
        [
            "+ 5 TCP/80 deny (3, 0) [#3]",
            "+ 6 TCP/80 deny (3, 0) [#3]",
            "- * TCP/80 deny (2, 0) [#2]"
        ]
    );
    assert_eq!(render_covered(&ms), none());
}

#[test]
fn cfp_2b_weaker_descendant_wildcard_needs_no_copy() {
    // (tcp, *, {5, 6}) prio 1; (tcp, 80, {*}) prio 2. The CFP synthesizes (tcp, 80, {5, 6}) from
    // rule 1. Under the identity-first lookup that copy is unnecessary: 5 and 6 find their own
    // TCP/* key and never reach the weaker `*` key (crate docs: weaker wildcards never need
    // copying). Rule 2 keeps its own key for every other identity.
    let e1 = e(1, 1, Allow, ids(&[5, 6]), tcp_all());
    let e2 = e(2, 2, Deny, any(), tcp(80));
    let ms = build(&[e1, e2]);
    assert_eq!(
        render_keys(&ms),
        [
            "* TCP/80 deny (2, 0) [#2]",
            "5 TCP/* allow (1, 0) [#1]",
            "6 TCP/* allow (1, 0) [#1]",
        ]
    );
    assert_eq!(render_covered(&ms), none());
    assert_eq!(verdict(&ms, Some(5), TCP, 80), "allow");
    assert_eq!(verdict(&ms, Some(6), TCP, 80), "allow");
    assert_eq!(verdict(&ms, Some(7), TCP, 80), "deny");
    assert_eq!(verdict(&ms, None, TCP, 80), "deny");
    assert_eq!(verdict(&ms, Some(7), TCP, 81), "default");
}

fn cfp_incremental_rules() -> Vec<PolicyEntry> {
    vec![
        e(1, 1, Allow, ids(&[5, 6]), tcp_range(0, 1023)),
        e(2, 2, Deny, ids(&[7]), tcp(80)),
        e(3, 3, Deny, ids(&[8]), tcp_all()),
    ]
}

#[test]
fn cfp_incremental_example_1_add_identity_9() {
    // "Processing incremental updates", example 1: rules 1-3 check ID 9 in priority order:
    // rule 1 adds it, rule 2 finds it in an ancestor (covered), rule 3 adds it (the text; the
    // figure leaves rule 3 at {8}, see the next test).
    let rules = cfp_incremental_rules();
    let mut ms = build(&rules);
    assert_eq!(
        render_keys(&ms),
        [
            "5 TCP/0-1023 (/6) allow (1, 0) [#1]",
            "6 TCP/0-1023 (/6) allow (1, 0) [#1]",
            "7 TCP/80 deny (2, 0) [#2]",
            "8 TCP/* deny (3, 0) [#3]",
        ]
    );
    let mut after = rules.clone();
    for e in &mut after {
        if let Selector::Ids(s) = &mut e.selector {
            s.insert(9);
        }
    }
    let add = Update::AddIdentity {
        id: 9,
        selected_by: vec![EntryId(1), EntryId(2), EntryId(3)],
    };
    let changes = step(&mut ms, vec![add], &after);
    assert_eq!(
        changes,
        [
            "+ 9 TCP/* deny (3, 0) [#3]",
            "+ 9 TCP/0-1023 (/6) allow (1, 0) [#1]"
        ]
    );
    assert_eq!(render_covered(&ms), ["#2 at 9 TCP/80 by 9 TCP/0-1023 (/6)"]);
    assert_eq!(verdict(&ms, Some(9), TCP, 80), "allow");
    assert_eq!(verdict(&ms, Some(9), TCP, 1024), "deny");
    assert_eq!(verdict(&ms, Some(9), UDP, 53), "default");
    assert_eq!(verdict(&ms, Some(7), TCP, 80), "deny");
}

#[test]
fn cfp_incremental_example_1_as_in_the_figure() {
    // The figure's "After": 9 joins rules 1 and 2 only.
    let rules = cfp_incremental_rules();
    let mut ms = build(&rules);
    let mut after = rules.clone();
    for e in &mut after[..2] {
        if let Selector::Ids(s) = &mut e.selector {
            s.insert(9);
        }
    }
    let add = Update::AddIdentity {
        id: 9,
        selected_by: vec![EntryId(1), EntryId(2)],
    };
    let changes = step(&mut ms, vec![add], &after);
    assert_eq!(changes, ["+ 9 TCP/0-1023 (/6) allow (1, 0) [#1]"]);
    assert_eq!(render_covered(&ms), ["#2 at 9 TCP/80 by 9 TCP/0-1023 (/6)"]);
    assert_eq!(verdict(&ms, Some(9), TCP, 1024), "default");

    // And 9 goes away again: exactly its key is removed, the notes with it.
    let changes = step(&mut ms, vec![Update::RemoveIdentity(9)], &rules);
    assert_eq!(changes, ["- 9 TCP/0-1023 (/6) allow (1, 0) [#1]"]);
    assert_eq!(render_covered(&ms), none());
}

// ---------------------------------------------------------------------------------------------
// Cilium `pkg/policy/mapstate_test.go` scenarios (research notes §3), allow/deny only.

#[test]
fn cilium_01_broader_allow_does_not_remove_narrower_deny() {
    // insertWithChanges 2a/2b: deny `1 tcp 80`, then allow `1 L3` (or `1 tcp 64-127`).
    let deny = e(1, 0, Deny, ids(&[1]), tcp(80));
    for (allow, keys) in [
        (
            e(2, 0, Allow, ids(&[1]), l3()),
            ["1 * allow (0, 0) [#2]", "1 TCP/80 deny (0, 0) [#1]"],
        ),
        (
            e(2, 0, Allow, ids(&[1]), tcp_range(64, 127)),
            [
                "1 TCP/64-127 (/10) allow (0, 0) [#2]",
                "1 TCP/80 deny (0, 0) [#1]",
            ],
        ),
    ] {
        let mut ms = build(std::slice::from_ref(&deny));
        let changes = step(
            &mut ms,
            vec![Update::AddEntry(allow.clone())],
            &[deny.clone(), allow],
        );
        assert_eq!(changes, [format!("+ {}", keys[0])]);
        assert_eq!(render_keys(&ms), keys);
        assert_eq!(render_covered(&ms), none());
        assert_eq!(verdict(&ms, Some(1), TCP, 80), "deny");
        assert_eq!(verdict(&ms, Some(1), TCP, 81), "allow");
    }
}

#[test]
fn cilium_02_allow_at_the_key_of_an_equal_deny_is_ignored() {
    // 3a/3b, 18: deny at K, then allow at the same K: allow ignored, no change.
    let deny = e(1, 0, Deny, ids(&[1]), tcp(80));
    let allow = e(2, 0, Allow, ids(&[1]), tcp(80));
    let mut ms = build(std::slice::from_ref(&deny));
    let changes = step(
        &mut ms,
        vec![Update::AddEntry(allow.clone())],
        &[deny, allow],
    );
    assert_eq!(changes, none());
    assert_eq!(render_keys(&ms), ["1 TCP/80 deny (0, 0) [#1]"]);
    assert_eq!(render_covered(&ms), ["#2 at 1 TCP/80 by 1 TCP/80"]);
}

#[test]
fn cilium_03_broader_deny_deletes_narrower_allow() {
    // 4a/4b: allow `1 tcp 80`, then deny `1 tcp 64-127`: deny added, allow:80 deleted.
    let allow = e(1, 0, Allow, ids(&[1]), tcp(80));
    let deny = e(2, 0, Deny, ids(&[1]), tcp_range(64, 127));
    let mut ms = build(std::slice::from_ref(&allow));
    let changes = step(
        &mut ms,
        vec![Update::AddEntry(deny.clone())],
        &[allow, deny],
    );
    assert_eq!(
        changes,
        [
            "+ 1 TCP/64-127 (/10) deny (0, 0) [#2]",
            "- 1 TCP/80 allow (0, 0) [#1]"
        ]
    );
    assert_eq!(render_keys(&ms), ["1 TCP/64-127 (/10) deny (0, 0) [#2]"]);
    assert_eq!(
        render_covered(&ms),
        ["#1 at 1 TCP/80 by 1 TCP/64-127 (/10)"]
    );
}

#[test]
fn cilium_04_l3_deny_replaces_all_keys_of_its_identity_only() {
    // 5a/5b: allows `1 tcp80`, `1 L3`, `2 tcp80`; then deny `1 L3`: 1's keys become one L3
    // deny, 2 is untouched. Difference from Cilium: at equal rank the broader `1 L3` allow
    // covers `1 tcp80` from the start (it can never decide a packet), where Cilium keeps both
    // allows when all precedences are equal (it skips pruning then).
    let rules = vec![
        e(1, 0, Allow, ids(&[1]), tcp(80)),
        e(2, 0, Allow, ids(&[1]), l3()),
        e(3, 0, Allow, ids(&[2]), tcp(80)),
    ];
    let deny = e(4, 0, Deny, ids(&[1]), l3());
    let mut ms = build(&rules);
    assert_eq!(
        render_keys(&ms),
        ["1 * allow (0, 0) [#2]", "2 TCP/80 allow (0, 0) [#3]"]
    );
    assert_eq!(render_covered(&ms), ["#1 at 1 TCP/80 by 1 *"]);
    let mut after = rules.clone();
    after.push(deny.clone());
    let changes = step(&mut ms, vec![Update::AddEntry(deny)], &after);
    assert_eq!(changes, ["~ 1 * allow (0, 0) [#2] -> 1 * deny (0, 0) [#4]"]);
    assert_eq!(
        render_keys(&ms),
        ["1 * deny (0, 0) [#4]", "2 TCP/80 allow (0, 0) [#3]"]
    );
    assert_eq!(
        render_covered(&ms),
        ["#1 at 1 TCP/80 by 1 *", "#2 at 1 * by 1 *"]
    );
    assert_eq!(verdict(&ms, Some(1), TCP, 80), "deny");
    assert_eq!(verdict(&ms, Some(2), TCP, 80), "allow");
}

#[test]
fn cilium_05_directions_never_interact() {
    // 6a/6b: ingress allows; egress deny for the same identity. Each MapState is one direction,
    // so a change to the egress state writes egress keys only.
    let allow = e(1, 0, Allow, ids(&[1]), tcp(80));
    let ingress = build(std::slice::from_ref(&allow));
    let mut egress = MapState::build(Direction::Egress, Deny, [allow.clone()]).unwrap();
    let deny = e(2, 0, Deny, ids(&[1]), l3());
    let changes = egress.apply([Update::AddEntry(deny)]).unwrap();
    assert_eq!(
        render_changes(&changes),
        ["+ 1 * deny (0, 0) [#2]", "- 1 TCP/80 allow (0, 0) [#1]"]
    );
    assert_eq!(egress.direction(), Direction::Egress);
    assert_eq!(verdict(&egress, Some(1), TCP, 80), "deny");
    assert_eq!(render_keys(&ingress), ["1 TCP/80 allow (0, 0) [#1]"]);
    assert_eq!(verdict(&ingress, Some(1), TCP, 80), "allow");
}

#[test]
fn cilium_06_allows_under_an_l3_deny_are_not_inserted() {
    // 7a/7b, 8a/8b: deny `1 L3`, then allow `1 tcp 80` / `1 tcp 64-127`: bailed.
    let deny = e(1, 0, Deny, ids(&[1]), l3());
    let a80 = e(2, 0, Allow, ids(&[1]), tcp(80));
    let a64 = e(3, 0, Allow, ids(&[1]), tcp_range(64, 127));
    let mut ms = build(std::slice::from_ref(&deny));
    let changes = step(
        &mut ms,
        vec![Update::AddEntry(a80.clone()), Update::AddEntry(a64.clone())],
        &[deny, a80, a64],
    );
    assert_eq!(changes, none());
    assert_eq!(render_keys(&ms), ["1 * deny (0, 0) [#1]"]);
    assert_eq!(
        render_covered(&ms),
        ["#2 at 1 TCP/80 by 1 *", "#3 at 1 TCP/64-127 (/10) by 1 *"]
    );
}

#[test]
fn cilium_07_wildcard_l3_deny_removes_every_identity_key() {
    // 11a/12a/12b: deny `ANY L3` with other ingress entries: all deleted; new allows bailed.
    let rules = vec![
        e(1, 0, Allow, ids(&[1]), tcp(80)),
        e(2, 0, Allow, ids(&[2]), l3()),
    ];
    let deny = e(3, 0, Deny, any(), l3());
    let mut ms = build(&rules);
    let mut now = rules.clone();
    now.push(deny.clone());
    let changes = step(&mut ms, vec![Update::AddEntry(deny)], &now);
    assert_eq!(
        changes,
        [
            "+ * * deny (0, 0) [#3]",
            "- 1 TCP/80 allow (0, 0) [#1]",
            "- 2 * allow (0, 0) [#2]",
        ]
    );
    assert_eq!(render_keys(&ms), ["* * deny (0, 0) [#3]"]);
    assert_eq!(
        render_covered(&ms),
        ["#1 at 1 TCP/80 by * *", "#2 at 2 * by * *"]
    );
    let late = e(4, 0, Allow, ids(&[1]), udp(53));
    now.push(late.clone());
    assert_eq!(step(&mut ms, vec![Update::AddEntry(late)], &now), none());
    assert_eq!(verdict(&ms, Some(1), UDP, 53), "deny");
}

#[test]
fn cilium_10_wildcard_port_deny_inside_a_specific_range_allow() {
    // 15a / 15b-reverse: deny `0 tcp 80` and allow `1 tcp 64-127`, either order: both kept;
    // Cilium resolves 1:80 at lookup time by precedence, we by a covering copy under 1.
    let deny = e(1, 0, Deny, any(), tcp(80));
    let allow = e(2, 0, Allow, ids(&[1]), tcp_range(64, 127));
    for rules in [
        vec![deny.clone(), allow.clone()],
        vec![allow.clone(), deny.clone()],
    ] {
        let ms = build(&rules);
        assert_eq!(
            render_keys(&ms),
            [
                "* TCP/80 deny (0, 0) [#1]",
                "1 TCP/64-127 (/10) allow (0, 0) [#2]",
                "1 TCP/80 deny (0, 0) [#1] synthesized",
            ]
        );
        assert_eq!(render_covered(&ms), none());
        assert_eq!(verdict(&ms, Some(1), TCP, 80), "deny");
        assert_eq!(verdict(&ms, Some(1), TCP, 81), "allow");
        assert_eq!(verdict(&ms, Some(2), TCP, 80), "deny");
        assert_eq!(verdict(&ms, Some(2), TCP, 81), "default");
    }
    // Incrementally in both orders, with the exact writes.
    let mut ms = build(std::slice::from_ref(&deny));
    assert_eq!(
        step(
            &mut ms,
            vec![Update::AddEntry(allow.clone())],
            &[deny.clone(), allow.clone()]
        ),
        [
            "+ 1 TCP/64-127 (/10) allow (0, 0) [#2]",
            "+ 1 TCP/80 deny (0, 0) [#1] synthesized",
        ]
    );
    let mut ms = build(std::slice::from_ref(&allow));
    assert_eq!(
        step(
            &mut ms,
            vec![Update::AddEntry(deny.clone())],
            &[allow.clone(), deny.clone()]
        ),
        [
            "+ * TCP/80 deny (0, 0) [#1]",
            "+ 1 TCP/80 deny (0, 0) [#1] synthesized",
        ]
    );
    // Removing the wildcard deny removes its copy too.
    assert_eq!(
        step(&mut ms, vec![Update::RemoveEntry(deny.id)], &[allow]),
        [
            "- * TCP/80 deny (0, 0) [#1]",
            "- 1 TCP/80 deny (0, 0) [#1] synthesized",
        ]
    );
}

#[test]
fn cilium_11_shared_deny_key_of_two_selectors() {
    // AccumulateMapChangesDeny 2a-2d: Foo{42,43} and Bar{42,44} both deny `tcp 80`; delete 42
    // from both; re-add 44.
    let foo = e(1, 0, Deny, ids(&[42, 43]), tcp(80));
    let bar = e(2, 0, Deny, ids(&[42, 44]), tcp(80));
    let mut ms = build(&[foo.clone(), bar.clone()]);
    assert_eq!(
        render_keys(&ms),
        [
            "42 TCP/80 deny (0, 0) [#1,#2]",
            "43 TCP/80 deny (0, 0) [#1]",
            "44 TCP/80 deny (0, 0) [#2]",
        ]
    );
    let foo2 = PolicyEntry {
        selector: ids(&[43]),
        ..foo.clone()
    };
    let bar2 = PolicyEntry {
        selector: ids(&[44]),
        ..bar.clone()
    };
    let changes = step(
        &mut ms,
        vec![
            Update::Deselect {
                entry: foo.id,
                ids: vec![42],
            },
            Update::Deselect {
                entry: bar.id,
                ids: vec![42],
            },
        ],
        &[foo2.clone(), bar2.clone()],
    );
    assert_eq!(changes, ["- 42 TCP/80 deny (0, 0) [#1,#2]"], "one delete");
    let reselect = Update::Select {
        entry: bar.id,
        ids: vec![44],
    };
    let changes = step(&mut ms, vec![reselect], &[foo2.clone(), bar2.clone()]);
    assert_eq!(changes, none(), "re-adding an existing key changes nothing");
    // Foo now also selects 44: same verdict, one more entry at the key (a value update).
    let foo3 = PolicyEntry {
        selector: ids(&[43, 44]),
        ..foo
    };
    let changes = step(
        &mut ms,
        vec![Update::Select {
            entry: foo3.id,
            ids: vec![44],
        }],
        &[foo3, bar2],
    );
    assert_eq!(
        changes,
        ["~ 44 TCP/80 deny (0, 0) [#2] -> 44 TCP/80 deny (0, 0) [#1,#2]"]
    );
}

#[test]
fn cilium_12_allows_under_an_identity_l3_deny() {
    // AccumulateMapChangesDeny 3a/4a/4b: deny `42 L3`; incremental allows for 42 are never
    // inserted, for 43 they are; add+delete of a bailed key in one batch writes nothing.
    let deny = e(1, 0, Deny, ids(&[42]), l3());
    let dns = e(2, 0, Allow, ids(&[42]), udp(53));
    let http = e(3, 0, Allow, ids(&[42]), tcp(80));
    let mut ms = build(std::slice::from_ref(&deny));
    let changes = step(
        &mut ms,
        vec![
            Update::AddEntry(dns.clone()),
            Update::AddEntry(http.clone()),
        ],
        &[deny.clone(), dns.clone(), http.clone()],
    );
    assert_eq!(changes, none());
    let dns43 = PolicyEntry {
        selector: ids(&[42, 43]),
        ..dns.clone()
    };
    let http43 = PolicyEntry {
        selector: ids(&[42, 43]),
        ..http.clone()
    };
    let changes = step(
        &mut ms,
        vec![
            Update::Select {
                entry: dns.id,
                ids: vec![43],
            },
            Update::Select {
                entry: http.id,
                ids: vec![43],
            },
        ],
        &[deny.clone(), dns43.clone(), http43.clone()],
    );
    assert_eq!(
        changes,
        [
            "+ 43 TCP/80 allow (0, 0) [#3]",
            "+ 43 UDP/53 allow (0, 0) [#2]"
        ]
    );
    let bailed = e(4, 0, Allow, ids(&[42]), tcp(8080));
    let changes = step(
        &mut ms,
        vec![
            Update::AddEntry(bailed.clone()),
            Update::RemoveEntry(bailed.id),
        ],
        &[deny, dns43, http43],
    );
    assert_eq!(changes, none());
}

#[test]
fn cilium_13_add_and_delete_in_one_batch() {
    // AccumulateMapChanges 4a/4b: add then delete the same key in one batch: nothing; add,
    // delete, add: one add.
    let a = e(1, 0, Allow, ids(&[1]), tcp(80));
    let mut ms = build(&[]);
    let changes = step(
        &mut ms,
        vec![Update::AddEntry(a.clone()), Update::RemoveEntry(a.id)],
        &[],
    );
    assert_eq!(changes, none());
    let changes = step(
        &mut ms,
        vec![
            Update::AddEntry(a.clone()),
            Update::RemoveEntry(a.id),
            Update::AddEntry(a.clone()),
        ],
        std::slice::from_ref(&a),
    );
    assert_eq!(changes, ["+ 1 TCP/80 allow (0, 0) [#1]"]);
}

#[test]
fn cilium_14_ordered_incremental_changes() {
    // AccumulateMapChanges 4c-4f (levels P0 < P1 < P2; the P0 redirect is a plain allow here).
    let p0_allow_44 = e(1, 0, Allow, ids(&[44]), tcp(80));
    let p2_deny_any = e(2, 2, Deny, any(), l3());
    let p1_deny_44 = e(3, 1, Deny, ids(&[44]), tcp_all());
    let p1_deny_43 = e(4, 1, Deny, ids(&[43]), tcp(80));
    let p0_allow_43 = e(5, 0, Allow, ids(&[43]), tcp(80));

    let mut now = vec![p0_allow_44.clone()];
    let mut ms = build(&now);
    assert_eq!(render_keys(&ms), ["44 TCP/80 allow (0, 0) [#1]"]);

    // The P2 deny-all does not remove the P0 allow.
    now.push(p2_deny_any.clone());
    let changes = step(&mut ms, vec![Update::AddEntry(p2_deny_any)], &now);
    assert_eq!(changes, ["+ * * deny (2, 0) [#2]"]);
    assert_eq!(verdict(&ms, Some(44), TCP, 80), "allow");
    assert_eq!(verdict(&ms, Some(44), TCP, 81), "deny");

    // Neither does the P1 deny of all TCP for 44.
    now.push(p1_deny_44.clone());
    let changes = step(&mut ms, vec![Update::AddEntry(p1_deny_44)], &now);
    assert_eq!(changes, ["+ 44 TCP/* deny (1, 0) [#3]"]);
    assert_eq!(verdict(&ms, Some(44), TCP, 80), "allow");

    // Deleting the P0 allow removes only its key.
    now.retain(|e| e.id != p0_allow_44.id);
    let changes = step(&mut ms, vec![Update::RemoveEntry(p0_allow_44.id)], &now);
    assert_eq!(changes, ["- 44 TCP/80 allow (0, 0) [#1]"]);
    assert_eq!(verdict(&ms, Some(44), TCP, 80), "deny");

    // P1 deny `43 tcp80`, then the P0 allow at the same key replaces it.
    now.push(p1_deny_43.clone());
    let changes = step(&mut ms, vec![Update::AddEntry(p1_deny_43)], &now);
    assert_eq!(changes, ["+ 43 TCP/80 deny (1, 0) [#4]"]);
    now.push(p0_allow_43.clone());
    let changes = step(&mut ms, vec![Update::AddEntry(p0_allow_43)], &now);
    assert_eq!(
        changes,
        ["~ 43 TCP/80 deny (1, 0) [#4] -> 43 TCP/80 allow (0, 0) [#5]"]
    );
    assert_eq!(render_covered(&ms), ["#4 at 43 TCP/80 by 43 TCP/80"]);
    assert_eq!(
        render_keys(&ms),
        [
            "* * deny (2, 0) [#2]",
            "43 TCP/80 allow (0, 0) [#5]",
            "44 TCP/* deny (1, 0) [#3]",
        ]
    );
}

/// Cilium's subnet identities: `world` selects {world, subnet, ip}, `subnet` {subnet, ip},
/// `ip` {ip}.
const WORLD: Identity = 1;
const SUBNET: Identity = 2;
const IP: Identity = 3;

fn world() -> Selector {
    ids(&[WORLD, SUBNET, IP])
}

fn subnet() -> Selector {
    ids(&[SUBNET, IP])
}

fn ip() -> Selector {
    ids(&[IP])
}

#[test]
fn cilium_17_deny_preferred_insert_with_subnets() {
    // denyPreferredInsertWithSubnets, in spirit: each row in both insertion orders (checked by
    // `build`) with the exact keys, covered notes and a few verdicts.
    struct Row {
        what: &'static str,
        rules: Vec<PolicyEntry>,
        keys: Vec<&'static str>,
        covered: Vec<&'static str>,
        verdicts: Vec<(Identity, u8, u16, &'static str)>,
    }
    let rows = vec![
        Row {
            what: "same level: a superset L3 deny suppresses a subset L3 allow",
            rules: vec![e(1, 0, Deny, world(), l3()), e(2, 0, Allow, subnet(), l3())],
            keys: vec![
                "1 * deny (0, 0) [#1]",
                "2 * deny (0, 0) [#1]",
                "3 * deny (0, 0) [#1]",
            ],
            covered: vec!["#2 at 2 * by 2 *", "#2 at 3 * by 3 *"],
            verdicts: vec![(IP, TCP, 80, "deny"), (SUBNET, ICMP, 0, "deny")],
        },
        Row {
            what: "same level: a superset proto deny suppresses a subset port allow",
            rules: vec![
                e(1, 0, Deny, world(), tcp_all()),
                e(2, 0, Allow, ip(), tcp(80)),
            ],
            keys: vec![
                "1 TCP/* deny (0, 0) [#1]",
                "2 TCP/* deny (0, 0) [#1]",
                "3 TCP/* deny (0, 0) [#1]",
            ],
            covered: vec!["#2 at 3 TCP/80 by 3 TCP/*"],
            verdicts: vec![(IP, TCP, 80, "deny"), (IP, UDP, 80, "default")],
        },
        Row {
            what: "same level: a subset port deny inside a superset L3 allow is kept",
            rules: vec![e(1, 0, Allow, world(), l3()), e(2, 0, Deny, ip(), tcp(80))],
            keys: vec![
                "1 * allow (0, 0) [#1]",
                "2 * allow (0, 0) [#1]",
                "3 * allow (0, 0) [#1]",
                "3 TCP/80 deny (0, 0) [#2]",
            ],
            covered: vec![],
            verdicts: vec![
                (IP, TCP, 80, "deny"),
                (IP, TCP, 81, "allow"),
                (SUBNET, TCP, 80, "allow"),
            ],
        },
        Row {
            what: "an earlier-level allow survives under a later-level deny",
            rules: vec![e(1, 0, Allow, ip(), tcp(80)), e(2, 1, Deny, world(), l3())],
            keys: vec![
                "1 * deny (1, 0) [#2]",
                "2 * deny (1, 0) [#2]",
                "3 * deny (1, 0) [#2]",
                "3 TCP/80 allow (0, 0) [#1]",
            ],
            covered: vec![],
            verdicts: vec![
                (IP, TCP, 80, "allow"),
                (IP, TCP, 81, "deny"),
                (SUBNET, TCP, 80, "deny"),
            ],
        },
        Row {
            what: "a later-level narrower deny is not inserted under an earlier covering allow",
            rules: vec![
                e(1, 0, Allow, subnet(), tcp_all()),
                e(2, 1, Deny, ip(), tcp(80)),
            ],
            keys: vec!["2 TCP/* allow (0, 0) [#1]", "3 TCP/* allow (0, 0) [#1]"],
            covered: vec!["#2 at 3 TCP/80 by 3 TCP/*"],
            verdicts: vec![(IP, TCP, 80, "allow"), (WORLD, TCP, 80, "default")],
        },
        Row {
            what: "deny vs deny at the same level: the broader one covers the narrower",
            rules: vec![e(1, 0, Deny, world(), l3()), e(2, 0, Deny, ip(), tcp(80))],
            keys: vec![
                "1 * deny (0, 0) [#1]",
                "2 * deny (0, 0) [#1]",
                "3 * deny (0, 0) [#1]",
            ],
            covered: vec!["#2 at 3 TCP/80 by 3 *"],
            verdicts: vec![(IP, TCP, 80, "deny")],
        },
        Row {
            what: "with a later allow-all: an earlier subset proto deny stays",
            rules: vec![
                e(1, 1, Allow, world(), l3()),
                e(2, 0, Deny, subnet(), tcp_all()),
            ],
            keys: vec![
                "1 * allow (1, 0) [#1]",
                "2 * allow (1, 0) [#1]",
                "2 TCP/* deny (0, 0) [#2]",
                "3 * allow (1, 0) [#1]",
                "3 TCP/* deny (0, 0) [#2]",
            ],
            covered: vec![],
            verdicts: vec![
                (WORLD, TCP, 80, "allow"),
                (SUBNET, TCP, 80, "deny"),
                (IP, UDP, 53, "allow"),
            ],
        },
        Row {
            what: "a wildcard deny stronger than an identity's broader allow is copied under it",
            rules: vec![e(1, 1, Allow, ip(), l3()), e(2, 0, Deny, any(), tcp(80))],
            keys: vec![
                "* TCP/80 deny (0, 0) [#2]",
                "3 * allow (1, 0) [#1]",
                "3 TCP/80 deny (0, 0) [#2] synthesized",
            ],
            covered: vec![],
            verdicts: vec![
                (IP, TCP, 80, "deny"),
                (IP, TCP, 81, "allow"),
                (WORLD, TCP, 80, "deny"),
            ],
        },
    ];
    for row in rows {
        for rules in [row.rules.clone(), row.rules.iter().rev().cloned().collect()] {
            let ms = build(&rules);
            assert_eq!(render_keys(&ms), row.keys, "{}", row.what);
            assert_eq!(render_covered(&ms), row.covered, "{}", row.what);
            for &(id, proto, port, want) in &row.verdicts {
                assert_eq!(
                    verdict(&ms, Some(id), proto, port),
                    want,
                    "{}: {id} {proto}/{port}",
                    row.what
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The write order.

#[test]
fn safe_order_avoids_the_transient_allow_of_a_naive_order() {
    // Identity 1 allows TCP but denies port 80; the deny widens to 80-81. Deleting the old deny
    // key before the new one is written would let 1 -> TCP/80 through the TCP/* allow for a
    // moment, although both the old and the new policy deny it.
    let allow = e(1, 1, Allow, ids(&[1]), tcp_all());
    let deny80 = e(2, 0, Deny, ids(&[1]), tcp(80));
    let deny80_81 = e(3, 0, Deny, ids(&[1]), tcp_range(80, 81));
    let before = build(&[allow.clone(), deny80.clone()]);
    let mut after = before.clone();
    let changes = after
        .apply([
            Update::RemoveEntry(deny80.id),
            Update::AddEntry(deny80_81.clone()),
        ])
        .unwrap();
    check(&after, &[allow, deny80_81]);
    assert_eq!(
        render_changes(&changes),
        [
            "+ 1 TCP/80-81 (/15) deny (0, 0) [#3]",
            "- 1 TCP/80 deny (0, 0) [#2]"
        ]
    );
    let ids = [Some(1), None];
    let probes = probes_at(&probe_ports([(79, 82)]));
    // Deletions first: the model sees the transient allow.
    let naive: Vec<Op> = changes
        .removed
        .iter()
        .map(|(k, _)| Op::Delete(*k))
        .chain(changes.added.iter().map(|(k, e)| Op::Upsert(*k, e.clone())))
        .collect();
    let err = check_write_order(&before, &after, &naive, &ids, &probes).unwrap_err();
    assert!(err.contains("transient allow after 1 of 2 writes"), "{err}");
    // The safe order writes the new deny first.
    let safe = changes.safe_order();
    assert!(matches!(safe[0], Op::Upsert(_, ref e) if e.verdict == Deny));
    check_write_order(&before, &after, &safe, &ids, &probes).unwrap();
}

#[test]
fn safe_order_when_an_identity_loses_its_last_key() {
    // Identity 1 has only a deny key; the new state removes it and adds a wildcard deny. If the
    // identity's key were deleted first, 1 would fall through to `*`, which still allows.
    let allow_all = e(1, 2, Allow, any(), tcp_all());
    let deny1 = e(2, 0, Deny, ids(&[1]), tcp(80));
    let deny_all80 = e(3, 0, Deny, any(), tcp(80));
    let before = build(&[allow_all.clone(), deny1.clone()]);
    let mut after = before.clone();
    let changes = after
        .apply([
            Update::RemoveEntry(deny1.id),
            Update::AddEntry(deny_all80.clone()),
        ])
        .unwrap();
    check(&after, &[allow_all, deny_all80]);
    assert_eq!(
        render_changes(&changes),
        ["+ * TCP/80 deny (0, 0) [#3]", "- 1 TCP/80 deny (0, 0) [#2]"]
    );
    let ids = [Some(1), Some(2), None];
    let probes = probes_at(&probe_ports([(80, 80)]));
    let naive = vec![
        Op::Delete(changes.removed[0].0),
        Op::Upsert(changes.added[0].0, changes.added[0].1.clone()),
    ];
    assert!(check_write_order(&before, &after, &naive, &ids, &probes).is_err());
    check_write_order(&before, &after, &changes.safe_order(), &ids, &probes).unwrap();
}

/// An entry of a tier, at rule index 0.
fn t(
    id: u64,
    tier: Tier,
    priority: i32,
    action: Action,
    selector: Selector,
    l4: L4Match,
) -> PolicyEntry {
    tiered_entry(id, tier, priority, 0, action, selector, l4)
}

#[test]
fn admin_pass_hands_an_identity_to_a_weaker_wildcard_allow() {
    // Admin: Pass TCP from 5 (prio 10), then Deny everything (prio 20). Ordnet: Allow TCP/80 from
    // everyone. For 5, TCP/80 is passed to the ordnet Allow (the copy of the wildcard entry under
    // the Pass is a key of 5: Cilium lost it, #43916); other TCP of 5 finds nothing below and gets
    // the default (deny here); 5's UDP and everyone else meet the Admin Deny.
    let pass = t(1, Tier::Admin, 10, Action::Pass, ids(&[5]), tcp_all());
    let deny = t(2, Tier::Admin, 20, Action::Deny, any(), l3());
    let allow = e(3, 0, Allow, any(), tcp(80));
    let ms = build(&[pass, deny, allow]);
    let copy = COPY_BASE | 1 << 32 | 3;
    assert_eq!(
        render_keys(&ms),
        [
            "* * deny admin (20, 0) [#2]".to_string(),
            "5 TCP/* deny admin (10, 0) pass [#1]".to_string(),
            format!("5 TCP/80 allow admin (10, 0) pass → (0, 0) [#{copy}]"),
        ]
    );
    assert_eq!(ms.copy_of(EntryId(copy)), Some((EntryId(1), EntryId(3))));
    assert_eq!(verdict(&ms, Some(5), TCP, 80), "allow");
    assert_eq!(verdict(&ms, Some(5), TCP, 81), "deny");
    assert_eq!(verdict(&ms, Some(5), UDP, 53), "deny");
    assert_eq!(verdict(&ms, Some(6), TCP, 80), "deny");
    assert_eq!(verdict(&ms, None, TCP, 80), "deny");
}

#[test]
fn equal_key_deny_beats_pass_beats_accept() {
    // Three Admin entries at one (priority, index): Accept from everyone, Pass from 5, Deny TCP/80
    // from 6. 5 is passed (to the default: deny), 6 is denied on TCP/80 and accepted elsewhere, 7
    // is accepted.
    let accept = t(1, Tier::Admin, 5, Action::Allow, any(), l3());
    let pass = t(2, Tier::Admin, 5, Action::Pass, ids(&[5]), l3());
    let deny = t(3, Tier::Admin, 5, Action::Deny, ids(&[6]), tcp(80));
    let ms = build(&[accept, pass, deny]);
    assert_eq!(verdict(&ms, Some(5), TCP, 80), "deny");
    assert_eq!(verdict(&ms, Some(6), TCP, 80), "deny");
    assert_eq!(verdict(&ms, Some(6), UDP, 53), "allow");
    assert_eq!(verdict(&ms, Some(7), TCP, 80), "allow");
}

#[test]
fn baseline_entries_decide_only_while_the_default_is_allow() {
    // A Baseline Deny of TCP/80 from 5 and a Baseline Pass of TCP from 5 after it: while the
    // endpoint is not isolated they are keys (TCP/80 denied, other TCP allowed by the Pass, which
    // skips the weaker Baseline Deny of everything); once it is isolated they are gone (the
    // isolation default decides before the Baseline tier), and they come back.
    let deny80 = t(1, Tier::Baseline, 1, Action::Deny, ids(&[5]), tcp(80));
    let pass = t(2, Tier::Baseline, 2, Action::Pass, ids(&[5]), tcp_all());
    let deny_all = t(3, Tier::Baseline, 3, Action::Deny, any(), l3());
    let entries = [deny80, pass, deny_all];
    let mut ms = MapState::build(Direction::Ingress, Allow, entries.to_vec()).unwrap();
    check(&ms, &entries);
    assert_eq!(verdict(&ms, Some(5), TCP, 80), "deny");
    assert_eq!(verdict(&ms, Some(5), TCP, 81), "allow");
    assert_eq!(verdict(&ms, Some(5), UDP, 53), "deny");
    let flip = |ms: &mut MapState, to: Verdict| {
        let before = ms.clone();
        let changes = ms.set_default(to);
        check_change_set(&before, ms, &changes).unwrap();
        check(ms, &entries);
        assert_eq!(ms.policy_entries(), entries.to_vec());
        render_changes(&changes)
    };
    assert_eq!(
        flip(&mut ms, Deny),
        [
            "- * * deny baseline (3, 0) [#3]",
            "- 5 TCP/* allow baseline (2, 0) pass [#2]",
            "- 5 TCP/80 deny baseline (1, 0) [#1]",
        ]
    );
    assert!(ms.is_empty());
    assert_eq!(verdict(&ms, Some(5), TCP, 81), "default");
    assert_eq!(flip(&mut ms, Allow).len(), 3);
    assert_eq!(verdict(&ms, Some(5), TCP, 81), "allow");
}
