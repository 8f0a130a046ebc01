//! Progress callbacks, so a binary can draw bars without the library knowing how.

/// The stages of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Running the layer on every sample and accumulating statistics.
    Capture,
    /// Smoothing and solving every linear.
    Solve,
    /// Re-running the quantized layer to produce the next layer's inputs.
    Propagate,
}

/// Receives progress; every method has a do-nothing default.
pub trait Progress {
    /// The run starts: `layers` decoder layers, `samples` calibration samples.
    fn start(&mut self, _layers: usize, _samples: usize) {}
    /// A layer begins.
    fn layer(&mut self, _layer: usize) {}
    /// A stage of the current layer begins, with `steps` steps.
    fn stage(&mut self, _stage: Stage, _steps: usize) {}
    /// One step of the current stage is done.
    fn step(&mut self) {}
    /// A layer is done, with its timings and memory.
    fn layer_done(&mut self, _report: &crate::LayerReport) {}
    /// With [`QuantizeOptions::resume`](crate::QuantizeOptions::resume): layer `layer`'s
    /// resume state is on disk (synced, and recorded in the manifest), so a run killed from now
    /// on continues after it. Called after [`layer_done`](Self::layer_done).
    fn layer_saved(&mut self, _layer: usize) {}
    /// A message worth showing (a warning, a skipped sample, where the hidden states live).
    fn message(&mut self, _text: &str) {}
    /// The run is over.
    fn finish(&mut self) {}
}

/// Reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
