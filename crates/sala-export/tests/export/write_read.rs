//! Writer → reader round trips, the files around the weights, and the directory transaction.

use crate::common;

use std::fs;

use common::*;
use proptest::prelude::*;
use sala_export::{
    verify, Checkpoint, CheckpointFormat, CheckpointWriter, Dtype, ExportError, LinearFormat,
    WriterOptions, INDEX_FILE,
};
use sala_formats::gptq_pack::qweight_to_compressed_tensors;
use sala_formats::nvfp4::global_scale_from_amax;
use sala_formats::{BlockScales, Nvfp4Matrix};

/// The GPTQ linear as the reader must return it: scales rounded to fp16.
fn with_f16_scales(p: &sala_formats::GptqPacked) -> sala_formats::GptqPacked {
    let mut p = p.clone();
    for s in &mut p.scales {
        *s = half::f16::from_f32(*s).to_f32();
    }
    p
}

#[test]
fn gptq_round_trip_is_exact() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("gptq");
    let dense = ["model.layers.1.self_attn.o_proj"];
    let written = write_fixture(&target, Format::Gptq, &dense, |_, _| {});
    assert!(written.shards.len() > 1, "small shards give several files");
    assert_eq!(written.quantized_linears, 2 * LINEARS.len() - 1);

    let ck = Checkpoint::open(&target).unwrap();
    assert!(matches!(ck.format(), CheckpointFormat::Gptq(c) if c.bits == 4));
    for (module, linear) in build_linears(Format::Gptq, &dense, 7) {
        let read = ck.linear_weight(&module).unwrap();
        match linear {
            Linear::Gptq(p) => {
                let expected = with_f16_scales(&p);
                assert_eq!(ck.gptq_linear(&module).unwrap(), expected, "{module}");
                assert_eq!(read.values, expected.dequantize().unwrap(), "{module}");
                assert_eq!(read.shape, [p.out_features, p.in_features]);
            }
            Linear::Dense(w, o, i) => {
                let bf16: Vec<f32> = w
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_f32())
                    .collect();
                assert_eq!(read.values, bf16);
                assert_eq!(read.shape, [o, i]);
            }
            Linear::Nvfp4(..) => unreachable!(),
        }
    }
    for (name, shape, values) in passthrough(7) {
        let read = ck.tensor_f32(&name).unwrap();
        let bf16: Vec<f32> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        assert_eq!((read.shape, read.values), (shape, bf16), "{name}");
    }
    let report = verify(&target).unwrap();
    assert!(report.is_ok(), "{:#?}", report.violations);
}

#[test]
fn nvfp4_round_trip_is_exact() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("nvfp4");
    write_fixture(&target, Format::Nvfp4, &[], |_, _| {});
    let ck = Checkpoint::open(&target).unwrap();
    assert!(matches!(ck.format(), CheckpointFormat::Nvfp4(_)));
    let linears = build_linears(Format::Nvfp4, &[], 7);
    assert_eq!(ck.quantized_linears().len(), linears.len());
    for (module, linear) in linears {
        let Linear::Nvfp4(m, input_scale) = linear else {
            unreachable!()
        };
        let (read, read_input) = ck.nvfp4_linear(&module).unwrap();
        assert_eq!(read, m, "{module}");
        assert_eq!(read_input, Some(input_scale));
        assert_eq!(ck.linear_weight(&module).unwrap().values, m.dequantize());
    }
    let report = verify(&target).unwrap();
    assert!(report.is_ok(), "{:#?}", report.violations);
    assert_eq!(report.format, "nvfp4");
    // E2M1 codes plus one E4M3 per 16 plus two fp32 scalars per linear.
    let bits = report.summary.bits_per_quantized_weight();
    assert!(bits > 4.5 && bits < 4.6, "{bits}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    /// Random shapes and values, both formats, one linear per checkpoint.
    #[test]
    fn random_single_linears_round_trip(
        seed in any::<u64>(),
        out_blocks in 1usize..4,
        in_blocks in 1usize..4,
    ) {
        let (out, inp) = (8 * out_blocks, 128 * in_blocks);
        let w = random(&mut rng(seed), out * inp);
        let gptq = gptq_linear(&w, out, inp);
        let global = global_scale_from_amax(0.5).unwrap();
        let fp4 = Nvfp4Matrix::quantize(&w, out, inp, global, BlockScales::Max).unwrap();

        let root = tempfile::tempdir().unwrap();
        let mut writer = CheckpointWriter::create(root.path().join("g"), WriterOptions::default()).unwrap();
        writer.add_gptq_linear("m", &gptq).unwrap();
        writer.finish(model_config(), &quant_config(Format::Gptq, &[])).unwrap();
        let ck = Checkpoint::open(root.path().join("g")).unwrap();
        prop_assert_eq!(ck.gptq_linear("m").unwrap(), with_f16_scales(&gptq));

        let mut writer = CheckpointWriter::create(root.path().join("n"), WriterOptions::default()).unwrap();
        writer.add_nvfp4_linear("m", &fp4, 0.25).unwrap();
        writer.finish(model_config(), &quant_config(Format::Nvfp4, &[])).unwrap();
        let ck = Checkpoint::open(root.path().join("n")).unwrap();
        prop_assert_eq!(ck.nvfp4_linear("m").unwrap(), (fp4, Some(0.25)));
    }
}

/// compressed-tensors reads `weight_packed = qweightᵀ` and `weight_scale = scalesᵀ`, unpacks
/// element k of a row from bits `4·(k % 8)` of word `k / 8` as `u − 8`, and multiplies by the
/// scale of group `k / group_size`. Decoding the stored tensors that way must give our reader's
/// weights.
#[test]
fn gptq_packing_agrees_with_the_compressed_tensors_view() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("gptq");
    write_fixture(&target, Format::Gptq, &[], |_, _| {});
    let ck = Checkpoint::open(&target).unwrap();
    for (module, format) in ck.quantized_linears() {
        assert_eq!(format, LinearFormat::Gptq);
        let p = ck.gptq_linear(&module).unwrap();
        let (out, inp) = (p.out_features, p.in_features);
        let words = inp / 8;
        let packed = qweight_to_compressed_tensors(&p.qweight, out, words).unwrap();
        let scales = ck.tensor_f32(&format!("{module}.scales")).unwrap();
        let groups = scales.shape[0];
        let mut ct = vec![0.0f32; out * inp];
        for o in 0..out {
            for k in 0..inp {
                let word = packed[o * words + k / 8] as u32;
                let u = ((word >> (4 * (k % 8))) & 0xF) as i32 - 8;
                // weight_scale = scalesᵀ: [out, groups]
                let scale_t = scales.values[(k / GROUP) * out + o];
                assert!(k / GROUP < groups);
                ct[o * inp + k] = u as f32 * scale_t;
            }
        }
        assert_eq!(ct, ck.linear_weight(&module).unwrap().values, "{module}");
    }
}

#[test]
fn config_and_side_files() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("gptq");
    let written = write_fixture(&target, Format::Gptq, &[], |_, _| {});
    assert_eq!(
        written.copied_files,
        [
            "chat_template.jinja",
            "generation_config.json",
            "modeling_minicpm.py",
            "tokenizer.json",
            "tokenizer.model",
            "tokenizer_config.json"
        ]
    );
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_str(&fs::read_to_string(target.join(name)).unwrap()).unwrap()
    };
    let config = read("config.json");
    assert_eq!(config["quantization_config"], read("quantize_config.json"));
    assert_eq!(config["quantization_config"]["checkpoint_format"], "gptq");
    assert_eq!(config["quantization_config"]["quant_method"], "gptq");
    assert_eq!(config["hidden_size"], HIDDEN);
    let names = entries(&target);
    assert!(names.contains(&INDEX_FILE.to_string()));
    assert!(!names.contains(&"notes.txt".to_string()));
    // Symmetric v1 zeros: every word 0x77777777.
    let ck = Checkpoint::open(&target).unwrap();
    let zeros = ck.tensor_f32("model.layers.0.mlp.up_proj.qzeros").unwrap();
    assert!(zeros.values.iter().all(|&z| z == 2004318071.0));
    let (dtype, _) = ck.tensor_info("model.layers.0.mlp.up_proj.scales").unwrap();
    assert_eq!(dtype, Dtype::F16);

    let target = root.path().join("nvfp4");
    write_fixture(&target, Format::Nvfp4, &[], |_, _| {});
    let config = serde_json::from_str::<serde_json::Value>(
        &fs::read_to_string(target.join("config.json")).unwrap(),
    )
    .unwrap();
    let q = &config["quantization_config"];
    assert_eq!(q["quant_method"], "modelopt");
    assert_eq!(q["ignore"], serde_json::json!(["lm_head"]));
    assert_eq!(q["exclude_modules"], q["ignore"]);
    let hf: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(target.join("hf_quant_config.json")).unwrap())
            .unwrap();
    assert_eq!(hf["quantization"]["quant_algo"], "NVFP4");
    assert_eq!(hf["quantization"]["group_size"], 16);
    let ck = Checkpoint::open(&target).unwrap();
    let (dtype, shape) = ck
        .tensor_info("model.layers.0.self_attn.q_proj.weight_scale_2")
        .unwrap();
    assert_eq!((dtype, shape.len()), (Dtype::F32, 0));
    let (dtype, shape) = ck
        .tensor_info("model.layers.0.self_attn.k_proj.weight_scale")
        .unwrap();
    assert_eq!((dtype, shape), (Dtype::F8_E4M3, &[KV, HIDDEN / 16][..]));
}

#[test]
fn a_single_shard_has_no_index() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("one");
    let mut writer = CheckpointWriter::create(&target, WriterOptions::default()).unwrap();
    writer
        .add_f32("model.norm.weight", Dtype::BF16, &[4], &[1.0; 4])
        .unwrap();
    let written = writer
        .finish(model_config(), &quant_config(Format::Gptq, &[]))
        .unwrap();
    assert_eq!(written.shards, ["model.safetensors"]);
    assert_eq!(
        entries(&target),
        ["config.json", "model.safetensors", "quantize_config.json"]
    );
    assert_eq!(
        Checkpoint::open(&target)
            .unwrap()
            .tensor_f32("model.norm.weight")
            .unwrap()
            .values,
        [1.0; 4]
    );
}

/// An error half-way (after shards were flushed) leaves neither the target nor the staging
/// directory; with `overwrite`, the previous checkpoint survives a failed write intact.
#[test]
fn an_error_half_way_leaves_no_target() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("out");
    let options = WriterOptions {
        max_shard_bytes: SMALL_SHARDS,
        ..WriterOptions::default()
    };
    let mut writer = CheckpointWriter::create(&target, options.clone()).unwrap();
    for (module, linear) in build_linears(Format::Gptq, &[], 7).iter().take(6) {
        write_linear(&mut writer, module, linear);
    }
    assert!(
        entries(writer.staging_dir()).len() > 1,
        "shards were flushed"
    );
    let err = writer
        .add_tensor("model.norm.weight", Dtype::BF16, &[HIDDEN], &[0u8; 3])
        .unwrap_err();
    assert!(
        matches!(err, ExportError::TensorSize { ref tensor, .. } if tensor == "model.norm.weight")
    );
    drop(writer);
    assert!(
        entries(root.path()).is_empty(),
        "{:?}",
        entries(root.path())
    );

    // A failure inside finish (the model config is not an object).
    let mut writer = CheckpointWriter::create(&target, options.clone()).unwrap();
    let (module, linear) = &build_linears(Format::Gptq, &[], 7)[0];
    write_linear(&mut writer, module, linear);
    let err = writer
        .finish(serde_json::json!([1]), &quant_config(Format::Gptq, &[]))
        .unwrap_err();
    assert!(matches!(err, ExportError::Json { .. }), "{err}");
    assert!(entries(root.path()).is_empty());

    // With overwrite, the old checkpoint is untouched by a failed write.
    write_fixture(&target, Format::Gptq, &[], |_, _| {});
    let before = entries(&target);
    let mut writer = CheckpointWriter::create(
        &target,
        WriterOptions {
            overwrite: true,
            ..options
        },
    )
    .unwrap();
    let (module, linear) = &build_linears(Format::Nvfp4, &[], 7)[0];
    write_linear(&mut writer, module, linear);
    let err = writer
        .finish(model_config(), &quant_config(Format::Gptq, &[]))
        .unwrap_err();
    assert!(matches!(err, ExportError::Layout { .. }), "{err}");
    assert_eq!(entries(&target), before);
    assert_eq!(entries(root.path()), ["out", "source-model"]);
    assert!(verify(&target).unwrap().is_ok());
}

#[test]
fn refuses_existing_output_the_source_and_bad_linears() {
    let root = tempfile::tempdir().unwrap();
    let source = source_model(root.path());
    let with_source = WriterOptions {
        source_model: Some(source.clone()),
        overwrite: true,
        ..WriterOptions::default()
    };
    assert!(matches!(
        CheckpointWriter::create(&source, with_source),
        Err(ExportError::TargetIsSource { .. })
    ));
    assert!(matches!(
        CheckpointWriter::create(&source, WriterOptions::default()),
        Err(ExportError::TargetExists { .. })
    ));

    let mut writer =
        CheckpointWriter::create(root.path().join("x"), WriterOptions::default()).unwrap();
    let linears = build_linears(Format::Gptq, &[], 7);
    let (module, Linear::Gptq(p)) = &linears[0] else {
        unreachable!()
    };
    let mut nan = p.clone();
    nan.scales[3] = f32::NAN;
    let err = writer.add_gptq_linear(module, &nan).unwrap_err();
    assert!(
        matches!(err, ExportError::InvalidScale { ref tensor, .. } if tensor.ends_with("q_proj.scales"))
    );
    writer.add_gptq_linear(module, p).unwrap();
    assert!(matches!(
        writer.add_gptq_linear(module, p),
        Err(ExportError::DuplicateTensor { .. })
    ));
    let fp4 = build_linears(Format::Nvfp4, &[], 7);
    let (m, Linear::Nvfp4(matrix, s)) = &fp4[1] else {
        unreachable!()
    };
    assert!(matches!(
        writer.add_nvfp4_linear(m, matrix, *s),
        Err(ExportError::Layout { .. })
    ));
}

#[cfg(unix)]
#[test]
fn side_files_that_link_out_of_the_model_directory_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let source = source_model(root.path());
    let elsewhere = root.path().join("elsewhere.json");
    fs::write(&elsewhere, "{\"secret\": 1}").unwrap();
    fs::remove_file(source.join("generation_config.json")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, source.join("generation_config.json")).unwrap();
    let options = WriterOptions {
        source_model: Some(source.clone()),
        ..WriterOptions::default()
    };
    let target = root.path().join("out");
    let err = CheckpointWriter::create(&target, options.clone())
        .err()
        .expect("refused");
    assert!(matches!(err, ExportError::OutsideSource { .. }), "{err}");
    assert!(err.to_string().contains("generation_config.json"), "{err}");
    assert!(!target.exists());
    assert_eq!(entries(root.path()), ["elsewhere.json", "source-model"]);

    // A link that stays inside the model directory is followed.
    fs::copy(&elsewhere, source.join("real_generation_config.json")).unwrap();
    fs::remove_file(source.join("generation_config.json")).unwrap();
    std::os::unix::fs::symlink(
        "real_generation_config.json",
        source.join("generation_config.json"),
    )
    .unwrap();
    let writer = CheckpointWriter::create(&target, options).unwrap();
    drop(writer);
}
