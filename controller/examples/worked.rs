//! The worked example of docs/mapstate.md: builds a small MapState, prints its trie (the dump),
//! a few lookups, and the change set and write order of adding one identity.
//!
//! `cargo run -p ordnet --example worked`

use std::sync::Arc;

use ordnet::render::trie::{Dump, Focus, TreeOptions};
use ordnet_mapstate::*;

fn entry(id: u64, priority: i32, verdict: Verdict, selector: Selector, l4: L4Match) -> PolicyEntry {
    PolicyEntry {
        id: EntryId(id),
        order: OrderKey::new(priority, 0),
        action: verdict.into(),
        selector,
        l4,
        origin: Arc::new(Origin {
            kind: "OrderedNetworkPolicy".into(),
            namespace: Some("demo".into()),
            name: format!("rule{id}"),
            direction: Direction::Ingress,
            rule_index: 0,
            rule_name: None,
            priority,
            action: verdict.into(),
            tier: ordnet_mapstate::Tier::Ordnet,
            passed_by: None,
        }),
    }
}

fn main() {
    let tcp = Protocol::Tcp;
    let entries = vec![
        // #1 priority 1: every identity may reach TCP 0-1023.
        entry(
            1,
            1,
            Verdict::Allow,
            Selector::Any,
            L4Match::Ports {
                proto: tcp,
                first: 0,
                last: 1023,
            },
        ),
        // #2 priority 2: identity 5 may not use TCP at all.
        entry(2, 2, Verdict::Deny, Selector::ids([5]), L4Match::Proto(tcp)),
        // #3 priority 3: nobody may reach TCP/80 (too late: #1 already decides it).
        entry(3, 3, Verdict::Deny, Selector::Any, L4Match::port(tcp, 80)),
        // #4 priority 2: identity 6 may reach UDP/53.
        entry(
            4,
            2,
            Verdict::Allow,
            Selector::ids([6]),
            L4Match::port(Protocol::Udp, 53),
        ),
    ];
    let mut ms = MapState::build(Direction::Ingress, Verdict::Deny, entries).expect("unique ids");
    let labels = |id: Identity| Some(format!("demo/app=id{id}"));
    print!(
        "{}",
        Dump::new("demo/server")
            .side(&ms, Some("isolated by demo/rule1".into()))
            .labels(labels)
            .focus(Focus {
                identity: Some(5),
                protocol: tcp,
                port: 80,
            })
            .tree(TreeOptions::default())
    );
    println!();
    for (id, proto, port) in [
        (Some(5), 6u8, 80u16),
        (Some(5), 6, 2000),
        (Some(6), 6, 80),
        (Some(6), 17, 53),
        (None, 6, 2000),
    ] {
        let d = ms.lookup(id, proto, port);
        let by = match d {
            Decision::Matched { key, entry } => format!(
                "key ({}, {}) order {} entries {:?}",
                key.peer, key.prefix, entry.order, entry.entries
            ),
            Decision::Default(_) => "isolation default".into(),
        };
        println!(
            "lookup id {:>4} proto {proto:>2} port {port:>4}: {} by {by}",
            id.map_or("none".into(), |i| i.to_string()),
            d.verdict()
        );
    }
    println!();
    let changes = ms
        .apply([Update::AddIdentity {
            id: 7,
            selected_by: vec![EntryId(2)],
        }])
        .expect("valid update");
    println!("AddIdentity 7 (selected by #2): write order");
    for op in changes.safe_order() {
        match op {
            Op::Upsert(k, e) => println!(
                "  upsert ({}, {}) {} {}{}",
                k.peer,
                k.prefix,
                e.verdict,
                e.order,
                if e.synthesized { " synthesized" } else { "" }
            ),
            Op::Delete(k) => println!("  delete ({}, {})", k.peer, k.prefix),
        }
    }
}
