//! `accumulate_xtx` against `reference::hessian_naive` for both normalizations.

use sala_hessian::reference::hessian_naive;
use sala_hessian::Normalization;
use sala_kernels::hessian::{accumulate_xtx, normalization_weight, xtx_lower_blocks, XtxBlocking};
use sala_kernels::{CubeGemm, KernelError, MatrixView};

use crate::common::{client, max_rel_diff, Rng};

#[test]
fn accumulated_xtx_matches_the_naive_hessian_for_both_normalizations() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(3);
    let dim = 48;
    let samples: Vec<(Vec<f32>, usize)> = [37usize, 21, 64]
        .iter()
        .map(|&tokens| (rng.vec(tokens * dim), tokens))
        .collect();
    for normalization in [Normalization::PerSample, Normalization::PerToken] {
        let h = MatrixView::zeros(&client, dim, dim).unwrap();
        for (x, tokens) in &samples {
            let x = MatrixView::upload(&client, x, *tokens, dim).unwrap();
            let weight = normalization_weight(normalization, x.rows);
            accumulate_xtx(&client, &CubeGemm, &x, weight, &h).unwrap();
        }
        let divisor = match normalization {
            Normalization::PerSample => samples.len() as f64,
            Normalization::PerToken => samples.iter().map(|s| s.1).sum::<usize>() as f64,
        };
        let got: Vec<f32> = h
            .download(&client)
            .unwrap()
            .iter()
            .map(|&v| (v as f64 / divisor) as f32)
            .collect();
        let refs: Vec<(&[f32], usize)> = samples.iter().map(|(x, t)| (x.as_slice(), *t)).collect();
        let want = hessian_naive(&refs, dim, normalization);
        // Relative to the diagonal's scale (off-diagonal sums of random signs are small).
        let err = max_rel_diff(&got, &want, 0.1);
        assert!(err < 1e-5, "{normalization:?}: relative error {err}");
    }
}

#[test]
fn accumulate_xtx_checks_shapes() {
    let Some(client) = client() else {
        return;
    };
    let x = MatrixView::zeros(&client, 5, 8).unwrap();
    let h = MatrixView::zeros(&client, 8, 7).unwrap();
    let err = accumulate_xtx(&client, &CubeGemm, &x, 1.0, &h).unwrap_err();
    assert!(matches!(err, KernelError::Shape { .. }), "{err}");
}

/// Every entry of a `[dim, dim]` product is computed once (a block on or below the block
/// diagonal) or mirrored once (from a block strictly below it), for every grouping: the grid
/// one GEMM per block or batched (groups of equal whole blocks along one block diagonal), and
/// recursive halving, single or batched.
#[test]
fn lower_blocks_cover_the_product_once() {
    for dim in [0, 1, 5, 64, 100, 256, 300, 513] {
        for block in [1, 16, 64, 100, 256] {
            for (batched, halving) in [(false, false), (true, false), (false, true), (true, true)] {
                let blocking = XtxBlocking {
                    block,
                    batched,
                    halving,
                };
                let groups = xtx_lower_blocks(dim, blocking);
                let mut seen = vec![0u8; dim * dim];
                for g in &groups {
                    assert!(g.count >= 1, "{blocking:?} dim {dim}: {g:?}");
                    if g.count > 1 && !halving {
                        assert_eq!((g.rows, g.cols, g.step), (block, block, block), "{g:?}");
                    }
                    if g.row == g.col {
                        assert!(g.rows <= block, "{blocking:?} dim {dim}: {g:?}");
                    }
                    for (r0, c0) in g.origins() {
                        assert!(r0 >= c0, "{blocking:?} dim {dim}: block at ({r0}, {c0})");
                        assert!(r0 + g.rows <= dim && c0 + g.cols <= dim, "{g:?} past {dim}");
                        for r in r0..r0 + g.rows {
                            for c in c0..c0 + g.cols {
                                seen[r * dim + c] += 1;
                                if r0 != c0 {
                                    seen[c * dim + r] += 1;
                                }
                            }
                        }
                    }
                }
                let wrong = seen.iter().position(|&n| n != 1);
                assert_eq!(
                    wrong,
                    None,
                    "{blocking:?} dim {dim}: entry covered {:?}",
                    wrong.map(|e| seen[e])
                );
            }
        }
    }
}

/// Batching shrinks no block: the batched grouping has the same blocks as one GEMM each,
/// and its calls are one per block diagonal plus the ragged last row.
#[test]
fn batched_blocks_are_the_single_blocks_grouped_by_diagonal() {
    let blocks = |batched| {
        let mut all: Vec<(usize, usize, usize, usize)> = xtx_lower_blocks(
            300,
            XtxBlocking {
                block: 64,
                batched,
                halving: false,
            },
        )
        .iter()
        .flat_map(|g| g.origins().map(move |(r, c)| (r, c, g.rows, g.cols)))
        .collect();
        all.sort_unstable();
        all
    };
    assert_eq!(blocks(true), blocks(false));
    // 300 = 4 × 64 + 44: 4 block diagonals of whole blocks, then 5 blocks of the last row.
    assert_eq!(
        xtx_lower_blocks(
            300,
            XtxBlocking {
                block: 64,
                batched: true,
                halving: false,
            }
        )
        .len(),
        4 + 5
    );
    assert_eq!(
        xtx_lower_blocks(
            300,
            XtxBlocking {
                block: 64,
                batched: false,
                halving: false,
            }
        )
        .len(),
        15
    );
}

/// Halving a power-of-two multiple of the block computes the grid's entries in fewer, larger
/// GEMMs: at 16384 / 2048 (the down_proj Hessian) one 8192-wide rectangle, two 4096-wide,
/// four 2048-wide and the 8 diagonal blocks; batched, one call per level.
#[test]
fn halving_computes_the_grids_entries_in_fewer_larger_products() {
    let plan = |batched, halving| {
        xtx_lower_blocks(
            16384,
            XtxBlocking {
                block: 2048,
                batched,
                halving,
            },
        )
    };
    let entries = |groups: &[sala_kernels::XtxBlocks]| -> usize {
        groups.iter().map(|g| g.count * g.rows * g.cols).sum()
    };
    let (grid, halving, batched) = (plan(false, false), plan(false, true), plan(true, true));
    assert_eq!(entries(&halving), entries(&grid));
    assert_eq!(entries(&batched), entries(&grid));
    assert_eq!((grid.len(), halving.len(), batched.len()), (36, 15, 4));
    let shapes: Vec<_> = batched.iter().map(|g| (g.rows, g.count, g.step)).collect();
    assert_eq!(
        shapes,
        [
            (8192, 1, 0),
            (4096, 2, 8192),
            (2048, 4, 4096),
            (2048, 8, 2048)
        ]
    );
}

/// On CUDA only (`--features cuda`, an NVIDIA GPU): the blocked, symmetric cuBLAS Hessian
/// over weighted runs of rows against the f64 sum. CI never builds these.
#[cfg(feature = "cuda")]
mod cuda_runs {
    use cubecl::cuda::CudaRuntime;
    use cubecl::prelude::ComputeClient;
    use half::bf16;
    use sala_kernels::cuda::{
        xtx_runs_bf16, xtx_runs_bf16_blocked, Bf16Matrix, Cublas, XtxBlocking, XtxRun, XtxStream,
        XTX_BLOCK,
    };
    use sala_kernels::{DeviceVec, MatrixView};

    use crate::common::{client, Rng};

    /// The default blocking on three blocks (the last ragged), and batched blockings: small
    /// blocks with block diagonals of 3, 2 and 1 whole blocks and a ragged row, and the
    /// default block batched.
    #[test]
    fn weighted_runs_match_the_f64_sum_and_are_exactly_symmetric() {
        let Some(client) = client() else {
            return;
        };
        let blas = Cublas::new(0).unwrap();
        let cases = [
            (XtxBlocking::default(), 2 * XTX_BLOCK + 100),
            (
                XtxBlocking {
                    block: 256,
                    batched: true,
                    halving: false,
                },
                3 * 256 + 40,
            ),
            (
                XtxBlocking {
                    block: 256,
                    batched: true,
                    halving: true,
                },
                3 * 256 + 40,
            ),
            (
                XtxBlocking {
                    block: 512,
                    batched: true,
                    halving: true,
                },
                2 * XTX_BLOCK + 100,
            ),
            (
                XtxBlocking {
                    block: XTX_BLOCK,
                    batched: true,
                    halving: false,
                },
                2 * XTX_BLOCK + 100,
            ),
        ];
        for (blocking, dim) in cases {
            check_runs(&client, &blas, blocking, dim);
        }
    }

    fn check_runs(
        client: &ComputeClient<CudaRuntime>,
        blas: &Cublas,
        blocking: XtxBlocking,
        dim: usize,
    ) {
        let mut rng = Rng::new(71);
        // Runs of different weights, one empty, rows left out between them.
        let tokens = 300;
        let x: Vec<f32> = (0..tokens * dim)
            .map(|_| bf16::from_f32(rng.normal()).to_f32())
            .collect();
        let bits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let xm = Bf16Matrix::upload(client, &bits, tokens, dim).unwrap();
        let runs = [
            XtxRun {
                first_row: 0,
                rows: 100,
                weight: 0.01,
            },
            XtxRun {
                first_row: 100,
                rows: 0,
                weight: 5.0,
            },
            XtxRun {
                first_row: 120,
                rows: 180,
                weight: 1.0 / 180.0,
            },
        ];
        // h starts symmetric and non-zero: the products accumulate into it.
        let h0: Vec<f32> = (0..dim * dim)
            .map(|e| {
                let (r, c) = (e / dim, e % dim);
                ((r.min(c) * 7 + r.max(c) * 3) % 11) as f32 - 5.0
            })
            .collect();
        let h = DeviceVec::upload(client, &h0);
        let view = MatrixView {
            handle: h.handle.clone(),
            offset: 0,
            rows: dim,
            cols: dim,
            row_stride: dim,
        };
        xtx_runs_bf16_blocked(client, blas, &xm, &runs, &view, blocking).unwrap();
        let got: Vec<f32> = h.download(client).unwrap();
        // Column-major copy: the reference reads columns of x as contiguous rows.
        let xt: Vec<f64> = (0..dim * tokens)
            .map(|e| x[(e % tokens) * dim + e / tokens] as f64)
            .collect();
        let mut worst = 0f64;
        for r in 0..dim {
            for c in 0..=r {
                let want: f64 = h0[r * dim + c] as f64
                    + runs
                        .iter()
                        .map(|run| {
                            run.weight as f64
                                * (run.first_row..run.first_row + run.rows)
                                    .map(|t| xt[r * tokens + t] * xt[c * tokens + t])
                                    .sum::<f64>()
                        })
                        .sum::<f64>();
                let (lower, upper) = (got[r * dim + c], got[c * dim + r]);
                assert_eq!(
                    lower.to_bits(),
                    upper.to_bits(),
                    "{blocking:?}: ({r}, {c}) not symmetric"
                );
                worst = worst.max((lower as f64 - want).abs());
            }
        }
        // Entries are O(1)–O(10); f32 sums of a few hundred products are good to ~1e-5.
        assert!(worst < 1e-4, "{blocking:?}: worst error {worst:e}");
    }

    /// Products queued on an [`XtxStream`] into two Hessians, each input dropped by the caller
    /// at once and its memory offered to new buffers, give the synchronous products' sums bit
    /// for bit; the stream holds no more inputs than its limit allows (none, where an input
    /// alone exceeds it), and `wait_for` leaves nothing in flight for its Hessian.
    #[test]
    fn queued_products_equal_the_synchronous_ones_bit_for_bit() {
        let Some(client) = client() else {
            return;
        };
        let blas = Cublas::new(0).unwrap();
        let (dim, tokens) = (XTX_BLOCK + 64, 257);
        let input_bytes = (tokens * dim * 2) as u64;
        let inputs = normal_inputs(&mut Rng::new(5), 6, tokens * dim);
        let runs = two_runs(57, tokens, 0.005);
        let square = |client: &ComputeClient<CudaRuntime>| zero_square(client, dim);
        let want = [square(&client), square(&client)];
        for (i, bits) in inputs.iter().enumerate() {
            let x = Bf16Matrix::upload(&client, bits, tokens, dim).unwrap();
            xtx_runs_bf16(&client, &blas, &x, &runs, &want[i % 2]).unwrap();
        }
        for (limit, most) in [(2 * input_bytes, 2), (input_bytes / 2, 0)] {
            let stream = XtxStream::new(0, limit).unwrap();
            let got = [square(&client), square(&client)];
            for (i, bits) in inputs.iter().enumerate() {
                let x = Bf16Matrix::upload(&client, bits, tokens, dim).unwrap();
                stream.queue(&client, &x, &runs, &got[i % 2]).unwrap();
                drop(x);
                // New buffers of the input's size, written at once: where the stream did not
                // hold the input, they would take its memory while its products read it.
                let noise: Vec<u16> = (0..tokens * dim).map(|e| (e % 977) as u16).collect();
                let _other = Bf16Matrix::upload(&client, &noise, tokens, dim).unwrap();
                assert!(
                    stream.in_flight() <= most,
                    "limit {limit}: {}",
                    stream.in_flight()
                );
            }
            stream.wait_for(&client, &got[1]).unwrap();
            assert_eq!(stream.in_flight(), 0, "the last product wrote got[1]");
            stream.settle().unwrap();
            for (g, w) in got.iter().zip(&want) {
                let (g, w): (Vec<f32>, Vec<f32>) =
                    (g.download(&client).unwrap(), w.download(&client).unwrap());
                let same = g.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "limit {limit}: queued sums differ");
            }
        }
    }

    /// Products queued on an [`XtxStream`] write only the blocks on and below the diagonal:
    /// the blocks above are filled once, by `settle`, from the blocks below, and then equal the
    /// synchronous products' bit for bit. A Hessian the caller dropped before `settle` keeps its
    /// buffer until its mirror is done: buffers made after the drop are not written.
    #[test]
    fn queued_hessians_are_mirrored_once_when_read() {
        let Some(client) = client() else {
            return;
        };
        let blas = Cublas::new(0).unwrap();
        let (dim, tokens) = (XTX_BLOCK + 64, 129);
        let inputs = normal_inputs(&mut Rng::new(11), 3, tokens * dim);
        let runs = two_runs(29, tokens, 0.01);
        let square = || zero_square(&client, dim);
        let want = square();
        for bits in &inputs {
            let x = Bf16Matrix::upload(&client, bits, tokens, dim).unwrap();
            xtx_runs_bf16(&client, &blas, &x, &runs, &want).unwrap();
        }
        let want: Vec<f32> = want.download(&client).unwrap();

        let stream = XtxStream::new(0, u64::MAX).unwrap();
        let got = square();
        for bits in &inputs {
            stream.wait_for_products(&client, &got).unwrap();
            let x = Bf16Matrix::upload(&client, bits, tokens, dim).unwrap();
            stream.queue(&client, &x, &runs, &got).unwrap();
            assert_eq!(stream.unmirrored(), 1, "one Hessian queued into");
        }
        stream.wait_for_products(&client, &got).unwrap();
        let before: Vec<f32> = got.download(&client).unwrap();
        let (mut lower_same, mut upper_zero) = (true, 0usize);
        for r in 0..dim {
            for c in 0..dim {
                let (g, w) = (before[r * dim + c], want[r * dim + c]);
                if c <= r {
                    lower_same &= g.to_bits() == w.to_bits();
                } else if g == 0.0 && w != 0.0 {
                    upper_zero += 1;
                }
            }
        }
        assert!(lower_same, "the lower triangle before the mirror");
        // Halving splits 1088 in two spans of 544: the 544 × 544 block above the diagonal
        // blocks is left unwritten (its entries are sums of 258 products, never exactly 0).
        let half = dim / 2;
        assert_eq!(upper_zero, half * half, "upper entries left unfilled");

        let dropped = square();
        let x = Bf16Matrix::upload(&client, &inputs[0], tokens, dim).unwrap();
        stream.queue(&client, &x, &runs, &dropped).unwrap();
        stream.wait_for_products(&client, &dropped).unwrap();
        drop((x, dropped));
        let sentinel = vec![7.0f32; dim * dim];
        let others: Vec<DeviceVec<f32>> = (0..4)
            .map(|_| DeviceVec::upload(&client, &sentinel))
            .collect();
        assert_eq!(stream.unmirrored(), 2);
        stream.settle().unwrap();
        assert_eq!((stream.unmirrored(), stream.in_flight()), (0, 0));
        let after: Vec<f32> = got.download(&client).unwrap();
        let same = after
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "mirrored sums differ from the synchronous ones");
        for other in &others {
            let values: Vec<f32> = other.download(&client).unwrap();
            assert!(
                values == sentinel,
                "a buffer made after the drop was written"
            );
        }
    }

    /// `count` inputs of `len` bf16 values (their bits), each drawn from N(0, 1).
    fn normal_inputs(rng: &mut Rng, count: usize, len: usize) -> Vec<Vec<u16>> {
        (0..count)
            .map(|_| {
                (0..len)
                    .map(|_| bf16::from_f32(rng.normal()).to_bits())
                    .collect()
            })
            .collect()
    }

    /// `tokens` rows in two runs: the first `split` rows weighted `1/split`, the rest `weight`.
    fn two_runs(split: usize, tokens: usize, weight: f32) -> [XtxRun; 2] {
        [
            XtxRun {
                first_row: 0,
                rows: split,
                weight: 1.0 / split as f32,
            },
            XtxRun {
                first_row: split,
                rows: tokens - split,
                weight,
            },
        ]
    }

    /// A new `[dim, dim]` f32 Hessian of zeros, the whole buffer.
    fn zero_square(client: &ComputeClient<CudaRuntime>, dim: usize) -> MatrixView {
        let h = DeviceVec::<f32>::zeros(client, dim * dim).unwrap();
        MatrixView {
            handle: h.handle,
            offset: 0,
            rows: dim,
            cols: dim,
            row_stride: dim,
        }
    }
}
