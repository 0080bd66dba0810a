//! The host's side of a device frame ([`HostClock`]): its time preparing a frame's inputs,
//! in `queue.submit`, encoding the next frame's commands ahead, and from the submission to
//! what the frame reads back, summed over frames, so that `bench model` can split the host's
//! turn between decoded tokens (the wall clock a token takes beyond the GPU's busy time).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A part of a frame's host work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The embedding rows, the n-gram rows and the frame values, and their uploads.
    Inputs,
    /// `queue.submit` of the frame's command buffer.
    Submit,
    /// Encoding the next frame's command buffer (while the GPU runs this one).
    Ahead,
    /// From the submission's return to the frame's outputs read back (the GPU's time
    /// included).
    Read,
}

/// Nanoseconds per [`Phase`], and frames, of the frames that ran without breaks (every routed
/// expert resident; the cold path counts its own).
#[derive(Debug, Default)]
pub struct HostClock {
    frames: AtomicU64,
    ns: [AtomicU64; 4],
}

/// [`HostClock`]'s sums in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostStats {
    /// Frames timed.
    pub frames: u64,
    /// [`Phase::Inputs`].
    pub inputs_seconds: f64,
    /// [`Phase::Submit`].
    pub submit_seconds: f64,
    /// [`Phase::Ahead`].
    pub ahead_seconds: f64,
    /// [`Phase::Read`].
    pub read_seconds: f64,
}

impl HostClock {
    /// Adds the time since `t0` to `phase`.
    pub(crate) fn add(&self, phase: Phase, t0: Instant) {
        self.add_time(phase, t0.elapsed());
    }

    /// Adds `d` to `phase`.
    pub(crate) fn add_time(&self, phase: Phase, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.ns[phase as usize].fetch_add(ns, Ordering::Relaxed);
    }

    /// Counts a frame.
    pub(crate) fn frame(&self) {
        self.frames.fetch_add(1, Ordering::Relaxed);
    }

    /// The sums so far.
    pub fn stats(&self) -> HostStats {
        let s = |p: Phase| self.ns[p as usize].load(Ordering::Relaxed) as f64 * 1e-9;
        HostStats {
            frames: self.frames.load(Ordering::Relaxed),
            inputs_seconds: s(Phase::Inputs),
            submit_seconds: s(Phase::Submit),
            ahead_seconds: s(Phase::Ahead),
            read_seconds: s(Phase::Read),
        }
    }
}

impl HostStats {
    /// What was added since `before`.
    pub fn since(&self, before: &HostStats) -> HostStats {
        HostStats {
            frames: self.frames.saturating_sub(before.frames),
            inputs_seconds: self.inputs_seconds - before.inputs_seconds,
            submit_seconds: self.submit_seconds - before.submit_seconds,
            ahead_seconds: self.ahead_seconds - before.ahead_seconds,
            read_seconds: self.read_seconds - before.read_seconds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each phase sums into its own counter, and `since` takes the earlier sums off.
    #[test]
    fn phases_sum_apart() {
        let c = HostClock::default();
        let t0 = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        c.add(Phase::Read, t0);
        c.frame();
        let a = c.stats();
        assert_eq!(a.frames, 1);
        assert!(a.read_seconds >= 0.002, "{a:?}");
        assert_eq!(
            (a.inputs_seconds, a.submit_seconds, a.ahead_seconds),
            (0.0, 0.0, 0.0)
        );
        c.add(Phase::Submit, Instant::now());
        c.frame();
        let d = c.stats().since(&a);
        assert_eq!(d.frames, 1);
        assert_eq!(d.read_seconds, 0.0);
        assert!(d.submit_seconds >= 0.0);
    }
}
