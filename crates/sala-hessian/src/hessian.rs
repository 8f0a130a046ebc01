//! The Hessian `H = Σ XᵀX` of a linear layer's inputs: its owned type, the streaming
//! accumulator (a blocked, parallel rank-k update on faer) and the diagonal-only statistics
//! of the NVFP4 recipe (sala-smooth's channel statistics behind this crate's conventions).

use faer::linalg::matmul::triangular::{matmul, BlockStructure};
use faer::{Accum, Mat, MatRef, Par};
use rayon::prelude::*;

use crate::error::{check_matrix, HessianError};
use crate::scalar::{Activation, HessianScalar};
use sala_smooth::{ChannelSums, SmoothError};

/// Tokens converted and multiplied per GEMM call: large enough for the GEMM to run at full
/// speed, small enough that the converted copy of the batch stays a few MiB.
const TOKENS_PER_CHUNK: usize = 512;

/// How the accumulated sums are normalized when the Hessian or the channel statistics are
/// finalized: sala-smooth's, so that both kinds of statistics share one definition.
pub use sala_smooth::Normalization;

/// A symmetric `[dim, dim]` Hessian in `f32` or `f64`.
///
/// Only the lower triangle (with the diagonal) is read by the factorization and the proxy
/// error; the accumulator fills both triangles.
#[derive(Debug, Clone, PartialEq)]
pub struct Hessian<T: HessianScalar> {
    matrix: Mat<T>,
}

impl<T: HessianScalar> Hessian<T> {
    /// Wraps a row-major `[dim, dim]` buffer (no symmetry check; non-finite values are
    /// reported when the Hessian is used).
    pub fn from_row_major(dim: usize, values: &[T]) -> Result<Self, HessianError> {
        check_matrix("hessian", values.len(), dim, dim)?;
        Ok(Self {
            matrix: crate::layout::square_from_row_major(values, dim)?,
        })
    }

    /// Wraps a faer matrix, which must be square and non-empty.
    pub fn from_mat(matrix: Mat<T>) -> Result<Self, HessianError> {
        if matrix.nrows() != matrix.ncols() {
            return Err(HessianError::DimensionMismatch {
                what: "hessian rows vs columns",
                left: matrix.nrows(),
                right: matrix.ncols(),
            });
        }
        if matrix.nrows() == 0 {
            return Err(HessianError::Empty { what: "hessian" });
        }
        Ok(Self { matrix })
    }

    /// The identity Hessian (GPTQ then reduces to round-to-nearest).
    pub fn identity(dim: usize) -> Self {
        Self {
            matrix: Mat::identity(dim, dim),
        }
    }

    /// The number of input channels.
    pub fn dim(&self) -> usize {
        self.matrix.nrows()
    }

    /// Element `(row, col)`.
    pub fn get(&self, row: usize, col: usize) -> T {
        self.matrix[(row, col)]
    }

    /// The diagonal, `E[x²]` per input channel under the accumulator's normalization.
    pub fn diagonal(&self) -> Vec<T> {
        (0..self.dim()).map(|i| self.matrix[(i, i)]).collect()
    }

    /// A faer view of the matrix.
    pub fn as_mat(&self) -> MatRef<'_, T> {
        self.matrix.as_ref()
    }

    /// The matrix as a row-major `[dim, dim]` vector.
    pub fn to_row_major(&self) -> Vec<T> {
        crate::layout::square_to_row_major(self.matrix.as_ref())
    }

    /// The first non-finite element of the lower triangle, as an error.
    pub(crate) fn check_finite(&self) -> Result<(), HessianError> {
        let n = self.dim();
        for col in 0..n {
            for row in col..n {
                let v: f64 = self.matrix[(row, col)].into();
                if !v.is_finite() {
                    return Err(HessianError::NonFinite {
                        what: "hessian",
                        row,
                        col,
                        value: v,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Streams activation batches `[tokens, dim]` into `Σ XᵀX` (one batch = one calibration
/// sample) and finalizes them into a [`Hessian`].
///
/// The product is a faer rank-k update of the lower triangle only (half the flops of a full
/// GEMM), computed in `T`, run on the rayon pool. Partial accumulators built on different
/// threads or devices combine with [`merge`](Self::merge).
///
/// With [`with_f32_products`](Self::with_f32_products), each chunk of at most 512 tokens is
/// multiplied in f32 (twice the GEMM rate of f64 on the same cores) and only the sum over
/// chunks is kept in `T`: the rounding of a 512-term f32 dot product (about 512 · 2⁻²⁴ relative
/// to the sum of absolute products) stays far below the damping the solver adds.
#[derive(Debug, Clone)]
pub struct HessianAccumulator<T: HessianScalar> {
    sum: Mat<T>,
    normalization: Normalization,
    samples: u64,
    tokens: u64,
    par: Par,
    /// Scratch `[dim, dim]` of the f32 chunk products, when they are asked for.
    f32_products: Option<Mat<f32>>,
}

impl<T: HessianScalar> HessianAccumulator<T> {
    /// An empty accumulator for `dim` input channels.
    pub fn new(dim: usize, normalization: Normalization) -> Result<Self, HessianError> {
        if dim == 0 {
            return Err(HessianError::Empty { what: "hessian" });
        }
        Ok(Self {
            sum: Mat::zeros(dim, dim),
            normalization,
            samples: 0,
            tokens: 0,
            par: Par::rayon(0),
            f32_products: None,
        })
    }

    /// Multiplies each chunk of tokens in f32 and adds the chunk's product into the `T` sum
    /// (see the type's documentation); for `T = f32` this changes nothing.
    pub fn with_f32_products(mut self) -> Self {
        let dim = self.dim();
        self.f32_products = Some(Mat::zeros(dim, dim));
        self
    }

    /// Sets the parallelism of the GEMM (default: every thread of the rayon pool).
    pub fn with_parallelism(mut self, par: Par) -> Self {
        self.par = par;
        self
    }

    /// Input channels.
    pub fn dim(&self) -> usize {
        self.sum.nrows()
    }

    /// Samples added so far (merged accumulators included).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Tokens added so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The normalization chosen at construction.
    pub fn normalization(&self) -> Normalization {
        self.normalization
    }

    /// Adds one calibration sample: a row-major `[tokens, dim]` activation batch.
    ///
    /// Non-finite activations are an error naming the token and channel; nothing is added
    /// then.
    pub fn add_sample<A: Activation>(
        &mut self,
        activations: &[A],
        tokens: usize,
    ) -> Result<(), HessianError> {
        let dim = self.dim();
        check_matrix("activations", activations.len(), tokens, dim)?;
        check_activations_finite(activations, dim)?;
        let alpha = match self.normalization {
            Normalization::PerSample => T::from_f64(1.0 / tokens as f64),
            Normalization::PerToken => T::from_f64(1.0),
        };
        if let Some(scratch) = self.f32_products.as_mut() {
            add_f32_products(&mut self.sum, scratch, activations, dim, alpha, self.par);
            self.samples += 1;
            self.tokens += tokens as u64;
            return Ok(());
        }
        let (sum, par) = (&mut self.sum, self.par);
        for_each_chunk(
            activations,
            dim,
            |a| T::from_f32(a.to_f32()),
            |x| {
                matmul(
                    sum.as_mut(),
                    BlockStructure::TriangularLower,
                    Accum::Add,
                    x.transpose(),
                    BlockStructure::Rectangular,
                    x,
                    BlockStructure::Rectangular,
                    alpha,
                    par,
                );
                sala_cpu::clear_upper_state_everywhere();
            },
        );
        self.samples += 1;
        self.tokens += tokens as u64;
        Ok(())
    }

    /// Adds another accumulator's sums (same dimension and normalization).
    pub fn merge(&mut self, other: &Self) -> Result<(), HessianError> {
        check_same_setup(
            (self.dim(), self.normalization),
            (other.dim(), other.normalization),
        )?;
        let n = self.dim();
        for col in 0..n {
            for row in col..n {
                self.sum[(row, col)] += other.sum[(row, col)];
            }
        }
        self.samples += other.samples;
        self.tokens += other.tokens;
        Ok(())
    }

    /// The normalized, symmetric Hessian. An accumulator that saw no sample is an error.
    pub fn finalize(&self) -> Result<Hessian<T>, HessianError> {
        let divisor = normalization_divisor(self.normalization, self.samples, self.tokens)?;
        let scale = T::from_f64(1.0 / divisor);
        let matrix = crate::layout::symmetric_from_lower(self.dim(), |row, col| {
            self.sum[(row, col)] * scale
        });
        Ok(Hessian { matrix })
    }
}

/// `sum += alpha · Σ_chunks XcᵀXc` (lower triangle), each chunk's product computed in f32 into
/// `scratch` and added in `T`, column by column in parallel.
fn add_f32_products<T: HessianScalar, A: Activation>(
    sum: &mut Mat<T>,
    scratch: &mut Mat<f32>,
    activations: &[A],
    dim: usize,
    alpha: T,
    par: Par,
) {
    for_each_chunk(
        activations,
        dim,
        |a| a.to_f32(),
        |x| {
            matmul(
                scratch.as_mut(),
                BlockStructure::TriangularLower,
                Accum::Replace,
                x.transpose(),
                BlockStructure::Rectangular,
                x,
                BlockStructure::Rectangular,
                1.0f32,
                par,
            );
            sala_cpu::clear_upper_state_everywhere();
            let scratch = &*scratch;
            sum.par_col_iter_mut()
                .enumerate()
                .for_each(|(col, mut column)| {
                    for row in col..dim {
                        let product = T::from_f32(scratch[(row, col)]);
                        column[row] += alpha * product;
                    }
                });
        },
    );
}

/// Calls `product` on each chunk of at most `TOKENS_PER_CHUNK` rows of the row-major
/// `[tokens, dim]` `activations`, converted by `convert` into one reused buffer and viewed as a
/// row-major `[rows, dim]` matrix.
fn for_each_chunk<S: Copy, A: Activation>(
    activations: &[A],
    dim: usize,
    convert: impl Fn(A) -> S,
    mut product: impl FnMut(MatRef<'_, S>),
) {
    let chunk_len = TOKENS_PER_CHUNK.min(activations.len() / dim.max(1)) * dim;
    let Some(&first) = activations.first() else {
        return;
    };
    let mut chunk = vec![convert(first); chunk_len];
    for rows in activations.chunks(TOKENS_PER_CHUNK * dim.max(1)) {
        let buf = &mut chunk[..rows.len()];
        for (dst, &src) in buf.iter_mut().zip(rows) {
            *dst = convert(src);
        }
        product(MatRef::from_row_major_slice(
            buf,
            rows.len() / dim.max(1),
            dim,
        ));
    }
}

/// Per-input-channel statistics of the activations (the diagonal-only variant of the
/// Hessian, plus what SmoothQuant / AWQ need), as [`ChannelStatsAccumulator::finalize`] gives
/// them: a plain record, so that statistics summed elsewhere (on a device) can be one too.
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelStats {
    /// `E[x²]` per channel, normalized like the full Hessian (equals its diagonal), `[dim]`.
    pub mean_square: Vec<f64>,
    /// `E[|x|]` per channel under the same normalization, `[dim]`.
    pub mean_abs: Vec<f64>,
    /// `max |x|` per channel over every token seen, `[dim]`.
    pub abs_max: Vec<f32>,
    /// Samples seen.
    pub samples: u64,
    /// Tokens seen.
    pub tokens: u64,
}

/// Streams activation batches into per-channel `Σx²`, `Σ|x|` and `max|x|`
/// (the diagonal Hessian `E[x²]` and the activation amax of the NVFP4 recipe).
///
/// An adapter of sala-smooth's [`sala_smooth::ChannelStats`], which does the arithmetic (sums
/// in f64, the normalization, merging) for both crates. This type adds this crate's
/// conventions: construction fails on zero channels, batches may be bf16 or f16, errors are
/// [`HessianError`]s naming the token and channel, and batches are split over the rayon pool
/// by tokens.
#[derive(Debug, Clone)]
pub struct ChannelStatsAccumulator {
    stats: sala_smooth::ChannelStats,
}

impl ChannelStatsAccumulator {
    /// An empty accumulator for `dim` channels.
    pub fn new(dim: usize, normalization: Normalization) -> Result<Self, HessianError> {
        if dim == 0 {
            return Err(HessianError::Empty {
                what: "channel statistics",
            });
        }
        Ok(Self {
            stats: sala_smooth::ChannelStats::with_normalization(dim, normalization),
        })
    }

    /// Channels.
    pub fn dim(&self) -> usize {
        self.stats.channels()
    }

    /// Adds one calibration sample, a row-major `[tokens, dim]` batch.
    pub fn add_sample<A: Activation>(
        &mut self,
        activations: &[A],
        tokens: usize,
    ) -> Result<(), HessianError> {
        let dim = self.dim();
        // Checked here rather than by sala-smooth so that the errors name the token too.
        check_matrix("activations", activations.len(), tokens, dim)?;
        check_activations_finite(activations, dim)?;
        let sums = activations
            .par_chunks(TOKENS_PER_CHUNK * dim)
            .fold(
                || ChannelSums::new(dim),
                |mut sums, rows| {
                    sums.add_rows(rows);
                    sums
                },
            )
            .map(Ok)
            .try_reduce(
                || ChannelSums::new(dim),
                |mut a, b| {
                    a.combine(&b)?;
                    Ok::<_, SmoothError>(a)
                },
            )?;
        self.stats.add_sums(&sums)?;
        Ok(())
    }

    /// Adds another accumulator's sums (same dimension and normalization).
    pub fn merge(&mut self, other: &Self) -> Result<(), HessianError> {
        // Checked here for the errors this crate's accumulators share.
        check_same_setup(
            (self.dim(), self.stats.normalization()),
            (other.dim(), other.stats.normalization()),
        )?;
        self.stats.merge(&other.stats)?;
        Ok(())
    }

    /// The normalized statistics. An accumulator that saw no sample is an error.
    pub fn finalize(&self) -> Result<ChannelStats, HessianError> {
        if self.stats.samples() == 0 {
            return Err(no_sample());
        }
        Ok(ChannelStats {
            mean_square: self.stats.mean_square()?,
            mean_abs: self.stats.mean_abs()?,
            abs_max: self.stats.abs_max().to_vec(),
            samples: self.stats.samples(),
            tokens: self.stats.tokens(),
        })
    }
}

fn check_activations_finite<A: Activation>(values: &[A], dim: usize) -> Result<(), HessianError> {
    match values.iter().position(|v| !v.to_f32().is_finite()) {
        None => Ok(()),
        Some(i) => Err(HessianError::NonFinite {
            what: "activations",
            row: i / dim,
            col: i % dim,
            value: values[i].to_f32() as f64,
        }),
    }
}

fn check_same_setup(
    a: (usize, Normalization),
    b: (usize, Normalization),
) -> Result<(), HessianError> {
    if a.0 != b.0 {
        return Err(HessianError::DimensionMismatch {
            what: "merged accumulators",
            left: a.0,
            right: b.0,
        });
    }
    if a.1 != b.1 {
        return Err(HessianError::MergeMismatch {
            reason: "different normalizations",
        });
    }
    Ok(())
}

fn normalization_divisor(
    normalization: Normalization,
    samples: u64,
    tokens: u64,
) -> Result<f64, HessianError> {
    if samples == 0 {
        return Err(no_sample());
    }
    Ok(match normalization {
        Normalization::PerSample => samples as f64,
        Normalization::PerToken => tokens as f64,
    })
}

/// The error of finalizing an accumulator that saw no sample.
fn no_sample() -> HessianError {
    HessianError::Empty {
        what: "accumulator (no sample added)",
    }
}
