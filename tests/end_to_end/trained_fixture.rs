//! The committed trained fixture (`fixtures/tiny-sala-trained`, written by
//! `cargo run --release --example train_fixture`): it has the random fixture's layout, and
//! it predicts held-out text far better than a uniform guess.

use sala_eval::model::{host_values, read_config, tokenize};
use sala_eval::{split_sequences, LoadedModel, MetricsAccumulator};
use sala_gptq::model::{AttentionMode, LayerRunner, Numerics, RunOptions, TensorStore};
use sala_gptq::CpuBackend;
use std::path::PathBuf;

fn trained() -> PathBuf {
    sala_quant::fixtures_dir().join("tiny-sala-trained")
}

#[test]
fn the_trained_fixture_has_the_random_fixtures_tensors() {
    let random_dir = sala_quant::fixtures_dir().join("tiny-sala");
    let random = TensorStore::open(&random_dir).unwrap();
    let learned = TensorStore::open(&trained()).unwrap();
    let mut names: Vec<&str> = random.names().collect();
    let mut learned_names: Vec<&str> = learned.names().collect();
    names.sort_unstable();
    learned_names.sort_unstable();
    assert_eq!(names, learned_names);
    for name in names {
        let (a, b) = (random.info(name).unwrap(), learned.info(name).unwrap());
        assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{name}");
    }
    let config = |dir: PathBuf| std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert_eq!(config(random_dir), config(trained()));
}

/// Perplexity on the first two 128-token windows of the held-out text, through the
/// inference path of `eval_quant` (f32 numerics, dense minicpm4 attention).
#[test]
fn the_trained_fixture_predicts_heldout_text_far_better_than_uniform() {
    let dir = trained();
    let config = read_config(&dir).unwrap();
    let text =
        std::fs::read_to_string(sala_quant::fixtures_dir().join("text/heldout.txt")).unwrap();
    let tokens = tokenize(&dir, &text).unwrap();
    let sequences = split_sequences(&tokens, config.raw().bos_token_id, &[128], 2);
    assert_eq!(sequences.len(), 2);
    let model = LoadedModel::open(&dir, &config).unwrap();
    let vocab = config.vocab_size();
    let options = RunOptions {
        numerics: Numerics::F32,
        attention: AttentionMode::Dense,
        ..RunOptions::default()
    };
    let runner = LayerRunner::<CpuBackend>::new(config, Default::default(), options);
    let mut acc = MetricsAccumulator::default();
    for sequence in &sequences {
        let logits = host_values(model.logits(&runner, &sequence.ids).unwrap()).unwrap();
        acc.add_sequence(&logits, &logits, vocab, &sequence.ids)
            .unwrap();
    }
    let perplexity = acc.finish().perplexity_original;
    // Uniform is 2048, the random fixture ~17 000; the committed weights measure 88.0 here
    // (98.4 on eval_quant's windows, docs/quality.md).
    let bound = vocab as f64 / 8.0;
    assert!(
        perplexity < bound,
        "held-out perplexity {perplexity:.1} is not below {bound} (uniform {vocab})"
    );
}
