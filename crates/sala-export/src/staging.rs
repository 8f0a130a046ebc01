//! The directory transaction: everything is written into a hidden temporary directory next to
//! the target and renamed into place at the end, so a reader never sees a half-written
//! checkpoint and an error (or a panic, or a dropped writer) leaves the target untouched.

use std::fs;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

use crate::ExportError;

/// A staging directory that becomes `target` on [`StagedDir::commit`] and is removed otherwise.
#[derive(Debug)]
pub struct StagedDir {
    target: PathBuf,
    staging: TempDir,
    overwrite: bool,
}

impl StagedDir {
    /// Creates the staging directory in `target`'s parent (created if missing).
    ///
    /// Fails if `target` exists and `overwrite` is false, or if `target` is `source`, one of its
    /// ancestors (replacing it would destroy the input) or inside it.
    pub fn create(
        target: &Path,
        overwrite: bool,
        source: Option<&Path>,
    ) -> Result<Self, ExportError> {
        let (parent, name) = split_target(target)?;
        // Checked before anything is created, so a refused target leaves no directory behind.
        if let Some(source) = source {
            refuse_source(&resolve_lenient(&parent)?.join(&name), source)?;
        }
        fs::create_dir_all(&parent).map_err(ExportError::io(&parent))?;
        let resolved = fs::canonicalize(&parent)
            .map_err(ExportError::io(&parent))?
            .join(&name);
        if resolved.exists() && !overwrite {
            return Err(ExportError::TargetExists {
                path: target.to_path_buf(),
            });
        }
        let staging = tempfile::Builder::new()
            .prefix(&format!(".{}.partial-", name.to_string_lossy()))
            .tempdir_in(&parent)
            .map_err(ExportError::io(&parent))?;
        Ok(Self {
            target: resolved,
            staging,
            overwrite,
        })
    }

    /// Where files are written until the commit.
    pub fn path(&self) -> &Path {
        self.staging.path()
    }

    /// The final location (parent canonicalized).
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Renames the staging directory into place; with `overwrite`, the old target is moved
    /// aside first and deleted only after the new one is in place.
    pub fn commit(self) -> Result<PathBuf, ExportError> {
        let parent = self.target.parent().unwrap_or(Path::new("."));
        // The old checkpoint goes into its own temporary directory, removed when it drops.
        let aside = match self.target.exists() {
            true if !self.overwrite => {
                return Err(ExportError::TargetExists { path: self.target });
            }
            true => {
                let aside = tempfile::Builder::new()
                    .prefix(".replaced-")
                    .tempdir_in(parent)
                    .map_err(ExportError::io(parent))?;
                let old = aside.path().join("old");
                fs::rename(&self.target, &old).map_err(ExportError::io(&self.target))?;
                Some((aside, old))
            }
            false => None,
        };
        if let Err(source) = fs::rename(self.staging.path(), &self.target) {
            if let Some((_, old)) = &aside {
                // Put the previous checkpoint back; the staging directory drops with `self`.
                let _ = fs::rename(old, &self.target);
            }
            return Err(ExportError::Io {
                path: self.target,
                source,
            });
        }
        // The staging path no longer exists; `keep` stops the drop from trying to remove it.
        let _ = self.staging.keep();
        Ok(self.target)
    }
}

fn split_target(target: &Path) -> Result<(PathBuf, std::ffi::OsString), ExportError> {
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
    fn commit_renames_and_overwrite_replaces() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("out");
        let staged = StagedDir::create(&target, false, None).unwrap();
        fs::write(staged.path().join("a"), b"1").unwrap();
        staged.commit().unwrap();
        assert_eq!(entries(&target), ["a"]);

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
