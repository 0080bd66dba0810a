//! One engine code path over every architecture: [`AnyModel`] binds the model a CMF header names
//! (`qwen4_exp` -> model-qwen4, `deepseek_v4` and `deepseek_v41` -> model-dsv4), on the CPU or,
//! where a
//! [`Placement`] asks and the device takes it, on the GPU; [`AnyState`] is its sequence
//! state; every command only talks to these. [`LoadedModel`] owns the file and the model bound
//! to it, so one loaded model can be shared across threads (`Arc<LoadedModel>`) by the
//! generation loop, a server's requests and a speculative drafter alike.

use std::path::Path;

use std::sync::Arc;

use cmf_format::{Cmf, CmfError};
use gpu_runtime::{BackendChoice, GpuOptions, Selected};
use model_core::CausalLm;

/// The context a device state holds when the command does not say (`--ctx`).
pub const DEFAULT_DEVICE_CTX: usize = 4096;

/// Where a model runs: the backend (`--backend` / `CORTIQ_GPU`), the VRAM budget (`--vram`),
/// and the context a device sequence state is allocated for.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    /// auto, wgpu or cpu.
    pub backend: BackendChoice,
    /// Bytes the weights may take on the device (default: by adapter type).
    pub vram: Option<u64>,
    /// Tokens a device state holds (default [`DEFAULT_DEVICE_CTX`]).
    pub ctx: Option<usize>,
    /// llama.cpp's static `--n-cpu-moe`: the routed experts of the first N layers on the CPU,
    /// the rest resident (default: as many experts as the budget holds, in every layer).
    pub cpu_moe: Option<usize>,
    /// How the resident experts change while running (default: learned).
    pub policy: Option<model_qwen4::CachePolicy>,
    /// Where the learned expert scores of this model are kept between runs (read at load
    /// when present; [`AnyModel::save_expert_scores`] writes them).
    pub expert_state: Option<std::path::PathBuf>,
}

impl Placement {
    /// The CPU, always.
    pub fn cpu() -> Placement {
        Placement {
            backend: BackendChoice::Cpu,
            ..Placement::default()
        }
    }
}

/// The machine's RAM in bytes (`MemTotal` of /proc/meminfo), where the OS says.
fn host_ram() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Expert scores saved by an earlier run ([`AnyModel::save_expert_scores`]), or `None` (no
/// file; an unreadable one is skipped with a warning: a cold start is still right).
fn load_expert_scores(path: &Path) -> Option<Vec<Vec<f32>>> {
    let bytes = std::fs::read(path).ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(v) => {
            tracing::info!("expert scores from {}", path.display());
            Some(v)
        }
        Err(e) => {
            tracing::warn!("{}: not expert scores ({e}); starting cold", path.display());
            None
        }
    }
}

/// Why a CMF could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// No model crate for this architecture.
    #[error(
        "unsupported architecture `{0}` (this engine runs qwen4_exp, deepseek_v4 and deepseek_v41)"
    )]
    Architecture(String),
    /// A qwen4_exp model whose config or tensors are unusable.
    #[error(transparent)]
    Qwen4(#[from] model_qwen4::WeightError),
    /// A deepseek_v4 model whose config or tensors are unusable.
    #[error(transparent)]
    Dsv4(#[from] model_dsv4::WeightError),
    /// A deepseek_v41 model whose config or tensors are unusable.
    #[error(transparent)]
    Dsv41(#[from] model_dsv4::v41::V41WeightError),
    /// The tokenizer in the header (which the Engram hashes need) does not load.
    #[error("the tokenizer in the CMF header does not load: {0}")]
    Tokenizer(String),
    /// `--backend wgpu` and no GPU to open.
    #[error("--backend wgpu: {0}")]
    Gpu(#[from] gpu_runtime::GpuError),
}

/// Why a forward refused its input.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// From model-qwen4.
    #[error(transparent)]
    Qwen4(#[from] model_qwen4::ForwardError),
    /// From model-dsv4.
    #[error(transparent)]
    Dsv4(#[from] model_dsv4::ForwardError),
    /// From model-dsv4's V4.1 forward.
    #[error(transparent)]
    Dsv41(#[from] model_dsv4::v41::ForwardError),
    /// A state made by one architecture handed to another.
    #[error("the sequence state belongs to a different architecture")]
    StateMismatch,
}

/// A bound model of any supported architecture.
pub enum AnyModel<'a> {
    /// Qwen3.8-Flash-Next.
    Qwen4(model_qwen4::Model<'a>),
    /// DeepSeek-V4-Flash.
    Dsv4(model_dsv4::Model<'a>),
    /// DeepSeek-V4.1-Flash.
    Dsv41(Box<model_dsv4::v41::Model<'a>>),
    /// Qwen3.8-Flash-Next, resident on the GPU.
    Qwen4Gpu(Box<model_qwen4::GpuModel<'a>>),
    /// DeepSeek-V4-Flash, resident on the GPU.
    Dsv4Gpu(Box<model_dsv4::GpuModel<'a>>),
    /// DeepSeek-V4.1-Flash, resident on the GPU.
    Dsv41Gpu(Box<model_dsv4::v41::gpu::GpuModel<'a>>),
}

/// The sequence state of an [`AnyModel`]; `Clone` is the snapshot.
#[derive(Debug, Clone)]
pub enum AnyState {
    /// For [`AnyModel::Qwen4`].
    Qwen4(model_qwen4::SeqState),
    /// For [`AnyModel::Dsv4`].
    Dsv4(model_dsv4::SeqState),
    /// For [`AnyModel::Dsv41`].
    Dsv41(Box<model_dsv4::v41::SeqState>),
    /// For [`AnyModel::Qwen4Gpu`]: the caches on the device.
    Qwen4Gpu(Box<model_qwen4::GpuState>),
    /// For [`AnyModel::Dsv4Gpu`]: the caches on the device.
    Dsv4Gpu(Box<model_dsv4::GpuState>),
    /// For [`AnyModel::Dsv41Gpu`]: the caches on the device (and the n-gram look-back).
    Dsv41Gpu(Box<model_dsv4::v41::gpu::GpuState>),
}

impl<'a> AnyModel<'a> {
    /// Binds the model the header's `architecture` names.
    pub fn bind(cmf: &'a Cmf) -> Result<AnyModel<'a>, BindError> {
        match cmf.header().architecture.as_str() {
            "qwen4_exp" => {
                let (c, w) = model_qwen4::Weights::bind(cmf)?;
                Ok(AnyModel::Qwen4(model_qwen4::Model::new(c, w)))
            }
            "deepseek_v4" => {
                let (c, w) = model_dsv4::Weights::bind(cmf)?;
                Ok(AnyModel::Dsv4(model_dsv4::Model::new(c, w)))
            }
            "deepseek_v41" => {
                let (c, w) = model_dsv4::v41::Weights::bind(cmf, engram_token_map(cmf)?)?;
                Ok(AnyModel::Dsv41(Box::new(model_dsv4::v41::Model::new(c, w))))
            }
            other => Err(BindError::Architecture(other.to_string())),
        }
    }

    /// Binds the model and places it as `place` asks: on the GPU when the backend is `wgpu`,
    /// or `auto` with a hardware adapter (a software rasteriser such as lavapipe is slower than
    /// the CPU kernels: `auto` passes it over, `wgpu` takes it), and the device takes the
    /// model; else on the CPU, saying why in one warning. A model the device refuses at load
    /// (the budget, a kernel the driver rejects) runs on the CPU with a warning; only
    /// `--backend wgpu` without any adapter is an error.
    pub fn bind_on(cmf: &'a Cmf, place: &Placement) -> Result<AnyModel<'a>, BindError> {
        let cpu = Self::bind(cmf)?;
        if place.backend == BackendChoice::Cpu {
            return Ok(cpu);
        }
        match cpu {
            AnyModel::Qwen4(model) => Self::place_qwen4(model, place),
            AnyModel::Dsv4(model) => Self::place_ds(
                model,
                place,
                |g| AnyModel::Dsv4Gpu(Box::new(g)),
                AnyModel::Dsv4,
            ),
            AnyModel::Dsv41(model) => Self::place_ds(
                *model,
                place,
                |g| AnyModel::Dsv41Gpu(Box::new(g)),
                |m| AnyModel::Dsv41(Box::new(m)),
            ),
            cpu => Ok(cpu),
        }
    }

    /// The device `place` asks for: `None` (with a warning saying why) where the model runs
    /// on the CPU instead; an error only for `--backend wgpu` without an adapter.
    fn device_for(place: &Placement) -> Result<Option<Box<gpu_runtime::GpuContext>>, BindError> {
        let mut opts = GpuOptions::from_env()?;
        opts.backend = place.backend;
        if place.vram.is_some() {
            opts.vram_budget = place.vram;
        }
        let ctx = match gpu_runtime::select(&opts) {
            Ok(Selected::Gpu(ctx)) => ctx,
            Ok(Selected::Cpu(why)) => {
                tracing::warn!("running on the CPU: {why}");
                return Ok(None);
            }
            Err(e) if place.backend == BackendChoice::Wgpu => return Err(e.into()),
            Err(e) => {
                tracing::warn!("running on the CPU: {e}");
                return Ok(None);
            }
        };
        if ctx.is_software() && place.backend == BackendChoice::Auto {
            tracing::warn!(
                "running on the CPU: the only adapter is a software one ({}; --backend wgpu uses it)",
                ctx.info.name
            );
            return Ok(None);
        }
        Ok(Some(ctx))
    }

    /// Places a bound deepseek_v4 model as `place` asks (see [`AnyModel::bind_on`]).
    pub fn place_dsv4(
        model: model_dsv4::Model<'a>,
        place: &Placement,
    ) -> Result<AnyModel<'a>, BindError> {
        Self::place_ds(
            model,
            place,
            |g| AnyModel::Dsv4Gpu(Box::new(g)),
            AnyModel::Dsv4,
        )
    }

    /// Places a bound deepseek_v4 or deepseek_v41 model as `place` asks: the non-expert
    /// weights resident, the routed experts in the global bank as the budget (or
    /// `--n-cpu-moe`) allows, the rest computed on the CPU; on the CPU where the device is not
    /// used or refuses the model (with a warning).
    fn place_ds<M: model_dsv4::gpu::Variant<'a>>(
        model: M,
        place: &Placement,
        gpu: impl FnOnce(model_dsv4::GpuModel<'a, M, M::Blocks>) -> AnyModel<'a>,
        cpu: impl FnOnce(M) -> AnyModel<'a>,
    ) -> Result<AnyModel<'a>, BindError> {
        if place.backend == BackendChoice::Cpu {
            return Ok(cpu(model));
        }
        let Some(ctx) = Self::device_for(place)? else {
            return Ok(cpu(model));
        };
        let ctx_len = place.ctx.unwrap_or(DEFAULT_DEVICE_CTX).max(1);
        // `--n-cpu-moe N`: the first N layers' experts on the CPU, the rest resident (the
        // static split llama.cpp offers); else as many per layer as the budget holds.
        let residency = match place.cpu_moe {
            Some(n) => {
                let sh = model.shape();
                let (nl, ne) = (sh.layers, sh.experts);
                model_dsv4::Residency::PerLayer(
                    (0..nl).map(|l| if l < n { 0 } else { ne }).collect(),
                )
            }
            None => model_dsv4::Residency::Budget,
        };
        let experts = model_dsv4::ExpertPlacement {
            residency,
            segment_slots: None,
            policy: place.policy.unwrap_or_default(),
            warm: place.expert_state.as_deref().and_then(load_expert_scores),
        };
        match model_dsv4::GpuModel::with_experts(model, Arc::from(ctx), ctx_len, &experts) {
            Ok(g) => {
                let (hot, all) = g.resident_experts();
                tracing::info!(
                    "on the GPU: {} MiB of weights resident ({hot} of {all} routed experts; the rest on the CPU), context {ctx_len}",
                    g.resident_bytes() >> 20
                );
                Ok(gpu(g))
            }
            Err(u) => {
                tracing::warn!(
                    "running on the CPU: the GPU did not take the model: {}",
                    u.error
                );
                Ok(cpu(u.model))
            }
        }
    }

    /// Places a bound qwen4_exp model as `place` asks (see [`AnyModel::bind_on`]).
    pub fn place_qwen4(
        model: model_qwen4::Model<'a>,
        place: &Placement,
    ) -> Result<AnyModel<'a>, BindError> {
        if place.backend == BackendChoice::Cpu {
            return Ok(AnyModel::Qwen4(model));
        }
        let Some(ctx) = Self::device_for(place)? else {
            return Ok(AnyModel::Qwen4(model));
        };
        let ctx_len = place.ctx.unwrap_or(DEFAULT_DEVICE_CTX).max(1);
        let residency = match place.cpu_moe {
            Some(n) => {
                let (nl, ne) = (model.config.num_hidden_layers, model.config.num_experts);
                model_qwen4::Residency::PerLayer(
                    (0..nl).map(|l| if l < n { 0 } else { ne }).collect(),
                )
            }
            None => model_qwen4::Residency::Budget,
        };
        let warm = place.expert_state.as_deref().and_then(load_expert_scores);
        let offload = model_qwen4::Offload {
            residency,
            policy: place.policy.unwrap_or_default(),
            warm,
            ..model_qwen4::Offload::default()
        };
        match model_qwen4::GpuModel::with_offload(model, Arc::from(ctx), ctx_len, true, offload) {
            Ok(g) => {
                let (hot, all) = g.resident_experts();
                tracing::info!(
                    "on the GPU: {} MiB of weights resident ({hot} of {all} routed experts), context {ctx_len}",
                    g.resident_bytes() >> 20
                );
                Ok(AnyModel::Qwen4Gpu(Box::new(g)))
            }
            Err(u) => {
                tracing::warn!(
                    "running on the CPU: the GPU did not take the model: {}",
                    u.error
                );
                Ok(AnyModel::Qwen4(u.model))
            }
        }
    }

    /// Feeds `tokens` and returns the greedy next token: chosen on the device for a GPU model
    /// (only its id is read back), from the last logits row otherwise.
    pub fn greedy(&self, tokens: &[u32], st: &mut AnyState) -> Result<u32, ForwardError> {
        if let (AnyModel::Qwen4Gpu(m), AnyState::Qwen4Gpu(s)) = (self, &mut *st) {
            return Ok(m.forward_greedy(tokens, s)?);
        }
        let l = self.forward_last(tokens, st)?;
        Ok(l.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32)
    }

    /// Empties `st` for reuse (a device state keeps its buffers and recorded frames).
    pub fn reset(&self, st: &mut AnyState) {
        match (self, &mut *st) {
            (AnyModel::Qwen4Gpu(m), AnyState::Qwen4Gpu(s)) => m.reset(s),
            _ => *st = self.new_state(),
        }
    }

    /// Weight bytes one decoded token reads (qwen4_exp; `None` for other architectures).
    pub fn bytes_per_token(&self) -> Option<u64> {
        let m = match self {
            AnyModel::Qwen4(m) => m,
            AnyModel::Qwen4Gpu(g) => &g.model,
            AnyModel::Dsv4(m) => {
                return Some(m.weights.bytes_per_token(m.config.num_experts_per_tok));
            }
            AnyModel::Dsv4Gpu(g) => {
                let m = &g.model;
                return Some(m.weights.bytes_per_token(m.config.num_experts_per_tok));
            }
            AnyModel::Dsv41(_) | AnyModel::Dsv41Gpu(_) => return None,
        };
        Some(m.weights.bytes_per_token(m.config.num_experts_per_tok))
    }

    /// The adapter a GPU model runs on.
    pub fn device(&self) -> String {
        match self {
            AnyModel::Qwen4Gpu(g) => g.ctx().info.name.clone(),
            AnyModel::Dsv4Gpu(g) => g.ctx().info.name.clone(),
            AnyModel::Dsv41Gpu(g) => g.ctx().info.name.clone(),
            _ => format!("CPU ({} threads)", rayon::current_num_threads()),
        }
    }

    /// The share of routed (token, expert) pairs computed in VRAM so far, when some experts
    /// are computed on the CPU (`None` when all are resident, or on the CPU alone).
    pub fn expert_share(&self) -> Option<f64> {
        match self {
            AnyModel::Qwen4Gpu(g) => g.expert_share(),
            AnyModel::Dsv4Gpu(g) => {
                let (resident, all) = g.resident_experts();
                let s = g.cold_stats();
                (resident < all).then(|| 1.0 - s.cold as f64 / s.routed.max(1) as f64)
            }
            AnyModel::Dsv41Gpu(g) => {
                let (resident, all) = g.resident_experts();
                let s = g.cold_stats();
                (resident < all).then(|| 1.0 - s.cold as f64 / s.routed.max(1) as f64)
            }
            _ => None,
        }
    }

    /// Writes the learned expert scores of a model running with experts on the CPU to `path`
    /// (JSON: one array of scores per layer), for the next run to start warm; nothing for a
    /// model without cold experts. Written to a temporary file and renamed, so a reader
    /// never sees half of it.
    pub fn save_expert_scores(&self, path: &Path) -> std::io::Result<bool> {
        if self.expert_share().is_none() {
            return Ok(false);
        }
        let scores = match self {
            AnyModel::Qwen4Gpu(g) => g.expert_scores(),
            AnyModel::Dsv4Gpu(g) => g.expert_scores(),
            AnyModel::Dsv41Gpu(g) => g.expert_scores(),
            _ => return Ok(false),
        };
        if scores.iter().all(Vec::is_empty) {
            return Ok(false);
        }
        let json = serde_json::to_vec(&scores)?;
        let tmp = path.with_extension("experts.tmp");
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, path)?;
        Ok(true)
    }

    /// `gpu` or `cpu`: where the forward runs.
    pub fn backend_name(&self) -> &'static str {
        match self {
            AnyModel::Qwen4Gpu(_) | AnyModel::Dsv4Gpu(_) | AnyModel::Dsv41Gpu(_) => "gpu",
            _ => "cpu",
        }
    }

    /// Vocabulary size (width of a logits row).
    pub fn vocab_size(&self) -> usize {
        match self {
            AnyModel::Qwen4(m) => m.config.vocab_size,
            AnyModel::Dsv4(m) => m.config.vocab_size,
            AnyModel::Dsv41(m) => m.config.vocab_size,
            AnyModel::Qwen4Gpu(m) => m.model.config.vocab_size,
            AnyModel::Dsv4Gpu(m) => m.model.config.vocab_size,
            AnyModel::Dsv41Gpu(m) => m.model.config.vocab_size,
        }
    }

    /// An empty sequence for this model.
    pub fn new_state(&self) -> AnyState {
        match self {
            AnyModel::Qwen4(m) => AnyState::Qwen4(model_qwen4::SeqState::new(&m.config)),
            AnyModel::Dsv4(m) => AnyState::Dsv4(model_dsv4::SeqState::new(&m.config)),
            AnyModel::Dsv41(m) => AnyState::Dsv41(Box::new(m.new_state())),
            AnyModel::Qwen4Gpu(m) => AnyState::Qwen4Gpu(Box::new(m.new_state())),
            AnyModel::Dsv4Gpu(m) => AnyState::Dsv4Gpu(Box::new(m.new_state())),
            AnyModel::Dsv41Gpu(m) => AnyState::Dsv41Gpu(Box::new(m.new_state())),
        }
    }

    /// Feeds `tokens` after whatever `st` holds; returns their logits `[T, vocab]`.
    pub fn forward(&self, tokens: &[u32], st: &mut AnyState) -> Result<Vec<f32>, ForwardError> {
        match (self, st) {
            (AnyModel::Qwen4(m), AnyState::Qwen4(s)) => Ok(m.forward(tokens, s)?),
            (AnyModel::Dsv4(m), AnyState::Dsv4(s)) => Ok(m.forward(tokens, s)?),
            (AnyModel::Dsv41(m), AnyState::Dsv41(s)) => Ok(m.forward(tokens, s)?),
            (AnyModel::Qwen4Gpu(m), AnyState::Qwen4Gpu(s)) => Ok(m.forward(tokens, s)?),
            (AnyModel::Dsv4Gpu(m), AnyState::Dsv4Gpu(s)) => Ok(m.forward(tokens, s)?),
            (AnyModel::Dsv41Gpu(m), AnyState::Dsv41Gpu(s)) => Ok(m.forward(tokens, s)?),
            _ => Err(ForwardError::StateMismatch),
        }
    }

    /// Feeds `tokens` after whatever `st` holds; returns the logits `[vocab]` of the last one
    /// (what sampling needs: the lm_head rows nobody reads are skipped).
    pub fn forward_last(
        &self,
        tokens: &[u32],
        st: &mut AnyState,
    ) -> Result<Vec<f32>, ForwardError> {
        match (self, st) {
            (AnyModel::Qwen4(m), AnyState::Qwen4(s)) => Ok(m.forward_last(tokens, s)?),
            (AnyModel::Dsv4(m), AnyState::Dsv4(s)) => Ok(m.forward_last(tokens, s)?),
            (AnyModel::Dsv41(m), AnyState::Dsv41(s)) => Ok(m.forward_last(tokens, s)?),
            (AnyModel::Qwen4Gpu(m), AnyState::Qwen4Gpu(s)) => Ok(m.forward_last(tokens, s)?),
            (AnyModel::Dsv4Gpu(m), AnyState::Dsv4Gpu(s)) => Ok(m.forward_last(tokens, s)?),
            (AnyModel::Dsv41Gpu(m), AnyState::Dsv41Gpu(s)) => Ok(m.forward_last(tokens, s)?),
            _ => Err(ForwardError::StateMismatch),
        }
    }

    /// Feeds several sequences at once (each its own tokens after whatever its state holds) and
    /// returns each one's last logits row. A CPU qwen4_exp model runs them as one batched step
    /// (every weight read once for all their rows); on the device, the sequences fed one token
    /// (decoding) share batched frames of up to 8 rows and the longer ones (prompts) run their
    /// own frames; other models feed them one after another.
    pub fn forward_batch(
        &self,
        seqs: &mut [(&[u32], &mut AnyState)],
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        if let AnyModel::Qwen4Gpu(m) = self {
            let mut out = vec![Vec::new(); seqs.len()];
            let mut rows = Vec::new();
            let mut at = Vec::new();
            for (i, (tokens, st)) in seqs.iter_mut().enumerate() {
                let AnyState::Qwen4Gpu(s) = &mut **st else {
                    return Err(ForwardError::StateMismatch);
                };
                match tokens {
                    [tok] => {
                        rows.push((*tok, &mut **s));
                        at.push(i);
                    }
                    _ => out[i] = m.forward_last(tokens, s)?,
                }
            }
            for (i, logits) in at.into_iter().zip(m.forward_rows(&mut rows)?) {
                out[i] = logits;
            }
            return Ok(out);
        }
        if let AnyModel::Qwen4(m) = self {
            let mut inner = Vec::with_capacity(seqs.len());
            for (tokens, st) in seqs.iter_mut() {
                match &mut **st {
                    AnyState::Qwen4(s) => inner.push((*tokens, s)),
                    _ => return Err(ForwardError::StateMismatch),
                }
            }
            return Ok(m.forward_batch(&mut inner)?);
        }
        seqs.iter_mut()
            .map(|(tokens, st)| self.forward_last(tokens, st))
            .collect()
    }

    /// A snapshot of `st` to restore later (a device state's is checked: a device out of
    /// memory is an error, not a broken snapshot).
    pub fn snapshot(&self, st: &AnyState) -> Result<AnyState, ForwardError> {
        match st {
            AnyState::Qwen4Gpu(s) => Ok(AnyState::Qwen4Gpu(Box::new(s.try_clone()?))),
            AnyState::Dsv4Gpu(s) => Ok(AnyState::Dsv4Gpu(Box::new(s.try_clone()?))),
            AnyState::Dsv41Gpu(s) => Ok(AnyState::Dsv41Gpu(Box::new(s.try_clone()?))),
            st => Ok(st.clone()),
        }
    }

    /// Makes `st` a copy of `snap` (a device state keeps its own buffers and recorded frames,
    /// the snapshot's contents copied into them).
    pub fn restore(&self, st: &mut AnyState, snap: &AnyState) -> Result<(), ForwardError> {
        match (&mut *st, snap) {
            (AnyState::Qwen4Gpu(s), AnyState::Qwen4Gpu(snap)) => Ok(s.restore(snap)?),
            (AnyState::Dsv4Gpu(s), AnyState::Dsv4Gpu(snap)) => Ok(s.restore(snap)?),
            (AnyState::Dsv41Gpu(s), AnyState::Dsv41Gpu(snap)) => Ok(s.restore(snap)?),
            (AnyState::Qwen4Gpu(_) | AnyState::Dsv4Gpu(_) | AnyState::Dsv41Gpu(_), _) => {
                Err(ForwardError::StateMismatch)
            }
            _ => {
                *st = snap.clone();
                Ok(())
            }
        }
    }

    /// Logits `[T, vocab]` of every position of `tokens`, from an empty sequence.
    pub fn forward_prefill(&self, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        self.forward(tokens, &mut self.new_state())
    }
}

impl AnyState {
    /// Tokens the sequence holds.
    pub fn pos(&self) -> usize {
        match self {
            AnyState::Qwen4(s) => s.pos,
            AnyState::Dsv4(s) => s.pos,
            AnyState::Dsv41(s) => s.pos,
            AnyState::Qwen4Gpu(s) => s.pos,
            AnyState::Dsv4Gpu(s) => s.pos,
            AnyState::Dsv41Gpu(s) => s.pos,
        }
    }

    /// Memory its caches take (host or device): what keeping a snapshot of it costs.
    pub fn bytes(&self) -> u64 {
        match self {
            AnyState::Qwen4(s) => s.bytes() as u64,
            AnyState::Dsv4(s) => s.bytes() as u64,
            AnyState::Dsv41(s) => s.bytes() as u64,
            AnyState::Qwen4Gpu(s) => s.bytes(),
            AnyState::Dsv4Gpu(s) => s.bytes(),
            AnyState::Dsv41Gpu(s) => s.bytes(),
        }
    }
}

/// The compressed token map of the tokenizer in `cmf`'s header, which a deepseek_v41 model's
/// Engram hashes need (derived as the reference's `build_compressed_token_map` does: each id's
/// decoded text and raw token); `None` without an embedded tokenizer.
fn engram_token_map(
    cmf: &Cmf,
) -> Result<Option<model_dsv4::engram::CompressedTokenMap>, BindError> {
    let Some(json) = &cmf.header().tokenizer else {
        return Ok(None);
    };
    let tok: tokenizers::Tokenizer = json
        .to_string()
        .parse()
        .map_err(|e| BindError::Tokenizer(format!("{e}")))?;
    let n = tok.get_vocab_size(true) as u32;
    let strings = (0..n)
        .map(|id| {
            let text = tok
                .decode(&[id], false)
                .map_err(|e| BindError::Tokenizer(format!("token {id} does not decode: {e}")))?;
            Ok((text, tok.id_to_token(id)))
        })
        .collect::<Result<Vec<_>, BindError>>()?;
    Ok(Some(
        model_dsv4::engram::CompressedTokenMap::from_token_strings(strings),
    ))
}

self_cell::self_cell!(
    /// The file and the model borrowing its mapped bytes, kept together.
    struct Bound {
        owner: Cmf,
        #[covariant]
        dependent: AnyModel,
    }
);

/// Why a model file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file does not open or validate.
    #[error(transparent)]
    Open(#[from] CmfError),
    /// Not a model this engine runs, or its config or tensors are unusable.
    #[error("{file}: {source}")]
    Bind {
        /// The model file.
        file: String,
        /// What is wrong.
        source: BindError,
    },
}

impl LoadError {
    /// `source` from binding the model in `cmf`.
    pub fn bind(cmf: &Cmf, source: BindError) -> LoadError {
        LoadError::Bind {
            file: cmf.display_path().display().to_string(),
            source,
        }
    }
}

/// A CMF file and its bound model, owned together: `Send + Sync`, so an `Arc<LoadedModel>` is
/// shared across threads (the mapped weights are read-only; each sequence has its own
/// [`AnyState`]).
pub struct LoadedModel {
    bound: Bound,
    integrity: crate::integrity::Integrity,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("cmf", self.cmf())
            .finish()
    }
}

impl LoadedModel {
    /// Binds the model in `cmf` on the CPU, taking ownership of the file.
    pub fn new(cmf: Cmf) -> Result<LoadedModel, LoadError> {
        Self::new_on(cmf, &Placement::cpu())
    }

    /// Binds the model in `cmf` where `place` asks ([`AnyModel::bind_on`]).
    pub fn new_on(cmf: Cmf, place: &Placement) -> Result<LoadedModel, LoadError> {
        if let Some(ram) = host_ram()
            && cmf.file_len() > ram
        {
            tracing::warn!(
                "the model file ({:.1} GB) is larger than this machine's RAM ({:.1} GB): the \
                 weights the CPU reads (cold experts, or all of them) are paged in from disk \
                 as they are used, which is slow",
                cmf.file_len() as f64 / 1e9,
                ram as f64 / 1e9
            );
        }
        Ok(LoadedModel {
            bound: Bound::try_new(cmf, |c| {
                AnyModel::bind_on(c, place).map_err(|e| LoadError::bind(c, e))
            })?,
            integrity: Default::default(),
        })
    }

    /// Opens (memory-maps) and binds the CMF at `path` on the CPU.
    pub fn open(path: &Path) -> Result<LoadedModel, LoadError> {
        Self::new(Cmf::open(path)?)
    }

    /// Opens and binds the CMF at `path` where `place` asks.
    pub fn open_on(path: &Path, place: &Placement) -> Result<LoadedModel, LoadError> {
        Self::new_on(Cmf::open(path)?, place)
    }

    /// The file.
    pub fn cmf(&self) -> &Cmf {
        self.bound.borrow_owner()
    }

    /// The bound model.
    pub fn model(&self) -> &AnyModel<'_> {
        self.bound.borrow_dependent()
    }

    /// The tensor checksum check of this model ([`crate::integrity`]).
    pub fn integrity(&self) -> &crate::integrity::Integrity {
        &self.integrity
    }
}
