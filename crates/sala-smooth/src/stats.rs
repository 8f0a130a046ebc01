//! Per-input-channel activation statistics, accumulated one calibration sample at a time.

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

/// Statistics of one activation tensor's channels (the input of a linear, or equivalently the
/// output of the norm or linear that feeds it), mergeable across samples and workers.
///
/// Means are *per-sample normalised*, as in the original scripts: each sample contributes
/// `Σ_tokens f(x) / n_tokens`, and the result is divided by the number of samples, so a
/// 128k-token sample weighs as much as a 100-token one. [`ChannelStats::mean_square`] is therefore
/// exactly `diag(H) / nsamples` of the scripts' Hessian `H = Σ_samples XᵀX / n_tokens`.
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelStats {
    abs_max: Vec<f32>,
    sum_mean_square: Vec<f64>,
    sum_mean_abs: Vec<f64>,
    samples: u64,
}

impl ChannelStats {
    /// Empty statistics for `channels` channels.
    pub fn new(channels: usize) -> Self {
        Self {
            abs_max: vec![0.0; channels],
            sum_mean_square: vec![0.0; channels],
            sum_mean_abs: vec![0.0; channels],
            samples: 0,
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
        check_finite_rows(x, channels)?;

        let mut square = vec![0.0f64; channels];
        let mut abs = vec![0.0f64; channels];
        // Every check is done: from here on the statistics are updated in place.
        for row in x.chunks_exact(channels.max(1)) {
            for (j, &v) in row.iter().enumerate() {
                let v64 = f64::from(v);
                square[j] += v64 * v64;
                abs[j] += v64.abs();
                self.abs_max[j] = self.abs_max[j].max(v.abs());
            }
        }
        let inv_tokens = 1.0 / tokens as f64;
        for j in 0..channels {
            self.sum_mean_square[j] += square[j] * inv_tokens;
            self.sum_mean_abs[j] += abs[j] * inv_tokens;
        }
        self.samples += 1;
        Ok(())
    }

    /// Adds the samples of `other` (accumulated elsewhere, e.g. by another worker).
    ///
    /// The result equals the statistics of both sample lists concatenated.
    pub fn merge(&mut self, other: &ChannelStats) -> Result<()> {
        check_channels("merged statistics", self.channels(), other.channels())?;
        for (a, b) in self.abs_max.iter_mut().zip(&other.abs_max) {
            *a = a.max(*b);
        }
        for (a, b) in self.sum_mean_square.iter_mut().zip(&other.sum_mean_square) {
            *a += b;
        }
        for (a, b) in self.sum_mean_abs.iter_mut().zip(&other.sum_mean_abs) {
            *a += b;
        }
        self.samples += other.samples;
        Ok(())
    }

    /// `max |x_j|` per channel over all tokens of all samples.
    pub fn abs_max(&self) -> &[f32] {
        &self.abs_max
    }

    /// Per-sample-normalised `E[x_j²]` per channel: `diag(H) / nsamples` in the scripts' terms.
    pub fn mean_square(&self) -> Result<Vec<f64>> {
        self.per_sample_mean(&self.sum_mean_square)
    }

    /// Per-sample-normalised `E[|x_j|]` per channel.
    pub fn mean_abs(&self) -> Result<Vec<f64>> {
        self.per_sample_mean(&self.sum_mean_abs)
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
            self.sum_mean_square[j] /= s64 * s64;
            self.sum_mean_abs[j] /= s64;
        }
        Ok(())
    }

    fn per_sample_mean(&self, sums: &[f64]) -> Result<Vec<f64>> {
        if self.samples == 0 {
            return Err(SmoothError::NoSamples);
        }
        let n = self.samples as f64;
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
}
