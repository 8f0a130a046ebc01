//! A Rust project outside the workspace (`docs/external-project`) depends on `sala-gptq` by path,
//! builds, and quantizes the bundled fixture through the public API.

use std::path::Path;
use std::process::Command;

#[test]
fn an_external_project_builds_and_quantizes_through_the_public_api() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let project = root.join("docs/external-project");
    let out = tempfile::tempdir().unwrap();
    let output = out.path().join("tiny-sala-gptq");
    let result = Command::new(env!("CARGO"))
        .args(["run", "--quiet", "--manifest-path"])
        .arg(project.join("Cargo.toml"))
        .arg("--")
        .arg(root.join("fixtures/tiny-sala"))
        .arg(root.join("fixtures/calib/calib.jsonl"))
        .arg(&output)
        // Its own target directory: cargo's lock on the workspace's is held by this test run.
        .env("CARGO_TARGET_DIR", root.join("target/external-project"))
        .output()
        .expect("cargo runs");
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(stdout.contains("verified ok"), "{stdout}");
    assert!(output.join("quantize_config.json").is_file());
}
