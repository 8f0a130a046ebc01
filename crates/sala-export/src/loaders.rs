//! The GPTQ loaders an AutoGPTQ-layout checkpoint can be written for, the rules each applies
//! to the configuration and to every linear's shape, and the target a run names (`--target`):
//! which loaders must accept the result.
//!
//! | loader | bits (sym) | group size | per linear |
//! |---|---|---|---|
//! | `gptq_marlin` (vLLM, SGLang) | 4, 8 (symmetric only) | −1, 32, 64, 128 | `out % 64`, `in % 128`, `in % group` |
//! | `exllama` (vLLM's `gptq` method) | 2, 3, 4, 8 | any | `in % group` (whole groups), `in % (32/bits)`, `out % (32/bits)` |
//! | `torch` (transformers + GPTQModel's torch kernel) | 2, 3, 4, 8 | any | `in % (32/bits)`, `out % (32/bits)`; the last group may be partial (`ceil(in/group)` groups, `g_idx = k / group`) |
//!
//! The words of `qweight` pack `32/bits` input rows, and those of `qzeros` `32/bits` outputs,
//! so every loader needs both to divide; only the group rules differ.

use std::fmt;
use std::str::FromStr;

/// A GPTQ kernel that loads the AutoGPTQ v1 layout (`qweight`, `qzeros`, `scales`, `g_idx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GptqLoader {
    /// vLLM / SGLang `gptq_marlin`: the fast path, and the strictest shapes.
    Marlin,
    /// vLLM's `gptq` method (exllama kernels): whole groups only.
    Exllama,
    /// transformers with GPTQModel's (or AutoGPTQ's) torch kernel: a partial last group is fine.
    Torch,
}

impl GptqLoader {
    /// Every loader, strictest first.
    pub const ALL: [GptqLoader; 3] = [GptqLoader::Marlin, GptqLoader::Exllama, GptqLoader::Torch];

    /// The loader's short name, as printed.
    pub fn name(self) -> &'static str {
        match self {
            GptqLoader::Marlin => "gptq_marlin",
            GptqLoader::Exllama => "exllama",
            GptqLoader::Torch => "torch",
        }
    }

    /// Who runs it.
    pub fn served_by(self) -> &'static str {
        match self {
            GptqLoader::Marlin => "vLLM, SGLang",
            GptqLoader::Exllama => "vLLM `gptq`",
            GptqLoader::Torch => "transformers + GPTQModel",
        }
    }

    /// Group sizes the loader accepts (`None`: any positive size, or −1).
    pub fn group_sizes(self) -> Option<&'static [i64]> {
        match self {
            GptqLoader::Marlin => Some(&crate::config::MARLIN_GROUP_SIZES),
            GptqLoader::Exllama | GptqLoader::Torch => None,
        }
    }

    /// Why the loader refuses `bits`-bit weights on a symmetric (`sym`) or asymmetric grid.
    pub fn bits_violation(self, bits: u32, sym: bool) -> Option<String> {
        match self {
            GptqLoader::Marlin if !matches!((bits, sym), (4, true) | (8, true)) => Some(format!(
                "(bits, sym) = ({bits}, {sym}) is not (4, true) or (8, true)"
            )),
            GptqLoader::Exllama | GptqLoader::Torch if !matches!(bits, 2 | 3 | 4 | 8) => {
                Some(format!("{bits} bits is not one of 2, 3, 4, 8"))
            }
            _ => None,
        }
    }

    /// Why the loader refuses groups of `group_size` input columns (−1: one group per row).
    pub fn group_violation(self, group_size: i64) -> Option<String> {
        match self.group_sizes() {
            Some(sizes) if !sizes.contains(&group_size) => {
                Some(format!("group size {group_size} is not one of {sizes:?}"))
            }
            None if group_size != -1 && group_size <= 0 => Some(format!(
                "group size {group_size} is neither -1 nor positive"
            )),
            _ => None,
        }
    }

    /// Why the loader refuses one linear of `out` × `inp` weights at `bits` bits with groups
    /// of `group_size` input columns (`None`: one group per row). Empty: accepted.
    pub fn linear_violations(
        self,
        out: usize,
        inp: usize,
        bits: u32,
        group_size: Option<usize>,
    ) -> Vec<String> {
        let mut broken = Vec::new();
        let per_word = if (1..=32).contains(&bits) {
            (32 / bits) as usize
        } else {
            1
        };
        if self == GptqLoader::Marlin {
            if out % crate::MARLIN_MIN_OUT != 0 {
                broken.push(format!("out {out} % {} != 0", crate::MARLIN_MIN_OUT));
            }
            if inp % crate::MARLIN_MIN_IN != 0 {
                broken.push(format!("in {inp} % {} != 0", crate::MARLIN_MIN_IN));
            }
        } else {
            if inp % per_word != 0 {
                broken.push(format!("in {inp} % {per_word} != 0 (qweight words)"));
            }
            if out % per_word != 0 {
                broken.push(format!("out {out} % {per_word} != 0 (qzeros words)"));
            }
        }
        let whole_groups = matches!(self, GptqLoader::Marlin | GptqLoader::Exllama);
        if let Some(g) = group_size.filter(|&g| g > 0 && whole_groups) {
            if inp % g != 0 {
                broken.push(format!(
                    "in {inp} % group_size {g} != 0 (a partial last group)"
                ));
            }
        }
        broken
    }
}

impl fmt::Display for GptqLoader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which loaders a GPTQ checkpoint must load in: the plan applies only their rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoaderTarget {
    /// `gptq_marlin` (vLLM, SGLang): the default, what MiniCPM-SALA is served with.
    #[default]
    Marlin,
    /// The torch kernels (transformers + GPTQModel / AutoGPTQ): any shape whose words pack,
    /// a partial last group allowed. What a small model with `in % 128 != 0` can target.
    Gptq,
}

impl LoaderTarget {
    /// Every target, for help texts.
    pub const ALL: [LoaderTarget; 2] = [LoaderTarget::Marlin, LoaderTarget::Gptq];

    /// The target's name (`--target NAME`).
    pub fn name(self) -> &'static str {
        match self {
            LoaderTarget::Marlin => "marlin",
            LoaderTarget::Gptq => "gptq",
        }
    }

    /// The loaders that must accept the checkpoint.
    pub fn required(self) -> &'static [GptqLoader] {
        match self {
            LoaderTarget::Marlin => &[GptqLoader::Marlin],
            LoaderTarget::Gptq => &[GptqLoader::Torch],
        }
    }
}

impl fmt::Display for LoaderTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for LoaderTarget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LoaderTarget::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = LoaderTarget::ALL.iter().map(|t| t.name()).collect();
                format!(
                    "unknown loader target {s:?} (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// Whether one loader accepts a whole checkpoint or plan, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LoaderVerdict {
    /// The loader.
    pub loader: GptqLoader,
    /// Every reason it refuses, `"name: rule"` (the configuration's, then each linear's).
    pub refusals: Vec<String>,
}

impl LoaderVerdict {
    /// Whether the loader accepts it.
    pub fn accepts(&self) -> bool {
        self.refusals.is_empty()
    }
}

impl fmt::Display for LoaderVerdict {
    /// `gptq_marlin (vLLM, SGLang): yes`, or `no: <first reason> (+N more)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): ", self.loader, self.loader.served_by())?;
        match self.refusals.as_slice() {
            [] => f.write_str("yes"),
            [one] => write!(f, "no: {one}"),
            [first, rest @ ..] => write!(f, "no: {first} (+{} more)", rest.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_shapes_are_refused_by_marlin_and_exllama_only() {
        // SmolLM2-135M's q_proj: 576 × 576, groups of 128 → 4.5 groups.
        let marlin = GptqLoader::Marlin.linear_violations(576, 576, 4, Some(128));
        assert_eq!(marlin.len(), 2, "{marlin:?}");
        assert!(marlin[0].contains("in 576 % 128"));
        let exllama = GptqLoader::Exllama.linear_violations(576, 576, 4, Some(128));
        assert_eq!(exllama.len(), 1, "{exllama:?}");
        assert!(exllama[0].contains("partial last group"));
        assert!(GptqLoader::Torch
            .linear_violations(576, 576, 4, Some(128))
            .is_empty());
        // Words must still pack.
        let torch = GptqLoader::Torch.linear_violations(100, 36, 4, Some(128));
        assert_eq!(torch.len(), 2, "{torch:?}");
    }

    #[test]
    fn config_rules_follow_each_loader() {
        assert_eq!(GptqLoader::Marlin.bits_violation(4, true), None);
        assert!(GptqLoader::Marlin.bits_violation(4, false).is_some());
        assert!(GptqLoader::Marlin.group_violation(96).is_some());
        assert_eq!(GptqLoader::Marlin.group_violation(-1), None);
        assert_eq!(GptqLoader::Torch.bits_violation(2, false), None);
        assert_eq!(GptqLoader::Torch.group_violation(96), None);
        assert!(GptqLoader::Torch.bits_violation(5, true).is_some());
        assert!(GptqLoader::Torch.group_violation(0).is_some());
    }

    #[test]
    fn targets_parse_by_name() {
        assert_eq!("gptq".parse(), Ok(LoaderTarget::Gptq));
        assert_eq!("marlin".parse(), Ok(LoaderTarget::Marlin));
        let err = "exl2".parse::<LoaderTarget>().unwrap_err();
        assert!(err.contains("marlin, gptq"), "{err}");
    }
}
