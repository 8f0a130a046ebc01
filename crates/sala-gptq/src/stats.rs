//! The statistics of one layer input, shared by every linear that reads it: the full Hessian
//! (GPTQ) or the per-channel statistics (NVFP4), accumulated on the host in f64 (the default;
//! the Hessian's chunk products in f32) or on the device in f32 ([`QuantizeOptions::device_statistics`](crate::QuantizeOptions)).

use crate::error::PipelineError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use sala_hessian::layout::symmetric_from_lower;
use sala_hessian::{
    ChannelStats, ChannelStatsAccumulator, Hessian, HessianAccumulator, Normalization,
};
use sala_model::{gram_reference, row_weights, sample_runs, to_f32, FastOps, RowRun, TapRows};
use std::borrow::Cow;
use std::cell::OnceCell;

/// Which statistics a recipe needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatsKind {
    /// `H = E[XᵀX]` (GPTQ).
    Full,
    /// `E[x²]`, `E[|x|]`, `max|x|` per channel (NVFP4).
    Diagonal,
    /// Both (NVFP4 with GPTQ: the Hessian for the solver, `max|x|` for the input scale).
    FullAndChannels,
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
    /// A Hessian (`Full` or `DeviceFull`) and channel statistics of the same input.
    Both(Box<InputStats<B>>, Box<InputStats<B>>),
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
            (StatsKind::FullAndChannels, _) => InputStats::Both(
                Box::new(Self::new(StatsKind::Full, dim, on_device)?),
                Box::new(Self::new(StatsKind::Diagonal, dim, on_device)?),
            ),
            (StatsKind::Full, None) => {
                // f32 chunk products, f64 sums: twice the GEMM rate of f64 products, and the
                // rounding stays far below the damping (sala-hessian's tests bound it).
                InputStats::Full(
                    HessianAccumulator::new(dim, Normalization::PerSample)?.with_f32_products(),
                )
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
    #[cfg(test)]
    pub(crate) fn add(&mut self, x: &Tensor<B, 2>) -> Result<(), String> {
        let tokens = x.dims()[0];
        self.add_pack(x, &[tokens], 0..tokens, None)
            .map_err(|(_, e)| e)
    }

    /// Adds the inputs `x` `[rows, dim]`, rows `rows` of a pack of samples of `lengths`
    /// tokens lying back to back, each sample weighted by `1/its tokens` as if added alone: on
    /// the host sample by sample, on the device in one product with every row scaled by
    /// `√(1/T)` (`Σᵢ XᵢᵀXᵢ/Tᵢ = (DX)ᵀ(DX)`). The device statistics also take a pack in chunks of
    /// rows (a sample counts once, in the chunk where it starts); the host ones take whole
    /// packs. A failure names the sample (its index in `lengths`) when it is one sample's;
    /// `fast` computes the device Hessian's products where given.
    pub(crate) fn add_pack(
        &mut self,
        x: &Tensor<B, 2>,
        lengths: &[usize],
        rows: TapRows,
        fast: Option<&dyn FastOps<B>>,
    ) -> Result<(), (Option<usize>, String)> {
        self.add_pack_sharing(x, lengths, rows, fast, &OnceCell::new())
    }

    /// [`add_pack`](Self::add_pack), `x`'s host values downloaded at most once into `host`
    /// (both halves of [`InputStats::Both`] read the same copy).
    fn add_pack_sharing(
        &mut self,
        x: &Tensor<B, 2>,
        lengths: &[usize],
        rows: TapRows,
        fast: Option<&dyn FastOps<B>>,
        host: &OnceCell<Vec<f32>>,
    ) -> Result<(), (Option<usize>, String)> {
        if let InputStats::Both(hessian, channels) = self {
            hessian.add_pack_sharing(x, lengths, rows.clone(), fast, host)?;
            return channels.add_pack_sharing(x, lengths, rows, fast, host);
        }
        let [tokens, _] = x.dims();
        let pack: usize = lengths.iter().sum();
        if rows.len() != tokens || rows.end > pack {
            return Err((
                None,
                format!("rows {rows:?} of a pack of {lengths:?} tokens in a [{tokens}, _] input"),
            ));
        }
        let whole = rows.start == 0 && rows.end == pack;
        if !whole && matches!(self, InputStats::Full(_) | InputStats::Diagonal(_)) {
            return Err((
                None,
                format!(
                    "host statistics take whole packs, not rows {rows:?} (the MLP ran in \
                     chunks of rows: keep the statistics on the device)"
                ),
            ));
        }
        let (runs, starts) = sample_runs(lengths, rows);
        let host = || {
            host.get_or_init(|| {
                fast.and_then(|f| f.to_host(x))
                    .unwrap_or_else(|| host_values(x))
            })
        };
        match self {
            InputStats::Full(acc) => add_rows(host(), lengths, |s, rows, t| {
                acc.add_sample(rows, t)
                    .map_err(|e| (Some(s), e.to_string()))
            }),
            InputStats::Diagonal(acc) => add_rows(host(), lengths, |s, rows, t| {
                acc.add_sample(rows, t)
                    .map_err(|e| (Some(s), e.to_string()))
            }),
            InputStats::DeviceFull { sum, samples } => {
                // Moved out (not cloned) so that a fast path may accumulate in place.
                let placeholder = Tensor::zeros([1, 1], (&x.device(), DType::F32));
                let old = std::mem::replace(sum, placeholder);
                *sum = match fast {
                    Some(fast) => fast
                        .accumulate_gram(old, x, &runs)
                        .map_err(|e| (None, e.to_string()))?,
                    None => gram_reference(old, x, &runs),
                };
                *samples += starts as u64;
                Ok(())
            }
            InputStats::Both(..) => Ok(()),
            InputStats::DeviceDiagonal {
                square,
                abs,
                max,
                samples,
                tokens: seen,
            } => {
                let one_pass = match fast {
                    Some(fast) => fast
                        .channel_sums(x, &runs)
                        .map_err(|e| (None, e.to_string()))?,
                    None => None,
                };
                match one_pass {
                    Some([s, a, m]) => {
                        *square = square.clone() + s;
                        *abs = abs.clone() + a;
                        *max = max.clone().max_pair(m);
                    }
                    None => {
                        // In chunks of rows: three f32 copies of a whole `[T, 16384]` input
                        // would be 26 GB at 131,072 tokens (and each one over CubeCL's largest
                        // page but one).
                        let chunk = diagonal_chunk_rows(x.dims()[1]);
                        add_channel_sums([square, abs, max], x, &runs, chunk);
                    }
                }
                *samples += starts as u64;
                *seen += tokens as u64;
                Ok(())
            }
        }
    }

    /// The normalized statistics: device Hessians stay on the device, the rest is on the
    /// host. `input` names the input in errors.
    pub(crate) fn finalize(self, input: &str) -> Result<Finalized<B>, PipelineError> {
        let err = PipelineError::solve(input);
        let empty = || PipelineError::NoSamples(format!("no sample reached {input}"));
        Ok(match self {
            InputStats::Both(hessian, channels) => {
                let hessian = Box::new(hessian.finalize(input)?);
                match channels.finalize(input)? {
                    Finalized::Diagonal(channels) => Finalized::FullAndChannels(hessian, channels),
                    _ => {
                        return Err(PipelineError::Unsupported(format!(
                            "{input}: channel statistics expected"
                        )))
                    }
                }
            }
            InputStats::Full(acc) => Finalized::Full(acc.finalize().map_err(err)?),
            InputStats::Diagonal(acc) => Finalized::Diagonal(acc.finalize().map_err(err)?),
            InputStats::DeviceFull { sum, samples } => {
                if samples == 0 {
                    return Err(empty());
                }
                // One reduction decides in the common case; only a non-finite total (a bad
                // value, or an overflow of the sum itself) downloads the matrix to look.
                let total = to_f32(sum.clone()).sum().into_data().iter::<f32>().next();
                if !total.is_some_and(f32::is_finite) {
                    finite_values(sum.clone(), input)?;
                }
                Finalized::DeviceFull(sum.mul_scalar(1.0 / samples as f64))
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

/// Calls `add(sample, rows, tokens)` for each sample's rows of the pack's row-major `values`.
fn add_rows<E>(
    values: &[f32],
    lengths: &[usize],
    mut add: impl FnMut(usize, &[f32], usize) -> Result<(), E>,
) -> Result<(), E> {
    let width = values.len() / lengths.iter().sum::<usize>().max(1);
    let mut start = 0;
    for (sample, &len) in lengths.iter().enumerate() {
        add(sample, &values[start * width..(start + len) * width], len)?;
        start += len;
    }
    Ok(())
}

/// `[Σ w x², Σ w |x|, max |x|]` per column of `x` over `runs` by the chain of tensor ops
/// (each `[1, dim]` f32): what [`FastOps::channel_sums`] must agree with.
pub(crate) fn channel_sums_reference<B: Backend>(
    x: &Tensor<B, 2>,
    runs: &[RowRun],
) -> [Tensor<B, 2>; 3] {
    let dim = x.dims()[1];
    let zeros = || Tensor::<B, 2>::zeros([1, dim], (&x.device(), DType::F32));
    let (mut square, mut abs, mut max) = (zeros(), zeros(), zeros());
    add_channel_sums(
        [&mut square, &mut abs, &mut max],
        x,
        runs,
        diagonal_chunk_rows(dim),
    );
    [square, abs, max]
}

/// Adds `x`'s rows, `rows` at a time, to the device channel sums `[Σ w·x², Σ w·|x|, max |x|]`
/// (each `[1, dim]`), the rows of each run weighted by its weight.
fn add_channel_sums<B: Backend>(
    [square, abs, max]: [&mut Tensor<B, 2>; 3],
    x: &Tensor<B, 2>,
    runs: &[RowRun],
    rows: usize,
) {
    let [tokens, dim] = x.dims();
    let weights = row_weight_column::<B>(runs, &x.device());
    for start in (0..tokens).step_by(rows.max(1)) {
        let end = (start + rows).min(tokens);
        let a = to_f32(x.clone().slice([start..end, 0..dim])).abs();
        let weighted = a.clone() * weights.clone().slice([start..end, 0..1]);
        *square = square.clone() + (weighted.clone() * a.clone()).sum_dim(0);
        *abs = abs.clone() + weighted.sum_dim(0);
        *max = max.clone().max_pair(a.max_dim(0));
    }
}

/// Bytes of one f32 row chunk of the device channel statistics ([`diagonal_chunk_rows`]).
pub(crate) const DIAGONAL_CHUNK_BYTES: usize = 256 << 20;

/// Rows of a `dim`-wide input the device channel statistics take at a time: f32 copies of at
/// most [`DIAGONAL_CHUNK_BYTES`] (4096 rows of a 16384-wide input), at least one row.
pub(crate) fn diagonal_chunk_rows(dim: usize) -> usize {
    (DIAGONAL_CHUNK_BYTES / dim.max(1).saturating_mul(4)).max(1)
}

/// `[Σ rows, 1]`: each run's weight on each of its rows.
fn row_weight_column<B: Backend>(runs: &[RowRun], device: &B::Device) -> Tensor<B, 2> {
    let values = row_weights(runs);
    let rows = values.len();
    Tensor::from_data(TensorData::new(values, [rows, 1]), (device, DType::F32))
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
pub(crate) enum Finalized<B: Backend> {
    /// Full Hessian on the host (GPTQ).
    Full(Hessian<f64>),
    /// Full Hessian `[dim, dim]` f32 on the device, normalized (GPTQ with device statistics).
    DeviceFull(Tensor<B, 2>),
    /// Channel statistics (NVFP4).
    Diagonal(ChannelStats),
    /// A Hessian (`Full` or `DeviceFull`) and the channel statistics (NVFP4 with GPTQ).
    FullAndChannels(Box<Finalized<B>>, ChannelStats),
}

impl<B: Backend> Finalized<B> {
    /// Input channels.
    pub(crate) fn dim(&self) -> usize {
        match self {
            Finalized::Full(h) => h.dim(),
            Finalized::DeviceFull(h) => h.dims()[0],
            Finalized::Diagonal(s) => s.mean_square.len(),
            Finalized::FullAndChannels(h, _) => h.dim(),
        }
    }

    /// Per-channel RMS (`sqrt(E[x²])`), the original scripts' smoothing activation.
    pub(crate) fn rms(&self) -> Vec<f32> {
        let rms = |d: f64| d.max(0.0).sqrt() as f32;
        match self {
            Finalized::Full(h) => h.diagonal().into_iter().map(rms).collect(),
            Finalized::DeviceFull(h) => device_diagonal(h)
                .into_iter()
                .map(|d| rms(d as f64))
                .collect(),
            Finalized::Diagonal(s) => s.mean_square.iter().map(|&d| rms(d)).collect(),
            Finalized::FullAndChannels(h, _) => h.rms(),
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
                *h = Hessian::from_row_major(n, &m).map_err(PipelineError::solve(group))?;
            }
            Finalized::DeviceFull(h) => {
                let n = h.dims()[0];
                // The diagonal transform on ones checks the scales as the host transform does
                // and gives 1/s² per channel; the device applies 1/s on both sides.
                let mut inverse_squares = vec![1.0f64; n];
                sala_smooth::transform_hessian_diag(&mut inverse_squares, scales)
                    .map_err(smooth_err)?;
                let inverse: Vec<f32> = scales.iter().map(|&s| 1.0 / s).collect();
                let device = h.device();
                let r =
                    Tensor::<B, 1>::from_data(TensorData::new(inverse, [n]), (&device, DType::F32));
                let scaled = h.clone() * r.clone().reshape([n, 1]) * r.reshape([1, n]);
                *h = scaled;
            }
            Finalized::Diagonal(s) => rescale_channels(s, scales).map_err(smooth_err)?,
            Finalized::FullAndChannels(h, s) => {
                h.rescale(scales, group)?;
                rescale_channels(s, scales).map_err(smooth_err)?;
            }
        }
        Ok(())
    }

    /// Whether a full Hessian was accumulated (on the host or the device).
    pub(crate) fn has_hessian(&self) -> bool {
        !matches!(self, Finalized::Diagonal(_))
    }

    /// The channel statistics, where they were accumulated.
    pub(crate) fn channels(&self) -> Option<&ChannelStats> {
        match self {
            Finalized::Diagonal(s) | Finalized::FullAndChannels(_, s) => Some(s),
            Finalized::Full(_) | Finalized::DeviceFull(_) => None,
        }
    }

    /// The full Hessian if it is on the device (`[dim, dim]` f32, normalized).
    pub(crate) fn device_hessian(&self) -> Option<&Tensor<B, 2>> {
        match self {
            Finalized::DeviceFull(h) => Some(h),
            Finalized::FullAndChannels(h, _) => h.device_hessian(),
            Finalized::Full(_) | Finalized::Diagonal(_) => None,
        }
    }

    /// The full Hessian on the host in f64 (a device Hessian downloaded, its lower triangle
    /// mirrored); `None` for channel statistics.
    pub(crate) fn host_hessian(
        &self,
        input: &str,
    ) -> Result<Option<Cow<'_, Hessian<f64>>>, PipelineError> {
        match self {
            // Borrowed: a host Hessian is up to 2 GB (16384² f64), read by several linears.
            Finalized::Full(h) => Ok(Some(Cow::Borrowed(h))),
            Finalized::DeviceFull(h) => {
                let dim = h.dims()[0];
                let values = finite_values(h.clone(), input)?;
                let hessian =
                    mirrored_lower(&values, dim, 1).map_err(PipelineError::solve(input))?;
                Ok(Some(Cow::Owned(hessian)))
            }
            Finalized::Diagonal(_) => Ok(None),
            Finalized::FullAndChannels(h, _) => h.host_hessian(input),
        }
    }
}

/// `x ← x / s` on channel statistics: `E[x²] /= s²`, `max|x| /= s` (`E[|x|]` is not read
/// after smoothing).
fn rescale_channels(s: &mut ChannelStats, scales: &[f32]) -> sala_smooth::Result<()> {
    sala_smooth::transform_hessian_diag(&mut s.mean_square, scales)?;
    for (a, &sc) in s.abs_max.iter_mut().zip(scales) {
        *a /= sc;
    }
    Ok(())
}

/// The diagonal of a square device matrix, downloaded (`dim` values).
fn device_diagonal<B: Backend>(h: &Tensor<B, 2>) -> Vec<f32> {
    let n = h.dims()[0];
    let device = h.device();
    let index: Vec<i64> = (0..n as i64).map(|i| i * (n as i64 + 1)).collect();
    let index = Tensor::<B, 1, burn::tensor::Int>::from_data(TensorData::new(index, [n]), &device);
    to_f32(h.clone())
        .reshape([n * n])
        .select(0, index)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    fn sample(values: Vec<f32>, tokens: usize, dim: usize) -> Tensor<CpuBackend, 2> {
        Tensor::from_data(TensorData::new(values, [tokens, dim]), &Default::default())
    }

    fn finalize_both(
        kind: StatsKind,
        samples: &[Tensor<CpuBackend, 2>],
    ) -> (Finalized<CpuBackend>, Finalized<CpuBackend>) {
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
            (Finalized::Full(h), device @ Finalized::DeviceFull(_)) => {
                let d = device.host_hessian("x").unwrap().unwrap();
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

    /// Fast ops that count the host downloads they are asked for (and leave them to the
    /// caller's own download).
    #[derive(Debug, Default)]
    struct CountingDownloads(std::sync::atomic::AtomicUsize);

    impl FastOps<CpuBackend> for CountingDownloads {
        fn causal_attention(
            &self,
            _: Tensor<CpuBackend, 3>,
            _: Tensor<CpuBackend, 3>,
            _: Tensor<CpuBackend, 3>,
            _: &[usize],
            _: f32,
        ) -> sala_model::Result<Tensor<CpuBackend, 3>> {
            Err(sala_model::ModelError::InvalidInput("not used here".into()))
        }

        fn to_host(&self, _: &Tensor<CpuBackend, 2>) -> Option<Vec<f32>> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            None
        }
    }

    /// Host Hessian and host channel statistics of one input read one download per pack, and
    /// equal the two kinds accumulated apart.
    #[test]
    fn both_host_statistics_share_one_download_per_pack() {
        let lengths = [3usize, 5];
        let values = (0..8 * 4).map(|k| (k as f32 * 0.37).cos()).collect();
        let x = sample(values, 8, 4);
        let counter = CountingDownloads::default();
        let mut both = InputStats::<CpuBackend>::new(StatsKind::FullAndChannels, 4, None).unwrap();
        both.add_pack(&x, &lengths, 0..8, Some(&counter)).unwrap();
        assert_eq!(counter.0.load(std::sync::atomic::Ordering::Relaxed), 1);
        let mut apart = [StatsKind::Full, StatsKind::Diagonal]
            .map(|kind| InputStats::<CpuBackend>::new(kind, 4, None).unwrap());
        for stats in apart.iter_mut() {
            stats.add_pack(&x, &lengths, 0..8, None).unwrap();
        }
        let [full, diagonal] = apart.map(|stats| stats.finalize("x").unwrap());
        match (both.finalize("x").unwrap(), full, diagonal) {
            (
                Finalized::FullAndChannels(hessian, channels),
                Finalized::Full(h),
                Finalized::Diagonal(d),
            ) => {
                let Finalized::Full(hessian) = *hessian else {
                    panic!("host Hessian expected");
                };
                assert_eq!(hessian.to_row_major(), h.to_row_major());
                assert_eq!(channels.mean_square, d.mean_square);
                assert_eq!(channels.abs_max, d.abs_max);
            }
            _ => panic!("both kinds expected"),
        }
    }

    /// The device channel sums taken a few rows at a time (chunks straddling the samples'
    /// boundaries) equal the sums over the whole pack at once, up to f32 summation order.
    #[test]
    fn channel_sums_in_row_chunks_match_the_whole_pack() {
        let device = Default::default();
        let (dim, lengths) = (5, [7usize, 1, 12]);
        let tokens: usize = lengths.iter().sum();
        let values = (0..tokens * dim)
            .map(|k| ((k * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let x = sample(values, tokens, dim);
        let sums = |rows: usize| {
            let zeros = || Tensor::<CpuBackend, 2>::zeros([1, dim], (&device, DType::F32));
            let (mut square, mut abs, mut max) = (zeros(), zeros(), zeros());
            add_channel_sums(
                [&mut square, &mut abs, &mut max],
                &x,
                &sample_runs(&lengths, 0..lengths.iter().sum()).0,
                rows,
            );
            [square, abs, max].map(|t| t.into_data().to_vec::<f32>().unwrap())
        };
        let whole = sums(tokens);
        for rows in [1, 3, 8, tokens + 5] {
            let chunked = sums(rows);
            for (a, b) in whole.iter().zip(&chunked) {
                for (x, y) in a.iter().zip(b) {
                    assert!(
                        (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
                        "{rows} rows: {x} vs {y}"
                    );
                }
            }
            assert_eq!(
                whole[2], chunked[2],
                "the maximum does not depend on the order"
            );
        }
        assert_eq!(diagonal_chunk_rows(16384), 4096);
        assert_eq!(diagonal_chunk_rows(usize::MAX), 1);
    }

    /// `a` and `b` are statistics of one kind with the same values (sums up to rounding).
    fn assert_same_statistics(a: Finalized<CpuBackend>, b: Finalized<CpuBackend>) {
        match (a, b) {
            (a @ Finalized::Full(_), b @ Finalized::Full(_))
            | (a @ Finalized::DeviceFull(_), b @ Finalized::DeviceFull(_)) => close(
                &a.host_hessian("x").unwrap().unwrap().to_row_major(),
                &b.host_hessian("x").unwrap().unwrap().to_row_major(),
            ),
            (Finalized::Diagonal(a), Finalized::Diagonal(b)) => {
                close(&a.mean_square, &b.mean_square);
                close(&a.mean_abs, &b.mean_abs);
                assert_eq!(a.abs_max, b.abs_max);
                assert_eq!((a.samples, a.tokens), (b.samples, b.tokens));
            }
            _ => panic!("same kinds expected"),
        }
    }

    /// One pack of several samples gives the statistics of adding them one by one, on the
    /// host (sample by sample) and on the device (rows scaled by √(1/T)).
    #[test]
    fn a_pack_weighs_each_sample_as_if_added_alone() {
        let values: Vec<f32> = (0..27).map(|k| (k as f32 * 0.37).cos() * 3.0).collect();
        let lengths = [4, 1, 4];
        let pack = sample(values.clone(), 9, 3);
        let alone: Vec<_> = [0..4, 4..5, 5..9]
            .into_iter()
            .map(|rows| sample(values[rows.start * 3..rows.end * 3].to_vec(), rows.len(), 3))
            .collect();
        let device = Default::default();
        for kind in [StatsKind::Full, StatsKind::Diagonal] {
            for on_device in [None, Some(&device)] {
                let mut one_by_one = InputStats::<CpuBackend>::new(kind, 3, on_device).unwrap();
                for x in &alone {
                    one_by_one.add(x).unwrap();
                }
                let mut packed = InputStats::<CpuBackend>::new(kind, 3, on_device).unwrap();
                packed.add_pack(&pack, &lengths, 0..9, None).unwrap();
                assert_same_statistics(
                    one_by_one.finalize("x").unwrap(),
                    packed.finalize("x").unwrap(),
                );
            }
        }
    }

    /// The device statistics of a pack fed in chunks of rows that cut through its samples
    /// (as the MLP's row chunks feed `down_proj`'s) equal those of the whole pack; the host
    /// statistics refuse a chunk.
    #[test]
    fn device_statistics_take_a_pack_in_chunks_of_rows() {
        let values: Vec<f32> = (0..27).map(|k| (k as f32 * 0.61).sin() * 2.0).collect();
        let lengths = [4, 1, 4];
        let pack = sample(values.clone(), 9, 3);
        let device = Default::default();
        for kind in [StatsKind::Full, StatsKind::Diagonal] {
            let mut whole = InputStats::<CpuBackend>::new(kind, 3, Some(&device)).unwrap();
            whole.add_pack(&pack, &lengths, 0..9, None).unwrap();
            let mut chunked = InputStats::<CpuBackend>::new(kind, 3, Some(&device)).unwrap();
            for rows in [0..3, 3..7, 7..9] {
                let part = pack.clone().slice([rows.clone(), 0..3]);
                chunked.add_pack(&part, &lengths, rows, None).unwrap();
            }
            assert_same_statistics(whole.finalize("x").unwrap(), chunked.finalize("x").unwrap());
            let mut host = InputStats::<CpuBackend>::new(kind, 3, None).unwrap();
            let part = pack.clone().slice([3..7, 0..3]);
            let (_, message) = host.add_pack(&part, &lengths, 3..7, None).unwrap_err();
            assert!(message.contains("whole packs"), "{message}");
        }
    }

    /// A non-finite value in one sample of a pack names that sample (host statistics).
    #[test]
    fn a_bad_sample_in_a_pack_is_named() {
        let mut host = InputStats::<CpuBackend>::new(StatsKind::Full, 2, None).unwrap();
        let pack = sample(vec![1.0, 2.0, 3.0, f32::NAN, 5.0, 6.0], 3, 2);
        let (index, _) = host.add_pack(&pack, &[1, 2], 0..3, None).unwrap_err();
        assert_eq!(index, Some(1));
    }

    /// The smoothing activation and the Hessian transform of a device Hessian equal the
    /// host's; bad scales are refused alike.
    #[test]
    fn device_smoothing_transforms_match_the_host() {
        let samples = [
            sample((0..12).map(|k| (k as f32 * 0.7).sin()).collect(), 4, 3),
            sample((0..6).map(|k| k as f32 - 2.5).collect(), 2, 3),
        ];
        let (mut host, mut device) = finalize_both(StatsKind::Full, &samples);
        assert!(matches!(device, Finalized::DeviceFull(_)));
        let as_f64 = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
        close(&as_f64(host.rms()), &as_f64(device.rms()));
        let scales = [0.5, 2.0, 1.5];
        host.rescale(&scales, "g").unwrap();
        device.rescale(&scales, "g").unwrap();
        close(
            &host.host_hessian("x").unwrap().unwrap().to_row_major(),
            &device.host_hessian("x").unwrap().unwrap().to_row_major(),
        );
        for f in [&mut host, &mut device] {
            let err = f.rescale(&[1.0, 0.0, 1.0], "model.layers.3.input_layernorm");
            assert!(err
                .unwrap_err()
                .to_string()
                .contains("layers.3.input_layernorm"));
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
