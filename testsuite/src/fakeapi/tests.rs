//! The fake API server against the real kube client.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, events};
use ordnet_crds::OrderedNetworkPolicy;
use serde_json::json;
use tokio::time::timeout;

use super::*;

fn pod(ns: &str, name: &str, app: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": ns, "name": name, "labels": {"app": app}},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
        "status": {"podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}]}})
}

fn onp(ns: &str, name: &str, priority: i64) -> Value {
    json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
        "metadata": {"namespace": ns, "name": name},
        "spec": {"priority": priority, "podSelector": {}, "ingress": [{"action": "Deny"}]}})
}

type Stream = std::pin::Pin<Box<dyn futures::Stream<Item = watcher::Result<Event<Pod>>> + Send>>;

async fn next_event(s: &mut Stream) -> Event<Pod> {
    timeout(Duration::from_secs(10), s.next())
        .await
        .expect("a watch event within 10 s")
        .expect("stream open")
        .expect("no watcher error")
}

/// Reads events until `InitDone`, returning the names of the pods of the (re-)list. An `Init`
/// restarts the list, unless the caller has already read the list's `Init` (`after_init`):
/// then any other `Init` is unexpected.
async fn read_init(s: &mut Stream, after_init: bool) -> Vec<String> {
    let mut names = Vec::new();
    loop {
        match next_event(s).await {
            Event::Init if !after_init => names.clear(),
            Event::InitApply(p) => names.push(p.metadata.name.unwrap_or_default()),
            Event::InitDone => return names,
            other if after_init => panic!("unexpected {other:?} during the re-list"),
            other => panic!("unexpected {other:?} during the initial list"),
        }
    }
}

/// How many list requests (GETs that are not watches) the fake server has answered.
fn list_requests(api: &FakeApi) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.method == "GET" && !r.uri.contains("watch=true"))
        .count()
}

#[tokio::test]
async fn list_get_and_watch_with_the_kube_client() {
    let api = FakeApi::start().await.unwrap();
    api.create(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a"}}))
        .unwrap();
    api.create(pod("a", "p1", "web")).unwrap();
    let client = api.client();
    let pods: Api<Pod> = Api::all(client.clone());
    let list = pods.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    assert_eq!(list.metadata.resource_version.as_deref(), Some("2"));
    let p1 = Api::<Pod>::namespaced(client.clone(), "a")
        .get("p1")
        .await
        .unwrap();
    assert_eq!(p1.status.unwrap().pod_ip.as_deref(), Some("10.0.0.1"));
    let missing = Api::<Pod>::namespaced(client.clone(), "a")
        .get("nope")
        .await;
    assert!(matches!(missing, Err(kube::Error::Api(s)) if s.code == 404));
    let ns: Api<Namespace> = Api::all(client.clone());
    assert_eq!(
        ns.get("a").await.unwrap().metadata.name.as_deref(),
        Some("a")
    );

    let mut s: Stream = Box::pin(watcher(pods, watcher::Config::default()));
    assert_eq!(read_init(&mut s, false).await, vec!["p1"]);
    api.create(pod("a", "p2", "db")).unwrap();
    match next_event(&mut s).await {
        Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("p2")),
        other => panic!("{other:?}"),
    }
    let mut relabeled = pod("a", "p2", "cache");
    relabeled["metadata"]["labels"]["tier"] = json!("x");
    api.update(relabeled).unwrap();
    match next_event(&mut s).await {
        Event::Apply(p) => assert_eq!(p.metadata.labels.unwrap()["app"], "cache"),
        other => panic!("{other:?}"),
    }
    api.delete("v1", "Pod", "a", "p1").unwrap();
    match next_event(&mut s).await {
        Event::Delete(p) => assert_eq!(p.metadata.name.as_deref(), Some("p1")),
        other => panic!("{other:?}"),
    }
}

fn watcher(
    api: Api<Pod>,
    config: watcher::Config,
) -> impl futures::Stream<Item = watcher::Result<Event<Pod>>> + Send {
    watcher::watcher(api, config)
}

/// A fake server with one pod `a/p1`, and a backing-off pod watcher that has read its initial
/// list (exactly `p1`).
async fn watching_p1() -> (FakeApi, Stream) {
    let api = FakeApi::start().await.unwrap();
    api.create(pod("a", "p1", "web")).unwrap();
    let pods: Api<Pod> = Api::all(api.client());
    let mut s: Stream = Box::pin(watcher(pods, watcher::Config::default()).default_backoff());
    assert_eq!(read_init(&mut s, false).await, vec!["p1"]);
    (api, s)
}

#[tokio::test]
async fn a_dropped_watch_resumes_without_a_relist() {
    let (api, mut s) = watching_p1().await;
    api.drop_watches();
    api.create(pod("a", "p2", "web")).unwrap();
    match next_event(&mut s).await {
        Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("p2")),
        other => panic!("{other:?}"),
    }
    let lists = list_requests(&api);
    assert_eq!(lists, 1, "{:#?}", api.requests());
}

#[tokio::test]
async fn compaction_makes_the_watcher_relist() {
    let (api, mut s) = watching_p1().await;
    api.restart();
    api.delete("v1", "Pod", "a", "p1").unwrap();
    api.create(pod("a", "p3", "web")).unwrap();
    // The resumed watch gets 410 Gone; the watcher reports it and re-lists.
    let names = loop {
        let ev = timeout(Duration::from_secs(10), s.next())
            .await
            .unwrap()
            .unwrap();
        match ev {
            Err(e) => assert!(
                e.to_string().contains("410") || format!("{e:?}").contains("410"),
                "{e:?}"
            ),
            Ok(Event::Init) => break read_init(&mut s, true).await,
            Ok(other) => panic!("{other:?}"),
        }
    };
    assert_eq!(names, vec!["p3"]);
    // One list, the watch from the compacted version (410), the re-list.
    let lists = list_requests(&api);
    assert_eq!(lists, 2, "{:#?}", api.requests());
}

/// A restart is one step for a watch: one that looks at the log after the compaction (woken by
/// its bookmark ticker before it saw the drop) ends without moving its cursor, so nothing it sends
/// (a bookmark at the cursor) lets a client resume past the compaction without 410 Gone.
#[tokio::test]
async fn a_watch_sees_a_restart_as_one_step() {
    let api = FakeApi::start().await.unwrap();
    api.create(pod("a", "p1", "web")).unwrap();
    let epoch = api.inner.signal.borrow().1;
    let mut cursor = watches::Cursor {
        resource: resource_index("", "v1", "pods").unwrap(),
        namespace: None,
        rv: api.inner.lock().rv,
    };
    let caught_up = cursor.rv;
    let (events, ended) = cursor.pending(&api.inner, epoch);
    assert!(events.is_empty() && !ended);
    api.restart();
    let (events, ended) = cursor.pending(&api.inner, epoch);
    assert!(events.is_empty() && ended);
    assert_eq!(cursor.rv, caught_up);
    assert!(cursor.rv < api.inner.lock().compacted);
}

#[tokio::test]
async fn status_server_side_apply_keeps_spec_and_generation() {
    let api = FakeApi::start().await.unwrap();
    api.create(onp("a", "guard", 10)).unwrap();
    let onps: Api<OrderedNetworkPolicy> = Api::namespaced(api.client(), "a");
    let status = json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
        "status": {"observedGeneration": 1, "conditions": [{"type": "Accepted", "status": "True",
            "reason": "Valid", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z",
            "observedGeneration": 1}]}});
    let out = onps
        .patch_status(
            "guard",
            &PatchParams::apply("ordnet").force(),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();
    assert_eq!(out.metadata.generation, Some(1));
    let stored = api
        .get("ordnet.io/v1alpha1", "OrderedNetworkPolicy", "a", "guard")
        .unwrap();
    assert_eq!(stored["status"]["conditions"][0]["type"], "Accepted");
    assert_eq!(stored["spec"]["priority"], 10);
    // A status write cannot change the spec, a spec write cannot change the status.
    let sneaky = json!({"spec": {"priority": 99}, "status": {"observedGeneration": 7}});
    onps.patch_status("guard", &PatchParams::default(), &Patch::Merge(&sneaky))
        .await
        .unwrap();
    let stored = api
        .get("ordnet.io/v1alpha1", "OrderedNetworkPolicy", "a", "guard")
        .unwrap();
    assert_eq!(stored["spec"]["priority"], 10);
    assert_eq!(stored["status"]["observedGeneration"], 7);
    let mut edited = onp("a", "guard", 20);
    edited["status"] = json!({"observedGeneration": 100});
    api.update(edited.clone()).unwrap();
    let stored = api
        .get("ordnet.io/v1alpha1", "OrderedNetworkPolicy", "a", "guard")
        .unwrap();
    assert_eq!(stored["metadata"]["generation"], 2);
    // `update` is a test hook: it writes the status it is given too.
    assert_eq!(stored["status"]["observedGeneration"], 100);
    // A metadata-only change does not bump the generation.
    edited["metadata"]["labels"] = json!({"x": "y"});
    api.update(edited).unwrap();
    let stored = api
        .get("ordnet.io/v1alpha1", "OrderedNetworkPolicy", "a", "guard")
        .unwrap();
    assert_eq!(stored["metadata"]["generation"], 2);
    // Status of an object that does not exist: 404.
    let e = onps
        .patch_status(
            "nope",
            &PatchParams::apply("ordnet").force(),
            &Patch::Apply(&status),
        )
        .await;
    assert!(matches!(e, Err(kube::Error::Api(s)) if s.code == 404));
}

#[tokio::test]
async fn leases_conflict_on_a_stale_resource_version() {
    let api = FakeApi::start().await.unwrap();
    let leases: Api<Lease> = Api::namespaced(api.client(), "kube-system");
    let lease: Lease = serde_json::from_value(json!({"metadata": {"name": "ordnet-status"},
        "spec": {"holderIdentity": "node-a", "leaseDurationSeconds": 15}}))
    .unwrap();
    let created = leases.create(&PostParams::default(), &lease).await.unwrap();
    let again = leases.create(&PostParams::default(), &lease).await;
    assert!(matches!(again, Err(kube::Error::Api(s)) if s.code == 409));
    let mut mine = created.clone();
    mine.spec.as_mut().unwrap().holder_identity = Some("node-b".into());
    let replaced = leases
        .replace("ordnet-status", &PostParams::default(), &mine)
        .await
        .unwrap();
    assert_ne!(
        replaced.metadata.resource_version,
        created.metadata.resource_version
    );
    // `created` carries the old resource version now.
    let stale = leases
        .replace("ordnet-status", &PostParams::default(), &created)
        .await;
    assert!(matches!(stale, Err(kube::Error::Api(s)) if s.code == 409));
    let got = leases.get("ordnet-status").await.unwrap();
    assert_eq!(got.spec.unwrap().holder_identity.as_deref(), Some("node-b"));
}

#[tokio::test]
async fn events_from_the_kube_recorder_are_recorded() {
    let api = FakeApi::start().await.unwrap();
    let created = api.create(onp("a", "broken", 1)).unwrap();
    let obj: OrderedNetworkPolicy = serde_json::from_value(created).unwrap();
    let reporter = events::Reporter {
        controller: "ordnet-agent".into(),
        instance: Some("node-a".into()),
    };
    let recorder = events::Recorder::new(api.client(), reporter);
    let reference = kube::Resource::object_ref(&obj, &());
    recorder
        .publish(
            &events::Event {
                type_: events::EventType::Warning,
                reason: "Invalid".into(),
                note: Some("spec.priority: bad".into()),
                action: "Validate".into(),
                secondary: None,
            },
            &reference,
        )
        .await
        .unwrap();
    let evs = api.events();
    assert_eq!(evs.len(), 1, "{evs:#?}");
    assert_eq!(evs[0]["reason"], "Invalid");
    assert_eq!(evs[0]["regarding"]["name"], "broken");
    assert_eq!(evs[0]["note"], "spec.priority: bad");
}

#[test]
fn paths_parse_like_the_api_server() {
    let t = parse_path("/api/v1/namespaces/a/pods/p/status").unwrap();
    assert_eq!(
        (
            RESOURCES[t.resource].plural,
            t.namespace.as_deref(),
            t.name.as_deref(),
            t.status
        ),
        ("pods", Some("a"), Some("p"), true)
    );
    let t = parse_path("/api/v1/namespaces/a").unwrap();
    assert_eq!(
        (
            RESOURCES[t.resource].plural,
            t.namespace.as_deref(),
            t.name.as_deref()
        ),
        ("namespaces", None, Some("a"))
    );
    let t = parse_path("/apis/ordnet.io/v1alpha1/clusterorderednetworkpolicies/x/status").unwrap();
    assert!(t.status && t.namespace.is_none());
    assert!(parse_path("/apis/ordnet.io/v1alpha1/orderednetworkpolicies/x").is_err());
    assert!(parse_path("/apis/apps/v1/deployments").is_err());
    assert!(parse_path("/apis/coordination.k8s.io/v1/namespaces/a/leases/l/status").is_err());
    let q = query_map(Some("labelSelector=a%3Db+c&watch=1&x"));
    assert_eq!(q["labelSelector"], "a=b c");
    assert_eq!(q["watch"], "1");
    assert_eq!(q["x"], "");
}

#[tokio::test]
async fn streaming_lists_and_bookmarks() {
    let api = FakeApi::start().await.unwrap();
    api.create(pod("a", "p1", "web")).unwrap();
    api.create(pod("b", "p2", "web")).unwrap();
    let pods: Api<Pod> = Api::all(api.client());
    // sendInitialEvents=true: the initial ADDEDs, then the initial-events-end bookmark.
    let mut s: Stream = Box::pin(watcher(pods, watcher::Config::default().streaming_lists()));
    let mut names = read_init(&mut s, false).await;
    names.sort();
    assert_eq!(names, vec!["p1", "p2"]);
    assert!(
        api.requests().iter().all(|r| !r.uri.contains("limit=")),
        "a streaming list does not list: {:#?}",
        api.requests()
    );
    api.create(pod("a", "p3", "web")).unwrap();
    match next_event(&mut s).await {
        Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("p3")),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn raw_watch_sends_bookmarks_on_request_and_410_for_compacted_versions() {
    use http_body_util::BodyExt;
    let api = FakeApi::start().await.unwrap();
    api.create(pod("a", "p1", "web")).unwrap();
    let rv = api.resource_version();
    let client = api.client();
    let req = ::http::Request::get(format!(
        "/api/v1/pods?watch=true&allowWatchBookmarks=true&resourceVersion={rv}"
    ))
    .body(Vec::new())
    .unwrap();
    let resp = client
        .send(req.map(kube::client::Body::from))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    api.bookmark();
    let frame = timeout(Duration::from_secs(5), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let line: Value = serde_json::from_slice(frame.data_ref().unwrap()).unwrap();
    assert_eq!(line["type"], "BOOKMARK");
    assert_eq!(
        line["object"]["metadata"]["resourceVersion"],
        rv.to_string()
    );
    api.compact();
    let req = ::http::Request::get(format!("/api/v1/pods?watch=true&resourceVersion={rv}"))
        .body(Vec::new())
        .unwrap();
    let resp = client
        .send(req.map(kube::client::Body::from))
        .await
        .unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let line: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(line["type"], "ERROR");
    assert_eq!(line["object"]["code"], 410);
    assert_eq!(line["object"]["reason"], "Expired");
}

#[tokio::test]
async fn paged_lists_are_served_as_of_the_first_page() {
    let api = FakeApi::start().await.unwrap();
    for i in 0..5 {
        api.create(pod("a", &format!("p{i}"), "web")).unwrap();
    }
    let pods: Api<Pod> = Api::all(api.client());
    let first = pods.list(&ListParams::default().limit(2)).await.unwrap();
    let names = |l: &kube::core::ObjectList<Pod>| {
        l.items
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&first), ["p0", "p1"]);
    assert_eq!(first.metadata.remaining_item_count, Some(3));
    let token = first.metadata.continue_.clone().unwrap();
    // Changes after the first page do not show in the later pages.
    api.delete("v1", "Pod", "a", "p2").unwrap();
    api.create(pod("a", "p3a", "web")).unwrap();
    let mut p4 = api.get("v1", "Pod", "a", "p4").unwrap();
    p4["metadata"]["labels"]["app"] = json!("db");
    api.update(p4).unwrap();
    let second = pods
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(names(&second), ["p2", "p3"]);
    let third = pods
        .list(
            &ListParams::default()
                .limit(2)
                .continue_token(second.metadata.continue_.as_deref().unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(names(&third), ["p4"]);
    assert_eq!(
        third.items[0].metadata.labels.as_ref().unwrap()["app"],
        "web"
    );
    assert_eq!(third.metadata.continue_, None);
    assert_eq!(
        third.metadata.resource_version,
        first.metadata.resource_version
    );
    // A token from before a compaction has expired; the watcher (which pages by 500) still
    // lists everything.
    api.compact();
    let e = pods
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap_err();
    assert!(
        matches!(e, kube::Error::Api(ref s) if s.code == 410),
        "{e:?}"
    );
    let mut s: Stream = Box::pin(watcher(pods, watcher::Config::default().page_size(2)));
    let mut listed = read_init(&mut s, false).await;
    listed.sort();
    assert_eq!(listed, ["p0", "p1", "p3", "p3a", "p4"]);
}

/// A stopped server refuses connections and closes open watches; started again with its
/// history, a watch resumed from an old version gets what it missed; compacted, it gets 410.
#[tokio::test]
async fn stop_and_start_again_with_and_without_history() {
    let api = FakeApi::start().await.unwrap();
    api.create(pod("a", "p1", "web")).unwrap();
    let pods: Api<Pod> = Api::all(api.client());
    let rv = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut open = pods
        .watch(&kube::api::WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    api.stop();
    // The open watch is cut off (an error or the end, never an event).
    let cut = timeout(Duration::from_secs(5), open.next()).await.unwrap();
    assert!(!matches!(cut, Some(Ok(_))), "{cut:?}");
    assert!(pods.list(&ListParams::default()).await.is_err());
    api.create(pod("a", "p2", "web")).unwrap();

    api.start_again(History::Kept).await.unwrap();
    let mut resumed = pods
        .watch(&kube::api::WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    match timeout(Duration::from_secs(5), resumed.next())
        .await
        .unwrap()
    {
        Some(Ok(kube::api::WatchEvent::Added(p))) => {
            assert_eq!(p.metadata.name.as_deref(), Some("p2"))
        }
        other => panic!("{other:?}"),
    }

    api.start_again(History::Compacted).await.unwrap();
    let mut gone = pods
        .watch(&kube::api::WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    match timeout(Duration::from_secs(5), gone.next()).await.unwrap() {
        Some(Ok(kube::api::WatchEvent::Error(e))) => assert_eq!(e.code, 410),
        other => panic!("{other:?}"),
    }
    // Same objects, same versions.
    assert_eq!(
        pods.list(&ListParams::default()).await.unwrap().items.len(),
        2
    );
}

/// Faults: a silent watch sends nothing (not even at its timeout), failing lists answer 410
/// the given number of times, and a delay holds every answer back.
#[tokio::test]
async fn faults_are_played() {
    let api = FakeApi::start().await.unwrap();
    api.create(pod("a", "p1", "web")).unwrap();
    api.set_bookmark_interval(Duration::from_millis(100));
    let pods: Api<Pod> = Api::all(api.client());
    api.set_faults(Faults {
        silent_watches: true,
        failing_lists: 2,
        ..Faults::default()
    });
    // A plain list reads the current state: never 410.
    assert_eq!(
        pods.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
    for _ in 0..2 {
        match pods.list(&ListParams::default().limit(10)).await {
            Err(kube::Error::Api(s)) => assert_eq!(s.code, 410),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(api.faults().failing_lists, 0);
    assert_eq!(
        pods.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
    let mut silent = pods
        .watch(&kube::api::WatchParams::default().timeout(1), "0")
        .await
        .unwrap()
        .boxed();
    assert!(
        timeout(Duration::from_millis(1500), silent.next())
            .await
            .is_err(),
        "a silent watch sent something"
    );
    api.set_faults(Faults {
        delay: Duration::from_millis(300),
        ..Faults::default()
    });
    let t = std::time::Instant::now();
    pods.list(&ListParams::default()).await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300));
}
