//! Per-input-channel activation statistics, accumulated one calibration sample at a time.
//!
//! The one implementation in the workspace: sala-hessian's `ChannelStatsAccumulator` (the
//! diagonal statistics of the NVFP4 recipe) adapts [`ChannelStats`] and sums long samples'
//! rows on several threads through [`ChannelSums`].

use crate::error::{Result, SmoothError};
use crate::matrix::check_channels;

/// Which per-channel activation magnitude drives the smoothing scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationStat {
    /// `max |x_j|` over every token of every sample (SmoothQuant).
    AbsMax,
    /// `sqrt(E[x_j²])`, the square root of `diag(H)` with per-sample normalisation (the
    /// original scripts).
    Rms,
    /// `E[|x_j|]` with per-sample normalisation (AWQ).
    MeanAbs,
}

/// How per-sample sums of activation products are normalised: those of [`ChannelStats`] here,
/// and the Hessian `Σ XᵀX` of sala-hessian, which uses this same type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Normalization {
    /// Each sample's sums are divided by its token count, and their total by the number of
    /// samples: every calibration sample weighs the same whatever its length (the original
    /// SALA scripts' convention).
    #[default]
    PerSample,
    /// The plain sums divided by the total token count (GPTQModel's convention): long samples
    /// weigh more.
    PerToken,
}

/// Raw per-channel sums over rows of one sample, before any normalisation: `Σ x²` and
/// `Σ |x|` in f64, `max |x|`, and the number of rows.
///
/// The part of a sample's accumulation that can be split: the sums of disjoint row ranges
/// [`combine`](Self::combine) into those of the whole sample, so a caller may sum a long
/// sample on several threads and hand the total to [`ChannelStats::add_sums`].
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelSums {
    square: Vec<f64>,
    abs: Vec<f64>,
    max: Vec<f32>,
    rows: u64,
}

impl ChannelSums {
    /// Zero sums over no rows, for `channels` channels.
    pub fn new(channels: usize) -> Self {
        Self {
            square: vec![0.0; channels],
            abs: vec![0.0; channels],
            max: vec![0.0; channels],
            rows: 0,
        }
    }

    /// Number of channels.
    pub fn channels(&self) -> usize {
        self.square.len()
    }

    /// Rows (tokens) summed so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Adds the rows of a row-major `[rows, channels]` buffer; a trailing partial row is
    /// ignored.
    ///
    /// Values are not checked here (this is the inner loop): a NaN or infinity makes the sums
    /// non-finite, which [`ChannelStats::add_sums`] refuses.
    pub fn add_rows<T: Copy + Into<f32>>(&mut self, values: &[T]) {
        let channels = self.channels();
        // `max(1)`: with no channel there are no values either, and `chunks_exact(0)` panics.
        for row in values.chunks_exact(channels.max(1)) {
            for (j, &v) in row.iter().enumerate() {
                let v: f32 = v.into();
                // In f64: the square of an f32 is exact there, and long samples' sums keep
                // their precision.
                let v64 = f64::from(v);
                self.square[j] += v64 * v64;
                self.abs[j] += v64.abs();
                self.max[j] = self.max[j].max(v.abs());
            }
            self.rows += 1;
        }
    }

    /// Adds the sums of other rows of the same sample.
    ///
    /// Fails, changing nothing, when `other` has a different number of channels.
    pub fn combine(&mut self, other: &ChannelSums) -> Result<()> {
        check_channels("combined channel sums", self.channels(), other.channels())?;
        for j in 0..self.channels() {
            self.square[j] += other.square[j];
            self.abs[j] += other.abs[j];
            self.max[j] = self.max[j].max(other.max[j]);
        }
        self.rows += other.rows;
        Ok(())
    }

    /// Rejects the first non-finite sum, naming its channel.
    fn check_finite(&self) -> Result<()> {
        let sums = self.square.iter().zip(&self.abs).zip(&self.max);
        for (channel, ((&square, &abs), &max)) in sums.enumerate() {
            if let Some(value) = [square, abs, f64::from(max)]
                .into_iter()
                .find(|v| !v.is_finite())
            {
                return Err(SmoothError::NonFinite {
                    what: "channel sums".to_owned(),
                    channel,
                    value,
                });
            }
        }
        Ok(())
    }
}

/// Statistics of one activation tensor's channels (the input of a linear, or equivalently the
/// output of the norm or linear that feeds it), mergeable across samples and workers.
///
/// Means are *per-sample normalised* by default, as in the original scripts: each sample
/// contributes `Σ_tokens f(x) / n_tokens`, and the result is divided by the number of samples,
/// so a 128k-token sample weighs as much as a 100-token one. [`ChannelStats::mean_square`] is
/// therefore exactly `diag(H) / nsamples` of the scripts' Hessian `H = Σ_samples XᵀX /
/// n_tokens`. [`Normalization::PerToken`] ([`ChannelStats::with_normalization`]) weighs every
/// token the same instead.
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelStats {
    abs_max: Vec<f32>,
    /// `Σ_samples w · Σ_tokens x²` with the sample weight `w` of the normalisation.
    sum_square: Vec<f64>,
    /// `Σ_samples w · Σ_tokens |x|`.
    sum_abs: Vec<f64>,
    normalization: Normalization,
    samples: u64,
    tokens: u64,
}

impl ChannelStats {
    /// Empty per-sample-normalised statistics for `channels` channels.
    pub fn new(channels: usize) -> Self {
        Self::with_normalization(channels, Normalization::PerSample)
    }

    /// Empty statistics for `channels` channels under `normalization`.
    pub fn with_normalization(channels: usize, normalization: Normalization) -> Self {
        Self {
            abs_max: vec![0.0; channels],
            sum_square: vec![0.0; channels],
            sum_abs: vec![0.0; channels],
            normalization,
            samples: 0,
            tokens: 0,
        }
    }

    /// Number of channels.
    pub fn channels(&self) -> usize {
        self.abs_max.len()
    }

    /// Number of samples accumulated so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Number of tokens accumulated so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The normalisation chosen at construction.
    pub fn normalization(&self) -> Normalization {
        self.normalization
    }

    /// Adds one calibration sample: `x` is row-major `[tokens, channels]`.
    ///
    /// Fails on a length that is not `tokens · channels`, on zero tokens, and on NaN or
    /// infinite values (naming the channel), leaving the statistics unchanged.
    pub fn add_sample(&mut self, x: &[f32], tokens: usize) -> Result<()> {
        let channels = self.channels();
        if tokens == 0 {
            return Err(SmoothError::EmptySample);
        }
        if tokens.checked_mul(channels) != Some(x.len()) {
            return Err(SmoothError::BufferSize {
                what: "activation sample".to_owned(),
                rows: tokens,
                cols: channels,
                expected: tokens.saturating_mul(channels),
                actual: x.len(),
            });
        }
        // Checked on the values, not only on the sums, so that the error names the value.
        check_finite_rows(x, channels)?;
        let mut sums = ChannelSums::new(channels);
        sums.add_rows(x);
        self.add_sums(&sums)
    }

    /// Adds one calibration sample given as the [`ChannelSums`] of all its rows (its tokens).
    ///
    /// Fails on other channel counts, on sums of no row, and on non-finite sums (naming the
    /// channel), leaving the statistics unchanged.
    pub fn add_sums(&mut self, sums: &ChannelSums) -> Result<()> {
        check_channels("channel sums", self.channels(), sums.channels())?;
        if sums.rows == 0 {
            return Err(SmoothError::EmptySample);
        }
        sums.check_finite()?;
        // Every check is done: from here on the statistics are updated in place.
        let weight = match self.normalization {
            Normalization::PerSample => 1.0 / sums.rows as f64,
            Normalization::PerToken => 1.0,
        };
        for j in 0..self.channels() {
            self.sum_square[j] += sums.square[j] * weight;
            self.sum_abs[j] += sums.abs[j] * weight;
            self.abs_max[j] = self.abs_max[j].max(sums.max[j]);
        }
        self.samples += 1;
        self.tokens += sums.rows;
        Ok(())
    }

    /// Adds the samples of `other` (accumulated elsewhere, e.g. by another worker).
    ///
    /// The result equals the statistics of both sample lists concatenated. Statistics of
    /// another width or normalisation are refused.
    pub fn merge(&mut self, other: &ChannelStats) -> Result<()> {
        check_channels("merged statistics", self.channels(), other.channels())?;
        if self.normalization != other.normalization {
            return Err(SmoothError::NormalizationMismatch {
                expected: self.normalization,
                actual: other.normalization,
            });
        }
        for (a, b) in self.abs_max.iter_mut().zip(&other.abs_max) {
            *a = a.max(*b);
        }
        for (a, b) in self.sum_square.iter_mut().zip(&other.sum_square) {
            *a += b;
        }
        for (a, b) in self.sum_abs.iter_mut().zip(&other.sum_abs) {
            *a += b;
        }
        self.samples += other.samples;
        self.tokens += other.tokens;
        Ok(())
    }

    /// `max |x_j|` per channel over all tokens of all samples.
    pub fn abs_max(&self) -> &[f32] {
        &self.abs_max
    }

    /// `E[x_j²]` per channel under the normalisation; per sample, `diag(H) / nsamples` in the
    /// scripts' terms.
    pub fn mean_square(&self) -> Result<Vec<f64>> {
        self.mean(&self.sum_square)
    }

    /// `E[|x_j|]` per channel under the normalisation.
    pub fn mean_abs(&self) -> Result<Vec<f64>> {
        self.mean(&self.sum_abs)
    }

    /// The per-channel magnitude `stat` selects, as f32 (the precision scales are computed in).
    pub fn activation(&self, stat: ActivationStat) -> Result<Vec<f32>> {
        if self.samples == 0 {
            return Err(SmoothError::NoSamples);
        }
        Ok(match stat {
            ActivationStat::AbsMax => self.abs_max.clone(),
            ActivationStat::Rms => to_f32(self.mean_square()?.into_iter().map(f64::sqrt)),
            ActivationStat::MeanAbs => to_f32(self.mean_abs()?),
        })
    }

    /// Turns these into the statistics of the smoothed input `x_j / s_j`, so they need not be
    /// recollected after folding `scales` (`abs_max` and `E|x|` divide by `s_j`, `E[x²]` by `s_j²`).
    pub fn divide_channels(&mut self, scales: &[f32]) -> Result<()> {
        check_channels("scales", self.channels(), scales.len())?;
        crate::scales::check_positive("scales", scales)?;
        for (j, &s) in scales.iter().enumerate() {
            let s64 = f64::from(s);
            self.abs_max[j] /= s;
            self.sum_square[j] /= s64 * s64;
            self.sum_abs[j] /= s64;
        }
        Ok(())
    }

    /// The weighted sums divided by the samples (per sample) or the tokens (per token).
    fn mean(&self, sums: &[f64]) -> Result<Vec<f64>> {
        if self.samples == 0 {
            return Err(SmoothError::NoSamples);
        }
        let n = match self.normalization {
            Normalization::PerSample => self.samples,
            Normalization::PerToken => self.tokens,
        } as f64;
        Ok(sums.iter().map(|s| s / n).collect())
    }
}

fn to_f32(values: impl IntoIterator<Item = f64>) -> Vec<f32> {
    values.into_iter().map(|v| v as f32).collect()
}

/// Rejects the first NaN or infinity, naming its channel (column).
fn check_finite_rows(x: &[f32], channels: usize) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(SmoothError::NonFinite {
            what: "activation sample".to_owned(),
            channel: i % channels.max(1),
            value: f64::from(x[i]),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_sample_normalisation_weighs_samples_equally() {
        let mut stats = ChannelStats::new(1);
        // A one-token sample of 2 and a four-token sample of 0: per-sample E[x²] is 4 and 0.
        stats.add_sample(&[2.0], 1).unwrap();
        stats.add_sample(&[0.0; 4], 4).unwrap();
        assert_eq!(stats.mean_square().unwrap(), vec![2.0]);
        assert_eq!(stats.mean_abs().unwrap(), vec![1.0]);
        assert_eq!(stats.abs_max(), &[2.0]);
        assert_eq!(
            stats.activation(ActivationStat::Rms).unwrap(),
            vec![2f32.sqrt()]
        );
    }

    #[test]
    fn bad_samples_are_rejected_and_leave_stats_unchanged() {
        let mut stats = ChannelStats::new(2);
        assert!(matches!(
            stats.add_sample(&[1.0, 2.0, 3.0], 2),
            Err(SmoothError::BufferSize { actual: 3, .. })
        ));
        assert_eq!(stats.add_sample(&[], 0), Err(SmoothError::EmptySample));
        assert!(matches!(
            stats.add_sample(&[1.0, f32::NAN], 1),
            Err(SmoothError::NonFinite { channel: 1, .. })
        ));
        assert_eq!(stats, ChannelStats::new(2));
        assert_eq!(stats.mean_square(), Err(SmoothError::NoSamples));
    }

    #[test]
    fn merge_refuses_other_widths() {
        let mut a = ChannelStats::new(2);
        assert!(matches!(
            a.merge(&ChannelStats::new(3)),
            Err(SmoothError::ChannelCount {
                expected: 2,
                actual: 3,
                ..
            })
        ));
    }

    #[test]
    fn merge_refuses_another_normalisation() {
        let mut a = ChannelStats::new(2);
        let b = ChannelStats::with_normalization(2, Normalization::PerToken);
        assert_eq!(
            a.merge(&b),
            Err(SmoothError::NormalizationMismatch {
                expected: Normalization::PerSample,
                actual: Normalization::PerToken,
            })
        );
    }

    #[test]
    fn per_token_normalisation_weighs_tokens_equally() {
        let mut stats = ChannelStats::with_normalization(1, Normalization::PerToken);
        // The samples of the per-sample test: E[x²] = 4/5 and E|x| = 2/5 over the five tokens.
        stats.add_sample(&[2.0], 1).unwrap();
        stats.add_sample(&[0.0; 4], 4).unwrap();
        assert_eq!((stats.samples(), stats.tokens()), (2, 5));
        assert_eq!(stats.mean_square().unwrap(), vec![4.0 / 5.0]);
        assert_eq!(stats.mean_abs().unwrap(), vec![2.0 / 5.0]);
    }

    /// A sample's rows summed in parts and combined give the statistics of adding it whole.
    #[test]
    fn combined_row_sums_are_one_sample() {
        let x = [1.0f32, -2.0, 3.0, 0.5, -4.0, 1.5];
        let mut whole = ChannelStats::new(2);
        whole.add_sample(&x, 3).unwrap();
        let mut sums = ChannelSums::new(2);
        sums.add_rows(&x[..2]);
        let mut rest = ChannelSums::new(2);
        rest.add_rows(&x[2..]);
        sums.combine(&rest).unwrap();
        assert_eq!(sums.rows(), 3);
        let mut parts = ChannelStats::new(2);
        parts.add_sums(&sums).unwrap();
        assert_eq!(parts, whole);
        assert!(sums.combine(&ChannelSums::new(3)).is_err());
    }

    #[test]
    fn bad_sums_are_rejected_and_leave_stats_unchanged() {
        let mut stats = ChannelStats::new(2);
        assert_eq!(
            stats.add_sums(&ChannelSums::new(2)),
            Err(SmoothError::EmptySample)
        );
        let mut sums = ChannelSums::new(2);
        sums.add_rows(&[1.0f32, f32::INFINITY]);
        assert!(matches!(
            stats.add_sums(&sums),
            Err(SmoothError::NonFinite { channel: 1, .. })
        ));
        assert!(matches!(
            stats.add_sums(&ChannelSums::new(3)),
            Err(SmoothError::ChannelCount { actual: 3, .. })
        ));
        assert_eq!(stats, ChannelStats::new(2));
    }
}
