//! What a device offers and whether every kernel family builds on it: the runtime's own
//! report, so a front end (`cortiq doctor`) shows it without knowing how pipelines are made.

use kernels_wgsl::{Codec, Epilogue};

use crate::GpuContext;
use crate::ops::matvec::Plan;

/// The device's kernel report.
#[derive(Debug, Clone)]
pub struct KernelReport {
    /// The matvec plan chosen for a large matrix on this device.
    pub plan: Plan,
    /// Selected limits by name.
    pub limits: Vec<(String, u64)>,
    /// Each kernel variant by name: `Ok` when its pipeline builds, else the driver's refusal.
    pub kernels: Vec<(String, Result<(), String>)>,
}

impl KernelReport {
    /// The plan in words: reduction, lanes per workgroup, lanes per row.
    pub fn plan_text(&self) -> String {
        format!(
            "{:?} reduction, {} lanes per workgroup, {} per row",
            self.plan.reduce, self.plan.wg, self.plan.lanes
        )
    }

    /// Whether every kernel built.
    pub fn all_ok(&self) -> bool {
        self.kernels.iter().all(|(_, r)| r.is_ok())
    }
}

/// Builds every kernel family's pipelines on `ctx` (the matvec of every codec at 1 and 8 token
/// rows, the read-bandwidth probes) and reads the limits that matter to them.
pub fn kernel_report(ctx: &GpuContext) -> KernelReport {
    let plan = Plan::for_matrix(ctx, 1 << 20);
    let mut kernels = Vec::new();
    for codec in Codec::ALL {
        for nt in [1, 8] {
            // Built exactly as a matvec dispatch builds it (same layout), so the report checks
            // the pipelines that will run.
            let status = crate::ops::matvec::codec_pipeline(ctx, codec, nt, plan, Epilogue::None)
                .map(|_| ())
                .map_err(|e| e.to_string());
            let p = plan.for_codec(ctx, codec, nt, false);
            let mut k = p.kernel(codec, nt);
            k.lut_copies = p.lut_copies(ctx, &k);
            kernels.push((k.name(), status));
        }
    }
    for entry in ["read_bw", "tiny"] {
        let status = ctx
            .compute_pipeline(
                "read_bw",
                &|| kernels_wgsl::READ_BW.to_string(),
                entry,
                &[("WG", 256.0)],
            )
            .map(|_| ())
            .map_err(|e| e.to_string());
        kernels.push((entry.to_string(), status));
    }
    KernelReport {
        plan,
        limits: limits(ctx),
        kernels,
    }
}

fn limits(ctx: &GpuContext) -> Vec<(String, u64)> {
    let l = &ctx.limits;
    [
        ("max_buffer_size", l.max_buffer_size),
        (
            "max_storage_buffer_binding_size",
            l.max_storage_buffer_binding_size,
        ),
        (
            "max_storage_buffers_per_shader_stage",
            l.max_storage_buffers_per_shader_stage as u64,
        ),
        (
            "max_compute_workgroups_per_dimension",
            l.max_compute_workgroups_per_dimension as u64,
        ),
        (
            "max_compute_invocations_per_workgroup",
            l.max_compute_invocations_per_workgroup as u64,
        ),
        (
            "max_compute_workgroup_storage_size",
            l.max_compute_workgroup_storage_size as u64,
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}
