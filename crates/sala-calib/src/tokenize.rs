//! Tokenization and sample selection: the calibration set a quantizer consumes.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use crate::error::{CalibError, Result};
use crate::jsonl::{
    read_jsonl, CalibRecord, CalibText, ChatMessage, JsonlRecords, ReadOptions, SkippedLine,
};
use crate::template::ChatTemplate;

/// A model's tokenizer (`tokenizer.json`) and chat template, if it has one.
#[derive(Debug)]
pub struct CalibTokenizer {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
}

impl CalibTokenizer {
    /// Loads `tokenizer.json` and the chat template (see [`ChatTemplate::from_model_dir`]) of a
    /// Hugging Face model directory.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            let why = match std::fs::metadata(&path) {
                Ok(meta) if meta.is_dir() => "is a directory, not the tokenizer file",
                Ok(_) => "is not a regular file",
                Err(_) => "not found",
            };
            return Err(CalibError::Io {
                path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, why),
            });
        }
        let tokenizer = Tokenizer::from_file(&path).map_err(|err| CalibError::Tokenizer {
            path: path.clone(),
            message: err.to_string(),
        })?;
        Ok(Self::new(tokenizer, ChatTemplate::from_model_dir(dir)?))
    }

    /// Wraps an already-built tokenizer and optional chat template.
    pub fn new(tokenizer: Tokenizer, template: Option<ChatTemplate>) -> Self {
        Self {
            tokenizer,
            template,
        }
    }

    /// The chat template used for `messages` records, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The underlying tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
}

/// The most samples a calibration set holds (`max_samples` beyond it is refused before any
/// sample is built; the original scripts use 96).
pub const MAX_SAMPLES: usize = 1 << 20;

/// The most tokens a calibration set holds, repeats included (their ids alone take 4 bytes
/// each, and every token's hidden state is kept between layers).
pub const MAX_TOKENS: usize = 1 << 31;

/// How a calibration set is built from a JSONL file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CalibOptions {
    /// Longest sample in tokens; longer ones are truncated keeping the head (default 131072).
    pub max_len: usize,
    /// Number of samples: the first `max_samples` records, repeated cyclically when the file has
    /// fewer (the original scripts' behaviour). `None` uses every record once.
    pub max_samples: Option<usize>,
    /// Skip malformed JSONL lines, counting them, instead of failing.
    pub skip_malformed: bool,
}

impl Default for CalibOptions {
    fn default() -> Self {
        Self {
            max_len: 131_072,
            max_samples: None,
            skip_malformed: false,
        }
    }
}

/// One tokenized calibration sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalibSample {
    /// 1-based line of the record in the JSONL file.
    pub line: usize,
    /// Token ids, at most `max_len`, including the special tokens the tokenizer adds.
    pub ids: Vec<u32>,
    /// The record was longer than `max_len` and lost its tail.
    pub truncated: bool,
    /// A `messages` record joined as plain text because the model has no chat template.
    pub untemplated_chat: bool,
    /// 0 for a record's first use; `k` for its `k`-th cyclic repetition.
    pub repeat: usize,
}

/// A sample at or above the minicpm4 dense limit (see [`CalibSet::at_or_above`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DenseLenExceedance {
    /// Index of the sample in the set.
    pub sample: usize,
    /// 1-based line of its record.
    pub line: usize,
    /// Its length in tokens.
    pub tokens: usize,
}

/// Tokenized calibration samples, in the order the quantizer will run them.
#[derive(Debug)]
pub struct CalibSet {
    /// The JSONL file they came from.
    pub path: PathBuf,
    /// The samples (records first, then cyclic repeats).
    pub samples: Vec<CalibSample>,
    /// Malformed lines skipped while reading (only with `skip_malformed`).
    pub skipped: Vec<SkippedLine>,
    /// The `max_len` the samples were truncated to.
    pub max_len: usize,
}

impl CalibSet {
    /// Reads, renders and tokenizes `path` as `options` say.
    pub fn load(path: &Path, tokenizer: &CalibTokenizer, options: &CalibOptions) -> Result<Self> {
        let read_options = ReadOptions {
            skip_malformed: options.skip_malformed,
        };
        let records = read_jsonl(path, &read_options)?;
        Self::from_records(path, records, tokenizer, options)
    }

    /// Builds the set from records already read from `path` (used in errors).
    ///
    /// Plain text is encoded with the tokenizer's special tokens (BOS where the tokenizer adds
    /// it), as the original scripts did. A `messages` record is rendered with the chat template
    /// and encoded *without* adding special tokens, as `apply_chat_template` does: the template
    /// writes them itself. When the model has no chat template, its turns' contents are joined by
    /// blank lines and encoded as plain text; such samples are flagged
    /// ([`CalibSample::untemplated_chat`]) and counted in the report.
    pub fn from_records(
        path: &Path,
        mut records: JsonlRecords,
        tokenizer: &CalibTokenizer,
        options: &CalibOptions,
    ) -> Result<Self> {
        if options.max_len == 0 || options.max_samples == Some(0) {
            return Err(CalibError::Option(format!(
                "max_len (--max-len) and max_samples (--max-samples) must be at least 1, got {} \
                 and {}",
                options.max_len,
                options
                    .max_samples
                    .map_or("all".to_owned(), |n| n.to_string())
            )));
        }
        if records.records.is_empty() {
            return Err(CalibError::NoSamples {
                path: path.to_owned(),
                skipped: records.skipped.len(),
            });
        }
        let wanted = options.max_samples.unwrap_or(records.records.len());
        if wanted > MAX_SAMPLES {
            return Err(CalibError::Option(format!(
                "max_samples (--max-samples) {wanted} is more than the {MAX_SAMPLES} samples a \
                 calibration set may hold"
            )));
        }
        records.records.truncate(wanted);

        let truncating = truncating_tokenizer(&tokenizer.tokenizer, options.max_len, path)?;
        let distinct: Vec<CalibSample> = records
            .records
            .par_iter()
            .map(|record| encode_record(record, &truncating, tokenizer.chat_template(), path))
            .collect::<Result<_>>()?;
        let tokens = cyclic_tokens(&distinct, wanted);
        if tokens.is_none_or(|t| t > MAX_TOKENS) {
            return Err(CalibError::Option(format!(
                "{wanted} samples (--max-samples) of these records would hold more than {MAX_TOKENS} \
                 tokens; lower --max-samples or --max-len"
            )));
        }
        Ok(Self {
            path: path.to_owned(),
            samples: repeat_cyclically(distinct, wanted),
            skipped: records.skipped,
            max_len: options.max_len,
        })
    }

    /// Number of distinct records used (samples that are not repeats).
    pub fn distinct(&self) -> usize {
        self.samples.iter().filter(|s| s.repeat == 0).count()
    }

    /// The samples with `dense_len` tokens or more: MiniCPM-SALA's minicpm4 layers use dense
    /// attention only below `sparse_config.dense_len`, so these would take the sparse path
    /// unless calibration overrides `dense_len`.
    pub fn at_or_above(&self, dense_len: usize) -> Vec<DenseLenExceedance> {
        self.samples
            .iter()
            .enumerate()
            .filter(|(_, s)| s.ids.len() >= dense_len)
            .map(|(sample, s)| DenseLenExceedance {
                sample,
                line: s.line,
                tokens: s.ids.len(),
            })
            .collect()
    }
}

/// A copy of `tokenizer` that truncates to `max_len` on the right (keeping the head), exactly as
/// `transformers` does with `truncation=True, max_length=max_len`.
fn truncating_tokenizer(tokenizer: &Tokenizer, max_len: usize, path: &Path) -> Result<Tokenizer> {
    let mut truncating = tokenizer.clone();
    truncating
        .with_truncation(Some(TruncationParams {
            direction: TruncationDirection::Right,
            max_length: max_len,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
        }))
        .map_err(|err| CalibError::Tokenizer {
            path: path.to_owned(),
            message: err.to_string(),
        })?;
    Ok(truncating)
}

fn encode_record(
    record: &CalibRecord,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    path: &Path,
) -> Result<CalibSample> {
    let (text, add_special_tokens, untemplated_chat) = match (&record.text, template) {
        (CalibText::Plain(text), _) => (text.clone(), true, false),
        (CalibText::Chat(messages), Some(template)) => {
            let rendered = template
                .render(messages)
                .map_err(|source| CalibError::Render {
                    path: path.to_owned(),
                    line: record.line,
                    source,
                })?;
            (rendered, false, false)
        }
        (CalibText::Chat(messages), None) => (join_turns(messages), true, true),
    };
    let encoding =
        tokenizer
            .encode(text, add_special_tokens)
            .map_err(|err| CalibError::Encode {
                path: path.to_owned(),
                line: record.line,
                message: err.to_string(),
            })?;
    if encoding.get_ids().is_empty() {
        return Err(CalibError::Encode {
            path: path.to_owned(),
            line: record.line,
            message: "the record gives 0 tokens (an empty rendered chat template, or text the \
                      tokenizer drops entirely)"
                .to_owned(),
        });
    }
    Ok(CalibSample {
        line: record.line,
        ids: encoding.get_ids().to_vec(),
        truncated: !encoding.get_overflowing().is_empty(),
        untemplated_chat,
        repeat: 0,
    })
}

/// A conversation as raw text when the model has no chat template: the turns' contents joined by
/// blank lines, like the original scripts' `question + "\n\n" + response` traces.
fn join_turns(messages: &[ChatMessage]) -> String {
    let contents: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
    contents.join("\n\n")
}

/// Tokens of `wanted` samples cycling through `distinct` (`None` on overflow).
fn cyclic_tokens(distinct: &[CalibSample], wanted: usize) -> Option<usize> {
    let n = distinct.len().max(1);
    let all: usize = distinct.iter().map(|s| s.ids.len()).sum();
    let head: usize = distinct.iter().take(wanted % n).map(|s| s.ids.len()).sum();
    (wanted / n).checked_mul(all)?.checked_add(head)
}

/// Extends `distinct` to `wanted` samples by cycling through it.
fn repeat_cyclically(distinct: Vec<CalibSample>, wanted: usize) -> Vec<CalibSample> {
    let n = distinct.len();
    let repeats: Vec<CalibSample> = (n..wanted)
        .map(|i| CalibSample {
            repeat: i / n,
            ..distinct[i % n].clone()
        })
        .collect();
    let mut samples = distinct;
    samples.extend(repeats);
    samples
}
