//! Calibration data for post-training quantization: what the Hessians see.
//!
//! - [`read_jsonl`]: JSONL records with `question` / `text` (raw text, the original scripts'
//!   fields) or `messages` (a chat); malformed lines fail with file and line, or are skipped and
//!   counted;
//! - [`CalibTokenizer`]: a model directory's `tokenizer.json` and chat template ([`ChatTemplate`],
//!   rendered with MiniJinja as `transformers` does);
//! - [`CalibSet`]: tokenized samples with `max_len` truncation (head kept), `max_samples` and
//!   cyclic repetition, and the `dense_len` check;
//! - [`CalibStats`]: the coverage report (length buckets, uniqueness), as a table and JSON.

mod error;
mod jsonl;
mod model_dir;
mod stats;
mod template;
mod tokenize;

pub use error::{CalibError, LineError, Result};
pub use jsonl::{
    parse_jsonl, read_jsonl, CalibRecord, CalibText, ChatMessage, JsonlRecords, ReadOptions,
    SkippedLine, MAX_LINE_BYTES,
};
pub use model_dir::model_dense_len;
pub use stats::{uniqueness_ratio, CalibStats, DenseLenReport, LengthBucket, Uniqueness};
pub use template::ChatTemplate;
pub use tokenize::{
    CalibOptions, CalibSample, CalibSet, CalibTokenizer, DenseLenExceedance, MAX_SAMPLES,
    MAX_TOKENS,
};
