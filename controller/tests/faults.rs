//! The agent through API server faults, played by the fake API server: the server killed and
//! started again (history kept, and compacted so every watch gets 410 Gone), watches that are
//! accepted and then never send anything, a slow server, and bursts of 410 Gone on re-list.
//!
//! In each: nothing the agent programmed changes while it cannot hear the API server (the
//! programmed tables, and the verdicts decided over them by the in-memory datapath, are sampled
//! throughout), the staleness is visible (`/readyz` body, metrics) while it lasts, and the agent
//! ends equal to a from-scratch build of the final objects.
//!
//! `restart_bench` (ignored; run it with `cargo test --release -p ordnet --test faults
//! restart_bench -- --ignored --nocapture`) measures change → programmed after the API server
//! comes back, over repeated kills.

mod support;

use std::time::{Duration, Instant};

use ordnet::agent::{AgentHandle, WatchConfig, wait_until};
use ordnet_engine::ObjectKind;
use ordnet_testsuite::fakeapi::{FakeApi, Faults, History};
use ordnet_testsuite::scale::{self, Shape};
use support::*;

/// Generous: a bound for a test to fail on, not the number measured (the benchmark's).
const LIMIT: Duration = Duration::from_secs(30);

/// Two nodes of 100 pods (the agent is node 0's), 10 namespaces, 40 policies.
const SHAPE: Shape = Shape {
    pods: 200,
    policies: 40,
};

/// Short watch timeouts, so a silent watch is found in 2 s.
fn quick_watch() -> WatchConfig {
    WatchConfig {
        timeout: Duration::from_secs(1),
        idle_grace: Duration::from_secs(1),
        ..WatchConfig::default()
    }
}

struct Cluster {
    api: FakeApi,
    agent: AgentHandle,
    node: String,
    shape: Shape,
    /// How many changes were made so far (each change is a new one of its kind).
    changes: usize,
}

impl Cluster {
    async fn start(shape: Shape, watch: WatchConfig) -> Cluster {
        let api = FakeApi::start().await.unwrap();
        for o in shape.objects() {
            api.create(o).unwrap();
        }
        let node = scale::node_name(0);
        let agent = start_agent_with(&api, &node, LIMIT, watch).await;
        let c = Cluster {
            api,
            agent,
            node,
            shape,
            changes: 0,
        };
        c.converged(LIMIT, "the initial sync").await;
        c
    }

    /// One change of every kind (pods here and elsewhere, a namespace, both policy kinds).
    fn change_all(&mut self) {
        for k in 0..scale::CHANGE_KINDS.len() {
            let _ = scale::change(&self.api, &self.shape, k, self.changes);
        }
        self.changes += 1;
    }

    /// Waits until what the agent programmed equals a fresh build of the server's objects;
    /// how long after `since` the batch that got it there was applied (a sampler notes when
    /// each batch lands, so the cost of the fresh build and of the comparison is not counted).
    async fn converged_since(&self, since: Instant, limit: Duration, step: &str) -> Duration {
        let state = self.agent.state.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut seen = state.metrics.batches.get();
                let mut last = since;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let now = state.metrics.batches.get();
                    if now != seen {
                        seen = now;
                        last = Instant::now();
                    }
                    std::thread::sleep(Duration::from_micros(500));
                }
                last
            })
        };
        let want = offline_on(&self.api, &self.node);
        loop {
            if programmed(&self.agent).as_ref() == Some(&want) {
                break;
            }
            assert!(
                since.elapsed() < limit,
                "{step}: the agent did not end equal to a fresh build within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let last = sampler.join().unwrap();
        last.saturating_duration_since(since)
    }

    /// [`Cluster::converged_since`] now.
    async fn converged(&self, limit: Duration, step: &str) -> Duration {
        self.converged_since(Instant::now(), limit, step).await
    }

    /// The verdicts of every pair of this node's endpoints on TCP 80, decided by the datapath
    /// over the tables the agent programmed.
    async fn verdicts(&self) -> String {
        let (code, body) =
            http_get(self.agent.debug_addr(), "/v1/matrix?protocol=TCP&port=80").await;
        assert_eq!(code, 200, "{body}");
        body
    }

    /// For `period`, the programmed tables (sampled every 20 ms) and the verdicts (every 500
    /// ms) stay what they were at the start.
    async fn unchanged_for(&self, period: Duration, step: &str) {
        let tables = programmed(&self.agent);
        let verdicts = self.verdicts().await;
        let t = Instant::now();
        let mut last_verdicts = Instant::now();
        while t.elapsed() < period {
            assert!(
                programmed(&self.agent) == tables,
                "{step}: the programmed tables changed while the agent could not hear the API server"
            );
            if last_verdicts.elapsed() >= Duration::from_millis(500) {
                assert!(
                    self.verdicts().await == verdicts,
                    "{step}: a verdict changed while the agent could not hear the API server"
                );
                last_verdicts = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn readyz(&self) -> (u16, String) {
        http_get(self.agent.debug_addr(), "/readyz").await
    }

    async fn metrics(&self) -> String {
        http_get(self.agent.debug_addr(), "/metrics").await.1
    }

    /// Waits until `/readyz` answers 200 and its body contains `text`.
    async fn readyz_says(&self, text: &str, step: &str) {
        let t = Instant::now();
        loop {
            let (code, body) = self.readyz().await;
            assert_eq!(code, 200, "{step}: readiness must stay true: {body}");
            if body.contains(text) {
                return;
            }
            assert!(
                t.elapsed() < LIMIT,
                "{step}: /readyz never said {text:?}; it says {body:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until no kind is stale (`/readyz` says just `ready`).
    async fn in_step(&self, step: &str) {
        self.readyz_says("ready", step).await;
        assert!(
            wait_until(LIMIT, || self
                .agent
                .state
                .watch
                .stale(Instant::now())
                .is_empty())
            .await,
            "{step}: still stale: {:?}",
            self.agent.state.watch.stale(Instant::now())
        );
    }

    fn total(&self, f: impl Fn(&ordnet::agent::KindHealth) -> u64) -> u64 {
        self.agent.state.watch.all().iter().map(|(_, h)| f(h)).sum()
    }

    /// Requests whose URI starts with `prefix` and that are lists (not watches).
    fn lists_since(&self, from: usize) -> usize {
        self.api.requests()[from..]
            .iter()
            .filter(|r| r.method == "GET" && !r.uri.contains("watch=") && r.uri.contains("limit="))
            .count()
    }
}

/// The API server is killed and started again on the same port: with its history (the agent
/// resumes every watch where it was, no re-list) and compacted (every watch gets 410 Gone and
/// the agent lists again). Changes made while it is away and right after it is back reach the
/// datapath; while it is away nothing programmed changes and `/readyz` says which kinds are
/// stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_killed_and_back_with_history_and_compacted() {
    let mut c = Cluster::start(SHAPE, WatchConfig::default()).await;
    for history in [History::Kept, History::Compacted] {
        let step = format!("restart ({history:?})");
        c.change_all();
        c.converged(LIMIT, &step).await;
        let relists = c.total(|h| h.relists);

        c.api.stop();
        // Changes the agent cannot see yet (another API server of an HA pair took them).
        c.change_all();
        for kind in ObjectKind::ALL {
            c.readyz_says(&format!("{}: stale for", kind.name()), &step)
                .await;
        }
        assert!(
            c.metrics().await.lines().any(|l| l
                .strip_prefix("ordnet_watch_stale_seconds{kind=\"Pod\"} ")
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|v| v > 0.0)),
            "{step}: ordnet_watch_stale_seconds does not show the Pod watch stale"
        );
        c.unchanged_for(Duration::from_secs(2), &step).await;

        c.api.start_again(history).await.unwrap();
        let back = Instant::now();
        c.change_all();
        let took = c.converged_since(back, LIMIT, &step).await;
        eprintln!("{step}: changes programmed {took:?} after the server was back");
        c.in_step(&step).await;
        match history {
            History::Kept => assert_eq!(
                c.total(|h| h.relists) - relists,
                0,
                "{step}: listed again although the history was kept"
            ),
            // A resumed watch is in step once the server accepts it; the 410 comes after, as
            // the stream's first event. A kind whose objects did not change can be converged
            // and in step in between, so wait for every kind's list.
            History::Compacted => assert!(
                wait_until(LIMIT, || c.total(|h| h.relists) - relists
                    >= ObjectKind::ALL.len() as u64)
                .await,
                "{step}: only {} kinds listed again after 410: {:#?}",
                c.total(|h| h.relists) - relists,
                c.agent.state.watch.all()
            ),
        }
    }
    assert!(c.total(|h| h.reconnects) >= ObjectKind::ALL.len() as u64);
}

/// Watches that are accepted and then send nothing at all (a half-open connection, a stalled
/// proxy): each is taken for dead after its timeout plus the grace and started again; the kind
/// shows stale meanwhile, with why; once the server answers again the agent catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_watches_are_restarted() {
    let mut c = Cluster::start(SHAPE, quick_watch()).await;
    c.api.set_faults(Faults {
        silent_watches: true,
        ..Faults::default()
    });
    // Every open watch ends; the new ones are silent.
    c.api.drop_watches();
    c.change_all();
    let step = "silent watches";
    c.readyz_says("heard nothing", step).await;
    c.unchanged_for(Duration::from_secs(1), step).await;
    assert!(
        wait_until(LIMIT, || c.total(|h| h.silent)
            >= ObjectKind::ALL.len() as u64)
        .await,
        "{step}: silent watches were not all restarted"
    );
    assert!(
        c.metrics()
            .await
            .contains("ordnet_watch_silent_total{kind=\"Pod\"} ")
    );

    c.api.set_faults(Faults::default());
    c.converged(LIMIT, step).await;
    c.in_step(step).await;
}

/// A server that answers every request late (here 300 ms): the agent starts, follows changes
/// and never takes the slowness for a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_server_is_followed() {
    let api = FakeApi::start().await.unwrap();
    for o in SHAPE.objects() {
        api.create(o).unwrap();
    }
    api.set_faults(Faults {
        delay: Duration::from_millis(300),
        ..Faults::default()
    });
    let node = scale::node_name(0);
    let agent = start_agent_with(&api, &node, LIMIT, quick_watch()).await;
    let mut c = Cluster {
        api,
        agent,
        node,
        shape: SHAPE,
        changes: 0,
    };
    let step = "slow server";
    c.converged(LIMIT, step).await;
    for _ in 0..3 {
        c.change_all();
        c.converged(LIMIT, step).await;
    }
    // Watches time out every second and are resumed, each start answered 300 ms late: none of
    // that is an error.
    tokio::time::sleep(Duration::from_secs(3)).await;
    c.change_all();
    c.converged(LIMIT, step).await;
    assert_eq!(
        c.total(|h| h.errors),
        0,
        "{step}: {:?}",
        c.agent.state.watch.all()
    );
    assert_eq!(c.total(|h| h.silent), 0);
    c.in_step(step).await;
}

/// After a restart that compacted the history, every kind lists again, and the lists fail with
/// 410 Gone in a burst: each is tried again after the backoff (not in a hot loop), the last
/// state stays programmed meanwhile, and the agent ends equal to a fresh build, including a
/// delete it never saw as an event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_of_410_on_relist() {
    let mut c = Cluster::start(SHAPE, WatchConfig::default()).await;
    let step = "410 on re-list";
    const FAILING: usize = 24;
    c.api.set_faults(Faults {
        failing_lists: FAILING,
        ..Faults::default()
    });
    let from = c.api.requests().len();
    c.api.restart();
    // A pod of the agent's node (pods go round the nodes) that no change touches.
    let pod = SHAPE.pod(4);
    c.api
        .delete(
            "v1",
            "Pod",
            pod["metadata"]["namespace"].as_str().unwrap(),
            pod["metadata"]["name"].as_str().unwrap(),
        )
        .unwrap();
    c.change_all();
    c.readyz_says("410", step).await;
    c.converged(LIMIT, step).await;
    c.in_step(step).await;
    assert_eq!(c.api.faults().failing_lists, 0);
    let lists = c.lists_since(from);
    // Every failed list, then one good list per kind; a few more at most (a list a watch
    // started meanwhile): no hot loop.
    assert!(
        lists >= FAILING + ObjectKind::ALL.len() && lists <= FAILING + 3 * ObjectKind::ALL.len(),
        "{step}: {lists} list requests for {FAILING} failures"
    );
}

/// Change → programmed after the API server comes back, over repeated kills (history kept and
/// compacted in turn), with the server away 3 s each time (long enough for the backoff to reach
/// its bound). Prints p50/max. `ORDNET_RESTARTS` sets the number of kills (default 10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with --release --ignored --nocapture"]
async fn restart_bench() {
    let runs: usize = std::env::var("ORDNET_RESTARTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let shape = Shape {
        pods: 2000,
        policies: 200,
    };
    let mut c = Cluster::start(shape, WatchConfig::default()).await;
    let mut took = Vec::new();
    let mut in_step = Vec::new();
    for run in 0..runs {
        let history = if run % 2 == 0 {
            History::Kept
        } else {
            History::Compacted
        };
        c.api.stop();
        c.change_all();
        tokio::time::sleep(Duration::from_secs(3)).await;
        c.api.start_again(history).await.unwrap();
        let back = Instant::now();
        c.change_all();
        took.push(c.converged_since(back, LIMIT, "restart").await);
        assert!(
            wait_until(LIMIT, || c
                .agent
                .state
                .watch
                .stale(Instant::now())
                .is_empty())
            .await
        );
        in_step.push(back.elapsed());
        let health = c.agent.state.watch.all();
        eprintln!(
            "run {run} ({history:?}): changes programmed {:.0} ms after the server was back; failed requests so far per kind: {:?}",
            took[run].as_secs_f64() * 1e3,
            health
                .iter()
                .map(|(k, h)| (k.name(), h.errors))
                .collect::<Vec<_>>()
        );
    }
    let report = |what: &str, v: &mut Vec<Duration>| {
        v.sort();
        eprintln!(
            "{what}: p50 {:.0} ms, max {:.0} ms over {} restarts ({} pods, {} policies)",
            v[v.len() / 2].as_secs_f64() * 1e3,
            v[v.len() - 1].as_secs_f64() * 1e3,
            v.len(),
            shape.pods,
            shape.policies
        );
    };
    report(
        "change -> programmed after the API server is back",
        &mut took,
    );
    report("every kind in step (at most)", &mut in_step);
}
