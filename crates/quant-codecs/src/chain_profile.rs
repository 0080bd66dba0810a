//! Where a chained region's time goes ([`crate::many::run_chain`]: the offload's cold
//! experts). With `CORTIQ_CHAIN_PROFILE=1` every region records, per task, the thread that ran
//! it, when it started and ended and how long a down task waited for its expert's gate/up;
//! [`report`] sums the regions since its last call. Off (the default) a region pays one load
//! of a flag.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Instant;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("CORTIQ_CHAIN_PROFILE").is_ok_and(|v| v == "1"))
}

/// A small id per thread (the ids of `std::thread::ThreadId` are not numbers on stable).
fn thread_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static ID: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    ID.with(|id| *id)
}

/// Sums over regions, in nanoseconds and bytes.
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    regions: u64,
    wall: u64,
    setup: u64,
    quantise: u64,
    first_mean: u64,
    first_max: u64,
    stage1_end: u64,
    last_end: u64,
    threads: u64,
    tasks1: u64,
    tasks2: u64,
    busy1: u64,
    busy2: u64,
    wait2: u64,
    bytes1: u64,
    bytes2: u64,
}

static TOTALS: Mutex<Totals> = Mutex::new(Totals {
    regions: 0,
    wall: 0,
    setup: 0,
    quantise: 0,
    first_mean: 0,
    first_max: 0,
    stage1_end: 0,
    last_end: 0,
    threads: 0,
    tasks1: 0,
    tasks2: 0,
    busy1: 0,
    busy2: 0,
    wait2: 0,
    bytes1: 0,
    bytes2: 0,
});

fn since(base: Instant, t: Instant) -> u64 {
    t.saturating_duration_since(base).as_nanos() as u64
}

/// One region being profiled: when it started and when its activations were quantised.
pub(crate) struct Region {
    t0: Instant,
    set_up: Option<Instant>,
    caller: u64,
}

impl Region {
    /// A region starting now, if profiling is on.
    pub(crate) fn start() -> Option<Region> {
        enabled().then(|| Region {
            t0: Instant::now(),
            set_up: None,
            caller: thread_id(),
        })
    }

    /// The region's tasks are laid out; it is about to start.
    pub(crate) fn set_up(self) -> Region {
        Region {
            set_up: Some(Instant::now()),
            ..self
        }
    }

    /// Adds the region (its tasks in `ts`) to the totals.
    pub(crate) fn finish(self, ts: &Tasks) {
        let wall = since(self.t0, Instant::now());
        let load = |v: &[AtomicU64], i: usize| v[i].load(Ordering::Relaxed);
        let mut t = Totals {
            regions: 1,
            wall,
            setup: self.set_up.map_or(0, |q| since(self.t0, q)),
            ..Totals::default()
        };
        let mut first: HashMap<u64, u64> = HashMap::new();
        for i in 0..ts.kind.len() {
            let (start, end, wait) = (load(&ts.start, i), load(&ts.end, i), load(&ts.wait, i));
            let thread = load(&ts.thread, i);
            let e = first.entry(thread).or_insert(start);
            *e = (*e).min(start);
            t.last_end = t.last_end.max(end);
            match ts.kind[i].load(Ordering::Relaxed) {
                0 => t.quantise += end.saturating_sub(start),
                1 => {
                    t.tasks1 += 1;
                    t.busy1 += end.saturating_sub(start);
                    t.bytes1 += load(&ts.bytes, i);
                    t.stage1_end = t.stage1_end.max(end);
                }
                2 => {
                    t.tasks2 += 1;
                    t.busy2 += end.saturating_sub(start).saturating_sub(wait);
                    t.wait2 += wait;
                    t.bytes2 += load(&ts.bytes, i);
                }
                _ => {}
            }
        }
        t.threads = first.len() as u64;
        let workers: Vec<u64> = first
            .iter()
            .filter(|(id, _)| **id != self.caller)
            .map(|(_, s)| *s)
            .collect();
        if !workers.is_empty() {
            t.first_mean = workers.iter().sum::<u64>() / workers.len() as u64;
            t.first_max = workers.iter().copied().max().unwrap_or(0);
        }
        let mut all = TOTALS.lock().unwrap_or_else(PoisonError::into_inner);
        macro_rules! add {
            ($($f:ident),*) => { $(all.$f += t.$f;)* };
        }
        add!(
            regions, wall, setup, quantise, first_mean, first_max, stage1_end, last_end, threads,
            tasks1, tasks2, busy1, busy2, wait2, bytes1, bytes2
        );
    }
}

/// Per task of a region: thread, start, end, wait (ns since the region's start), stage, bytes.
pub(crate) struct Tasks {
    epoch: Instant,
    thread: Vec<AtomicU64>,
    start: Vec<AtomicU64>,
    end: Vec<AtomicU64>,
    wait: Vec<AtomicU64>,
    kind: Vec<AtomicU8>,
    bytes: Vec<AtomicU64>,
}

impl Tasks {
    /// Room for `n` tasks of `region`.
    pub(crate) fn new(n: usize, region: &Region) -> Tasks {
        let zeros = || (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        Tasks {
            epoch: region.t0,
            thread: zeros(),
            start: zeros(),
            end: zeros(),
            wait: zeros(),
            kind: (0..n).map(|_| AtomicU8::new(0)).collect(),
            bytes: zeros(),
        }
    }

    /// Task `i` of stage `kind` started at `t` and reads `bytes`; its end is recorded when the
    /// returned guard drops.
    pub(crate) fn record(&self, i: usize, kind: u8, t: Instant, bytes: u64) -> TaskRec<'_> {
        self.thread[i].store(thread_id(), Ordering::Relaxed);
        self.start[i].store(since(self.epoch, t), Ordering::Relaxed);
        self.kind[i].store(kind, Ordering::Relaxed);
        self.bytes[i].store(bytes, Ordering::Relaxed);
        TaskRec { ts: self, i, t }
    }
}

/// A running task's record: [`TaskRec::waited`] marks the end of its wait, dropping it its end.
pub(crate) struct TaskRec<'a> {
    ts: &'a Tasks,
    i: usize,
    t: Instant,
}

impl TaskRec<'_> {
    /// The task's wait for its inputs ends now.
    pub(crate) fn waited(&mut self) {
        self.ts.wait[self.i].store(since(self.t, Instant::now()), Ordering::Relaxed);
    }
}

impl Drop for TaskRec<'_> {
    fn drop(&mut self) {
        let end = since(self.ts.epoch, Instant::now());
        self.ts.end[self.i].store(end, Ordering::Relaxed);
    }
}

/// The regions profiled since the last call, as one line of means per region (`None` when
/// profiling is off or no region ran); the totals start again.
pub fn report() -> Option<String> {
    let t = std::mem::take(&mut *TOTALS.lock().unwrap_or_else(PoisonError::into_inner));
    if t.regions == 0 {
        return None;
    }
    let n = t.regions as f64;
    let us = |ns: u64| ns as f64 / n / 1e3;
    let gbs = |bytes: u64, ns: u64| {
        if ns == 0 {
            0.0
        } else {
            bytes as f64 / ns as f64
        }
    };
    let threads = t.threads as f64 / n;
    let idle = threads * us(t.wall) - us(t.quantise) - us(t.busy1) - us(t.busy2) - us(t.wait2);
    Some(format!(
        "chained regions: {} | per region: wall {:.1} us, set-up {:.1} us, workers' first task at {:.1} us (latest {:.1}), \
         gate/up tasks done at {:.1} us, all tasks at {:.1} us | {:.1} threads, quantising {:.1} thread-us, {:.1} gate/up tasks busy {:.1} us ({:.2} GB/s a thread), \
         {:.1} down tasks busy {:.1} us ({:.2} GB/s a thread) waiting {:.1} us, idle {:.1} thread-us | {:.2} MB, {:.1} GB/s",
        t.regions,
        us(t.wall),
        us(t.setup),
        us(t.first_mean),
        us(t.first_max),
        us(t.stage1_end),
        us(t.last_end),
        threads,
        us(t.quantise),
        t.tasks1 as f64 / n,
        us(t.busy1),
        gbs(t.bytes1, t.busy1),
        t.tasks2 as f64 / n,
        us(t.busy2),
        gbs(t.bytes2, t.busy2),
        us(t.wait2),
        idle,
        (t.bytes1 + t.bytes2) as f64 / n / 1e6,
        gbs(t.bytes1 + t.bytes2, t.wall),
    ))
}
