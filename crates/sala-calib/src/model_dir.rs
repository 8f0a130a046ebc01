//! Small readers for files of a Hugging Face model directory.

use std::path::Path;

use serde_json::Value;

use crate::error::{CalibError, Result};

/// Reads and parses a JSON file, naming it in errors.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| CalibError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|err| CalibError::Config {
        path: path.to_owned(),
        message: format!("not valid JSON: {err}"),
    })
}

/// The model's `sparse_config.dense_len` from `config.json` (MiniCPM-SALA: sequences shorter than
/// this take dense attention in the minicpm4 layers), or `None` when the model has none.
pub fn model_dense_len(model_dir: &Path) -> Result<Option<usize>> {
    let path = model_dir.join("config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let config = read_json(&path)?;
    match config.get("sparse_config").and_then(|s| s.get("dense_len")) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| CalibError::Config {
                path,
                message: format!("sparse_config.dense_len is not a token count: {value}"),
            }),
    }
}
