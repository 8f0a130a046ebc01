//! The device-memory budget of a run, planned from sizes alone before any compute: what one
//! layer's work costs per pack token and per layer ([`LayerFootprint`]), which pack size fits,
//! whether the hidden states of every sample can stay on the device ([`MemoryPlan`]), and a
//! refusal naming the sample when even that sample alone cannot fit ([`BudgetError`]).
//!
//! The footprint is an upper estimate of the buffers a layer holds at once on the GPU path
//! (bf16 storage, fused element-wise kernels, cuBLAS linears, device statistics and solver):
//! the pack's input and residual, the widest of the attention and MLP intermediates, the
//! layer's weights, its statistics and the solver's work buffers. The plan spends only
//! [`MemoryPlan::USABLE_FRACTION`] of the budget on tensors: the rest is left to what the
//! estimate does not count (cuBLAS and cuSOLVER workspaces, kernel metadata, the CUDA memory
//! pool's fragmentation; on CUDA every buffer is allocated at its exact size, see
//! `sala_model::configure_cuda_runtime`; other runtimes round buffers up to pool pages).

use crate::plan::Recipe;
use crate::stats::DIAGONAL_CHUNK_BYTES;
use sala_model::{input_groups, LayerKind, SalaConfig};
use serde::Serialize;
use std::fmt;

/// One megabyte, for messages.
const MB: f64 = 1e6;

/// What one decoder layer's work holds on the device, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerFootprint {
    /// Bytes per token of a pack: activations and their copies, the widest moment of the
    /// layer (largest over the layer kinds).
    pub per_token: u64,
    /// Bytes per layer whatever its packs, while they run: weights on the device and the
    /// statistics (Hessians) being accumulated (largest over the layers).
    pub fixed: u64,
    /// Bytes of the solve stage, which runs between the packs: the statistics and the
    /// solver's work buffers on the largest linear (largest over the layers).
    pub solve: u64,
    /// Bytes per token of the longest sample that the run keeps for its whole length (the
    /// RoPE tables, f32 cos and sin).
    pub per_longest_token: u64,
}

/// Which statistics of each layer input a run accumulates (and keeps for its solve).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Statistics {
    /// A full Hessian per input (GPTQ).
    Hessians,
    /// Channel statistics per input (NVFP4's block search).
    Channels,
    /// Both (NVFP4 with GPTQ).
    HessiansAndChannels,
    /// Channel statistics per input, and a full Hessian per input group narrower than its
    /// layer's widest (NVFP4 with GPTQ below the widest input, the block search on it).
    ChannelsAndNarrowHessians,
}

impl Statistics {
    /// Whether an input group `width` features wide, in a layer whose widest input group is
    /// `widest` features wide, gets a full Hessian.
    pub fn full_hessian(self, width: usize, widest: usize) -> bool {
        match self {
            Statistics::Hessians | Statistics::HessiansAndChannels => true,
            Statistics::Channels => false,
            Statistics::ChannelsAndNarrowHessians => width < widest,
        }
    }

    /// Whether every input gets channel statistics.
    pub fn channels(self) -> bool {
        self != Statistics::Hessians
    }
}

/// The input features of each of layer `layer`'s input groups
/// ([`sala_model::input_groups`], in their order): its first reader's.
pub(crate) fn input_group_widths(config: &SalaConfig, layer: usize) -> Vec<usize> {
    let specs = config.linear_specs(layer);
    input_groups(config, layer)
        .iter()
        .map(|g| {
            g.readers
                .first()
                .and_then(|r| specs.iter().find(|s| &s.name == r))
                .map_or(0, |s| s.in_features)
        })
        .collect()
}

impl From<Recipe> for Statistics {
    /// The recipe's default solver's statistics.
    fn from(recipe: Recipe) -> Self {
        match recipe {
            Recipe::Gptq => Statistics::Hessians,
            Recipe::Nvfp4 => Statistics::Channels,
        }
    }
}

impl LayerFootprint {
    /// The footprint of `config`'s layers accumulating `statistics` with hidden states of `elem` bytes
    /// per value (2 under bf16 storage, 4 in f32), the MLP run `mlp_rows` rows at a time
    /// ([`RunOptions::mlp_rows`](sala_model::RunOptions)) or a whole pack at once (`None`).
    pub fn estimate(
        config: &SalaConfig,
        statistics: impl Into<Statistics>,
        elem: u64,
        mlp_rows: Option<usize>,
    ) -> Self {
        let statistics = statistics.into();
        let layers = 0..config.num_layers();
        let per_token = layers
            .clone()
            .map(|l| per_token_of(config, config.layer_kind(l), elem, mlp_rows.is_some()))
            .max()
            .unwrap_or(0);
        let stages: Vec<(u64, u64)> = layers
            .map(|l| fixed_of(config, l, statistics, elem))
            .collect();
        let head_dim = config.attention_heads().head_dim as u64;
        // One chunk's gate, up and SwiGLU product, its down_proj output and residual sum.
        let (h, inter) = (
            config.hidden_size() as u64,
            config.intermediate_size() as u64,
        );
        let mlp_chunk = mlp_rows.map_or(0, |rows| elem * rows as u64 * (3 * inter + 2 * h));
        Self {
            per_token,
            fixed: stages.iter().map(|s| s.0).max().unwrap_or(0) + mlp_chunk,
            solve: stages.iter().map(|s| s.1).max().unwrap_or(0),
            per_longest_token: 2 * 4 * head_dim,
        }
    }

    /// Bytes of a layer's largest moment: its largest pack, or its solve.
    pub fn peak_bytes(&self, tokens: usize, longest: usize) -> u64 {
        self.pack_bytes(tokens, longest).max(self.solve)
    }

    /// Bytes of one pack of `tokens` tokens whose longest sample has `longest` tokens.
    pub fn pack_bytes(&self, tokens: usize, longest: usize) -> u64 {
        self.fixed
            .saturating_add(self.per_token.saturating_mul(tokens as u64))
            .saturating_add(self.per_longest_token.saturating_mul(longest as u64))
    }
}

/// Per-token bytes of one layer kind: the larger of its attention and MLP moments, the pack's
/// input counted (a copy for packs of several samples; for one sample it is the stored hidden
/// state, counted twice when those live on the device). A `chunked` MLP holds only the rows of
/// one chunk of intermediates (counted in the fixed bytes).
fn per_token_of(config: &SalaConfig, kind: LayerKind, elem: u64, chunked: bool) -> u64 {
    let h = config.hidden_size() as u64;
    let inter = config.intermediate_size() as u64;
    let heads = match kind {
        LayerKind::Lightning => config.lightning_heads().unwrap_or(config.attention_heads()),
        _ => config.attention_heads(),
    };
    let (q, kv) = (heads.q_width() as u64, heads.kv_width() as u64);
    let attention = match kind {
        // Input, norm, q, k, v, normed q and k (RoPE), the GLA output, its norm, the gate.
        LayerKind::Lightning => 2 * h + 3 * q + 4 * kv,
        // Input, norm, q, k, v, the output gate, the attention output.
        _ => 2 * h + 3 * q + 2 * kv,
    };
    let mlp = match chunked {
        // Input, residual, its norm, the chunks' outputs and their concatenation.
        true => 5 * h,
        // Input, residual, gate, up and their SwiGLU product.
        false => 2 * h + 3 * inter,
    };
    elem * attention.max(mlp)
}

/// Fixed bytes of layer `layer` while its packs run (its weights in the storage dtype and the
/// statistics of its inputs), and the bytes of its solve (the statistics and the solver's
/// work on its largest linear).
fn fixed_of(config: &SalaConfig, layer: usize, statistics: Statistics, elem: u64) -> (u64, u64) {
    let weights: u64 = config
        .layer_tensor_specs(layer)
        .iter()
        .map(|t| t.shape.iter().product::<usize>() as u64 * elem)
        .sum();
    let widths = input_group_widths(config, layer);
    let widest = widths.iter().copied().max().unwrap_or(0);
    let with_hessian: Vec<u64> = widths
        .iter()
        .filter(|&&w| statistics.full_hessian(w, widest))
        .map(|&w| w as u64)
        .collect();
    let largest = config
        .linear_specs(layer)
        .iter()
        .map(|s| (s.out_features * s.in_features) as u64)
        .max()
        .unwrap_or(0);
    let f32 = 4;
    // One f32 Hessian per input group that gets one. The solve: the factorisation's three
    // square buffers and a smoothing rescale of the widest of them (a factor kept for the next
    // reader of the same Hessian is the one that reader would compute, never a second);
    // weights, codes, errors and the proxy's two buffers of the largest linear.
    let hessians: u64 = with_hessian.iter().map(|d| d * d * f32).sum();
    let widest_hessian = with_hessian.iter().copied().max();
    let gptq_solve = widest_hessian.map(|w| hessians + 4 * w * w * f32 + 5 * largest * f32);
    // The channel sums' row chunks (three f32 copies); the search's weights and codes of the
    // largest linear with its block scales and errors.
    let channel_chunks = match statistics.channels() {
        true => 3 * DIAGONAL_CHUNK_BYTES as u64,
        false => 0,
    };
    let search_solve = 3 * largest * f32;
    // Where both solvers run, the larger of their work buffers.
    let solve = gptq_solve.map_or(search_solve, |gptq| gptq.max(search_solve));
    (weights + hessians + channel_chunks, solve)
}

/// Where the plan puts things and how large the packs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryPlan {
    /// The budget, bytes.
    pub budget: u64,
    /// The layer footprint the plan used.
    pub footprint: LayerFootprint,
    /// Bytes of every sample's hidden states in the storage dtype.
    pub hidden_bytes: u64,
    /// Whether the hidden states stay on the device (else host memory or a file).
    pub hidden_on_device: bool,
    /// Tokens per pack (a longer sample runs alone).
    pub pack_tokens: usize,
    /// Tokens of the longest sample.
    pub longest: usize,
    /// Bytes of a layer's largest moment: its largest pack's work (fixed part included), or
    /// its solve if that is larger.
    pub largest_pack_bytes: u64,
}

/// A budget too small for a sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetError {
    /// Index of the sample in the lengths given to [`MemoryPlan::new`].
    pub index: usize,
    /// Its tokens.
    pub tokens: usize,
    /// Bytes its layer work needs.
    pub needed: u64,
    /// Bytes the plan may spend ([`MemoryPlan::USABLE_FRACTION`] of the budget).
    pub usable: u64,
    /// The budget, bytes.
    pub budget: u64,
}

impl fmt::Display for BudgetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sample {} has {} tokens: one layer's work on it needs {:.0} MB of device memory, \
             more than the {:.0} MB the plan may spend of the {:.0} MB budget \
             (--max-device-memory); lower --max-len or raise the budget",
            self.index,
            self.tokens,
            self.needed as f64 / MB,
            self.usable as f64 / MB,
            self.budget as f64 / MB
        )
    }
}

impl std::error::Error for BudgetError {}

impl MemoryPlan {
    /// Share of the budget the plan spends on tensors; the rest is left to what the estimate
    /// does not count (library workspaces, the allocator's fragmentation and rounding).
    pub const USABLE_FRACTION: f64 = 0.8;

    /// Bytes the plan may spend of `budget`.
    pub fn usable(budget: u64) -> u64 {
        (budget as f64 * Self::USABLE_FRACTION) as u64
    }

    /// Plans samples of `lengths` tokens (at least one, none empty) with `footprint`, hidden
    /// states of `hidden_width` values of `elem` bytes per token, within `budget` bytes.
    /// Packs hold up to `pack_tokens` tokens and shrink (to one sample) when the budget is
    /// small. The hidden states stay on the device when `device_hidden` allows it and they fit
    /// beside the largest pack; packs shrink first to make room for them.
    pub fn new(
        lengths: &[usize],
        footprint: LayerFootprint,
        hidden_width: usize,
        elem: u64,
        budget: u64,
        pack_tokens: usize,
        device_hidden: bool,
    ) -> Result<Self, BudgetError> {
        let usable = Self::usable(budget);
        let (index, longest) = lengths
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))
            .unwrap_or((0, 0));
        let alone = footprint.peak_bytes(longest, longest);
        if alone > usable {
            return Err(BudgetError {
                index,
                tokens: longest,
                needed: alone,
                usable,
                budget,
            });
        }
        let total: u64 = lengths.iter().map(|&n| n as u64).sum();
        let hidden_bytes = total
            .saturating_mul(hidden_width as u64)
            .saturating_mul(elem);
        let pack_within = |room: u64| {
            // The largest pack whose bytes fit `room` (at least the longest sample, which
            // runs alone anyway), capped by the requested size.
            let spare = room.saturating_sub(footprint.pack_bytes(0, longest));
            let tokens = spare
                .checked_div(footprint.per_token)
                .unwrap_or(u64::MAX)
                .min(usize::MAX as u64) as usize;
            pack_tokens.max(1).min(tokens.max(1))
        };
        let on_device = device_hidden && hidden_bytes.saturating_add(alone) <= usable;
        let pack = match on_device {
            true => pack_within(usable - hidden_bytes),
            false => pack_within(usable),
        };
        Ok(Self {
            budget,
            footprint,
            hidden_bytes,
            hidden_on_device: on_device,
            pack_tokens: pack,
            longest,
            largest_pack_bytes: footprint.peak_bytes(pack.max(longest), longest),
        })
    }

    /// Bytes the plan expects on the device at a layer's largest moment: the hidden states
    /// when they live there, and the largest pack's work (or the solve).
    pub fn expected_peak(&self) -> u64 {
        let hidden = if self.hidden_on_device {
            self.hidden_bytes
        } else {
            0
        };
        hidden.saturating_add(self.largest_pack_bytes)
    }

    /// Bytes of freed memory the device's allocator may keep between packs: the expected
    /// peak and a quarter more for the allocator's fragmentation, within the budget. Keeping
    /// more only makes the reserved figure grow towards the budget; keeping less makes the
    /// next pack map memory again.
    pub fn pool_keep(&self) -> u64 {
        self.expected_peak()
            .saturating_add(self.expected_peak() / 4)
            .min(self.budget)
    }

    /// Bytes the hidden states may take on the device ([`crate::QuantizeOptions`]'s
    /// `max_device_memory`): all of theirs when the plan keeps them there, else none.
    pub fn hidden_allowance(&self) -> Option<u64> {
        self.hidden_on_device.then_some(self.hidden_bytes)
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device budget {:.0} MB ({:.0} MB for tensors): hidden states {:.0} MB {}; packs \
             up to {} tokens; a layer's largest moment {:.0} MB ({:.0} MB per layer + {} bytes \
             per token; solve {:.0} MB); longest sample {} tokens; freed memory kept up to \
             {:.0} MB",
            self.budget as f64 / MB,
            Self::usable(self.budget) as f64 / MB,
            self.hidden_bytes as f64 / MB,
            if self.hidden_on_device {
                "on the device"
            } else {
                "on the host"
            },
            self.pack_tokens,
            self.largest_pack_bytes as f64 / MB,
            self.footprint.fixed as f64 / MB,
            self.footprint.per_token,
            self.footprint.solve as f64 / MB,
            self.longest,
            self.pool_keep() as f64 / MB,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The 9B model's configuration, bundled with the fixtures.
    fn full_size_config() -> SalaConfig {
        SalaConfig::from_file(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../fixtures/minicpm-sala-9b-config.json"),
        )
        .unwrap()
    }

    fn footprint(per_token: u64, fixed: u64) -> LayerFootprint {
        LayerFootprint {
            per_token,
            fixed,
            solve: fixed,
            per_longest_token: 8,
        }
    }

    /// The full-size model's footprint is what the audit of the GPU path counted: about
    /// 115 kB per token (the MLP's moment: input, residual, gate, up, SwiGLU).
    #[test]
    fn full_size_footprint_matches_the_counted_buffers() {
        let config = full_size_config();
        let gptq = LayerFootprint::estimate(&config, Recipe::Gptq, 2, None);
        assert_eq!(gptq.per_token, 2 * (2 * 4096 + 3 * 16384));
        // Hessians 3·4096² + 16384² f32 (1.27 GB) and weights of about 0.57 GB while packs
        // run; the solve adds the factorisation (4.3 GB) and the largest linear's (1.3 GB).
        assert!(
            (1.7e9..2.0e9).contains(&(gptq.fixed as f64)),
            "{}",
            gptq.fixed
        );
        assert!(
            (6.5e9..7.5e9).contains(&(gptq.solve as f64)),
            "{}",
            gptq.solve
        );
        let nvfp4 = LayerFootprint::estimate(&config, Recipe::Nvfp4, 2, None);
        assert_eq!(nvfp4.per_token, gptq.per_token);
        assert!(
            nvfp4.fixed < gptq.fixed && nvfp4.solve < gptq.solve / 5,
            "{nvfp4:?}"
        );
        // The MLP in chunks of 16384 rows: the lightning attention's moment (input, norm, q,
        // k, v, normed q and k, the GLA output, its norm, the gate, all 4096 wide) becomes the
        // widest, and one chunk's intermediates (1.88 GB) join the fixed bytes. At 131,072
        // tokens the layer needs 3.5 GB less.
        let chunked = LayerFootprint::estimate(&config, Recipe::Gptq, 2, Some(16384));
        assert_eq!(chunked.per_token, 2 * 9 * 4096);
        assert_eq!(
            chunked.fixed - gptq.fixed,
            2 * 16384 * (3 * 16384 + 2 * 4096)
        );
        let saved = gptq.pack_bytes(131_072, 131_072) - chunked.pack_bytes(131_072, 131_072);
        assert!((3.4e9..3.6e9).contains(&(saved as f64)), "{saved}");
    }

    /// NVFP4 with GPTQ below the widest input keeps the three 4096² Hessians (0.2 GB) and
    /// not the 16384² one: its fixed bytes are the search's plus those, and its solve is that
    /// of a 4096-wide factor beside the largest linear's buffers.
    #[test]
    fn narrow_hessians_cost_a_fraction_of_all_hessians() {
        let config = full_size_config();
        let all = LayerFootprint::estimate(&config, Statistics::HessiansAndChannels, 2, None);
        let search = LayerFootprint::estimate(&config, Statistics::Channels, 2, None);
        let narrow =
            LayerFootprint::estimate(&config, Statistics::ChannelsAndNarrowHessians, 2, None);
        assert_eq!(narrow.fixed - search.fixed, 3 * 4096 * 4096 * 4);
        assert!(narrow.fixed < all.fixed, "{narrow:?} vs {all:?}");
        let largest = 16384 * 4096 * 4;
        assert_eq!(
            narrow.solve,
            3 * 4096 * 4096 * 4 + 4 * 4096 * 4096 * 4 + 5 * largest
        );
        assert!(narrow.solve < all.solve / 3, "{narrow:?} vs {all:?}");
    }

    #[test]
    fn which_groups_get_a_full_hessian() {
        assert!(Statistics::Hessians.full_hessian(4096, 4096));
        assert!(!Statistics::Hessians.channels());
        assert!(!Statistics::Channels.full_hessian(64, 4096));
        assert!(Statistics::HessiansAndChannels.full_hessian(16384, 16384));
        let narrow = Statistics::ChannelsAndNarrowHessians;
        assert!(narrow.full_hessian(4096, 16384) && !narrow.full_hessian(16384, 16384));
        assert!(narrow.channels());
    }

    #[test]
    fn a_sample_too_long_for_the_budget_is_named() {
        let err = MemoryPlan::new(
            &[10, 500, 20, 500],
            footprint(1000, 0),
            4,
            2,
            100_000,
            64,
            true,
        )
        .unwrap_err();
        assert_eq!((err.index, err.tokens), (1, 500));
        assert_eq!(err.needed, 500 * 1000 + 500 * 8);
        let message = err.to_string();
        assert!(message.contains("sample 1 has 500 tokens"), "{message}");
        assert!(message.contains("--max-device-memory"), "{message}");
    }

    #[test]
    fn packs_shrink_before_the_hidden_states_leave_the_device() {
        let lengths = [100; 10];
        let fp = footprint(100, 1000);
        // Room for everything: the requested packs, states on the device.
        let roomy = MemoryPlan::new(&lengths, fp, 4, 2, 10_000_000, 400, true).unwrap();
        assert!(roomy.hidden_on_device);
        assert_eq!(roomy.pack_tokens, 400);
        // States (8000 bytes) plus a pack of 400 do not fit in 0.8 · 50,000; about 300 do.
        let tight = MemoryPlan::new(&lengths, fp, 4, 2, 50_000, 400, true).unwrap();
        assert!(tight.hidden_on_device);
        assert!(
            tight.pack_tokens < 400 && tight.pack_tokens >= 100,
            "{tight:?}"
        );
        // Not even one sample beside the states: they go to the host.
        let host = MemoryPlan::new(&lengths, fp, 4, 2, 15_000, 400, true).unwrap();
        assert!(!host.hidden_on_device);
        assert_eq!(host.hidden_allowance(), None);
    }

    proptest! {
        /// Whatever the sizes, a plan never spends more than its usable budget, its packs are
        /// at most the requested size, and a larger budget never gives smaller packs or moves
        /// the states off the device.
        #[test]
        fn plans_stay_within_the_budget(
            lengths in proptest::collection::vec(1usize..5000, 1..40),
            per_token in 1u64..100_000,
            fixed in 0u64..1_000_000_000,
            budget in 1u64..100_000_000_000,
            pack_tokens in 1usize..40_000,
            device_hidden: bool,
        ) {
            let fp = footprint(per_token, fixed);
            match MemoryPlan::new(&lengths, fp, 64, 2, budget, pack_tokens, device_hidden) {
                Ok(plan) => {
                    let hidden = if plan.hidden_on_device { plan.hidden_bytes } else { 0 };
                    prop_assert!(plan.largest_pack_bytes + hidden <= MemoryPlan::usable(budget));
                    prop_assert_eq!(plan.expected_peak(), plan.largest_pack_bytes + hidden);
                    // The allocator keeps at least the expected peak, never beyond the budget.
                    prop_assert!(plan.pool_keep() >= plan.expected_peak());
                    prop_assert!(plan.pool_keep() <= budget);
                    prop_assert!(plan.pack_tokens <= pack_tokens && plan.pack_tokens >= 1);
                    prop_assert!(!plan.hidden_on_device || device_hidden);
                    let more = MemoryPlan::new(&lengths, fp, 64, 2, budget * 2, pack_tokens,
                        device_hidden).unwrap();
                    prop_assert!(more.hidden_on_device >= plan.hidden_on_device);
                    if more.hidden_on_device == plan.hidden_on_device {
                        prop_assert!(more.pack_tokens >= plan.pack_tokens);
                    }
                }
                Err(err) => {
                    let longest = *lengths.iter().max().unwrap();
                    prop_assert_eq!(err.tokens, longest);
                    prop_assert_eq!(lengths[err.index], longest);
                    prop_assert!(err.needed > MemoryPlan::usable(budget));
                }
            }
        }
    }
}
