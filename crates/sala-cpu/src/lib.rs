//! `sala-cpu`: what the CPU path needs below the model, on every x86-64 machine.
//!
//! - [`vector_state`]: clears the upper vector state that faer's AVX-512 GEMM kernels leave
//!   dirty ([`clear_upper_state`], [`clear_upper_state_everywhere`]), and reads it
//!   ([`upper_state_in_use`]).
//! - [`vector_math`]: `exp`, the logistic sigmoid and softmax over slices, eight lanes at a time
//!   ([`exp_in_place`], [`sigmoid_into`], [`softmax_in_place`]), where libm's scalar `expf`
//!   (and burn's `exp(−ln(1 + exp(−x)))` sigmoid) cost most of a small model's forward.

pub mod vector_math;
pub mod vector_state;

pub use vector_math::{exp_in_place, sigmoid_into, softmax_in_place, EXP_MAX_ULPS};
pub use vector_state::{clear_upper_state, clear_upper_state_everywhere, upper_state_in_use};
