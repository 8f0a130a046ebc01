//! `C ← β·C + α·op(A)·op(B)` on f32 windows: the [`Gemm`] trait every product of this crate
//! goes through, and its portable implementation [`CubeGemm`] (cubek-matmul + a CubeCL
//! epilogue). The CUDA glue implements the same trait with cuBLAS.

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubek_matmul::definition::{MatmulElems, MatmulGlobalElems, MatmulSetupError};
use cubek_matmul::launch::Strategy;
use cubek_std::InputBinding;

use crate::device::{array_arg, MatrixView};
use crate::error::KernelError;
use crate::launch::elementwise;

/// A general matrix product on one runtime.
pub trait Gemm<R: cubecl::Runtime> {
    /// `c ← beta·c + alpha·op(a)·op(b)`, `op(x) = xᵀ` when the flag is set; f32 in and out.
    /// Shapes are checked (op(a): m×k, op(b): k×n, c: m×n) and give KernelError::Shape.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        client: &cubecl::prelude::ComputeClient<R>,
        alpha: f32,
        a: &MatrixView,
        trans_a: bool,
        b: &MatrixView,
        trans_b: bool,
        beta: f32,
        c: &MatrixView,
    ) -> Result<(), KernelError>;
}

/// The portable implementation: cubek-matmul for the product (into a scratch buffer) + an
/// elementwise CubeCL kernel for `beta·c + alpha·p`.
///
/// The product uses cubek's unit (FMA) routine, never tensor cores: on CUDA an f32 tensor-core
/// product would round its inputs to tf32, and GPTQ's error propagation needs f32.
#[derive(Debug, Clone, Copy, Default)]
pub struct CubeGemm;

/// The `(rows, cols)` of `op(x)`.
fn op_shape(x: &MatrixView, trans: bool) -> (usize, usize) {
    if trans {
        (x.cols, x.rows)
    } else {
        (x.rows, x.cols)
    }
}

/// Checks the three windows and returns `(m, n, k)`.
pub fn check_gemm_shapes(
    a: &MatrixView,
    trans_a: bool,
    b: &MatrixView,
    trans_b: bool,
    c: &MatrixView,
) -> Result<(usize, usize, usize), KernelError> {
    a.check("gemm a")?;
    b.check("gemm b")?;
    c.check("gemm c")?;
    let (m, k) = op_shape(a, trans_a);
    let (k2, n) = op_shape(b, trans_b);
    if k != k2 || c.rows != m || c.cols != n {
        return Err(KernelError::shape(
            "gemm",
            format!(
                "op(a) {m}×{k}, op(b) {k2}×{n}, c {}×{} (trans_a {trans_a}, trans_b {trans_b})",
                c.rows, c.cols
            ),
        ));
    }
    Ok((m, n, k))
}

impl<R: Runtime> Gemm<R> for CubeGemm {
    fn gemm(
        &self,
        client: &ComputeClient<R>,
        alpha: f32,
        a: &MatrixView,
        trans_a: bool,
        b: &MatrixView,
        trans_b: bool,
        beta: f32,
        c: &MatrixView,
    ) -> Result<(), KernelError> {
        let (m, n, k) = check_gemm_shapes(a, trans_a, b, trans_b, c)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let product = if k == 0 || alpha == 0.0 {
            // BLAS semantics: `op(a)·op(b)` is not evaluated, `c` is only scaled.
            MatrixView::zeros(client, m, n)?
        } else {
            matmul_into_scratch(client, a, trans_a, b, trans_b, m, n)?
        };
        axpby(client, alpha, &product, beta, c)
    }
}

/// `op(a)·op(b)` into a new dense `m × n` buffer.
fn matmul_into_scratch<R: Runtime>(
    client: &ComputeClient<R>,
    a: &MatrixView,
    trans_a: bool,
    b: &MatrixView,
    trans_b: bool,
    m: usize,
    n: usize,
) -> Result<MatrixView, KernelError> {
    let lhs = operand(client, a, trans_a)?;
    let rhs = operand(client, b, trans_b)?;
    let out = client.empty(m * n * size_of::<f32>());
    let out_binding = TensorBinding::<R> {
        handle: out.clone().binding(),
        strides: [n, 1].into(),
        shape: [m, n].into(),
        runtime: std::marker::PhantomData,
    };
    let f32_type = <f32 as CubeElement>::cube_type();
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: f32_type,
        rhs: f32_type,
        out: f32_type,
    });
    let input = |t: &TensorBinding<R>| InputBinding::new(t.clone(), f32_type);
    // The unit routine first (plain f32 FMAs); the naive kernel if a device refuses it.
    let result = Strategy::SimpleUnit(Default::default())
        .launch_ref_checked(
            client,
            input(&lhs),
            input(&rhs),
            out_binding.clone(),
            &mut dtypes,
        )
        .or_else(|_| {
            Strategy::Naive.launch_ref_checked(
                client,
                input(&lhs),
                input(&rhs),
                out_binding,
                &mut dtypes,
            )
        });
    result.map_err(|e| KernelError::Launch {
        what: "gemm (cubek-matmul)",
        message: format!("{e:?}"),
    })?;
    Ok(MatrixView {
        handle: out,
        offset: 0,
        rows: m,
        cols: n,
        row_stride: n,
    })
}

/// Launching through the public `launch_ref` with our error type.
trait LaunchChecked<R: Runtime> {
    fn launch_ref_checked(
        &self,
        client: &ComputeClient<R>,
        lhs: InputBinding<R>,
        rhs: InputBinding<R>,
        out: TensorBinding<R>,
        dtypes: &mut MatmulElems,
    ) -> Result<(), MatmulSetupError>;
}

impl<R: Runtime> LaunchChecked<R> for Strategy {
    fn launch_ref_checked(
        &self,
        client: &ComputeClient<R>,
        lhs: InputBinding<R>,
        rhs: InputBinding<R>,
        out: TensorBinding<R>,
        dtypes: &mut MatmulElems,
    ) -> Result<(), MatmulSetupError> {
        cubek_matmul::launch::launch_ref(self, client, lhs, rhs, out, dtypes)
    }
}

/// Bytes a binding offset must be a multiple of. wgpu requires
/// `min_storage_buffer_offset_alignment` (256 by default); 256 also suits CUDA.
const BINDING_ALIGN_BYTES: usize = 256;

/// A tensor binding of `op(x)`: the window itself when its offset can be bound, else a dense
/// copy of it (cubek-matmul reads strided tensors but cannot take an unaligned offset).
fn operand<R: Runtime>(
    client: &ComputeClient<R>,
    x: &MatrixView,
    trans: bool,
) -> Result<TensorBinding<R>, KernelError> {
    let align = BINDING_ALIGN_BYTES.max(client.properties().memory.alignment as usize);
    let x = if (x.offset * size_of::<f32>()) % align == 0 {
        x.clone()
    } else {
        pack(client, x)?
    };
    let handle: Handle = x
        .handle
        .clone()
        .offset_start((x.offset * size_of::<f32>()) as u64);
    let (shape, strides) = if trans {
        ([x.cols, x.rows], [1, x.row_stride])
    } else {
        ([x.rows, x.cols], [x.row_stride, 1])
    };
    Ok(TensorBinding {
        handle: handle.binding(),
        strides: strides.into(),
        shape: shape.into(),
        runtime: std::marker::PhantomData,
    })
}

/// A dense copy of a window.
pub(crate) fn pack<R: Runtime>(
    client: &ComputeClient<R>,
    x: &MatrixView,
) -> Result<MatrixView, KernelError> {
    x.check("pack")?;
    let out = client.empty(x.len().max(1) * size_of::<f32>());
    if !x.is_empty() {
        let (count, dim) = elementwise(client, x.len())?;
        pack_kernel::launch::<R>(
            client,
            count,
            dim,
            array_arg(&x.handle),
            array_arg(&out),
            x.offset,
            x.row_stride,
            x.rows,
            x.cols,
        );
    }
    Ok(MatrixView {
        handle: out,
        offset: 0,
        rows: x.rows,
        cols: x.cols,
        row_stride: x.cols,
    })
}

/// `c ← beta·c + alpha·p` for a dense `p` of the shape of the window `c`.
fn axpby<R: Runtime>(
    client: &ComputeClient<R>,
    alpha: f32,
    p: &MatrixView,
    beta: f32,
    c: &MatrixView,
) -> Result<(), KernelError> {
    let (count, dim) = elementwise(client, c.len())?;
    axpby_kernel::launch::<R>(
        client,
        count,
        dim,
        array_arg(&p.handle),
        array_arg(&c.handle),
        alpha,
        beta,
        c.offset,
        c.row_stride,
        c.rows,
        c.cols,
    );
    Ok(())
}

/// `dst[i·cols + j] = src[offset + i·row_stride + j]`, one unit per element.
#[cube(launch)]
fn pack_kernel(
    src: &Array<f32>,
    dst: &mut Array<f32>,
    offset: usize,
    row_stride: usize,
    rows: usize,
    cols: usize,
) {
    let idx = ABSOLUTE_POS;
    if idx < rows * cols {
        let (i, j) = (idx / cols, idx % cols);
        dst[idx] = src[offset + i * row_stride + j];
    }
}

/// `c[i, j] ← beta·c[i, j] + alpha·p[i·cols + j]` on the window `(offset, row_stride)` of `c`;
/// `c` is not read when `beta == 0` (so NaN garbage in `c` does not propagate, as in BLAS).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn axpby_kernel(
    p: &Array<f32>,
    c: &mut Array<f32>,
    alpha: f32,
    beta: f32,
    offset: usize,
    row_stride: usize,
    rows: usize,
    cols: usize,
) {
    let idx = ABSOLUTE_POS;
    if idx < rows * cols {
        let at = offset + (idx / cols) * row_stride + idx % cols;
        let scaled = alpha * p[idx];
        if beta == 0.0 {
            c[at] = scaled;
        } else {
            c[at] = beta * c[at] + scaled;
        }
    }
}
