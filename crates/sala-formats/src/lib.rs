//! sala-formats: see the crate description; under construction.
