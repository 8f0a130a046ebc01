//! `gptq.rtn`: the solver is skipped and every linear is the round-to-nearest baseline.

use sala_gptq::calib::{CalibOptions, CalibSet, CalibTokenizer};
use sala_gptq::{CpuBackend, NoProgress, Pipeline, QuantizeOptions, Recipe, Sample};
use std::path::Path;

#[test]
fn rtn_switch_reproduces_the_baseline_error() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let model = fixtures.join("tiny-llama");
    let tokenizer = CalibTokenizer::from_model_dir(&model).unwrap();
    let calib = CalibOptions {
        max_len: 64,
        max_samples: Some(4),
        skip_malformed: false,
    };
    let set = CalibSet::load(&fixtures.join("calib/calib.jsonl"), &tokenizer, &calib).unwrap();
    let samples: Vec<Sample> = set.samples.iter().map(Sample::from).collect();
    let dir = tempfile::tempdir().unwrap();
    let mut options = QuantizeOptions::new(Recipe::Gptq);
    options.gptq.rtn = true;
    let pipeline = Pipeline::<CpuBackend>::new(Default::default(), options);
    let report = pipeline
        .run(&model, &dir.path().join("rtn"), &samples, &mut NoProgress)
        .unwrap();
    assert!(!report.linears.is_empty());
    for l in &report.linears {
        let (q, rtn) = (l.output_error.unwrap(), l.baseline_output_error.unwrap());
        assert!(
            (q - rtn).abs() <= 1e-9 * rtn.abs().max(1.0),
            "{}: {q} vs {rtn}",
            l.name
        );
    }
}
