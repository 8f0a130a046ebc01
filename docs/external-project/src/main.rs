//! Quantizes a model with GPTQ W4A16 through the public API of `sala-gptq`.
//! Usage: sala-gptq-user <model_dir> <calib.jsonl> <output_dir>
use sala_gptq::calib::{CalibOptions, CalibSet, CalibTokenizer};
use sala_gptq::{CpuBackend, NoProgress, Pipeline, QuantizeOptions, Recipe, Sample};
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [model, calib, output] = args.as_slice() else {
        return Err("usage: sala-gptq-user <model_dir> <calib.jsonl> <output_dir>".into());
    };
    let tokenizer = CalibTokenizer::from_model_dir(model)?;
    let options = CalibOptions { max_len: 128, max_samples: Some(8), ..CalibOptions::default() };
    let samples: Vec<Sample> = CalibSet::load(calib, &tokenizer, &options)?.samples.iter().map(Sample::from).collect();
    let pipeline = Pipeline::<CpuBackend>::new(Default::default(), QuantizeOptions::new(Recipe::Gptq));
    let report = pipeline.run(model, output, &samples, &mut NoProgress)?;
    println!("{report}");
    Ok(())
}
