//! The coverage report of a calibration set (after the original `analyze_data_96.py`).

use std::collections::HashSet;
use std::fmt;

use serde::Serialize;

use crate::tokenize::{CalibSet, DenseLenExceedance};

/// Token-length bucket edges: `[0,1k) [1k,5k) [5k,10k) [10k,20k) [20k,50k) [50k,100k)
/// [100k,131k]` and `>131k`, where 131k is 131072, the default `max_len`, so a sample truncated
/// to it lands in the last regular bucket.
const BUCKETS: [(&str, usize, Option<usize>); 8] = [
    ("[0,1k)", 0, Some(1_000)),
    ("[1k,5k)", 1_000, Some(5_000)),
    ("[5k,10k)", 5_000, Some(10_000)),
    ("[10k,20k)", 10_000, Some(20_000)),
    ("[20k,50k)", 20_000, Some(50_000)),
    ("[50k,100k)", 50_000, Some(100_000)),
    ("[100k,131k]", 100_000, Some(131_073)),
    (">131k", 131_073, None),
];

/// Samples whose length falls in `[min_tokens, end_tokens)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LengthBucket {
    /// Human label, e.g. `[1k,5k)`.
    pub label: &'static str,
    /// Smallest length in the bucket (tokens).
    pub min_tokens: usize,
    /// First length past the bucket (tokens); `None` for the open last bucket.
    pub end_tokens: Option<usize>,
    /// Samples in the bucket.
    pub samples: usize,
}

/// Per-sample uniqueness `unique tokens / tokens` over the set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Uniqueness {
    /// Lowest ratio.
    pub min: f64,
    /// 1-based JSONL line of the sample with the lowest ratio.
    pub min_line: usize,
    /// Mean ratio over samples.
    pub mean: f64,
}

/// Samples at or above the minicpm4 dense limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DenseLenReport {
    /// The limit checked (tokens).
    pub dense_len: usize,
    /// Every sample at or above it.
    pub samples: Vec<DenseLenExceedance>,
}

/// The coverage report of a calibration set; [`fmt::Display`] prints it as a table and it
/// serializes to JSON with serde.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CalibStats {
    /// The JSONL file.
    pub path: String,
    /// Samples in the set (records plus cyclic repeats).
    pub samples: usize,
    /// Distinct records used.
    pub distinct_records: usize,
    /// Malformed lines skipped.
    pub skipped_lines: usize,
    /// Samples cut to `max_len`.
    pub truncated: usize,
    /// `messages` samples joined as plain text because the model has no chat template.
    pub untemplated_chats: usize,
    /// The `max_len` samples were cut to (tokens).
    pub max_len: usize,
    /// Sum of sample lengths (tokens).
    pub total_tokens: u64,
    /// Shortest sample (tokens).
    pub min_tokens: usize,
    /// Mean sample length (tokens).
    pub mean_tokens: f64,
    /// Longest sample (tokens).
    pub max_tokens: usize,
    /// Length distribution.
    pub buckets: Vec<LengthBucket>,
    /// Token uniqueness per sample.
    pub uniqueness: Uniqueness,
    /// The dense-limit check, when a limit was given.
    pub dense_len: Option<DenseLenReport>,
}

/// `unique ids / ids` of one sample (0 for an empty one).
pub fn uniqueness_ratio(ids: &[u32]) -> f64 {
    if ids.is_empty() {
        return 0.0;
    }
    let unique: HashSet<u32> = ids.iter().copied().collect();
    unique.len() as f64 / ids.len() as f64
}

impl CalibStats {
    /// The report of `set`, with the dense-limit check when `dense_len` is given.
    ///
    /// A [`CalibSet`] always holds at least one sample, so every field is defined.
    pub fn of(set: &CalibSet, dense_len: Option<usize>) -> Self {
        let lengths: Vec<usize> = set.samples.iter().map(|s| s.ids.len()).collect();
        let total_tokens: u64 = lengths.iter().map(|&n| n as u64).sum();
        let samples = lengths.len();
        Self {
            path: set.path.display().to_string(),
            samples,
            distinct_records: set.distinct(),
            skipped_lines: set.skipped.len(),
            truncated: set.samples.iter().filter(|s| s.truncated).count(),
            untemplated_chats: set.samples.iter().filter(|s| s.untemplated_chat).count(),
            max_len: set.max_len,
            total_tokens,
            min_tokens: lengths.iter().copied().min().unwrap_or(0),
            mean_tokens: total_tokens as f64 / samples.max(1) as f64,
            max_tokens: lengths.iter().copied().max().unwrap_or(0),
            buckets: bucket_lengths(&lengths),
            uniqueness: uniqueness(set),
            dense_len: dense_len.map(|dense_len| DenseLenReport {
                dense_len,
                samples: set.at_or_above(dense_len),
            }),
        }
    }
}

fn bucket_lengths(lengths: &[usize]) -> Vec<LengthBucket> {
    BUCKETS
        .iter()
        .map(|&(label, min_tokens, end_tokens)| LengthBucket {
            label,
            min_tokens,
            end_tokens,
            samples: lengths
                .iter()
                .filter(|&&n| n >= min_tokens && end_tokens.is_none_or(|end| n < end))
                .count(),
        })
        .collect()
}

fn uniqueness(set: &CalibSet) -> Uniqueness {
    let ratios: Vec<(f64, usize)> = set
        .samples
        .iter()
        .map(|s| (uniqueness_ratio(&s.ids), s.line))
        .collect();
    let (min, min_line) =
        ratios.iter().copied().fold(
            (f64::INFINITY, 0),
            |best, r| if r.0 < best.0 { r } else { best },
        );
    let mean = ratios.iter().map(|r| r.0).sum::<f64>() / ratios.len().max(1) as f64;
    Uniqueness {
        min: if ratios.is_empty() { 0.0 } else { min },
        min_line,
        mean,
    }
}

impl fmt::Display for CalibStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "calibration set  {}", self.path)?;
        writeln!(
            f,
            "samples          {} ({} distinct records, {} repeats, {} malformed lines skipped)",
            self.samples,
            self.distinct_records,
            self.samples - self.distinct_records,
            self.skipped_lines
        )?;
        writeln!(
            f,
            "tokens           {} total; per sample min {}, mean {:.0}, max {}",
            self.total_tokens, self.min_tokens, self.mean_tokens, self.max_tokens
        )?;
        writeln!(
            f,
            "truncated        {} samples to max_len {}",
            self.truncated, self.max_len
        )?;
        if self.untemplated_chats > 0 {
            writeln!(
                f,
                "chat records     {} joined as plain text: the model has no chat template",
                self.untemplated_chats
            )?;
        }
        writeln!(
            f,
            "uniqueness       min {:.4} (line {}), mean {:.4}",
            self.uniqueness.min, self.uniqueness.min_line, self.uniqueness.mean
        )?;
        writeln!(f)?;
        writeln!(f, "  {:<12} {:>8} {:>7}", "tokens", "samples", "share")?;
        for bucket in &self.buckets {
            let share = 100.0 * bucket.samples as f64 / self.samples.max(1) as f64;
            writeln!(
                f,
                "  {:<12} {:>8} {:>6.1}%",
                bucket.label, bucket.samples, share
            )?;
        }
        if let Some(report) = &self.dense_len {
            writeln!(f)?;
            write_dense_len(f, report)?;
        }
        Ok(())
    }
}

fn write_dense_len(f: &mut fmt::Formatter<'_>, report: &DenseLenReport) -> fmt::Result {
    if report.samples.is_empty() {
        return writeln!(f, "dense_len {}: every sample is shorter", report.dense_len);
    }
    let lines: Vec<String> = report.samples.iter().map(|s| s.line.to_string()).collect();
    writeln!(
        f,
        "dense_len {}: {} samples have as many tokens or more and take the sparse path unless \
         calibration overrides dense_len (lines {})",
        report.dense_len,
        report.samples.len(),
        lines.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenize::CalibSample;

    fn sample(line: usize, ids: Vec<u32>, repeat: usize) -> CalibSample {
        CalibSample {
            line,
            ids,
            truncated: false,
            untemplated_chat: false,
            repeat,
        }
    }

    #[test]
    fn buckets_cover_every_length_once() {
        let lengths = [0, 999, 1_000, 4_999, 131_072, 131_073, 200_000];
        let buckets = bucket_lengths(&lengths);
        let counts: Vec<usize> = buckets.iter().map(|b| b.samples).collect();
        assert_eq!(counts, vec![2, 2, 0, 0, 0, 0, 1, 2]);
        assert_eq!(counts.iter().sum::<usize>(), lengths.len());
    }

    #[test]
    fn uniqueness_and_totals() {
        assert_eq!(uniqueness_ratio(&[1, 1, 1, 1]), 0.25);
        assert_eq!(uniqueness_ratio(&[1, 2, 3, 4]), 1.0);
        let set = CalibSet {
            path: "c.jsonl".into(),
            samples: vec![
                sample(1, vec![1, 2, 3, 4], 0),
                sample(2, vec![7; 8], 0),
                sample(1, vec![1, 2, 3, 4], 1),
            ],
            skipped: Vec::new(),
            max_len: 16,
        };
        let stats = CalibStats::of(&set, Some(8));
        assert_eq!(stats.samples, 3);
        assert_eq!(stats.distinct_records, 2);
        assert_eq!(stats.total_tokens, 16);
        assert_eq!((stats.min_tokens, stats.max_tokens), (4, 8));
        assert_eq!(stats.uniqueness.min, 0.125);
        assert_eq!(stats.uniqueness.min_line, 2);
        assert!((stats.uniqueness.mean - (1.0 + 0.125 + 1.0) / 3.0).abs() < 1e-12);
        let dense = stats.dense_len.as_ref().unwrap();
        assert_eq!(dense.samples.len(), 1);
        assert_eq!(dense.samples[0].line, 2);

        let table = stats.to_string();
        assert!(
            table.contains("samples          3 (2 distinct records, 1 repeats"),
            "{table}"
        );
        assert!(table.contains("[0,1k)"), "{table}");
        assert!(table.contains("lines 2"), "{table}");
        let json = serde_json::to_value(&stats).unwrap();
        assert_eq!(json["buckets"][0]["samples"], 3);
        assert_eq!(json["dense_len"]["samples"][0]["tokens"], 8);
    }
}
