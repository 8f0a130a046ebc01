//! Errors of the evaluation. Each names what the user has to fix.

use thiserror::Error;

/// Why an evaluation could not run.
#[derive(Debug, Error)]
pub enum EvalError {
    /// Loading or running a checkpoint failed.
    #[error(transparent)]
    Pipeline(#[from] sala_gptq::PipelineError),
    /// The model graph refused its input.
    #[error(transparent)]
    Model(#[from] sala_gptq::model::ModelError),
    /// A checkpoint directory could not be read.
    #[error(transparent)]
    Export(#[from] sala_gptq::export::ExportError),
    /// The model's tokenizer could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] sala_gptq::calib::CalibError),
    /// Inputs that do not fit together (shapes, lengths, configs).
    #[error("{0}")]
    InvalidInput(String),
}
