//! The committed example reports (`docs/report-examples/`: the trained tiny SALA quantized with
//! both recipes, with `eval_quant` and `drift` results) render into pages that parse as XML,
//! whose every plot is an SVG document, that hold every linear with the JSON's figures and the
//! evaluation's and drift's tables.

use sala_report_html::{charts, drift_from_file, render, EvalResults, Inputs, QuantizationReport};
use std::path::{Path, PathBuf};

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/report-examples")
}

fn inputs(name: &str) -> (Inputs, serde_json::Value) {
    let dir = examples();
    let report = dir.join(format!("{name}.json"));
    let json = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let inputs = Inputs {
        report: QuantizationReport::from_file(&report).unwrap(),
        eval: Some(EvalResults::from_file(&dir.join(format!("{name}.eval.json"))).unwrap()),
        drift: Some(drift_from_file(&dir.join(format!("{name}.drift.json"))).unwrap()),
    };
    (inputs, json)
}

fn parse(xml: &str) -> roxmltree::Document<'_> {
    roxmltree::Document::parse_with_options(
        xml,
        roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("not well-formed: {e}"))
}

fn text_of(node: roxmltree::Node) -> String {
    node.descendants().filter_map(|n| n.text()).collect()
}

fn check(name: &str) {
    let (inputs, json) = inputs(name);
    let html = render(&inputs).unwrap();
    let doc = parse(&html);

    // Each plot on its own is an SVG document with text (axis labels, legends).
    let run = &inputs.report.report;
    let plots = charts::draw_all(
        run,
        inputs.report.plan.as_ref(),
        inputs.eval.as_ref(),
        inputs.drift.as_ref(),
    )
    .unwrap();
    let all = [
        &plots.errors,
        &plots.ratio,
        &plots.smoothing,
        &plots.retries,
        &plots.time,
        &plots.memory,
        &plots.eval,
        &plots.drift,
    ];
    // The examples had no damping retry: that plot is left out (the page says so).
    assert!(plots.retries.is_none());
    let drawn: Vec<&Option<String>> = all.into_iter().filter(|p| p.is_some()).collect();
    assert_eq!(drawn.len(), all.len() - 1);
    for svg in &drawn {
        let svg = svg.as_deref().unwrap();
        let plot = parse(svg);
        assert_eq!(plot.root_element().tag_name().name(), "svg");
        assert!(plot.descendants().any(|n| n.tag_name().name() == "text"));
    }
    let svgs = doc
        .descendants()
        .filter(|n| n.tag_name().name() == "svg")
        .count();
    assert_eq!(svgs, drawn.len());

    // Every linear, with the JSON's numbers.
    let linears = json["report"]["linears"].as_array().unwrap();
    let rows: Vec<roxmltree::Node> = doc
        .descendants()
        .filter(|n| n.attribute("data-linear").is_some())
        .collect();
    assert_eq!(rows.len(), linears.len());
    for (row, l) in rows.iter().zip(linears) {
        assert_eq!(row.attribute("data-linear"), l["name"].as_str());
        let values: Vec<f64> = row
            .children()
            .filter_map(|c| c.attribute("data-value"))
            .map(|v| v.parse().unwrap())
            .collect();
        assert_eq!(
            values,
            [
                l["output_error"].as_f64().unwrap(),
                l["baseline_output_error"].as_f64().unwrap()
            ]
        );
    }

    // The evaluation: a row per length bucket and one for all positions, KL as in the JSON.
    let eval = inputs.eval.as_ref().unwrap();
    let table = doc
        .descendants()
        .find(|n| n.attribute("class") == Some("eval"))
        .expect("the evaluation table");
    let eval_rows: Vec<String> = table
        .children()
        .filter(|n| n.tag_name().name() == "tr")
        .skip(1)
        .map(text_of)
        .collect();
    assert_eq!(eval_rows.len(), eval.buckets.len() + 1);
    for (row, b) in eval_rows.iter().zip(&eval.buckets) {
        assert!(row.starts_with(&b.length.to_string()), "{row}");
        assert!(row.contains(&format!("{:.4}", b.metrics.kl_mean)), "{row}");
        assert!(
            row.contains(&format!("{:.4}", b.metrics.top1_agreement)),
            "{row}"
        );
    }
    // The drift: a row per text and lightning layer.
    let drift = inputs.drift.as_ref().unwrap();
    let drift_rows = doc
        .descendants()
        .find(|n| n.attribute("class") == Some("drift"))
        .expect("the drift table")
        .children()
        .filter(|n| n.tag_name().name() == "tr")
        .count();
    assert_eq!(drift_rows - 1, drift.values().map(Vec::len).sum::<usize>());

    // Self-contained: nothing to fetch.
    assert!(!html.contains("<script"));
    assert!(!html.contains("<link"));
    assert!(!html.contains("src=\""));
}

#[test]
fn the_gptq_example_renders_with_every_linear_and_its_evaluation() {
    check("gptq-w4a16");
}

#[test]
fn the_nvfp4_example_renders_with_every_linear_and_its_evaluation() {
    check("nvfp4");
}

#[test]
fn the_committed_pages_are_what_the_renderer_makes_of_the_committed_json() {
    for name in ["gptq-w4a16", "nvfp4"] {
        let (inputs, _) = inputs(name);
        let committed = std::fs::read_to_string(examples().join(format!("{name}.html"))).unwrap();
        assert!(
            committed == render(&inputs).unwrap(),
            "docs/report-examples/{name}.html is stale: render it again (docs/report.md)"
        );
    }
}

#[test]
fn bad_inputs_are_errors_that_name_the_file() {
    let dir = std::env::temp_dir().join(format!("sala-report-html-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.json");
    let err = QuantizationReport::from_file(&missing)
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing.json"), "{err}");
    let eval = dir.join("eval.json");
    std::fs::write(&eval, r#"{"buckets": 3}"#).unwrap();
    let err = EvalResults::from_file(&eval).unwrap_err().to_string();
    assert!(err.contains("eval.json"), "{err}");
    let drift = dir.join("drift.json");
    std::fs::write(&drift, r#"{"diverse": []}"#).unwrap();
    let err = drift_from_file(&drift).unwrap_err().to_string();
    assert!(
        err.contains("drift.json") && err.contains("drift --json"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The page of `inputs` with its report replaced by `json`, read back from a file (as the
/// binary reads it) in a temporary folder named after `tag`.
fn render_with_report(inputs: &mut Inputs, json: &serde_json::Value, tag: &str) -> String {
    let dir = std::env::temp_dir().join(format!("sala-report-html-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("report.json");
    std::fs::write(&path, serde_json::to_string(json).unwrap()).unwrap();
    inputs.report = QuantizationReport::from_file(&path).unwrap();
    let page = render(inputs).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    page
}

#[test]
fn each_group_s_alpha_is_on_the_page() {
    let (mut inputs, mut json) = inputs("gptq-w4a16");
    let linears = json["report"]["linears"].as_array_mut().unwrap();
    let mut smoothed = 0;
    for l in linears.iter_mut() {
        if !l["smooth_scale_range"].is_null() {
            l["smooth_alpha"] = serde_json::json!(0.2);
            smoothed += 1;
        }
    }
    assert!(smoothed > 0, "the example smooths nothing");
    let page = render_with_report(&mut inputs, &json, "alpha");
    assert!(
        page.contains("Smoothing α by group: 0.20 ("),
        "no α summary"
    );
    assert!(page.contains("α 0.20: "), "no α in the linears' table");
}

#[test]
fn the_solve_steps_are_summed_on_the_page_when_the_report_has_them() {
    let (mut inputs, mut json) = inputs("gptq-w4a16");
    assert!(
        !render(&inputs).unwrap().contains("solve steps"),
        "an older report has none"
    );
    let linears = json["report"]["linears"].as_array_mut().unwrap();
    for l in linears.iter_mut() {
        l["solve_steps"] = serde_json::json!({"solve": 0.5, "solver: column loop": 0.25});
    }
    let n = linears.len() as f64;
    let page = render_with_report(&mut inputs, &json, "steps");
    let expected = format!(
        "solve {:.1} s, solver: column loop {:.1} s",
        0.5 * n,
        0.25 * n
    );
    assert!(page.contains(&expected), "no '{expected}' on the page");
}

#[test]
fn a_run_that_mixes_full_and_diagonal_errors_says_so() {
    let (mut inputs, mut json) = inputs("nvfp4");
    let said = |page: &str| page.contains("that GPTQ solved are on the full Hessian");
    assert!(
        !said(&render(&inputs).unwrap()),
        "an older report has no kinds"
    );
    let linears = json["report"]["linears"].as_array_mut().unwrap();
    for l in linears.iter_mut() {
        l["error_hessian"] = serde_json::json!("diagonal");
    }
    let page = render_with_report(&mut inputs, &json, "one-kind");
    assert!(!said(&page), "one kind needs no sentence");
    let linears = json["report"]["linears"].as_array_mut().unwrap();
    let mut full = 0;
    for l in linears.iter_mut() {
        if !l["name"].as_str().unwrap().ends_with("down_proj") {
            l["error_hessian"] = serde_json::json!("full");
            full += 1;
        }
    }
    let diagonal = linears.len() - full;
    assert!(full > 0 && diagonal > 0);
    let page = render_with_report(&mut inputs, &json, "mixed");
    let expected = format!(
        "The errors of the {full} linears that GPTQ solved are on the full Hessian, those of \
         the {diagonal} that the block search solved"
    );
    assert!(page.contains(&expected), "no '{expected}' on the page");
}

#[test]
fn the_load_stage_is_a_column_when_the_report_has_it() {
    let (mut inputs, mut json) = inputs("gptq-w4a16");
    let header = "<th>load s</th>";
    assert!(
        !render(&inputs).unwrap().contains(header),
        "an older report has no load stage"
    );
    let layers = json["report"]["layers"].as_array_mut().unwrap();
    for l in layers.iter_mut() {
        l["load"] = serde_json::json!(0.25);
        l["capture"] = serde_json::json!(1.0);
        for stage in [
            "accumulate",
            "finalize",
            "smooth",
            "solve",
            "propagate",
            "write",
        ] {
            l[stage] = serde_json::json!(0.0);
        }
    }
    let page = render_with_report(&mut inputs, &json, "load");
    assert!(page.contains(header), "no load column");
    // Each layer's row: load, capture, five zero stages, then the total with the load in it.
    let row = "<td class=\"n\">0.25</td><td class=\"n\">1.00</td>";
    assert!(page.contains(row), "no load cell before capture");
    assert!(
        page.contains("<td class=\"n\">0.00</td><td class=\"n\">1.25</td>"),
        "the total lacks the load"
    );
}
