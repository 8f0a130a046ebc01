//! Who reads what inside a decoder layer: the facts about the architecture that smoothing and
//! calibration need (which linears share one input, and what produced that input).
//!
//! Linears that read the same tensor share one Hessian (`XᵀX` is computed once per input), and a
//! SmoothQuant group must fold its scales into **every** reader of its source: in a minicpm4
//! layer `o_gate` reads `input_layernorm`'s output just like q/k/v (the original `dense_all`
//! script forgot it).

use crate::config::{LayerKind, SalaConfig};

/// What produces a linear's input, as far as folding a channel scale is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InputSource {
    /// An RMSNorm output: a scale can be folded into the norm weight (`w /= s`).
    Norm {
        /// The norm's module name, e.g. `model.layers.3.input_layernorm` (weight: `<name>.weight`).
        norm: String,
    },
    /// `act(gate) · up`: a scale can be folded into `up_proj`'s output rows (`W[j, :] /= s_j`).
    UpProjection {
        /// `up_proj`'s module name.
        linear: String,
    },
    /// An input no weight can absorb a scale into exactly (attention output through a gate).
    Opaque {
        /// A descriptive name of the tensor, e.g. `model.layers.0.self_attn.gated_output`.
        tensor: String,
    },
}

impl InputSource {
    /// The producer's name (norm, linear or tensor).
    pub fn name(&self) -> &str {
        match self {
            InputSource::Norm { norm } => norm,
            InputSource::UpProjection { linear } => linear,
            InputSource::Opaque { tensor } => tensor,
        }
    }

    /// Whether a channel scale can be folded into the producer exactly.
    pub fn is_foldable(&self) -> bool {
        !matches!(self, InputSource::Opaque { .. })
    }
}

/// One input tensor of a layer and every linear that multiplies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputGroup {
    /// What produced the input.
    pub source: InputSource,
    /// Full module names of the linears reading it, in forward order.
    pub readers: Vec<String>,
}

/// The input groups of decoder layer `layer`, in forward order. Every linear of the layer
/// appears in exactly one group.
///
/// | kind | attention input (norm) | o_proj input | MLP input (norm) | down input |
/// |---|---|---|---|---|
/// | lightning | q, k, v, z_proj | `o_norm` (norm) | gate, up | `up_proj` rows |
/// | minicpm4 | q, k, v, o_gate | gated attention (opaque) | gate, up | `up_proj` rows |
/// | llama | q, k, v | attention (opaque) | gate, up | `up_proj` rows |
pub fn input_groups(config: &SalaConfig, layer: usize) -> Vec<InputGroup> {
    let p = format!("model.layers.{layer}");
    let names = |parts: &[&str]| parts.iter().map(|s| format!("{p}.{s}")).collect::<Vec<_>>();
    let norm = |n: &str| InputSource::Norm {
        norm: format!("{p}.{n}"),
    };
    let kind = config.layer_kind(layer);
    let (attention_readers, o_source) = match kind {
        LayerKind::Lightning => (
            names(&[
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.z_proj",
            ]),
            norm("self_attn.o_norm"),
        ),
        LayerKind::Minicpm4 => (
            names(&[
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_gate",
            ]),
            InputSource::Opaque {
                tensor: format!("{p}.self_attn.gated_output"),
            },
        ),
        LayerKind::Llama => (
            names(&["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            InputSource::Opaque {
                tensor: format!("{p}.self_attn.output"),
            },
        ),
    };
    vec![
        InputGroup {
            source: norm("input_layernorm"),
            readers: attention_readers,
        },
        InputGroup {
            source: o_source,
            readers: names(&["self_attn.o_proj"]),
        },
        InputGroup {
            source: norm("post_attention_layernorm"),
            readers: names(&["mlp.gate_proj", "mlp.up_proj"]),
        },
        InputGroup {
            source: InputSource::UpProjection {
                linear: format!("{p}.mlp.up_proj"),
            },
            readers: names(&["mlp.down_proj"]),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_linear_is_read_from_exactly_one_group() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/tiny-sala/config.json");
        let config = SalaConfig::from_file(&dir).expect("the committed tiny-sala fixture");
        for layer in 0..config.num_layers() {
            let mut readers: Vec<String> = input_groups(&config, layer)
                .into_iter()
                .flat_map(|g| g.readers)
                .collect();
            let mut linears: Vec<String> = config
                .linear_specs(layer)
                .into_iter()
                .map(|s| s.name)
                .collect();
            readers.sort();
            linears.sort();
            assert_eq!(readers, linears, "layer {layer}");
        }
    }
}
