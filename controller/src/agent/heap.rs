//! The agent's dealings with the allocator (glibc's, on Linux): the memory it holds freed is
//! given back after the initial sync ([`release_after_initial_sync`]) and, after changes, when
//! the agent holds noticeably more than it did after it last gave back
//! ([`give_back_when_grown`]); otherwise glibc keeps what a change frees for the next one to
//! reuse. Elsewhere (other allocators) giving back does nothing.
//!
//! glibc's own mmap threshold is kept: it rises to the largest mapped block freed so far (up to
//! 32 MiB, the trim threshold with it), so changes take their large transient buffers (write
//! batches, flattened rule sets, a moving endpoint's diff) from memory the changes before them
//! freed instead of mapping and faulting in fresh pages every time. Until 2026-12-07 the agent
//! fixed the threshold at 128 KiB (every such buffer mapped and unmapped, the heap's top
//! trimmed after every change), which kept the memory low with nothing given back after changes,
//! at the cost of the slowest changes (docs/agent.md, "Memory and scale": the local relabel's p99 at
//! 10k pods / 5k policies 23.4 against 25.6 ms on average over ten alternated pairs; RSS once
//! quiet 114.7 against 122.4 MiB at 10k / 1k and 428.1 against 480.8 MiB at 50k / 5k).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;

/// How long the agent goes without programming a change before it gives back what a burst left
/// freed: long enough that changes in quick succession reuse it, short enough that it is back
/// soon after. Giving back took 2-15 ms (10k pods / 5k policies to 50k / 5k); a change that
/// arrives meanwhile may wait for the allocator's locks.
pub(super) const QUIET: Duration = Duration::from_secs(1);

/// Gives the memory freed after the initial sync back to the system. The initial list and
/// build peak at about twice what the agent keeps (the listed objects wait for the build, the
/// build has its scratch), and glibc's allocator keeps freed memory for reuse: at 50,000 pods
/// the agent's RSS stayed at that peak (909 MiB for 480 MiB in use).
pub(super) fn release_after_initial_sync() {
    give_back();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    unsafe {
        let m = libc::mallinfo2();
        tracing::info!(
            heap_in_use_mib = m.uordblks as f64 / 1048576.0,
            heap_free_mib = m.fordblks as f64 / 1048576.0,
            mmapped_mib = m.hblkhd as f64 / 1048576.0,
            arenas_mib = m.arena as f64 / 1048576.0,
            "gave freed memory back after the initial sync"
        );
    }
}

/// Returns the allocator's free pages to the system (`malloc_trim(0)`: also those between
/// allocations in use, in every arena) and remembers what the agent then holds, for
/// [`grown_by`].
pub(super) fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases memory the allocator holds as free.
    unsafe {
        libc::malloc_trim(0);
    }
    if let Some(now) = resident_bytes() {
        AFTER_GIVING_BACK.store(now, Ordering::Relaxed);
    }
}

/// The resident memory after the last [`give_back`] (0: none yet).
static AFTER_GIVING_BACK: AtomicU64 = AtomicU64::new(0);

/// Whether the agent holds more than `1 / denominator` above what it held after it last gave
/// back (yes if it never did; no if its resident memory cannot be read).
pub(super) fn grown_by(denominator: u64) -> bool {
    let Some(now) = resident_bytes() else {
        return false;
    };
    let before = AFTER_GIVING_BACK.load(Ordering::Relaxed);
    before == 0 || now > before + before / denominator
}

/// This process's resident memory (`/proc/self/statm`), in bytes (also the metric
/// `process_resident_memory_bytes`).
pub(super) fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

/// Growth (a fraction's denominator) at which the agent gives back once quiet: a sixteenth.
/// An isolated change grows it by less (a few MiB at 10k pods / 5k policies), and giving back
/// after it would only make the next change fault its pages in again; a burst grows it by more.
const GROWN_WHEN_QUIET: u64 = 16;

/// Growth at which the agent gives back while changes keep coming: a tenth, so that a long
/// burst cannot hold much more than the agent needs.
const GROWN_WHEN_BUSY: u64 = 10;

/// Gives freed memory back (`release`, on the blocking pool) when the agent has grown
/// (`grown`, given a fraction's denominator): by [`GROWN_WHEN_BUSY`] after any change, by
/// [`GROWN_WHEN_QUIET`] once nothing was programmed for `quiet` after a change (once per quiet
/// spell). `programmed` counts the batches of changes programmed; ends when its sender is gone.
pub(super) async fn give_back_when_grown(
    mut programmed: watch::Receiver<u64>,
    quiet: Duration,
    grown: fn(u64) -> bool,
    release: fn(),
) {
    loop {
        if programmed.changed().await.is_err() {
            return;
        }
        loop {
            if grown(GROWN_WHEN_BUSY) {
                on_pool(release, "gave freed memory back, busy").await;
            }
            tokio::select! {
                changed = programmed.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep(quiet) => break,
            }
        }
        if grown(GROWN_WHEN_QUIET) {
            on_pool(release, "gave freed memory back, quiet after changes").await;
        }
    }
}

/// Runs `release` on the blocking pool and logs how long it took.
async fn on_pool(release: fn(), what: &'static str) {
    let started = std::time::Instant::now();
    let _ = tokio::task::spawn_blocking(release).await;
    tracing::debug!(took_ms = started.elapsed().as_secs_f64() * 1000.0, "{what}");
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// What the test's agent holds, what it held after giving back, and how often it did.
    static HELD: AtomicU64 = AtomicU64::new(1600);
    static KEPT: AtomicU64 = AtomicU64::new(1600);
    static RELEASED: AtomicUsize = AtomicUsize::new(0);

    fn grown(denominator: u64) -> bool {
        let kept = KEPT.load(Ordering::SeqCst);
        HELD.load(Ordering::SeqCst) > kept + kept / denominator
    }

    fn release() {
        KEPT.store(HELD.load(Ordering::SeqCst), Ordering::SeqCst);
        RELEASED.fetch_add(1, Ordering::SeqCst);
    }

    fn released() -> usize {
        RELEASED.load(Ordering::SeqCst)
    }

    /// Lets the loop run until it waits again; a release runs on the blocking pool, so
    /// waits for it when `expect` more are due (a hang guard, not a measure).
    async fn settle(expect: usize) {
        for _ in 0..1000 {
            tokio::task::yield_now().await;
            if released() >= expect {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    /// One change, then `spell` of nothing.
    async fn change(tx: &watch::Sender<u64>, spell: Duration, expect: usize) {
        tx.send_modify(|n| *n += 1);
        settle(expect).await;
        tokio::time::advance(spell).await;
        settle(expect).await;
    }

    /// Changes in quick succession give nothing back until the agent has grown by a tenth; a
    /// quiet spell after them gives back once if it grew by a sixteenth, and not otherwise.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn gives_back_what_changes_left_behind() {
        let (tx, rx) = watch::channel(0u64);
        let quiet = Duration::from_secs(1);
        let task = tokio::spawn(give_back_when_grown(rx, quiet, grown, release));
        tokio::time::advance(quiet * 5).await;
        settle(0).await;
        assert_eq!(released(), 0, "nothing before a change");
        // A burst growing by 150 of 1600 (less than a tenth): nothing while it lasts.
        for _ in 0..15 {
            HELD.fetch_add(10, Ordering::SeqCst);
            change(&tx, quiet / 2, 0).await;
        }
        assert_eq!(
            released(),
            0,
            "not while changes come, grown by less than a tenth"
        );
        tokio::time::advance(quiet).await;
        settle(1).await;
        assert_eq!(
            released(),
            1,
            "quiet after them, grown by more than a sixteenth"
        );
        tokio::time::advance(quiet * 10).await;
        settle(1).await;
        assert_eq!(released(), 1, "once per quiet spell");
        // Isolated changes growing it by less than a sixteenth: nothing.
        for _ in 0..5 {
            HELD.fetch_add(10, Ordering::SeqCst);
            change(&tx, quiet * 3, 1).await;
        }
        assert_eq!(released(), 1, "grown by less than a sixteenth");
        // A burst past a tenth gives back while it lasts.
        HELD.fetch_add(300, Ordering::SeqCst);
        change(&tx, quiet / 2, 2).await;
        assert_eq!(released(), 2, "grown by more than a tenth while busy");
        change(&tx, quiet / 2, 2).await;
        assert_eq!(released(), 2, "nothing more to give back");
        drop(tx);
        task.await.expect("ends when the count's sender is gone");
        assert_eq!(released(), 2, "nothing else given back, late or not");
    }
}
