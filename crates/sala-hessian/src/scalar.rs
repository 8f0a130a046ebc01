//! The two floating-point types a Hessian may be stored in, and the activation types a batch
//! may arrive in.

use faer::traits::RealField;
use half::{bf16, f16};

/// Storage precision of a Hessian: `f32` (fast, what IST-DASLab GPTQ uses) or `f64` (what
/// the original SALA script uses). Sealed: only these two.
pub trait HessianScalar:
    RealField + Copy + Send + Sync + PartialOrd + Into<f64> + sealed::Sealed + 'static
{
    /// Converts from f64 (rounding to nearest for f32).
    fn from_f64(x: f64) -> Self;
    /// Converts from f32 (exact).
    fn from_f32(x: f32) -> Self;
    /// Converts to f32 (rounding to nearest for f64).
    fn to_f32(self) -> f32;
}

impl HessianScalar for f32 {
    #[inline]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl HessianScalar for f64 {
    #[inline]
    fn from_f64(x: f64) -> Self {
        x
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        x as f64
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self as f32
    }
}

/// An activation element as the model produces it: `f32`, `bf16` or `f16`.
///
/// `Into<f32>` (which all three have) lets sala-smooth's channel sums read a batch directly.
pub trait Activation: Copy + Send + Sync + Into<f32> + sealed::Sealed {
    /// The value as f32 (exact for all three types).
    fn to_f32(self) -> f32;
}

impl Activation for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Activation for bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Activation for f16 {
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}
