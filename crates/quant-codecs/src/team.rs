//! Who runs a parallel region's tasks: rayon's pool, or a [`Team`] of threads that spin between
//! regions.
//!
//! The offload's cold experts are a parallel region of a few hundred microseconds every few
//! hundred microseconds (one per layer with a cold winner). Rayon's workers fall asleep in
//! the gaps, and waking them is a large part of each region: on the H200 machine's host a
//! layer's cold experts took ~340 us for ~10 MB, about 220 us of it a fixed cost per call
//! (docs/perf.md, #16). A [`Team`] keeps its workers spinning for a while after each region,
//! so the next one starts at once, and parks them once no work has come for that long.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Runs `n` independent tasks `f(0)..f(n - 1)`, in parallel where it can, and returns when all
/// of them are done. Every index runs exactly once.
pub trait Parallel: Sync {
    /// Runs `f(i)` for every `i < n`.
    fn for_each_index(&self, n: usize, f: &(dyn Fn(usize) + Sync));
}

/// Rayon's global pool (what every CPU kernel uses unless told otherwise).
#[derive(Debug, Clone, Copy, Default)]
pub struct Rayon;

impl Parallel for Rayon {
    fn for_each_index(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        use rayon::prelude::*;
        match n {
            0 => {}
            1 => f(0),
            _ => (0..n).into_par_iter().for_each(f),
        }
    }
}

thread_local! {
    /// Set while this thread runs a team's task: a region started from inside one runs
    /// inline instead of waiting for a team that is busy with its caller.
    static IN_TEAM: Cell<bool> = const { Cell::new(false) };
}

/// One parallel region: its tasks are claimed from `next`, one index at a time.
struct Job {
    /// The region's closure, its lifetime erased (see [`Team::for_each_index`]).
    f: *const (dyn Fn(usize) + Sync + 'static),
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

// SAFETY: `f` points to a `Sync` closure, so calling it from several threads at once is
// allowed; it is dereferenced only for a claimed index below `n`, while the region's caller
// is still waiting for that index to finish (see `Job::work`).
unsafe impl Send for Job {}
// SAFETY: as above; every other field is atomic.
unsafe impl Sync for Job {}

impl Job {
    /// Claims and runs the job's tasks until none are left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            // SAFETY: index `i < n` was claimed by this thread alone, and the caller of
            // `Team::for_each_index` does not return (so the closure is alive) until `done`
            // reaches `n`, which needs this task's increment below. A thread that picks up a
            // finished job's `Arc` later claims an index `>= n` and never gets here.
            let f = unsafe { &*self.f };
            let was = IN_TEAM.with(|t| t.replace(true));
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            IN_TEAM.with(|t| t.set(was));
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// What the team's threads and its callers share.
struct Shared {
    /// Bumped for every new region (and at shutdown).
    epoch: AtomicU64,
    /// The current region, one slot per worker: each worker takes the region from its own
    /// slot, so that a dozen workers seeing a new region at once do not queue on one lock
    /// (with one slot they started their first task ~7 us later: docs/perf.md, seventh pass).
    slots: Vec<Mutex<Option<Arc<Job>>>>,
    /// How many workers are parked; new regions wake them through `wake`.
    parked: Mutex<usize>,
    wake: Condvar,
    stop: AtomicBool,
    /// How long a worker spins for the next region before it parks.
    spin: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A task's panic is caught before it can poison anything, so a poisoned lock means only
    // that a thread died holding it; the data (a counter, an `Arc`) is still whole.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A fixed set of threads that run parallel regions with their caller, spinning between
/// regions for a configurable time. Regions from several callers take turns.
pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One region at a time.
    turn: Mutex<()>,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("workers", &self.workers.len())
            .field("spin", &self.shared.spin)
            .finish()
    }
}

impl Team {
    /// A team of `workers` threads besides the caller (so a region runs on `workers + 1`
    /// threads), each spinning for `spin` after a region before it parks (`Duration::ZERO`:
    /// park at once, as on a machine whose cores are needed elsewhere between regions).
    /// A thread that cannot be started leaves the team smaller (with a warning).
    pub fn new(workers: usize, spin: Duration) -> Team {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            slots: (0..workers).map(|_| Mutex::new(None)).collect(),
            parked: Mutex::new(0),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            spin,
        });
        let workers = (0..workers)
            .filter_map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("cortiq-team-{i}"))
                    .spawn(move || worker(&s, i))
                    .map_err(|e| tracing::warn!("thread team: worker {i} not started: {e}"))
                    .ok()
            })
            .collect();
        Team {
            shared,
            workers,
            turn: Mutex::new(()),
        }
    }

    /// The team the offload's cold experts run on: `CORTIQ_COLD_THREADS` threads with the
    /// caller (default: rayon's thread count less two, left to the span encoder and the
    /// stager that run beside the cold experts; at least two), spinning
    /// `CORTIQ_TEAM_SPIN_US` after a region (default 2,000 us: longer than a layer's GPU
    /// span, so a decode keeps them awake). With `software` (a CPU-emulated GPU, whose work
    /// runs on the same cores) they park at once.
    pub fn from_env(software: bool) -> Team {
        let var = |k: &str| std::env::var(k).ok();
        let threads = var("CORTIQ_COLD_THREADS")
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or_else(|| rayon::current_num_threads().saturating_sub(2))
            .max(2);
        let spin_us = if software {
            0
        } else {
            var("CORTIQ_TEAM_SPIN_US")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(2_000)
        };
        Team::new(threads - 1, Duration::from_micros(spin_us))
    }

    /// Threads a region runs on (the workers and the caller).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// How long a worker spins between regions before parking.
    pub fn spin(&self) -> Duration {
        self.shared.spin
    }
}

impl Parallel for Team {
    /// Runs the region on the team and the calling thread. A task that panics does not stop
    /// the others; the call panics once all of them are done. Called from inside one of this
    /// team's tasks, the region runs inline on that thread.
    fn for_each_index(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n <= 1 || self.workers.is_empty() || IN_TEAM.with(Cell::get) {
            (0..n).for_each(f);
            return;
        }
        let _turn = lock(&self.turn);
        // SAFETY: only the lifetime is erased. The pointer is dereferenced only inside
        // `Job::work` for a claimed index below `n`, and this function does not return before
        // all `n` tasks have finished (the loop below), so `f` outlives every such use.
        let f: &'static (dyn Fn(usize) + Sync) = unsafe {
            std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(f)
        };
        let job = Arc::new(Job {
            f,
            n,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        });
        for slot in &self.shared.slots {
            *lock(slot) = Some(Arc::clone(&job));
        }
        self.shared.epoch.fetch_add(1, Ordering::Release);
        if *lock(&self.shared.parked) > 0 {
            self.shared.wake.notify_all();
        }
        job.work();
        let mut spins = 0u32;
        while job.done.load(Ordering::Acquire) < n {
            // Tasks still running on workers: they are short, so spin, but let a descheduled
            // worker back onto the core if they are not.
            spins += 1;
            if spins < 1 << 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if job.panicked.load(Ordering::Relaxed) {
            panic!("a task of a thread team's parallel region panicked");
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.epoch.fetch_add(1, Ordering::Release);
        {
            let _parked = lock(&self.shared.parked);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            // A worker only ends by seeing `stop`; its tasks' panics were caught.
            let _ = w.join();
        }
    }
}

/// Worker `me`: runs each new region's tasks, spins for `spin` after the last one, then parks
/// until the next region (or shutdown).
fn worker(s: &Shared, me: usize) {
    // No epoch seen yet: the first look takes whatever the slot holds, so a worker that starts
    // after a region was posted (thread start-up can take longer than posting one) still
    // joins it instead of waiting for the next.
    let mut seen = u64::MAX;
    let mut idle_since = Instant::now();
    let mut polls = 0u32;
    loop {
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        let e = s.epoch.load(Ordering::Acquire);
        if e != seen {
            seen = e;
            // Taken, not cloned: the slot holds no finished region for long (a worker that
            // missed an epoch finds the latest region there, or nothing).
            let job = lock(&s.slots[me]).take();
            if let Some(job) = job {
                job.work();
            }
            idle_since = Instant::now();
            continue;
        }
        // Reading the clock costs more than a spin; look at it every 64 polls.
        polls = polls.wrapping_add(1);
        if !polls.is_multiple_of(64) || idle_since.elapsed() < s.spin {
            std::hint::spin_loop();
            continue;
        }
        let mut parked = lock(&s.parked);
        *parked += 1;
        // The epoch is re-read under the lock a new region takes before notifying, so a
        // region published after this check still wakes this worker.
        while s.epoch.load(Ordering::Acquire) == seen && !s.stop.load(Ordering::Acquire) {
            parked = s.wake.wait(parked).unwrap_or_else(PoisonError::into_inner);
        }
        *parked -= 1;
        drop(parked);
        idle_since = Instant::now();
    }
}
