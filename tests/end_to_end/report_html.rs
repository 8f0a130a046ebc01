//! The HTML report of a fixture run: `quantize_sala` on the trained tiny SALA writes
//! `quantization_report.html` next to `quantization_report.json`; the page parses as XML
//! (its inline SVG plots with it), names every quantized linear with the JSON's figures, and
//! links to nothing. `render_report` renders it again, and refuses bad inputs by name.

use clap::Parser;
use sala_quant::quantize_cli::{run, Args};
use std::collections::BTreeMap;
use std::path::Path;

/// Runs a small quantization of the trained fixture into `out`.
fn quantize(out: &Path, recipe: &str) {
    let fixture = sala_quant::fixtures_dir().join("tiny-sala-trained");
    let argv = [
        "quantize_sala",
        "--quiet",
        "--input",
        fixture.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--recipe",
        recipe,
        "--max-samples",
        "6",
        "--max-len",
        "96",
    ];
    run(Args::try_parse_from(argv).unwrap()).expect("the run succeeds");
}

/// Checks the page in `dir` against the JSON beside it.
fn check_page(dir: &Path) {
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("quantization_report.json")).unwrap(),
    )
    .unwrap();
    let html = std::fs::read_to_string(dir.join("quantization_report.html")).unwrap();
    let doc = roxmltree::Document::parse_with_options(
        &html,
        roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        },
    )
    .expect("the page is well-formed XML");

    // Self-contained: no script, no stylesheet link, no image or font from elsewhere.
    for node in doc.descendants().filter(|n| n.is_element()) {
        let tag = node.tag_name().name();
        assert!(
            !["script", "link", "img", "iframe"].contains(&tag),
            "<{tag}>"
        );
        for a in node.attributes() {
            assert!(
                !(a.value().contains("http://") || a.value().contains("https://"))
                    || a.value() == "http://www.w3.org/1999/xhtml"
                    || a.value() == "http://www.w3.org/2000/svg",
                "external reference {}={}",
                a.name(),
                a.value()
            );
        }
    }

    // The plots: inline SVG documents, each with drawn content and text.
    let svgs: Vec<_> = doc
        .descendants()
        .filter(|n| n.tag_name().name() == "svg")
        .collect();
    let figures: Vec<&str> = doc
        .descendants()
        .filter(|n| n.tag_name().name() == "figure")
        .filter_map(|n| n.attribute("id"))
        .collect();
    for id in ["plot-errors", "plot-ratio", "plot-time", "plot-memory"] {
        assert!(figures.contains(&id), "{id} missing: {figures:?}");
    }
    assert_eq!(svgs.len(), figures.len());
    for svg in &svgs {
        assert!(
            svg.descendants().any(|n| n.tag_name().name() == "text"),
            "a plot without any label"
        );
    }

    // Every quantized linear has its row, with the JSON's figures exactly.
    let rows: BTreeMap<&str, roxmltree::Node> = doc
        .descendants()
        .filter_map(|n| Some((n.attribute("data-linear")?, n)))
        .collect();
    let linears = json["report"]["linears"].as_array().unwrap();
    assert!(linears.len() > 20, "{} linears", linears.len());
    assert_eq!(rows.len(), linears.len());
    for l in linears {
        let name = l["name"].as_str().unwrap();
        let row = rows.get(name).unwrap_or_else(|| panic!("{name} missing"));
        let values: Vec<f64> = row
            .children()
            .filter_map(|c| c.attribute("data-value"))
            .map(|v| v.parse().unwrap())
            .collect();
        let json_values = [
            l["output_error"].as_f64().unwrap(),
            l["baseline_output_error"].as_f64().unwrap(),
        ];
        assert_eq!(values.len(), 2, "{name}");
        for (page, file) in values.iter().zip(json_values) {
            // The page carries the shortest text of each f64; serde_json's default parser
            // (without `float_roundtrip`) reads decimal text to within an ulp or so, so the
            // file's figure is compared at that precision.
            assert!(same_f64(*page, file), "{name}: {page} against {file}");
        }
        let text: String = row.descendants().filter_map(|n| n.text()).collect();
        assert!(text.contains(l["treatment"].as_str().unwrap()), "{name}");
    }

    // The run's facts: the verifier's verdict and the wall time as the JSON has them.
    let text: String = doc.descendants().filter_map(|n| n.text()).collect();
    let report = &json["report"];
    assert!(text.contains(report["verify_summary"].as_str().unwrap()));
    assert!(text.contains(&format!("{:.1} s", report["seconds"].as_f64().unwrap())));
    // The plan summary: a row per layer kind of the fixture.
    for kind in ["minicpm4", "lightning"] {
        assert!(
            doc.descendants()
                .filter(|n| n.tag_name().name() == "td")
                .any(|n| n.text() == Some(kind)),
            "plan row {kind}"
        );
    }
}

/// Equal to within the error of serde_json's default decimal parsing (a few ulps).
fn same_f64(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-14 * a.abs().max(b.abs())
}

/// The `data-value` figures of a page, in document order.
fn page_values(html: &str) -> Vec<f64> {
    let doc = roxmltree::Document::parse_with_options(
        html,
        roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        },
    )
    .unwrap();
    doc.descendants()
        .filter_map(|n| n.attribute("data-value"))
        .map(|v| v.parse().unwrap())
        .collect()
}

#[test]
fn a_gptq_run_writes_a_page_with_every_linear_and_the_jsons_figures() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gptq");
    quantize(&out, "gptq");
    check_page(&out);
    // Rendering again from the JSON gives the same page: the same text but for the last digits
    // of the full-precision figures (the command renders its in-memory values, render_report
    // the file's as serde_json reads them).
    let again = dir.path().join("again.html");
    sala_quant::render_report(
        &out.join("quantization_report.json"),
        None,
        None,
        Some(&again),
    )
    .unwrap();
    let (again, first) = (
        std::fs::read_to_string(&again).unwrap(),
        std::fs::read_to_string(out.join("quantization_report.html")).unwrap(),
    );
    let strip = |html: &str| -> String {
        html.split("data-value=\"")
            .enumerate()
            .map(|(i, part)| match i {
                0 => part,
                _ => part.split_once('"').map_or(part, |(_, rest)| rest),
            })
            .collect()
    };
    assert!(strip(&again) == strip(&first), "the pages differ");
    let (a, b) = (page_values(&again), page_values(&first));
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).all(|(x, y)| same_f64(*x, *y)));
}

#[test]
fn an_nvfp4_run_writes_a_page_too() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("nvfp4");
    quantize(&out, "nvfp4");
    check_page(&out);
}

#[test]
fn render_report_names_a_missing_or_wrong_input() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let err = sala_quant::render_report(&missing, None, None, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("nope.json"), "{err}");

    let wrong = dir.path().join("wrong.json");
    std::fs::write(&wrong, r#"{"report": {"recipe": "gptq"}}"#).unwrap();
    let err = sala_quant::render_report(&wrong, None, None, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("wrong.json"), "{err}");

    // A good report with a bad evaluation file: refused, naming the evaluation file, and
    // nothing written.
    let out = dir.path().join("page.html");
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/report-examples/gptq-w4a16.json");
    let eval = dir.path().join("eval.json");
    std::fs::write(&eval, "[1, 2]").unwrap();
    let err = sala_quant::render_report(&example, Some(&eval), None, Some(&out))
        .unwrap_err()
        .to_string();
    assert!(err.contains("eval.json"), "{err}");
    let drift = dir.path().join("drift.json");
    std::fs::write(&drift, "{}").unwrap();
    let err = sala_quant::render_report(&example, None, Some(&drift), Some(&out))
        .unwrap_err()
        .to_string();
    assert!(err.contains("drift.json"), "{err}");
    assert!(!out.exists());
}
