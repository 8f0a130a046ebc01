//! The page: a view of the inputs (numbers formatted once, here), the plots, and the
//! `minijinja` template that lays them out.
//!
//! The page is polyglot XHTML (every element closed, no named entities but XML's), so that a
//! test reads it with an XML parser, and it is self-contained: styles inline, plots inline SVG,
//! no script, no font, no link to anything.

use crate::charts::{draw_all, smoothing_groups, Charts, Group};
use crate::data::{
    DriftResults, ErrorHessian, EvalMetrics, EvalResults, LinearReport, PlanRow, QuantizationReport,
};
use crate::error::ReportError;
use serde::Serialize;
use std::collections::BTreeMap;

/// What a page is rendered from.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// `quantization_report.json`.
    pub report: QuantizationReport,
    /// `eval_quant --json`, if given.
    pub eval: Option<EvalResults>,
    /// `drift --json`, if given.
    pub drift: Option<DriftResults>,
}

/// The template, compiled into the binary (nothing is read at run time).
const TEMPLATE: &str = include_str!("../templates/report.html");

/// Renders the page.
pub fn render(inputs: &Inputs) -> Result<String, ReportError> {
    let view = View::of(inputs)?;
    let mut env = minijinja::Environment::new();
    // `.html` names turn on HTML escaping of every value not marked `safe` (only the SVGs are).
    env.add_template("report.html", TEMPLATE)?;
    Ok(env
        .get_template("report.html")?
        .render(minijinja::value::Serde(&view))?)
}

/// A key and its value, for the run's facts table.
#[derive(Debug, Serialize)]
struct Fact {
    key: String,
    value: String,
}

fn fact(key: &str, value: impl Into<String>) -> Fact {
    Fact {
        key: key.to_owned(),
        value: value.into(),
    }
}

/// One row of the per-linear table.
#[derive(Debug, Serialize)]
struct LinearRow {
    name: String,
    layer: String,
    projection: String,
    treatment: String,
    shape: String,
    error: String,
    /// Shortest round-trip text of the JSON's number, for machines (`data-value`).
    error_value: String,
    baseline: String,
    baseline_value: String,
    ratio: String,
    /// `worse` when the error is above the baseline's.
    class: &'static str,
    smooth: String,
    retries: usize,
    fallback: bool,
    seconds: String,
}

#[derive(Debug, Serialize)]
struct LayerRow {
    layer: usize,
    kind: String,
    samples: usize,
    tokens: u64,
    stages: Vec<String>,
    total: String,
    rss: String,
    device: String,
}

#[derive(Debug, Serialize)]
struct EvalRow {
    label: String,
    sequences: String,
    tokens: usize,
    ppl_original: String,
    ppl_quantized: String,
    kl_mean: String,
    kl_max: String,
    top1: String,
}

#[derive(Debug, Serialize)]
struct DriftRow {
    text: String,
    layer: usize,
    first_tokens: usize,
    first_state_rel: String,
    last_tokens: usize,
    last_state_rel: String,
    last_output_rel: String,
    p_state_abs: String,
    p_state_rel: String,
    p_output_rel: String,
}

#[derive(Debug, Serialize)]
struct Bucket {
    label: String,
    samples: usize,
}

/// Everything the template shows, formatted.
#[derive(Debug, Serialize)]
struct View {
    title: String,
    facts: Vec<Fact>,
    highlights: Vec<String>,
    calibration: Vec<Fact>,
    buckets: Vec<Bucket>,
    failed_samples: Vec<String>,
    plan: Vec<PlanRow>,
    charts: Charts,
    linears: Vec<LinearRow>,
    stage_names: Vec<&'static str>,
    layers: Vec<LayerRow>,
    eval: Option<Vec<EvalRow>>,
    eval_source: String,
    drift: Option<Vec<DriftRow>>,
    baseline: &'static str,
    settings: Vec<Fact>,
    generator: String,
}

const GB: f64 = 1e9;

fn opt_e(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.4e}"))
}

fn opt_raw(v: Option<f64>) -> String {
    v.map_or(String::new(), |v| v.to_string())
}

/// The solve stage's seconds by step, summed over the linears, largest first
/// (`solve 59.0 s, baseline 20.0 s, …`); `None` for a report without them.
fn solve_steps_text(linears: &[LinearReport]) -> Option<String> {
    let mut totals: std::collections::BTreeMap<&str, f64> = std::collections::BTreeMap::new();
    for (step, seconds) in linears.iter().flat_map(|l| &l.solve_steps) {
        *totals.entry(step.as_str()).or_default() += seconds;
    }
    let mut steps: Vec<(&str, f64)> = totals.into_iter().collect();
    steps.sort_by(|a, b| b.1.total_cmp(&a.1));
    let listed: Vec<String> = steps
        .iter()
        .map(|(step, seconds)| format!("{step} {seconds:.1} s"))
        .collect();
    (!listed.is_empty()).then(|| listed.join(", "))
}

fn opt_p(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.2}"))
}

impl View {
    fn of(inputs: &Inputs) -> Result<Self, ReportError> {
        let q = &inputs.report;
        let run = &q.report;
        let charts = draw_all(
            run,
            q.plan.as_ref(),
            inputs.eval.as_ref(),
            inputs.drift.as_ref(),
        )?;
        let baseline = match run.recipe.as_str() {
            "nvfp4" => "max calibration",
            _ => "RTN",
        };
        let model_name = q.model.as_ref().map_or_else(
            || {
                std::path::Path::new(&run.input)
                    .file_name()
                    .map_or(run.input.clone(), |n| n.to_string_lossy().into_owned())
            },
            |m| m.name.clone(),
        );
        let recipe = recipe_title(q);
        let mut facts = vec![fact(
            "model",
            match &q.model {
                Some(m) => format!(
                    "{} ({}, {:.2} M parameters, {:.1} MB of safetensors)",
                    m.name,
                    if m.model_type.is_empty() {
                        "?"
                    } else {
                        &m.model_type
                    },
                    m.parameters as f64 / 1e6,
                    m.bytes as f64 / 1e6
                ),
                None => model_name.clone(),
            },
        )];
        facts.push(fact("recipe", recipe.clone()));
        facts.push(fact("input", run.input.clone()));
        facts.push(fact("output", run.output.clone()));
        facts.push(fact(
            "calibration",
            format!(
                "{} samples, {} tokens{}",
                run.samples,
                run.tokens,
                if run.failed_samples.is_empty() {
                    String::new()
                } else {
                    format!(", {} skipped", run.failed_samples.len())
                }
            ),
        ));
        facts.push(fact("wall time", format!("{:.1} s", run.seconds)));
        facts.push(fact(
            "peak host memory",
            run.peak_rss_bytes.map_or("unknown".into(), |b| {
                format!("{:.3} GB (RSS)", b as f64 / GB)
            }),
        ));
        facts.push(fact(
            "peak device memory",
            run.peak_device_memory
                .map_or("– (no device probe: a CPU run)".into(), |m| {
                    format!(
                        "{:.3} GB in use, {:.3} GB reserved",
                        m.in_use as f64 / GB,
                        m.reserved as f64 / GB
                    )
                }),
        ));
        let mut size = format!("{:.2} MB of tensors written", run.output_bytes as f64 / 1e6);
        if let Some(m) = &q.model {
            if m.parameters > 0 {
                size += &format!(
                    "; {:.2} bits per parameter over the whole checkpoint ({:.2}× smaller than the source)",
                    run.output_bytes as f64 * 8.0 / m.parameters as f64,
                    m.bytes as f64 / run.output_bytes.max(1) as f64
                );
            }
        }
        facts.push(fact("size", size));
        facts.push(fact(
            "hidden states",
            format!(
                "{:.1} MB, {}",
                run.hidden_state_bytes as f64 / 1e6,
                run.hidden_states_location.as_deref().unwrap_or("?")
            ),
        ));
        facts.push(fact(
            "solver",
            format!(
                "{}; statistics on the {}",
                run.solver,
                if run.statistics_on_device {
                    "device"
                } else {
                    "host"
                }
            ),
        ));
        if let Some(steps) = solve_steps_text(&run.linears) {
            facts.push(fact("solve steps", steps));
        }
        facts.push(fact("verifier", run.verify_summary.clone()));

        let highlights = highlights(q, baseline);
        let (calibration, buckets) = match &q.calibration {
            Some(c) => (
                vec![
                    fact("file", c.path.clone()),
                    fact(
                        "samples",
                        format!(
                            "{} ({} distinct records; {} truncated to {} tokens; {} malformed lines skipped)",
                            c.samples, c.distinct_records, c.truncated, c.max_len, c.skipped_lines
                        ),
                    ),
                    fact(
                        "tokens",
                        format!(
                            "{} in all; per sample min {}, mean {:.1}, max {}",
                            c.total_tokens, c.min_tokens, c.mean_tokens, c.max_tokens
                        ),
                    ),
                    fact(
                        "uniqueness",
                        format!(
                            "unique / total tokens per sample: mean {:.3}, min {:.3} (line {})",
                            c.uniqueness.mean, c.uniqueness.min, c.uniqueness.min_line
                        ),
                    ),
                ],
                c.buckets
                    .iter()
                    .map(|b| Bucket {
                        label: b.label.clone(),
                        samples: b.samples,
                    })
                    .collect(),
            ),
            None => (Vec::new(), Vec::new()),
        };
        let linears = run.linears.iter().map(linear_row).collect();
        let with_load = run.reports_load();
        let stage_names = crate::data::StageSeconds::default()
            .named(with_load)
            .iter()
            .map(|(n, _)| *n)
            .collect();
        let layers = run
            .layers
            .iter()
            .map(|l| LayerRow {
                layer: l.layer,
                kind: l.kind.clone(),
                samples: l.samples,
                tokens: l.tokens,
                stages: l
                    .stages
                    .named(with_load)
                    .iter()
                    .map(|(_, s)| format!("{s:.2}"))
                    .collect(),
                total: format!("{:.2}", l.stages.total()),
                rss: l
                    .peak_rss_bytes
                    .map_or("–".into(), |b| format!("{:.3}", b as f64 / GB)),
                device: l.peak_device_memory.map_or("–".into(), |m| {
                    format!(
                        "{:.3} / {:.3}",
                        m.in_use as f64 / GB,
                        m.reserved as f64 / GB
                    )
                }),
            })
            .collect();
        let eval = inputs.eval.as_ref().map(|e| {
            let row = |label: String, sequences: String, m: &EvalMetrics| EvalRow {
                label,
                sequences,
                tokens: m.tokens,
                ppl_original: format!("{:.2}", m.perplexity_original),
                ppl_quantized: format!("{:.2}", m.perplexity_quantized),
                kl_mean: format!("{:.4}", m.kl_mean),
                kl_max: format!("{:.3}", m.kl_max),
                top1: format!("{:.4}", m.top1_agreement),
            };
            let mut rows: Vec<EvalRow> = e
                .buckets
                .iter()
                .map(|b| row(b.length.to_string(), b.sequences.to_string(), &b.metrics))
                .collect();
            let total: usize = e.buckets.iter().map(|b| b.sequences).sum();
            rows.push(row("all".into(), total.to_string(), &e.overall));
            rows
        });
        let eval_source = inputs.eval.as_ref().map_or(String::new(), |e| {
            format!(
                "{} against {} ({})",
                e.quantized, e.original, e.quantized_format
            )
        });
        let drift = inputs.drift.as_ref().map(|d| {
            d.iter()
                .flat_map(|(text, layers)| {
                    layers.iter().filter_map(move |l| {
                        let (first, last) = (l.points.first()?, l.points.last()?);
                        Some(DriftRow {
                            text: text.clone(),
                            layer: l.layer,
                            first_tokens: first.tokens,
                            first_state_rel: format!("{:.3}", first.state_rel),
                            last_tokens: last.tokens,
                            last_state_rel: format!("{:.3}", last.state_rel),
                            last_output_rel: format!("{:.3}", last.output_rel),
                            p_state_abs: opt_p(l.p_state_abs),
                            p_state_rel: opt_p(l.p_state_rel),
                            p_output_rel: opt_p(l.p_output_rel),
                        })
                    })
                })
                .collect()
        });
        Ok(View {
            title: format!("{model_name}: {recipe}"),
            facts,
            highlights,
            calibration,
            buckets,
            failed_samples: run.failed_samples.clone(),
            plan: q.plan.as_ref().map(|p| p.summary()).unwrap_or_default(),
            charts,
            linears,
            stage_names,
            layers,
            eval,
            eval_source,
            drift,
            baseline,
            settings: q.settings.iter().map(|(k, v)| fact(k, v.clone())).collect(),
            generator: format!("sala-report-html {}", env!("CARGO_PKG_VERSION")),
        })
    }
}

/// `GPTQ W4A16 (INT4 g128)` / `NVFP4 (FP4)`: the recipe and the treatments it used.
fn recipe_title(q: &QuantizationReport) -> String {
    let run = &q.report;
    let name = match run.recipe.as_str() {
        "gptq" => "GPTQ W4A16".to_owned(),
        "nvfp4" => "NVFP4".to_owned(),
        other => other.to_owned(),
    };
    let mut treatments: Vec<&str> = Vec::new();
    for l in &run.linears {
        if !treatments.contains(&l.treatment.as_str()) {
            treatments.push(&l.treatment);
        }
    }
    let smooth = if run.linears.iter().any(|l| l.smooth_scale_range.is_some()) {
        ", SmoothQuant"
    } else {
        ""
    };
    format!("{name} ({}{smooth})", treatments.join(", "))
}

fn linear_row(l: &LinearReport) -> LinearRow {
    let ratio = l.ratio();
    LinearRow {
        name: l.name.clone(),
        layer: l.layer().map_or("–".into(), |l| l.to_string()),
        projection: l.projection().to_owned(),
        treatment: l.treatment.clone(),
        shape: format!("{}×{}", l.out_features, l.in_features),
        error: opt_e(l.output_error),
        error_value: opt_raw(l.output_error),
        baseline: opt_e(l.baseline_output_error),
        baseline_value: opt_raw(l.baseline_output_error),
        ratio: ratio.map_or("–".into(), |r| format!("{r:.3}")),
        class: if ratio.is_some_and(|r| r > 1.0) {
            "worse"
        } else {
            ""
        },
        smooth: match (l.smooth_scale_range, l.smooth_alpha) {
            (Some((a, b)), Some(alpha)) => format!("α {alpha:.2}: {a:.3} … {b:.3}"),
            (Some((a, b)), None) => format!("{a:.3} … {b:.3}"),
            (None, _) => "–".into(),
        },
        retries: l.damping_retries,
        fallback: l.rtn_fallback,
        seconds: format!("{:.2}", l.seconds),
    }
}

/// How many smoothing groups got each α (`0.20 (5 groups), 0.50 (3 groups)`), when the groups
/// report one.
fn alpha_counts(groups: &[Group]) -> Option<String> {
    let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
    for alpha in groups.iter().filter_map(|g| g.alpha) {
        // Hundredths: the search's grid is 0.05 apart, and a fixed α prints as given.
        *counts.entry((alpha * 100.0).round() as u32).or_default() += 1;
    }
    (!counts.is_empty()).then(|| {
        counts
            .iter()
            .map(|(a, n)| {
                let s = if *n == 1 { "" } else { "s" };
                format!("{:.2} ({n} group{s})", *a as f32 / 100.0)
            })
            .collect::<Vec<_>>()
            .join(", ")
    })
}

/// Where a run measured some linears' errors on the full Hessian and others on its diagonal
/// (NVFP4's hybrid solver), the sentence that says so: its totals add figures of both kinds.
fn mixed_hessians(linears: &[LinearReport]) -> Option<String> {
    let count = |kind| {
        let kinds = linears.iter().map(|l| l.error_hessian);
        kinds.filter(|&k| k == Some(kind)).count()
    };
    let (full, diagonal) = (count(ErrorHessian::Full), count(ErrorHessian::Diagonal));
    (full > 0 && diagonal > 0).then(|| {
        format!(
            "The errors of the {full} linears that GPTQ solved are on the full Hessian, those of \
             the {diagonal} that the block search solved on its diagonal E[x²]: the totals add \
             both kinds, and each linear's ratio compares like with like."
        )
    })
}

/// The few sentences a reader wants first: totals, where the solver lost to the baseline,
/// the largest errors, the extreme smoothing scales, retries, skipped samples.
fn highlights(q: &QuantizationReport, baseline: &str) -> Vec<String> {
    let run = &q.report;
    let mut out = Vec::new();
    let (ours, base) = run.linears.iter().fold((0.0, 0.0), |(o, b), l| {
        (
            o + l.output_error.unwrap_or(0.0),
            b + l.baseline_output_error.unwrap_or(0.0),
        )
    });
    let with_ratio: Vec<(&LinearReport, f64)> = run
        .linears
        .iter()
        .filter_map(|l| Some((l, l.ratio()?)))
        .collect();
    if base > 0.0 {
        out.push(format!(
            "Total proxy output error {ours:.4e} against {base:.4e} for {baseline} (ratio {:.3}).",
            ours / base
        ));
    }
    if let Some(line) = mixed_hessians(&run.linears) {
        out.push(line);
    }
    if !with_ratio.is_empty() {
        let worse: Vec<&(&LinearReport, f64)> =
            with_ratio.iter().filter(|(_, r)| *r > 1.0).collect();
        let ties = with_ratio.iter().filter(|(_, r)| *r == 1.0).count();
        let better = with_ratio.len() - worse.len() - ties;
        let mut line = format!(
            "Below the {baseline} baseline on {better} of {} linears",
            with_ratio.len()
        );
        if ties > 0 {
            line += &format!(", equal on {ties}");
        }
        if worse.is_empty() {
            line += ", above it on none.";
        } else {
            let names: Vec<String> = worse
                .iter()
                .take(8)
                .map(|(l, r)| format!("{} (×{r:.3})", l.name))
                .collect();
            line += &format!(
                ", above it on {}: {}{}.",
                worse.len(),
                names.join(", "),
                if worse.len() > 8 { ", …" } else { "" }
            );
        }
        out.push(line);
        let mut by_ratio = with_ratio.clone();
        by_ratio.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top: Vec<String> = by_ratio
            .iter()
            .take(3)
            .map(|(l, r)| format!("{} ({r:.3})", l.name))
            .collect();
        out.push(format!(
            "Highest ratio to the baseline: {}.",
            top.join(", ")
        ));
    }
    let mut by_error: Vec<&LinearReport> = run
        .linears
        .iter()
        .filter(|l| l.output_error.is_some())
        .collect();
    by_error.sort_by(|a, b| {
        b.output_error
            .unwrap_or(0.0)
            .total_cmp(&a.output_error.unwrap_or(0.0))
    });
    if !by_error.is_empty() {
        let top: Vec<String> = by_error
            .iter()
            .take(3)
            .map(|l| format!("{} ({:.3e})", l.name, l.output_error.unwrap_or(0.0)))
            .collect();
        out.push(format!("Largest proxy output errors: {}.", top.join(", ")));
    }
    let groups = smoothing_groups(&run.linears, q.plan.as_ref());
    let low = groups.iter().min_by(|a, b| a.range.0.total_cmp(&b.range.0));
    let high = groups.iter().max_by(|a, b| a.range.1.total_cmp(&b.range.1));
    if let (Some(low), Some(high)) = (low, high) {
        out.push(format!(
            "Smoothing scales over {} groups span {:.3} (layer {} {}) to {:.3} (layer {} {}).",
            groups.len(),
            low.range.0,
            low.layer,
            low.source,
            high.range.1,
            high.layer,
            high.source
        ));
        if let Some(alphas) = alpha_counts(&groups) {
            out.push(format!("Smoothing α by group: {alphas}."));
        }
    } else {
        out.push("No smoothing.".into());
    }
    let retries: usize = run.linears.iter().map(|l| l.damping_retries).sum();
    let fallbacks = run.linears.iter().filter(|l| l.rtn_fallback).count();
    out.push(format!(
        "Damping retries: {retries}; RTN fallbacks: {fallbacks}."
    ));
    out.push(if run.failed_samples.is_empty() {
        "No calibration sample was skipped.".into()
    } else {
        format!(
            "{} calibration samples were skipped (see below).",
            run.failed_samples.len()
        )
    });
    out
}
