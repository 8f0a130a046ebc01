//! Smoothing groups as plain data, and the check that a group covers every reader of its source.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Result, SmoothError};

/// What produces the activation a group smooths, and so absorbs `1/s`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SmoothSource {
    /// A norm whose weight multiplies the activation (e.g. `input_layernorm`).
    Norm(String),
    /// A linear whose output rows produce the activation (e.g. `mlp.up_proj` feeding `down_proj`).
    LinearOutput(String),
}

impl SmoothSource {
    /// The source's tensor/module name.
    pub fn name(&self) -> &str {
        match self {
            SmoothSource::Norm(name) | SmoothSource::LinearOutput(name) => name,
        }
    }
}

/// One smoothing group: a source and the linears that read its output (which absorb `s`).
///
/// Plain data with string names, so a model can describe its groups as tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmoothGroup {
    /// The producer of the smoothed activation.
    pub source: SmoothSource,
    /// Names of the linears whose input columns absorb the scales.
    pub targets: Vec<String>,
}

impl SmoothGroup {
    /// A group whose source is the norm `norm`.
    pub fn norm(norm: &str, targets: &[&str]) -> Self {
        Self::with_source(SmoothSource::Norm(norm.to_owned()), targets)
    }

    /// A group whose source is the output rows of the linear `linear`.
    pub fn linear_output(linear: &str, targets: &[&str]) -> Self {
        Self::with_source(SmoothSource::LinearOutput(linear.to_owned()), targets)
    }

    fn with_source(source: SmoothSource, targets: &[&str]) -> Self {
        Self {
            source,
            targets: targets.iter().map(|t| (*t).to_owned()).collect(),
        }
    }

    /// Checks the group against the model's data flow: the source must be known, the targets
    /// non-empty, distinct and readers of the source, and **every** reader of the source must be a
    /// target. A reader left out would see its input silently divided by `s`: the `o_gate` bug of
    /// the original NVFP4 script, refused here with [`SmoothError::MissingReader`].
    pub fn validate(&self, readers: &ReaderMap) -> Result<()> {
        let producer = self.source.name();
        let Some(actual_readers) = readers.readers(producer) else {
            return Err(SmoothError::UnknownSource {
                producer: producer.to_owned(),
            });
        };
        if self.targets.is_empty() {
            return Err(SmoothError::NoTargets {
                producer: producer.to_owned(),
            });
        }
        let mut seen = BTreeSet::new();
        for target in &self.targets {
            if !seen.insert(target.as_str()) {
                return Err(SmoothError::DuplicateTarget {
                    producer: producer.to_owned(),
                    linear: target.clone(),
                });
            }
            if !actual_readers.contains(target) {
                return Err(SmoothError::NotAReader {
                    producer: producer.to_owned(),
                    linear: target.clone(),
                });
            }
        }
        match actual_readers.iter().find(|r| !seen.contains(r.as_str())) {
            Some(missing) => Err(SmoothError::MissingReader {
                producer: producer.to_owned(),
                linear: missing.clone(),
            }),
            None => Ok(()),
        }
    }
}

/// Validates every group and refuses two groups with the same source (the second would fold
/// scales computed from statistics the first already changed).
pub fn validate_groups(groups: &[SmoothGroup], readers: &ReaderMap) -> Result<()> {
    let mut sources = BTreeSet::new();
    for group in groups {
        group.validate(readers)?;
        if !sources.insert(group.source.name()) {
            return Err(SmoothError::DuplicateSource {
                producer: group.source.name().to_owned(),
            });
        }
    }
    Ok(())
}

/// "Who reads what": for each producer (a norm or a linear), the linears that read its output.
///
/// The model builds it from its graph; a reader is listed once however many paths lead to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReaderMap {
    readers: BTreeMap<String, BTreeSet<String>>,
}

impl ReaderMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `reader` (a linear) reads the output of `producer`.
    pub fn add(&mut self, producer: &str, reader: &str) {
        self.readers
            .entry(producer.to_owned())
            .or_default()
            .insert(reader.to_owned());
    }

    /// Records `producer` with all of `readers`.
    pub fn add_all(&mut self, producer: &str, readers: &[&str]) {
        let entry = self.readers.entry(producer.to_owned()).or_default();
        entry.extend(readers.iter().map(|r| (*r).to_owned()));
    }

    /// The readers of `producer` (sorted), or `None` when the producer is unknown.
    pub fn readers(&self, producer: &str) -> Option<&BTreeSet<String>> {
        self.readers.get(producer)
    }
}

impl<'a> FromIterator<(&'a str, &'a [&'a str])> for ReaderMap {
    fn from_iter<I: IntoIterator<Item = (&'a str, &'a [&'a str])>>(iter: I) -> Self {
        let mut map = ReaderMap::new();
        for (producer, readers) in iter {
            map.add_all(producer, readers);
        }
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The data flow of a minicpm4 attention block: `o_gate` reads the normed input too.
    fn minicpm4_readers() -> ReaderMap {
        let qkvg: &[&str] = &["q_proj", "k_proj", "v_proj", "o_gate"];
        let up: &[&str] = &["down_proj"];
        [("input_layernorm", qkvg), ("up_proj", up)]
            .into_iter()
            .collect()
    }

    #[test]
    fn complete_groups_pass() {
        let readers = minicpm4_readers();
        let groups = [
            SmoothGroup::norm("input_layernorm", &["q_proj", "k_proj", "v_proj", "o_gate"]),
            SmoothGroup::linear_output("up_proj", &["down_proj"]),
        ];
        validate_groups(&groups, &readers).unwrap();
    }

    #[test]
    fn the_o_gate_bug_is_refused_by_name() {
        let group = SmoothGroup::norm("input_layernorm", &["q_proj", "k_proj", "v_proj"]);
        let err = group.validate(&minicpm4_readers()).unwrap_err();
        assert_eq!(
            err,
            SmoothError::MissingReader {
                producer: "input_layernorm".to_owned(),
                linear: "o_gate".to_owned(),
            }
        );
        assert!(err.to_string().contains("o_gate"));
    }

    #[test]
    fn malformed_groups_are_refused() {
        let readers = minicpm4_readers();
        let all = ["q_proj", "k_proj", "v_proj", "o_gate"];
        let cases = [
            (
                SmoothGroup::norm("post_attention_layernorm", &["gate_proj"]),
                "not in the reader map",
            ),
            (SmoothGroup::norm("input_layernorm", &[]), "no target"),
            (
                SmoothGroup::norm(
                    "input_layernorm",
                    &["q_proj", "q_proj", "k_proj", "v_proj", "o_gate"],
                ),
                "listed twice",
            ),
            (
                SmoothGroup::norm("input_layernorm", &[&all[..], &["down_proj"]].concat()),
                "does not read",
            ),
        ];
        for (group, message) in cases {
            let err = group.validate(&readers).unwrap_err().to_string();
            assert!(err.contains(message), "{err}");
        }
        let twice = [
            SmoothGroup::linear_output("up_proj", &["down_proj"]),
            SmoothGroup::linear_output("up_proj", &["down_proj"]),
        ];
        assert!(matches!(
            validate_groups(&twice, &readers),
            Err(SmoothError::DuplicateSource { .. })
        ));
    }
}
