//! The integration tests of this package in one binary: each module below was a test binary of
//! its own, and each linked the whole stack; one link instead of several keeps CI's build short.

mod common;
mod config;
mod golden;
mod ops;
mod runner;
mod source;
mod store;
