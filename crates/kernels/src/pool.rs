//! A small persistent thread pool tuned for the many tiny parallel regions of LLM decoding.
//!
//! [`ThreadPool::new(n)`](ThreadPool::new) starts `n - 1` worker threads; the thread that calls
//! [`ThreadPool::run`] takes part in the work. A job of `n` items is published by storing a new
//! generation in one atomic word whose low bits count claimed items; threads claim items by
//! compare-exchange, so a worker that is late (descheduled on a busy machine) costs nothing: the caller
//! runs the unclaimed items and waits only for claimed ones. Idle workers spin on the word (decode
//! issues a matmul every few microseconds), then yield, then park. No allocation happens per call. A
//! panic inside the job is caught and re-raised on the caller once all items are done, so the pool never
//! deadlocks.
//!
//! [`parallel_for`] splits `0..n_items` into one contiguous range per thread.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// The job as workers see it: a pointer to the caller's `&dyn Fn(item)` (valid while items remain).
type JobRef<'a> = &'a (dyn Fn(usize) + Sync);

/// How long an idle worker spins on the job state before it starts yielding, then parking
/// (long enough to cover the serial work between two matmuls of a decode step: norms, attention).
const SPIN_FOR: Duration = Duration::from_micros(300);
/// How long the caller spins waiting for workers before yielding (a worker may be descheduled).
const WAIT_SPIN_FOR: Duration = Duration::from_micros(50);
const YIELD_FOR: Duration = Duration::from_millis(3);
/// `state` packs `generation << GEN_SHIFT | n_items << COUNT_SHIFT | next unclaimed item`.
const GEN_SHIFT: u32 = 32;
const COUNT_SHIFT: u32 = 16;
const FIELD_MASK: u64 = (1 << COUNT_SHIFT) - 1;
/// Most items one job may have (the count and the next item share the low 32 bits of `state`).
pub const MAX_ITEMS: usize = FIELD_MASK as usize;

struct Shared {
    /// `generation << GEN_SHIFT | n_items << COUNT_SHIFT | next unclaimed item`. A job is published by
    /// storing a new generation with its item count and item 0; items are claimed by compare-exchange,
    /// so a thread that arrives late (descheduled, parked) finds nothing left and never touches a
    /// finished job: the caller waits only for items that were actually claimed, and does the unclaimed
    /// ones itself. The count lives in the same word as the claim on purpose: with a separate counter a
    /// late worker could read the *next* job's (larger) count, already stored but not yet published,
    /// and claim a phantom item of the exhausted old job (an item run twice, the finished count off,
    /// and a null job pointer dereferenced: a SIGSEGV seen on CI).
    state: AtomicU64,
    /// Items of the current job that are done.
    finished: AtomicUsize,
    /// Points at a `JobRef` on the caller's stack while a job runs.
    job: AtomicPtr<()>,
    shutdown: AtomicBool,
    /// First panic payload caught during the current job.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    n_threads: usize,
    /// One flag per worker: set while that worker is (about to be) parked.
    sleeping: Box<[AtomicBool]>,
}

impl Shared {
    /// Claims and runs items of generation `generation` until none are left.
    fn work(&self, generation: u64) {
        loop {
            let s = self.state.load(Ordering::Acquire);
            if s >> GEN_SHIFT != generation {
                return;
            }
            let (item, n_items) = (s & FIELD_MASK, (s >> COUNT_SHIFT) & FIELD_MASK);
            if item >= n_items {
                return;
            }
            let ptr = self.job.load(Ordering::Acquire) as *const JobRef<'_>;
            if self.state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
                continue;
            }
            let item = item as usize;
            // SAFETY: the claim succeeded on the very state word read above (generation, count and
            // item in one word, and that word never repeats), so that job was unfinished from the read
            // of `job` to the claim: its caller is still waiting for this item, and `job`, stored before
            // the generation was published and cleared only after every item is finished, points at
            // its closure.
            let job: JobRef<'_> = unsafe { *ptr };
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| job(item))) {
                let mut slot = self.panic.lock().unwrap_or_else(|p| p.into_inner());
                if slot.is_none() {
                    *slot = Some(payload);
                }
            }
            self.finished.fetch_add(1, Ordering::Release);
        }
    }
}

/// A fixed set of threads that share the items of each job given to [`ThreadPool::run`] /
/// [`ThreadPool::run_items`].
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
    /// Serialises concurrent callers; a nested call from inside a job runs serially instead.
    busy: Mutex<()>,
    generation: AtomicU64,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in total (`n_threads - 1` workers plus the caller); 0 counts as 1.
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            finished: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            shutdown: AtomicBool::new(false),
            panic: Mutex::new(None),
            n_threads,
            sleeping: (1..n_threads).map(|_| AtomicBool::new(false)).collect(),
        });
        let workers = (1..n_threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                let handle = thread::Builder::new()
                    .name(format!("specee-kernel-{index}"))
                    .spawn(move || worker_loop(&shared, index))
                    .unwrap_or_else(|e| panic!("cannot spawn kernel worker thread {index}: {e}"));
                let thread = handle.thread().clone();
                (handle, thread)
            })
            .collect();
        ThreadPool { shared, workers, busy: Mutex::new(()), generation: AtomicU64::new(0) }
    }

    /// Number of threads that run each job (workers + the caller).
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Runs `f(index, n_threads)` once for every `index < n_threads` and returns when all calls are
    /// done. Calls run in parallel on the pool's threads; an index is never run twice, but one thread
    /// may run several indices (e.g. when a worker is descheduled), so per-index scratch is safe,
    /// per-OS-thread state is not. A panic in any call is re-raised here after all calls finished.
    pub fn run(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.shared.n_threads;
        self.run_items(n, &|i| f(i, n));
    }

    /// Runs `f(item)` once for every `item < n_items`, the items claimed dynamically by the pool's
    /// threads (the caller included), and returns when all are done. A panic is re-raised here.
    ///
    /// # Panics
    /// If `n_items > MAX_ITEMS`.
    pub fn run_items(&self, n_items: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(n_items <= MAX_ITEMS, "run_items: too many items ({n_items} > {MAX_ITEMS})");
        if n_items == 0 {
            return;
        }
        if self.shared.n_threads == 1 || n_items == 1 {
            (0..n_items).for_each(f);
            return;
        }
        // A nested or concurrent call must not wait on workers that are busy with the outer job.
        let Ok(_guard) = self.busy.try_lock().or_else(|e| match e {
            std::sync::TryLockError::Poisoned(p) => Ok(p.into_inner()),
            std::sync::TryLockError::WouldBlock => Err(()),
        }) else {
            (0..n_items).for_each(f);
            return;
        };
        let shared = &*self.shared;
        let job: JobRef<'_> = f;
        let generation = (self.generation.load(Ordering::Relaxed) + 1) & (u64::MAX >> GEN_SHIFT);
        self.generation.store(generation, Ordering::Relaxed);
        shared.finished.store(0, Ordering::Relaxed);
        shared.job.store(&job as *const JobRef<'_> as *mut (), Ordering::Relaxed);
        shared.state.store(generation << GEN_SHIFT | (n_items as u64) << COUNT_SHIFT, Ordering::SeqCst);
        for (i, (_, thread)) in self.workers.iter().enumerate() {
            if shared.sleeping[i].load(Ordering::SeqCst) {
                thread.unpark();
            }
        }
        shared.work(generation);
        // Wait for claimed items still running: spin first, then yield (a worker may be descheduled).
        let start = Instant::now();
        let mut spins = 0u32;
        while shared.finished.load(Ordering::Acquire) < n_items {
            spins = spins.wrapping_add(1);
            if spins % 32 != 0 || start.elapsed() < WAIT_SPIN_FOR {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        shared.job.store(std::ptr::null_mut(), Ordering::Relaxed);
        if let Some(payload) = shared.panic.lock().unwrap_or_else(|p| p.into_inner()).take() {
            resume_unwind(payload);
        }
    }
}

/// Most contiguous shares [`ThreadPool::run_shares`] divides a job into (more threads help with them).
pub const MAX_SHARES: usize = 16;

/// An atomic counter alone on its cache lines (two, as the adjacent-line prefetcher pairs them), so that one
/// thread claiming from its own share does not contend with another claiming from its own.
#[repr(align(128))]
struct Cursor(AtomicUsize);

impl ThreadPool {
    /// Runs `f(share, range)` over ranges that cover `0..n_items` exactly once, with one contiguous **share** of
    /// the items per thread (at most [`MAX_SHARES`]): each thread claims `step` items at a time from its own
    /// share's cursor, then helps with the other shares' unclaimed items. `share` is the share the calling
    /// thread took (per-share scratch is safe, as with [`ThreadPool::run`]).
    ///
    /// Against [`ThreadPool::run_items`] with one item per piece, the claims of a thread's own share stay in its
    /// core's cache (the cursors sit on separate cache lines) and the pool's shared counters are touched once per
    /// share, not once per piece: on the 2-vCPU VM the per-piece claims of a SmolLM2 projection (a dozen
    /// pieces, each claim and completion a cache line crossing cores) cost more than 1 µs per matmul. And each
    /// thread streams one contiguous part of the work, which the hardware prefetchers like.
    pub fn run_shares(&self, n_items: usize, step: usize, f: &(dyn Fn(usize, std::ops::Range<usize>) + Sync)) {
        let (shares, step) = (self.n_threads().min(n_items).min(MAX_SHARES), step.max(1));
        if shares <= 1 {
            for start in (0..n_items).step_by(step) {
                f(0, start..(start + step).min(n_items));
            }
            return;
        }
        let bounds = |t: usize| t * n_items / shares;
        let next: [Cursor; MAX_SHARES] =
            std::array::from_fn(|t| Cursor(AtomicUsize::new(if t < shares { bounds(t) } else { 0 })));
        self.run_items(shares, &|me| {
            for t in (me..shares).chain(0..me) {
                let end = bounds(t + 1);
                loop {
                    let start = next[t].0.fetch_add(step, Ordering::Relaxed);
                    if start >= end {
                        break;
                    }
                    f(me, start..(start + step).min(end));
                }
            }
        });
    }
}

fn worker_loop(shared: &Shared, index: usize) {
    let mut seen = 0u64;
    let sleeping = &shared.sleeping[index - 1];
    loop {
        // Wait for a new generation.
        let start = Instant::now();
        let mut spins = 0u32;
        let generation = loop {
            let g = shared.state.load(Ordering::Acquire) >> GEN_SHIFT;
            if g != seen || shared.shutdown.load(Ordering::Acquire) {
                break g;
            }
            spins = spins.wrapping_add(1);
            if spins % 64 != 0 {
                std::hint::spin_loop();
                continue;
            }
            let waited = start.elapsed();
            if waited < SPIN_FOR {
                std::hint::spin_loop();
            } else if waited < YIELD_FOR {
                thread::yield_now();
            } else {
                sleeping.store(true, Ordering::SeqCst);
                // Re-check after announcing sleep: the caller checks `sleeping` after publishing.
                if shared.state.load(Ordering::SeqCst) >> GEN_SHIFT == seen && !shared.shutdown.load(Ordering::SeqCst) {
                    thread::park_timeout(Duration::from_millis(100));
                }
                sleeping.store(false, Ordering::SeqCst);
            }
        };
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        seen = generation;
        shared.work(generation);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for (_, thread) in &self.workers {
            thread.unpark();
        }
        for (handle, _) in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

/// The `index`-th of `parts` near-equal contiguous pieces of `0..n_items`.
pub fn split_range(n_items: usize, index: usize, parts: usize) -> std::ops::Range<usize> {
    let parts = parts.max(1);
    let base = n_items / parts;
    let extra = n_items % parts;
    let start = index * base + index.min(extra);
    let len = base + usize::from(index < extra);
    start.min(n_items)..(start + len).min(n_items)
}

/// Calls `f` on one contiguous, non-empty piece of `0..n_items` per thread (pieces differ by at most one).
pub fn parallel_for(pool: &ThreadPool, n_items: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    if n_items == 0 {
        return;
    }
    if n_items == 1 || pool.n_threads() == 1 {
        f(0..n_items);
        return;
    }
    pool.run(&|index, n| {
        let range = split_range(n_items, index, n);
        if !range.is_empty() {
            f(range);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_quick_runs_complete() {
        // 100k runs on two threads; fewer with one, and with three (more threads than CI's cores).
        for (threads, runs) in [(1, 10_000u64), (2, 100_000), (3, 10_000)] {
            let pool = ThreadPool::new(threads);
            let counter = AtomicU64::new(0);
            let start = Instant::now();
            for _ in 0..runs {
                pool.run(&|_, _| {
                    counter.fetch_add(1, Ordering::Relaxed);
                });
            }
            eprintln!("{threads} threads: {:?} per run", start.elapsed() / runs as u32);
            assert_eq!(counter.load(Ordering::Relaxed), runs * threads as u64);
        }
    }

    #[test]
    fn every_index_runs_once() {
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads);
            let seen: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|i, n| {
                assert_eq!(n, threads);
                seen[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));
        }
    }

    /// Many jobs whose item counts change from one to the next, some run serially (one item), with the
    /// workers sometimes parked: every item of every job runs exactly once, and only while its caller
    /// waits (`sentinel` lives on the caller's stack). This caught a worker claiming a phantom item of
    /// a finished job after reading the next job's count (an item run twice, then a SIGSEGV).
    #[test]
    fn jobs_of_changing_sizes_run_each_item_once() {
        let pool = ThreadPool::new(2);
        let mut seed = 12345u64;
        for run in 0..500_000u64 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let n = 1 + (seed % 9) as usize;
            let sentinel = [run; 4];
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run_items(n, &|i| {
                assert_eq!(std::hint::black_box(&sentinel)[3], run, "item ran after its job returned");
                hits[i].fetch_add(1, Ordering::Relaxed);
                if (seed >> i) % 3 == 0 {
                    std::hint::black_box((0..64u64).sum::<u64>());
                }
            });
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(h.load(Ordering::Relaxed), 1, "run {run}: item {i} of {n}");
            }
            if seed % 2000 == 0 {
                thread::sleep(Duration::from_micros(seed % 4000));
            }
        }
    }

    #[test]
    fn run_shares_covers_every_item_once_with_one_thread_per_share() {
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads);
            for (n_items, step) in [(0, 1), (1, 1), (7, 1), (36, 9), (100, 3), (1000, 1000)] {
                let seen: Vec<AtomicUsize> = (0..n_items).map(|_| AtomicUsize::new(0)).collect();
                // The thread that runs each share: a share's scratch must never be used by two threads.
                let owner: Vec<std::sync::Mutex<Option<thread::ThreadId>>> =
                    (0..MAX_SHARES).map(|_| std::sync::Mutex::new(None)).collect();
                pool.run_shares(n_items, step, &|share, range| {
                    assert!(share < threads.min(n_items).max(1) && range.len() <= step && !range.is_empty());
                    let mut o = owner[share].lock().unwrap();
                    assert_eq!(*o.get_or_insert(thread::current().id()), thread::current().id());
                    for i in range {
                        seen[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1), "{threads} threads, {n_items} items");
            }
        }
    }

    #[test]
    fn parallel_for_covers_range_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n_items in [0, 1, 2, 3, 7, 100] {
                let hits: Vec<AtomicUsize> = (0..n_items).map(|_| AtomicUsize::new(0)).collect();
                parallel_for(&pool, n_items, |range| {
                    for i in range {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn sum_is_correct_with_parked_workers() {
        let pool = ThreadPool::new(3);
        let data: Vec<u64> = (0..10_000).collect();
        for round in 0..3 {
            if round > 0 {
                thread::sleep(Duration::from_millis(10)); // let workers park
            }
            let total = AtomicU64::new(0);
            parallel_for(&pool, data.len(), |range| {
                total.fetch_add(data[range].iter().sum(), Ordering::Relaxed);
            });
            assert_eq!(total.load(Ordering::Relaxed), data.iter().sum::<u64>());
        }
    }

    #[test]
    fn panic_is_reraised_without_deadlock() {
        let pool = ThreadPool::new(3);
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|i, _| {
                if i == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(result.is_err());
        // The pool still works afterwards.
        let counter = AtomicUsize::new(0);
        pool.run(&|_, _| {
            counter.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(counter.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn nested_run_does_not_deadlock() {
        let pool = ThreadPool::new(2);
        let counter = AtomicUsize::new(0);
        pool.run(&|_, _| {
            pool.run(&|_, _| {
                counter.fetch_add(1, Ordering::Relaxed);
            });
        });
        // Outer job runs on 2 threads; one nested call gets the pool (2 calls), the other runs serially (2).
        assert_eq!(counter.load(Ordering::Relaxed), 4);
    }
}
