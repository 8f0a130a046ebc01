//! Writes the bundled calibration set `fixtures/calib/calib.jsonl`, deterministically, from the
//! public-domain text in `fixtures/text/calib-source/` (see the README there).
//!
//! ```text
//! cargo run --release --example make_calib                  # rewrites fixtures/calib/calib.jsonl
//! cargo run --release --example make_calib -- --out /tmp/calib.jsonl
//! cargo run --release --example make_calib -- --production-mix --out calib-production.jsonl
//! ```
//!
//! The mix follows what the original team learned (short task-like samples *and* long documents,
//! bimodal): short `question` records (dictionary definitions, multiple-choice verse questions
//! answered `ANSWER: X`), a few `messages` chats, long `text` passages of several thousand tokens,
//! needle-in-a-haystack prompts with the answer appended, and common-word-extraction lists (low
//! token uniqueness). Every record carries `_source`, as the original `calib_dense_96.jsonl` did.
//! Output goes to a temporary file next to the target, then is renamed into place.

use std::collections::BTreeMap;
use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Parser;
use sala_quant::fixtures_dir;
use serde_json::{json, Value};

type AnyError = Box<dyn Error + Send + Sync>;

/// Seed of every random choice (the original builder shuffled with 42 too).
const SEED: u64 = 42;
/// Character budgets of the long passages: about 3.5 characters per token with the fixtures'
/// BPE, so they span the [1k, 5k) to [20k, 50k) token buckets. The last takes the rest.
const PASSAGE_CHARS: [usize; 7] = [6_000, 12_000, 20_000, 30_000, 45_000, 60_000, 90_000];
/// Short definition questions, then chats, taken from distinct dictionary entries.
const DEFINITIONS: usize = 48;
const CHATS: usize = 6;
/// Multiple-choice verse questions.
const MCQS: usize = 16;
/// Needle-in-a-haystack prompts: haystack size in characters and the needle's key.
const HAYSTACKS: [(usize, &str); 2] = [(15_000, "amber-harbor"), (40_000, "silent-orchard")];
/// Common-word-extraction lists: number of words listed.
const WORD_LISTS: [usize; 2] = [300, 900];

#[derive(Parser)]
#[command(about = "Write the bundled calibration JSONL from fixtures/text/calib-source")]
struct Args {
    /// Output file (default: fixtures/calib/calib.jsonl).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Instead of the bundled mix, write this many long `text` records (a load test of the
    /// full-size model, e.g. 96): windows of the King James chapters at evenly spaced offsets,
    /// wrapping around (they overlap when the text is shorter than their total). Needs --out.
    #[arg(long, requires = "out")]
    windows: Option<usize>,
    /// Characters per window (about 3.5 per token with the fixtures' BPE: 16000 gives more
    /// than 4096 tokens).
    #[arg(long, default_value_t = 16_000, requires = "windows")]
    window_chars: usize,
    /// Instead of the bundled mix, write the production length mix (a memory and speed test of
    /// the full-size model): 96 `text` windows of the King James chapters whose lengths follow
    /// the production calibration set's buckets (60 under 1k tokens, 4 of 1k–10k, 17 of
    /// 10k–50k, 9 of 50k–100k, 6 of 100k–131k; about 1.9 M tokens, the three longest cut to
    /// 131,072 by `quantize_sala --max-len`). Needs --out.
    #[arg(long, requires = "out", conflicts_with = "windows")]
    production_mix: bool,
}

/// Characters per token of the full-size fixture's byte-level BPE on this text (measured: the
/// first version of this mix, at 3.5, gave 2,292,365 tokens for 1,947,216 asked), to turn
/// token targets into window lengths.
const CHARS_PER_TOKEN: f64 = 2.95;

/// Token targets of `--production-mix`: `(count, first, last)` per bucket, lengths spread
/// evenly from `first` to `last`. The last bucket's three longest ask for 10 % more than
/// 131,072 tokens so that truncation, not the text, sets their length.
const PRODUCTION_BUCKETS: [(usize, usize, usize); 6] = [
    (60, 150, 950),
    (4, 2_000, 8_000),
    (17, 11_000, 47_000),
    (9, 52_000, 96_000),
    (3, 106_000, 122_000),
    (3, 144_200, 144_200),
];

/// Window lengths in characters of `--production-mix`, longest last.
fn production_window_chars() -> Vec<usize> {
    PRODUCTION_BUCKETS
        .iter()
        .flat_map(|&(count, first, last)| {
            (0..count).map(move |i| {
                let step = if count > 1 {
                    (last - first) / (count - 1)
                } else {
                    0
                };
                let tokens = first + i * step;
                (tokens as f64 * CHARS_PER_TOKEN).round() as usize
            })
        })
        .collect()
}

fn main() -> Result<(), AnyError> {
    let args = Args::parse();
    let out = args
        .out
        .unwrap_or_else(|| fixtures_dir().join("calib").join("calib.jsonl"));
    let sources = fixtures_dir().join("text").join("calib-source");
    let chapters = parse_chapters(&read(&sources.join("kjv-genesis-exodus.txt"))?);
    let entries = parse_entries(&read(&sources.join("devil-a-d.txt"))?);
    let short: Vec<&Entry> = entries.iter().filter(|e| e.is_short()).collect();
    if chapters.len() < 4 || short.len() < DEFINITIONS + CHATS {
        return Err(format!(
            "{}: too little text ({} chapters, {} short entries)",
            sources.display(),
            chapters.len(),
            short.len()
        )
        .into());
    }

    if let Some(count) = args.windows {
        if count == 0 || args.window_chars == 0 {
            return Err(format!(
                "--windows {count} --window-chars {}: both must be positive",
                args.window_chars
            )
            .into());
        }
        let records = windows(&chapters, &vec![args.window_chars; count]);
        return finish(&out, &records);
    }
    if args.production_mix {
        let records = windows(&chapters, &production_window_chars());
        return finish(&out, &records);
    }

    let mut rng = SplitMix(SEED);
    let mut records = Vec::new();
    records.extend(short[..DEFINITIONS].iter().map(|e| definition_question(e)));
    records.extend(
        short[DEFINITIONS..DEFINITIONS + CHATS]
            .iter()
            .enumerate()
            .map(|(i, e)| chat(e, i)),
    );
    records.extend((0..MCQS).map(|_| verse_mcq(&chapters, &mut rng)));
    records.extend(passages(&chapters));
    records.extend(
        HAYSTACKS
            .iter()
            .map(|&(chars, key)| needle_in_haystack(&entries, chars, key, &mut rng)),
    );
    let headwords: Vec<String> = short
        .iter()
        .take(24)
        .map(|e| e.word.to_lowercase())
        .collect();
    records.extend(
        WORD_LISTS
            .iter()
            .map(|&n| common_words(&headwords, n, &mut rng)),
    );
    rng.shuffle(&mut records);
    finish(&out, &records)
}

/// Writes `records` to `out` and says so.
fn finish(out: &Path, records: &[Value]) -> Result<(), AnyError> {
    write_atomically(out, records)?;
    let bytes = std::fs::metadata(out)?.len();
    println!(
        "wrote {} ({} records, {} bytes)",
        out.display(),
        records.len(),
        bytes
    );
    Ok(())
}

/// One `text` record per entry of `lengths` (characters), cut from the chapters' text laid end
/// to end at evenly spaced offsets (wrapping around), on character boundaries.
fn windows(chapters: &[Chapter], lengths: &[usize]) -> Vec<Value> {
    let count = lengths.len().max(1);
    let text: Vec<char> = chapters
        .iter()
        .map(|c| format!("{}\n\n", c.text()))
        .collect::<String>()
        .chars()
        .collect();
    let len = text.len();
    let stride = len / count;
    lengths
        .iter()
        .enumerate()
        .map(|(i, &chars)| {
            let window: String = (0..chars).map(|k| text[(i * stride + k) % len]).collect();
            json!({"_source": "kjv-window", "text": window})
        })
        .collect()
}

fn read(path: &Path) -> Result<String, AnyError> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()).into())
}

/// One chapter of the King James text: its title (`Genesis 1`) and verses (numbers stripped).
struct Chapter {
    title: String,
    verses: Vec<String>,
}

impl Chapter {
    fn book(&self) -> &str {
        self.title
            .rsplit_once(' ')
            .map_or(&self.title, |(book, _)| book)
    }

    fn text(&self) -> String {
        let verses: Vec<String> = self
            .verses
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{} {v}", i + 1))
            .collect();
        format!("{}\n\n{}\n\n", self.title, verses.join("\n"))
    }
}

/// Splits `bible-kjv` output: a line `Book N` opens a chapter, `  N text` a verse, and other
/// lines continue the verse.
fn parse_chapters(text: &str) -> Vec<Chapter> {
    let mut chapters: Vec<Chapter> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let trimmed = line.trim_start();
        let verse_start = line.starts_with("  ")
            && trimmed
                .split_once(' ')
                .is_some_and(|(n, _)| n.parse::<u32>().is_ok());
        let is_title = !line.starts_with(' ')
            && line.rsplit_once(' ').is_some_and(|(book, n)| {
                n.parse::<u32>().is_ok() && book.chars().all(|c| c.is_alphabetic() || c == ' ')
            });
        if is_title {
            chapters.push(Chapter {
                title: line.to_owned(),
                verses: Vec::new(),
            });
        } else if let Some(chapter) = chapters.last_mut() {
            if verse_start {
                let (_, verse) = trimmed.split_once(' ').unwrap_or_default();
                chapter.verses.push(verse.to_owned());
            } else if let Some(verse) = chapter.verses.last_mut() {
                verse.push(' ');
                verse.push_str(trimmed);
            }
        }
    }
    chapters
}

/// One entry of The Devil's Dictionary: headword and the full entry text.
struct Entry {
    word: String,
    text: String,
}

impl Entry {
    /// A one-paragraph prose entry of at most 300 characters (no verse quotations).
    fn is_short(&self) -> bool {
        self.text.len() <= 300 && !self.text.contains("\n\n") && !self.text.contains("\n ")
    }

    /// The definition without the headword and part of speech (`WORD, n.  text`).
    fn definition(&self) -> String {
        let body = self
            .text
            .split_once("  ")
            .map_or(self.text.as_str(), |(_, d)| d);
        body.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}

/// Splits the dictionary into entries: an entry starts at column 0 with an upper-case headword
/// followed by `,` or `.` (`ABNORMAL, adj.`, `ABRACADABRA.`), right after a blank line.
fn parse_entries(text: &str) -> Vec<Entry> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut previous_blank = true;
    for line in text.lines() {
        match headword(line).filter(|_| previous_blank) {
            Some(word) => entries.push(Entry {
                word: word.to_owned(),
                text: line.to_owned(),
            }),
            None => {
                if let Some(entry) = entries.last_mut() {
                    entry.text.push('\n');
                    entry.text.push_str(line);
                }
            }
        }
        previous_blank = line.trim().is_empty();
    }
    for entry in &mut entries {
        entry.text = entry.text.trim_end().to_owned();
    }
    entries
}

fn headword(line: &str) -> Option<&str> {
    let end = line.find([',', '.'])?;
    let word = &line[..end];
    let upper = word.len() >= 2
        && word.starts_with(|c: char| c.is_ascii_uppercase())
        && word
            .chars()
            .all(|c| c.is_ascii_uppercase() || " '-".contains(c));
    upper.then_some(word)
}

fn definition_question(entry: &Entry) -> Value {
    json!({
        "question": format!(
            "In Ambrose Bierce's The Devil's Dictionary, how is the word \"{}\" defined?\n\nAnswer: {}",
            entry.word,
            entry.definition()
        ),
        "_source": "devil-definition",
    })
}

fn chat(entry: &Entry, index: usize) -> Value {
    let mut messages = Vec::new();
    if index % 2 == 0 {
        messages.push(
            json!({"role": "system", "content": "You answer in the voice of Ambrose Bierce."}),
        );
    }
    messages.push(json!({"role": "user", "content": format!("What does \"{}\" mean?", entry.word.to_lowercase())}));
    messages.push(json!({"role": "assistant", "content": entry.definition()}));
    json!({"messages": messages, "_source": "devil-chat"})
}

/// "Which chapter is this verse from?" with four chapters of the same book, `ANSWER: X`.
fn verse_mcq(chapters: &[Chapter], rng: &mut SplitMix) -> Value {
    let chapter = &chapters[rng.below(chapters.len())];
    let verse = &chapter.verses[rng.below(chapter.verses.len())];
    let same_book: Vec<&Chapter> = chapters
        .iter()
        .filter(|c| c.book() == chapter.book())
        .collect();
    let mut options = vec![chapter.title.as_str()];
    while options.len() < 4 {
        let candidate = same_book[rng.below(same_book.len())].title.as_str();
        if !options.contains(&candidate) {
            options.push(candidate);
        }
    }
    rng.shuffle(&mut options);
    let letters = ["A", "B", "C", "D"];
    let answer = letters[options
        .iter()
        .position(|o| *o == chapter.title)
        .unwrap_or(0)];
    let listed: Vec<String> = letters
        .iter()
        .zip(&options)
        .map(|(l, o)| format!("{l}) {o}"))
        .collect();
    json!({
        "question": format!(
            "Which chapter of the King James Bible contains this verse?\n\n\"{verse}\"\n\n{}\n\nANSWER: {answer}",
            listed.join("\n")
        ),
        "_source": "kjv-mcq",
    })
}

/// Consecutive chapters cut into passages of [`PASSAGE_CHARS`] characters, the rest last.
fn passages(chapters: &[Chapter]) -> Vec<Value> {
    let mut out = Vec::new();
    let mut budgets = PASSAGE_CHARS.iter();
    let mut budget = budgets.next().copied();
    let mut text = String::new();
    for chapter in chapters {
        text.push_str(&chapter.text());
        if budget.is_some_and(|b| text.len() >= b) {
            out.push(
                json!({"text": std::mem::take(&mut text).trim_end(), "_source": "kjv-passage"}),
            );
            budget = budgets.next().copied();
        }
    }
    if !text.is_empty() {
        out.push(json!({"text": text.trim_end(), "_source": "kjv-passage"}));
    }
    out
}

/// Dictionary entries up to `chars` characters with one needle sentence hidden among them, the
/// question after them and the answer appended (as the original eval-prompt rows had).
fn needle_in_haystack(entries: &[Entry], chars: usize, key: &str, rng: &mut SplitMix) -> Value {
    let start = rng.below(entries.len() / 2);
    let mut paragraphs: Vec<&str> = Vec::new();
    let mut length = 0;
    for entry in entries.iter().cycle().skip(start) {
        if length >= chars {
            break;
        }
        paragraphs.push(&entry.text);
        length += entry.text.len() + 2;
    }
    let number = 1_000_000 + rng.below(9_000_000);
    let needle = format!("The special magic number for {key} is {number}.");
    let position = rng.below(paragraphs.len() + 1);
    paragraphs.insert(position, &needle);
    json!({
        "question": format!(
            "{}\n\nWhat is the special magic number for {key} mentioned in the provided text?\n\nAnswer: {number}",
            paragraphs.join("\n\n")
        ),
        "_source": "niah",
    })
}

/// A numbered list of `n` words drawn with a skewed distribution, and its ten most common words.
fn common_words(vocabulary: &[String], n: usize, rng: &mut SplitMix) -> Value {
    // Word k is drawn with weight 1/(k+1): a few words dominate, as in the eval's cwe task.
    let weights: Vec<f64> = (0..vocabulary.len())
        .map(|k| 1.0 / (k + 1) as f64)
        .collect();
    let total: f64 = weights.iter().sum();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut lines = Vec::with_capacity(n);
    for i in 0..n {
        let mut pick = rng.unit() * total;
        let k = weights.iter().position(|w| {
            pick -= w;
            pick < 0.0
        });
        let word = vocabulary[k.unwrap_or(vocabulary.len() - 1)].as_str();
        *counts.entry(word).or_default() += 1;
        lines.push(format!("{}. {word}", i + 1));
    }
    let mut ranked: Vec<(&str, usize)> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let top: Vec<String> = ranked
        .iter()
        .take(10)
        .enumerate()
        .map(|(i, (w, _))| format!("{}. {w}", i + 1))
        .collect();
    json!({
        "question": format!(
            "Below is a numbered list of words. Some of them appear more often than others.\n{}\n\nQuestion: What are the 10 most common words in the above list?\n\nAnswer: {}",
            lines.join("\n"),
            top.join(" ")
        ),
        "_source": "cwe",
    })
}

/// Writes one JSON object per line to a temporary file beside `out`, then renames it into place.
fn write_atomically(out: &Path, records: &[Value]) -> Result<(), AnyError> {
    let dir = out
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut file = tempfile::NamedTempFile::new_in(dir)?;
    for record in records {
        serde_json::to_writer(&mut file, record)?;
        file.write_all(b"\n")?;
    }
    file.as_file().sync_all()?;
    file.persist(out)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(())
}

/// SplitMix64: a tiny deterministic generator (no dependency, identical on every platform).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` (`n > 0`; the modulo bias is irrelevant for a fixture).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Fisher–Yates.
    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}
