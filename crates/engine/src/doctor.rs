//! `cortiq doctor`: what the machine offers (adapter, backend, driver, features, limits,
//! subgroup sizes, VRAM budget) and whether every kernel family builds on it: the report a
//! user pastes into a bug report.

use gpu_runtime::{GpuOptions, Selected};
use serde::Serialize;

/// The doctor's findings.
#[derive(Debug, Serialize)]
pub struct Doctor {
    /// `gpu`, `gpu (software adapter)` for a CPU-emulated device such as lavapipe, or `cpu`.
    pub backend: String,
    /// Whether the adapter is CPU-emulated (it runs every kernel, but at CPU speed).
    pub software_adapter: bool,
    /// Why the CPU was chosen, when it was.
    pub cpu_reason: Option<String>,
    /// The one-line adapter description.
    pub adapter: Option<String>,
    /// Selected limits by name.
    pub limits: Vec<(String, u64)>,
    /// The matvec plan: reduction, lanes per workgroup, lanes per row.
    pub plan: Option<String>,
    /// Each kernel family: name, then `ok` or the driver's refusal.
    pub kernels: Vec<(String, String)>,
    /// Errors the device reported outside any scope.
    pub uncaptured_errors: Vec<String>,
    /// The CPU kernels' instruction set.
    pub cpu_isa: String,
    /// CPU threads the kernels use.
    pub cpu_threads: usize,
}

/// Opens the backend `opts` selects and checks every kernel family on it.
pub fn run(opts: &GpuOptions) -> Result<Doctor, gpu_runtime::GpuError> {
    let cpu_isa = quant_codecs::Isa::detect().name().to_string();
    let cpu_threads = rayon::current_num_threads();
    match gpu_runtime::select(opts)? {
        Selected::Cpu(reason) => Ok(Doctor {
            backend: "cpu".into(),
            software_adapter: false,
            cpu_reason: Some(reason),
            adapter: None,
            limits: Vec::new(),
            plan: None,
            kernels: Vec::new(),
            uncaptured_errors: Vec::new(),
            cpu_isa,
            cpu_threads,
        }),
        Selected::Gpu(ctx) => {
            let report = gpu_runtime::report::kernel_report(&ctx);
            let software = ctx.is_software();
            Ok(Doctor {
                backend: if software {
                    "gpu (software adapter: CPU-emulated, for correctness, not speed)".into()
                } else {
                    "gpu".into()
                },
                software_adapter: software,
                cpu_reason: None,
                adapter: Some(ctx.describe()),
                plan: Some(report.plan_text()),
                limits: report.limits,
                kernels: report
                    .kernels
                    .into_iter()
                    .map(|(name, r)| (name, r.err().unwrap_or_else(|| "ok".into())))
                    .collect(),
                uncaptured_errors: ctx.uncaptured.lock().clone(),
                cpu_isa,
                cpu_threads,
            })
        }
    }
}

impl Doctor {
    /// The human-readable report.
    pub fn write_text(&self, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        writeln!(w, "backend     {}", self.backend)?;
        if let Some(r) = &self.cpu_reason {
            writeln!(w, "why cpu     {r}")?;
        }
        if let Some(a) = &self.adapter {
            writeln!(w, "adapter     {a}")?;
        }
        if let Some(p) = &self.plan {
            writeln!(w, "matvec      {p}")?;
        }
        writeln!(
            w,
            "cpu         {} kernels, {} threads",
            self.cpu_isa, self.cpu_threads
        )?;
        for (k, v) in &self.limits {
            writeln!(w, "limit       {k} = {v}")?;
        }
        for (k, v) in &self.kernels {
            writeln!(w, "kernel      {k:<22} {v}")?;
        }
        for e in &self.uncaptured_errors {
            writeln!(w, "error       {e}")?;
        }
        Ok(())
    }
}
