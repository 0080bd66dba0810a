//! `bench kernels`' launch-floor variants do the work they time: every dispatch ran and read
//! its index from its own uniform or from the immediates pushed with it (a wrong index adds
//! elsewhere), the workgroup-memory variant read back what its lanes stored, and the variant
//! whose dispatches each write a buffer of their own wrote every one of them.

mod common;

use gpu_runtime::bench::{FloorVariant, launch_floor_variant};

#[test]
fn launch_floor_variants_count_every_dispatch() {
    let Some(ctx) = common::ctx() else { return };
    let reps = 7;
    for (variant, per) in [
        (FloorVariant::Uniform, 1),
        (FloorVariant::Immediate, 1),
        (FloorVariant::WorkgroupMemory, 5),
        (FloorVariant::Fresh, 1),
    ] {
        match launch_floor_variant(ctx, variant, reps).unwrap() {
            Some((t, count)) => {
                // The warm-up's recording, then the timed one's.
                assert_eq!(count, per * (reps as u32 + 1), "{}", variant.name());
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
