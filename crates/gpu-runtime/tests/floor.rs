//! `bench kernels`' launch-floor variants do the work they time: every dispatch ran and read
//! its index from its own uniform or from the immediates pushed with it (a wrong index adds
//! elsewhere), the workgroup-memory variant read back what its lanes stored, the variant
//! alternating two pipelines ran each for half of the dispatches, and the variant whose
//! dispatches each write a buffer of their own wrote every one of them.

mod common;

use gpu_runtime::bench::{FloorVariant, launch_floor_variant};

#[test]
fn launch_floor_variants_count_every_dispatch() {
    let Some(ctx) = common::ctx() else { return };
    let reps = 7; // n = 8: four through each of two pipelines
    // The warm-up's one recording, then the timed pass's `reps`.
    let n = reps as u32 + 1;
    for (variant, want) in [
        (FloorVariant::Uniform, n),
        (FloorVariant::Immediate, n),
        (FloorVariant::WorkgroupMemory, 5 * n),
        // Half through each pipeline, the second adding 1 << 16.
        (FloorVariant::Alternate, (n / 2) * (1 + (1 << 16))),
        (FloorVariant::Fresh, n),
    ] {
        match launch_floor_variant(ctx, variant, reps).unwrap() {
            Some((t, count)) => {
                assert_eq!(count, want, "{}", variant.name());
                assert!(t.seconds > 0.0, "{}", variant.name());
            }
            None => assert_eq!(
                variant,
                FloorVariant::Immediate,
                "only immediates may be missing"
            ),
        }
    }
}
