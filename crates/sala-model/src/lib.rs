//! sala-model: see the crate description; under construction.
