//! # sala-report-html
//!
//! The HTML quantization report: one self-contained page (`quantization_report.html`) with the
//! run, the plan, the calibration coverage, plots and the per-linear and per-layer tables,
//! rendered from `quantization_report.json` and, when given, the JSON of `eval_quant` and
//! `drift`. No network, no script, no font file: styles inline, plots inline SVG.
//!
//! It depends on neither the model nor the GPU stack: it reads the JSON the tools write, so a
//! page can be rendered again from a committed checkpoint (`render_report`).
//!
//! - [`data`]: the inputs as serde reads them ([`QuantizationReport`], [`EvalResults`],
//!   [`DriftResults`]) and the plan summary per layer kind ([`Plan::summary`]);
//! - [`charts`]: the plots, drawn with `plotters`' SVG backend ([`Charts`]);
//! - [`page`]: the view and the `minijinja` template ([`render`]);
//! - [`ReportError`]: every failure, naming the file at fault.

pub mod charts;
pub mod data;
mod error;
pub mod page;

pub use charts::Charts;
pub use data::{
    drift_from_file, DriftResults, ErrorHessian, EvalResults, Plan, PlanRow, QuantizationReport,
};
pub use error::ReportError;
pub use page::{render, Inputs};

/// The page's file name in an output directory, next to `quantization_report.json`.
pub const HTML_FILE: &str = "quantization_report.html";

impl Inputs {
    /// Reads the report and the optional evaluation and drift files; each error names its
    /// file. Nothing is rendered yet, so a caller can check its inputs before long work.
    pub fn load(
        report: &std::path::Path,
        eval: Option<&std::path::Path>,
        drift: Option<&std::path::Path>,
    ) -> Result<Self, ReportError> {
        Ok(Self {
            report: QuantizationReport::from_file(report)?,
            eval: eval.map(EvalResults::from_file).transpose()?,
            drift: drift.map(drift_from_file).transpose()?,
        })
    }
}
