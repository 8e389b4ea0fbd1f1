//! The agent's dealings with the allocator (glibc's, on Linux): large buffers are kept out of
//! the heap ([`keep_large_buffers_out_of_the_heap`]) and the memory freed after the initial
//! sync is given back ([`release_free_memory`]). Elsewhere (other allocators) both do nothing.

/// Allocations at least this large are mapped on their own and unmapped when freed.
const MMAP_THRESHOLD: i32 = 128 * 1024;

/// Fixes glibc's mmap threshold at 128 KiB. By default it rises to the size of the largest
/// mapped block freed so far (up to 32 MiB), after which the programming's large transient
/// buffers (a full programming's write batches, flattened rule sets, the class translation's
/// lists) come from the heap, where what outlives them pins the pages they used: measured
/// with `agent_at_scale` at 10k pods / 1k policies, RSS 120-121 MiB with the threshold fixed
/// against 124-129 MiB without (459.8 against 469.0 MiB at 50k / 5k), the change latencies
/// unchanged (docs/agent.md, "Memory with classes").
pub fn keep_large_buffers_out_of_the_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's parameters; called before the agent's
    // threads allocate much, and any time is allowed.
    unsafe {
        if libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 {
            tracing::warn!("could not fix the allocator's mmap threshold");
        }
    }
}

/// Gives the memory freed after the initial sync back to the system. The initial list and
/// build peak at about twice what the agent keeps (the listed objects wait for the build, the
/// build has its scratch), and glibc's allocator keeps freed memory for reuse: at 50,000 pods
/// the agent's RSS stayed at that peak (909 MiB for 480 MiB in use). `malloc_trim` returns the
/// free pages (also those between allocations in use).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases memory the allocator holds as free.
    unsafe {
        libc::malloc_trim(0);
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
