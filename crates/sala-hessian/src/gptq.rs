//! The GPTQ solver for one linear `W [out, in]` given its Hessian (IST-DASLab's algorithm:
//! lazy blocks, group parameters at group start, act-order, static groups).
//!
//! Every output row is independent in GPTQ (each row only meets the shared factor `U`), so
//! the in-block column loop runs in parallel over rows, and the lazy update of the trailing
//! columns, `W[:, end:] -= Err · U[blk, end:]`, is one faer GEMM per block.

use faer::linalg::matmul::matmul;
use std::borrow::Cow;
use std::ops::Range;

use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;
use sala_formats::{ClipSearch, IntQuantizer, QuantParams};

use crate::error::HessianError;
use crate::hessian::Hessian;
use crate::inverse::{
    dead_columns, diagonal_f64, mean_fixed_diagonal, CholeskyInverse, Damping, UpperFactorizer,
};
use crate::quantized::{check_weights, dequantize, proxy_error, IntGrid, Method, QuantizedLinear};
use crate::rtn::Rtn;
use crate::scalar::HessianScalar;

/// What to do when no damping of the schedule makes the Hessian factorable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Return [`HessianError::NotPositiveDefinite`].
    #[default]
    Error,
    /// Quantize with round-to-nearest instead (llm-compressor's behaviour); the result says
    /// [`Method::RtnFallback`].
    Rtn,
}

/// GPTQ options. Defaults: 4-bit symmetric (IST grid), groups of 128, lazy blocks of 128,
/// no act-order, damping 0.01, errors on failure, proxy error computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptqConfig {
    /// Bits, scheme, group size.
    pub grid: IntGrid,
    /// Columns per lazy block (default 128); 1 disables lazy batching. Blocks are shortened
    /// when needed so that every group starts at a block start or lies inside one block.
    pub block_size: usize,
    /// Process columns by decreasing `diag(H)` (desc_act).
    pub act_order: bool,
    /// With groups: compute every group's parameters up front from the original weight, so
    /// that act-order keeps a monotone `g_idx`.
    pub static_groups: bool,
    /// Group-aware reordering (GAR, GPTQModel's `act_group_aware`): whole groups by
    /// decreasing `max diag(H)`, the columns inside each by decreasing `diag(H)`; a partial
    /// last group stays last. Every group keeps its own columns, so the result has the natural
    /// `g_idx` (desc_act off: every loader serves it). Needs groups; excludes `act_order`.
    pub group_aware_order: bool,
    /// Damping and retries of the Cholesky inverse.
    pub damping: Damping,
    /// What to do when the inverse fails.
    pub on_failure: FailurePolicy,
    /// Compute `tr((W − Q) H (W − Q)ᵀ)` (an extra `out·in²` flops).
    pub proxy_error: bool,
}

impl Default for GptqConfig {
    fn default() -> Self {
        Self {
            grid: IntGrid::default(),
            block_size: 128,
            act_order: false,
            static_groups: false,
            group_aware_order: false,
            damping: Damping::default(),
            on_failure: FailurePolicy::Error,
            proxy_error: true,
        }
    }
}

/// A validated GPTQ solver.
#[derive(Debug, Clone)]
pub struct Gptq {
    config: GptqConfig,
    quantizer: IntQuantizer,
}

/// GPTQ's column loop over a prepared problem: the part of [`Gptq::solve`] that a device can
/// run ([`Gptq::solve_with_loop`]). Implementations: [`BlockedLoop`] (the host's lazy-block
/// loop, the default), [`SequentialLoop`](crate::reference::SequentialLoop) (the textbook order) and the GPU kernels
/// of `sala-kernels`.
pub trait GptqColumnLoop {
    /// Quantizes every column of `w` `[out, inp]` (row-major f32, loop order: dead columns
    /// zeroed, act-order applied; a workspace the loop may overwrite) against the factor and
    /// grid of `problem`.
    fn run(
        &self,
        problem: &ColumnProblem<'_>,
        w: &mut [f32],
    ) -> Result<ColumnSolution, HessianError>;

    /// Who factors the damped Hessian: `None` (the default) is faer on the host.
    fn factorizer(&self) -> Option<&dyn UpperFactorizer> {
        None
    }
}

/// The host's lazy-block loop (faer GEMMs, rows in parallel with rayon): inner blocks of the
/// configured size update their outer block (8 inner blocks) at once, the columns after it
/// get one GEMM per outer block.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockedLoop;

impl GptqColumnLoop for BlockedLoop {
    fn run(
        &self,
        problem: &ColumnProblem<'_>,
        w: &mut [f32],
    ) -> Result<ColumnSolution, HessianError> {
        let (gs, inp) = (problem.group_size, problem.inp);
        let use_static = problem.static_groups.is_some();
        let block = effective_block(problem.block_size, gs, inp, use_static);
        // A group that starts in one outer block and ends in the next would miss the first
        // block's pending updates: only blocks contain whole groups then.
        let whole_groups_in_blocks = use_static || gs >= inp || gs <= block;
        // `block_size = 1` means no lazy batching at all (the textbook order).
        let outer = if whole_groups_in_blocks && block > 1 {
            block * OUTER_BLOCKS
        } else {
            block
        };
        Ok(blocked_loop(problem, w, block, outer))
    }
}

/// The column loop's input, in loop (permuted) order.
#[derive(Clone, Copy)]
pub struct ColumnProblem<'a> {
    /// The integer grid.
    pub quantizer: IntQuantizer,
    /// Output rows.
    pub out: usize,
    /// Input columns.
    pub inp: usize,
    /// Columns per group (`inp` when per-channel).
    pub group_size: usize,
    /// The configured lazy block (columns); loops shorten it so that groups stay whole.
    pub block_size: usize,
    /// `U`, the upper Cholesky factor of the damped inverse Hessian, `[inp, inp]`.
    pub upper: MatRef<'a, f32>,
    /// Static groups: parameters `[out, groups]` and the group of each loop position.
    pub static_groups: Option<(&'a [QuantParams], &'a [usize])>,
    /// Dynamic groups chosen by a clipping search, each column's error weighted by
    /// `diag(H)` in loop order (`[inp]`); `None`: the plain min/max range.
    pub clip: Option<(ClipSearch, &'a [f32])>,
}

impl ColumnProblem<'_> {
    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.inp.div_ceil(self.group_size)
    }
}

/// The column loop's output, in loop order. `P` is the grid's parameter of one row's group
/// (an integer grid's [`QuantParams`], an NVFP4 block's E4M3 scale byte).
#[derive(Debug, Clone, PartialEq)]
pub struct ColumnSolution<P = QuantParams> {
    /// Codes, `[out, inp]`.
    pub codes: Vec<u8>,
    /// Dynamic group parameters `[out, groups]` (unused with static groups).
    pub params_rows: Vec<P>,
    /// `Σ_rows (w − q)²/(2·U[c,c]²)` of each column, `[inp]`.
    pub column_loss: Vec<f64>,
}

impl ColumnSolution {
    /// All codes 0, all parameters `(1, 0)`, no loss: the loops' starting point.
    pub fn new(problem: &ColumnProblem<'_>) -> Self {
        let placeholder = QuantParams {
            scale: 1.0,
            zero: 0,
        };
        ColumnSolution::filled(problem.out, problem.inp, problem.groups(), placeholder)
    }
}

impl<P: Copy> ColumnSolution<P> {
    /// All codes 0, every group's parameter `placeholder`, no loss.
    pub(crate) fn filled(out: usize, inp: usize, groups: usize, placeholder: P) -> Self {
        Self {
            codes: vec![0; out * inp],
            params_rows: vec![placeholder; out * groups],
            column_loss: vec![0.0; inp],
        }
    }
}

/// What GPTQ's column loop needs of a grid: the problem's shape and factor, and how one
/// weight is rounded (the integer grids of [`ColumnProblem`], NVFP4's blocks in
/// [`crate::nvfp4_gptq`]). The loops ([`BlockedLoop`], the textbook one in [`crate::reference`])
/// are written once against it.
pub(crate) trait ColumnGrid: Sync {
    /// A group's parameter in one row.
    type Param: Copy + Send + Sync;
    /// Output rows.
    fn out(&self) -> usize;
    /// Input columns.
    fn inp(&self) -> usize;
    /// Groups (parameters) per row.
    fn groups(&self) -> usize;
    /// The parameters a solution starts from.
    fn placeholder(&self) -> Self::Param;
    /// `U`, `[inp, inp]`.
    fn upper(&self) -> MatRef<'_, f32>;
    /// The code and the dequantized value of `w_row[c]` (row `r`), setting the row's group
    /// parameter at a group start. `w_row` holds the row's error-updated weights, at least up
    /// to the end of the current group.
    fn round(&self, r: usize, c: usize, w_row: &[f32], params_row: &mut [Self::Param])
        -> (u8, f32);
}

impl ColumnGrid for ColumnProblem<'_> {
    type Param = QuantParams;

    fn out(&self) -> usize {
        self.out
    }

    fn inp(&self) -> usize {
        self.inp
    }

    fn groups(&self) -> usize {
        ColumnProblem::groups(self)
    }

    fn placeholder(&self) -> QuantParams {
        QuantParams {
            scale: 1.0,
            zero: 0,
        }
    }

    fn upper(&self) -> MatRef<'_, f32> {
        self.upper
    }

    #[inline]
    fn round(
        &self,
        r: usize,
        c: usize,
        w_row: &[f32],
        params_row: &mut [QuantParams],
    ) -> (u8, f32) {
        let gs = self.group_size;
        let p = match self.static_groups {
            Some((params, group_of)) => params[r * ColumnProblem::groups(self) + group_of[c]],
            None => {
                if c % gs == 0 {
                    let end = (c + gs).min(self.inp);
                    let values = &w_row[c..end];
                    params_row[c / gs] = match self.clip {
                        None => self.quantizer.params_for(values),
                        Some((search, diag)) => {
                            search.params(&self.quantizer, values, Some(&diag[c..end]))
                        }
                    };
                }
                params_row[c / gs]
            }
        };
        let code = self.quantizer.quantize(w_row[c], p);
        (code, IntQuantizer::dequantize(code, p))
    }
}

/// One column of one row: the grid's code, error `e = (w − q)/d` and loss `(w − q)²/(2d²)`
/// with `d = U[c, c]`.
#[inline]
pub(crate) fn quantize_column<G: ColumnGrid + ?Sized>(
    grid: &G,
    r: usize,
    c: usize,
    w_row: &[f32],
    params_row: &mut [G::Param],
) -> (u8, f32, f64) {
    let (code, q) = grid.round(r, c, w_row, params_row);
    let w = w_row[c];
    let d = grid.upper()[(c, c)];
    let diff = (w - q) as f64;
    let loss = diff * diff / (2.0 * d as f64 * d as f64);
    (code, (w - q) / d, loss)
}

/// Inner blocks per outer block. Inner blocks update the columns up to the end of their outer
/// block; the columns after it get one GEMM of depth `OUTER_BLOCKS · block`, which moves
/// `OUTER_BLOCKS` times less memory per flop than one update per inner block.
pub(crate) const OUTER_BLOCKS: usize = 8;

/// The lazy-block loop. `w` is `[out, inp]` in loop order and is overwritten.
pub(crate) fn blocked_loop<G: ColumnGrid>(
    problem: &G,
    w: &mut [f32],
    block: usize,
    outer: usize,
) -> ColumnSolution<G::Param> {
    let (out, inp) = (problem.out(), problem.inp());
    let mut sol = ColumnSolution::filled(out, inp, problem.groups(), problem.placeholder());
    let mut o1 = 0;
    while o1 < inp {
        let o2 = (o1 + outer).min(inp);
        let mut err = ErrorBlock {
            values: vec![0.0f32; out * (o2 - o1)],
            first_col: o1,
            cols: o2 - o1,
        };
        let mut i1 = o1;
        while i1 < o2 {
            let i2 = (i1 + block).min(o2);
            solve_block(problem, w, &mut sol, &mut err, i1..i2);
            subtract_update(problem, w, &err, i1..i2, i2..o2);
            i1 = i2;
        }
        subtract_update(problem, w, &err, o1..o2, o2..inp);
        o1 = o2;
    }
    sol
}

/// The scaled errors `e = (w − q)/d` of an outer block's columns, `[out, cols]`.
struct ErrorBlock {
    values: Vec<f32>,
    first_col: usize,
    cols: usize,
}

/// Quantizes the columns `span` of every row (in parallel over rows), applying each column's
/// error to the later columns of the span at once.
fn solve_block<G: ColumnGrid>(
    problem: &G,
    w: &mut [f32],
    sol: &mut ColumnSolution<G::Param>,
    err: &mut ErrorBlock,
    span: Range<usize>,
) {
    let (i1, i2, bsz) = (span.start, span.end, span.len());
    let (inp, groups) = (problem.inp(), problem.groups().max(1));
    let upper = problem.upper();
    let u_block: Vec<f32> = (0..bsz * bsz)
        .map(|k| upper[(i1 + k / bsz, i1 + k % bsz)])
        .collect();
    let e_offset = i1 - err.first_col;
    let mut loss = vec![0.0f64; problem.out() * bsz];
    (
        w.par_chunks_mut(inp),
        sol.codes.par_chunks_mut(inp),
        sol.params_rows.par_chunks_mut(groups),
        err.values.par_chunks_mut(err.cols),
        loss.par_chunks_mut(bsz),
    )
        .into_par_iter()
        .enumerate()
        .for_each(|(r, (w_row, code_row, params_row, e_row, l_row))| {
            for i in 0..bsz {
                let c = i1 + i;
                let (code, e, l) = quantize_column(problem, r, c, w_row, params_row);
                code_row[c] = code;
                e_row[e_offset + i] = e;
                l_row[i] = l;
                let u_row = &u_block[i * bsz..(i + 1) * bsz];
                for (wj, &uj) in w_row[c + 1..i2].iter_mut().zip(&u_row[i + 1..]) {
                    *wj -= e * uj;
                }
            }
        });
    for l_row in loss.chunks_exact(bsz) {
        for (acc, &l) in sol.column_loss[i1..i2].iter_mut().zip(l_row) {
            *acc += l;
        }
    }
}

/// `W[:, cols] -= Err[:, rows] · U[rows, cols]`: one faer GEMM.
fn subtract_update<G: ColumnGrid>(
    problem: &G,
    w: &mut [f32],
    err: &ErrorBlock,
    rows: Range<usize>,
    cols: Range<usize>,
) {
    if cols.is_empty() {
        return;
    }
    let (out, inp) = (problem.out(), problem.inp());
    // Row-major view of W[:, cols] (built as the transpose of a column-major view:
    // faer 0.24.4's `from_row_major_slice_with_stride_mut` swaps the two strides).
    let dst =
        MatMut::from_column_major_slice_with_stride_mut(&mut w[cols.start..], cols.len(), out, inp)
            .transpose_mut();
    let lhs = MatRef::from_row_major_slice_with_stride(
        &err.values[rows.start - err.first_col..],
        out,
        rows.len(),
        err.cols,
    );
    let rhs = problem
        .upper()
        .submatrix(rows.start, cols.start, rows.len(), cols.len());
    matmul(dst, Accum::Add, lhs, rhs, -1.0f32, Par::rayon(0));
    sala_cpu::clear_upper_state_everywhere();
}

/// The block length actually used: shortened so that a group never starts inside a block and
/// ends beyond it (there its parameters would miss the block's pending updates).
pub(crate) fn effective_block(
    block: usize,
    group_size: usize,
    inp: usize,
    static_groups: bool,
) -> usize {
    if static_groups || group_size >= inp || block % group_size == 0 {
        block
    } else if group_size < block {
        block - block % group_size
    } else {
        gcd(block, group_size)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Gptq {
    /// Validates the options.
    pub fn new(config: GptqConfig) -> Result<Self, HessianError> {
        let quantizer = config.grid.quantizer()?;
        if config.grid.group_size == Some(0) {
            return Err(sala_formats::FormatError::ZeroGroupSize.into());
        }
        if config.block_size == 0 {
            return Err(HessianError::InvalidOption {
                name: "block_size",
                value: "0".into(),
                rule: "must be positive",
            });
        }
        if config.group_aware_order && config.act_order {
            return Err(HessianError::InvalidOption {
                name: "group_aware_order",
                value: "true".into(),
                rule: "excludes act_order (desc_act): choose one column order",
            });
        }
        if config.group_aware_order && config.grid.group_size.is_none() {
            return Err(HessianError::InvalidOption {
                name: "group_aware_order",
                value: "true".into(),
                rule: "reorders groups: needs a group size",
            });
        }
        config.damping.validate()?;
        Ok(Self { config, quantizer })
    }

    /// The options.
    pub fn config(&self) -> &GptqConfig {
        &self.config
    }

    /// Quantizes the row-major `W [out, inp]` (f32) with the Hessian `h` `[inp, inp]`.
    ///
    /// Follows IST-DASLab's `fasterquant` (dead columns zeroed, damping, act-order
    /// permutation by `diag(H)` descending with ties in column order, static groups from the
    /// original weight). Dynamic group parameters are computed at each group start from the
    /// fully error-updated weights: identical to IST whenever the group size divides the block
    /// size (the production 128/128 case) and to the textbook sequential algorithm always.
    ///
    /// Errors: shapes, non-finite `W` or `H`, and [`HessianError::NotPositiveDefinite`] unless
    /// the policy is [`FailurePolicy::Rtn`].
    pub fn solve<T: HessianScalar>(
        &self,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &Hessian<T>,
    ) -> Result<QuantizedLinear, HessianError> {
        self.solve_with_loop(weights, out, inp, h, &BlockedLoop)
    }

    /// [`Gptq::solve`] with another column loop (a GPU's): the preparation (checks, dead
    /// columns, act-order, the damped inverse on the host, static groups) and the
    /// finishing (un-permuting, dequantization, proxy error) stay the same.
    pub fn solve_with_loop<T: HessianScalar, L: GptqColumnLoop + ?Sized>(
        &self,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &Hessian<T>,
        column_loop: &L,
    ) -> Result<QuantizedLinear, HessianError> {
        let cfg = &self.config;
        let prepared = self.prepare(weights, out, inp, &diagonal_f64(h))?;
        h.check_finite()?;
        let factorizer = column_loop.factorizer();
        let inverse =
            match CholeskyInverse::with_order_using(h, &prepared.order, &cfg.damping, factorizer) {
                Ok(inv) => inv,
                Err(HessianError::NotPositiveDefinite { .. })
                    if cfg.on_failure == FailurePolicy::Rtn =>
                {
                    return self.rtn_fallback(weights, out, inp, Some(h));
                }
                Err(e) => return Err(e),
            };
        let w0 = prepared.dead_zeroed(weights, inp);
        let mut w_loop = prepared.in_loop_order(&w0, inp).into_owned();
        let static_params = self.static_params(&prepared, &w0, out, inp);
        let static_group_of = prepared.static_group_of();
        let loop_diag = prepared.clip_weights_in_loop_order();
        let problem = ColumnProblem {
            quantizer: self.quantizer,
            out,
            inp,
            group_size: prepared.group_size,
            block_size: cfg.block_size,
            upper: inverse.upper(),
            static_groups: static_params
                .as_deref()
                .map(|p| (p, static_group_of.as_slice())),
            clip: cfg.grid.clip.zip(loop_diag.as_deref()),
        };
        let sol = column_loop.run(&problem, &mut w_loop)?;
        let attempt = DampingAttempt {
            retries: inverse.retries(),
            percdamp: inverse.percdamp(),
        };
        self.finish(
            out,
            &prepared,
            sol,
            static_params.as_deref(),
            attempt,
            |dequantized| Ok(proxy_error(weights, dequantized, inp, h)),
        )
    }

    /// GPTQ's bookkeeping from `diag(H)` alone (`diag` `[inp]`, f64): shapes and finite
    /// weights checked, dead columns, the loop order (act-order: `diag` descending, ties in
    /// column order, dead columns counted as 1) and the damping reference. A solver whose
    /// Hessian stays on a device downloads only the diagonal for this.
    pub fn prepare(
        &self,
        weights: &[f32],
        out: usize,
        inp: usize,
        diag: &[f64],
    ) -> Result<GptqPreparation, HessianError> {
        check_weights(weights, out, inp, Some(diag.len()))?;
        let group_size = self.config.grid.effective_group_size(inp)?;
        let dead = dead_columns(diag);
        let fixed: Vec<f64> = diag
            .iter()
            .zip(&dead)
            .map(|(&d, &dead)| if dead { 1.0 } else { d })
            .collect();
        let order = if self.config.act_order {
            let mut order: Vec<usize> = (0..inp).collect();
            order.sort_by(|&a, &b| fixed[b].total_cmp(&fixed[a]));
            order
        } else if self.config.group_aware_order {
            group_aware_order(&fixed, group_size)
        } else {
            (0..inp).collect()
        };
        let clip_weights = self
            .config
            .grid
            .clip
            .map(|_| diag.iter().map(|&d| d as f32).collect());
        Ok(GptqPreparation {
            clip_weights,
            mean_diag: mean_fixed_diagonal(diag, &dead),
            dead,
            order,
            group_size,
        })
    }

    /// Static groups' parameters `[out, groups]` from the dead-zeroed original weight `w0`,
    /// when the options ask for them (groups and `static_groups`).
    pub fn static_params(
        &self,
        prepared: &GptqPreparation,
        w0: &[f32],
        out: usize,
        inp: usize,
    ) -> Option<Vec<QuantParams>> {
        let use_static = self.config.static_groups && self.config.grid.group_size.is_some();
        use_static.then(|| {
            let grid = (&self.config.grid, &self.quantizer);
            let weights = prepared.clip_weights.as_deref();
            static_group_params(grid, weights, w0, out, inp, prepared.group_size)
        })
    }

    /// The integer quantizer of the grid.
    pub fn quantizer(&self) -> IntQuantizer {
        self.quantizer
    }

    /// The result from the column loop's `sol` (loop order) for `out` rows: codes and
    /// parameters back in the original order, `g_idx`, the dequantized weight, the losses,
    /// and the proxy error from `proxy(dequantized)` when the options ask for it.
    pub fn finish(
        &self,
        out: usize,
        prepared: &GptqPreparation,
        sol: ColumnSolution,
        static_params: Option<&[QuantParams]>,
        attempt: DampingAttempt,
        proxy: impl FnOnce(&[f32]) -> Result<f64, HessianError>,
    ) -> Result<QuantizedLinear, HessianError> {
        let (inp, gs, perm) = (prepared.order.len(), prepared.group_size, &prepared.order);
        let groups = inp.div_ceil(gs);
        let (params, g_idx) = match static_params {
            Some(p) => (
                transpose(p, out, groups),
                (0..inp).map(|j| (j / gs) as i32).collect(),
            ),
            None => match prepared.whole_group_origins() {
                // Every loop group is one whole original group (natural order, group-aware
                // order): the parameters go back to their groups, `g_idx` stays natural.
                Some(origin) => {
                    let mut params = sol.params_rows.clone();
                    for (row, row_params) in params.chunks_exact_mut(groups).enumerate() {
                        for (k, &o) in origin.iter().enumerate() {
                            row_params[o] = sol.params_rows[row * groups + k];
                        }
                    }
                    (
                        transpose(&params, out, groups),
                        (0..inp).map(|j| (j / gs) as i32).collect(),
                    )
                }
                None => {
                    let mut g_idx = vec![0i32; inp];
                    for (c, &j) in perm.iter().enumerate() {
                        g_idx[j] = (c / gs) as i32;
                    }
                    (transpose(&sol.params_rows, out, groups), g_idx)
                }
            },
        };
        let mut column_loss = vec![0.0f64; inp];
        for (c, &j) in perm.iter().enumerate() {
            column_loss[j] = sol.column_loss[c];
        }
        let codes = if prepared.is_natural_order() {
            sol.codes
        } else {
            unpermute_columns(&sol.codes, inp, perm)
        };
        let dequantized = dequantize(&codes, &params, &g_idx, out);
        let proxy = if self.config.proxy_error {
            Some(proxy(&dequantized)?)
        } else {
            None
        };
        Ok(QuantizedLinear {
            out_features: out,
            in_features: inp,
            grid: self.config.grid,
            group_size: gs,
            codes,
            params,
            g_idx,
            dequantized,
            loss: column_loss.iter().sum(),
            column_loss,
            proxy_error: proxy,
            method: Method::Gptq,
            damping_retries: attempt.retries,
            percdamp: attempt.percdamp,
        })
    }

    /// `sol` for `out` rows with its proxy error already known (`None` when the options do
    /// not ask for it), to be [`finish`](Self::finish)ed later, possibly on another thread:
    /// what a device solver hands back once the device's part is done.
    pub fn unfinished(
        &self,
        out: usize,
        prepared: GptqPreparation,
        sol: ColumnSolution,
        attempt: DampingAttempt,
        proxy_error: Option<f64>,
    ) -> UnfinishedGptq {
        UnfinishedGptq(Unfinished::Columns(Box::new(ColumnsToFinish {
            gptq: self.clone(),
            out,
            prepared,
            sol,
            attempt,
            proxy_error,
        })))
    }

    /// Round-to-nearest in place of GPTQ (the [`FailurePolicy::Rtn`] fallback), the proxy
    /// error under `h` when given.
    pub fn rtn_fallback<T: HessianScalar>(
        &self,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: Option<&Hessian<T>>,
    ) -> Result<QuantizedLinear, HessianError> {
        let rtn = Rtn::new(self.config.grid)?;
        let hessian = h.filter(|_| self.config.proxy_error);
        let mut result = rtn.quantize(weights, out, inp, hessian)?;
        result.method = Method::RtnFallback;
        result.damping_retries = self.config.damping.max_retries;
        Ok(result)
    }
}

/// A GPTQ result whose host finishing (codes and parameters back in the original order, the
/// dequantized weight: tens of milliseconds for a large linear) may still be to do. `Send`:
/// a caller can [`finish`](Self::finish) it on another thread while a device solves the next
/// linear.
#[derive(Debug)]
pub struct UnfinishedGptq(Unfinished);

#[derive(Debug)]
enum Unfinished {
    Finished(Box<QuantizedLinear>),
    Columns(Box<ColumnsToFinish>),
}

/// [`Gptq::finish`]'s arguments, the proxy error already known.
#[derive(Debug)]
struct ColumnsToFinish {
    gptq: Gptq,
    out: usize,
    prepared: GptqPreparation,
    sol: ColumnSolution,
    attempt: DampingAttempt,
    proxy_error: Option<f64>,
}

impl UnfinishedGptq {
    /// A result with nothing left to do (a host solve, a fallback).
    pub fn finished(quantized: QuantizedLinear) -> Self {
        Self(Unfinished::Finished(Box::new(quantized)))
    }

    /// Whether [`finish`](Self::finish) has work to do.
    pub fn needs_finishing(&self) -> bool {
        matches!(self.0, Unfinished::Columns(_))
    }

    /// The finished result.
    pub fn finish(self) -> Result<QuantizedLinear, HessianError> {
        match self.0 {
            Unfinished::Finished(quantized) => Ok(*quantized),
            Unfinished::Columns(c) => {
                let proxy_error = c.proxy_error;
                c.gptq
                    .finish(c.out, &c.prepared, c.sol, None, c.attempt, |_| {
                        proxy_error
                            .ok_or_else(|| HessianError::Device("no proxy error computed".into()))
                    })
            }
        }
    }
}

/// Which damping attempt factored the Hessian: the retries before it and its relative damping.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DampingAttempt {
    /// Failed attempts before this one.
    pub retries: usize,
    /// `λ / mean(diag H)`.
    pub percdamp: f64,
}

/// [`Gptq::prepare`]'s result: what GPTQ needs of the Hessian besides its factor.
#[derive(Debug, Clone, PartialEq)]
pub struct GptqPreparation {
    /// `dead[j]` for each original column `j` (`H[j,j] == 0`: its weights are zeroed and its
    /// diagonal set to 1 before damping).
    pub dead: Vec<bool>,
    /// The loop order: loop position `c` is original column `order[c]`.
    pub order: Vec<usize>,
    /// `mean(diag H)` with dead columns counted as 1: the damping reference.
    pub mean_diag: f64,
    /// Columns per group (`inp` when per-channel).
    pub group_size: usize,
    /// With a clipping search: `diag(H)` in the original column order, the weight of each
    /// column's error.
    pub clip_weights: Option<Vec<f32>>,
}

impl GptqPreparation {
    /// [`clip_weights`](Self::clip_weights) in loop order.
    pub fn clip_weights_in_loop_order(&self) -> Option<Vec<f32>> {
        let weights = self.clip_weights.as_ref()?;
        Some(self.order.iter().map(|&j| weights[j]).collect())
    }

    /// The weights with dead columns zeroed, original order, row-major `[out, inp]`
    /// (borrowed when no column is dead).
    pub fn dead_zeroed<'a>(&self, weights: &'a [f32], inp: usize) -> Cow<'a, [f32]> {
        if !self.dead.contains(&true) {
            return Cow::Borrowed(weights);
        }
        let mut w0 = weights.to_vec();
        w0.par_chunks_exact_mut(inp.max(1)).for_each(|row| {
            for (v, _) in row.iter_mut().zip(&self.dead).filter(|(_, &d)| d) {
                *v = 0.0;
            }
        });
        Cow::Owned(w0)
    }

    /// `w` `[out, inp]` with its columns in loop order (borrowed when the order is the
    /// natural one: no act-order).
    pub fn in_loop_order<'a>(&self, w: &'a [f32], inp: usize) -> Cow<'a, [f32]> {
        if self.is_natural_order() {
            Cow::Borrowed(w)
        } else {
            Cow::Owned(permute_columns(w, inp, &self.order))
        }
    }

    /// The weights as the column loop starts from them: dead columns zeroed, loop order
    /// (borrowed when neither changes anything: no copy of a 268 MB weight for nothing).
    pub fn loop_weights<'a>(&self, weights: &'a [f32], inp: usize) -> Cow<'a, [f32]> {
        match self.dead_zeroed(weights, inp) {
            Cow::Borrowed(w) => self.in_loop_order(w, inp),
            Cow::Owned(w) if self.is_natural_order() => Cow::Owned(w),
            Cow::Owned(w) => Cow::Owned(permute_columns(&w, inp, &self.order)),
        }
    }

    /// Whether loop position `c` is column `c` for every `c`.
    pub fn is_natural_order(&self) -> bool {
        self.order.iter().enumerate().all(|(c, &j)| c == j)
    }

    /// `Some(origin)` when every group of the loop order (positions `k·gs ..`) holds exactly
    /// the columns of one original group `origin[k]` (the natural and the group-aware orders);
    /// `None` when a loop group mixes columns of several (act-order).
    pub fn whole_group_origins(&self) -> Option<Vec<usize>> {
        let (gs, inp) = (self.group_size, self.order.len());
        self.order
            .chunks(gs.max(1))
            .map(|loop_group| {
                let origin = loop_group.first()? / gs;
                let size = ((origin + 1) * gs).min(inp) - origin * gs;
                let whole =
                    loop_group.len() == size && loop_group.iter().all(|&j| j / gs == origin);
                whole.then_some(origin)
            })
            .collect()
    }

    /// The static group of each loop position (the group of its original column).
    pub fn static_group_of(&self) -> Vec<usize> {
        self.order.iter().map(|&j| j / self.group_size).collect()
    }

    /// `diag(H)` in loop order with dead columns set to 1: the diagonal of the matrix the
    /// factor is computed from, before damping.
    pub fn fixed_diagonal_in_loop_order(&self, diag: &[f64]) -> Vec<f64> {
        self.order
            .iter()
            .map(|&j| if self.dead[j] { 1.0 } else { diag[j] })
            .collect()
    }
}

/// GAR's loop order from the (dead-fixed) diagonal: the full groups by decreasing maximum
/// `diag`, the columns inside each by decreasing `diag` (both stable: ties keep column
/// order), then a partial last group in its natural order.
fn group_aware_order(diag: &[f64], gs: usize) -> Vec<usize> {
    let full = diag.len() / gs.max(1);
    let by_diag_desc = |a: &usize, b: &usize| diag[*b].total_cmp(&diag[*a]);
    let mut inside: Vec<Vec<usize>> = (0..full)
        .map(|g| {
            let mut cols: Vec<usize> = (g * gs..(g + 1) * gs).collect();
            cols.sort_by(by_diag_desc);
            cols
        })
        .collect();
    let mut group_order: Vec<usize> = (0..full).collect();
    group_order.sort_by(|&a, &b| diag[inside[b][0]].total_cmp(&diag[inside[a][0]]));
    let mut order: Vec<usize> = group_order
        .into_iter()
        .flat_map(|g| std::mem::take(&mut inside[g]))
        .collect();
    order.extend(full * gs..diag.len());
    order
}

/// `W[:, order[c]] = Wp[:, c]`: the inverse of [`permute_columns`], rows in parallel.
fn unpermute_columns<X: Copy + Default + Send + Sync>(
    wp: &[X],
    inp: usize,
    order: &[usize],
) -> Vec<X> {
    let mut w = vec![X::default(); wp.len()];
    w.par_chunks_mut(inp)
        .zip(wp.par_chunks(inp))
        .for_each(|(row, row_p)| {
            for (&j, &v) in order.iter().zip(row_p) {
                row[j] = v;
            }
        });
    w
}

/// `Wp[:, c] = W[:, order[c]]`.
fn permute_columns(w: &[f32], inp: usize, order: &[usize]) -> Vec<f32> {
    let mut wp = vec![0.0f32; w.len()];
    wp.par_chunks_mut(inp)
        .zip(w.par_chunks(inp))
        .for_each(|(row_p, row)| {
            for (v, &j) in row_p.iter_mut().zip(order) {
                *v = row[j];
            }
        });
    wp
}

/// Parameters of every group from the (dead-zeroed, un-permuted) weight, `[out, groups]`;
/// `weights` `[inp]` weigh each column's error in the grid's clipping search.
fn static_group_params(
    (grid, quantizer): (&IntGrid, &IntQuantizer),
    weights: Option<&[f32]>,
    w: &[f32],
    out: usize,
    inp: usize,
    gs: usize,
) -> Vec<QuantParams> {
    let groups = inp.div_ceil(gs);
    (0..out * groups)
        .into_par_iter()
        .map(|k| {
            let (r, g) = (k / groups, k % groups);
            let columns = g * gs..((g + 1) * gs).min(inp);
            let values = &w[r * inp..(r + 1) * inp][columns.clone()];
            grid.group_params(quantizer, values, weights.map(|c| &c[columns]))
        })
        .collect()
}

/// `[rows, cols]` → `[cols, rows]`.
pub(crate) fn transpose<X: Copy>(m: &[X], rows: usize, cols: usize) -> Vec<X> {
    (0..rows * cols)
        .map(|k| m[(k % rows) * cols + k / rows])
        .collect()
}
