//! Several int8 products in one parallel region: [`run_many`] (independent products, such as a
//! layer's cold experts' gate/up projections) and [`run_chain`] (pairs `second . f(first . x)`,
//! such as whole expert MLPs, where a pair's second product starts as soon as its own first
//! one is done instead of after every first product).
//!
//! Both split every matrix's rows into tasks of about [`TASK_BYTES`] and compute each row
//! exactly as [`crate::int8::run`] does, so the split never changes a bit.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use crate::int8::{
    ActChunk, Acts, Mat, Order, Path, act_params, acts_of, acts_serial, code_offset, path_of,
    rows_path,
};
use crate::team::Parallel;
use crate::{DType, Isa, Layout, MAX_BATCH};

/// Bytes of weights one task reads at least. Measured on the H200 machine's 16-core host with
/// a layer's cold experts on a spinning team (docs/perf.md, #16): 96 KB beat 24, 48 and 192 KB
/// (fewer tasks to start, each streaming longer, and still several per thread).
const TASK_BYTES: usize = 96 << 10;

/// Activation floats below which quantising them is left to the caller's thread: a region's
/// start and join cost more than quantising a few thousand values.
const SERIAL_QUANT_FLOATS: usize = 1 << 15;

/// Rows per task for a matrix.
fn task_rows(m: &Mat) -> usize {
    let row_bytes = (m.bytes.len() / m.l.rows).max(1);
    (TASK_BYTES / row_bytes).clamp(8, m.l.rows.max(8))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Rows `r0..` of `m` for `nt` token rows into `outs` (one slice per token row).
fn rows_nt(p: Path, m: &Mat, a: &Acts, nt: usize, r0: usize, outs: &mut [&mut [f32]]) {
    let order = Order::of(m.l.dtype);
    match nt {
        1 => rows_path::<1>(p, m, a, order, r0, outs),
        2 => rows_path::<2>(p, m, a, order, r0, outs),
        3 => rows_path::<3>(p, m, a, order, r0, outs),
        4 => rows_path::<4>(p, m, a, order, r0, outs),
        5 => rows_path::<5>(p, m, a, order, r0, outs),
        6 => rows_path::<6>(p, m, a, order, r0, outs),
        7 => rows_path::<7>(p, m, a, order, r0, outs),
        _ => rows_path::<8>(p, m, a, order, r0, outs),
    }
}

/// Quantises the activations of several products, once for products that read the same
/// activations with the same code layout (a layer's cold experts all read the MoE input;
/// q8_2f's activations are scaled by each matrix's own column scales first, so they never
/// share). Returns the quantised sets and, per product, which set it reads.
fn shared_acts(exec: &dyn Parallel, products: &[(Mat, &[f32])]) -> (Vec<Acts>, Vec<usize>) {
    let (firsts, which) = act_sets(products);
    let floats: usize = firsts.iter().map(|&j| products[j].1.len()).sum();
    if floats < SERIAL_QUANT_FLOATS {
        let acts = firsts
            .iter()
            .map(|&j| acts_of(&products[j].0, products[j].1))
            .collect();
        return (acts, which);
    }
    // Inside the region each set is quantised on its own thread: a task that entered rayon's
    // pool from a team thread would wait on it, and could wait for ever if the region's
    // caller were the pool's only free thread.
    let acts: Vec<Mutex<Option<Acts>>> = firsts.iter().map(|_| Mutex::new(None)).collect();
    exec.for_each_index(firsts.len(), &|i| {
        let (m, xs) = products[firsts[i]];
        *lock(&acts[i]) = Some(acts_serial(&m, xs));
    });
    let acts = acts
        .into_iter()
        .map(|a| {
            a.into_inner()
                .unwrap_or_else(PoisonError::into_inner)
                .expect("every activation set was quantised")
        })
        .collect();
    (acts, which)
}

/// Which products can share one quantisation of their activations: the first product of
/// each set, and per product the set it reads.
fn act_sets(products: &[(Mat, &[f32])]) -> (Vec<usize>, Vec<usize>) {
    let key = |&(m, xs): &(Mat, &[f32])| {
        (m.l.dtype != DType::Q8_2f).then(|| {
            let order = Order::of(m.l.dtype);
            (
                xs.as_ptr(),
                xs.len(),
                m.l.cols,
                order,
                code_offset(m.l.dtype),
            )
        })
    };
    let mut which = Vec::with_capacity(products.len());
    let mut firsts: Vec<usize> = Vec::new();
    for (j, prod) in products.iter().enumerate() {
        let k = key(prod);
        let same = k.and_then(|k| firsts.iter().position(|&f| key(&products[f]) == Some(k)));
        which.push(same.unwrap_or_else(|| {
            firsts.push(j);
            firsts.len() - 1
        }));
    }
    (firsts, which)
}

/// A task writing rows `r0..` of a product: its output slice per token row (the first `nt`;
/// held inline, since a layer's cold experts make a few hundred of these per call).
type OutTask<'a> = (usize, usize, [&'a mut [f32]; MAX_BATCH]);

/// Splits product `j`'s outputs `ys` (`nt` rows of `rows`) into tasks of `chunk` rows.
fn out_tasks<'a>(
    j: usize,
    rows: usize,
    chunk: usize,
    nt: usize,
    ys: &'a mut [f32],
) -> Vec<OutTask<'a>> {
    let mut tasks: Vec<OutTask<'a>> = (0..rows.div_ceil(chunk))
        .map(|c| (j, c * chunk, Default::default()))
        .collect();
    for (t, y) in ys.chunks_mut(rows).take(nt).enumerate() {
        for (task, part) in tasks.iter_mut().zip(y.chunks_mut(chunk)) {
            task.2[t] = part;
        }
    }
    tasks
}

/// One product of [`run_many`]: the matrix's layout and bytes, `nt`, `xs`, `ys`.
pub(crate) type ManyProduct<'a> = (Layout, &'a [u8], usize, &'a [f32], &'a mut [f32]);

/// Several products (each `(matrix, nt, xs, ys)`, quantised dtypes, `1 <= nt <= MAX_BATCH`,
/// lengths checked by the caller) in one parallel region: all the products' tasks scheduled
/// together, so a handful of small matrices costs one fork/join instead of one per matrix.
pub(crate) fn run_many(isa: Isa, exec: &dyn Parallel, products: Vec<ManyProduct<'_>>) {
    let p = path_of(isa);
    let ins: Vec<(Mat, &[f32])> = products
        .iter()
        .map(|&(l, bytes, _, xs, _)| (Mat { l, bytes }, xs))
        .collect();
    let (acts, which) = shared_acts(exec, &ins);
    let mut meta = Vec::with_capacity(products.len());
    let mut tasks: Vec<OutTask<'_>> = Vec::new();
    for (j, (l, bytes, nt, _, ys)) in products.into_iter().enumerate() {
        debug_assert!(l.dtype.has_int8_kernel());
        let m = Mat { l, bytes };
        tasks.extend(out_tasks(j, l.rows, task_rows(&m), nt, ys));
        meta.push((m, &acts[which[j]], nt));
    }
    // Each task is taken out of its cell by the one index that runs it.
    let cells: Vec<Mutex<Option<OutTask<'_>>>> =
        tasks.into_iter().map(|t| Mutex::new(Some(t))).collect();
    exec.for_each_index(cells.len(), &|i| {
        if let Some((j, r0, mut outs)) = lock(&cells[i]).take() {
            let (m, a, nt) = &meta[j];
            rows_nt(p, m, a, *nt, r0, &mut outs[..*nt]);
        }
    });
}

/// A finished stage-one task of [`run_chain`]: its first row and its outputs, token-major.
type RowsDone = (usize, Vec<f32>);

/// One pair of [`run_chain`]: the first matrix, `nt`, `xs`, the second matrix, `ys`.
pub(crate) type ChainLink<'a> = (Mat<'a>, usize, &'a [f32], Mat<'a>, &'a mut [f32]);

/// What `between(pair, y, x)` turns a first product's outputs `y` (`nt` rows of the first
/// matrix's rows) into: the second product's activations `x` (`nt` rows of the second
/// matrix's columns).
pub type Between<'f> = dyn Fn(usize, &[f32], &mut [f32]) + Sync + 'f;

/// Sets `flag` if dropped while armed: a stage-one task that unwinds marks its pair failed,
/// so the stage-two tasks waiting for it return instead of waiting for ever.
struct FailOnUnwind<'a>(&'a AtomicBool);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

/// Waits for `acts` (set by a task already running: tasks are claimed in order, and every
/// task a wait depends on comes earlier); `None` if the task that was to set it failed.
fn wait_for<'a>(acts: &'a OnceLock<Acts>, failed: &AtomicBool) -> Option<&'a Acts> {
    let mut spins = 0u32;
    loop {
        if let Some(a) = acts.get() {
            return Some(a);
        }
        if failed.load(Ordering::Acquire) {
            return None;
        }
        spins += 1;
        if spins < 1 << 12 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// One activation set of [`run_chain`] quantised inside its region, a chunk of a token row
/// per task: the matrix it is laid out for, its rows, `nt`, q8_2f's column scales.
struct ActSet<'a> {
    m: Mat<'a>,
    xs: &'a [f32],
    nt: usize,
    cs: Option<Vec<f32>>,
    layout: (Order, i32),
    chunks: usize,
}

/// Pairs `ys = second . between(first . xs)` (quantised dtypes, `1 <= nt <= MAX_BATCH`,
/// lengths checked by the caller) in one parallel region. The first products' activations
/// are quantised by the region's first tasks, a chunk of a row each (so the threads start at
/// once rather than after one thread has quantised them all); then every first product's
/// tasks are claimed, then every second product's; the task that finishes a pair's first
/// product applies `between`, quantises the result and releases that pair's second-product
/// tasks. A task waits only for tasks already running, never behind a region-wide barrier;
/// each value equals two [`run_many`] calls with `between` applied between.
pub(crate) fn run_chain(
    isa: Isa,
    exec: &dyn Parallel,
    links: Vec<ChainLink<'_>>,
    between: &Between<'_>,
) {
    let p = path_of(isa);
    let prof = crate::chain_profile::Region::start();
    let ins: Vec<(Mat, &[f32])> = links.iter().map(|l| (l.0, l.2)).collect();
    let (firsts, which) = act_sets(&ins);
    let sets: Vec<ActSet<'_>> = firsts
        .iter()
        .map(|&j| {
            let (m, xs) = ins[j];
            let (cs, layout) = act_params(&m);
            ActSet {
                m,
                xs,
                nt: xs.len() / m.l.cols,
                cs,
                layout,
                chunks: ActChunk::per_row(m.l.cols),
            }
        })
        .collect();
    // Stage zero: (set, token row, chunk).
    let t0: Vec<(usize, usize, usize)> = sets
        .iter()
        .enumerate()
        .flat_map(|(i, a)| (0..a.nt).flat_map(move |t| (0..a.chunks).map(move |c| (i, t, c))))
        .collect();
    let chunks0: Vec<Mutex<Vec<(usize, usize, ActChunk)>>> =
        sets.iter().map(|_| Mutex::new(Vec::new())).collect();
    let acts1: Vec<OnceLock<Acts>> = sets.iter().map(|_| OnceLock::new()).collect();
    let failed0: Vec<AtomicBool> = sets.iter().map(|_| AtomicBool::new(false)).collect();
    // Stage one: (pair, first row, rows); its outputs are gathered per pair.
    let mut t1: Vec<(usize, usize, usize)> = Vec::new();
    let mut count1 = Vec::with_capacity(links.len());
    let mut meta = Vec::with_capacity(links.len());
    let mut t2: Vec<OutTask<'_>> = Vec::new();
    for (j, (first, nt, _, second, ys)) in links.into_iter().enumerate() {
        debug_assert!(first.l.dtype.has_int8_kernel() && second.l.dtype.has_int8_kernel());
        let chunk = task_rows(&first);
        let before = t1.len();
        for r0 in (0..first.l.rows).step_by(chunk) {
            t1.push((j, r0, chunk.min(first.l.rows - r0)));
        }
        count1.push(t1.len() - before);
        t2.extend(out_tasks(j, second.l.rows, task_rows(&second), nt, ys));
        meta.push((first, second, nt));
    }
    // Per pair, its finished stage-one tasks: (first row, outputs token-major).
    let parts: Vec<Mutex<Vec<RowsDone>>> = meta.iter().map(|_| Mutex::new(Vec::new())).collect();
    let acts2: Vec<OnceLock<Acts>> = meta.iter().map(|_| OnceLock::new()).collect();
    let failed: Vec<AtomicBool> = meta.iter().map(|_| AtomicBool::new(false)).collect();
    let cells2: Vec<Mutex<Option<OutTask<'_>>>> =
        t2.into_iter().map(|t| Mutex::new(Some(t))).collect();
    let claim = AtomicUsize::new(0);
    let (n0, n1) = (t0.len(), t1.len());
    let prof = prof.map(|r| r.set_up());
    let tasks = prof
        .as_ref()
        .map(|r| crate::chain_profile::Tasks::new(n0 + n1 + cells2.len(), r));
    let bytes_of = |m: &Mat, rows: usize| (m.bytes.len() / m.l.rows.max(1) * rows) as u64;
    // Tasks go in claim order, not by the index a runner was given: a later stage's task is
    // only claimed once every task of the stages before has been, by a runner that is running
    // it, so waiting for one never waits for a task still queued (with rayon, perhaps behind
    // the waiter).
    exec.for_each_index(n0 + n1 + cells2.len(), &|_| {
        let k = claim.fetch_add(1, Ordering::Relaxed);
        let t_start = tasks.as_ref().map(|_| std::time::Instant::now());
        if k < n0 {
            let (i, t, c) = t0[k];
            let a = &sets[i];
            let _guard = FailOnUnwind(&failed0[i]);
            let _rec = tasks
                .as_ref()
                .zip(t_start)
                .map(|(ts, t)| ts.record(k, 0, t, 0));
            let cols = a.m.l.cols;
            let part = ActChunk::quantize(&a.xs[t * cols..][..cols], a.cs.as_deref(), a.layout, c);
            let done = {
                let mut ps = lock(&chunks0[i]);
                ps.push((t, c, part));
                (ps.len() == a.nt * a.chunks).then(|| std::mem::take(&mut *ps))
            };
            if let Some(ps) = done {
                let mut acts = Acts::zeroed(a.nt, cols, a.layout.0);
                for (t, c, part) in &ps {
                    acts.set_chunk(*t, *c, part);
                }
                // Only the task that completes set `i` gets here.
                let _ = acts1[i].set(acts);
            }
        } else if k < n0 + n1 {
            let k1 = k - n0;
            let (j, r0, len) = t1[k1];
            let (first, second, nt) = &meta[j];
            let _guard = FailOnUnwind(&failed[j]);
            let _rec = tasks
                .as_ref()
                .zip(t_start)
                .map(|(ts, t)| ts.record(k, 1, t, bytes_of(first, len)));
            let Some(a1) = wait_for(&acts1[which[j]], &failed0[which[j]]) else {
                failed[j].store(true, Ordering::Release);
                return;
            };
            let mut buf = vec![0.0f32; nt * len];
            let mut outs: [&mut [f32]; MAX_BATCH] = Default::default();
            for (o, part) in outs.iter_mut().zip(buf.chunks_mut(len)) {
                *o = part;
            }
            rows_nt(p, first, a1, *nt, r0, &mut outs[..*nt]);
            let done = {
                let mut ps = lock(&parts[j]);
                ps.push((r0, buf));
                (ps.len() == count1[j]).then(|| std::mem::take(&mut *ps))
            };
            if let Some(ps) = done {
                let rows = first.l.rows;
                let mut y1 = vec![0.0f32; nt * rows];
                for (r0, buf) in ps {
                    let len = buf.len() / nt;
                    for (t, part) in buf.chunks(len).enumerate() {
                        y1[t * rows + r0..][..len].copy_from_slice(part);
                    }
                }
                let mut mid = vec![0.0f32; nt * second.l.cols];
                between(j, &y1, &mut mid);
                // The only task that gets here for pair `j` sets it; nothing else does. Serial:
                // stage-two tasks of this pair may be waiting for it, and inside rayon's pool
                // this thread could take one of them up while it waits for its own helpers.
                let _ = acts2[j].set(acts_serial(second, &mid));
            }
        } else if let Some((j, r0, mut outs)) = lock(&cells2[k - n0 - n1]).take() {
            let (_, second, nt) = &meta[j];
            let rows = outs[0].len();
            let mut rec = tasks
                .as_ref()
                .zip(t_start)
                .map(|(ts, t)| ts.record(k, 2, t, bytes_of(second, rows)));
            let Some(a) = wait_for(&acts2[j], &failed[j]) else {
                return;
            };
            if let Some(r) = rec.as_mut() {
                r.waited();
            }
            rows_nt(p, second, a, *nt, r0, &mut outs[..*nt]);
        }
    });
    if let (Some(r), Some(ts)) = (prof, tasks) {
        r.finish(&ts);
    }
}
