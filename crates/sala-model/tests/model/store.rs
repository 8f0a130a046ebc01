//! Loading: single and sharded checkpoints, and the errors for bad files.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use sala_model::{LayerWeights, ModelError, SalaConfig, TensorStore};

fn tiny_sala() -> std::path::PathBuf {
    common::fixtures().join("tiny-sala")
}

/// Copies the fixture's config into `dir` and writes the fixture's tensors as shards,
/// `split` tensors in the first, applying `edit` to the (name, dtype, shape, bytes) list.
fn write_sharded(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
    let source = TensorStore::open(&tiny_sala()).unwrap();
    let mut tensors: Vec<_> = source
        .names()
        .map(|n| {
            let info = source.info(n).unwrap();
            (
                n.to_owned(),
                info.dtype,
                info.shape,
                source.raw_bytes(n).unwrap().to_vec(),
            )
        })
        .collect();
    edit(&mut tensors);
    std::fs::copy(tiny_sala().join("config.json"), dir.join("config.json")).unwrap();
    let half = tensors.len() / 2;
    let mut weight_map = BTreeMap::new();
    for (i, part) in [&tensors[..half], &tensors[half..]].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: BTreeMap<_, _> = part
            .iter()
            .map(|(n, dt, shape, bytes)| {
                (
                    n.clone(),
                    TensorView::new(*dt, shape.clone(), bytes).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        for (n, ..) in part.iter() {
            weight_map.insert(n.clone(), file.clone());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join(sala_model::INDEX_FILE), index.to_string()).unwrap();
}

fn load_layer0(dir: &Path) -> Result<LayerWeights, ModelError> {
    let config = SalaConfig::from_file(&dir.join("config.json"))?;
    let store = TensorStore::open(dir)?;
    store.check_config(&config)?;
    LayerWeights::load(&store, &config, 0)
}

#[test]
fn single_file_and_sharded_load_the_same_values() {
    let single = load_layer0(&tiny_sala()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_sharded(dir.path(), |_| {});
    let sharded = load_layer0(dir.path()).unwrap();
    assert_eq!(single.tensors, sharded.tensors);
    let store = TensorStore::open(dir.path()).unwrap();
    let info = store.info("model.layers.0.mlp.up_proj.weight").unwrap();
    assert_eq!(info.dtype, Dtype::BF16);
    assert_eq!(info.shape, vec![512, 256]);
    assert!(
        info.file.ends_with("model-00001-of-00002.safetensors")
            || info.file.ends_with("model-00002-of-00002.safetensors")
    );
}

#[test]
fn raw_bytes_are_the_stored_bf16() {
    let store = TensorStore::open(&tiny_sala()).unwrap();
    let name = "model.norm.weight";
    let raw = store.raw_bytes(name).unwrap();
    let values = store.to_f32(name).unwrap();
    assert_eq!(raw.len(), 2 * values.data.len());
    let first = half::bf16::from_le_bytes([raw[0], raw[1]]).to_f32();
    assert_eq!(first, values.data[0]);
}

fn sharded_error(edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) -> String {
    let dir = tempfile::tempdir().unwrap();
    write_sharded(dir.path(), edit);
    load_layer0(dir.path()).unwrap_err().to_string()
}

#[test]
fn rejects_wrong_shape_naming_tensor_and_file() {
    let msg = sharded_error(|t| {
        let entry = t
            .iter_mut()
            .find(|e| e.0 == "model.layers.0.self_attn.k_proj.weight")
            .unwrap();
        entry.2 = vec![256, 128];
    });
    assert!(
        msg.contains("model.layers.0.self_attn.k_proj.weight"),
        "{msg}"
    );
    assert!(
        msg.contains("[256, 128]") && msg.contains(".safetensors"),
        "{msg}"
    );
}

#[test]
fn rejects_wrong_dtype() {
    let msg = sharded_error(|t| {
        let entry = t
            .iter_mut()
            .find(|e| e.0 == "model.layers.0.mlp.down_proj.weight")
            .unwrap();
        entry.1 = Dtype::I16;
    });
    assert!(msg.contains("down_proj") && msg.contains("I16"), "{msg}");
}

#[test]
fn rejects_missing_tensor() {
    let msg = sharded_error(|t| t.retain(|e| e.0 != "model.layers.5.self_attn.o_gate.weight"));
    assert!(
        msg.contains("model.layers.5.self_attn.o_gate.weight") && msg.contains("missing"),
        "{msg}"
    );
}

#[test]
fn rejects_non_finite_weights() {
    let dir = tempfile::tempdir().unwrap();
    write_sharded(dir.path(), |t| {
        let entry = t
            .iter_mut()
            .find(|e| e.0 == "model.layers.0.mlp.up_proj.weight")
            .unwrap();
        entry.3[6..8].copy_from_slice(&half::bf16::NAN.to_le_bytes());
    });
    let msg = load_layer0(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("up_proj") && msg.contains("non-finite") && msg.contains("index 3"),
        "{msg}"
    );
}

#[test]
fn rejects_shard_outside_directory() {
    for bad in [
        "../model.safetensors",
        "/etc/passwd",
        "sub/../../x.safetensors",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let index = serde_json::json!({"weight_map": {"model.norm.weight": bad}});
        std::fs::write(dir.path().join(sala_model::INDEX_FILE), index.to_string()).unwrap();
        let err = TensorStore::open(dir.path()).err().expect("index accepted");
        assert!(
            matches!(err, ModelError::ShardOutsideDirectory { .. }),
            "{bad}: {err}"
        );
        assert!(err.to_string().contains(bad));
    }
}

#[test]
fn missing_directory_and_bad_token_ids_are_errors() {
    let err = TensorStore::open(Path::new("no/such/model")).err().unwrap();
    assert!(err.to_string().contains("model.safetensors"), "{err}");
    let store = TensorStore::open(&tiny_sala()).unwrap();
    let err = store
        .rows_f32(sala_model::EMBED_TOKENS, &[1, 5000])
        .unwrap_err();
    assert!(err.to_string().contains("token id 5000"), "{err}");
}

/// Releasing a tensor's pages (done after every `to_f32`) changes nothing that is read later.
#[test]
fn released_tensors_read_the_same() {
    let store = TensorStore::open(&tiny_sala()).unwrap();
    let names: Vec<String> = store.names().map(str::to_owned).collect();
    let before: Vec<Vec<u8>> = names
        .iter()
        .map(|n| store.raw_bytes(n).unwrap().to_vec())
        .collect();
    for n in &names {
        let first = store.to_f32(n).unwrap();
        store.release(n);
        assert_eq!(store.to_f32(n).unwrap().data, first.data, "{n}");
    }
    store.release("no.such.tensor");
    for (n, bytes) in names.iter().zip(&before) {
        assert_eq!(store.raw_bytes(n).unwrap(), &bytes[..], "{n}");
    }
}
