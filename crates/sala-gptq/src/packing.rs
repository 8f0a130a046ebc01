//! Packs: which calibration samples run through a layer together.
//!
//! A GPU runs a layer's GEMMs near its peak only on thousands of rows, while most calibration
//! samples are short. Samples of similar length are therefore put back to back in one
//! `[Σ T, hidden]` buffer (the runner restarts positions, attention and the GLA state at each
//! sample), until a pack holds a target number of tokens. Similar lengths keep the per-sample
//! work of a pack (attention, GLA) balanced and let equal lengths share one batched GLA.

/// Groups the samples `(index, tokens)` into packs of at least `target_tokens` tokens each
/// (the last pack may hold fewer), longest samples first; a sample of `target_tokens` or more
/// is a pack of its own. Every index appears in exactly one pack, in the order packs are run;
/// within a pack the samples keep descending length (ties by index). `target_tokens <= 1`
/// gives one sample per pack.
pub fn pack_samples(samples: &[(usize, usize)], target_tokens: usize) -> Vec<Vec<usize>> {
    let mut order = samples.to_vec();
    order.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut packs: Vec<Vec<usize>> = Vec::new();
    let mut tokens = 0usize;
    for (index, len) in order {
        let full = packs.is_empty() || tokens >= target_tokens;
        if full {
            packs.push(Vec::new());
            tokens = 0;
        }
        if let Some(pack) = packs.last_mut() {
            pack.push(index);
        }
        tokens = tokens.saturating_add(len);
    }
    packs
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn long_samples_run_alone_and_short_ones_fill_packs() {
        let samples = [(0, 500), (1, 131_072), (2, 600), (3, 16_384), (4, 700)];
        assert_eq!(
            pack_samples(&samples, 16_384),
            vec![vec![1], vec![3], vec![4, 2, 0]]
        );
        assert_eq!(
            pack_samples(&samples, 1200),
            vec![vec![1], vec![3], vec![4, 2], vec![0]]
        );
        assert_eq!(
            pack_samples(&samples, 1),
            vec![vec![1], vec![3], vec![4], vec![2], vec![0]]
        );
        assert!(pack_samples(&[], 16).is_empty());
    }

    proptest! {
        /// Every sample lands in exactly one pack; every pack but the last reaches the target
        /// and would be under it without its last sample; lengths never increase along the run.
        #[test]
        fn packs_partition_the_samples(
            lens in proptest::collection::vec(1usize..5000, 1..60),
            target in 1usize..20_000,
        ) {
            let samples: Vec<(usize, usize)> = lens.iter().copied().enumerate().collect();
            let packs = pack_samples(&samples, target);
            let mut seen: Vec<usize> = packs.iter().flatten().copied().collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>());
            let order: Vec<usize> = packs.iter().flatten().map(|&i| lens[i]).collect();
            prop_assert!(order.windows(2).all(|w| w[0] >= w[1]));
            for (p, pack) in packs.iter().enumerate() {
                let total: usize = pack.iter().map(|&i| lens[i]).sum();
                let last = lens[pack[pack.len() - 1]];
                prop_assert!(total - last < target);
                if p + 1 < packs.len() {
                    prop_assert!(total >= target);
                }
            }
        }
    }
}
