//! Module names: the fused shard groups the serving stacks build (q/k/v → `qkv_proj`,
//! gate/up → `gate_up_proj`) and which tensors are decoder-layer linears.
//!
//! SGLang and vLLM load `self_attn.{q,k,v}_proj` into one `qkv_proj` and `mlp.{gate,up}_proj`
//! into one `gate_up_proj` (for SALA and Llama alike). The members of such a group must be all
//! quantized or all not, with one precision and one global scale.

/// A fused group of linears that the serving stacks load as one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FusedKind {
    /// `self_attn.{q,k,v}_proj` → `self_attn.qkv_proj`.
    Qkv,
    /// `mlp.{gate,up}_proj` → `mlp.gate_up_proj`.
    GateUp,
}

impl FusedKind {
    /// Member names, in the order the loaders concatenate them.
    pub fn members(self) -> &'static [&'static str] {
        match self {
            FusedKind::Qkv => &["q_proj", "k_proj", "v_proj"],
            FusedKind::GateUp => &["gate_proj", "up_proj"],
        }
    }

    /// The name of the fused layer in the serving stacks.
    pub fn fused_name(self) -> &'static str {
        match self {
            FusedKind::Qkv => "qkv_proj",
            FusedKind::GateUp => "gate_up_proj",
        }
    }

    fn parent_suffix(self) -> &'static str {
        match self {
            FusedKind::Qkv => "self_attn",
            FusedKind::GateUp => "mlp",
        }
    }
}

/// A linear that belongs to a fused group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedMember<'a> {
    /// The module holding the group, e.g. `model.layers.3.self_attn`.
    pub parent: &'a str,
    /// Which group.
    pub kind: FusedKind,
    /// The member's own last name component, e.g. `k_proj`.
    pub member: &'a str,
}

impl FusedMember<'_> {
    /// The fused layer's full name, e.g. `model.layers.3.self_attn.qkv_proj`.
    pub fn fused_module(&self) -> String {
        format!("{}.{}", self.parent, self.kind.fused_name())
    }

    /// Full names of every member of the group.
    pub fn sibling_modules(&self) -> Vec<String> {
        self.kind
            .members()
            .iter()
            .map(|m| format!("{}.{m}", self.parent))
            .collect()
    }
}

/// The fused group `module` belongs to, if any.
pub fn fused_member(module: &str) -> Option<FusedMember<'_>> {
    let (parent, member) = module.rsplit_once('.')?;
    [FusedKind::Qkv, FusedKind::GateUp]
        .into_iter()
        .find(|kind| {
            kind.members().contains(&member)
                && parent.rsplit('.').next() == Some(kind.parent_suffix())
        })
        .map(|kind| FusedMember {
            parent,
            kind,
            member,
        })
}

/// The module of a tensor that is the 2-D `weight` of a linear inside a decoder layer
/// (`….layers.<n>.….weight`); embeddings, `lm_head` and 1-D norm weights are not.
pub fn decoder_linear<'a>(tensor: &'a str, shape: &[usize]) -> Option<&'a str> {
    let module = tensor.strip_suffix(".weight")?;
    let in_layer = module
        .split('.')
        .collect::<Vec<_>>()
        .windows(2)
        .any(|w| w[0] == "layers" && w[1].parse::<usize>().is_ok());
    (shape.len() == 2 && in_layer).then_some(module)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_groups_of_sala_and_llama() {
        let m = fused_member("model.layers.3.self_attn.k_proj").unwrap();
        assert_eq!(m.kind, FusedKind::Qkv);
        assert_eq!(m.fused_module(), "model.layers.3.self_attn.qkv_proj");
        assert_eq!(m.sibling_modules().len(), 3);
        let m = fused_member("model.layers.0.mlp.up_proj").unwrap();
        assert_eq!(m.kind, FusedKind::GateUp);
        assert!(fused_member("model.layers.0.self_attn.o_proj").is_none());
        assert!(fused_member("model.layers.0.self_attn.z_proj").is_none());
        assert!(fused_member("model.layers.0.mlp.q_proj").is_none());
    }

    #[test]
    fn decoder_linears_are_2d_weights_inside_layers() {
        let w = "model.layers.12.mlp.down_proj.weight";
        assert_eq!(
            decoder_linear(w, &[8, 8]),
            Some("model.layers.12.mlp.down_proj")
        );
        assert_eq!(
            decoder_linear("model.layers.1.input_layernorm.weight", &[8]),
            None
        );
        assert_eq!(decoder_linear("model.embed_tokens.weight", &[8, 8]), None);
        assert_eq!(decoder_linear("lm_head.weight", &[8, 8]), None);
    }
}
