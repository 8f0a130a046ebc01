//! sala-smooth: see the crate description; under construction.
