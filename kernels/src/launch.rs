//! Launch geometry shared by the kernels: how many cubes of how many units cover `n` work
//! items within the device's limits.

use cubecl::ir::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::{ComputeClient, CubeCount, CubeDim};
use cubecl::Runtime;

use crate::error::KernelError;

/// Units per cube of the elementwise kernels (a multiple of every plane size).
pub(crate) const UNITS_PER_CUBE: u32 = 256;

/// Kernels index with 32-bit integers on every runtime (CubeCL's default address type).
const MAX_INDEX: usize = u32::MAX as usize;

/// Cubes of [`UNITS_PER_CUBE`] units covering `n` items (each unit checks `ABSOLUTE_POS < n`),
/// spread over x and y when x alone would exceed the device's cube-count limit.
pub(crate) fn elementwise<R: Runtime>(
    client: &ComputeClient<R>,
    n: usize,
) -> Result<(CubeCount, CubeDim), KernelError> {
    let units = UNITS_PER_CUBE.min(client.properties().hardware.max_units_per_cube);
    let count = cube_count(client, n.div_ceil(units as usize))?;
    Ok((count, CubeDim::new_1d(units)))
}

/// `cubes` cubes laid out as `x × y` with `x` within the device limit (a few idle cubes at
/// the end when `cubes` does not factor).
pub(crate) fn cube_count<R: Runtime>(
    client: &ComputeClient<R>,
    cubes: usize,
) -> Result<CubeCount, KernelError> {
    check_addressable("work items", cubes.saturating_mul(UNITS_PER_CUBE as usize))?;
    let (max_x, max_y, _) = client.properties().hardware.max_cube_count;
    let max_x = (max_x as usize).max(1);
    let x = cubes.clamp(1, max_x);
    let y = cubes.div_ceil(x).max(1);
    if y > max_y as usize {
        return Err(KernelError::unsupported(
            "launch size",
            format!("{cubes} cubes exceed the device's {max_x}×{max_y} grid"),
        ));
    }
    Ok(CubeCount::Static(x as u32, y as u32, 1))
}

/// Errors when an index would not fit the kernels' 32-bit addressing.
pub(crate) fn check_addressable(what: &'static str, n: usize) -> Result<(), KernelError> {
    if n > MAX_INDEX {
        return Err(KernelError::unsupported(
            what,
            format!("{n} elements exceed 32-bit kernel indexing"),
        ));
    }
    Ok(())
}

/// Rows, columns and depth of the cooperative matrix tiles the tensor-core kernels use.
const CMMA_TILE: u32 = 16;

/// Units per plane the tensor-core kernels are written for (CUDA's warp).
const CMMA_PLANE: u32 = 32;

/// Whether `client`'s runtime offers 16×16×16 bf16 → f32 cooperative matrices with 32-unit
/// planes, what the tensor-core kernels are built on.
pub(crate) fn bf16_cmma_supported<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let bf16_type = ElemType::Float(FloatKind::BF16).into();
    let config = MmaConfig {
        a_type: bf16_type,
        b_type: bf16_type,
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: CMMA_TILE,
        n: CMMA_TILE,
        k: CMMA_TILE,
    };
    let hardware = &client.properties().hardware;
    client.features().matmul.cmma.contains(&config)
        && hardware.plane_size_min == CMMA_PLANE
        && hardware.plane_size_max == CMMA_PLANE
}

/// Rows, columns and depth of the manual matrix product the flash kernel is built on
/// (`mma.m16n8k16`).
const MMA_SHAPE: (u32, u32, u32) = (16, 8, 16);

/// Whether `client`'s runtime offers the manual `m16n8k16` bf16 → f32 matrix products and
/// bf16 `ldmatrix` (CUDA from sm_80), with 32-unit planes.
pub(crate) fn bf16_mma_supported<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let bf16_type = ElemType::Float(FloatKind::BF16).into();
    let (m, n, k) = MMA_SHAPE;
    let config = MmaConfig {
        a_type: bf16_type,
        b_type: bf16_type,
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m,
        n,
        k,
    };
    let hardware = &client.properties().hardware;
    let matmul = &client.features().matmul;
    matmul.mma.contains(&config)
        && matmul.ldmatrix.contains(&bf16_type)
        && hardware.plane_size_min == CMMA_PLANE
        && hardware.plane_size_max == CMMA_PLANE
}

/// Errors (naming `what`) unless the device allows cubes of `units` units with
/// `shared_bytes` bytes of shared memory each.
pub(crate) fn check_cube_resources<R: Runtime>(
    client: &ComputeClient<R>,
    what: &'static str,
    units: usize,
    shared_bytes: usize,
) -> Result<(), KernelError> {
    let hardware = &client.properties().hardware;
    if (hardware.max_units_per_cube as usize) < units
        || hardware.max_shared_memory_size < shared_bytes
    {
        return Err(KernelError::unsupported(
            what,
            format!(
                "the kernel needs {units} units and {shared_bytes} bytes of shared memory per \
                 cube; the device allows {} and {}",
                hardware.max_units_per_cube, hardware.max_shared_memory_size
            ),
        ));
    }
    Ok(())
}
