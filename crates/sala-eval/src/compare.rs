//! The original and the quantized model on the same sequences, per length bucket.

use crate::error::EvalError;
use crate::metrics::{Metrics, MetricsAccumulator};
use crate::model::{host_values, LoadedModel};
use crate::sequences::Sequence;
use burn::tensor::backend::Backend;
use sala_gptq::model::LayerRunner;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The metrics of one length bucket.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketReport {
    /// Sequence length (tokens, BOS included).
    pub length: usize,
    /// Sequences in the bucket.
    pub sequences: usize,
    /// Their statistics.
    pub metrics: Metrics,
}

/// A comparison of a quantized model with its original.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalReport {
    /// Directory of the original model.
    pub original: String,
    /// Format of the original (normally `"unquantized"`).
    pub original_format: String,
    /// Directory of the quantized model.
    pub quantized: String,
    /// Format of the quantized model.
    pub quantized_format: String,
    /// One entry per length, ascending.
    pub buckets: Vec<BucketReport>,
    /// All positions of all sequences.
    pub overall: Metrics,
}

/// Runs both models on every sequence and compares their logits position by position.
pub fn evaluate<B: Backend>(
    runner: &LayerRunner<B>,
    original: &LoadedModel,
    quantized: &LoadedModel,
    sequences: &[Sequence],
) -> Result<EvalReport, EvalError> {
    if sequences.is_empty() {
        return Err(EvalError::InvalidInput(
            "no evaluation sequences (is the text shorter than the shortest length?)".into(),
        ));
    }
    let vocab = runner.config().vocab_size();
    let mut buckets: BTreeMap<usize, (usize, MetricsAccumulator)> = BTreeMap::new();
    for sequence in sequences {
        let p = host_values(original.logits(runner, &sequence.ids)?)?;
        let q = host_values(quantized.logits(runner, &sequence.ids)?)?;
        let (count, acc) = buckets.entry(sequence.bucket).or_default();
        *count += 1;
        acc.add_sequence(&p, &q, vocab, &sequence.ids)?;
    }
    let mut overall = MetricsAccumulator::default();
    for (_, acc) in buckets.values() {
        overall.merge(acc);
    }
    Ok(EvalReport {
        original: original.dir().display().to_string(),
        original_format: original.format().to_owned(),
        quantized: quantized.dir().display().to_string(),
        quantized_format: quantized.format().to_owned(),
        buckets: buckets
            .into_iter()
            .map(|(length, (sequences, acc))| BucketReport {
                length,
                sequences,
                metrics: acc.finish(),
            })
            .collect(),
        overall: overall.finish(),
    })
}

impl EvalReport {
    /// A Markdown table: one row per bucket and one for all.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "| length | seqs | tokens | ppl orig | ppl quant | KL mean | KL max | top-1 |"
        );
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---:|");
        let rows = self
            .buckets
            .iter()
            .map(|b| (b.length.to_string(), b.sequences, &b.metrics));
        let total = self.buckets.iter().map(|b| b.sequences).sum();
        for (label, seqs, m) in rows.chain([("all".to_owned(), total, &self.overall)]) {
            let _ = writeln!(
                s,
                "| {label} | {seqs} | {} | {:.3} | {:.3} | {:.5} | {:.4} | {:.4} |",
                m.tokens,
                m.perplexity_original,
                m.perplexity_quantized,
                m.kl_mean,
                m.kl_max,
                m.top1_agreement
            );
        }
        s
    }
}
