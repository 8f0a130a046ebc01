//! `sala-quant`: the root package of the workspace. It owns the thin example binaries under
//! `examples/` and the end-to-end tests; the libraries live in `crates/` (see the README).

use std::path::PathBuf;

pub mod allocator;
pub mod device;
pub mod forward_cli;
pub mod full_size;
pub mod panic_boundary;
pub mod quantize_cli;
pub mod synthetic_cli;

/// The repository's `fixtures/` directory (bundled tiny models, calibration and held-out text).
///
/// Resolved from the package's manifest directory at compile time, so examples run from any
/// working directory.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// `render_report`: reads `report` (quantization_report.json) and the optional `eval_quant` /
/// `drift` JSON files, renders the HTML report and writes it to `out` (default:
/// `quantization_report.html` next to `report`) through a temporary file and a rename, so a
/// reader never sees half a page. Every input is read and checked before anything is written;
/// each error names its file. Returns the page's path.
pub fn render_report(
    report: &std::path::Path,
    eval: Option<&std::path::Path>,
    drift: Option<&std::path::Path>,
    out: Option<&std::path::Path>,
) -> Result<PathBuf, Box<dyn std::error::Error>> {
    use std::io::Write;
    let inputs = sala_report_html::Inputs::load(report, eval, drift)?;
    let page = sala_report_html::render(&inputs)?;
    let out = match out {
        Some(path) => path.to_owned(),
        None => report
            .parent()
            .unwrap_or(std::path::Path::new("."))
            .join(sala_report_html::HTML_FILE),
    };
    let name = out
        .file_name()
        .ok_or_else(|| format!("{}: not a file name", out.display()))?;
    let tmp = out.with_file_name(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(page.as_bytes())?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, &out)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("{}: {e}", out.display()).into());
    }
    Ok(out)
}
