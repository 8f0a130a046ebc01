//! sala-hessian: see the crate description; under construction.
