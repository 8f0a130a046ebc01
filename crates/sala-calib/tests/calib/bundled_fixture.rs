//! The bundled `fixtures/calib/calib.jsonl` (written by `cargo run --example make_calib`) reads
//! cleanly and holds the mix it promises.

use std::path::PathBuf;

use sala_calib::{read_jsonl, CalibText, ReadOptions};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/calib/calib.jsonl")
}

#[test]
fn bundled_calibration_file_is_strict_jsonl_with_short_long_and_chat_records() {
    let path = fixture();
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size < 1_000_000, "{} is {size} bytes", path.display());

    let read = read_jsonl(&path, &ReadOptions::default()).unwrap();
    let plain_lengths: Vec<usize> = read
        .records
        .iter()
        .filter_map(|r| match &r.text {
            CalibText::Plain(text) => Some(text.len()),
            CalibText::Chat(_) => None,
        })
        .collect();
    let chats = read.records.len() - plain_lengths.len();
    let short = plain_lengths.iter().filter(|&&n| n < 2_000).count();
    // Several thousand tokens at about 3 characters per token.
    let long = plain_lengths.iter().filter(|&&n| n >= 15_000).count();
    assert!(short >= 40, "{short} short records");
    assert!(long >= 4, "{long} long records");
    assert!(chats >= 3, "{chats} chat records");
}
