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
        // The workspace's target directory (cargo releases its lock before it runs the test
        // binaries): the dependencies this run's tests were built with are reused, where a
        // directory of its own cost a second cold build of all of them (about 7 minutes on
        // CI's 2 cores).
        .env("CARGO_TARGET_DIR", root.join("target"))
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
