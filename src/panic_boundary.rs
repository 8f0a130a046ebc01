//! Where a panic inside a run becomes an error line. CubeCL's CUDA server unwraps a failed
//! allocation (`can't allocate buffer of size: N`) on its own thread, and a library bug would
//! panic too: the hook installed by [`install_hook`] keeps the first panic's message instead of
//! printing it, the job runs under [`run_guarded`], and a panic comes back as one error that
//! says where the run was (layer and stage, from [`set_place`]), what failed (the buffer's size
//! when the runtime names it), the budget and the option that lowers it. Unwinding drops the
//! staged checkpoint, which removes its directory as any other error does.

use std::error::Error;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

/// The first panic's message and location since the hook was installed.
static FIRST_PANIC: Mutex<Option<String>> = Mutex::new(None);
/// Where the run is (`layer 5, capture`), for the error.
static PLACE: Mutex<String> = Mutex::new(String::new());

/// What the runtime says when an allocation fails (CubeCL's CUDA server).
const ALLOCATION_FAILED: &str = "can't allocate buffer of size: ";

/// Replaces the default panic hook by one that keeps the first panic's message for
/// [`run_guarded`] (and prints its backtrace when `RUST_BACKTRACE` asks for one).
pub fn install_hook() {
    std::panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".to_owned());
        let located = match info.location() {
            Some(at) => format!("{message} (at {}:{})", at.file(), at.line()),
            None => message,
        };
        // A genuine bug needs its trace: printed at once when RUST_BACKTRACE asks for it.
        let trace = std::backtrace::Backtrace::capture();
        if trace.status() == std::backtrace::BacktraceStatus::Captured {
            eprintln!("panic: {located}\n{trace}");
        }
        if let Ok(mut first) = FIRST_PANIC.lock() {
            first.get_or_insert(located);
        }
    }));
}

/// Records where the run is, e.g. `layer 5, capture`.
pub fn set_place(place: String) {
    if let Ok(mut p) = PLACE.lock() {
        *p = place;
    }
}

/// The device budget a run was planned for, as the error names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBudget {
    /// Bytes (`--max-device-memory`).
    pub bytes: u64,
    /// Whether the plan kept the hidden states on the device: if so, a lower budget moves
    /// them to the host; if not, they are there already.
    pub hidden_on_device: bool,
}

/// Runs `job`; a panic inside it (on this thread, or first on a runtime thread) becomes an
/// error ([`describe`]) with `budget` named.
pub fn run_guarded<T>(
    budget: Option<DeviceBudget>,
    job: impl FnOnce() -> Result<T, Box<dyn Error>>,
) -> Result<T, Box<dyn Error>> {
    match catch_unwind(AssertUnwindSafe(job)) {
        Ok(result) => result,
        Err(payload) => {
            let first = FIRST_PANIC.lock().ok().and_then(|mut f| f.take());
            let message = first
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic without a message".to_owned());
            let place = PLACE.lock().map(|p| p.clone()).unwrap_or_default();
            Err(describe(&message, &place, budget).into())
        }
    }
}

/// The error line for a panic `message` at `place` under `budget`.
pub fn describe(message: &str, place: &str, budget: Option<DeviceBudget>) -> String {
    let place = match place {
        "" => "before the first layer".to_owned(),
        p => format!("in {p}"),
    };
    // What a lower budget changes: the packs, and the hidden states' place if they were on
    // the device.
    let lowers = match budget {
        Some(DeviceBudget {
            hidden_on_device: false,
            ..
        }) => "smaller packs; the hidden states are on the host already",
        _ => "smaller packs, hidden states on the host",
    };
    let budget = budget.map_or("no device budget".to_owned(), |b| {
        format!("a device budget of {:.0} MB", b.bytes as f64 / 1e6)
    });
    let bytes = message.find(ALLOCATION_FAILED).and_then(|at| {
        let digits: String = message[at + ALLOCATION_FAILED.len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse::<u64>().ok()
    });
    let out_of_memory = bytes.is_some() || message.contains("OUT_OF_MEMORY");
    match (out_of_memory, bytes) {
        (true, Some(bytes)) => format!(
            "the GPU ran out of memory {place}: the runtime could not allocate a buffer of {:.1} \
             GB, with {budget}; lower --max-device-memory ({lowers}) or --max-len",
            bytes as f64 / 1e9
        ),
        (true, None) => format!(
            "the GPU ran out of memory {place}, with {budget}; lower --max-device-memory \
             ({lowers}) or --max-len ({message})"
        ),
        _ => format!(
            "internal error {place}: {message} (RUST_BACKTRACE=1 prints where it came from)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allocation_failure_names_the_place_the_size_and_the_option() {
        let message = "called `Result::unwrap()` on an `Err` value: can't allocate buffer of \
                       size: 37527470080";
        let budget = DeviceBudget {
            bytes: 76_000_000_000,
            hidden_on_device: true,
        };
        let line = describe(message, "layer 5, capture", Some(budget));
        assert!(line.contains("in layer 5, capture"), "{line}");
        assert!(line.contains("37.5 GB"), "{line}");
        assert!(line.contains("76000 MB"), "{line}");
        assert!(line.contains("--max-device-memory"), "{line}");
        assert!(line.contains("hidden states on the host)"), "{line}");
        assert!(!line.contains('\n'));
        let on_host = DeviceBudget {
            hidden_on_device: false,
            ..budget
        };
        let line = describe(message, "the embedding, before layer 0", Some(on_host));
        assert!(line.contains("in the embedding, before layer 0"), "{line}");
        assert!(line.contains("on the host already"), "{line}");
        let other = describe("index out of bounds", "", None);
        assert!(
            other.starts_with("internal error before the first layer: index out of bounds"),
            "{other}"
        );
        assert!(other.contains("RUST_BACKTRACE=1"), "{other}");
    }

    #[test]
    fn a_panic_in_the_job_becomes_an_error() {
        set_place("layer 2, solve".to_owned());
        let budget = DeviceBudget {
            bytes: 1_000_000,
            hidden_on_device: true,
        };
        let result: Result<(), _> = run_guarded(Some(budget), || {
            std::panic::panic_any("can't allocate buffer of size: 2000000000".to_owned())
        });
        let line = result.unwrap_err().to_string();
        assert!(
            line.contains("layer 2, solve") && line.contains("2.0 GB"),
            "{line}"
        );
        set_place(String::new());
        let fine: Result<u8, Box<dyn Error>> = run_guarded(None, || Ok(3));
        assert_eq!(fine.unwrap(), 3);
    }
}
