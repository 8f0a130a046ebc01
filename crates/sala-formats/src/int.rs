//! Integer quantization (2–8 bits) with one scale and one zero point per group.
//!
//! `code = clamp(round_ties_even(x / scale) + zero, 0, maxq)` and `x̂ = scale · (code − zero)`,
//! as in IST-DASLab's `quant.py` (PyTorch's `round` is round-half-to-even, so `round_ties_even`
//! matches it bit for bit). Two symmetric grids are selectable, both with `zero = 2^(bits−1)`.

use crate::FormatError;
use rayon::prelude::*;

/// How a group's scale and zero point are derived from its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IntScheme {
    /// Symmetric, `scale = 2·absmax / (2^bits − 1)` (AutoGPTQ / IST GPTQ / compressed-tensors):
    /// 16 codes at 4 bits, a `+absmax` weight is clipped to `7·scale`.
    #[default]
    SymmetricIst,
    /// Symmetric, `scale = absmax / (2^(bits−1) − 1)` (the original SALA GPTQ script, `max/7`):
    /// `±absmax` land exactly on codes `zero ± 7`; code 0 is unused.
    SymmetricAbsMax,
    /// Asymmetric, `scale = (max − min) / (2^bits − 1)` over a range that includes 0,
    /// `zero = round(−min / scale)`.
    Asymmetric,
}

impl IntScheme {
    /// Whether the zero point is fixed at `2^(bits−1)`.
    pub fn is_symmetric(self) -> bool {
        !matches!(self, IntScheme::Asymmetric)
    }
}

/// Scale and zero point of one group of one output row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantParams {
    /// Step between adjacent codes (positive, finite).
    pub scale: f32,
    /// Code that represents 0.0 (an integer in `0..=maxq`).
    pub zero: u8,
}

/// An integer grid: a bit width and a scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntQuantizer {
    bits: u32,
    scheme: IntScheme,
}

/// Smallest scale ever produced: a group of tiny values still gets a finite step
/// (the original script's `clamp(min=1e-10)`).
pub const MIN_SCALE: f32 = 1e-10;

impl IntQuantizer {
    /// A quantizer for `bits` in 2..=8.
    pub fn new(bits: u32, scheme: IntScheme) -> Result<Self, FormatError> {
        if !(2..=8).contains(&bits) {
            return Err(FormatError::UnsupportedBits {
                bits,
                supported: "2..=8",
            });
        }
        Ok(Self { bits, scheme })
    }

    /// Bit width.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// Scheme.
    pub fn scheme(&self) -> IntScheme {
        self.scheme
    }

    /// Largest code, `2^bits − 1`.
    pub fn maxq(&self) -> u8 {
        ((1u32 << self.bits) - 1) as u8
    }

    /// The symmetric zero point, `2^(bits−1)`.
    pub fn symmetric_zero(&self) -> u8 {
        (1u32 << (self.bits - 1)) as u8
    }

    /// Scale and zero for a group from its minimum and maximum (IST `find_params`).
    ///
    /// The range always includes 0; an all-zero group gets the range ±1 (so its scale is finite).
    pub fn params_from_range(&self, min: f32, max: f32) -> QuantParams {
        let mut lo = min.min(0.0);
        let mut hi = max.max(0.0);
        let maxq = self.maxq() as f32;
        match self.scheme {
            IntScheme::SymmetricIst | IntScheme::SymmetricAbsMax => {
                hi = hi.max(-lo);
                if hi == 0.0 {
                    hi = 1.0;
                }
                let scale = match self.scheme {
                    IntScheme::SymmetricIst => 2.0 * hi / maxq,
                    _ => hi / (self.symmetric_zero() as f32 - 1.0),
                };
                QuantParams {
                    scale: scale.max(MIN_SCALE),
                    zero: self.symmetric_zero(),
                }
            }
            IntScheme::Asymmetric => {
                if lo == 0.0 && hi == 0.0 {
                    lo = -1.0;
                    hi = 1.0;
                }
                let scale = ((hi - lo) / maxq).max(MIN_SCALE);
                let zero = (-lo / scale).round_ties_even().clamp(0.0, maxq);
                QuantParams {
                    scale,
                    zero: zero as u8,
                }
            }
        }
    }

    /// Scale and zero for a group of values (min/max over the slice).
    pub fn params_for(&self, values: &[f32]) -> QuantParams {
        let (min, max) = min_max(values);
        self.params_from_range(min, max)
    }

    /// The code of `x` under `p`.
    #[inline]
    pub fn quantize(&self, x: f32, p: QuantParams) -> u8 {
        let q = round_ties_even_small(x / p.scale) + p.zero as f32;
        q.clamp(0.0, self.maxq() as f32) as u8
    }

    /// The value of `code` under `p`.
    #[inline]
    pub fn dequantize(code: u8, p: QuantParams) -> f32 {
        p.scale * (code as f32 - p.zero as f32)
    }

    /// Round trip: the grid point `x` maps to.
    #[inline]
    pub fn fake_quantize(&self, x: f32, p: QuantParams) -> f32 {
        Self::dequantize(self.quantize(x, p), p)
    }
}

/// A clipping search for a group's range (GPTQModel's `mse`, llm-compressor's MSE observer):
/// the group's `[min, max]` is shrunk to `p · [min, max]` for `p = 1 − i/grid`,
/// `i = 0 … ⌊max_shrink · grid⌋ − 1` (the first candidate is the plain range), and the
/// candidate with the least `Σₖ weightₖ · |wₖ − q(wₖ)|^norm` wins (ties keep the wider range).
/// Weights are per column (GPTQ passes `diag(H)`, so an error counts as much as its input's
/// energy); without them every column weighs 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipSearch {
    grid: u32,
    max_shrink: f32,
    norm: f32,
}

/// Only [`ClipSearch::new`] builds one, and it refuses NaN: equality is total.
impl Eq for ClipSearch {}

impl ClipSearch {
    /// The toolkit's default: grid 100, shrink up to 80 %, norm 2. With `diag(H)` as the
    /// column weights (as GPTQ passes them) the error is the diagonal part of the proxy
    /// output error, and every candidate is products, no `powf`.
    pub const DEFAULT: ClipSearch = ClipSearch {
        grid: 100,
        max_shrink: 0.8,
        norm: 2.0,
    };

    /// GPTQModel's defaults: grid 100, shrink up to 80 %, norm 2.4.
    pub const GPTQMODEL: ClipSearch = ClipSearch {
        grid: 100,
        max_shrink: 0.8,
        norm: 2.4,
    };

    /// A search over `⌊max_shrink · grid⌋` candidates (`grid ≥ 1`, `0 < max_shrink < 1`,
    /// `norm > 0`, all finite).
    pub fn new(grid: u32, max_shrink: f32, norm: f32) -> Result<Self, FormatError> {
        let valid =
            grid >= 1 && max_shrink > 0.0 && max_shrink < 1.0 && norm > 0.0 && norm.is_finite();
        if !valid {
            return Err(FormatError::InvalidClipSearch {
                grid,
                max_shrink,
                norm,
            });
        }
        Ok(Self {
            grid,
            max_shrink,
            norm,
        })
    }

    /// Candidate ranges tried.
    pub fn candidates(&self) -> usize {
        ((self.max_shrink * self.grid as f32).floor() as usize).max(1)
    }

    /// The error exponent.
    pub fn norm(&self) -> f32 {
        self.norm
    }

    /// The best parameters of `quantizer` for `values`, each column weighted by `weights`
    /// (same length as `values`) when given.
    ///
    /// Each candidate's error is summed in f32 over eight lanes; the norms 1 to 4 are
    /// products, any other one a `powf` per weight (several times slower).
    pub fn params(
        &self,
        quantizer: &IntQuantizer,
        values: &[f32],
        weights: Option<&[f32]>,
    ) -> QuantParams {
        let (min, max) = min_max(values);
        let power = Power::of(self.norm);
        let mut best = quantizer.params_from_range(min, max);
        let mut best_error = weighted_error(quantizer, best, power, values, weights);
        for i in 1..self.candidates() {
            let shrink = self.shrink(i);
            let p = quantizer.params_from_range(min * shrink, max * shrink);
            let e = weighted_error(quantizer, p, power, values, weights);
            if e < best_error {
                (best, best_error) = (p, e);
            }
        }
        best
    }

    /// The factor candidate `i` scales the range by, `1 − i / grid` (f32).
    pub fn shrink(&self, i: usize) -> f32 {
        1.0 - i as f32 / self.grid as f32
    }
}

/// `|d|^norm`, by products where the norm is a small integer.
#[derive(Debug, Clone, Copy)]
enum Power {
    One,
    Two,
    Three,
    Four,
    Real(f32),
}

impl Power {
    fn of(norm: f32) -> Self {
        match norm {
            1.0 => Power::One,
            2.0 => Power::Two,
            3.0 => Power::Three,
            4.0 => Power::Four,
            other => Power::Real(other),
        }
    }
}

/// Lanes of the clipping search's f32 sums (one AVX register).
const LANES: usize = 8;

/// `Σₖ weightₖ · |wₖ − q(wₖ)|^norm` under `p` (every weight 1 without `weights`): f32 terms
/// summed in [`LANES`] lanes, the lanes then added in order.
fn weighted_error(
    quantizer: &IntQuantizer,
    p: QuantParams,
    power: Power,
    values: &[f32],
    weights: Option<&[f32]>,
) -> f64 {
    // One loop per power, so that each is a straight vectorizable loop.
    match power {
        Power::One => lane_sums(quantizer, p, values, weights, |d| d),
        Power::Two => lane_sums(quantizer, p, values, weights, |d| each(d, |v| v * v)),
        Power::Three => lane_sums(quantizer, p, values, weights, |d| each(d, |v| v * v * v)),
        Power::Four => lane_sums(quantizer, p, values, weights, |d| {
            each(d, |v| (v * v) * (v * v))
        }),
        // libm's `powf` per weight: about ten times the products' cost (`wide`'s vector
        // `powf` measured no faster on the x86-64 baseline).
        Power::Real(norm) => {
            lane_sums(quantizer, p, values, weights, |d| each(d, |v| v.powf(norm)))
        }
    }
}

/// `f` of every lane.
#[inline(always)]
fn each(mut d: [f32; LANES], f: impl Fn(f32) -> f32) -> [f32; LANES] {
    for v in &mut d {
        *v = f(*v);
    }
    d
}

/// [`weighted_error`] with `pow` applied to [`LANES`] residuals at a time. Written for the
/// compiler to vectorize: no branch per weight (`quantize`'s clamps are min/max); the tail is
/// padded with residuals and weights of 0.
#[inline(always)]
fn lane_sums(
    quantizer: &IntQuantizer,
    p: QuantParams,
    values: &[f32],
    weights: Option<&[f32]>,
    pow: impl Fn([f32; LANES]) -> [f32; LANES],
) -> f64 {
    let (scale, zero, maxq) = (p.scale, p.zero as f32, quantizer.maxq() as f32);
    // `fake_quantize` without the u8 round trip: the same f32 value.
    let residual = |w: f32| {
        let code = (round_ties_even_small(w / scale) + zero).max(0.0).min(maxq);
        (w - scale * (code - zero)).abs()
    };
    let mut lanes = [0.0f32; LANES];
    let mut add = |chunk: &[f32; LANES], weight: &[f32; LANES]| {
        let mut d = [0.0f32; LANES];
        for k in 0..LANES {
            d[k] = residual(chunk[k]);
        }
        let terms = pow(d);
        for k in 0..LANES {
            lanes[k] += weight[k] * terms[k];
        }
    };
    // Without weights every column weighs 1 (an exact product).
    let ones = [1.0f32; LANES];
    let full = values.len() / LANES * LANES;
    for (k, chunk) in values[..full].chunks_exact(LANES).enumerate() {
        let weight = weights.map_or(&ones, |c| lane_array(&c[k * LANES..]));
        add(lane_array(chunk), weight);
    }
    if full < values.len() {
        // The tail, padded with residuals of 0 (the value 0 is a code) and weights of 0.
        let mut chunk = [0.0f32; LANES];
        let mut weight = [0.0f32; LANES];
        let tail = values.len() - full;
        chunk[..tail].copy_from_slice(&values[full..]);
        match weights {
            None => weight[..tail].fill(1.0),
            Some(c) => weight[..tail].copy_from_slice(&c[full..]),
        }
        add(&chunk, &weight);
    }
    lanes.iter().map(|&l| l as f64).sum()
}

/// The first [`LANES`] values of `values` as an array (`values` has at least that many).
#[inline(always)]
fn lane_array(values: &[f32]) -> &[f32; LANES] {
    values[..LANES].try_into().expect("LANES values")
}

/// `(min, max)` of `values`; `(0, 0)` when empty.
fn min_max(values: &[f32]) -> (f32, f32) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    values
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

/// `v.round_ties_even()` for the range codes live in, without a libm call.
///
/// The x86-64 baseline has no `roundss`, so `round_ties_even` is a function call per weight.
/// Adding and subtracting 1.5·2²³ rounds to an integer with the FPU's ties-to-even mode; it is
/// exact for |v| < 2²², so `v` is first clamped to ±1024 (every code of ≤ 8 bits lies inside,
/// and the caller clamps to the grid anyway). NaN stays NaN.
#[inline]
pub fn round_ties_even_small(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    let v = v.clamp(-1024.0, 1024.0);
    (v + MAGIC) - MAGIC
}

/// A row-major `[rows, cols]` matrix quantized group-wise along columns (round-to-nearest).
///
/// `params` is laid out `[groups, rows]` (the AutoGPTQ `scales` orientation: one row of `rows`
/// values per group), `codes` is `[rows, cols]`.
#[derive(Debug, Clone, PartialEq)]
pub struct IntGroupQuantized {
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// Columns per group.
    pub group_size: usize,
    /// The grid.
    pub quantizer: IntQuantizer,
    /// Codes, `[rows, cols]`.
    pub codes: Vec<u8>,
    /// Per-group parameters, `[groups, rows]`.
    pub params: Vec<QuantParams>,
}

impl IntGroupQuantized {
    /// Number of groups, `ceil(cols / group_size)`.
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(self.group_size)
    }

    /// Dequantizes to a row-major `[rows, cols]` matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let groups = self.groups();
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            for c in 0..self.cols {
                let p = self.params[(c / self.group_size) * self.rows + r];
                out.push(IntQuantizer::dequantize(self.codes[r * self.cols + c], p));
            }
        }
        debug_assert_eq!(self.params.len(), groups * self.rows);
        out
    }
}

/// Round-to-nearest group-wise quantization of a row-major `[rows, cols]` matrix.
///
/// `group_size` columns share one scale per row; the last group may be shorter. Non-finite
/// values are an error naming their position.
pub fn quantize_groupwise(
    weights: &[f32],
    rows: usize,
    cols: usize,
    group_size: usize,
    quantizer: IntQuantizer,
) -> Result<IntGroupQuantized, FormatError> {
    quantize_groupwise_with(weights, rows, cols, group_size, quantizer, None)
}

/// [`quantize_groupwise`] with each group's parameters chosen by a [`ClipSearch`], columns
/// weighted by `column_weights` `[cols]` when given.
pub fn quantize_groupwise_searched(
    weights: &[f32],
    rows: usize,
    cols: usize,
    group_size: usize,
    quantizer: IntQuantizer,
    search: &ClipSearch,
    column_weights: Option<&[f32]>,
) -> Result<IntGroupQuantized, FormatError> {
    if let Some(c) = column_weights {
        crate::shape::check_matrix("column weights", c.len(), 1, cols)?;
    }
    quantize_groupwise_with(
        weights,
        rows,
        cols,
        group_size,
        quantizer,
        Some((search, column_weights)),
    )
}

fn quantize_groupwise_with(
    weights: &[f32],
    rows: usize,
    cols: usize,
    group_size: usize,
    quantizer: IntQuantizer,
    search: Option<(&ClipSearch, Option<&[f32]>)>,
) -> Result<IntGroupQuantized, FormatError> {
    crate::shape::check_matrix("weights", weights.len(), rows, cols)?;
    if group_size == 0 {
        return Err(FormatError::ZeroGroupSize);
    }
    crate::shape::check_finite(weights, cols)?;
    let groups = cols.div_ceil(group_size);
    // Rows are independent: parameters and codes row by row in parallel, the parameters
    // then transposed to `[groups, rows]`.
    let mut codes = vec![0u8; rows * cols];
    let mut row_params = vec![
        QuantParams {
            scale: 1.0,
            zero: 0
        };
        rows * groups
    ];
    weights
        .par_chunks_exact(cols.max(1))
        .zip(codes.par_chunks_exact_mut(cols.max(1)))
        .zip(row_params.par_chunks_exact_mut(groups.max(1)))
        .for_each(|((row, out), params)| {
            for (g, ((wg, cg), p)) in row
                .chunks(group_size)
                .zip(out.chunks_mut(group_size))
                .zip(params.iter_mut())
                .enumerate()
            {
                *p = match search {
                    None => quantizer.params_for(wg),
                    Some((search, column_weights)) => {
                        let first = g * group_size;
                        let weights = column_weights.map(|c| &c[first..first + wg.len()]);
                        search.params(&quantizer, wg, weights)
                    }
                };
                for (c, &w) in cg.iter_mut().zip(wg) {
                    *c = quantizer.quantize(w, *p);
                }
            }
        });
    let params = (0..groups * rows)
        .map(|k| row_params[(k % rows) * groups + k / rows])
        .collect();
    Ok(IntGroupQuantized {
        rows,
        cols,
        group_size,
        quantizer,
        codes,
        params,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_search_shrinks_a_range_set_by_one_outlier_and_refuses_bad_settings() {
        let q = IntQuantizer::new(4, IntScheme::SymmetricIst).unwrap();
        // 31 values in ±0.1 and one at 1.0: the plain range wastes most codes on the outlier.
        let mut values: Vec<f32> = (0..31).map(|i| (i as f32 - 15.0) / 150.0).collect();
        values.push(1.0);
        let search = ClipSearch::GPTQMODEL;
        assert_eq!(search.candidates(), 80);
        let plain = q.params_for(&values);
        let searched = search.params(&q, &values, None);
        assert!(searched.scale < plain.scale, "{searched:?} vs {plain:?}");
        // A heavy weight on the outlier's column keeps it representable.
        let mut weights = vec![1.0f32; 32];
        weights[31] = 1e6;
        let kept = search.params(&q, &values, Some(&weights));
        assert!(kept.scale > searched.scale);
        for (grid, shrink, norm) in [
            (0, 0.5, 2.0),
            (10, 0.0, 2.0),
            (10, 1.0, 2.0),
            (10, 0.5, f32::NAN),
        ] {
            assert!(ClipSearch::new(grid, shrink, norm).is_err());
        }
    }

    #[test]
    fn the_two_symmetric_grids() {
        let ist = IntQuantizer::new(4, IntScheme::SymmetricIst).unwrap();
        let absmax = IntQuantizer::new(4, IntScheme::SymmetricAbsMax).unwrap();
        let p = ist.params_for(&[-1.5, 0.3, 3.0]);
        assert_eq!((p.scale, p.zero), (6.0 / 15.0, 8));
        assert_eq!(ist.quantize(3.0, p), 15); // 7.5 -> 8 (ties even) + 8 -> clamp 15
        let p = absmax.params_for(&[-1.5, 0.3, 3.0]);
        assert_eq!((p.scale, p.zero), (3.0 / 7.0, 8));
        assert_eq!(absmax.quantize(3.0, p), 15);
        assert_eq!(absmax.quantize(-3.0, p), 1);
    }

    #[test]
    fn asymmetric_range_includes_zero_and_all_zero_groups_are_finite() {
        let q = IntQuantizer::new(4, IntScheme::Asymmetric).unwrap();
        let p = q.params_for(&[1.0, 2.0, 3.0]);
        assert_eq!(p.scale, 3.0 / 15.0);
        assert_eq!(p.zero, 0);
        let p = q.params_for(&[0.0; 4]);
        assert!(p.scale.is_finite() && p.scale > 0.0);
        assert_eq!(q.fake_quantize(0.0, p), 0.0);
    }

    #[test]
    fn ties_round_to_even() {
        let q = IntQuantizer::new(4, IntScheme::SymmetricIst).unwrap();
        let p = QuantParams {
            scale: 1.0,
            zero: 8,
        };
        assert_eq!(q.quantize(0.5, p), 8);
        assert_eq!(q.quantize(1.5, p), 10);
        assert_eq!(q.quantize(-2.5, p), 6);
    }

    #[test]
    fn fast_rounding_equals_round_ties_even() {
        let mut v = -1030.0f32;
        while v < 1030.0 {
            for x in [v, v + 0.5, v + 0.25, v + 0.499_999_97, v - 1e-3] {
                let want = x.clamp(-1024.0, 1024.0).round_ties_even();
                assert_eq!(round_ties_even_small(x), want, "{x}");
            }
            v += 0.75;
        }
        assert!(round_ties_even_small(f32::NAN).is_nan());
    }

    #[test]
    fn bits_out_of_range_are_rejected() {
        assert!(IntQuantizer::new(1, IntScheme::Asymmetric).is_err());
        assert!(IntQuantizer::new(9, IntScheme::Asymmetric).is_err());
    }

    #[test]
    fn groupwise_rejects_nan_with_position() {
        let q = IntQuantizer::new(4, IntScheme::SymmetricIst).unwrap();
        let mut w = vec![0.5f32; 2 * 8];
        w[11] = f32::NAN;
        let err = quantize_groupwise(&w, 2, 8, 4, q).unwrap_err();
        assert!(matches!(err, FormatError::NonFinite { row: 1, col: 3, .. }));
    }
}
