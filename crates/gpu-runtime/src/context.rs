//! The wgpu context: backend choice, adapter choice, the device with its real limits and
//! features, the VRAM budget, and the one-line description a user pastes into a bug report.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::GpuError;
use crate::pipelines::Pipelines;

/// Which compute backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// The GPU if an adapter exists, else the CPU with a one-line notice.
    #[default]
    Auto,
    /// The GPU through wgpu; an error if there is none.
    Wgpu,
    /// The CPU kernels only.
    Cpu,
}

impl std::str::FromStr for BackendChoice {
    type Err = GpuError;

    fn from_str(s: &str) -> Result<Self, GpuError> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(BackendChoice::Auto),
            "wgpu" | "gpu" => Ok(BackendChoice::Wgpu),
            "cpu" => Ok(BackendChoice::Cpu),
            other => Err(GpuError::Setting {
                setting: "backend (--backend / CORTIQ_GPU)",
                message: format!("{other:?} is not one of auto, wgpu, cpu"),
            }),
        }
    }
}

/// How to open the GPU. Every field has a flag in the `cortiq` binary and an environment variable.
#[derive(Debug, Clone, Default)]
pub struct GpuOptions {
    /// `--backend` / `CORTIQ_GPU`: auto (default), wgpu, cpu.
    pub backend: BackendChoice,
    /// `CORTIQ_ADAPTER`: a case-insensitive substring of the adapter's name to pick it.
    pub adapter: Option<String>,
    /// `--vram` / `CORTIQ_VRAM` (e.g. `16G`, `512M`): bytes the weight arena may keep resident.
    /// Default: [`default_budget`] of the adapter.
    pub vram_budget: Option<u64>,
    /// `CORTIQ_PIPELINE_CACHE`: where the persistent pipeline cache lives (default
    /// `$XDG_CACHE_HOME/cortiq` or `~/.cache/cortiq`); `off` disables it.
    pub pipeline_cache_dir: Option<PathBuf>,
    /// `CORTIQ_SHADER_CHECKS=full`: compile kernels with every runtime check wgpu can add.
    /// Default (false): buffer and array bounds stay checked, but loops are not given an
    /// iteration counter and integer divisions no zero guard (the `pipelines` module says why).
    pub full_shader_checks: bool,
    /// `CORTIQ_MATMAT=plain`: long frames (32 rows and more) of f16 matrices and of q8_2f
    /// matrices on int8 activations run the 8-row kernel on tiles of 8 rows (every row's sums
    /// then equal a frame of 8's bit for bit) instead of the tiled matmat (`ops::tiled`;
    /// default `tiled`), and the routed experts of frames of 128 slots and more run the
    /// one-slot grouped kernels instead of expert by expert (`ops::experts_tiled`).
    pub plain_matmat: bool,
    /// `CORTIQ_MATMAT=tiled4x4`: the tiled matmats (f16, and q8_2f on int8 activations) run
    /// four token rows x four matrix rows a lane in 256 lanes (the kernels before the wide
    /// ones, for a same-build comparison) instead of eight x eight in 64 (default).
    pub narrow_tiles: bool,
    /// `CORTIQ_FUSED_OPS=off`: every step of a model forward that has a fused kernel (a GDN
    /// layer's prep, recurrence and norm of a decode step in `gdn_step`) runs its separate
    /// kernels instead (default `on`): to measure what a fusion gains, or to rule one out.
    pub split_ops: bool,
    /// `CORTIQ_CONCURRENT=off`: a model's independent dispatches write the shared work
    /// buffers, so wgpu orders each after the one before, as earlier builds did (default
    /// `on`: a short frame's independent dispatches write outputs of their own and run side
    /// by side; [`GpuContext::concurrent`]). The same kernels and sums either way.
    pub serial_dispatches: bool,
    /// `CORTIQ_PREFETCH=hc`: a short frame reads each hyper-connection site's matrices once
    /// beside the latency-bound dispatch before the site, so the site finds them in the
    /// device's L2 ([`GpuContext::prefetch_hc`]; default off).
    pub prefetch_hc: bool,
    /// `CORTIQ_HC_NORM=apart`: a hyper-connection site's norm runs as a dispatch of its own
    /// (default `folded`: into the site's front and read-out matvecs, one dispatch fewer a
    /// site, where a frame has up to 8 rows and the device binds nine storage buffers;
    /// [`GpuContext::fold_hc_norm`]). The same math; the sums' order differs.
    pub hc_norm_apart: bool,
    /// `CORTIQ_MATVEC_SPLIT=LANES[:CHUNKS]`: how far the rows of few-row matrices are split
    /// across lanes ([`crate::Plan::for_shape`]): until the matrix has `LANES` lanes in flight
    /// or a lane would walk fewer than `CHUNKS` 16-column chunks (default
    /// [`MatvecSplit::DEFAULT`]). A measurement knob: a plan changes a row's order of additions,
    /// and every frame of up to 8 rows and every decode step share the one plan of a matrix.
    pub matvec_split: Option<MatvecSplit>,
}

/// How far [`crate::Plan::for_shape`] splits a row across lanes ([`GpuOptions::matvec_split`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatvecSplit {
    /// Lanes in flight the split aims for.
    pub target_lanes: usize,
    /// Fewest 16-column chunks a lane walks.
    pub min_chunks: usize,
}

impl MatvecSplit {
    /// 65,536 lanes, four chunks a lane (measured on the H200, docs/perf.md, 2026-12-02).
    /// `131072:1` and `262144:1` take about 3% off a decoded qwen4_exp token on an H100 but
    /// add 4-9% to a 512-row prefill frame, whose split matrices are also tiled along z
    /// (2026-12-07); they also move one deepseek_v41 fixture prompt's logits past its test's
    /// bound against transformers on lavapipe (the mHC mixing matrix's sums in another order
    /// flip a fake-quantiser rounding: docs/perf.md).
    pub const DEFAULT: MatvecSplit = MatvecSplit {
        target_lanes: 65536,
        min_chunks: 4,
    };

    fn parse(v: &str) -> Option<MatvecSplit> {
        let (lanes, chunks) = v.split_once(':').unwrap_or((v, "4"));
        let s = MatvecSplit {
            target_lanes: lanes.trim().parse().ok()?,
            min_chunks: chunks.trim().parse().ok()?,
        };
        (s.target_lanes > 0 && s.min_chunks > 0).then_some(s)
    }
}

impl GpuOptions {
    /// Options from the environment (`CORTIQ_GPU`, `CORTIQ_ADAPTER`, `CORTIQ_VRAM`,
    /// `CORTIQ_PIPELINE_CACHE`, `CORTIQ_SHADER_CHECKS`, `CORTIQ_MATMAT`, `CORTIQ_FUSED_OPS`, `CORTIQ_MATVEC_SPLIT`,
    /// `CORTIQ_CONCURRENT`, `CORTIQ_PREFETCH`);
    /// unset variables keep
    /// the defaults.
    pub fn from_env() -> Result<GpuOptions, GpuError> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let mut o = GpuOptions::default();
        if let Some(b) = var("CORTIQ_GPU") {
            o.backend = b.parse()?;
        }
        o.adapter = var("CORTIQ_ADAPTER");
        if let Some(v) = var("CORTIQ_VRAM") {
            o.vram_budget = Some(parse_size(&v).ok_or_else(|| GpuError::Setting {
                setting: "CORTIQ_VRAM",
                message: format!("{v:?} is not a size like 16G, 512M or 1073741824"),
            })?);
        }
        o.pipeline_cache_dir = match var("CORTIQ_PIPELINE_CACHE") {
            Some(v) if v == "off" => None,
            Some(v) => Some(PathBuf::from(v)),
            None => default_cache_dir(),
        };
        o.full_shader_checks = match var("CORTIQ_SHADER_CHECKS").as_deref() {
            None | Some("trusted") => false,
            Some("full") => true,
            Some(other) => {
                return Err(GpuError::Setting {
                    setting: "CORTIQ_SHADER_CHECKS",
                    message: format!("{other:?} is not one of trusted, full"),
                });
            }
        };
        (o.plain_matmat, o.narrow_tiles) = match var("CORTIQ_MATMAT").as_deref() {
            None | Some("tiled") => (false, false),
            Some("tiled4x4") => (false, true),
            Some("plain") => (true, false),
            Some(other) => {
                return Err(GpuError::Setting {
                    setting: "CORTIQ_MATMAT",
                    message: format!("{other:?} is not one of tiled, tiled4x4, plain"),
                });
            }
        };
        if let Some(v) = var("CORTIQ_MATVEC_SPLIT") {
            o.matvec_split = Some(MatvecSplit::parse(&v).ok_or_else(|| GpuError::Setting {
                setting: "CORTIQ_MATVEC_SPLIT",
                message: format!("{v:?} is not LANES or LANES:CHUNKS (positive integers)"),
            })?);
        }
        // A two-way setting: `name` unset or `default` gives false, `other` true.
        let switch = |name: &'static str, default: &str, other: &str| match var(name) {
            None => Ok(false),
            Some(v) if v == default => Ok(false),
            Some(v) if v == other => Ok(true),
            Some(v) => Err(GpuError::Setting {
                setting: name,
                message: format!("{v:?} is not one of {default}, {other}"),
            }),
        };
        o.split_ops = switch("CORTIQ_FUSED_OPS", "on", "off")?;
        o.serial_dispatches = switch("CORTIQ_CONCURRENT", "on", "off")?;
        o.prefetch_hc = switch("CORTIQ_PREFETCH", "off", "hc")?;
        o.hc_norm_apart = switch("CORTIQ_HC_NORM", "folded", "apart")?;
        Ok(o)
    }
}

fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("cortiq"))
}

/// Parses `16G`, `512M`, `64K`, `1.5G`, `2T` or a plain byte count (binary units; a trailing
/// `B` or `iB` is allowed).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let s = s
        .strip_suffix("iB")
        .or_else(|| s.strip_suffix("ib"))
        .or_else(|| s.strip_suffix('B'))
        .or_else(|| s.strip_suffix('b'))
        .unwrap_or(s);
    let (num, mult) = match s.char_indices().last()? {
        (i, 'T' | 't') => (&s[..i], 1u64 << 40),
        (i, 'G' | 'g') => (&s[..i], 1u64 << 30),
        (i, 'M' | 'm') => (&s[..i], 1 << 20),
        (i, 'K' | 'k') => (&s[..i], 1 << 10),
        _ => (s, 1),
    };
    let v: f64 = num.trim().parse().ok()?;
    let bytes = v * mult as f64;
    (v.is_finite() && v >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

/// Device-local memory the adapter reports free, in bytes: on Vulkan the device-local heaps'
/// budget less their usage where `VK_EXT_memory_budget` reports them, else the largest
/// device-local heap; `None` on other backends (wgpu itself does not report memory sizes).
pub fn reported_free(adapter: &wgpu::Adapter) -> Option<u64> {
    #[cfg(any(target_os = "linux", target_os = "windows", target_os = "android"))]
    {
        use ash::vk;
        // SAFETY: the hal adapter is only read (its instance and physical device handles, for
        // two property queries) while `adapter` is alive; nothing is created or destroyed.
        let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
        let instance = hal.shared_instance().raw_instance();
        let pd = hal.raw_physical_device();
        // SAFETY: `pd` is a valid physical device of `instance`.
        let exts = unsafe { instance.enumerate_device_extension_properties(pd) }.ok()?;
        let has_budget = exts
            .iter()
            .any(|e| e.extension_name_as_c_str() == Ok(ash::ext::memory_budget::NAME));
        let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
        let mut props = vk::PhysicalDeviceMemoryProperties2::default();
        if has_budget {
            props = props.push_next(&mut budget);
        }
        // SAFETY: as above; the chained struct belongs to an extension the device supports.
        unsafe { instance.get_physical_device_memory_properties2(pd, &mut props) };
        let mp = props.memory_properties;
        let heaps = &mp.memory_heaps[..mp.memory_heap_count as usize];
        let local = |i: &usize| heaps[*i].flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL);
        let free = (0..heaps.len())
            .filter(local)
            .map(|i| {
                if has_budget {
                    budget.heap_budget[i].saturating_sub(budget.heap_usage[i])
                } else {
                    heaps[i].size
                }
            })
            .max()?;
        (free > 0).then_some(free)
    }
    #[cfg(not(any(target_os = "linux", target_os = "windows", target_os = "android")))]
    {
        let _ = adapter;
        None
    }
}

/// The VRAM budget used when none is given: what the adapter reports free
/// ([`reported_free`]) less a fifth (at least 2 GiB) for activations, caches and the driver,
/// for a hardware adapter; else by the adapter's type: 8 GiB for a discrete GPU (what a 12 GB
/// consumer card can spare next to activations and caches), 4 GiB integrated or virtual, 2 GiB
/// for a software adapter (whose "device memory" is the host's). Never more than the largest
/// buffer the device allows times 64 (the weights are many buffers).
pub fn default_budget_of(adapter: &wgpu::Adapter) -> u64 {
    let (info, limits) = (adapter.get_info(), adapter.limits());
    let hardware = !matches!(info.device_type, wgpu::DeviceType::Cpu);
    match reported_free(adapter).filter(|_| hardware) {
        Some(free) => {
            // The sequence states (KV caches of long contexts), scratch and the driver live
            // outside the weights' budget.
            let reserve = (free / 5).max(2 << 30);
            free.saturating_sub(reserve)
                .max(1 << 30)
                .min(limits.max_buffer_size.saturating_mul(64))
        }
        None => default_budget(&info, &limits),
    }
}

/// The VRAM budget by adapter type alone (see `default_budget_of`): 8 GiB for a discrete
/// GPU, 4 GiB integrated or virtual, 2 GiB for a software adapter; never more than the largest
/// buffer the device allows times 4. Set `--vram` to use a bigger card fully.
pub fn default_budget(info: &wgpu::AdapterInfo, limits: &wgpu::Limits) -> u64 {
    let by_type: u64 = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 8 << 30,
        wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::VirtualGpu => 4 << 30,
        _ => 2 << 30,
    };
    by_type.min(limits.max_buffer_size.saturating_mul(4))
}

/// What the device can do, as the kernels care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Subgroup operations are enabled.
    pub subgroups: bool,
    /// Smallest and largest subgroup size the adapter reports.
    pub subgroup_sizes: (u32, u32),
    /// Shader f16.
    pub shader_f16: bool,
    /// Timestamp queries (GPU timing in `bench`).
    pub timestamps: bool,
    /// A persistent pipeline cache.
    pub pipeline_cache: bool,
    /// Binding arrays of storage buffers.
    pub binding_arrays: bool,
    /// The f16 <-> f32 conversion builtins (`unpack2x16float`): the hardware f16 matvec.
    pub f16_in_f32: bool,
}

impl DeviceCaps {
    /// The capability set naga validates kernels against.
    pub fn shader_caps(&self) -> kernels_wgsl::Caps {
        kernels_wgsl::Caps {
            subgroups: self.subgroups,
            binding_arrays: self.binding_arrays,
            shader_f16: self.shader_f16,
            f16_in_f32: self.f16_in_f32,
        }
    }
}

/// The GPU: adapter, device, queue, and the state every op shares (pipelines, budget).
/// Passed explicitly to whatever needs it; there is no global.
pub struct GpuContext {
    /// The adapter.
    pub adapter: wgpu::Adapter,
    /// The device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// The adapter's description.
    pub info: wgpu::AdapterInfo,
    /// The limits the device was opened with (the adapter's own).
    pub limits: wgpu::Limits,
    /// Features the kernels use.
    pub caps: DeviceCaps,
    /// Bytes the weight arena may keep resident.
    pub vram_budget: u64,
    /// Long frames through the tiled matmat ([`GpuOptions::plain_matmat`]).
    pub tiled_matmat: bool,
    /// The tiled matmats eight x eight a lane ([`GpuOptions::narrow_tiles`]).
    pub wide_tiles: bool,
    /// Fused op kernels where a model has them ([`GpuOptions::split_ops`]).
    pub fused_ops: bool,
    /// Independent dispatches of a short frame side by side ([`GpuOptions::serial_dispatches`]).
    pub concurrent: bool,
    /// Hyper-connection matrices prefetched into L2 ([`GpuOptions::prefetch_hc`]).
    pub prefetch_hc: bool,
    /// A hyper-connection site's norm folded into its matvecs where they take it
    /// ([`GpuOptions::hc_norm_apart`], and the device binds nine storage buffers).
    pub fold_hc_norm: bool,
    /// How far few-row matrices' rows are split across lanes ([`GpuOptions::matvec_split`]).
    pub matvec_split: MatvecSplit,
    pub(crate) pipelines: Pipelines,
    pub(crate) matvec_layout: std::sync::OnceLock<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pub(crate) i8_layout: std::sync::OnceLock<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pub(crate) aux_layouts: std::sync::OnceLock<[(wgpu::BindGroupLayout, wgpu::PipelineLayout); 2]>,
    pub(crate) norm_layout: std::sync::OnceLock<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pub(crate) act_quant_layout: std::sync::OnceLock<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pub(crate) act_quant_grouped_layout:
        std::sync::OnceLock<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pub(crate) op_layout: std::sync::OnceLock<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pub(crate) grouped_layout: std::sync::OnceLock<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pub(crate) grouped_i8_layout:
        std::sync::OnceLock<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pub(crate) op_dummies: std::sync::OnceLock<Vec<wgpu::Buffer>>,
    pub(crate) grouped_tiled_layout:
        std::sync::OnceLock<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    /// The grouped kernels' layouts over segmented banks, by (int8 path, binding).
    pub(crate) segmented_layouts: Mutex<
        std::collections::HashMap<
            (bool, kernels_wgsl::Segments),
            (wgpu::BindGroupLayout, wgpu::PipelineLayout),
        >,
    >,
    /// The tiled matmat's layouts, indexed by (int8 path, auxiliary buffer, split)
    /// (`GpuContext::tiled_layout`).
    pub(crate) tiled_layouts:
        std::sync::OnceLock<Vec<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>>,
    /// The split tiled matmats' partial sums: one buffer, grown as needed, that every split
    /// dispatch of the device shares (each reduces its sums before the next writes).
    pub(crate) tiled_scratch: Mutex<Option<Arc<wgpu::Buffer>>>,
    /// Errors no scope caught (logged; the last few kept for `doctor`).
    pub uncaptured: Arc<Mutex<Vec<String>>>,
}

impl fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// The outcome of backend selection.
#[derive(Debug)]
pub enum Selected {
    /// A GPU is ready.
    Gpu(Box<GpuContext>),
    /// The CPU kernels will run, and why (for the one-line notice).
    Cpu(String),
}

/// Chooses the backend `opts` asks for: `cpu` never touches wgpu; `auto` falls back to the CPU
/// when no adapter exists; `wgpu` fails without one.
pub fn select(opts: &GpuOptions) -> Result<Selected, GpuError> {
    match opts.backend {
        BackendChoice::Cpu => Ok(Selected::Cpu("backend cpu was asked for".into())),
        BackendChoice::Wgpu => Ok(Selected::Gpu(Box::new(GpuContext::new(opts)?))),
        BackendChoice::Auto => match GpuContext::new(opts) {
            Ok(c) => Ok(Selected::Gpu(Box::new(c))),
            Err(e @ (GpuError::NoAdapter { .. } | GpuError::RequestDevice { .. })) => {
                Ok(Selected::Cpu(e.to_string()))
            }
            Err(e) => Err(e),
        },
    }
}

fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

impl GpuContext {
    /// Opens the preferred adapter: the one `opts.adapter` names, else a discrete GPU before an
    /// integrated, virtual or software one. The device gets the adapter's own limits.
    pub fn new(opts: &GpuOptions) -> Result<GpuContext, GpuError> {
        let desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        let backends = format!("{:?}", desc.backends);
        let instance = wgpu::Instance::new(desc);
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        if adapters.is_empty() {
            return Err(GpuError::NoAdapter { backends });
        }
        let names: Vec<String> = adapters
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({:?})", i.name, i.backend)
            })
            .collect();
        let mut candidates: Vec<(usize, wgpu::Adapter)> =
            adapters.into_iter().enumerate().collect();
        if let Some(want) = &opts.adapter {
            let w = want.to_lowercase();
            candidates.retain(|(i, _)| names[*i].to_lowercase().contains(&w));
            if candidates.is_empty() {
                return Err(GpuError::AdapterNotFound {
                    wanted: want.clone(),
                    available: names,
                });
            }
        }
        candidates.sort_by_key(|(i, a)| (rank(a.get_info().device_type), *i));
        let adapter = candidates.swap_remove(0).1;
        let info = adapter.get_info();
        let limits = adapter.limits();
        let have = adapter.features();
        let wanted = wgpu::Features::SUBGROUP
            | wgpu::Features::SHADER_F16
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::PIPELINE_CACHE
            // Only `bench kernels`' launch floor pushes immediates (its measured cost is a
            // bind group's: parameters stay in uniform buffers).
            | wgpu::Features::IMMEDIATES
            | wgpu::Features::BUFFER_BINDING_ARRAY
            | wgpu::Features::STORAGE_RESOURCE_BINDING_ARRAY
            // naga marks a binding array's index taken from a storage load non-uniform
            // (ShaderNonUniform in SPIR-V), though a grouped kernel's segment is the same for
            // its whole workgroup.
            | wgpu::Features::SAMPLED_TEXTURE_AND_STORAGE_BUFFER_ARRAY_NON_UNIFORM_INDEXING;
        let features = have & wanted;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("cortiq"),
            required_features: features,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| GpuError::RequestDevice {
            adapter: info.name.clone(),
            message: e.to_string(),
        })?;
        let uncaptured = Arc::new(Mutex::new(Vec::new()));
        let sink = uncaptured.clone();
        // wgpu's default handler panics; an engine with a CPU fallback logs instead.
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            tracing::error!("uncaptured GPU error: {e}");
            let mut v = sink.lock();
            if v.len() < 16 {
                v.push(e.to_string());
            }
        }));
        let caps = DeviceCaps {
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            subgroup_sizes: (info.subgroup_min_size, info.subgroup_max_size),
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            pipeline_cache: features.contains(wgpu::Features::PIPELINE_CACHE),
            binding_arrays: features.contains(
                wgpu::Features::STORAGE_RESOURCE_BINDING_ARRAY
                    | wgpu::Features::BUFFER_BINDING_ARRAY
                    | wgpu::Features::SAMPLED_TEXTURE_AND_STORAGE_BUFFER_ARRAY_NON_UNIFORM_INDEXING,
            ),
            f16_in_f32: adapter
                .get_downlevel_capabilities()
                .flags
                .contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32),
        };
        let vram_budget = opts
            .vram_budget
            .unwrap_or_else(|| default_budget_of(&adapter));
        let pipelines = Pipelines::new(
            &device,
            &info,
            caps.pipeline_cache,
            opts.pipeline_cache_dir.clone(),
            opts.full_shader_checks,
        );
        let fold_hc_norm = !opts.hc_norm_apart && limits.max_storage_buffers_per_shader_stage >= 9;
        let ctx = GpuContext {
            adapter,
            device,
            queue,
            info,
            limits,
            caps,
            vram_budget,
            tiled_matmat: !opts.plain_matmat,
            wide_tiles: !opts.narrow_tiles,
            fused_ops: !opts.split_ops,
            concurrent: !opts.serial_dispatches,
            prefetch_hc: opts.prefetch_hc,
            fold_hc_norm,
            matvec_split: opts.matvec_split.unwrap_or(MatvecSplit::DEFAULT),
            pipelines,
            matvec_layout: std::sync::OnceLock::new(),
            i8_layout: std::sync::OnceLock::new(),
            aux_layouts: std::sync::OnceLock::new(),
            norm_layout: std::sync::OnceLock::new(),
            act_quant_layout: std::sync::OnceLock::new(),
            act_quant_grouped_layout: std::sync::OnceLock::new(),
            op_layout: std::sync::OnceLock::new(),
            grouped_layout: std::sync::OnceLock::new(),
            grouped_i8_layout: std::sync::OnceLock::new(),
            op_dummies: std::sync::OnceLock::new(),
            grouped_tiled_layout: std::sync::OnceLock::new(),
            segmented_layouts: Mutex::new(Default::default()),
            tiled_layouts: std::sync::OnceLock::new(),
            tiled_scratch: Mutex::new(None),
            uncaptured,
        };
        tracing::info!("{}", ctx.describe());
        Ok(ctx)
    }

    /// The largest byte range one storage binding may cover (a multiple of 16).
    pub fn max_binding(&self) -> u64 {
        let m = self
            .limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size);
        m & !15
    }

    /// Runs `f` (buffer creation, copies, submissions) and returns the device's refusal of
    /// any of it (out of memory, a validation error) as an error, instead of leaving it to the
    /// uncaptured-error handler, which only logs.
    pub fn checked<T>(&self, what: &'static str, f: impl FnOnce() -> T) -> Result<T, GpuError> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        // Scopes pop in reverse order.
        let validation = pollster::block_on(validation.pop());
        let oom = pollster::block_on(oom.pop());
        match validation.or(oom) {
            Some(e) => Err(GpuError::Refused {
                what,
                message: e.to_string(),
            }),
            None => Ok(out),
        }
    }

    /// Whether the adapter is CPU-emulated (lavapipe, WARP, SwiftShader): every kernel runs,
    /// at CPU speed.
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// One line: adapter, backend, type, driver, subgroups, features, binding limit, budget.
    pub fn describe(&self) -> String {
        let i = &self.info;
        let c = &self.caps;
        let mut feats = Vec::new();
        if c.subgroups {
            feats.push(format!(
                "subgroups {}..{}",
                c.subgroup_sizes.0, c.subgroup_sizes.1
            ));
        }
        for (on, name) in [
            (c.shader_f16, "f16"),
            (c.timestamps, "timestamps"),
            (c.pipeline_cache, "pipeline-cache"),
            (c.binding_arrays, "binding-arrays"),
            (c.f16_in_f32, "f16-in-f32"),
        ] {
            if on {
                feats.push(name.to_string());
            }
        }
        format!(
            "{} ({:?}, {:?}, driver {} {}); {}; max binding {} MiB; VRAM budget {} MiB",
            i.name,
            i.backend,
            i.device_type,
            i.driver,
            i.driver_info,
            if feats.is_empty() {
                "no optional features".into()
            } else {
                feats.join(", ")
            },
            self.max_binding() >> 20,
            self.vram_budget >> 20
        )
    }

    /// A compute pipeline for `entry` of a WGSL module, built under error scopes and cached:
    /// a module the validator or the driver refuses is a [`GpuError::PipelineRejected`] (and
    /// stays one), never a panic.
    pub fn compute_pipeline(
        &self,
        name: &str,
        source: &dyn Fn() -> String,
        entry: &str,
        constants: &[(&str, f64)],
    ) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
        self.pipelines
            .get(&self.device, name, source, entry, constants, None)
    }

    /// Blocks until the GPU has finished all submitted work.
    pub fn wait(&self) {
        let _ = self.device.poll(wgpu::PollType::wait_indefinitely());
    }

    /// Writes the pipeline cache to disk (also done when the context is dropped).
    pub fn save_pipeline_cache(&self) {
        self.pipelines.save();
    }
}

impl Drop for GpuContext {
    fn drop(&mut self) {
        self.pipelines.save();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("16G"), Some(16 << 30));
        assert_eq!(parse_size("512M"), Some(512 << 20));
        assert_eq!(parse_size("1.5GiB"), Some(3 << 29));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("1T"), Some(1 << 40));
        assert_eq!(parse_size("1e30T"), None);
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("-1G"), None);
    }

    #[test]
    fn backend_names() {
        assert_eq!("CPU".parse::<BackendChoice>().unwrap(), BackendChoice::Cpu);
        assert_eq!(
            "wgpu".parse::<BackendChoice>().unwrap(),
            BackendChoice::Wgpu
        );
        assert!("cuda".parse::<BackendChoice>().is_err());
    }

    #[test]
    fn matvec_splits_parse() {
        let s = |lanes, chunks| {
            Some(MatvecSplit {
                target_lanes: lanes,
                min_chunks: chunks,
            })
        };
        assert_eq!(MatvecSplit::parse("262144:1"), s(262144, 1));
        assert_eq!(MatvecSplit::parse("131072"), s(131072, 4));
        assert_eq!(MatvecSplit::parse("0:1"), None);
        assert_eq!(MatvecSplit::parse("65536:0"), None);
        assert_eq!(MatvecSplit::parse("many"), None);
    }
}
