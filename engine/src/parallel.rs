//! The MapState work of one change, on several threads. Every shared state a change touches is
//! changed by its own batch of updates, and every state a moving endpoint needs anew is built
//! from its own entries: these jobs share nothing (entry ids are given out before, by the one
//! thread that owns the engine), so they run on the caller's thread and on helper threads
//! parked between changes ([`helpers`]), each job's result equal to what it would be alone. A
//! local relabel at 10k pods / 5k policies is one build of thousands of entries and hundreds of
//! small batches, about half of the engine's time; the rest (reading the notifications, the
//! diffs of the endpoints' old and new states) stays on the caller's thread. The engine's build
//! and new endpoints build their new states the same way (`Engine::attach_endpoints`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use ordnet_mapstate::{ChangeSet, Direction, MapState, PolicyEntry, Update, UpdateError, Verdict};

/// One piece of MapState work.
pub(crate) enum Job {
    /// A batch applied to a state (taken out of the engine for the time of the job).
    Apply {
        state: Box<MapState>,
        batch: Vec<Update>,
    },
    /// A state built from its entries.
    Build {
        dir: Direction,
        default: Verdict,
        entries: Vec<PolicyEntry>,
    },
}

/// What a [`Job`] gives back, in the same order as the jobs. The states stay boxed: a
/// `MapState` is hundreds of bytes inline, and a change's ~200 results were copied into a list
/// of new pages twice (the results' slots, then the list returned).
pub(crate) enum Done {
    /// The state, changed by its batch or unchanged if the batch was refused.
    Applied {
        state: Box<MapState>,
        result: Result<ChangeSet, UpdateError>,
    },
    Built(Box<MapState>),
}

/// Below this much work (updates' identities and entries, summed; ~1.5 µs a unit at 10k pods
/// / 5k policies), the jobs run on the caller's thread: waking a parked helper costs tens of
/// microseconds (more when the other cores are busy), a small edit's whole update. It was
/// 2,000, when each change started its threads: a local relabel's ~200 batches sum to ~2,000,
/// and those just under it ran alone for 3-4 ms (measured, 2026-11-29).
const PARALLEL_WORK: usize = 200;

/// At most this many threads per change.
const MAX_THREADS: usize = 8;

impl Job {
    /// An estimate of the job's cost (identities selected and entries touched), to start the
    /// dearest first and to skip threads for small changes.
    fn work(&self) -> usize {
        match self {
            Job::Build { entries, .. } => entries.len() * 4,
            Job::Apply { batch, .. } => batch
                .iter()
                .map(|u| match u {
                    Update::AddIdentity { selected_by, .. } => 1 + selected_by.len(),
                    Update::Select { ids, .. } | Update::Deselect { ids, .. } => 1 + ids.len(),
                    _ => 4,
                })
                .sum(),
        }
    }

    fn run(self) -> Done {
        match self {
            Job::Apply { mut state, batch } => {
                let result = state.apply(batch);
                Done::Applied { state, result }
            }
            Job::Build {
                dir,
                default,
                entries,
            } => Done::Built(Box::new(crate::shared::build_state(dir, default, entries))),
        }
    }
}

/// The threads a change's MapState work may use: `ORDNET_ENGINE_THREADS` if set (1: all on
/// the caller's thread), else the machine's parallelism, at most [`MAX_THREADS`].
fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var("ORDNET_ENGINE_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .clamp(1, MAX_THREADS)
    })
}

/// Runs every job, the dearest first, on the caller's thread and up to [`threads`] - 1 of the
/// [`helpers`]; the results in the order of `jobs`.
pub(crate) fn run(jobs: Vec<Job>) -> Vec<Done> {
    let work: Vec<usize> = jobs.iter().map(Job::work).collect();
    let threads = threads().min(jobs.len());
    if threads < 2 || work.iter().sum::<usize>() < PARALLEL_WORK {
        return jobs.into_iter().map(Job::run).collect();
    }
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(work[i]));
    let region = Arc::new(Region {
        order,
        next: AtomicUsize::new(0),
        done: jobs.iter().map(|_| Mutex::new(None)).collect(),
        left: Mutex::new(jobs.len()),
        slots: jobs.into_iter().map(|j| Mutex::new(Some(j))).collect(),
        finished: Condvar::new(),
    });
    // The helpers join when they are woken; the caller does not wait for them to start (it
    // takes the jobs they have not taken yet), only for the jobs they took to end.
    for tx in helpers().iter().take(threads - 1) {
        let _ = tx.send(Arc::clone(&region));
    }
    region.work();
    let mut left = region.left.lock().unwrap_or_else(|e| e.into_inner());
    while *left > 0 {
        left = region
            .finished
            .wait(left)
            .unwrap_or_else(|e| e.into_inner());
    }
    drop(left);
    region
        .done
        .iter()
        .map(|d| {
            match d
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .expect("every job ran")
            {
                Ok(d) => d,
                // A job that panicked on a helper panics the caller, as on its own thread.
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
        .collect()
}

/// The jobs of one [`run`], shared by the caller and the helpers it woke.
struct Region {
    /// Job indexes, the dearest first; `next` is the first not taken.
    order: Vec<usize>,
    next: AtomicUsize,
    slots: Vec<Mutex<Option<Job>>>,
    /// Each job's result, or its panic.
    done: Vec<Mutex<Option<std::thread::Result<Done>>>>,
    /// Jobs not done yet; `finished` is signalled when it reaches 0.
    left: Mutex<usize>,
    finished: Condvar,
}

impl Region {
    /// Takes and runs jobs until none is left to take.
    fn work(&self) {
        while let Some(&i) = self.order.get(self.next.fetch_add(1, Ordering::Relaxed)) {
            let job = self.slots[i]
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(job) = job {
                let d = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run()));
                *self.done[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(d);
                let mut left = self.left.lock().unwrap_or_else(|e| e.into_inner());
                *left -= 1;
                if *left == 0 {
                    self.finished.notify_all();
                }
            }
        }
    }
}

/// The helper threads, started once (with the first change that has enough work) and parked
/// between changes. A thread started for each change, as before, began its first job 0.6-1.3
/// ms after the jobs were ready at the median and ~3.4 ms at the 90th percentile in the agent
/// at 10k pods / 5k policies, against 0.2 ms in a process with nothing else to run: the agent's
/// other core is rarely idle (its watches and debug server, the client polling it) and a new
/// thread waited for it, so the agent's engine ran about as on one thread (local relabel engine
/// p50 6.3-8.3 ms; 6.4 with `ORDNET_ENGINE_THREADS=1`; 5.0 in `engine_changes`). A parked
/// helper, woken, began after 0.04-0.07 ms at the median (the 90th percentile stays: the other
/// core busy for a slice). A helper that cannot be started is left out (the caller does its
/// jobs).
fn helpers() -> &'static [Sender<Arc<Region>>] {
    static HELPERS: OnceLock<Vec<Sender<Arc<Region>>>> = OnceLock::new();
    HELPERS.get_or_init(|| {
        (1..threads())
            .map_while(|_| {
                let (tx, rx) = channel::<Arc<Region>>();
                std::thread::Builder::new()
                    .name("ordnet-mapstate".into())
                    .spawn(move || rx.into_iter().for_each(|r| r.work()))
                    .ok()
                    .map(|_| tx)
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ordnet_mapstate::{Action, EntryId, IdSet, L4Match, OrderKey, Origin, Selector, Tier};
    use std::sync::Arc;

    fn entry(id: u64, ids: &[u32]) -> PolicyEntry {
        PolicyEntry {
            id: EntryId(id),
            order: OrderKey::new(1, id as u32),
            action: Action::Deny,
            selector: Selector::Ids(ids.iter().copied().collect::<IdSet>()),
            l4: L4Match::Any,
            origin: Arc::new(Origin {
                kind: "OrderedNetworkPolicy".into(),
                namespace: Some("a".into()),
                name: "p".into(),
                direction: Direction::Ingress,
                rule_index: id as u32,
                rule_name: None,
                priority: 1,
                action: Action::Deny,
                tier: Tier::Ordnet,
                passed_by: None,
            }),
        }
    }

    /// 40 jobs, half builds and half batches of `AddIdentity` (enough work to use threads).
    fn sample_jobs() -> Vec<Job> {
        (0..40u64)
            .map(|j| {
                let entries: Vec<PolicyEntry> = (0..60)
                    .map(|e| entry(j * 100 + e, &[(e % 7) as u32 + 1, 100 + j as u32]))
                    .collect();
                if j % 2 == 0 {
                    Job::Build {
                        dir: Direction::Ingress,
                        default: Verdict::Allow,
                        entries,
                    }
                } else {
                    let state = MapState::build(Direction::Egress, Verdict::Deny, entries).unwrap();
                    Job::Apply {
                        state: Box::new(state),
                        batch: vec![Update::AddIdentity {
                            id: 500 + j as u32,
                            selected_by: (0..50).map(|e| EntryId(j * 100 + e)).collect(),
                        }],
                    }
                }
            })
            .collect()
    }

    /// `parallel` is what each job of [`sample_jobs`] gives alone, in the jobs' order.
    fn assert_as_alone(parallel: &[Done]) {
        assert_eq!(parallel.len(), 40);
        let alone: Vec<Done> = sample_jobs().into_iter().map(Job::run).collect();
        for (p, a) in parallel.iter().zip(&alone) {
            match (p, a) {
                (Done::Built(p), Done::Built(a)) => assert_eq!(p.iter(), a.iter()),
                (
                    Done::Applied {
                        state: ps,
                        result: Ok(pc),
                    },
                    Done::Applied {
                        state: as_,
                        result: Ok(ac),
                    },
                ) => {
                    assert_eq!(ps.iter(), as_.iter());
                    assert_eq!(pc, ac);
                    assert!(!pc.added.is_empty());
                }
                _ => panic!("a job's result differs"),
            }
        }
    }

    /// Many jobs on threads give what each gives alone, in the jobs' order.
    #[test]
    fn threads_give_what_each_job_gives_alone() {
        assert_as_alone(&run(sample_jobs()));
    }

    /// Callers on several threads at once share the helpers: each gets its own jobs' results
    /// (a helper busy with one caller's jobs leaves the others' to their callers).
    #[test]
    fn callers_at_once_each_get_their_own_results() {
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..5 {
                        assert_as_alone(&run(sample_jobs()));
                    }
                });
            }
        });
    }
}
