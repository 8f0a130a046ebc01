//! Errors of the facade. Each names what the user has to fix.

use thiserror::Error;

/// A plan that a loader would refuse, or options that do not make sense together.
#[derive(Debug, Error)]
pub enum PlanError {
    /// `--layer-bits` item that does not parse.
    #[error("--layer-bits: cannot parse {item:?} (expected `layer:bits` or `first-last:bits`, e.g. \"0:4,2-7:8,8:16\")")]
    LayerBits {
        /// The item.
        item: String,
    },
    /// The same layer range given twice (the second would silently win).
    #[error("--layer-bits names layers {layers} twice ({first} and {second} bits); give each range once (a later, narrower range may override a wider one)")]
    DuplicateLayerBits {
        /// The range as written.
        layers: String,
        /// Bits of the first rule.
        first: u32,
        /// Bits of the second rule.
        second: u32,
    },
    /// A layer index beyond the model.
    #[error("--layer-bits names layer {layer}, but the model has {layers} layers")]
    LayerOutOfRange {
        /// The layer named.
        layer: usize,
        /// Layers in the model.
        layers: usize,
    },
    /// A bit width the recipe cannot produce.
    #[error("{bits} bits is not possible with the {recipe} recipe (allowed: {allowed}; set by --bits, --layer-bits, --minicpm4-bits or --lightning-bits)")]
    Bits {
        /// Requested bits.
        bits: u32,
        /// Recipe name.
        recipe: &'static str,
        /// What is allowed.
        allowed: &'static str,
    },
    /// A linear whose shape breaks a serving kernel's rule.
    #[error("{linear} [{out_features}x{in_features}] breaks the loader rule {rule}; exclude it (--exclude) or change the plan")]
    Shape {
        /// Module name.
        linear: String,
        /// Rows.
        out_features: usize,
        /// Columns.
        in_features: usize,
        /// The rule.
        rule: String,
    },
    /// Members of a fused group (q/k/v or gate/up) at different precisions.
    #[error("fused group {group} mixes precisions ({members}); vLLM and SGLang refuse this")]
    FusedMismatch {
        /// Group name.
        group: String,
        /// Member treatments.
        members: String,
    },
    /// A regular expression that does not compile.
    #[error("--exclude {pattern:?}: {message}")]
    Regex {
        /// The pattern.
        pattern: String,
        /// The regex crate's message.
        message: String,
    },
    /// A plan that keeps every linear in 16 bits: the output would hold no quantized weight.
    #[error("nothing to quantize: every linear is kept in 16 bits (check --bits, --layer-bits, --minicpm4-bits, --lightning-bits and --exclude)")]
    NothingQuantized,
    /// A quantized linear the checkpoint's loader would not serve.
    #[error("{linear}: {detail}")]
    Loader {
        /// Module name.
        linear: String,
        /// The loader and its rule.
        detail: String,
    },
    /// A solver or smoothing option out of its range.
    #[error("{option}: {message}")]
    Option {
        /// The option (as the command line spells it).
        option: &'static str,
        /// What is wrong with it.
        message: String,
    },
}

/// Anything that stops a quantization run. The output directory is then absent (or, with
/// `overwrite`, the previous one untouched).
#[derive(Debug, Error)]
pub enum PipelineError {
    /// The plan was refused.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// Reading the model or running it.
    #[error(transparent)]
    Model(#[from] sala_model::ModelError),
    /// Calibration data.
    #[error(transparent)]
    Calib(#[from] sala_calib::CalibError),
    /// A solver.
    #[error("{linear}: {source}")]
    Solve {
        /// The linear being solved.
        linear: String,
        /// What failed.
        source: sala_hessian::HessianError,
    },
    /// Smoothing.
    #[error("smoothing {group}: {source}")]
    Smooth {
        /// The group's source.
        group: String,
        /// What failed.
        source: sala_smooth::SmoothError,
    },
    /// Packing into a format.
    #[error("{linear}: {source}")]
    Format {
        /// The linear.
        linear: String,
        /// What failed.
        source: sala_formats::FormatError,
    },
    /// Writing or verifying the checkpoint.
    #[error(transparent)]
    Export(#[from] sala_export::ExportError),
    /// The written checkpoint breaks a loader rule (the directory has been removed).
    #[error("the written checkpoint failed verification:\n{0}")]
    Verify(String),
    /// The forward pass of one sample failed (and skipping was not asked for).
    #[error("sample {sample} (calibration line {line}) failed in layer {layer}: {message}")]
    Sample {
        /// Sample index.
        sample: usize,
        /// Line in the calibration file.
        line: usize,
        /// Layer.
        layer: usize,
        /// What failed.
        message: String,
    },
    /// Statistics accumulated on the device hold a NaN or an infinity: some sample's
    /// activations overflowed (host statistics name the sample).
    #[error("the statistics of {input} are not finite (value {index}); a calibration sample's activations overflowed: run with host statistics to find it")]
    NonFiniteStatistics {
        /// The input (its first reader's name).
        input: String,
        /// Index of the first non-finite value.
        index: usize,
    },
    /// The device failed (a kernel or a transfer), outside any one sample.
    #[error("layer {layer}: {message}")]
    Device {
        /// The layer being run.
        layer: usize,
        /// What the backend said.
        message: String,
    },
    /// No calibration sample is left.
    #[error("no calibration samples: {0}")]
    NoSamples(String),
    /// The run would need more memory or address space than there is.
    #[error("too large: {0}")]
    TooLarge(String),
    /// A calibration token id the model's embedding has no row for.
    #[error("calibration line {line}: token id {id} is outside the model's vocabulary (vocab_size {vocab} in config.json); is tokenizer.json this model's?")]
    TokenOutOfRange {
        /// Line of the sample in the calibration file.
        line: usize,
        /// The token id.
        id: u32,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// Tensors of the checkpoint that the config has no place for (they would be dropped).
    #[error("{dir}: {} tensor(s) that config.json has no place for would be dropped, changing the model: {}", names.len(), list_some(names))]
    UnusedTensors {
        /// The model directory.
        dir: std::path::PathBuf,
        /// The tensors.
        names: Vec<String>,
    },
    /// A resumable run's staged state that cannot be resumed: made with other inputs or
    /// options (the message names every difference), or damaged.
    #[error("cannot resume from {dir}: {message}")]
    Resume {
        /// The staging directory (or its resume directory).
        dir: std::path::PathBuf,
        /// What differs or is wrong.
        message: String,
    },
    /// Something the pipeline does not do yet.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A file-system operation.
    #[error("{path}: {message}")]
    Io {
        /// The path involved.
        path: std::path::PathBuf,
        /// What failed.
        message: String,
    },
}

impl PipelineError {
    /// The map from a solver's error to [`PipelineError::Solve`] naming `linear`.
    pub(crate) fn solve(linear: &str) -> impl Fn(sala_hessian::HessianError) -> Self + Copy + '_ {
        move |source| PipelineError::Solve {
            linear: linear.to_owned(),
            source,
        }
    }
}

/// The first few of `names`, and how many more.
fn list_some(names: &[String]) -> String {
    let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    match names.len().saturating_sub(shown.len()) {
        0 => shown.join(", "),
        more => format!("{}, and {more} more", shown.join(", ")),
    }
}
