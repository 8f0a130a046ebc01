//! The statistics of one layer input, shared by every linear that reads it: the full Hessian
//! (GPTQ) or the per-channel statistics (NVFP4), accumulated on the host in f64 (the default)
//! or on the device in f32 ([`QuantizeOptions::device_statistics`](crate::QuantizeOptions)).

use crate::error::PipelineError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use sala_hessian::layout::symmetric_from_lower;
use sala_hessian::{
    ChannelStats, ChannelStatsAccumulator, Hessian, HessianAccumulator, Normalization,
};
use sala_model::to_f32;

/// Which statistics a recipe needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatsKind {
    /// `H = E[XᵀX]` (GPTQ).
    Full,
    /// `E[x²]`, `E[|x|]`, `max|x|` per channel (NVFP4).
    Diagonal,
}

/// Running sums of one input's statistics. Every sample weighs the same
/// ([`Normalization::PerSample`]: each sample's sums are divided by its token count).
pub(crate) enum InputStats<B: Backend> {
    /// Host f64 Hessian.
    Full(HessianAccumulator<f64>),
    /// Host f64 channel statistics.
    Diagonal(ChannelStatsAccumulator),
    /// Device f32 `Σ XᵀX / tokens`, `[dim, dim]`.
    DeviceFull { sum: Tensor<B, 2>, samples: u64 },
    /// Device f32 `Σ x² / tokens`, `Σ |x| / tokens`, `max |x|`, each `[1, dim]`.
    DeviceDiagonal {
        square: Tensor<B, 2>,
        abs: Tensor<B, 2>,
        max: Tensor<B, 2>,
        samples: u64,
        tokens: u64,
    },
}

impl<B: Backend> InputStats<B> {
    /// Empty statistics of `kind` for `dim` channels, on the host or on `device`.
    pub(crate) fn new(
        kind: StatsKind,
        dim: usize,
        on_device: Option<&B::Device>,
    ) -> Result<Self, sala_hessian::HessianError> {
        let zeros =
            |shape: [usize; 2], device: &B::Device| Tensor::zeros(shape, (device, DType::F32));
        Ok(match (kind, on_device) {
            (StatsKind::Full, None) => {
                InputStats::Full(HessianAccumulator::new(dim, Normalization::PerSample)?)
            }
            (StatsKind::Diagonal, None) => {
                InputStats::Diagonal(ChannelStatsAccumulator::new(dim, Normalization::PerSample)?)
            }
            (StatsKind::Full, Some(device)) => InputStats::DeviceFull {
                sum: zeros([dim, dim], device),
                samples: 0,
            },
            (StatsKind::Diagonal, Some(device)) => InputStats::DeviceDiagonal {
                square: zeros([1, dim], device),
                abs: zeros([1, dim], device),
                max: zeros([1, dim], device),
                samples: 0,
                tokens: 0,
            },
        })
    }

    /// Adds one sample's input `x` `[tokens, dim]`: downloaded for host statistics, in f32 on
    /// the device otherwise.
    pub(crate) fn add(&mut self, x: &Tensor<B, 2>) -> Result<(), sala_hessian::HessianError> {
        let [tokens, _] = x.dims();
        let weight = 1.0 / tokens as f64;
        match self {
            InputStats::Full(acc) => acc.add_sample(&host_values(x), tokens),
            InputStats::Diagonal(acc) => acc.add_sample(&host_values(x), tokens),
            InputStats::DeviceFull { sum, samples } => {
                let x = to_f32(x.clone());
                let xtx = x.clone().transpose().matmul(x).mul_scalar(weight);
                *sum = sum.clone() + xtx;
                *samples += 1;
                Ok(())
            }
            InputStats::DeviceDiagonal {
                square,
                abs,
                max,
                samples,
                tokens: seen,
            } => {
                let a = to_f32(x.clone()).abs();
                *square = square.clone() + (a.clone() * a.clone()).sum_dim(0).mul_scalar(weight);
                *abs = abs.clone() + a.clone().sum_dim(0).mul_scalar(weight);
                *max = max.clone().max_pair(a.max_dim(0));
                *samples += 1;
                *seen += tokens as u64;
                Ok(())
            }
        }
    }

    /// The normalized statistics on the host. `input` names the input in errors.
    pub(crate) fn finalize(self, input: &str) -> Result<Finalized, PipelineError> {
        let err = |source| PipelineError::Solve {
            linear: input.to_owned(),
            source,
        };
        let empty = || PipelineError::NoSamples(format!("no sample reached {input}"));
        Ok(match self {
            InputStats::Full(acc) => Finalized::Full(acc.finalize().map_err(err)?),
            InputStats::Diagonal(acc) => Finalized::Diagonal(acc.finalize().map_err(err)?),
            InputStats::DeviceFull { sum, samples } => {
                if samples == 0 {
                    return Err(empty());
                }
                let dim = sum.dims()[0];
                let values = finite_values(sum, input)?;
                Finalized::Full(mirrored_lower(&values, dim, samples).map_err(err)?)
            }
            InputStats::DeviceDiagonal {
                square,
                abs,
                max,
                samples,
                tokens,
            } => {
                if samples == 0 {
                    return Err(empty());
                }
                let mean = |t: Tensor<B, 2>| -> Result<Vec<f64>, PipelineError> {
                    let v = finite_values(t, input)?;
                    Ok(v.iter().map(|&s| s as f64 / samples as f64).collect())
                };
                Finalized::Diagonal(ChannelStats {
                    mean_square: mean(square)?,
                    mean_abs: mean(abs)?,
                    abs_max: finite_values(max, input)?,
                    samples,
                    tokens,
                })
            }
        })
    }
}

/// The f64 Hessian `sum / samples` from the row-major f32 `sum` `[dim, dim]`, its lower
/// triangle mirrored (the device GEMM need not be bit-symmetric), as the host accumulator
/// finalizes. Filled in parallel tiles, straight into the Hessian's own matrix: at
/// width 16384 this is 268 M values.
fn mirrored_lower(
    sum: &[f32],
    dim: usize,
    samples: u64,
) -> Result<Hessian<f64>, sala_hessian::HessianError> {
    let scale = 1.0 / samples as f64;
    Hessian::from_mat(symmetric_from_lower(dim, |row, col| {
        sum[row * dim + col] as f64 * scale
    }))
}

/// The input as host f32 values (the statistics accept bf16-valued f32 exactly).
fn host_values<B: Backend>(x: &Tensor<B, 2>) -> Vec<f32> {
    x.clone()
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap_or_default()
}

/// Downloads `t` and refuses a non-finite value (an activation that overflowed).
fn finite_values<B: Backend, const D: usize>(
    t: Tensor<B, D>,
    input: &str,
) -> Result<Vec<f32>, PipelineError> {
    let v = t
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap_or_default();
    match v.iter().position(|x| !x.is_finite()) {
        None => Ok(v),
        Some(index) => Err(PipelineError::NonFiniteStatistics {
            input: input.to_owned(),
            index,
        }),
    }
}

/// The finalized statistics of one input, after smoothing transforms.
pub(crate) enum Finalized {
    /// Full Hessian (GPTQ).
    Full(Hessian<f64>),
    /// Channel statistics (NVFP4).
    Diagonal(ChannelStats),
}

impl Finalized {
    /// Input channels.
    pub(crate) fn dim(&self) -> usize {
        match self {
            Finalized::Full(h) => h.dim(),
            Finalized::Diagonal(s) => s.mean_square.len(),
        }
    }

    /// Per-channel RMS (`sqrt(E[x²])`), the original scripts' smoothing activation.
    pub(crate) fn rms(&self) -> Vec<f32> {
        match self {
            Finalized::Full(h) => h
                .diagonal()
                .iter()
                .map(|&d| d.max(0.0).sqrt() as f32)
                .collect(),
            Finalized::Diagonal(s) => s
                .mean_square
                .iter()
                .map(|&d| d.max(0.0).sqrt() as f32)
                .collect(),
        }
    }

    /// `x ← x / s` per channel: `H ← diag(1/s) H diag(1/s)`, `E[x²] /= s²`, `max|x| /= s`.
    pub(crate) fn rescale(&mut self, scales: &[f32], group: &str) -> Result<(), PipelineError> {
        let smooth_err = |source| PipelineError::Smooth {
            group: group.to_owned(),
            source,
        };
        match self {
            Finalized::Full(h) => {
                let n = h.dim();
                let mut m = h.to_row_major();
                sala_smooth::transform_hessian(&mut m, n, scales).map_err(smooth_err)?;
                *h = Hessian::from_row_major(n, &m).map_err(|source| PipelineError::Solve {
                    linear: group.to_owned(),
                    source,
                })?;
            }
            Finalized::Diagonal(s) => {
                sala_smooth::transform_hessian_diag(&mut s.mean_square, scales)
                    .map_err(smooth_err)?;
                for (a, &sc) in s.abs_max.iter_mut().zip(scales) {
                    *a /= sc;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use burn::tensor::TensorData;

    fn sample(values: Vec<f32>, tokens: usize, dim: usize) -> Tensor<CpuBackend, 2> {
        Tensor::from_data(TensorData::new(values, [tokens, dim]), &Default::default())
    }

    fn finalize_both(kind: StatsKind, samples: &[Tensor<CpuBackend, 2>]) -> (Finalized, Finalized) {
        let dim = samples[0].dims()[1];
        let device = Default::default();
        let mut host = InputStats::<CpuBackend>::new(kind, dim, None).unwrap();
        let mut dev = InputStats::<CpuBackend>::new(kind, dim, Some(&device)).unwrap();
        for x in samples {
            host.add(x).unwrap();
            dev.add(x).unwrap();
        }
        (host.finalize("x").unwrap(), dev.finalize("x").unwrap())
    }

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "{x} vs {y}");
        }
    }

    #[test]
    fn device_statistics_match_the_host_accumulators() {
        let samples = [
            sample((0..12).map(|k| (k as f32 * 0.7).sin()).collect(), 4, 3),
            sample((0..6).map(|k| k as f32 - 2.5).collect(), 2, 3),
        ];
        match finalize_both(StatsKind::Full, &samples) {
            (Finalized::Full(h), Finalized::Full(d)) => {
                assert_eq!(d.dim(), 3);
                close(&h.to_row_major(), &d.to_row_major());
            }
            _ => panic!("full statistics expected"),
        }
        match finalize_both(StatsKind::Diagonal, &samples) {
            (Finalized::Diagonal(h), Finalized::Diagonal(d)) => {
                close(&h.mean_square, &d.mean_square);
                close(&h.mean_abs, &d.mean_abs);
                assert_eq!(h.abs_max, d.abs_max);
                assert_eq!((h.samples, h.tokens), (d.samples, d.tokens));
            }
            _ => panic!("diagonal statistics expected"),
        }
    }

    #[test]
    fn non_finite_device_statistics_name_the_input() {
        let device = Default::default();
        let mut dev = InputStats::<CpuBackend>::new(StatsKind::Full, 2, Some(&device)).unwrap();
        dev.add(&sample(vec![1.0, f32::INFINITY], 1, 2)).unwrap();
        let err = dev.finalize("model.layers.0.mlp.down_proj").err().unwrap();
        assert!(err.to_string().contains("mlp.down_proj"), "{err}");
    }
}
