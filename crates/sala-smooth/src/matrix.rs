//! A named, shape-checked view of a linear layer's weight.

use crate::error::{Result, SmoothError};
use rayon::prelude::*;

/// A mutable view of one linear layer's weight, row-major `[out, in]` (`rows = out` features,
/// `cols = in` features), as PyTorch and safetensors store `nn.Linear.weight`.
///
/// The name travels with the data so every shape error names the tensor.
#[derive(Debug)]
pub struct WeightMatrix<'a> {
    name: &'a str,
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
}

impl<'a> WeightMatrix<'a> {
    /// Wraps `data` (`rows · cols` values, row-major `[rows = out, cols = in]`).
    ///
    /// Fails with [`SmoothError::BufferSize`] when the length does not match the shape.
    pub fn new(name: &'a str, data: &'a mut [f32], rows: usize, cols: usize) -> Result<Self> {
        let expected = rows.checked_mul(cols);
        if expected != Some(data.len()) {
            return Err(SmoothError::BufferSize {
                what: name.to_owned(),
                rows,
                cols,
                expected: expected.unwrap_or(usize::MAX),
                actual: data.len(),
            });
        }
        Ok(Self {
            name,
            data,
            rows,
            cols,
        })
    }

    /// The tensor's name, as given to [`WeightMatrix::new`].
    pub fn name(&self) -> &str {
        self.name
    }

    /// Output features (rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (columns).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The weight values, row-major `[rows, cols]`.
    pub fn data(&self) -> &[f32] {
        self.data
    }

    /// The weight values, mutable, row-major `[rows, cols]`.
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.data
    }

    /// The rows (each `cols` long) for rayon: full-size weights hold up to 67M values.
    pub(crate) fn rows_par_iter(&self) -> rayon::slice::ChunksExact<'_, f32> {
        self.data.par_chunks_exact(self.cols.max(1))
    }

    /// The rows, mutably, for rayon.
    pub(crate) fn rows_par_iter_mut(&mut self) -> rayon::slice::ChunksExactMut<'_, f32> {
        self.data.par_chunks_exact_mut(self.cols.max(1))
    }
}

/// Checks that `what` has `expected` channels.
pub(crate) fn check_channels(what: &str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(SmoothError::ChannelCount {
            what: what.to_owned(),
            expected,
            actual,
        })
    }
}
