//! Per-token statistics of two models' logits on the same tokens, in f64.
//!
//! For position `t` with original distribution `p` and quantized `q` (softmax of the logits):
//! `KL(p ‖ q) = Σ p (log p − log q)`, top-1 agreement `argmax p == argmax q`, and, where the
//! next token `y = ids[t+1]` is known, the negative log-likelihoods `−log p(y)`, `−log q(y)`.
//! Perplexity is `exp(mean NLL)` over the predicted positions.

use crate::error::EvalError;
use serde::Serialize;

/// `log softmax(row)` in f64 (max-subtracted).
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    row.iter().map(|&x| x as f64 - log_z).collect()
}

/// Index of the first largest value.
fn argmax(row: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}

/// `KL(p ‖ q)` from log-probabilities.
fn kl_divergence(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| lp.exp() * (lp - lq))
        .sum()
}

/// The statistics of one position.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenComparison {
    /// `KL(original ‖ quantized)` in nats.
    pub kl: f64,
    /// Whether both models rank the same token first.
    pub agree: bool,
    /// `(−log p(y), −log q(y))` of the next token `y`, when it is known.
    pub nll: Option<(f64, f64)>,
}

/// Compares one position's logits; `next` is the token that follows (if any).
pub fn compare_token(
    original: &[f32],
    quantized: &[f32],
    next: Option<u32>,
) -> Result<TokenComparison, EvalError> {
    if original.len() != quantized.len() || original.is_empty() {
        return Err(EvalError::InvalidInput(format!(
            "logit rows of {} and {} entries cannot be compared",
            original.len(),
            quantized.len()
        )));
    }
    let (log_p, log_q) = (log_softmax(original), log_softmax(quantized));
    let nll = match next {
        None => None,
        Some(y) if (y as usize) < log_p.len() => Some((-log_p[y as usize], -log_q[y as usize])),
        Some(y) => {
            return Err(EvalError::InvalidInput(format!(
                "token id {y} is outside the vocabulary of {}",
                log_p.len()
            )))
        }
    };
    Ok(TokenComparison {
        kl: kl_divergence(&log_p, &log_q),
        agree: argmax(&log_p) == argmax(&log_q),
        nll,
    })
}

/// Sums of per-token statistics; [`MetricsAccumulator::finish`] turns them into [`Metrics`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsAccumulator {
    tokens: usize,
    agreements: usize,
    kl_sum: f64,
    kl_max: f64,
    predicted: usize,
    nll_original: f64,
    nll_quantized: f64,
}

impl MetricsAccumulator {
    /// Adds one position.
    pub fn add(&mut self, token: &TokenComparison) {
        self.tokens += 1;
        self.agreements += usize::from(token.agree);
        self.kl_sum += token.kl;
        self.kl_max = self.kl_max.max(token.kl);
        if let Some((p, q)) = token.nll {
            self.predicted += 1;
            self.nll_original += p;
            self.nll_quantized += q;
        }
    }

    /// Adds every position of one sequence: logits `[ids.len(), vocab]` row-major of both
    /// models; position `t` predicts `ids[t + 1]`.
    pub fn add_sequence(
        &mut self,
        original: &[f32],
        quantized: &[f32],
        vocab: usize,
        ids: &[u32],
    ) -> Result<(), EvalError> {
        let expected = ids.len() * vocab;
        if vocab == 0 || original.len() != expected || quantized.len() != expected {
            return Err(EvalError::InvalidInput(format!(
                "logits of {} and {} values do not match {} tokens × vocabulary {vocab}",
                original.len(),
                quantized.len(),
                ids.len()
            )));
        }
        let rows = original.chunks(vocab).zip(quantized.chunks(vocab));
        for (t, (p, q)) in rows.enumerate() {
            self.add(&compare_token(p, q, ids.get(t + 1).copied())?);
        }
        Ok(())
    }

    /// Adds another accumulator's positions.
    pub fn merge(&mut self, other: &Self) {
        self.tokens += other.tokens;
        self.agreements += other.agreements;
        self.kl_sum += other.kl_sum;
        self.kl_max = self.kl_max.max(other.kl_max);
        self.predicted += other.predicted;
        self.nll_original += other.nll_original;
        self.nll_quantized += other.nll_quantized;
    }

    /// The means (NaN where nothing was added).
    pub fn finish(&self) -> Metrics {
        let mean = |sum: f64, n: usize| sum / n as f64;
        Metrics {
            tokens: self.tokens,
            predicted: self.predicted,
            perplexity_original: mean(self.nll_original, self.predicted).exp(),
            perplexity_quantized: mean(self.nll_quantized, self.predicted).exp(),
            kl_mean: mean(self.kl_sum, self.tokens),
            kl_max: self.kl_max,
            top1_agreement: mean(self.agreements as f64, self.tokens),
        }
    }
}

/// Quality of the quantized model relative to the original over a set of positions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metrics {
    /// Positions compared (KL, top-1).
    pub tokens: usize,
    /// Positions with a known next token (perplexity).
    pub predicted: usize,
    /// Perplexity of the original model.
    pub perplexity_original: f64,
    /// Perplexity of the quantized model.
    pub perplexity_quantized: f64,
    /// Mean per-token `KL(original ‖ quantized)`, nats.
    pub kl_mean: f64,
    /// Largest per-token KL, nats.
    pub kl_max: f64,
    /// Fraction of positions where both models rank the same token first.
    pub top1_agreement: f64,
}
