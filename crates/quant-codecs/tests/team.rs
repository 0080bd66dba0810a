//! The thread team (`quant_codecs::team`): every index of a region runs exactly once, on a
//! team awake or parked, from several callers, nested, and after a task panicked; awake or
//! parked, the workers share a region's tasks.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use quant_codecs::team::{Parallel, Rayon, Team};

/// Runs a region of `n` tasks that count their index and checks each ran once.
fn once_each(exec: &dyn Parallel, n: usize) {
    let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
    exec.for_each_index(n, &|i| {
        hits[i].fetch_add(1, Ordering::Relaxed);
    });
    for (i, h) in hits.iter().enumerate() {
        assert_eq!(h.load(Ordering::Relaxed), 1, "index {i} of {n}");
    }
}

/// Runs a region of `n` tasks of `ms` milliseconds each; how many threads ran some.
fn threads_sharing(team: &Team, n: usize, ms: u64) -> usize {
    let threads = std::sync::Mutex::new(std::collections::HashSet::new());
    team.for_each_index(n, &|_| {
        threads.lock().unwrap().insert(std::thread::current().id());
        std::thread::sleep(Duration::from_millis(ms));
    });
    threads.into_inner().unwrap().len()
}

#[test]
fn every_index_runs_once_on_rayon_and_on_teams_of_any_size() {
    let teams = [
        Team::new(0, Duration::ZERO),
        Team::new(1, Duration::from_millis(2)),
        Team::new(5, Duration::from_millis(2)),
        Team::new(3, Duration::ZERO),
    ];
    for n in [0, 1, 2, 3, 7, 64, 1000] {
        once_each(&Rayon, n);
        for t in &teams {
            for _ in 0..20 {
                once_each(t, n);
            }
        }
    }
    assert_eq!(teams[2].threads(), 6);
}

/// Workers that have parked (no spin, a pause longer than any wake-up) still take the next
/// region's tasks, and do share them: with tasks slow enough, more than one thread runs some.
#[test]
fn parked_workers_wake_for_the_next_region() {
    let team = Team::new(3, Duration::ZERO);
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(20));
        once_each(&team, 50);
        assert!(
            threads_sharing(&team, 32, 2) > 1,
            "one thread ran every task"
        );
    }
}

/// Workers spinning between regions (what the cold path's layers see) take each region from
/// their own slots and share it, from the first region on: one posted before a worker has
/// started is still joined by it once it runs.
#[test]
fn spinning_workers_share_back_to_back_regions() {
    let team = Team::new(3, Duration::from_millis(200));
    for _ in 0..20 {
        assert!(
            threads_sharing(&team, 16, 1) > 1,
            "one thread ran every task"
        );
    }
}

/// A task that panics does not hang the region: the others run, the call panics, and the
/// team goes on working.
#[test]
fn a_panicking_task_fails_the_call_and_leaves_the_team_usable() {
    let team = Team::new(3, Duration::from_millis(1));
    let ran = AtomicUsize::new(0);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        team.for_each_index(40, &|i| {
            if i == 17 {
                panic!("task 17");
            }
            ran.fetch_add(1, Ordering::Relaxed);
        })
    }));
    assert!(r.is_err(), "the panic was swallowed");
    assert_eq!(ran.load(Ordering::Relaxed), 39);
    once_each(&team, 100);
}

/// Regions from two threads at once take turns; a region started inside a task runs inline.
#[test]
fn concurrent_and_nested_regions_complete() {
    let team = Team::new(2, Duration::from_millis(1));
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                for n in [5, 33, 200] {
                    once_each(&team, n);
                }
            });
        }
    });
    let total = AtomicUsize::new(0);
    team.for_each_index(6, &|_| {
        team.for_each_index(10, &|j| {
            total.fetch_add(j, Ordering::Relaxed);
        });
    });
    assert_eq!(total.load(Ordering::Relaxed), 6 * 45);
}
