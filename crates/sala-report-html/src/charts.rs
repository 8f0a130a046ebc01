//! The plots, each an SVG document in a `String`, drawn with `plotters`' SVG backend.
//!
//! Per-linear plots put a linear at `layer + offset`: the linears of layer `L` spread over
//! `[L − 0.4, L + 0.4]` in forward order, so the x axis reads as the decoder layer and a point
//! is found by its layer. Error plots use a log scale (errors span decades between a `k_proj`
//! and a `down_proj`), and are coloured by the linear's projection.

use crate::data::{DriftResults, EvalResults, LinearReport, Plan, RunReport};
use crate::error::ReportError;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::collections::BTreeMap;

/// Width and height of a plot in pixels (CSS scales them to the page).
const SIZE: (u32, u32) = (960, 340);

/// A palette that stays distinguishable in print and for common colour blindness (Okabe–Ito,
/// then two greys).
const PALETTE: [RGBColor; 9] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(213, 94, 0),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(240, 228, 66),
    RGBColor(0, 0, 0),
    RGBColor(150, 150, 150),
];

/// The minor grid lines: barely there, so the points stand out.
const LIGHT: RGBColor = RGBColor(242, 242, 242);

/// The x range of a per-layer plot up to layer `last`, with room on the right for the legend
/// (a quarter of the width), so that it never covers the last layers' points.
fn layer_span(last: f64) -> std::ops::Range<f64> {
    -0.6..last + 0.6 + 0.3 * (last + 1.2)
}

/// Tick labels of a per-layer axis: whole layers up to `last`, none in the legend's room.
fn layer_ticks(last: f64) -> impl Fn(&f64) -> String {
    move |v: &f64| {
        let r = v.round();
        if (v - r).abs() < 1e-6 && r >= 0.0 && r <= last {
            format!("{}", r as i64)
        } else {
            String::new()
        }
    }
}

/// The colour of the `i`-th series.
fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Every plot of a report, as SVG documents, by name; a plot without data is absent.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Charts {
    /// Per linear: proxy output error (filled) and the baseline's (ring), log scale.
    pub errors: Option<String>,
    /// Per linear: ours / baseline, log scale, with 1 marked.
    pub ratio: Option<String>,
    /// Per smoothing group: the range of its scales.
    pub smoothing: Option<String>,
    /// Per layer: damping retries and RTN fallbacks (absent when there are none).
    pub retries: Option<String>,
    /// Per layer: seconds by stage, stacked.
    pub time: Option<String>,
    /// Per layer: peak host (and device) memory.
    pub memory: Option<String>,
    /// Per length bucket: mean KL and top-1 agreement.
    pub eval: Option<String>,
    /// GLA state drift against length, diverse and repeated text.
    pub drift: Option<String>,
}

/// Draws every plot the data allows.
pub fn draw_all(
    run: &RunReport,
    plan: Option<&Plan>,
    eval: Option<&EvalResults>,
    drift: Option<&DriftResults>,
) -> Result<Charts, ReportError> {
    let placed = place_linears(&run.linears);
    Ok(Charts {
        errors: errors(&run.linears, &placed)?,
        ratio: ratio(&run.linears, &placed)?,
        smoothing: smoothing(&run.linears, plan)?,
        retries: retries(run)?,
        time: time(run)?,
        memory: memory(run)?,
        eval: eval.map(eval_chart).transpose()?,
        drift: drift.map(drift_chart).transpose()?.flatten(),
    })
}

/// Runs `draw` on a fresh SVG canvas and returns the document.
fn svg(
    plot: &'static str,
    draw: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<String, ReportError> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
        let result = root
            .fill(&WHITE)
            .map_err(|e| e.into())
            .and_then(|()| draw(&root))
            .and_then(|()| root.present().map_err(|e| e.into()));
        result.map_err(|e| ReportError::Plot {
            plot,
            message: e.to_string(),
        })?;
    }
    Ok(out)
}

/// The x position of each linear (see the module's doc) and the projections in first-seen
/// order (their colours).
struct Placed {
    x: Vec<f64>,
    kinds: Vec<String>,
    kind_of: Vec<usize>,
    /// The last x position's layer (`lm_head` counts as one past the last layer).
    last: f64,
}

fn place_linears(linears: &[LinearReport]) -> Placed {
    let mut per_layer: BTreeMap<usize, usize> = BTreeMap::new();
    for l in linears {
        *per_layer
            .entry(l.layer().unwrap_or(usize::MAX))
            .or_default() += 1;
    }
    let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
    let mut kinds: Vec<String> = Vec::new();
    let mut kind_of = Vec::new();
    let mut x = Vec::new();
    let last_layer = per_layer.keys().filter(|&&l| l != usize::MAX).max();
    let head_at = last_layer.map_or(0, |l| l + 1);
    for l in linears {
        let layer = l.layer().unwrap_or(usize::MAX);
        let n = per_layer[&layer];
        let j = seen.entry(layer).or_default();
        let at = if layer == usize::MAX { head_at } else { layer };
        x.push(at as f64 - 0.4 + 0.8 * (*j as f64 + 0.5) / n as f64);
        *j += 1;
        let kind = l.projection().to_owned();
        let k = kinds.iter().position(|k| *k == kind).unwrap_or_else(|| {
            kinds.push(kind);
            kinds.len() - 1
        });
        kind_of.push(k);
    }
    let hi = if per_layer.contains_key(&usize::MAX) {
        head_at
    } else {
        last_layer.copied().unwrap_or(0)
    };
    Placed {
        x,
        kinds,
        kind_of,
        last: hi as f64,
    }
}

/// A log range around the positive values, padded by a fifth of a decade; `None` without any.
fn log_range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    (hi > 0.0).then(|| {
        let pad = 10f64.powf(0.2);
        let (lo, hi) = (lo / pad, hi * pad);
        // A single value still needs a range.
        if hi / lo < 1.5 {
            (lo / 2.0, hi * 2.0)
        } else {
            (lo, hi)
        }
    })
}

/// `1.2e3` style ticks for log axes.
fn sci(v: &f64) -> String {
    format!("{v:.0e}")
}

fn errors(linears: &[LinearReport], placed: &Placed) -> Result<Option<String>, ReportError> {
    let values = linears
        .iter()
        .flat_map(|l| [l.output_error, l.baseline_output_error])
        .flatten();
    let Some((lo, hi)) = log_range(values) else {
        return Ok(None);
    };
    let ticks = layer_ticks(placed.last);
    svg("errors", |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(layer_span(placed.last), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .light_line_style(LIGHT)
            .x_desc("decoder layer (its linears in forward order)")
            .y_desc("tr((W-Q) H (W-Q)^T)")
            .x_label_formatter(&ticks)
            .y_label_formatter(&sci)
            .draw()?;
        for (k, kind) in placed.kinds.iter().enumerate() {
            let c = colour(k);
            let ours = linears.iter().enumerate().filter_map(|(i, l)| {
                (placed.kind_of[i] == k)
                    .then_some(l.output_error)
                    .flatten()
                    .map(|e| Circle::new((placed.x[i], e), 4, c.filled()))
            });
            chart
                .draw_series(ours)?
                .label(kind.as_str())
                .legend(move |(x, y)| Circle::new((x, y), 4, c.filled()));
            let base = linears.iter().enumerate().filter_map(|(i, l)| {
                (placed.kind_of[i] == k)
                    .then_some(l.baseline_output_error)
                    .flatten()
                    .map(|e| Circle::new((placed.x[i], e), 4, c.stroke_width(1)))
            });
            chart.draw_series(base)?;
        }
        // The ring's meaning, once, in black.
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label("ring: baseline")
            .legend(|(x, y)| Circle::new((x, y), 4, BLACK.stroke_width(1)));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
        Ok(())
    })
    .map(Some)
}

fn ratio(linears: &[LinearReport], placed: &Placed) -> Result<Option<String>, ReportError> {
    let Some((lo, hi)) = log_range(linears.iter().filter_map(LinearReport::ratio)) else {
        return Ok(None);
    };
    // 1 (ours = baseline) is always in view: above it is a loss.
    let (lo, hi) = (lo.min(0.5), hi.max(2.0));
    let ticks = layer_ticks(placed.last);
    svg("ratio", |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(layer_span(placed.last), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .light_line_style(LIGHT)
            .x_desc("decoder layer")
            .y_desc("error / baseline error")
            .x_label_formatter(&ticks)
            .y_label_formatter(&|v| format!("{v:.2}"))
            .draw()?;
        chart.draw_series(LineSeries::new(
            [
                (layer_span(placed.last).start, 1.0),
                (layer_span(placed.last).end, 1.0),
            ],
            BLACK.stroke_width(1),
        ))?;
        for (k, kind) in placed.kinds.iter().enumerate() {
            let c = colour(k);
            let points = linears.iter().enumerate().filter_map(|(i, l)| {
                (placed.kind_of[i] == k)
                    .then(|| l.ratio())
                    .flatten()
                    .map(|r| Circle::new((placed.x[i], r), 4, c.filled()))
            });
            chart
                .draw_series(points)?
                .label(kind.as_str())
                .legend(move |(x, y)| Circle::new((x, y), 4, c.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
        Ok(())
    })
    .map(Some)
}

/// One smoothing group: where it is drawn, its source kind, its scale range and its α.
pub(crate) struct Group {
    pub(crate) layer: usize,
    pub(crate) source: String,
    pub(crate) range: (f64, f64),
    pub(crate) alpha: Option<f32>,
}

/// The smoothing groups with their scale ranges: by the plan's group names when the report
/// has the plan (the linears of one group share its scales), else one per linear.
pub(crate) fn smoothing_groups(linears: &[LinearReport], plan: Option<&Plan>) -> Vec<Group> {
    let group_of: BTreeMap<&str, &str> = plan
        .map(|p| {
            p.linears
                .iter()
                .filter_map(|l| Some((l.name.as_str(), l.smooth_group.as_deref()?)))
                .collect()
        })
        .unwrap_or_default();
    let mut groups: Vec<(String, Group)> = Vec::new();
    for l in linears {
        let Some((a, b)) = l.smooth_scale_range else {
            continue;
        };
        let (a, b) = (a as f64, b as f64);
        let name = group_of
            .get(l.name.as_str())
            .map_or(l.name.clone(), |g| (*g).to_owned());
        match groups.iter_mut().find(|(n, _)| *n == name) {
            Some((_, g)) => g.range = (g.range.0.min(a), g.range.1.max(b)),
            None => groups.push((
                name.clone(),
                Group {
                    layer: l.layer().unwrap_or(0),
                    source: name.rsplit('.').next().unwrap_or(&name).to_owned(),
                    range: (a, b),
                    alpha: l.smooth_alpha,
                },
            )),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

fn smoothing(linears: &[LinearReport], plan: Option<&Plan>) -> Result<Option<String>, ReportError> {
    let groups = smoothing_groups(linears, plan);
    let Some((lo, hi)) = log_range(groups.iter().flat_map(|g| [g.range.0, g.range.1])) else {
        return Ok(None);
    };
    let (lo, hi) = (lo.min(0.5), hi.max(2.0));
    let last = groups.iter().map(|g| g.layer).max().unwrap_or(0);
    let mut sources: Vec<&str> = Vec::new();
    for g in &groups {
        if !sources.contains(&g.source.as_str()) {
            sources.push(&g.source);
        }
    }
    let ticks = layer_ticks(last as f64);
    svg("smoothing", |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(layer_span(last as f64), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .light_line_style(LIGHT)
            .x_desc("decoder layer")
            .y_desc("smoothing scale (min..max)")
            .x_label_formatter(&ticks)
            .y_label_formatter(&|v| format!("{v:.2}"))
            .draw()?;
        let width = 0.8 / sources.len().max(1) as f64;
        for (k, source) in sources.iter().enumerate() {
            let c = colour(k);
            let bars = groups.iter().filter(|g| g.source == *source).map(|g| {
                let x = g.layer as f64 - 0.4 + width * k as f64;
                Rectangle::new(
                    [(x + 0.1 * width, g.range.0), (x + 0.9 * width, g.range.1)],
                    c.filled(),
                )
            });
            chart
                .draw_series(bars)?
                .label(*source)
                .legend(move |(x, y)| Rectangle::new([(x - 5, y - 5), (x + 5, y + 5)], c.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
        Ok(())
    })
    .map(Some)
}

fn retries(run: &RunReport) -> Result<Option<String>, ReportError> {
    if run.linears.is_empty() {
        return Ok(None);
    }
    let mut per_layer: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for layer in &run.layers {
        per_layer.entry(layer.layer).or_default();
    }
    for l in &run.linears {
        let e = per_layer.entry(l.layer().unwrap_or(0)).or_default();
        e.0 += l.damping_retries;
        e.1 += usize::from(l.rtn_fallback);
    }
    // Nothing to plot is said in words (the page's note), not with an empty chart.
    if per_layer.values().all(|&(r, f)| r == 0 && f == 0) {
        return Ok(None);
    }
    let last = per_layer.keys().max().copied().unwrap_or(0);
    let top = per_layer
        .values()
        .map(|(r, f)| r.max(f))
        .max()
        .copied()
        .unwrap_or(0)
        .max(1);
    let ticks = layer_ticks(last as f64);
    svg("retries", |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(layer_span(last as f64), 0.0..top as f64 + 0.5)?;
        chart
            .configure_mesh()
            .light_line_style(LIGHT)
            .x_desc("decoder layer")
            .y_desc("count")
            .x_label_formatter(&ticks)
            .y_labels(top + 2)
            .y_label_formatter(&|v| {
                // Counts: whole numbers only.
                let r = v.round();
                if (v - r).abs() < 1e-6 {
                    format!("{r:.0}")
                } else {
                    String::new()
                }
            })
            .draw()?;
        for (k, (label, pick)) in [("damping retries", 0usize), ("RTN fallbacks", 1usize)]
            .into_iter()
            .enumerate()
        {
            let c = colour(k + 3);
            let bars = per_layer.iter().map(|(&layer, &(r, f))| {
                let v = if pick == 0 { r } else { f } as f64;
                let x = layer as f64 - 0.35 + 0.35 * k as f64;
                Rectangle::new([(x, 0.0), (x + 0.33, v)], c.filled())
            });
            chart
                .draw_series(bars)?
                .label(label)
                .legend(move |(x, y)| Rectangle::new([(x - 5, y - 5), (x + 5, y + 5)], c.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
        Ok(())
    })
    .map(Some)
}

fn time(run: &RunReport) -> Result<Option<String>, ReportError> {
    if run.layers.is_empty() {
        return Ok(None);
    }
    let last = run.layers.iter().map(|l| l.layer).max().unwrap_or(0);
    let top = run
        .layers
        .iter()
        .map(|l| l.stages.total())
        .fold(0f64, f64::max)
        .max(1e-3);
    let ticks = layer_ticks(last as f64);
    svg("time", |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(layer_span(last as f64), 0.0..top * 1.35)?;
        chart
            .configure_mesh()
            .light_line_style(LIGHT)
            .x_desc("decoder layer")
            .y_desc("seconds")
            .x_label_formatter(&ticks)
            .draw()?;
        let with_load = run.reports_load();
        let stages: Vec<&str> = run.layers[0]
            .stages
            .named(with_load)
            .iter()
            .map(|(name, _)| *name)
            .collect();
        for (k, stage) in stages.iter().enumerate() {
            let c = colour(k);
            let bars = run.layers.iter().map(|l| {
                let named = l.stages.named(with_load);
                let below: f64 = named[..k].iter().map(|(_, s)| s).sum();
                let x = l.layer as f64;
                Rectangle::new(
                    [(x - 0.35, below), (x + 0.35, below + named[k].1)],
                    c.filled(),
                )
            });
            chart
                .draw_series(bars)?
                .label(*stage)
                .legend(move |(x, y)| Rectangle::new([(x - 5, y - 5), (x + 5, y + 5)], c.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
        Ok(())
    })
    .map(Some)
}

fn memory(run: &RunReport) -> Result<Option<String>, ReportError> {
    const GB: f64 = 1e9;
    let gb = |b: u64| b as f64 / GB;
    let series: Vec<(&str, Vec<(f64, f64)>)> = [
        (
            "peak RSS (host)",
            run.layers
                .iter()
                .filter_map(|l| Some((l.layer as f64, gb(l.peak_rss_bytes?))))
                .collect::<Vec<_>>(),
        ),
        (
            "device in use",
            run.layers
                .iter()
                .filter_map(|l| Some((l.layer as f64, gb(l.peak_device_memory?.in_use))))
                .collect(),
        ),
        (
            "device reserved",
            run.layers
                .iter()
                .filter_map(|l| Some((l.layer as f64, gb(l.peak_device_memory?.reserved))))
                .collect(),
        ),
    ]
    .into_iter()
    .filter(|(_, points)| !points.is_empty())
    .collect();
    if series.is_empty() {
        return Ok(None);
    }
    let last = run.layers.iter().map(|l| l.layer).max().unwrap_or(0);
    let top = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
        .fold(0f64, f64::max)
        .max(1e-3);
    let ticks = layer_ticks(last as f64);
    svg("memory", |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(layer_span(last as f64), 0.0..top * 1.25)?;
        chart
            .configure_mesh()
            .light_line_style(LIGHT)
            .x_desc("decoder layer (peak so far, at the layer's end)")
            .y_desc("GB")
            .x_label_formatter(&ticks)
            .y_label_formatter(&|v| format!("{v:.2}"))
            .draw()?;
        for (k, (label, points)) in series.iter().enumerate() {
            let c = colour(k);
            chart
                .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))?
                .label(*label)
                .legend(move |(x, y)| {
                    PathElement::new([(x - 8, y), (x + 8, y)], c.stroke_width(2))
                });
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
        Ok(())
    })
    .map(Some)
}

fn eval_chart(eval: &EvalResults) -> Result<String, ReportError> {
    let n = eval.buckets.len();
    let kl_top = eval
        .buckets
        .iter()
        .map(|b| b.metrics.kl_mean)
        .fold(0f64, f64::max)
        .max(1e-6);
    let lengths: Vec<String> = eval.buckets.iter().map(|b| b.length.to_string()).collect();
    svg("eval", |root| {
        let (left, right) = root.split_horizontally(SIZE.0 / 2);
        let label = |v: &f64| {
            let i = v.round();
            if (v - i).abs() < 1e-6 && i >= 0.0 {
                lengths.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        let mut kl = ChartBuilder::on(&left)
            .margin(10)
            .caption("mean KL (nats) per length", ("sans-serif", 16))
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(-0.6..n as f64 - 0.4, 0.0..kl_top * 1.2)?;
        kl.configure_mesh()
            .light_line_style(LIGHT)
            .x_desc("sequence length (tokens)")
            .x_labels(n.max(2) * 2 + 1)
            .x_label_formatter(&label)
            .y_label_formatter(&|v| format!("{v:.4}"))
            .disable_x_mesh()
            .draw()?;
        kl.draw_series(eval.buckets.iter().enumerate().map(|(i, b)| {
            Rectangle::new(
                [(i as f64 - 0.3, 0.0), (i as f64 + 0.3, b.metrics.kl_mean)],
                colour(0).filled(),
            )
        }))?;
        let lo = eval
            .buckets
            .iter()
            .map(|b| b.metrics.top1_agreement)
            .fold(1f64, f64::min);
        let floor = (lo - 0.05).clamp(0.0, 0.95);
        let mut top1 = ChartBuilder::on(&right)
            .margin(10)
            .caption("top-1 agreement per length", ("sans-serif", 16))
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(-0.6..n as f64 - 0.4, floor..1.0)?;
        top1.configure_mesh()
            .light_line_style(LIGHT)
            .x_desc("sequence length (tokens)")
            .x_labels(n.max(2) * 2 + 1)
            .x_label_formatter(&label)
            .y_label_formatter(&|v| format!("{v:.2}"))
            .disable_x_mesh()
            .draw()?;
        top1.draw_series(eval.buckets.iter().enumerate().map(|(i, b)| {
            Rectangle::new(
                [
                    (i as f64 - 0.3, floor),
                    (i as f64 + 0.3, b.metrics.top1_agreement),
                ],
                colour(2).filled(),
            )
        }))?;
        Ok(())
    })
}

/// Relative GLA state error against prefix length (log–log): one line per lightning layer and
/// text, diverse text in blue shades, repeated text in orange ones.
fn drift_chart(drift: &DriftResults) -> Result<Option<String>, ReportError> {
    let points = drift
        .values()
        .flatten()
        .flat_map(|l| l.points.iter().map(|p| (p.tokens as f64, p.state_rel)));
    let (xs, ys): (Vec<f64>, Vec<f64>) = points.unzip();
    let (Some(x), Some(y)) = (log_range(xs.iter().copied()), log_range(ys.iter().copied())) else {
        return Ok(None);
    };
    svg("drift", |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d((x.0..x.1).log_scale(), (y.0..y.1).log_scale())?;
        chart
            .configure_mesh()
            .light_line_style(LIGHT)
            .x_desc("prefix length (tokens)")
            .y_desc("relative state error")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v:.3}"))
            .draw()?;
        let shades = |text: &str, i: usize| -> RGBColor {
            let base = if text == "repeated" {
                [(230, 159, 0), (213, 94, 0), (240, 228, 66), (160, 90, 0)]
            } else {
                [(0, 114, 178), (86, 180, 233), (0, 158, 115), (0, 60, 120)]
            };
            let (r, g, b) = base[i % base.len()];
            RGBColor(r, g, b)
        };
        for (text, layers) in drift {
            for (i, layer) in layers.iter().enumerate() {
                let c = shades(text, i);
                let line = layer
                    .points
                    .iter()
                    .filter(|p| p.state_rel > 0.0)
                    .map(|p| (p.tokens as f64, p.state_rel));
                let style = if text == "repeated" {
                    c.stroke_width(2)
                } else {
                    c.stroke_width(1)
                };
                chart
                    .draw_series(LineSeries::new(line, style))?
                    .label(format!("{text}, layer {}", layer.layer))
                    .legend(move |(x, y)| PathElement::new([(x - 8, y), (x + 8, y)], style));
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
        Ok(())
    })
    .map(Some)
}
