//! Everything a quantization run is told, with the original scripts' defaults.

use crate::budget::Statistics;
use crate::error::PlanError;
use crate::plan::{PlanOptions, QuantPlan, Recipe, Treatment};
use sala_hessian::{
    ClipSearch, Damping, FailurePolicy, Gptq, GptqConfig, IntGrid, IntScheme, Nvfp4BlockSearch,
    Nvfp4Gptq,
};
use sala_model::{AttentionMode, Numerics, RunOptions};
use sala_smooth::AlphaGrid;

/// The pipeline's GPTQ damping, `λ / mean(diag H)`: GPTQModel's `damp_percent`. On
/// SmolLM2-135M (three calibration subsets) it lowered the KL on The Devil's Dictionary by 5 %
/// at group 128 against IST's 0.01 (`sala-hessian`'s [`Damping`] default) and was within the
/// noise at group 64 (docs/quality.md).
pub const DEFAULT_DAMP_PERCENT: f64 = 0.05;

/// GPTQ solver options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptqOptions {
    /// Grid: [`IntScheme::SymmetricIst`] (`2·absmax/15`, AutoGPTQ; default),
    /// [`IntScheme::SymmetricAbsMax`] (`absmax/7`, the original SALA script) or asymmetric.
    pub scheme: IntScheme,
    /// Relative damping `λ = damp · mean(diag H)` (default [`DEFAULT_DAMP_PERCENT`], 0.05)
    /// and its retries.
    pub damping: Damping,
    /// Columns per lazy block (default 128).
    pub block_size: usize,
    /// Act-order (desc_act). Marlin serves it, at a cost; default off.
    pub act_order: bool,
    /// Static groups (monotone `g_idx` under act-order).
    pub static_groups: bool,
    /// Group-aware reordering (GAR, GPTQModel's `act_group_aware`, also its default): groups
    /// solved by decreasing importance, natural `g_idx` in the checkpoint, no cost. Default on
    /// (measured on SmolLM2-135M and the trained fixture: docs/quality.md); act-order, when
    /// asked for, replaces it.
    pub group_aware_order: bool,
    /// Quantize with RTN when even the last damping retry cannot factor the Hessian.
    pub rtn_fallback: bool,
    /// Skip the solver: plain round-to-nearest on the same grid (the baseline); default off.
    pub rtn: bool,
    /// A clipping search for each group's range, errors weighted by `diag(H)` (GPTQModel's
    /// `mse`); default [`ClipSearch::DEFAULT`] (norm 2), `None` for the plain min/max range.
    /// A device solver runs it on the device.
    pub clip: Option<ClipSearch>,
}

impl Default for GptqOptions {
    fn default() -> Self {
        Self {
            scheme: IntScheme::SymmetricIst,
            damping: Damping {
                percdamp: DEFAULT_DAMP_PERCENT,
                ..Damping::default()
            },
            block_size: 128,
            act_order: false,
            static_groups: false,
            group_aware_order: true,
            rtn_fallback: false,
            rtn: false,
            clip: Some(ClipSearch::DEFAULT),
        }
    }
}

impl GptqOptions {
    /// The solver's options for a linear of `bits` and `group_size`. Act-order takes precedence
    /// over the group-aware order (both are column orders; the latter is the default).
    pub fn solver_config(&self, bits: u32, group_size: usize) -> GptqConfig {
        GptqConfig {
            grid: IntGrid {
                bits,
                scheme: self.scheme,
                group_size: Some(group_size),
                clip: self.clip,
            },
            block_size: self.block_size,
            act_order: self.act_order,
            static_groups: self.static_groups,
            group_aware_order: self.group_aware_order && !self.act_order,
            damping: self.damping,
            on_failure: self.failure_policy(),
            proxy_error: true,
        }
    }

    /// The failure policy this asks of the solver.
    pub fn failure_policy(&self) -> FailurePolicy {
        if self.rtn_fallback {
            FailurePolicy::Rtn
        } else {
            FailurePolicy::Error
        }
    }
}

/// Rows per MLP chunk on the GPU path ([`RunOptions::mlp_rows`]): a pack of up to this many
/// rows runs its MLP at once, as before; a longer sample's `[tokens, 3 × 16384]` bf16
/// intermediates (12.9 GB at 131,072 tokens on the full-size model) stay at 1.6 GB.
pub const DEFAULT_MLP_ROWS: usize = 16_384;

/// Default tokens per pack ([`QuantizeOptions::pack_tokens`]): enough rows for the GEMMs to
/// fill a large GPU, small enough that a pack's activations (`tokens × intermediate` bf16
/// values, 0.5 GB at 16384 × 16384) stay a fraction of its memory.
pub const DEFAULT_PACK_TOKENS: usize = 16_384;

/// How SmoothQuant's migration strength α is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Smoothing {
    /// One α in `[0, 1]` for every group (`--smooth-alpha 0.5`).
    Fixed(f32),
    /// AWQ's grid search per group on the quantized group's channel-weighted output error
    /// ([`sala_smooth::search_alpha`]; `--smooth-alpha search`).
    Searched(AlphaGrid),
}

/// How the NVFP4 recipe quantizes a linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Nvfp4Solver {
    /// Each block's E4M3 scale searched on the weights, weighted by `diag(H)`, then round to
    /// nearest (the original scripts' recipe).
    BlockSearch,
    /// GPTQ on the NVFP4 grid: the same search at each block as the column loop reaches it,
    /// and the rounding errors spread over the later columns with the full Hessian
    /// ([`Nvfp4Gptq`]; damping, lazy block size and the RTN fallback from [`GptqOptions`]).
    Gptq,
    /// GPTQ on the FP4 grid for every input group narrower than its layer's widest, the block
    /// search for the widest (the MLP's down projection in a transformer layer). The widest
    /// group's Hessian is most of the Hessian work (16384² of the 9B model's 3 × 4096² +
    /// 16384²: 84%), and most of GPTQ's gain over the search comes from the other linears
    /// (docs/quality.md). The default.
    #[default]
    Hybrid,
}

/// All options of a run.
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    /// Which linears get which treatment.
    pub plan: PlanOptions,
    /// GPTQ solver options (GPTQ recipe).
    pub gptq: GptqOptions,
    /// Block-scale search (NVFP4 recipe): iterations, maximum shrink, error norm.
    pub nvfp4_search: Nvfp4BlockSearch,
    /// The NVFP4 recipe's solver: GPTQ on the FP4 grid below each layer's widest input and the
    /// block search on the widest (default), the block search alone, or GPTQ everywhere.
    pub nvfp4_solver: Nvfp4Solver,
    /// SmoothQuant and how its migration strength α is chosen; `None` turns smoothing off.
    /// Default: a fixed α = 0.5 for NVFP4 (the original scripts'); off for GPTQ, which
    /// measured better unsmoothed on both SmolLM2-135M and the trained tiny SALA
    /// (docs/quality.md).
    pub smoothing: Option<Smoothing>,
    /// How the model runs (numerics, dense mode for minicpm4 layers).
    pub run: RunOptions,
    /// Bytes of host memory the hidden states of all samples may take; beyond it they go to a
    /// memory-mapped file in the output's parent directory. `None`: no limit.
    pub max_host_memory: Option<u64>,
    /// Bytes of device memory the hidden states of all samples may take (in the runner's
    /// storage dtype: 2 bytes per value under bf16 storage). When they fit they stay on the
    /// device between layers (no host round trip); otherwise they go to the host (or disk, per
    /// `max_host_memory`). `None` (the default, and what the CPU path uses): never on the device.
    pub max_device_memory: Option<u64>,
    /// Accumulate the Hessians (GPTQ) or channel statistics (NVFP4) on the device with the
    /// backend's matmul in f32 (the activations are bf16 values, so every product is exact),
    /// instead of downloading each linear input and accumulating in f64 on the host (the
    /// default). Non-finite activations are then found once per layer (naming the input, not
    /// the sample) and `skip_failed_samples` cannot skip them.
    pub device_statistics: bool,
    /// Tokens per pack: samples of similar length run through each layer together, back to
    /// back in one buffer (attention, RoPE and the GLA restart at each sample), until a pack
    /// holds at least this many tokens; a longer sample is a pack of its own. `0` or `1`: one
    /// sample per pass. Default [`DEFAULT_PACK_TOKENS`].
    pub pack_tokens: usize,
    /// Count and skip a sample whose forward pass fails instead of stopping (reported).
    pub skip_failed_samples: bool,
    /// Also quantize every linear with RTN to report its error next to the solver's.
    pub compare_rtn: bool,
    /// True-sequential quantization inside each layer (GPTQModel's `true_sequential`): the
    /// inputs of each linear are captured from the layer whose earlier linears are already
    /// quantized (attention inputs, then `o_proj`'s, then gate/up's, then down's), at the cost
    /// of one more forward pass of the layer per input group. Smoothing still reads the
    /// original layer's activations. Default off.
    pub true_sequential: bool,
    /// Read the next decoder layer's weights from the checkpoint on a thread of its own while
    /// the current layer is quantized, so that the device does not wait for the host to read
    /// and decode them (0.3–0.4 s per layer of the full-size model on an H100 machine's host).
    /// Costs one more layer's weights in host memory (f32: 1.1 GB per layer of the full-size
    /// model). Default on; it changes no result.
    pub prefetch_weights: bool,
    /// Replace an existing output directory, only once the new one is complete and verified,
    /// and only if it is a quantized checkpoint or empty (see `sala_export::StagedDir`).
    pub overwrite: bool,
    /// Maximum bytes per safetensors shard.
    pub max_shard_bytes: u64,
    /// Resumable run: keep in the staging directory what every completed layer produced (its
    /// tensors, its report entries, the next layer's hidden states) with a manifest and a
    /// fingerprint of everything that determines the result, and continue a run on the same
    /// output that stopped after layer k at layer k+1 (its staging directory found and adopted
    /// when the fingerprint matches; a mismatch is an error naming what differs, before any
    /// compute; nothing to resume starts a fresh run). The staging directory is then kept
    /// when the run stops on an error or is interrupted (SIGINT / SIGTERM / SIGHUP) once it
    /// holds a completed layer. The result is byte for byte the one of an uninterrupted run.
    /// Costs a write (and sync) of the hidden states after every layer. Default off.
    pub resume: bool,
    /// Extra named entries of the resume fingerprint, compared with the staged run's by name
    /// (a binary adds its flags, e.g. `("--damp", "0.01")`, and the calibration file's hash, so
    /// that a mismatch names them as the user spells them).
    pub resume_identity: Vec<(String, String)>,
}

impl QuantizeOptions {
    /// The defaults for `recipe`: the original scripts' (dense attention, bf16 rounding,
    /// SmoothQuant at α = 0.5 for NVFP4), with GPTQ unsmoothed.
    pub fn new(recipe: Recipe) -> Self {
        Self {
            plan: PlanOptions::new(recipe),
            gptq: GptqOptions::default(),
            nvfp4_search: Nvfp4BlockSearch::default(),
            nvfp4_solver: Nvfp4Solver::Hybrid,
            smoothing: match recipe {
                Recipe::Gptq => None,
                Recipe::Nvfp4 => Some(Smoothing::Fixed(0.5)),
            },
            run: RunOptions {
                numerics: Numerics::Bf16Rounding,
                attention: AttentionMode::Dense,
                ..RunOptions::default()
            },
            max_host_memory: None,
            max_device_memory: None,
            device_statistics: false,
            pack_tokens: DEFAULT_PACK_TOKENS,
            skip_failed_samples: false,
            compare_rtn: true,
            true_sequential: false,
            prefetch_weights: true,
            overwrite: false,
            max_shard_bytes: sala_export::DEFAULT_MAX_SHARD_BYTES,
            resume: false,
            resume_identity: Vec::new(),
        }
    }
}

impl QuantizeOptions {
    /// GPTQ on the NVFP4 grid with this run's block search and GPTQ damping, block size and
    /// failure policy.
    pub fn nvfp4_gptq(&self) -> Nvfp4Gptq {
        Nvfp4Gptq {
            search: self.nvfp4_search,
            damping: self.gptq.damping,
            block_size: self.gptq.block_size,
            on_failure: self.gptq.failure_policy(),
        }
    }

    /// Which statistics the run accumulates: full Hessians for GPTQ, channel statistics for
    /// NVFP4's block search, both for NVFP4 with [`Nvfp4Solver::Gptq`], and with
    /// [`Nvfp4Solver::Hybrid`] Hessians only below each layer's widest input.
    pub fn statistics(&self) -> Statistics {
        match (self.plan.recipe, self.nvfp4_solver) {
            (Recipe::Gptq, _) => Statistics::Hessians,
            (Recipe::Nvfp4, Nvfp4Solver::BlockSearch) => Statistics::Channels,
            (Recipe::Nvfp4, Nvfp4Solver::Gptq) => Statistics::HessiansAndChannels,
            (Recipe::Nvfp4, Nvfp4Solver::Hybrid) => Statistics::ChannelsAndNarrowHessians,
        }
    }

    /// Refuses, before any compute, what could only fail later: a plan that quantizes nothing,
    /// a GPTQ bit width or grid `gptq_marlin` does not serve (the checkpoint is written for it),
    /// and solver or smoothing options out of range. `plan` is the plan built from
    /// `self.plan`.
    pub fn check(&self, plan: &QuantPlan) -> Result<(), PlanError> {
        if plan.quantized().next().is_none() {
            return Err(PlanError::NothingQuantized);
        }
        if let Some(Smoothing::Fixed(alpha)) = self.smoothing {
            if !(0.0..=1.0).contains(&alpha) {
                return Err(PlanError::Option {
                    option: "--smooth-alpha",
                    message: format!("{alpha} is outside [0, 1]"),
                });
            }
        }
        if self.run.mlp_rows.is_some() && !self.device_statistics {
            return Err(PlanError::Option {
                option: "mlp_rows",
                message: "an MLP in chunks of rows needs the statistics on the device (the \
                          host statistics take whole samples)"
                    .into(),
            });
        }
        if self.run.mlp_rows == Some(0) {
            return Err(PlanError::Option {
                option: "mlp_rows",
                message: "0 rows per chunk".into(),
            });
        }
        match self.plan.recipe {
            Recipe::Gptq => self.check_gptq(plan),
            Recipe::Nvfp4 => {
                self.nvfp4_search
                    .validate()
                    .map_err(|e| PlanError::Option {
                        option: "--mse-iters / --mse-max-shrink / --mse-error-norm",
                        message: e.to_string(),
                    })?;
                self.nvfp4_gptq().validate().map_err(|e| PlanError::Option {
                    option: "--damp / --block-size",
                    message: e.to_string(),
                })
            }
        }
    }

    /// Every GPTQ treatment of `plan`: served by the target's loaders, and accepted by the solver with these
    /// options (damping, block size, groups).
    fn check_gptq(&self, plan: &QuantPlan) -> Result<(), PlanError> {
        let sym = self.gptq.scheme != IntScheme::Asymmetric;
        for linear in plan.quantized() {
            let Treatment::Int { bits, group_size } = linear.treatment else {
                continue;
            };
            for &loader in plan.target.required() {
                if let Some(broken) = loader.bits_violation(bits, sym) {
                    return Err(PlanError::Loader {
                        linear: linear.name.clone(),
                        detail: format!(
                            "{bits}-bit {} GPTQ: {loader}, the loader this checkpoint is written \
                             for (--target {}), refuses it: {broken} (--bits, --layer-bits, \
                             --no-sym)",
                            if sym { "symmetric" } else { "asymmetric" },
                            plan.target
                        ),
                    });
                }
            }
            let config = self.gptq.solver_config(bits, group_size);
            Gptq::new(config).map_err(|e| PlanError::Option {
                option: "GPTQ options (--damp, --group-size)",
                message: e.to_string(),
            })?;
        }
        Ok(())
    }
}
