//! What an interrupted run leaves behind: nothing. Every live staging directory is registered
//! here; [`remove_staging_on_interrupt`] installs a handler for SIGINT, SIGTERM and SIGHUP that
//! removes them (and restores an output that a commit had moved aside), releases their lock
//! files, and then lets the signal terminate the process as it would have.
//!
//! The handler itself only writes the signal number into a pipe (the one thing a signal
//! handler may safely do); a watcher thread reads it and does the file-system work. A commit
//! holds the registry while it renames, so the watcher never removes a directory that is being
//! renamed into place: it waits for the commit and then finds nothing left to remove.
//!
//! SIGKILL cannot be caught: what it leaves is removed (or restored) by the next run on the same
//! output, see [`crate::StagedDir::create`] (or continued by a resuming run).
//!
//! A resumable run's staging directory that already holds a completed layer
//! ([`crate::StagedDir::set_resumable`]) is kept on interrupt, so that the run can be resumed.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// One staging directory in flight.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) id: u64,
    /// The staging directory (removed on interrupt).
    pub(crate) staging: PathBuf,
    /// The output it will become.
    pub(crate) target: PathBuf,
    /// While a commit replaces an old output: where the old output was moved to.
    pub(crate) aside: Option<PathBuf>,
    /// The output's lock file (removed on interrupt).
    pub(crate) lock: Option<PathBuf>,
    /// Kept on interrupt: a resumable run's staging directory that holds at least one
    /// completed layer (see [`crate::StagedDir::set_resumable`]).
    pub(crate) keep: bool,
}

pub(crate) struct Registry {
    next: u64,
    pending: Vec<Pending>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    next: 0,
    pending: Vec::new(),
});

/// The registry, locked (a poisoned lock is still usable: its data are plain paths).
pub(crate) fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

impl Registry {
    /// Registers a staging directory; returns its id.
    pub(crate) fn add(&mut self, staging: &Path, target: &Path, lock: Option<&Path>) -> u64 {
        self.next += 1;
        self.pending.push(Pending {
            id: self.next,
            staging: staging.to_path_buf(),
            target: target.to_path_buf(),
            aside: None,
            lock: lock.map(Path::to_path_buf),
            keep: false,
        });
        self.next
    }

    /// Records (or clears) where a commit moved the old output.
    pub(crate) fn set_aside(&mut self, id: u64, aside: Option<&Path>) {
        if let Some(p) = self.pending.iter_mut().find(|p| p.id == id) {
            p.aside = aside.map(Path::to_path_buf);
        }
    }

    /// Marks a staging directory as one to keep on interrupt (or not).
    pub(crate) fn set_keep(&mut self, id: u64, keep: bool) {
        if let Some(p) = self.pending.iter_mut().find(|p| p.id == id) {
            p.keep = keep;
        }
    }

    /// Forgets a staging directory (committed or removed).
    pub(crate) fn remove(&mut self, id: u64) {
        self.pending.retain(|p| p.id != id);
    }

    /// Removes every registered staging directory (but keeps those marked to keep: a
    /// resumable run's), puts back outputs moved aside, removes the lock files; returns one
    /// line per action.
    fn clean_all(&mut self) -> Vec<String> {
        let mut done = Vec::new();
        for p in self.pending.drain(..) {
            if p.keep {
                done.push(format!(
                    "kept the staging directory {}: it holds completed layers; run the same \
                     command again with --resume to continue",
                    p.staging.display()
                ));
            } else if remove_tree(&p.staging) {
                done.push(format!(
                    "removed the staging directory {}",
                    p.staging.display()
                ));
            }
            if let Some(aside) = &p.aside {
                done.push(crate::staging::settle_aside(aside, &p.target));
            }
            if let Some(lock) = &p.lock {
                let _ = std::fs::remove_file(lock);
            }
        }
        done
    }
}

/// Removes `dir` and everything below, retrying while another thread still creates files in it.
/// True if it existed.
pub(crate) fn remove_tree(dir: &Path) -> bool {
    if std::fs::symlink_metadata(dir).is_err() {
        return false;
    }
    for _ in 0..20 {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
    true
}

/// Installs the SIGINT / SIGTERM / SIGHUP handler (once per process; later calls do nothing).
///
/// Meant for binaries: after an interrupt the process ends, killed by the same signal (exit
/// status 130 for SIGINT in a shell), once every registered staging directory is removed. On
/// platforms other than Unix it does nothing.
pub fn remove_staging_on_interrupt() -> Result<(), std::io::Error> {
    #[cfg(unix)]
    {
        static INSTALLED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
        INSTALLED
            .get_or_init(|| unix::install().map_err(|e| e.to_string()))
            .clone()
            .map_err(std::io::Error::other)
    }
    #[cfg(not(unix))]
    {
        Ok(())
    }
}

#[cfg(unix)]
mod unix {
    use std::io::Write;
    use std::sync::atomic::{AtomicI32, Ordering};

    static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);

    extern "C" fn on_signal(signal: libc::c_int) {
        let fd = PIPE_WRITE.load(Ordering::Relaxed);
        if fd >= 0 {
            let byte = signal as u8;
            // SAFETY: write(2) is async-signal-safe; the buffer is a live local byte.
            unsafe { libc::write(fd, (&byte as *const u8).cast(), 1) };
        }
    }

    pub(super) fn install() -> std::io::Result<()> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` has room for the two descriptors pipe(2) writes.
        if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        for fd in fds {
            // SAFETY: fcntl on descriptors this function owns.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        let read_fd = fds[0];
        PIPE_WRITE.store(fds[1], Ordering::Relaxed);
        std::thread::Builder::new()
            .name("sala-interrupt".into())
            .spawn(move || watch(read_fd))?;
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: a zeroed sigaction is valid; the handler only calls write(2).
            let ok = unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(signal, &action, std::ptr::null_mut()) == 0
            };
            if !ok {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }

    fn watch(read_fd: libc::c_int) {
        let signal = loop {
            let mut byte = 0u8;
            // SAFETY: reads one byte into a live local.
            let n = unsafe { libc::read(read_fd, (&mut byte as *mut u8).cast(), 1) };
            if n == 1 {
                break libc::c_int::from(byte);
            }
            if n == 0 {
                return;
            }
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return;
            }
        };
        // Keep the registry locked until the process is gone: no commit may start after this.
        let mut registry = super::registry();
        let done = registry.clean_all();
        let name = match signal {
            libc::SIGINT => "SIGINT",
            libc::SIGTERM => "SIGTERM",
            _ => "SIGHUP",
        };
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "interrupted by {name}");
        for line in done {
            let _ = writeln!(err, "{line}");
        }
        drop(err);
        std::mem::forget(registry);
        // SAFETY: restoring the default action and raising the signal ends the process as the
        // signal would have (status "killed by SIGINT"); _exit is the fallback.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
            libc::_exit(128 + signal);
        }
    }
}
