//! Logits of the bundled fixtures against golden values from an independent implementation:
//! `scripts/golden/sala_reference.py`, pure Python + numpy in float64 with the plain GLA
//! recurrence and naive attention, reading the safetensors itself. Its output is committed in
//! `fixtures/golden/`.
//!
//! Tolerance: the Rust graph runs in f32 (`Numerics::F32`) against a float64 reference, so the
//! logits differ by accumulated f32 rounding only: relative 1e-7 per operation, grown over
//! 8 layers of ~10 dependent operations with sums of up to 512 terms. Measured: at most
//! 1.2e-6 (SALA) and 1.5e-6 (Llama) of the largest reference logit. We allow 1e-4 of it
//! (about 70× the measured error, room for another CPU's summation order), while any modelling
//! mistake (a missed scale, a wrong gate input, RoPE order) moves logits by percents.

use crate::common;

use common::*;
use sala_model::{LayerRunner, RunOptions, SalaConfig, TensorStore};
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    sequences: Vec<Sequence>,
}

#[derive(Deserialize)]
struct Sequence {
    ids: Vec<u32>,
    positions: Vec<usize>,
    logits: Vec<Vec<f32>>,
    row_mean: Vec<f32>,
    row_rms: Vec<f32>,
}

fn check_model(name: &str) {
    let dir = fixtures().join(name);
    let golden: Golden = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden").join(format!("{name}.json"))).unwrap(),
    )
    .unwrap();
    let config = SalaConfig::from_file(&dir.join("config.json")).unwrap();
    let store = TensorStore::open(&dir).unwrap();
    let runner = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let vocab = config.vocab_size();
    for seq in &golden.sequences {
        let logits = to_vec(runner.forward_logits(&store, &seq.ids).unwrap());
        let scale = seq.logits.iter().map(|r| max_abs(r)).fold(0.0, f32::max);
        let tolerance = 1e-4 * scale;
        for (&pos, expected) in seq.positions.iter().zip(&seq.logits) {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let err = max_abs_diff(row, expected);
            assert!(
                err <= tolerance,
                "{name}, {} tokens, position {pos}: max error {err} > {tolerance}",
                seq.ids.len()
            );
        }
        for (pos, (&mean, &rms)) in seq.row_mean.iter().zip(&seq.row_rms).enumerate() {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let got_mean = row.iter().sum::<f32>() / vocab as f32;
            let got_rms = (row.iter().map(|x| x * x).sum::<f32>() / vocab as f32).sqrt();
            assert!(
                (got_mean - mean).abs() <= tolerance,
                "{name} position {pos}: mean {got_mean} vs {mean}"
            );
            assert!(
                (got_rms - rms).abs() <= tolerance,
                "{name} position {pos}: rms {got_rms} vs {rms}"
            );
        }
    }
}

#[test]
fn tiny_sala_matches_numpy_reference() {
    check_model("tiny-sala");
}

#[test]
fn tiny_llama_matches_numpy_reference() {
    check_model("tiny-llama");
}
