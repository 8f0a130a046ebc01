//! Reading calibration records from JSONL.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{CalibError, LineError, Result};

/// One chat turn of a `messages` record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// The turn's text.
    pub content: String,
}

/// What a record asks to be tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalibText {
    /// Raw text (`question` or `text`), tokenized as it is.
    Plain(String),
    /// A conversation, rendered with the tokenizer's chat template first.
    Chat(Vec<ChatMessage>),
}

/// One usable line of a calibration JSONL file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalibRecord {
    /// 1-based line number in the file.
    pub line: usize,
    /// The record's content.
    pub text: CalibText,
}

/// A line that was skipped because it is malformed (only with [`ReadOptions::skip_malformed`]).
#[derive(Debug)]
pub struct SkippedLine {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub reason: LineError,
}

/// How strictly a JSONL file is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Skip malformed lines (and count them) instead of failing on the first one.
    pub skip_malformed: bool,
}

/// The records of a JSONL file, in file order, and the lines skipped.
#[derive(Debug, Default)]
pub struct JsonlRecords {
    /// Usable records.
    pub records: Vec<CalibRecord>,
    /// Malformed lines that were skipped.
    pub skipped: Vec<SkippedLine>,
}

/// Reads a calibration JSONL file.
///
/// Each non-blank line must be an object with a string `question` or `text` (the original
/// scripts' fields, `question` first), or a `messages` array of `{role, content}` objects.
/// Blank lines are ignored. A malformed line fails with its line number unless
/// `options.skip_malformed`, which records it in [`JsonlRecords::skipped`] instead.
pub fn read_jsonl(path: &Path, options: &ReadOptions) -> Result<JsonlRecords> {
    let file = File::open(path).map_err(|source| CalibError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_jsonl(BufReader::new(file), path, options)
}

/// The longest calibration line read, in bytes (16 MiB): far beyond a 131072-token sample
/// (about 0.6 MB of text), and a bound on what one line may cost (a file without newlines,
/// such as `/dev/zero`, fails after reading this much).
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// [`read_jsonl`] over any reader; `path` is only used in errors. A line longer than
/// [`MAX_LINE_BYTES`] fails, even with `skip_malformed` (the rest of it is never read).
pub fn parse_jsonl(
    mut reader: impl BufRead,
    path: &Path,
    options: &ReadOptions,
) -> Result<JsonlRecords> {
    let mut out = JsonlRecords::default();
    let mut bytes = Vec::new();
    for line in 1.. {
        bytes.clear();
        let read = (&mut reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut bytes)
            .map_err(|source| CalibError::Malformed {
                path: path.to_owned(),
                line,
                reason: LineError::Read(source),
            })?;
        if read == 0 {
            break;
        }
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
        } else if bytes.len() > MAX_LINE_BYTES {
            return Err(CalibError::Malformed {
                path: path.to_owned(),
                line,
                reason: LineError::TooLong(MAX_LINE_BYTES),
            });
        }
        // The byte-order mark some editors write at the start of a file.
        if line == 1 && bytes.starts_with(b"\xEF\xBB\xBF") {
            return Err(CalibError::Malformed {
                path: path.to_owned(),
                line,
                reason: LineError::ByteOrderMark,
            });
        }
        match parse_line(&bytes) {
            Ok(None) => {}
            Ok(Some(text)) => out.records.push(CalibRecord { line, text }),
            Err(reason) if options.skip_malformed => out.skipped.push(SkippedLine { line, reason }),
            Err(reason) => {
                return Err(CalibError::Malformed {
                    path: path.to_owned(),
                    line,
                    reason,
                })
            }
        }
    }
    Ok(out)
}

/// Parses one line; `Ok(None)` for a blank line.
fn parse_line(bytes: &[u8]) -> std::result::Result<Option<CalibText>, LineError> {
    let line = std::str::from_utf8(bytes).map_err(|_| LineError::Utf8)?;
    if line.trim().is_empty() {
        return Ok(None);
    }
    let Value::Object(object) = serde_json::from_str::<Value>(line)? else {
        return Err(LineError::NotAnObject);
    };
    for field in ["question", "text"] {
        if let Some(value) = object.get(field) {
            return plain_text(field, value).map(Some);
        }
    }
    match object.get("messages") {
        Some(messages) => chat_messages(messages).map(|m| Some(CalibText::Chat(m))),
        None => Err(LineError::NoTextField),
    }
}

fn plain_text(field: &'static str, value: &Value) -> std::result::Result<CalibText, LineError> {
    match value {
        Value::String(text) if text.is_empty() => Err(LineError::Empty(field)),
        Value::String(text) => Ok(CalibText::Plain(text.clone())),
        _ => Err(LineError::NotAString(field)),
    }
}

fn chat_messages(value: &Value) -> std::result::Result<Vec<ChatMessage>, LineError> {
    let Value::Array(items) = value else {
        return Err(LineError::Messages("not an array".to_owned()));
    };
    if items.is_empty() {
        return Err(LineError::Messages("the array is empty".to_owned()));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::Object(turn) => chat_message(turn).ok_or_else(|| {
                LineError::Messages(format!("message {i} lacks a string role or content"))
            }),
            _ => Err(LineError::Messages(format!("message {i} is not an object"))),
        })
        .collect()
}

fn chat_message(turn: &Map<String, Value>) -> Option<ChatMessage> {
    Some(ChatMessage {
        role: turn.get("role")?.as_str()?.to_owned(),
        content: turn.get("content")?.as_str()?.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, skip: bool) -> Result<JsonlRecords> {
        let options = ReadOptions {
            skip_malformed: skip,
        };
        parse_jsonl(text.as_bytes(), Path::new("calib.jsonl"), &options)
    }

    #[test]
    fn reads_every_record_kind_with_line_numbers() {
        let text = concat!(
            "{\"question\": \"q\", \"text\": \"ignored\", \"_source\": \"x\"}\n",
            "\n",
            "{\"text\": \"t\"}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
        );
        let read = parse(text, false).unwrap();
        let lines: Vec<usize> = read.records.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![1, 3, 4]);
        assert_eq!(read.records[0].text, CalibText::Plain("q".into()));
        assert_eq!(read.records[1].text, CalibText::Plain("t".into()));
        assert_eq!(
            read.records[2].text,
            CalibText::Chat(vec![ChatMessage {
                role: "user".into(),
                content: "hi".into()
            }])
        );
    }

    #[test]
    fn malformed_lines_fail_with_file_and_line() {
        let text = "{\"text\": \"ok\"}\n{\"text\": 3}\n";
        let err = parse(text, false).unwrap_err();
        assert_eq!(
            err.to_string(),
            "calib.jsonl:2: field `text` is not a string"
        );
    }

    #[test]
    fn every_kind_of_malformed_line_is_recognised_and_can_be_skipped() {
        let bad = [
            "{not json",
            "[1, 2]",
            "{\"other\": 1}",
            "{\"question\": \"\"}",
            "{\"messages\": []}",
            "{\"messages\": [{\"role\": \"user\"}]}",
            "{\"messages\": \"hi\"}",
        ];
        for line in bad {
            assert!(
                matches!(
                    parse(line, false),
                    Err(CalibError::Malformed { line: 1, .. })
                ),
                "{line}"
            );
        }
        let text = format!("{}\n{{\"text\": \"fine\"}}\n", bad.join("\n"));
        let read = parse(&text, true).unwrap();
        assert_eq!(read.records.len(), 1);
        assert_eq!(read.records[0].line, bad.len() + 1);
        let skipped: Vec<usize> = read.skipped.iter().map(|s| s.line).collect();
        assert_eq!(skipped, (1..=bad.len()).collect::<Vec<_>>());
    }

    #[test]
    fn an_endless_line_fails_after_the_bound_naming_the_line() {
        let endless = std::io::BufReader::new(std::io::repeat(b'x'));
        let err = parse_jsonl(endless, Path::new("zero"), &ReadOptions::default()).unwrap_err();
        assert!(
            matches!(
                err,
                CalibError::Malformed {
                    line: 1,
                    reason: LineError::TooLong(MAX_LINE_BYTES),
                    ..
                }
            ),
            "{err}"
        );
        // Also with skip_malformed: the rest of such a line is never read.
        let text = format!("{{\"text\": \"ok\"}}\n{}\n", "y".repeat(MAX_LINE_BYTES + 1));
        let options = ReadOptions {
            skip_malformed: true,
        };
        let err = parse_jsonl(text.as_bytes(), Path::new("f"), &options).unwrap_err();
        assert!(err.to_string().starts_with("f:2: "), "{err}");
        // A line of exactly the bound is read.
        let fits = format!("{{\"text\": \"{}\"}}", "z".repeat(MAX_LINE_BYTES - 12));
        assert_eq!(fits.len(), MAX_LINE_BYTES);
        assert_eq!(parse(&fits, false).unwrap().records.len(), 1);
    }

    #[test]
    fn a_byte_order_mark_is_named() {
        let err = parse("\u{feff}{\"text\": \"a\"}\n", false).unwrap_err();
        assert!(err.to_string().contains("byte-order mark"), "{err}");
        assert!(err.to_string().starts_with("calib.jsonl:1: "), "{err}");
    }

    #[test]
    fn invalid_utf8_is_a_malformed_line() {
        let bytes: &[u8] = b"{\"text\": \"ok\"}\n\xff\xfe\n";
        let err = parse_jsonl(bytes, Path::new("f.jsonl"), &ReadOptions::default()).unwrap_err();
        assert!(matches!(
            err,
            CalibError::Malformed {
                line: 2,
                reason: LineError::Utf8,
                ..
            }
        ));
    }
}
