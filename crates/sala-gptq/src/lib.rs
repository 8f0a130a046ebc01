//! sala-gptq: see the crate description; under construction.
