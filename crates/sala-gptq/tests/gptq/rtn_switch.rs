//! `gptq.rtn`: the solver is skipped and every linear is the round-to-nearest baseline (the
//! baseline has no clipping search; with one, `--rtn` searches and does better).

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
    let run = |clip, name: &str| {
        let mut options = QuantizeOptions::new(Recipe::Gptq);
        options.gptq.rtn = true;
        options.gptq.clip = clip;
        let pipeline = Pipeline::<CpuBackend>::new(Default::default(), options);
        pipeline
            .run(&model, &dir.path().join(name), &samples, &mut NoProgress)
            .unwrap()
    };
    let plain = run(None, "rtn");
    assert!(!plain.linears.is_empty());
    for l in &plain.linears {
        let (q, rtn) = (l.output_error.unwrap(), l.baseline_output_error.unwrap());
        assert!(
            (q - rtn).abs() <= 1e-9 * rtn.abs().max(1.0),
            "{}: {q} vs {rtn}",
            l.name
        );
    }
    // The default clipping search under --rtn: the same baseline where the inputs are the
    // same (layer 0; later layers see the other run's quantized outputs), and a lower total
    // (each group's range is searched on diag(H), the proxy error's diagonal).
    let searched = run(QuantizeOptions::new(Recipe::Gptq).gptq.clip, "rtn-clip");
    let first_layer = |l: &&sala_gptq::LinearReport| l.name.starts_with("model.layers.0.");
    let pairs: Vec<_> = searched
        .linears
        .iter()
        .filter(first_layer)
        .zip(plain.linears.iter().filter(first_layer))
        .collect();
    assert!(!pairs.is_empty());
    for (a, b) in pairs {
        assert_eq!(a.name, b.name);
        assert_eq!(
            a.baseline_output_error, b.baseline_output_error,
            "{}",
            a.name
        );
    }
    let total =
        |r: &sala_gptq::Report| -> f64 { r.linears.iter().map(|l| l.output_error.unwrap()).sum() };
    assert!(
        total(&searched) < total(&plain),
        "{} vs {}",
        total(&searched),
        total(&plain)
    );
}
