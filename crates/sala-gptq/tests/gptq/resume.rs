//! Resumable runs ([`QuantizeOptions::resume`]) through the library: a run stopped right after
//! a layer's state is on disk (a progress callback that panics, the way a crash would stop it)
//! and resumed gives the same bytes as an uninterrupted run, for both recipes; a resume with
//! other options or other calibration samples is refused before any compute, naming what
//! differs, and leaves the staged run as it was.

use sala_gptq::calib::{CalibOptions, CalibSet, CalibTokenizer};
use sala_gptq::{CpuBackend, NoProgress, Pipeline, Progress, QuantizeOptions, Recipe, Sample};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn samples(model: &Path, n: usize) -> Vec<Sample> {
    let tokenizer = CalibTokenizer::from_model_dir(model).unwrap();
    let options = CalibOptions {
        max_len: 48,
        max_samples: Some(n),
        skip_malformed: false,
    };
    let set = CalibSet::load(&fixtures().join("calib/calib.jsonl"), &tokenizer, &options).unwrap();
    set.samples.iter().map(Sample::from).collect()
}

/// Stops the run (a panic) once layer `after`'s resume state is saved.
struct StopAfter(usize);

impl Progress for StopAfter {
    fn layer_saved(&mut self, layer: usize) {
        if layer == self.0 {
            panic!("stopped after layer {layer}");
        }
    }
}

/// Records the messages.
#[derive(Default)]
struct Messages(Vec<String>);

impl Progress for Messages {
    fn message(&mut self, text: &str) {
        self.0.push(text.to_owned());
    }
    fn layer(&mut self, layer: usize) {
        self.0.push(format!("start layer {layer}"));
    }
}

/// Every file under `dir` with its bytes.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            assert!(e.file_type().unwrap().is_file(), "{:?}", e.path());
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// The report without what differs from run to run (wall-clock seconds, memory peaks).
fn report_without_timings(bytes: &[u8]) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
    sala_gptq::report::strip_run_dependent(&mut v);
    v
}

fn staging_dirs(parent: &Path) -> Vec<PathBuf> {
    fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains(".partial-"))
        .collect()
}

fn stopped_and_resumed_is_byte_identical(recipe: Recipe) {
    let model = fixtures().join("tiny-sala");
    let samples = samples(&model, 6);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let mut options = QuantizeOptions::new(recipe);
    // Several shards, so that a layer's tensors straddle a shard boundary.
    options.max_shard_bytes = 600_000;
    // The uninterrupted reference, without --resume, moved aside so that the paths match.
    Pipeline::<CpuBackend>::new(Default::default(), options.clone())
        .run(&model, &out, &samples, &mut NoProgress)
        .unwrap();
    let reference = files(&out);
    assert!(
        reference
            .keys()
            .filter(|k| k.ends_with(".safetensors"))
            .count()
            > 2
    );
    fs::remove_dir_all(&out).unwrap();

    options.resume = true;
    let pipeline = Pipeline::<CpuBackend>::new(Default::default(), options.clone());
    let stopped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pipeline.run(&model, &out, &samples, &mut StopAfter(3))
    }));
    assert!(stopped.is_err(), "the run was not stopped");
    assert!(!out.exists());
    let staged = staging_dirs(dir.path());
    assert_eq!(staged.len(), 1, "{staged:?}");
    assert!(staged[0].join("resume/manifest.json").is_file());
    // It is named after this process, which is alive: as the process of a crashed run would
    // be gone, it gets the name of a pid that cannot exist (beyond pid_max).
    let dead = dir.path().join(".out.partial-999999999-stopped");
    fs::rename(&staged[0], &dead).unwrap();
    let staged = vec![dead];

    // Other options or samples: refused before anything changes, naming the difference.
    let mut other = options.clone();
    other.gptq.damping.percdamp = 0.02;
    other.nvfp4_search.iters = 7;
    let err = Pipeline::<CpuBackend>::new(Default::default(), other)
        .run(&model, &out, &samples, &mut NoProgress)
        .unwrap_err()
        .to_string();
    let named = match recipe {
        Recipe::Gptq => "options: GPTQ",
        Recipe::Nvfp4 => "options: NVFP4 search",
    };
    assert!(
        err.contains("cannot resume") && err.contains(named),
        "{err}"
    );
    let err = pipeline
        .run(&model, &out, &samples[..5], &mut NoProgress)
        .unwrap_err()
        .to_string();
    assert!(err.contains("calibration samples"), "{err}");
    assert_eq!(staging_dirs(dir.path()), staged, "the staged run changed");

    let mut messages = Messages::default();
    pipeline.run(&model, &out, &samples, &mut messages).unwrap();
    let said = messages.0.join("\n");
    assert!(said.contains("continuing the staged run"), "{said}");
    assert!(
        !said.contains("start layer 3") && said.contains("start layer 4"),
        "{said}"
    );
    let resumed = files(&out);
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        resumed.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &reference {
        if name == sala_gptq::export::REPORT_FILE {
            assert_eq!(
                report_without_timings(bytes),
                report_without_timings(&resumed[name])
            );
        } else {
            assert!(bytes == &resumed[name], "{name} differs after the resume");
        }
    }
    assert!(staging_dirs(dir.path()).is_empty());
}

#[test]
fn gptq_stopped_and_resumed_is_byte_identical() {
    stopped_and_resumed_is_byte_identical(Recipe::Gptq);
}

#[test]
fn nvfp4_stopped_and_resumed_is_byte_identical() {
    stopped_and_resumed_is_byte_identical(Recipe::Nvfp4);
}

#[test]
fn resume_with_nothing_staged_starts_fresh() {
    let model = fixtures().join("tiny-sala");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let mut options = QuantizeOptions::new(Recipe::Gptq);
    options.resume = true;
    let mut messages = Messages::default();
    Pipeline::<CpuBackend>::new(Default::default(), options)
        .run(&model, &out, &samples(&model, 2), &mut messages)
        .unwrap();
    assert!(
        messages
            .0
            .iter()
            .any(|m| m.contains("no staged run to resume")),
        "{:?}",
        messages.0
    );
    assert!(sala_gptq::export::verify(&out).unwrap().is_ok());
    assert!(!out.join("resume").exists());
    assert!(staging_dirs(dir.path()).is_empty());
}
