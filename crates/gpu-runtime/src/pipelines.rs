//! Compute pipelines: built on first use under Validation and Internal error scopes (a kernel
//! the validator or the driver turns down becomes [`GpuError::PipelineRejected`], which callers
//! answer with the CPU kernel), cached per (module, entry, specialisation) including failures,
//! and backed by wgpu's persistent pipeline cache where the backend has one.
//!
//! Kernels are compiled without two of the checks wgpu adds by default: an iteration counter
//! in every loop (a guard against infinite loops in untrusted shaders, which also stands in the
//! way of the driver unrolling our constant-bound loops, e.g. the GDN recurrence's rows held in
//! registers) and a zero guard on every integer division (in the index arithmetic of every
//! inner loop). Buffer and array bounds stay checked. `CORTIQ_SHADER_CHECKS=full` (or
//! `GpuOptions::full_shader_checks`) restores every check.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::GpuError;

/// Name, entry point, constants, and the explicit layout's address (0 for an automatic one): the
/// same shader and constants under another layout is another pipeline, whose bind groups would
/// not fit the first.
type Key = (String, String, Vec<(String, u64)>, usize);

/// The pipeline table of one device.
pub(crate) struct Pipelines {
    map: Mutex<HashMap<Key, Result<Arc<wgpu::ComputePipeline>, String>>>,
    modules: Mutex<HashMap<String, Arc<wgpu::ShaderModule>>>,
    cache: Option<wgpu::PipelineCache>,
    cache_file: Option<PathBuf>,
    full_checks: bool,
}

fn cache_file(dir: PathBuf, info: &wgpu::AdapterInfo) -> PathBuf {
    let clean = |s: &str| {
        s.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect::<String>()
    };
    dir.join(format!(
        "pipelines-{:04x}-{:04x}-{}-{}.bin",
        info.vendor,
        info.device,
        clean(&info.driver),
        clean(&info.driver_info)
    ))
}

impl Pipelines {
    pub(crate) fn new(
        device: &wgpu::Device,
        info: &wgpu::AdapterInfo,
        supported: bool,
        dir: Option<PathBuf>,
        full_checks: bool,
    ) -> Pipelines {
        let cache_file = dir.filter(|_| supported).map(|d| cache_file(d, info));
        let cache = cache_file.as_ref().map(|f| {
            let data = std::fs::read(f).ok();
            // SAFETY: wgpu validates the blob's header (adapter and driver key, checksum) and,
            // with `fallback: true`, starts an empty cache when it does not match; the file
            // name is keyed by the same adapter and driver, and it was written by `save` from
            // `PipelineCache::get_data`.
            unsafe {
                device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
                    label: Some("cortiq pipelines"),
                    data: data.as_deref(),
                    fallback: true,
                })
            }
        });
        Pipelines {
            map: Mutex::new(HashMap::new()),
            modules: Mutex::new(HashMap::new()),
            cache,
            cache_file,
            full_checks,
        }
    }

    /// The pipeline for `entry` of module `name` (source `source`) specialised with `constants`.
    pub(crate) fn get(
        &self,
        device: &wgpu::Device,
        name: &str,
        source: &dyn Fn() -> String,
        entry: &str,
        constants: &[(&str, f64)],
        layout: Option<&wgpu::PipelineLayout>,
    ) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
        let key: Key = (
            name.to_string(),
            entry.to_string(),
            constants
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_bits()))
                .collect(),
            layout.map_or(0, |l| l as *const wgpu::PipelineLayout as usize),
        );
        let label = format!("{name}:{entry}{constants:?}");
        if let Some(hit) = self.map.lock().get(&key) {
            return hit.clone().map_err(|message| GpuError::PipelineRejected {
                name: label,
                message,
            });
        }
        let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
        let module = {
            let mut modules = self.modules.lock();
            modules
                .entry(name.to_string())
                .or_insert_with(|| {
                    let desc = wgpu::ShaderModuleDescriptor {
                        label: Some(name),
                        source: wgpu::ShaderSource::Wgsl(source().into()),
                    };
                    let mut checks = wgpu::ShaderRuntimeChecks::checked();
                    if !self.full_checks {
                        checks.force_loop_bounding = false;
                        checks.int_div_checks = false;
                    }
                    // SAFETY: the two checks dropped guard against infinite loops and division
                    // by zero. Every loop of this crate's kernels is bounded by a constant, the
                    // workgroup size, or a size the host sets from a validated shape (a stride
                    // of at least one); every divisor is a constant or a validated nonzero
                    // dimension (head counts, widths, group sizes). Bounds checks are kept.
                    Arc::new(unsafe { device.create_shader_module_trusted(desc, checks) })
                })
                .clone()
        };
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&label),
            layout,
            module: &module,
            entry_point: Some(entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                zero_initialize_workgroup_memory: true,
            },
            cache: self.cache.as_ref(),
        });
        // Scopes pop in reverse order; either may hold the refusal.
        let internal = pollster::block_on(internal.pop());
        let validation = pollster::block_on(validation.pop());
        let result = match internal.or(validation) {
            None => Ok(Arc::new(pipeline)),
            Some(e) => {
                tracing::warn!(
                    "GPU pipeline {label} rejected, the CPU kernel will run instead: {e}"
                );
                self.modules.lock().remove(name);
                Err(e.to_string())
            }
        };
        self.map.lock().insert(key, result.clone());
        result.map_err(|message| GpuError::PipelineRejected {
            name: label,
            message,
        })
    }

    /// Writes the persistent cache (atomically: a temporary file, then a rename).
    pub(crate) fn save(&self) {
        let (Some(cache), Some(file)) = (&self.cache, &self.cache_file) else {
            return;
        };
        let Some(data) = cache.get_data() else {
            return;
        };
        let write = || -> std::io::Result<()> {
            if let Some(dir) = file.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = file.with_extension(format!("tmp-{}", std::process::id()));
            std::fs::write(&tmp, &data)?;
            std::fs::rename(&tmp, file)
        };
        if let Err(e) = write() {
            tracing::debug!("pipeline cache not saved to {}: {e}", file.display());
        }
    }
}
