//! The integration tests of this package in one binary: each module below was a test binary of
//! its own, and each linked the whole stack; one link instead of several keeps CI's build short.

mod block_search;
mod common;
mod gptq;
mod hessian;
mod nvfp4_gptq;
