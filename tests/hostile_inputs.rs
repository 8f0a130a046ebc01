//! Hostile and faulty inputs against `quantize_sala`, each run as a real child process: the
//! test binary re-executes itself as the command (`SALA_HOSTILE_CHILD` set: its `main` is the
//! command's), so exit statuses, signals, closed streams and leftover files are what a user
//! would see.
//!
//! Every case asserts the exit status, an error that names the file, tensor, line or option at
//! fault, no panic, that a previous output (where there is one) is intact, and that no staging
//! directory, lock file or moved-aside output is left next to the output.
//!
//! `cargo test --test hostile_inputs [FILTER]` runs the cases whose name contains FILTER.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Set in the environment of a child: run the command instead of the cases.
const CHILD: &str = "SALA_HOSTILE_CHILD";

fn main() -> ExitCode {
    if std::env::var_os(CHILD).is_some() {
        return sala_quant::quantize_cli::main(std::env::args_os());
    }
    run_cases()
}

// ------------------------------------------------------------------------------------------
// The runner: every case in a worker thread (two at a time), a panic is a failure.

type Case = (&'static str, fn());

fn run_cases() -> ExitCode {
    // Cargo passes libtest flags (`--quiet`, `--test-threads`…); the first plain word filters.
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let cases: Vec<Case> = CASES
        .iter()
        .copied()
        .filter(|(name, _)| filter.as_ref().is_none_or(|f| name.contains(f.as_str())))
        .collect();
    println!("running {} hostile-input cases", cases.len());
    // A failed case's message is printed below, with the case's name.
    std::panic::set_hook(Box::new(|_| {}));
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(&(name, case)) = cases.get(i) else {
                    break;
                };
                let t = Instant::now();
                let result = std::panic::catch_unwind(case);
                let secs = t.elapsed().as_secs_f64();
                match result {
                    Ok(()) => println!("case {name} ... ok ({secs:.1} s)"),
                    Err(panic) => {
                        let message = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        println!("case {name} ... FAILED ({secs:.1} s)");
                        failures.lock().unwrap().push((name, message));
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    for (name, message) in &failures {
        println!("\n---- {name} ----\n{message}");
    }
    println!(
        "\nhostile inputs: {} passed, {} failed in {:.0} s",
        cases.len() - failures.len(),
        failures.len(),
        started.elapsed().as_secs_f64()
    );
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

// ------------------------------------------------------------------------------------------
// Running the command.

/// What a child run left.
struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "status {:?}\n--- stdout (tail) ---\n{}\n--- stderr ---\n{}",
            self.status,
            tail(&self.stdout),
            self.stderr
        )
    }
}

fn tail(text: &str) -> &str {
    let start = text.len().saturating_sub(2000);
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    &text[start..]
}

/// The command, as a child process of this binary, in `cwd`.
fn command(args: &[OsString], cwd: &Path) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("own executable"));
    cmd.env(CHILD, "1")
        .env_remove("RUST_BACKTRACE")
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null());
    cmd
}

/// Runs `cmd` with stdout and stderr in files of `dir` (no pipe can fill up), killing it after
/// `limit`.
fn finish(mut cmd: Command, dir: &Path, limit: Duration) -> Run {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let out_path = dir.join(format!("stdout-{n}.txt"));
    let err_path = dir.join(format!("stderr-{n}.txt"));
    cmd.stdout(fs::File::create(&out_path).unwrap())
        .stderr(fs::File::create(&err_path).unwrap());
    let mut child = cmd.spawn().expect("the child starts");
    let status = wait(&mut child, limit);
    let run = Run {
        status,
        stdout: fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: fs::read_to_string(&err_path).unwrap_or_default(),
    };
    let _ = fs::remove_file(out_path);
    let _ = fs::remove_file(err_path);
    run
}

fn wait(child: &mut std::process::Child, limit: Duration) -> ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("the command ran longer than {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

// ------------------------------------------------------------------------------------------
// Fixtures: a private copy of the tiny model, a small calibration file, an output path.

/// One case's files, removed at the end.
struct Env {
    root: tempfile::TempDir,
}

impl Env {
    fn new() -> Self {
        Self {
            root: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.root.path().join(name)
    }

    /// The output path (`<root>/out`).
    fn out(&self) -> PathBuf {
        self.path("out")
    }

    /// A copy of `fixtures/tiny-sala` in `<root>/model` (made on first use).
    fn model(&self) -> PathBuf {
        let model = self.path("model");
        if !model.exists() {
            copy_dir(&sala_quant::fixtures_dir().join("tiny-sala"), &model);
        }
        model
    }

    /// A two-record calibration file `<root>/calib.jsonl` (made on first use).
    fn calib(&self) -> PathBuf {
        let calib = self.path("calib.jsonl");
        if !calib.exists() {
            fs::write(
                &calib,
                "{\"text\": \"The quick brown fox jumps over the lazy dog.\"}\n\
                 {\"question\": \"What is the rubbish outside a fort for?\"}\n",
            )
            .unwrap();
        }
        calib
    }

    /// The usual flags: the private model and calibration, one short sample, one thread, the
    /// output `<root>/out`; then `extra` (which replaces a usual flag it repeats).
    fn args(&self, extra: &[&str]) -> Vec<OsString> {
        let defaults: [(&str, OsString); 6] = [
            ("--input", self.model().into()),
            ("--calib-data", self.calib().into()),
            ("--output", self.out().into()),
            ("--max-samples", "1".into()),
            ("--max-len", "16".into()),
            ("--threads", "1".into()),
        ];
        let mut args: Vec<OsString> = vec!["--quiet".into()];
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                args.push(flag.into());
                args.push(value);
            }
        }
        args.extend(os(extra));
        args
    }

    /// Runs the command with [`Env::args`] and `extra`, in the case's directory.
    fn quantize(&self, extra: &[&str]) -> Run {
        self.run_args(&self.args(extra))
    }

    /// Runs the command with exactly `args`, in the case's directory.
    fn run_args(&self, args: &[OsString]) -> Run {
        let cmd = command(args, self.root.path());
        finish(cmd, self.root.path(), Duration::from_secs(240))
    }

    /// A directory that passes for a previous checkpoint of this tool at `<root>/out`, with
    /// its contents.
    fn previous_output(&self) -> Snapshot {
        let out = self.out();
        fs::create_dir_all(&out).unwrap();
        fs::write(out.join("quantization_report.json"), "{\"report\": {}}").unwrap();
        fs::write(out.join("config.json"), "{\"quantization_config\": {}}").unwrap();
        fs::write(out.join("model.safetensors"), b"previous weights").unwrap();
        Snapshot::of(&out)
    }
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Every file under a directory with its bytes.
#[derive(Debug, PartialEq)]
struct Snapshot(BTreeMap<PathBuf, Vec<u8>>);

impl Snapshot {
    fn of(dir: &Path) -> Self {
        let mut files = BTreeMap::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for entry in fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else {
                    let rel = path.strip_prefix(dir).unwrap().to_path_buf();
                    files.insert(rel, fs::read(&path).unwrap());
                }
            }
        }
        Snapshot(files)
    }

    fn assert_intact(&self, dir: &Path) {
        let now = Snapshot::of(dir);
        let names = |s: &Snapshot| s.0.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&now), names(self), "{} changed", dir.display());
        assert!(*self == now, "{}: a file's content changed", dir.display());
    }
}

// ------------------------------------------------------------------------------------------
// Assertions.

/// No panic, exit status 1, `error: …` on stderr naming every needle.
fn assert_refused(run: &Run, needles: &[&str]) {
    assert_no_panic(run);
    assert_eq!(
        run.status.code(),
        Some(1),
        "expected exit status 1: {run:?}"
    );
    assert!(run.stderr.contains("error: "), "no error line: {run:?}");
    for needle in needles {
        assert!(
            run.stderr.contains(needle),
            "the error lacks {needle:?}: {run:?}"
        );
    }
}

fn assert_no_panic(run: &Run) {
    assert!(
        !run.stderr.contains("panicked") && !run.stderr.contains("RUST_BACKTRACE"),
        "a panic: {run:?}"
    );
    assert_ne!(run.status.code(), Some(101), "a panic: {run:?}");
}

fn assert_ok(run: &Run) {
    assert_no_panic(run);
    assert!(run.status.success(), "expected success: {run:?}");
}

/// Nothing next to `out` but `out` itself (if present) and what `keep` names.
fn assert_no_debris(out: &Path) {
    let parent = out.parent().unwrap();
    let debris: Vec<String> = fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".partial-") || n.contains(".replaced-") || n.ends_with(".lock"))
        .collect();
    assert!(debris.is_empty(), "left next to the output: {debris:?}");
}

/// The output was not written (and nothing else next to it).
fn assert_nothing_written(out: &Path) {
    assert!(!out.exists(), "{} was written", out.display());
    assert_no_debris(out);
}

// ------------------------------------------------------------------------------------------
// Editing model files.

/// Overwrites element `index` of tensor `tensor` in the shard `file` with `bytes`.
fn poke(file: &Path, tensor: &str, index: usize, bytes: &[u8]) {
    let mut data = fs::read(file).unwrap();
    let (header_len, metadata) = safetensors::SafeTensors::read_metadata(&data).unwrap();
    let info = metadata.info(tensor).expect("tensor in the shard");
    let elem = info.dtype.bitsize() / 8;
    assert_eq!(elem, bytes.len(), "{tensor}: {:?}", info.dtype);
    let at = 8 + header_len + info.data_offsets.0 + index * elem;
    data[at..at + elem].copy_from_slice(bytes);
    fs::write(file, data).unwrap();
}

const BF16_NAN: [u8; 2] = [0xc0, 0x7f];
const BF16_INF: [u8; 2] = [0x80, 0x7f];

// ------------------------------------------------------------------------------------------
// Class 3: NaN / Inf in tensors copied rather than quantized.

fn nan_in_copied_tensor(tensor: &str, index: usize, value: [u8; 2], extra: &[&str]) {
    let env = Env::new();
    let model = env.model();
    poke(&model.join("model.safetensors"), tensor, index, &value);
    let previous = env.previous_output();
    let mut flags = vec!["--overwrite"];
    flags.extend_from_slice(extra);
    let run = env.quantize(&flags);
    assert_refused(&run, &[tensor, "model.safetensors", "non-finite"]);
    previous.assert_intact(&env.out());
    assert_no_debris(&env.out());
}

fn nan_in_the_embedding() {
    nan_in_copied_tensor("model.embed_tokens.weight", 5 * 256 + 7, BF16_NAN, &[]);
}

fn inf_in_the_final_norm() {
    nan_in_copied_tensor("model.norm.weight", 3, BF16_INF, &[]);
}

fn nan_in_lm_head() {
    nan_in_copied_tensor("lm_head.weight", 2047 * 256, BF16_NAN, &[]);
}

fn nan_in_a_layer_norm() {
    nan_in_copied_tensor(
        "model.layers.6.post_attention_layernorm.weight",
        0,
        BF16_NAN,
        &[],
    );
}

fn nan_in_a_linear_kept_in_16_bits() {
    nan_in_copied_tensor(
        "model.layers.4.mlp.down_proj.weight",
        77,
        BF16_INF,
        &["--exclude", "model.layers.4.mlp"],
    );
}

/// The same NaN in a quantized linear is refused too (as it was), naming the tensor.
fn nan_in_a_quantized_linear() {
    let env = Env::new();
    let tensor = "model.layers.2.mlp.up_proj.weight";
    poke(&env.model().join("model.safetensors"), tensor, 9, &BF16_NAN);
    let run = env.quantize(&[]);
    assert_refused(&run, &[tensor]);
    assert_nothing_written(&env.out());
}

/// A good run, for reference: exit 0, a verified checkpoint with its report, nothing else.
fn a_good_run_commits_a_verified_checkpoint_with_its_report() {
    let env = Env::new();
    let run = env.quantize(&[]);
    assert_ok(&run);
    let out = env.out();
    assert!(out.join("quantization_report.json").is_file(), "{run:?}");
    assert!(out.join("quantization_report.html").is_file(), "{run:?}");
    assert!(sala_export::verify(&out).unwrap().is_ok());
    assert_no_debris(&out);
}

// ------------------------------------------------------------------------------------------
// Class 4: crashes instead of errors.

/// Standard output closed (a pipe whose reader is gone) before the run: refused before any
/// compute, nothing written.
fn stdout_closed_before_the_run() {
    let env = Env::new();
    let mut args = env.args(&[]);
    args.retain(|a| a != "--quiet");
    let mut cmd = command(&args, env.root.path());
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    drop(child.stdout.take());
    let status = wait(&mut child, Duration::from_secs(120));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let run = Run {
        status,
        stdout: String::new(),
        stderr,
    };
    assert_refused(&run, &["standard output"]);
    assert_nothing_written(&env.out());
}

/// Standard output full after a `--quiet` run: the checkpoint is committed and verified, the
/// run succeeds with a warning.
fn stdout_full_after_the_commit_is_a_warning() {
    let env = Env::new();
    let mut cmd = command(&env.args(&[]), env.root.path());
    cmd.stdout(
        fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap(),
    );
    let err_path = env.path("stderr.txt");
    cmd.stderr(fs::File::create(&err_path).unwrap());
    let mut child = cmd.spawn().unwrap();
    let run = Run {
        status: wait(&mut child, Duration::from_secs(240)),
        stdout: String::new(),
        stderr: fs::read_to_string(&err_path).unwrap(),
    };
    assert_ok(&run);
    assert!(
        run.stderr
            .contains("warning: cannot write to standard output"),
        "{run:?}"
    );
    assert!(run.stderr.contains("complete and verified"), "{run:?}");
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert!(env.out().join("quantization_report.json").is_file());
    assert_no_debris(&env.out());
}

/// `--plan-only` prints the plan and nothing else: a full standard output is an error.
fn plan_only_to_a_full_stdout() {
    let env = Env::new();
    let mut cmd = command(&env.args(&["--plan-only"]), env.root.path());
    cmd.stdout(
        fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap(),
    );
    let err_path = env.path("stderr.txt");
    cmd.stderr(fs::File::create(&err_path).unwrap());
    let mut child = cmd.spawn().unwrap();
    let run = Run {
        status: wait(&mut child, Duration::from_secs(60)),
        stdout: String::new(),
        stderr: fs::read_to_string(&err_path).unwrap(),
    };
    assert_refused(&run, &["standard output"]);
    assert_nothing_written(&env.out());
}

/// Edits the model's `config.json`.
fn edit_config(env: &Env, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let path = env.model().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    fs::write(&path, config.to_string()).unwrap();
    path
}

fn config_overflow(field: &str, value: u64, needles: &[&str]) {
    for plan_only in [false, true] {
        let env = Env::new();
        edit_config(&env, |c| c[field] = value.into());
        let run = env.quantize(if plan_only { &["--plan-only"] } else { &[] });
        let mut all = vec!["config.json", field];
        all.extend_from_slice(needles);
        assert_refused(&run, &all);
        assert_nothing_written(&env.out());
    }
}

fn config_vocab_times_hidden_overflows() {
    config_overflow("vocab_size", 1 << 62, &["overflows"]);
}

fn config_intermediate_times_hidden_overflows() {
    config_overflow("intermediate_size", u64::MAX, &["overflows"]);
}

fn config_heads_times_head_dim_overflows() {
    config_overflow("head_dim", 1 << 62, &["overflows"]);
}

fn config_absurd_layer_count() {
    config_overflow("num_hidden_layers", u64::MAX, &[]);
}

fn config_dimension_beyond_usize() {
    // 2^64 does not fit the field at all: serde names the field and the position.
    let env = Env::new();
    let path = env.model().join("config.json");
    let text = fs::read_to_string(&path).unwrap();
    let text = text.replace(
        "\"hidden_size\": 256",
        "\"hidden_size\": 18446744073709551616",
    );
    fs::write(&path, text).unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["config.json", "line"]);
    assert_nothing_written(&env.out());
}

fn huge_max_samples() {
    for n in ["18446744073709551615", "2000000"] {
        let env = Env::new();
        let run = env.quantize(&["--max-samples", n]);
        assert_refused(&run, &["--max-samples", n]);
        assert_nothing_written(&env.out());
    }
}

/// A huge `--max-len` only bounds the samples; it must not crash the tokenizer.
fn huge_max_len_is_harmless() {
    let env = Env::new();
    let run = env.quantize(&["--max-len", "18446744073709551615"]);
    assert_ok(&run);
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
}

/// `/dev/zero` as the calibration file: one endless line, refused after the line bound.
fn dev_zero_as_calibration() {
    let env = Env::new();
    let started = Instant::now();
    let mut args = env.args(&[]);
    let at = args.iter().position(|a| a == "--calib-data").unwrap();
    args[at + 1] = "/dev/zero".into();
    let run = env.run_args(&args);
    assert_refused(&run, &["/dev/zero:1:", "longer than"]);
    assert!(started.elapsed() < Duration::from_secs(60), "too slow");
    assert_nothing_written(&env.out());
}

fn a_calibration_line_beyond_the_bound() {
    let env = Env::new();
    let huge = format!("{{\"text\": \"{}\"}}\n", "word ".repeat(4 << 20));
    let mut text = String::from("{\"text\": \"fine\"}\n");
    text.push_str(&huge);
    fs::write(env.calib(), text).unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["calib.jsonl:2:", "longer than"]);
    assert_nothing_written(&env.out());
}

fn max_memory_options_that_overflow() {
    for option in ["--max-host-memory", "--max-device-memory"] {
        let env = Env::new();
        let run = env.quantize(&[option, "18446744073709551615"]);
        assert_refused(&run, &[option]);
        assert_nothing_written(&env.out());
    }
}

// ------------------------------------------------------------------------------------------
// Class 7: symbolic links out of the model directory.

/// Replaces `model/name` by a link to a copy of it in `<root>/elsewhere/`.
fn link_out(env: &Env, name: &str) -> PathBuf {
    let elsewhere = env.path("elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    let inside = env.model().join(name);
    let outside = elsewhere.join(name);
    fs::rename(&inside, &outside).unwrap();
    std::os::unix::fs::symlink(&outside, &inside).unwrap();
    outside
}

fn side_file_linked_out(name: &str) {
    let env = Env::new();
    let model = env.model();
    if !model.join(name).exists() {
        fs::write(model.join(name), "# remote code\n").unwrap();
    }
    link_out(&env, name);
    let previous = env.previous_output();
    let run = env.quantize(&["--overwrite"]);
    assert_refused(&run, &[name, "outside the model directory"]);
    previous.assert_intact(&env.out());
    assert_no_debris(&env.out());
}

fn generation_config_linked_out_of_the_model() {
    side_file_linked_out("generation_config.json");
}

fn python_file_linked_out_of_the_model() {
    side_file_linked_out("modeling_minicpm_sala.py");
}

fn tokenizer_config_linked_out_of_the_model() {
    side_file_linked_out("tokenizer_config.json");
}

fn weights_linked_out_of_the_model() {
    let env = Env::new();
    link_out(&env, "model.safetensors");
    let run = env.quantize(&[]);
    assert_refused(&run, &["model.safetensors", "outside the model directory"]);
    assert_nothing_written(&env.out());
}

/// Writes an index that puts every tensor in `file`.
fn write_index(model: &Path, file: &str) {
    let data = fs::read(sala_quant::fixtures_dir().join("tiny-sala/model.safetensors")).unwrap();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&data).unwrap();
    let map: serde_json::Map<String, serde_json::Value> = metadata
        .tensors()
        .keys()
        .map(|k| (k.clone(), file.into()))
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    fs::write(
        model.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
}

fn shard_through_a_linked_subdirectory() {
    let env = Env::new();
    let model = env.model();
    let elsewhere = env.path("elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    fs::rename(
        model.join("model.safetensors"),
        elsewhere.join("w.safetensors"),
    )
    .unwrap();
    std::os::unix::fs::symlink(&elsewhere, model.join("sub")).unwrap();
    write_index(&model, "sub/w.safetensors");
    let run = env.quantize(&[]);
    assert_refused(&run, &["sub/w.safetensors", "outside the model directory"]);
    assert_nothing_written(&env.out());
}

fn index_with_a_path_out_of_the_model() {
    let env = Env::new();
    let model = env.model();
    write_index(&model, "../model/model.safetensors");
    let run = env.quantize(&[]);
    assert_refused(
        &run,
        &["model.safetensors.index.json", "../model/model.safetensors"],
    );
    assert_nothing_written(&env.out());
}

/// A Hugging Face hub snapshot links every file to `../../blobs/`: accepted.
fn hugging_face_cache_layout_is_accepted() {
    let env = Env::new();
    let repo = env.path("hub/models--org--tiny");
    let blobs = repo.join("blobs");
    let snapshot = repo.join("snapshots/0123abcd");
    copy_dir(&sala_quant::fixtures_dir().join("tiny-sala"), &blobs);
    fs::create_dir_all(&snapshot).unwrap();
    for entry in fs::read_dir(&blobs).unwrap() {
        let name = entry.unwrap().file_name();
        let target = Path::new("../../blobs").join(&name);
        std::os::unix::fs::symlink(target, snapshot.join(&name)).unwrap();
    }
    let mut args = env.args(&[]);
    let at = args.iter().position(|a| a == "--input").unwrap();
    args[at + 1] = snapshot.into();
    let run = env.run_args(&args);
    assert_ok(&run);
    assert!(env.out().join("tokenizer.json").is_file());
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
}

// ------------------------------------------------------------------------------------------
// Classes 8 and 9: silently accepted, unclear errors.

/// Rewrites the model's weights with one more tensor `name` (bf16, `len` values).
fn add_tensor(env: &Env, name: &str, len: usize) {
    let path = env.model().join("model.safetensors");
    let data = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    let extra = vec![0u8; 2 * len];
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    views.push((
        name.to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![len], &extra).unwrap(),
    ));
    let bytes = safetensors::serialize(views, None).unwrap();
    fs::write(&path, bytes).unwrap();
}

fn an_extra_bias_would_be_dropped() {
    let env = Env::new();
    add_tensor(&env, "model.layers.3.self_attn.q_proj.bias", 256);
    let run = env.quantize(&[]);
    assert_refused(
        &run,
        &["model.layers.3.self_attn.q_proj.bias", "would be dropped"],
    );
    assert_nothing_written(&env.out());
}

fn a_tensor_of_a_layer_beyond_the_config() {
    let env = Env::new();
    add_tensor(&env, "model.layers.8.input_layernorm.weight", 256);
    let run = env.quantize(&[]);
    assert_refused(&run, &["model.layers.8.input_layernorm.weight", "no place"]);
    assert_nothing_written(&env.out());
}

/// A rotary buffer older checkpoints carry is dropped with a warning: the loaders rebuild it.
fn a_rotary_buffer_is_dropped_with_a_warning() {
    let env = Env::new();
    let name = "model.layers.1.self_attn.rotary_emb.inv_freq";
    add_tensor(&env, name, 32);
    let run = env.quantize(&[]);
    assert_ok(&run);
    assert!(run.stderr.contains(&format!("warning: {name}")), "{run:?}");
    let ck = sala_export::Checkpoint::open(env.out()).unwrap();
    assert!(!ck.contains(name));
}

fn duplicate_layer_bits() {
    let env = Env::new();
    let run = env.quantize(&["--layer-bits", "3:4,3:8"]);
    assert_refused(&run, &["--layer-bits", "3", "twice"]);
    assert_nothing_written(&env.out());
}

/// `--max-host-memory 0` keeps the hidden states in a file (its blocks reserved up front).
fn hidden_states_in_a_file() {
    let env = Env::new();
    let run = env.quantize(&["--max-host-memory", "0"]);
    assert_ok(&run);
    assert!(
        run.stderr
            .contains("hidden states: 0.0 MB in a memory-mapped file"),
        "{run:?}"
    );
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert_no_debris(&env.out());
}

fn a_zero_token_sample_names_its_line() {
    let env = Env::new();
    let model = env.model();
    let path = model.join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    config["chat_template"] = "{% for m in messages %}{% endfor %}".into();
    fs::write(&path, config.to_string()).unwrap();
    fs::write(
        env.calib(),
        "{\"text\": \"fine\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
    )
    .unwrap();
    let run = env.quantize(&["--max-samples", "2"]);
    assert_refused(&run, &["calib.jsonl:2:", "0 tokens"]);
    assert_nothing_written(&env.out());
}

fn a_token_id_outside_the_vocabulary_names_its_line() {
    let env = Env::new();
    let path = env.model().join("tokenizer.json");
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    tokenizer["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": 5000, "content": "<huge>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    fs::write(&path, tokenizer.to_string()).unwrap();
    fs::write(
        env.calib(),
        "{\"text\": \"fine\"}\n\n{\"text\": \"a <huge> token\"}\n",
    )
    .unwrap();
    let run = env.quantize(&["--max-samples", "2"]);
    // The tokenizer gives the added token the next free id, 2048: one past the embedding.
    assert_refused(
        &run,
        &["calib.jsonl:3:", "token id 2048", "vocab_size 2048"],
    );
    assert_nothing_written(&env.out());
}

fn a_byte_order_mark() {
    let env = Env::new();
    fs::write(env.calib(), "\u{feff}{\"text\": \"fine\"}\n").unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["calib.jsonl:1:", "byte-order mark"]);
    assert_nothing_written(&env.out());
}

fn a_directory_where_a_model_file_belongs(name: &str, needles: &[&str]) {
    let env = Env::new();
    let path = env.model().join(name);
    fs::remove_file(&path).unwrap();
    fs::create_dir(&path).unwrap();
    let run = env.quantize(&[]);
    let mut all = vec![name];
    all.extend_from_slice(needles);
    assert_refused(&run, &all);
    assert_nothing_written(&env.out());
}

fn tokenizer_json_is_a_directory() {
    a_directory_where_a_model_file_belongs("tokenizer.json", &["is a directory"]);
}

fn model_safetensors_is_a_directory() {
    a_directory_where_a_model_file_belongs("model.safetensors", &["not a regular file"]);
}

fn config_json_is_a_directory() {
    a_directory_where_a_model_file_belongs("config.json", &["directory"]);
}

fn absurd_thread_counts() {
    for n in ["5000", "0"] {
        let env = Env::new();
        let run = env.quantize(&["--threads", n]);
        assert_refused(&run, &[&format!("--threads {n}")]);
        assert_nothing_written(&env.out());
    }
}

/// A calibration set smaller than the hidden size runs, with a warning.
fn a_degenerate_calibration_set_is_warned_about() {
    let env = Env::new();
    let run = env.quantize(&["--max-len", "4"]);
    assert_ok(&run);
    assert!(
        run.stderr
            .contains("warning: the calibration set holds 4 tokens"),
        "{run:?}"
    );
}

// ------------------------------------------------------------------------------------------
// Classes 1, 5, 6: output paths, --overwrite, the lock, leftovers of dead runs, interrupts.

impl Env {
    /// Runs the command with [`Env::args`] and `extra` in the working directory `cwd`.
    fn quantize_in(&self, cwd: &Path, extra: &[&str]) -> Run {
        finish(
            command(&self.args(extra), cwd),
            self.root.path(),
            Duration::from_secs(240),
        )
    }

    /// Starts a run long enough to be interrupted (the bundled calibration set, 16 samples of
    /// up to 512 tokens); stdout and stderr go to files of the case's directory.
    fn start_long(&self, extra: &[&str]) -> (std::process::Child, PathBuf) {
        let calib = sala_quant::fixtures_dir().join("calib/calib.jsonl");
        let calib = calib.to_str().unwrap();
        let mut flags = vec![
            "--calib-data",
            calib,
            "--max-samples",
            "16",
            "--max-len",
            "512",
        ];
        flags.extend_from_slice(extra);
        let mut cmd = command(&self.args(&flags), self.root.path());
        let err_path = self.path(&format!("stderr-long-{}.txt", extra.len()));
        cmd.stdout(Stdio::null())
            .stderr(fs::File::create(&err_path).unwrap());
        (cmd.spawn().unwrap(), err_path)
    }

    /// Names next to the output that start with `.out.`.
    fn hidden_entries(&self) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(self.root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".out."))
            .collect();
        names.sort();
        names
    }

    /// Waits until the run's staging directory exists (the model is open, compute begins).
    fn wait_for_staging(&self, child: &mut std::process::Child) {
        let started = Instant::now();
        while !self
            .hidden_entries()
            .iter()
            .any(|n| n.contains(".partial-"))
        {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the run ended ({status:?}) before its staging directory appeared");
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "no staging directory"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn signal(child: &std::process::Child, sig: libc::c_int) {
    // SAFETY: sends a signal to our own child process.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill failed");
}

/// A real signal during the compute: the staging directory and the lock are removed, a
/// previous output is intact, and the process ends by that signal.
fn interrupted_by(sig: libc::c_int, name: &str) {
    use std::os::unix::process::ExitStatusExt;
    let env = Env::new();
    let previous = env.previous_output();
    let (mut child, err_path) = env.start_long(&["--overwrite"]);
    env.wait_for_staging(&mut child);
    std::thread::sleep(Duration::from_millis(200));
    signal(&child, sig);
    let status = wait(&mut child, Duration::from_secs(60));
    let stderr = fs::read_to_string(&err_path).unwrap();
    assert!(
        status.signal() == Some(sig) || status.code() == Some(128 + sig),
        "{status:?}: {stderr}"
    );
    assert!(
        stderr.contains(&format!("interrupted by {name}")),
        "{stderr}"
    );
    assert!(stderr.contains("removed the staging directory"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    previous.assert_intact(&env.out());
    assert_no_debris(&env.out());
}

fn sigint_during_the_run() {
    interrupted_by(libc::SIGINT, "SIGINT");
}

fn sigterm_during_the_run() {
    interrupted_by(libc::SIGTERM, "SIGTERM");
}

fn sighup_during_the_run() {
    interrupted_by(libc::SIGHUP, "SIGHUP");
}

/// SIGKILL cannot be caught: its staging directory stays until the next run on the same
/// output removes it (its process is gone), and that run succeeds.
fn sigkill_debris_is_removed_by_the_next_run() {
    let env = Env::new();
    let (mut child, _) = env.start_long(&[]);
    env.wait_for_staging(&mut child);
    signal(&child, libc::SIGKILL);
    wait(&mut child, Duration::from_secs(60));
    assert!(
        env.hidden_entries().iter().any(|n| n.contains(".partial-")),
        "{:?}",
        env.hidden_entries()
    );
    let run = env.quantize(&[]);
    assert_ok(&run);
    assert!(run.stderr.contains("a run that did not finish"), "{run:?}");
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert_no_debris(&env.out());
}

/// Two runs on one output: the second fails at start, naming the lock; the first finishes.
fn a_second_run_on_the_same_output_fails_at_start() {
    let env = Env::new();
    let (mut first, _) = env.start_long(&[]);
    env.wait_for_staging(&mut first);
    let started = Instant::now();
    let run = env.quantize(&[]);
    assert_refused(&run, &["another run is writing", ".out.lock", "by process"]);
    assert!(started.elapsed() < Duration::from_secs(30), "not at start");
    // The first run is not disturbed: stop it and check it cleans up after itself.
    signal(&first, libc::SIGTERM);
    wait(&mut first, Duration::from_secs(60));
    assert_no_debris(&env.out());
    assert!(!env.out().exists());
}

fn the_staging_directory_of_a_dead_run_is_removed() {
    let env = Env::new();
    let dead = env.path(".out.partial-999999999-AbC123");
    fs::create_dir(&dead).unwrap();
    fs::write(dead.join("model.safetensors"), "half-written").unwrap();
    let run = env.quantize(&[]);
    assert_ok(&run);
    assert!(
        run.stderr.contains(".out.partial-999999999-AbC123"),
        "{run:?}"
    );
    assert_no_debris(&env.out());
}

/// A staging directory whose process is alive (this test's) is never touched.
fn the_staging_directory_of_a_live_process_is_kept() {
    let env = Env::new();
    let live = env.path(&format!(".out.partial-{}-AbC123", std::process::id()));
    fs::create_dir(&live).unwrap();
    let run = env.quantize(&[]);
    assert_ok(&run);
    assert!(live.is_dir(), "a live run's staging directory was removed");
    fs::remove_dir(&live).unwrap();
    assert_no_debris(&env.out());
}

/// A commit killed between its two renames left the old output aside: the next run puts it
/// back first (and then, without --overwrite, refuses to replace it).
fn an_old_output_moved_aside_by_a_killed_commit_comes_back() {
    let env = Env::new();
    let previous = env.previous_output();
    let aside = env.path(".out.replaced-999999999-42");
    fs::rename(env.out(), &aside).unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["already exists", "--overwrite"]);
    assert!(
        run.stderr.contains("put the previous output back"),
        "{run:?}"
    );
    previous.assert_intact(&env.out());
    assert_no_debris(&env.out());
}

fn an_existing_output_without_overwrite() {
    let env = Env::new();
    let previous = env.previous_output();
    let run = env.quantize(&[]);
    assert_refused(&run, &["out", "already exists", "--overwrite"]);
    previous.assert_intact(&env.out());
    assert_no_debris(&env.out());
}

fn overwrite_replaces_a_previous_checkpoint() {
    let env = Env::new();
    env.previous_output();
    let run = env.quantize(&["--overwrite"]);
    assert_ok(&run);
    let report = fs::read_to_string(env.out().join("quantization_report.json")).unwrap();
    assert!(report.contains("\"calibration\""), "the new report");
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert_no_debris(&env.out());
}

fn overwrite_refuses_a_directory_of_user_files() {
    let env = Env::new();
    let out = env.out();
    fs::create_dir(&out).unwrap();
    fs::write(out.join("thesis.tex"), "years of work").unwrap();
    let before = Snapshot::of(&out);
    let run = env.quantize(&["--overwrite"]);
    assert_refused(
        &run,
        &["refusing to overwrite", "not a quantized checkpoint"],
    );
    before.assert_intact(&out);
    assert_no_debris(&out);
}

fn overwrite_refuses_the_calibration_files_directory() {
    let env = Env::new();
    let dir = env.path("data");
    fs::create_dir(&dir).unwrap();
    let calib = dir.join("calib.jsonl");
    fs::copy(env.calib(), &calib).unwrap();
    let before = Snapshot::of(&dir);
    let args: Vec<OsString> = env
        .args(&["--overwrite"])
        .into_iter()
        .map(|a| {
            if a == env.calib().as_os_str() {
                calib.clone().into()
            } else if a == env.out().as_os_str() {
                dir.clone().into()
            } else {
                a
            }
        })
        .collect();
    let run = env.run_args(&args);
    assert_refused(&run, &["refusing to overwrite", "calib.jsonl"]);
    before.assert_intact(&dir);
    assert_no_debris(&dir);
}

fn overwrite_refuses_the_working_directory() {
    let env = Env::new();
    let previous = env.previous_output();
    let run = env.quantize_in(&env.out(), &["--overwrite"]);
    assert_refused(&run, &["refusing to overwrite", "working directory"]);
    previous.assert_intact(&env.out());
    assert_no_debris(&env.out());
}

fn overwrite_refuses_a_plain_file() {
    let env = Env::new();
    fs::write(env.out(), "not a directory").unwrap();
    let run = env.quantize(&["--overwrite"]);
    assert_refused(&run, &["refusing to overwrite", "is a file"]);
    assert_eq!(fs::read_to_string(env.out()).unwrap(), "not a directory");
    assert_no_debris(&env.out());
}

fn overwrite_refuses_a_symbolic_link() {
    let env = Env::new();
    let real = env.path("real");
    fs::create_dir(&real).unwrap();
    fs::write(real.join("quantization_report.json"), "{}").unwrap();
    let before = Snapshot::of(&real);
    std::os::unix::fs::symlink(&real, env.out()).unwrap();
    let run = env.quantize(&["--overwrite"]);
    assert_refused(&run, &["refusing to overwrite", "symbolic link"]);
    before.assert_intact(&real);
    assert!(fs::symlink_metadata(env.out())
        .unwrap()
        .file_type()
        .is_symlink());
    assert_no_debris(&env.out());
}

fn the_model_directory_as_output() {
    let env = Env::new();
    let model = env.model();
    let before = Snapshot::of(&model);
    let mut args = env.args(&["--overwrite"]);
    let at = args.iter().position(|a| a == "--output").unwrap();
    args[at + 1] = model.clone().into();
    let run = env.run_args(&args);
    assert_refused(&run, &["source model directory"]);
    before.assert_intact(&model);
}

fn an_output_inside_the_model_directory() {
    let env = Env::new();
    let model = env.model();
    let before = Snapshot::of(&model);
    let mut args = env.args(&[]);
    let at = args.iter().position(|a| a == "--output").unwrap();
    args[at + 1] = model.join("quantized").into();
    let run = env.run_args(&args);
    assert_refused(&run, &["source model directory"]);
    before.assert_intact(&model);
}

fn an_output_below_a_file() {
    let env = Env::new();
    let file = env.path("plain");
    fs::write(&file, "x").unwrap();
    let mut args = env.args(&[]);
    let at = args.iter().position(|a| a == "--output").unwrap();
    args[at + 1] = file.join("out").into();
    let run = env.run_args(&args);
    assert_refused(&run, &["plain"]);
    assert_eq!(fs::read_to_string(&file).unwrap(), "x");
}

/// Missing parent directories are created for the output, and only then.
fn an_output_under_missing_directories() {
    let env = Env::new();
    let mut args = env.args(&[]);
    let at = args.iter().position(|a| a == "--output").unwrap();
    let out = env.path("a/b/out");
    args[at + 1] = out.clone().into();
    let run = env.run_args(&args);
    assert_ok(&run);
    assert!(sala_export::verify(&out).unwrap().is_ok());
    assert_no_debris(&out);
    // A refused run creates none of them.
    let env = Env::new();
    let mut args = env.args(&["--bits", "3"]);
    let at = args.iter().position(|a| a == "--output").unwrap();
    args[at + 1] = env.path("c/d/out").into();
    assert_refused(&env.run_args(&args), &["3-bit"]);
    assert!(!env.path("c").exists());
}

// ------------------------------------------------------------------------------------------
// Model files and the shard index.

fn input_flag(env: &Env, path: &Path, extra: &[&str]) -> Run {
    let mut args = env.args(extra);
    let at = args.iter().position(|a| a == "--input").unwrap();
    args[at + 1] = path.into();
    env.run_args(&args)
}

fn a_missing_model_directory() {
    let env = Env::new();
    let run = input_flag(&env, &env.path("no-such-model"), &[]);
    assert_refused(&run, &["no-such-model"]);
    assert_nothing_written(&env.out());
}

fn a_missing_config() {
    let env = Env::new();
    fs::remove_file(env.model().join("config.json")).unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["config.json"]);
    assert_nothing_written(&env.out());
}

fn a_truncated_config() {
    let env = Env::new();
    let path = env.model().join("config.json");
    let text = fs::read_to_string(&path).unwrap();
    fs::write(&path, &text[..text.len() / 2]).unwrap();
    let run = env.quantize(&["--plan-only"]);
    assert_refused(&run, &["config.json", "line"]);
    assert_nothing_written(&env.out());
}

fn an_unsupported_model_type() {
    let env = Env::new();
    edit_config(&env, |c| c["model_type"] = "gpt2".into());
    let run = env.quantize(&[]);
    assert_refused(&run, &["config.json", "model_type \"gpt2\""]);
    assert_nothing_written(&env.out());
}

fn a_truncated_weights_file() {
    let env = Env::new();
    let path = env.model().join("model.safetensors");
    let data = fs::read(&path).unwrap();
    fs::write(&path, &data[..data.len() / 2]).unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["model.safetensors"]);
    assert_nothing_written(&env.out());
}

fn a_weights_file_with_a_garbage_header() {
    let env = Env::new();
    let path = env.model().join("model.safetensors");
    let mut data = fs::read(&path).unwrap();
    data[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    fs::write(&path, data).unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["model.safetensors", "safetensors"]);
    assert_nothing_written(&env.out());
}

fn an_empty_weights_file() {
    let env = Env::new();
    fs::write(env.model().join("model.safetensors"), b"").unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["model.safetensors"]);
    assert_nothing_written(&env.out());
}

/// Rewrites the model's weights through `edit` of (name, dtype, shape, bytes).
fn rewrite_tensors(
    env: &Env,
    edit: impl Fn(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let path = env.model().join("model.safetensors");
    let data = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), view)
        })
        .collect();
    fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn a_missing_tensor() {
    let env = Env::new();
    let name = "model.layers.5.mlp.gate_proj.weight";
    rewrite_tensors(&env, |t| t.retain(|(n, ..)| n != name));
    let run = env.quantize(&[]);
    assert_refused(&run, &[name, "missing"]);
    assert_nothing_written(&env.out());
}

fn a_tensor_of_the_wrong_shape() {
    let env = Env::new();
    let name = "model.layers.1.self_attn.o_proj.weight";
    rewrite_tensors(&env, |t| {
        let entry = t.iter_mut().find(|(n, ..)| n == name).unwrap();
        entry.2 = vec![128, 512];
    });
    let run = env.quantize(&[]);
    assert_refused(&run, &[name, "shape [128, 512]", "expected [256, 256]"]);
    assert_nothing_written(&env.out());
}

fn a_tensor_of_an_integer_dtype() {
    let env = Env::new();
    let name = "model.norm.weight";
    rewrite_tensors(&env, |t| {
        let entry = t.iter_mut().find(|(n, ..)| n == name).unwrap();
        entry.1 = safetensors::Dtype::I16;
    });
    let run = env.quantize(&[]);
    assert_refused(&run, &[name, "dtype"]);
    assert_nothing_written(&env.out());
}

fn an_index_naming_a_missing_shard() {
    let env = Env::new();
    write_index(&env.model(), "model-00001-of-00002.safetensors");
    let run = env.quantize(&[]);
    assert_refused(&run, &["model-00001-of-00002.safetensors"]);
    assert_nothing_written(&env.out());
}

fn a_malformed_index() {
    let env = Env::new();
    fs::write(
        env.model().join("model.safetensors.index.json"),
        "{\"weight_map\": [",
    )
    .unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["model.safetensors.index.json"]);
    assert_nothing_written(&env.out());
}

fn a_malformed_tokenizer() {
    let env = Env::new();
    fs::write(env.model().join("tokenizer.json"), "{\"model\": 42}").unwrap();
    let run = env.quantize(&[]);
    assert_refused(&run, &["tokenizer.json"]);
    assert_nothing_written(&env.out());
}

// ------------------------------------------------------------------------------------------
// Calibration files.

fn calibration(text: &[u8], extra: &[&str], needles: &[&str]) {
    let env = Env::new();
    fs::write(env.calib(), text).unwrap();
    let run = env.quantize(extra);
    assert_refused(&run, needles);
    assert_nothing_written(&env.out());
}

fn a_missing_calibration_file() {
    let env = Env::new();
    let mut args = env.args(&[]);
    let at = args.iter().position(|a| a == "--calib-data").unwrap();
    args[at + 1] = env.path("no-such-calib.jsonl").into();
    let run = env.run_args(&args);
    assert_refused(&run, &["no-such-calib.jsonl"]);
    assert_nothing_written(&env.out());
}

fn an_empty_calibration_file() {
    calibration(b"\n\n", &[], &["calib.jsonl", "no calibration samples"]);
}

fn a_malformed_calibration_line() {
    calibration(
        b"{\"text\": \"ok\"}\n{not json\n",
        &[],
        &["calib.jsonl:2:", "not valid JSON"],
    );
}

fn a_calibration_line_that_is_not_an_object() {
    calibration(
        b"[1, 2, 3]\n",
        &[],
        &["calib.jsonl:1:", "not a JSON object"],
    );
}

fn a_calibration_line_without_text() {
    calibration(
        b"{\"answer\": \"x\"}\n",
        &[],
        &["calib.jsonl:1:", "`question`, `text` or `messages`"],
    );
}

fn invalid_utf8_in_a_calibration_line() {
    calibration(
        b"{\"text\": \"ok\"}\n\xff\xfe\xfd\n",
        &[],
        &["calib.jsonl:2:", "UTF-8"],
    );
}

fn only_malformed_lines_with_skip_malformed() {
    calibration(
        b"{bad\n[1]\n",
        &["--skip-malformed"],
        &["no calibration samples", "2 malformed"],
    );
}

fn a_directory_as_calibration_file() {
    let env = Env::new();
    let dir = env.path("calib-dir");
    fs::create_dir(&dir).unwrap();
    let mut args = env.args(&[]);
    let at = args.iter().position(|a| a == "--calib-data").unwrap();
    args[at + 1] = dir.into();
    let run = env.run_args(&args);
    assert_refused(&run, &["calib-dir"]);
    assert_nothing_written(&env.out());
}

fn a_sample_beyond_dense_len() {
    let env = Env::new();
    let run = env.quantize(&["--dense-len", "8"]);
    assert_refused(
        &run,
        &["calib.jsonl", "calibration line 1", "--dense-len 8"],
    );
    assert_nothing_written(&env.out());
}

/// A device budget too small for the longest sample: one error line naming the file, the
/// line, the sample's tokens and the budget, before any compute.
fn a_budget_too_small_for_the_longest_sample() {
    let env = Env::new();
    let long = "In the beginning God created the heaven and the earth. ".repeat(40);
    fs::write(
        env.calib(),
        format!("{{\"text\": \"Short.\"}}\n{{\"text\": \"{long}\"}}\n"),
    )
    .unwrap();
    let run = env.quantize(&[
        "--max-samples",
        "2",
        "--max-len",
        "4096",
        "--max-device-memory",
        "1",
    ]);
    assert_refused(
        &run,
        &[
            "calib.jsonl: calibration line 2: sample 1 has",
            "tokens",
            "of the 1 MB budget (--max-device-memory)",
        ],
    );
    let errors = run.stderr.lines().filter(|l| l.contains("error")).count();
    assert_eq!(errors, 1, "one error line: {run:?}");
    assert_nothing_written(&env.out());
    option(&["--max-device-memory", "0"], &["--max-device-memory 0"]);
}

// ------------------------------------------------------------------------------------------
// Options.

fn option(extra: &[&str], needles: &[&str]) {
    let env = Env::new();
    let run = env.quantize(extra);
    assert_refused(&run, needles);
    assert_nothing_written(&env.out());
}

fn zero_max_len_or_samples() {
    option(&["--max-len", "0"], &["--max-len"]);
    option(&["--max-samples", "0"], &["--max-samples"]);
}

fn bit_widths_that_cannot_be_served() {
    option(&["--bits", "3"], &["--bits", "3-bit"]);
    option(&["--recipe", "nvfp4", "--bits", "8"], &["8 bits", "nvfp4"]);
    option(&["--layer-bits", "2:2"], &["model.layers.2.", "2-bit"]);
}

fn a_layer_beyond_the_model() {
    option(
        &["--layer-bits", "99:8"],
        &["--layer-bits", "layer 99", "8 layers"],
    );
}

fn a_group_size_marlin_does_not_serve() {
    option(&["--group-size", "96"], &["group size 96"]);
}

fn an_exclude_pattern_that_does_not_compile() {
    option(&["--exclude", "(unclosed"], &["--exclude", "(unclosed"]);
}

fn cuda_in_a_build_without_it() {
    option(&["--device", "cuda"], &["--device cuda", "--features cuda"]);
}

fn nvfp4_search_options_out_of_range() {
    option(&["--recipe", "nvfp4", "--mse-iters", "0"], &["--mse-iters"]);
}

/// A flag that does not exist is a usage error: exit status 2, no panic, nothing written.
fn an_unknown_flag_is_a_usage_error() {
    let env = Env::new();
    let run = env.quantize(&["--bogus-flag"]);
    assert_no_panic(&run);
    assert_eq!(run.status.code(), Some(2), "{run:?}");
    assert!(run.stderr.contains("--bogus-flag"), "{run:?}");
    assert_nothing_written(&env.out());
}

// ------------------------------------------------------------------------------------------
// Class 7: resumable runs (--resume). A run killed right after layer k's state is on disk
// (the SALA_QUANTIZE_KILL_AFTER_LAYER test hook: SIGKILL to itself, nothing cleaned up) and
// resumed gives the same bytes in every file as an uninterrupted run; quantization_report.json
// is compared without its wall-clock and memory fields (seconds per stage and linear, peaks),
// and quantization_report.html, rendered from it, only for being there.

const KILL_AFTER: &str = "SALA_QUANTIZE_KILL_AFTER_LAYER";

/// The report's JSON without what differs from run to run: wall-clock seconds (per stage, per
/// linear, total) and memory peaks.
fn report_without_timings(bytes: &[u8]) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
    sala_gptq::report::strip_run_dependent(&mut v);
    v
}

/// Every file of `resumed` has the bytes of the same file of `reference` (the report: but
/// for its timings).
fn assert_same_checkpoint(reference: &Path, resumed: &Path) {
    let (a, b) = (Snapshot::of(reference), Snapshot::of(resumed));
    let names = |s: &Snapshot| s.0.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&a), names(&b));
    for (name, bytes) in &a.0 {
        if name == Path::new("quantization_report.json") {
            assert_eq!(
                report_without_timings(bytes),
                report_without_timings(&b.0[name]),
                "the reports differ"
            );
        } else if name == Path::new("quantization_report.html") {
            // The page shows the timings too; it is rendered from the JSON compared above
            // (tests/report_html.rs checks that), so being there is what is checked here.
            assert!(!bytes.is_empty() && !b.0[name].is_empty());
        } else {
            assert!(*bytes == b.0[name], "{} differs", name.display());
        }
    }
    assert!(a
        .0
        .keys()
        .any(|n| n.to_string_lossy().ends_with(".safetensors")));
}

impl Env {
    /// Runs the command with [`Env::args`] and `extra`, killed by the test hook after
    /// `layer`; checks that it died of SIGKILL there and left a resumable staging directory.
    fn quantize_killed_after(&self, layer: usize, extra: &[&str]) {
        use std::os::unix::process::ExitStatusExt;
        let mut cmd = command(&self.args(extra), self.root.path());
        cmd.env(KILL_AFTER, layer.to_string());
        let run = finish(cmd, self.root.path(), Duration::from_secs(240));
        assert_eq!(run.status.signal(), Some(libc::SIGKILL), "{run:?}");
        assert!(
            run.stderr
                .contains(&format!("killing the process after layer {layer}")),
            "{run:?}"
        );
        assert!(!self.out().exists());
        let staged = self.staged_runs();
        assert_eq!(staged.len(), 1, "{staged:?}");
    }

    /// Staging directories next to the output that hold a resume manifest.
    fn staged_runs(&self) -> Vec<PathBuf> {
        self.hidden_entries()
            .iter()
            .filter(|n| n.contains(".partial-"))
            .map(|n| self.path(n))
            .filter(|p| p.join("resume/manifest.json").is_file())
            .collect()
    }
}

/// Kills a `--resume` run after layer 3 of 8, resumes it, and compares every file with an
/// uninterrupted run's (without --resume) at the same output path.
fn killed_and_resumed_is_byte_identical(recipe: &str) {
    let env = Env::new();
    let flags = [
        "--recipe",
        recipe,
        "--max-samples",
        "3",
        "--max-len",
        "40",
        "--nvfp4-coverage",
        "all",
    ];
    assert_ok(&env.quantize(&flags));
    let reference = env.path("reference");
    fs::rename(env.out(), &reference).unwrap();
    let mut resumable = flags.to_vec();
    resumable.push("--resume");
    env.quantize_killed_after(3, &resumable);
    // Not quiet: the layers run print a line each on standard error.
    let mut args = env.args(&resumable);
    args.retain(|a| a != "--quiet");
    let run = env.run_args(&args);
    assert_ok(&run);
    assert!(
        run.stderr.contains("continuing the staged run") && run.stderr.contains("at layer 4"),
        "{run:?}"
    );
    assert!(
        !run.stderr.contains("layer 3 (") && run.stderr.contains("layer 4 ("),
        "layers 0 to 3 were computed again: {run:?}"
    );
    assert_same_checkpoint(&reference, &env.out());
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert_no_debris(&env.out());
}

fn gptq_killed_and_resumed_is_byte_identical() {
    killed_and_resumed_is_byte_identical("gptq");
}

fn nvfp4_killed_and_resumed_is_byte_identical() {
    killed_and_resumed_is_byte_identical("nvfp4");
}

/// A resume with another option that changes the result is refused before any compute,
/// naming the flag; the staged run is left as it was, and resumes with the original flags
/// plus those that change only how the run goes, which its report then names.
fn resume_with_a_changed_option_is_refused() {
    let env = Env::new();
    env.quantize_killed_after(2, &["--resume"]);
    let staged = env.staged_runs();
    let before = Snapshot::of(&staged[0]);
    let run = env.quantize(&["--resume", "--damp", "0.02"]);
    assert_refused(&run, &["cannot resume", "--damp", "0.05", "0.02"]);
    let run = env.quantize(&["--resume", "--unfused-residual"]);
    assert_refused(&run, &["cannot resume", "--unfused-residual"]);
    assert_eq!(env.staged_runs(), staged);
    before.assert_intact(&staged[0]);
    assert!(!env.out().exists());
    let run = env.quantize(&["--resume", "--serial-hessians", "--host-waits"]);
    assert_ok(&run);
    assert!(run.stderr.contains("continuing the staged run"), "{run:?}");
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert_no_debris(&env.out());
    let report = fs::read_to_string(env.out().join(sala_export::REPORT_FILE)).unwrap();
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    let settings = report["settings"].as_array().unwrap();
    for flag in ["--serial-hessians", "--host-waits"] {
        let entry = serde_json::json!([flag, "true"]);
        assert!(settings.contains(&entry), "{flag}: {settings:?}");
    }
}

/// A resume with another calibration file is refused, naming it.
fn resume_with_a_changed_calibration_file_is_refused() {
    let env = Env::new();
    env.quantize_killed_after(2, &["--resume"]);
    let staged = env.staged_runs();
    let mut text = fs::read_to_string(env.calib()).unwrap();
    text.push_str("{\"text\": \"one more record\"}\n");
    fs::write(env.calib(), text).unwrap();
    let run = env.quantize(&["--resume"]);
    assert_refused(&run, &["cannot resume", "calibration file (--calib-data)"]);
    assert_eq!(env.staged_runs(), staged);
    assert!(!env.out().exists());
}

/// `--resume` with nothing staged starts a fresh run and says so.
fn resume_with_nothing_staged_starts_fresh() {
    let env = Env::new();
    let run = env.quantize(&["--resume"]);
    assert_ok(&run);
    assert!(
        run.stderr.contains("no staged run to resume") && run.stderr.contains("fresh run"),
        "{run:?}"
    );
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert!(!env.out().join("resume").exists());
    assert_no_debris(&env.out());
}

/// Without --resume, a resumable staging directory is removed as before, and the message says
/// that --resume exists.
fn a_resumable_run_is_removed_without_resume() {
    let env = Env::new();
    env.quantize_killed_after(1, &["--resume"]);
    let run = env.quantize(&[]);
    assert_ok(&run);
    assert!(
        run.stderr.contains("--resume would have continued it"),
        "{run:?}"
    );
    assert!(env.staged_runs().is_empty());
    assert_no_debris(&env.out());
}

/// SIGINT during a --resume run that has completed a layer keeps its staging directory (the
/// lock goes), and a --resume run continues it.
fn sigint_keeps_a_resumable_run() {
    use std::os::unix::process::ExitStatusExt;
    let env = Env::new();
    let (mut child, err_path) = env.start_long(&["--resume"]);
    let started = Instant::now();
    while env.staged_runs().is_empty() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status:?}) before its first layer was saved");
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no layer saved"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The manifest is renamed into place just before the directory is marked to keep.
    std::thread::sleep(Duration::from_millis(100));
    signal(&child, libc::SIGINT);
    let status = wait(&mut child, Duration::from_secs(60));
    let stderr = fs::read_to_string(&err_path).unwrap();
    assert_eq!(status.signal(), Some(libc::SIGINT), "{stderr}");
    assert!(stderr.contains("kept the staging directory"), "{stderr}");
    assert!(stderr.contains("--resume"), "{stderr}");
    assert_eq!(env.staged_runs().len(), 1, "{:?}", env.hidden_entries());
    assert!(
        !env.hidden_entries().iter().any(|n| n.ends_with(".lock")),
        "{:?}",
        env.hidden_entries()
    );
    let (mut child, err_path) = env.start_long(&["--resume"]);
    let status = wait(&mut child, Duration::from_secs(240));
    let stderr = fs::read_to_string(&err_path).unwrap();
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(stderr.contains("continuing the staged run"), "{stderr}");
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert_no_debris(&env.out());
}

// ------------------------------------------------------------------------------------------
// Class 8: a full disk, simulated with a file-size limit (`ulimit -f`, 512-byte blocks in
// sh): quantize_sala ignores SIGXFSZ, so the write that crosses the limit fails with EFBIG
// ("File too large"), an error naming the file.

impl Env {
    /// Runs the command with [`Env::args`] and `extra` under `ulimit -f blocks`.
    fn quantize_limited(&self, blocks: u64, extra: &[&str]) -> Run {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("ulimit -f {blocks} && exec \"$0\" \"$@\""))
            .arg(std::env::current_exe().expect("own executable"))
            .args(self.args(extra))
            .env(CHILD, "1")
            .env_remove("RUST_BACKTRACE")
            .current_dir(self.root.path())
            .stdin(Stdio::null());
        finish(cmd, self.root.path(), Duration::from_secs(240))
    }
}

/// The run failed on a full disk: status 1, no panic, the error names `file` and the cause.
fn assert_disk_full(run: &Run, file: &str) {
    assert_refused(run, &[file, "File too large"]);
}

/// The hidden-state scratch file (--max-host-memory 0) cannot get its blocks.
fn disk_full_at_the_hidden_state_file() {
    let env = Env::new();
    let calib = sala_quant::fixtures_dir().join("calib/calib.jsonl");
    let calib = calib.to_str().unwrap();
    let flags = [
        "--calib-data",
        calib,
        "--max-samples",
        "8",
        "--max-len",
        "256",
        "--max-host-memory",
        "0",
    ];
    let previous = env.previous_output();
    let mut with_overwrite = flags.to_vec();
    with_overwrite.push("--overwrite");
    let run = env.quantize_limited(64, &with_overwrite);
    assert_disk_full(&run, "hidden-state scratch file");
    assert!(run.stderr.contains(".out.partial-"), "{run:?}");
    previous.assert_intact(&env.out());
    assert_no_debris(&env.out());
}

/// The shard (written once every layer is done) crosses the limit.
fn disk_full_at_the_shard() {
    let env = Env::new();
    let run = env.quantize_limited(256, &[]);
    assert_disk_full(&run, "shard-00001.partial");
    assert_nothing_written(&env.out());
}

/// `--overwrite` of a previous checkpoint, and the disk fills while the new one is written:
/// the old one is intact.
fn disk_full_while_overwriting_keeps_the_old_checkpoint() {
    let env = Env::new();
    assert_ok(&env.quantize(&[]));
    let previous = Snapshot::of(&env.out());
    let run = env.quantize_limited(256, &["--overwrite", "--max-len", "12"]);
    assert_disk_full(&run, "shard-00001.partial");
    previous.assert_intact(&env.out());
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert_no_debris(&env.out());
}

/// With --resume, the files of layer 0 (its shard data, staged as it is written, or its resume
/// state) cross the limit before any layer is complete: nothing to keep, nothing left.
fn disk_full_at_the_resume_state() {
    let env = Env::new();
    let run = env.quantize_limited(16, &["--resume"]);
    assert_disk_full(&run, ".out.partial-");
    assert_nothing_written(&env.out());
}

/// With --resume the disk fills at the shard data once a layer is complete: the staging
/// directory is kept (the lock is not), and a --resume run with room continues after the
/// completed layers and finishes.
fn disk_full_at_the_shard_of_a_resumable_run() {
    let env = Env::new();
    let run = env.quantize_limited(1024, &["--resume"]);
    assert_disk_full(&run, "shard-00001.partial");
    assert!(!env.out().exists());
    assert_eq!(env.staged_runs().len(), 1, "{:?}", env.hidden_entries());
    assert!(!env.hidden_entries().iter().any(|n| n.ends_with(".lock")));
    let run = env.quantize(&["--resume"]);
    assert_ok(&run);
    assert!(
        run.stderr.contains("--resume: continuing the staged run"),
        "{run:?}"
    );
    assert!(!run.stderr.contains("at layer 0:"), "{run:?}");
    assert!(sala_export::verify(env.out()).unwrap().is_ok());
    assert_no_debris(&env.out());
}

/// `(name, case)` pairs, named by the functions.
macro_rules! cases {
    ($($case:ident),* $(,)?) => {
        &[$((stringify!($case), $case as fn())),*]
    };
}

const CASES: &[Case] = cases![
    a_good_run_commits_a_verified_checkpoint_with_its_report,
    nan_in_the_embedding,
    inf_in_the_final_norm,
    nan_in_lm_head,
    nan_in_a_layer_norm,
    nan_in_a_linear_kept_in_16_bits,
    nan_in_a_quantized_linear,
    stdout_closed_before_the_run,
    stdout_full_after_the_commit_is_a_warning,
    plan_only_to_a_full_stdout,
    config_vocab_times_hidden_overflows,
    config_intermediate_times_hidden_overflows,
    config_heads_times_head_dim_overflows,
    config_absurd_layer_count,
    config_dimension_beyond_usize,
    huge_max_samples,
    huge_max_len_is_harmless,
    dev_zero_as_calibration,
    a_calibration_line_beyond_the_bound,
    max_memory_options_that_overflow,
    generation_config_linked_out_of_the_model,
    python_file_linked_out_of_the_model,
    tokenizer_config_linked_out_of_the_model,
    weights_linked_out_of_the_model,
    shard_through_a_linked_subdirectory,
    index_with_a_path_out_of_the_model,
    hugging_face_cache_layout_is_accepted,
    an_extra_bias_would_be_dropped,
    a_tensor_of_a_layer_beyond_the_config,
    a_rotary_buffer_is_dropped_with_a_warning,
    duplicate_layer_bits,
    hidden_states_in_a_file,
    a_zero_token_sample_names_its_line,
    a_token_id_outside_the_vocabulary_names_its_line,
    a_byte_order_mark,
    tokenizer_json_is_a_directory,
    model_safetensors_is_a_directory,
    config_json_is_a_directory,
    absurd_thread_counts,
    a_degenerate_calibration_set_is_warned_about,
    sigint_during_the_run,
    sigterm_during_the_run,
    sighup_during_the_run,
    sigkill_debris_is_removed_by_the_next_run,
    a_second_run_on_the_same_output_fails_at_start,
    the_staging_directory_of_a_dead_run_is_removed,
    the_staging_directory_of_a_live_process_is_kept,
    an_old_output_moved_aside_by_a_killed_commit_comes_back,
    an_existing_output_without_overwrite,
    overwrite_replaces_a_previous_checkpoint,
    overwrite_refuses_a_directory_of_user_files,
    overwrite_refuses_the_calibration_files_directory,
    overwrite_refuses_the_working_directory,
    overwrite_refuses_a_plain_file,
    overwrite_refuses_a_symbolic_link,
    the_model_directory_as_output,
    an_output_inside_the_model_directory,
    an_output_below_a_file,
    an_output_under_missing_directories,
    a_missing_model_directory,
    a_missing_config,
    a_truncated_config,
    an_unsupported_model_type,
    a_truncated_weights_file,
    a_weights_file_with_a_garbage_header,
    an_empty_weights_file,
    a_missing_tensor,
    a_tensor_of_the_wrong_shape,
    a_tensor_of_an_integer_dtype,
    an_index_naming_a_missing_shard,
    a_malformed_index,
    a_malformed_tokenizer,
    a_missing_calibration_file,
    an_empty_calibration_file,
    a_malformed_calibration_line,
    a_calibration_line_that_is_not_an_object,
    a_calibration_line_without_text,
    invalid_utf8_in_a_calibration_line,
    only_malformed_lines_with_skip_malformed,
    a_directory_as_calibration_file,
    a_sample_beyond_dense_len,
    a_budget_too_small_for_the_longest_sample,
    zero_max_len_or_samples,
    bit_widths_that_cannot_be_served,
    a_layer_beyond_the_model,
    a_group_size_marlin_does_not_serve,
    an_exclude_pattern_that_does_not_compile,
    cuda_in_a_build_without_it,
    nvfp4_search_options_out_of_range,
    an_unknown_flag_is_a_usage_error,
    gptq_killed_and_resumed_is_byte_identical,
    nvfp4_killed_and_resumed_is_byte_identical,
    resume_with_a_changed_option_is_refused,
    resume_with_a_changed_calibration_file_is_refused,
    resume_with_nothing_staged_starts_fresh,
    a_resumable_run_is_removed_without_resume,
    sigint_keeps_a_resumable_run,
    disk_full_at_the_hidden_state_file,
    disk_full_at_the_shard,
    disk_full_while_overwriting_keeps_the_old_checkpoint,
    disk_full_at_the_resume_state,
    disk_full_at_the_shard_of_a_resumable_run,
];
