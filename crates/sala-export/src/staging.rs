//! The directory transaction: everything is written (and verified) in a hidden staging directory
//! next to the target and renamed into place at the end, so a reader never sees a half-written
//! checkpoint and an error (or a panic, or a dropped writer, or an interrupt) leaves the target
//! untouched.
//!
//! - **Lock**: `.<name>.lock` next to the target, held (`flock`) from [`StagedDir::create`] to
//!   the commit or the drop; a second run on the same output fails at once, naming the lock.
//!   The kernel releases it when a process dies, even by SIGKILL.
//! - **Staging**: `.<name>.partial-<pid>-<random>`; removed on drop, on an error and (with
//!   [`crate::remove_staging_on_interrupt`]) on SIGINT / SIGTERM / SIGHUP. One left by a process
//!   that is gone (SIGKILL, power loss) is removed by the next run on the same output.
//! - **Commit**: a rename. With `overwrite`, the old output is first renamed to
//!   `.<name>.replaced-<pid>-<n>` and removed only once the new one is in place; if the second
//!   rename fails it is renamed back, and if the process dies in between, the next run puts it
//!   back.
//! - **Resume**: a staging directory that holds [`RESUME_DIR`]`/`[`RESUME_MANIFEST`] is the
//!   state of a resumable run. Without resumption it is removed like any other (the message
//!   says `--resume` exists); a resuming run finds it ([`find_resumable`]) and adopts it
//!   ([`StagedDir::create_adopting`]: renamed to a name of its own process under the lock). A
//!   staging directory marked with [`StagedDir::set_resumable`] is kept when the run stops
//!   (error, drop, SIGINT / SIGTERM / SIGHUP); the lock is released all the same.
//! - **Durability**: before the commit every staged file and the staging directory are synced
//!   to disk, and the parent directory after the rename.
//! - **Overwrite** replaces only a checkpoint ([`is_checkpoint_dir`]) or an empty directory:
//!   never a file, a symbolic link, a directory of other files, the working directory or a
//!   directory holding an input of the run.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

use crate::config::{read_json, CONFIG_FILE, HF_QUANT_CONFIG_FILE, QUANTIZE_CONFIG_FILE};
use crate::interrupt::{registry, remove_tree};
use crate::ExportError;

/// The run report `quantize_sala` writes into every checkpoint (inside the staging directory,
/// before the commit); also what marks a directory as one this tool wrote.
pub const REPORT_FILE: &str = "quantization_report.json";

/// The directory inside a staging directory that holds a resumable run's state.
pub const RESUME_DIR: &str = "resume";

/// The manifest of a resumable run's state, inside [`RESUME_DIR`]: its presence makes a
/// staging directory resumable. Written atomically (temporary file, sync, rename).
pub const RESUME_MANIFEST: &str = "manifest.json";

/// What [`recover_output_with`] does with the staging directory of a dead run that holds a
/// resume manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleStaging {
    /// Remove it like any other (the message says that `--resume` would have continued it).
    Remove,
    /// Keep it, for a resuming run to adopt.
    KeepResumable,
}

/// A staging directory that becomes `target` on [`StagedDir::commit`] and is removed otherwise.
#[derive(Debug)]
pub struct StagedDir {
    target: PathBuf,
    /// `Some` until the commit.
    staging: Option<PathBuf>,
    overwrite: bool,
    lock: Option<OutputLock>,
    id: u64,
    /// Parent directories this staging created (deepest first), removed again if still empty
    /// when nothing is committed.
    created: Vec<PathBuf>,
    recovered: Vec<String>,
    /// Kept (not removed) when dropped or interrupted: see [`StagedDir::set_resumable`].
    keep: bool,
    /// The staging directory of a dead run this one adopted, by its old name.
    adopted: Option<PathBuf>,
}

impl StagedDir {
    /// Creates the staging directory in `target`'s parent (created if missing), after taking the
    /// output's lock and removing what dead runs on the same output left behind.
    ///
    /// Fails if another run holds the lock; if `target` exists and `overwrite` is false, or it
    /// may not be replaced (see [`check_output`]); or if `target` is `source`, one of its
    /// ancestors (replacing it would destroy the input) or inside it.
    pub fn create(
        target: &Path,
        overwrite: bool,
        source: Option<&Path>,
    ) -> Result<Self, ExportError> {
        Self::create_adopting(target, overwrite, source, None)
    }

    /// [`create`](Self::create), but with `adopt` (a staging directory of a dead run on the
    /// same output, as [`find_resumable`] returns it) taken over instead of a new, empty staging
    /// directory: under the lock it is renamed to a name of this process, its contents kept.
    /// Fails if it is gone or its process is alive (another run took it over).
    pub fn create_adopting(
        target: &Path,
        overwrite: bool,
        source: Option<&Path>,
        adopt: Option<&Path>,
    ) -> Result<Self, ExportError> {
        let (parent, name) = split_target(target)?;
        // Checked before anything is created, so a refused target leaves no directory behind.
        if let Some(source) = source {
            refuse_source(&resolve_lenient(&parent)?.join(&name), source)?;
        }
        let created = missing_ancestors(&parent);
        fs::create_dir_all(&parent).map_err(ExportError::io(&parent))?;
        let mut staged = Self {
            target: PathBuf::new(),
            staging: None,
            overwrite,
            lock: None,
            id: 0,
            created,
            recovered: Vec::new(),
            keep: false,
            adopted: None,
        };
        // From here on, an error drops `staged`, which removes what was created.
        let parent = fs::canonicalize(&parent).map_err(ExportError::io(&parent))?;
        staged.target = parent.join(&name);
        staged.lock = OutputLock::acquire(&parent, &name, &staged.target)?;
        let adopt = adopt.map(|a| parent.join(a.file_name().unwrap_or(a.as_os_str())));
        staged.recovered = recover_stale(
            &parent,
            &name,
            &staged.target,
            StaleStaging::Remove,
            adopt.as_deref(),
        );
        check_existing(&staged.target, overwrite, &[])?;
        let staging = match &adopt {
            Some(old) => {
                let owned_by_dead = old
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix(&format!(".{}.partial-", name.to_string_lossy())))
                    .and_then(owner)
                    .is_some_and(|pid| !process_alive(pid));
                if !owned_by_dead || !old.join(RESUME_DIR).join(RESUME_MANIFEST).is_file() {
                    return Err(ExportError::Io {
                        path: old.clone(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            "the staging directory to resume is gone or in use by another run",
                        ),
                    });
                }
                let new = unique_sibling(&staged.target, "partial");
                fs::rename(old, &new).map_err(ExportError::io(old))?;
                staged.adopted = Some(old.clone());
                new
            }
            None => tempfile::Builder::new()
                .prefix(&format!(
                    ".{}.partial-{}-",
                    name.to_string_lossy(),
                    std::process::id()
                ))
                .tempdir_in(&parent)
                .map_err(ExportError::io(&parent))?
                .keep(),
        };
        let lock = staged.lock.as_ref().map(|l| l.path.as_path());
        staged.id = registry().add(&staging, &staged.target, lock);
        staged.staging = Some(staging);
        Ok(staged)
    }

    /// Where files are written until the commit.
    pub fn path(&self) -> &Path {
        self.staging.as_deref().unwrap_or(&self.target)
    }

    /// The final location (parent canonicalized).
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// What was found and cleaned up at creation: staging directories of dead runs removed, an
    /// output that an interrupted commit had moved aside put back. One line each.
    pub fn recovered(&self) -> &[String] {
        &self.recovered
    }

    /// The staging directory of a dead run this one adopted ([`create_adopting`](
    /// Self::create_adopting)), by its old name.
    pub fn adopted(&self) -> Option<&Path> {
        self.adopted.as_deref()
    }

    /// Marks the staging directory as a resumable run's (`true`: it holds at least one
    /// completed layer): it is then kept, not removed, when this value is dropped without a
    /// commit (an error) and on SIGINT / SIGTERM / SIGHUP. `false` (before the resume state
    /// is removed) restores the default: removed.
    pub fn set_resumable(&mut self, keep: bool) {
        self.keep = keep;
        registry().set_keep(self.id, keep);
    }

    /// Renames the staging directory into place; with `overwrite`, the old target is moved
    /// aside first and deleted only after the new one is in place (if the rename fails, the
    /// old target is put back and the staging directory removed).
    pub fn commit(mut self) -> Result<PathBuf, ExportError> {
        let mut reg = registry();
        let result = self.rename_into_place(&mut reg);
        if result.is_ok() {
            reg.remove(self.id);
            self.staging = None;
        }
        drop(reg);
        let aside = result?;
        if let Some(aside) = aside {
            // If this fails (or the process dies now), the next run on this output removes it.
            remove_tree(&aside);
        }
        self.created.clear();
        Ok(self.target.clone())
    }

    fn rename_into_place(
        &self,
        reg: &mut crate::interrupt::Registry,
    ) -> Result<Option<PathBuf>, ExportError> {
        let staging = self.path().to_path_buf();
        // Every file on disk before the rename makes them visible: a crash after the commit
        // never leaves an output with a truncated file.
        sync_tree(&staging)?;
        let exists = fs::symlink_metadata(&self.target).is_ok();
        let aside = if exists {
            check_existing(&self.target, self.overwrite, &[])?;
            let aside = unique_sibling(&self.target, "replaced");
            fs::rename(&self.target, &aside).map_err(ExportError::io(&self.target))?;
            reg.set_aside(self.id, Some(&aside));
            Some(aside)
        } else {
            None
        };
        if let Err(source) = fs::rename(&staging, &self.target) {
            if let Some(aside) = &aside {
                if fs::rename(aside, &self.target).is_ok() {
                    reg.set_aside(self.id, None);
                }
            }
            return Err(ExportError::Io {
                path: self.target.clone(),
                source,
            });
        }
        if let Some(parent) = self.target.parent() {
            // The rename itself on disk; best effort (the output is in place either way).
            let _ = sync_dir(parent);
        }
        Ok(aside)
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if let Some(staging) = self.staging.take() {
            let mut reg = registry();
            reg.remove(self.id);
            if !self.keep {
                remove_tree(&staging);
            }
        }
        // Releases the lock and removes its file, before the parents it sits in.
        self.lock = None;
        for dir in &self.created {
            let _ = fs::remove_dir(dir);
        }
    }
}

/// Syncs every file below `dir` and every directory (`dir` included) to disk; the error names
/// the file.
pub(crate) fn sync_tree(dir: &Path) -> Result<(), ExportError> {
    for entry in fs::read_dir(dir).map_err(ExportError::io(dir))? {
        let entry = entry.map_err(ExportError::io(dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(ExportError::io(&path))?;
        if kind.is_dir() {
            sync_tree(&path)?;
        } else if kind.is_file() {
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(ExportError::io(&path))?;
        }
    }
    sync_dir(dir)
}

/// Syncs a directory's entries (names created, renamed or removed in it) to disk.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), ExportError> {
    #[cfg(unix)]
    {
        fs::File::open(dir)
            .and_then(|f| f.sync_all())
            .map_err(ExportError::io(dir))
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

/// Whether `dir` holds a quantized checkpoint: this tool's [`REPORT_FILE`], AutoGPTQ's
/// `quantize_config.json`, ModelOpt's `hf_quant_config.json`, or a `config.json` with a
/// `quantization_config` object (any producer's).
pub fn is_checkpoint_dir(dir: &Path) -> bool {
    [REPORT_FILE, QUANTIZE_CONFIG_FILE, HF_QUANT_CONFIG_FILE]
        .iter()
        .any(|f| dir.join(f).is_file())
        || read_json(&dir.join(CONFIG_FILE))
            .ok()
            .and_then(|c| c.get("quantization_config").map(|q| q.is_object()))
            .unwrap_or(false)
}

/// Refuses, without creating or changing anything, an output that [`StagedDir::create`] or the
/// commit would refuse: `target` is, holds or lies inside `source`; it exists and `overwrite`
/// is false; it exists and may not be replaced (a file, a symbolic link, a directory that is
/// not a checkpoint and not empty, the working directory or one holding it, one holding any of
/// `protected`); or another run holds its lock. For a check before a long computation.
pub fn check_output(
    target: &Path,
    overwrite: bool,
    source: Option<&Path>,
    protected: &[&Path],
) -> Result<(), ExportError> {
    let (parent, name) = split_target(target)?;
    let parent = resolve_lenient(&parent)?;
    let resolved = parent.join(&name);
    if let Some(source) = source {
        refuse_source(&resolved, source)?;
    }
    if let Ok(meta) = fs::metadata(&parent) {
        if !meta.is_dir() {
            return Err(ExportError::Io {
                path: parent,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotADirectory,
                    "the output's parent is not a directory",
                ),
            });
        }
        check_existing(&resolved, overwrite, protected)?;
        // Taken and released at once: fails now if another run holds it.
        drop(OutputLock::acquire(&parent, &name, &resolved)?);
    }
    Ok(())
}

/// Cleans up, under the output's lock, what dead runs on `target` left: removes their staging
/// directories and puts back an old output that an interrupted commit had moved aside. One
/// line per action. Fails if another run holds the lock. Does nothing if `target`'s parent
/// does not exist. (Also done by [`StagedDir::create`]; call it first to have the old output
/// back before anything else looks at `target`.)
pub fn recover_output(target: &Path) -> Result<Vec<String>, ExportError> {
    recover_output_with(target, StaleStaging::Remove)
}

/// [`recover_output`], with the staging directories of dead runs that hold a resume manifest
/// removed or kept as `resumable` says.
pub fn recover_output_with(
    target: &Path,
    resumable: StaleStaging,
) -> Result<Vec<String>, ExportError> {
    let (parent, name) = split_target(target)?;
    let Ok(parent) = fs::canonicalize(&parent) else {
        return Ok(Vec::new());
    };
    let resolved = parent.join(&name);
    let _lock = OutputLock::acquire(&parent, &name, &resolved)?;
    Ok(recover_stale(&parent, &name, &resolved, resumable, None))
}

/// The staging directory of a dead run on `target` that holds a resume manifest, if any (the
/// most recently updated one when there are several); `None` if there is none or `target`'s
/// parent does not exist. Changes nothing.
pub fn find_resumable(target: &Path) -> Result<Option<PathBuf>, ExportError> {
    let (parent, name) = split_target(target)?;
    let Ok(parent) = fs::canonicalize(&parent) else {
        return Ok(None);
    };
    let Some(name) = name.to_str() else {
        return Ok(None);
    };
    let partial = format!(".{name}.partial-");
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    for entry in fs::read_dir(&parent)
        .map_err(ExportError::io(&parent))?
        .flatten()
    {
        let file_name = entry.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(&partial)) else {
            continue;
        };
        if owner(rest).is_none_or(process_alive) {
            continue;
        }
        let manifest = entry.path().join(RESUME_DIR).join(RESUME_MANIFEST);
        if let Ok(modified) = fs::metadata(&manifest).and_then(|m| m.modified()) {
            found.push((modified, entry.path()));
        }
    }
    found.sort();
    Ok(found.pop().map(|(_, path)| path))
}

fn check_existing(target: &Path, overwrite: bool, protected: &[&Path]) -> Result<(), ExportError> {
    let meta = match fs::symlink_metadata(target) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(ExportError::io(target)(e)),
    };
    if !overwrite {
        return Err(ExportError::TargetExists {
            path: target.to_path_buf(),
        });
    }
    let refuse = |reason: String| ExportError::NotReplaceable {
        path: target.to_path_buf(),
        reason,
    };
    if meta.file_type().is_symlink() {
        return Err(refuse(
            "it is a symbolic link (give the directory itself, or remove the link)".into(),
        ));
    }
    if !meta.is_dir() {
        return Err(refuse("it is a file, not a checkpoint directory".into()));
    }
    if let Ok(cwd) = std::env::current_dir().and_then(fs::canonicalize) {
        if cwd.starts_with(target) {
            return Err(refuse("it is or contains the working directory".into()));
        }
    }
    for path in protected {
        if let Ok(p) = fs::canonicalize(path) {
            if p.starts_with(target) {
                return Err(refuse(format!(
                    "it holds {}, an input of this run",
                    path.display()
                )));
            }
        }
    }
    let empty = fs::read_dir(target)
        .map_err(ExportError::io(target))?
        .next()
        .is_none();
    if !empty && !is_checkpoint_dir(target) {
        return Err(refuse(format!(
            "it is not a quantized checkpoint (no {REPORT_FILE}, {QUANTIZE_CONFIG_FILE}, \
             {HF_QUANT_CONFIG_FILE}, nor a config.json with a quantization_config); remove it \
             yourself or choose another output"
        )));
    }
    Ok(())
}

/// `.<name>.<what>-<pid>-<n>` next to `target`, not yet existing.
fn unique_sibling(target: &Path, what: &str) -> PathBuf {
    let parent = target.parent().unwrap_or(Path::new("."));
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let pid = std::process::id();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (0u64..)
        .map(|n| parent.join(format!(".{name}.{what}-{pid}-{}", u64::from(seed) + n)))
        .find(|p| fs::symlink_metadata(p).is_err())
        .unwrap_or_else(|| parent.join(format!(".{name}.{what}-{pid}")))
}

/// After a commit was cut short: puts `aside` back as `target` if the target is missing,
/// otherwise removes it (the new output is in place). One line saying which.
pub(crate) fn settle_aside(aside: &Path, target: &Path) -> String {
    if fs::symlink_metadata(target).is_err() && fs::rename(aside, target).is_ok() {
        format!(
            "put the previous output back at {} (from {})",
            target.display(),
            aside.display()
        )
    } else {
        remove_tree(aside);
        format!(
            "removed {}, the previous output an interrupted commit had replaced",
            aside.display()
        )
    }
}

/// Removes (or restores) what dead runs on the same output left: `.<name>.partial-<pid>-*`
/// staging directories and `.<name>.replaced-<pid>-*` old outputs whose process is gone. A
/// staging directory with a resume manifest is kept under [`StaleStaging::KeepResumable`];
/// `adopt` is always kept.
fn recover_stale(
    parent: &Path,
    name: &std::ffi::OsStr,
    target: &Path,
    resumable: StaleStaging,
    adopt: Option<&Path>,
) -> Vec<String> {
    let mut done = Vec::new();
    let Some(name) = name.to_str() else {
        return done;
    };
    let Ok(entries) = fs::read_dir(parent) else {
        return done;
    };
    let partial = format!(".{name}.partial-");
    let replaced = format!(".{name}.replaced-");
    let mut found: Vec<(PathBuf, bool)> = Vec::new();
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        let (rest, is_partial) = match (
            file_name.strip_prefix(&partial),
            file_name.strip_prefix(&replaced),
        ) {
            (Some(rest), _) => (rest, true),
            (None, Some(rest)) => (rest, false),
            _ => continue,
        };
        if owner(rest).is_some_and(|pid| !process_alive(pid)) {
            found.push((entry.path(), is_partial));
        }
    }
    found.sort();
    for (path, is_partial) in found {
        if is_partial {
            if adopt == Some(path.as_path()) {
                continue;
            }
            let manifest = path.join(RESUME_DIR).join(RESUME_MANIFEST);
            let is_resumable = manifest.is_file();
            if is_resumable && resumable == StaleStaging::KeepResumable {
                continue;
            }
            remove_tree(&path);
            done.push(if is_resumable {
                format!(
                    "removed {}, the staging directory of a run that did not finish (it held \
                     completed layers: --resume would have continued it)",
                    path.display()
                )
            } else {
                format!(
                    "removed {}, the staging directory of a run that did not finish",
                    path.display()
                )
            });
        } else {
            done.push(settle_aside(&path, target));
        }
    }
    done
}

/// The pid of `<pid>-<alphanumeric suffix>`.
fn owner(rest: &str) -> Option<u32> {
    let (pid, suffix) = rest.split_once('-')?;
    let plain = |s: &str, f: fn(char) -> bool| !s.is_empty() && s.chars().all(f);
    if !plain(pid, |c| c.is_ascii_digit()) || !plain(suffix, |c| c.is_ascii_alphanumeric()) {
        return None;
    }
    pid.parse().ok()
}

/// Whether process `pid` exists (in doubt: yes).
fn process_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        if pid == std::process::id() {
            return true;
        }
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return true;
        };
        // SAFETY: signal 0 only checks that the process exists.
        if unsafe { libc::kill(pid, 0) } == 0 {
            return true;
        }
        std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// The lock file `.<name>.lock` next to the output, held with `flock` while it lives and removed
/// when dropped.
#[derive(Debug)]
struct OutputLock {
    path: PathBuf,
    #[cfg(unix)]
    _file: fs::File,
}

impl OutputLock {
    /// Takes the lock of `target` (whose parent is `parent` and name `name`); `None` on
    /// platforms without `flock`.
    #[cfg(unix)]
    fn acquire(
        parent: &Path,
        name: &std::ffi::OsStr,
        target: &Path,
    ) -> Result<Option<Self>, ExportError> {
        use std::io::Write;
        use std::os::unix::fs::MetadataExt;
        use std::os::unix::io::AsRawFd;

        let path = parent.join(format!(".{}.lock", name.to_string_lossy()));
        for _ in 0..16 {
            let mut file = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(ExportError::io(&path))?;
            // SAFETY: flock on a descriptor `file` owns.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                    return Err(ExportError::io(&path)(err));
                }
                let holder = fs::read_to_string(&path)
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok())
                    .map(|pid| format!(" by process {pid}"))
                    .unwrap_or_default();
                return Err(ExportError::Locked {
                    target: target.to_path_buf(),
                    lock: path,
                    holder,
                });
            }
            // A holder removes the file before releasing it: the lock counts only if the file
            // locked is still the one at the path.
            let held = file.metadata().map_err(ExportError::io(&path))?;
            match fs::metadata(&path) {
                Ok(now) if now.dev() == held.dev() && now.ino() == held.ino() => {
                    let _ = file.set_len(0);
                    let _ = write!(file, "{}", std::process::id());
                    return Ok(Some(Self { path, _file: file }));
                }
                _ => continue,
            }
        }
        Err(ExportError::Io {
            path,
            source: std::io::Error::other("the lock file keeps changing; is another run starting?"),
        })
    }

    #[cfg(not(unix))]
    fn acquire(
        _parent: &Path,
        _name: &std::ffi::OsStr,
        _target: &Path,
    ) -> Result<Option<Self>, ExportError> {
        Ok(None)
    }
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        // Removed while still held, so that nobody can lock the old file after us.
        let _ = fs::remove_file(&self.path);
    }
}

fn split_target(target: &Path) -> Result<(PathBuf, OsString), ExportError> {
    let name = target.file_name().ok_or_else(|| ExportError::Io {
        path: target.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "output path has no final directory name",
        ),
    })?;
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name.to_os_string()))
}

/// The ancestors of `dir` that do not exist yet, deepest first.
fn missing_ancestors(dir: &Path) -> Vec<PathBuf> {
    dir.ancestors()
        .filter(|a| !a.as_os_str().is_empty())
        .take_while(|a| fs::symlink_metadata(a).is_err())
        .map(Path::to_path_buf)
        .collect()
}

/// `path` with its longest existing ancestor canonicalized and the rest appended as given.
fn resolve_lenient(path: &Path) -> Result<PathBuf, ExportError> {
    let mut existing = path;
    let mut rest = Vec::new();
    while !existing.exists() {
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => break,
        }
    }
    let base = if existing.as_os_str().is_empty() {
        Path::new(".")
    } else {
        existing
    };
    let mut resolved = fs::canonicalize(base).map_err(ExportError::io(base))?;
    resolved.extend(rest.iter().rev());
    Ok(resolved)
}

fn refuse_source(resolved_target: &Path, source: &Path) -> Result<(), ExportError> {
    let source = fs::canonicalize(source).map_err(ExportError::io(source))?;
    // The target must neither be the source, nor hold it, nor sit inside it (a checkpoint
    // written into the model directory would mix with the model's own files).
    if source.starts_with(resolved_target) || resolved_target.starts_with(&source) {
        return Err(ExportError::TargetIsSource {
            target: resolved_target.to_path_buf(),
            source_dir: source,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// A directory that passes for a checkpoint.
    fn checkpoint(dir: &Path, marker: &str) {
        fs::create_dir_all(dir).unwrap();
        fs::write(dir.join(REPORT_FILE), "{}").unwrap();
        fs::write(dir.join("marker"), marker).unwrap();
    }

    #[test]
    fn dropped_staging_leaves_nothing() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("out");
        let staged = StagedDir::create(&target, false, None).unwrap();
        fs::write(staged.path().join("x"), b"1").unwrap();
        drop(staged);
        assert!(entries(root.path()).is_empty());
    }

    #[test]
    fn dropped_staging_removes_the_parents_it_created() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("a/b/out");
        let staged = StagedDir::create(&target, false, None).unwrap();
        assert!(root.path().join("a/b").is_dir());
        drop(staged);
        assert!(entries(root.path()).is_empty());
    }

    #[test]
    fn commit_renames_and_overwrite_replaces() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("out");
        let staged = StagedDir::create(&target, false, None).unwrap();
        fs::write(staged.path().join(REPORT_FILE), b"1").unwrap();
        staged.commit().unwrap();
        assert_eq!(entries(&target), [REPORT_FILE]);

        assert!(matches!(
            StagedDir::create(&target, false, None),
            Err(ExportError::TargetExists { .. })
        ));
        let staged = StagedDir::create(&target, true, None).unwrap();
        fs::write(staged.path().join("b"), b"2").unwrap();
        staged.commit().unwrap();
        assert_eq!(entries(&target), ["b"]);
        assert_eq!(entries(root.path()), ["out"]);
    }

    #[test]
    fn a_failed_commit_keeps_the_old_output() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("out");
        checkpoint(&target, "old");
        let staged = StagedDir::create(&target, true, None).unwrap();
        // The staging directory vanishes: the second rename fails, the old output comes back.
        fs::remove_dir_all(staged.path()).unwrap();
        assert!(staged.commit().is_err());
        assert_eq!(fs::read_to_string(target.join("marker")).unwrap(), "old");
        assert_eq!(entries(root.path()), ["out"]);
    }

    #[test]
    fn overwrite_replaces_only_checkpoints() {
        let root = tempfile::tempdir().unwrap();
        let user = root.path().join("documents");
        fs::create_dir(&user).unwrap();
        fs::write(user.join("thesis.tex"), "precious").unwrap();
        let file = root.path().join("file");
        fs::write(&file, "x").unwrap();
        for target in [&user, &file] {
            let err = StagedDir::create(target, true, None).unwrap_err();
            assert!(matches!(err, ExportError::NotReplaceable { .. }), "{err}");
            assert!(check_output(target, true, None, &[]).is_err());
        }
        assert_eq!(
            fs::read_to_string(user.join("thesis.tex")).unwrap(),
            "precious"
        );
        assert_eq!(entries(root.path()), ["documents", "file"]);

        // An input of the run inside a checkpoint directory: refused too.
        let out = root.path().join("out");
        checkpoint(&out, "old");
        let calib = out.join("calib.jsonl");
        fs::write(&calib, "{}").unwrap();
        let err = check_output(&out, true, None, &[&calib]).unwrap_err();
        assert!(err.to_string().contains("calib.jsonl"), "{err}");
        // An empty directory may be replaced.
        let empty = root.path().join("empty");
        fs::create_dir(&empty).unwrap();
        assert!(check_output(&empty, true, None, &[]).is_ok());
    }

    #[test]
    fn a_second_run_on_the_same_output_is_refused_while_the_first_holds_the_lock() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("out");
        let first = StagedDir::create(&target, false, None).unwrap();
        let err = StagedDir::create(&target, false, None).unwrap_err();
        assert!(matches!(err, ExportError::Locked { .. }), "{err}");
        assert!(err.to_string().contains(".out.lock"), "{err}");
        assert!(check_output(&target, false, None, &[]).is_err());
        drop(first);
        assert!(entries(root.path()).is_empty());
        assert!(check_output(&target, false, None, &[]).is_ok());
        StagedDir::create(&target, false, None).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn what_dead_runs_left_is_cleaned_up_and_live_ones_are_kept() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("out");
        // A pid that cannot be alive (beyond pid_max) and ours (alive).
        let dead = format!(".out.partial-{}-abc123", 999_999_999u32);
        let live = format!(".out.partial-{}-abc123", std::process::id());
        let other = ".other.partial-999999999-abc123".to_string();
        for name in [&dead, &live, &other] {
            fs::create_dir(root.path().join(name)).unwrap();
        }
        // An old output moved aside by a commit that was killed: put back.
        let aside = root.path().join(".out.replaced-999999999-7");
        checkpoint(&aside, "old");
        let staged = StagedDir::create(&target, true, None).unwrap();
        assert_eq!(staged.recovered().len(), 2, "{:?}", staged.recovered());
        assert_eq!(fs::read_to_string(target.join("marker")).unwrap(), "old");
        drop(staged);
        assert_eq!(entries(root.path()), [other, live, "out".to_string()]);
    }

    #[test]
    fn refuses_the_source_directory_and_its_ancestors() {
        let root = tempfile::tempdir().unwrap();
        let source = root.path().join("model");
        fs::create_dir(&source).unwrap();
        for target in [source.clone(), root.path().to_path_buf()] {
            assert!(matches!(
                StagedDir::create(&target, true, Some(&source)),
                Err(ExportError::TargetIsSource { .. })
            ));
        }
        assert!(StagedDir::create(&root.path().join("q"), false, Some(&source)).is_ok());
        // Inside the source, even in a directory that does not exist yet: refused, nothing created.
        let inside = source.join("sub/q");
        assert!(matches!(
            StagedDir::create(&inside, false, Some(&source)),
            Err(ExportError::TargetIsSource { .. })
        ));
        assert!(!source.join("sub").exists());
    }
}
