//! sala-export: see the crate description; under construction.
