//! Data-parallel calibration over several GPUs of one host: the plan and the reductions'
//! semantics, independent of the transport.
//!
//! The scheme is llm-compressor's: every GPU runs capture and propagate for its share of the
//! samples (their hidden states stay on it), each linear has an *owner* GPU that receives the
//! sum of every GPU's partial Hessian, solves, and broadcasts the quantized weights, so that
//! every GPU propagates through the same quantized layer. Statistics that are maxima
//! (SmoothQuant's activation amax) are reduced by maximum on every GPU.
//!
//! This module decides who does what and states what the reductions compute:
//!
//! - [`partition_samples`]: samples over devices, balanced by their forward cost (a sample's
//!   cost grows with its length, [`PerTokenCost`]), longest first;
//! - [`assign_owners`]: linears over devices, balanced by their solve cost;
//! - [`sum_partials`] and [`max_partials`]: the reductions in a fixed device order, the
//!   reference an NCCL `reduce`/`all_reduce` is compared with (a sum equals one GPU's up to
//!   f32 summation order; a maximum equals it exactly).
//!
//! The NCCL transport (`--devices N` in `quantize_sala`) is not built: this project has had
//! no machine with several GPUs to run it on (docs/multi-gpu.md).

use crate::forward_bench::PerTokenCost;

/// `bins` bins' assignment of items with `costs`: the longest-processing-time rule (items by
/// descending cost, each to the bin with the least total so far, ties to the lower bin), which
/// is within 4/3 of the best possible largest bin. Returns each item's bin. `bins == 0` is
/// treated as one bin.
fn balance(costs: &[f64], bins: usize) -> Vec<usize> {
    let bins = bins.max(1);
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0.0f64; bins];
    let mut bin_of = vec![0usize; costs.len()];
    for item in order {
        let mut best = 0;
        for bin in 1..bins {
            if load[bin] < load[best] {
                best = bin;
            }
        }
        bin_of[item] = best;
        load[best] += costs[item].max(0.0);
    }
    bin_of
}

/// The samples `(index, tokens)` of each of `devices` devices, balanced by the forward cost of
/// a sample of `tokens` tokens under `cost` (seconds per token growing with the length, so a
/// 131072-token sample weighs more than 128 samples of 1024). Every index appears on exactly
/// one device; within a device the samples keep their given order.
pub fn partition_samples(
    samples: &[(usize, usize)],
    devices: usize,
    cost: &PerTokenCost,
) -> Vec<Vec<(usize, usize)>> {
    let costs: Vec<f64> = samples
        .iter()
        .map(|&(_, len)| cost.sample_seconds(len))
        .collect();
    let bin_of = balance(&costs, devices);
    let mut shares = vec![Vec::new(); devices.max(1)];
    for (sample, bin) in samples.iter().zip(bin_of) {
        shares[bin].push(*sample);
    }
    shares
}

/// The solve cost of a linear of `in_features` inputs and `out_features` outputs, in arbitrary
/// units: the factor of its `in × in` Hessian (`in³/3`) and the column loop over its weight
/// (`in² · out`).
pub fn solve_cost(in_features: usize, out_features: usize) -> f64 {
    let (i, o) = (in_features as f64, out_features as f64);
    i * i * i / 3.0 + i * i * o
}

/// The owner device of each linear `(in_features, out_features)` of a layer, balanced by
/// [`solve_cost`] over `devices` devices.
pub fn assign_owners(linears: &[(usize, usize)], devices: usize) -> Vec<usize> {
    let costs: Vec<f64> = linears.iter().map(|&(i, o)| solve_cost(i, o)).collect();
    balance(&costs, devices)
}

/// The elementwise sum of every device's partial statistic, added in device order (device 0
/// first): what the owner holds after an NCCL sum-reduce of the partial Hessians `Σ XᵢᵀXᵢ/Tᵢ`.
/// `None` when the partials differ in length or there are none.
pub fn sum_partials(partials: &[&[f32]]) -> Option<Vec<f32>> {
    reduce(partials, |a, b| a + b)
}

/// The elementwise maximum of every device's partial statistic (SmoothQuant's per-channel
/// activation amax): the same on every device after an NCCL max-all-reduce, and exactly one
/// GPU's result. `None` as [`sum_partials`].
pub fn max_partials(partials: &[&[f32]]) -> Option<Vec<f32>> {
    reduce(partials, f32::max)
}

/// `partials[0] ∘ partials[1] ∘ …` elementwise, in device order.
fn reduce(partials: &[&[f32]], op: impl Fn(f32, f32) -> f32) -> Option<Vec<f32>> {
    let (first, rest) = partials.split_first()?;
    if rest.iter().any(|p| p.len() != first.len()) {
        return None;
    }
    let mut out = first.to_vec();
    for partial in rest {
        for (o, &x) in out.iter_mut().zip(partial.iter()) {
            *o = op(*o, x);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The per-token cost of run (e)'s minicpm4 propagate pass (docs/results.md).
    fn minicpm4() -> PerTokenCost {
        PerTokenCost {
            base_s: 0.86e-6,
            per_length_s: 0.034e-9,
        }
    }

    fn loads(shares: &[Vec<(usize, usize)>], cost: &PerTokenCost) -> Vec<f64> {
        shares
            .iter()
            .map(|s| s.iter().map(|&(_, len)| cost.sample_seconds(len)).sum())
            .collect()
    }

    #[test]
    fn long_samples_are_spread_before_short_ones_fill_in() {
        // Two 131072-token samples and 64 of 1024 over two devices: one long sample each.
        let mut samples = vec![(0, 131_072), (1, 131_072)];
        samples.extend((2..66).map(|i| (i, 1024)));
        let shares = partition_samples(&samples, 2, &minicpm4());
        for share in &shares {
            assert_eq!(share.iter().filter(|s| s.1 == 131_072).count(), 1);
        }
        let l = loads(&shares, &minicpm4());
        assert!(
            (l[0] - l[1]).abs() <= minicpm4().sample_seconds(1024),
            "{l:?}"
        );
        // One device gets everything, in the given order.
        let one = partition_samples(&samples, 1, &minicpm4());
        assert_eq!(one, vec![samples.clone()]);
    }

    #[test]
    fn owners_balance_the_solves_of_a_layer() {
        // A SALA minicpm4 layer: q, k, v, o_gate, o, gate, up, down.
        let layer = [
            (4096, 4096),
            (4096, 256),
            (4096, 256),
            (4096, 4096),
            (4096, 4096),
            (4096, 16384),
            (4096, 16384),
            (16384, 4096),
        ];
        let owners = assign_owners(&layer, 2);
        // down_proj (in 16384) is the largest solve by far: it has a device to itself.
        let down_owner = owners[7];
        assert!(owners[..7].iter().all(|&o| o != down_owner), "{owners:?}");
        assert_eq!(assign_owners(&layer, 1), vec![0; 8]);
    }

    #[test]
    fn reductions_refuse_mismatched_partials() {
        assert_eq!(sum_partials(&[]), None);
        assert_eq!(sum_partials(&[&[1.0, 2.0], &[1.0]]), None);
        assert_eq!(
            max_partials(&[&[1.0, 5.0], &[3.0, 2.0]]),
            Some(vec![3.0, 5.0])
        );
    }

    proptest! {
        /// Every sample lands on exactly one device, and the busiest device is within the
        /// longest-processing-time bound: at most the mean load plus the largest sample.
        #[test]
        fn partitions_cover_every_sample_once_and_balance(
            lens in proptest::collection::vec(1usize..140_000, 0..120),
            devices in 1usize..9,
        ) {
            let samples: Vec<(usize, usize)> = lens.iter().copied().enumerate().collect();
            let cost = minicpm4();
            let shares = partition_samples(&samples, devices, &cost);
            prop_assert_eq!(shares.len(), devices);
            let mut seen: Vec<usize> = shares.iter().flatten().map(|s| s.0).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..samples.len()).collect::<Vec<_>>());
            let l = loads(&shares, &cost);
            let total: f64 = l.iter().sum();
            let largest = samples
                .iter()
                .map(|&(_, len)| cost.sample_seconds(len))
                .fold(0.0, f64::max);
            let busiest = l.iter().copied().fold(0.0, f64::max);
            prop_assert!(busiest <= total / devices as f64 + largest + 1e-12);
        }

        /// The sum of per-device partial Hessians equals one device's sum over all samples up
        /// to f32 summation order, and the maximum of partial amaxes equals it exactly.
        #[test]
        fn reductions_match_one_device(
            values in proptest::collection::vec(
                proptest::collection::vec(-100.0f32..100.0, 16), 1..40),
            devices in 1usize..5,
        ) {
            // Sample i lives on device i % devices.
            let mut partial_sum = vec![vec![0.0f32; 16]; devices];
            let mut partial_max = vec![vec![0.0f32; 16]; devices];
            for (i, v) in values.iter().enumerate() {
                for (j, &x) in v.iter().enumerate() {
                    partial_sum[i % devices][j] += x * x;
                    partial_max[i % devices][j] = partial_max[i % devices][j].max(x.abs());
                }
            }
            let sums: Vec<&[f32]> = partial_sum.iter().map(Vec::as_slice).collect();
            let maxes: Vec<&[f32]> = partial_max.iter().map(Vec::as_slice).collect();
            let reduced = sum_partials(&sums).unwrap();
            let reduced_max = max_partials(&maxes).unwrap();
            for j in 0..16 {
                let single: f64 = values.iter().map(|v| (v[j] as f64) * (v[j] as f64)).sum();
                let err = (reduced[j] as f64 - single).abs();
                prop_assert!(err <= 1e-5 * single.max(1.0), "{} vs {}", reduced[j], single);
                let single_max = values.iter().map(|v| v[j].abs()).fold(0.0f32, f32::max);
                prop_assert_eq!(reduced_max[j], single_max);
            }
        }
    }
}
