//! End-to-end tests of reading, rendering and tokenizing a calibration file, with a word-level
//! tokenizer trained in memory (no network, no fixture files).

use std::path::Path;

use sala_calib::{
    model_dense_len, CalibError, CalibOptions, CalibSet, CalibStats, CalibText, CalibTokenizer,
};
use tokenizers::models::wordlevel::{WordLevel, WordLevelTrainer};
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerBuilder, TokenizerImpl,
};

const CORPUS: &str = "the quick brown fox jumps over the lazy dog and the cat sat on a mat \
                      hello world what is the answer it is forty two user assistant";

/// A word-level tokenizer trained on [`CORPUS`] that adds `<s>` (BOS) in front of every text,
/// as MiniCPM's does.
fn trained_tokenizer() -> Tokenizer {
    let specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"];
    let mut trainer = WordLevelTrainer::builder()
        .show_progress(false)
        .special_tokens(
            specials
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .build()
        .unwrap();
    let mut tokenizer: TokenizerImpl<
        WordLevel,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(
            WordLevel::builder()
                .unk_token("<unk>".into())
                .build()
                .unwrap(),
        )
        .with_pre_tokenizer(Some(Whitespace {}.into()))
        .build()
        .unwrap();
    tokenizer.train(&mut trainer, [CORPUS].into_iter()).unwrap();
    let mut tokenizer = Tokenizer::from(tokenizer);
    tokenizer.add_special_tokens(&specials.map(|t| AddedToken::from(t, true)));
    let bos = tokenizer.token_to_id("<s>").unwrap();
    let template = TemplateProcessing::builder()
        .try_single("<s> $A")
        .unwrap()
        .special_tokens(vec![("<s>", bos)])
        .build()
        .unwrap();
    tokenizer.with_post_processor(Some(template));
    tokenizer
}

/// A model directory with `tokenizer.json`, and a ChatML template when `chat` is set.
fn model_dir(chat: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    trained_tokenizer()
        .save(dir.path().join("tokenizer.json"), false)
        .unwrap();
    if chat {
        let config = serde_json::json!({
            "bos_token": "<s>",
            "chat_template": "{{ bos_token }}{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}",
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    }
    dir
}

fn write_jsonl(dir: &Path, lines: &[&str]) -> std::path::PathBuf {
    let path = dir.join("calib.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

fn options(max_len: usize, max_samples: Option<usize>) -> CalibOptions {
    CalibOptions {
        max_len,
        max_samples,
        skip_malformed: false,
    }
}

#[test]
fn plain_text_gets_bos_and_truncation_keeps_the_head() {
    let dir = model_dir(false);
    let tokenizer = CalibTokenizer::from_model_dir(dir.path()).unwrap();
    let long = "the quick brown fox jumps over the lazy dog";
    let path = write_jsonl(
        dir.path(),
        &[
            &format!("{{\"question\": \"{long}\"}}"),
            "{\"text\": \"hello world\"}",
        ],
    );

    let full = tokenizer.tokenizer().encode(long, true).unwrap();
    let bos = tokenizer.tokenizer().token_to_id("<s>").unwrap();
    assert_eq!(full.get_ids()[0], bos);
    assert_eq!(full.get_ids().len(), 10);

    let set = CalibSet::load(&path, &tokenizer, &options(4, None)).unwrap();
    assert_eq!(set.samples.len(), 2);
    assert_eq!(set.samples[0].ids, full.get_ids()[..4].to_vec());
    assert!(set.samples[0].truncated);
    assert_eq!(set.samples[1].ids.len(), 3);
    assert_eq!(set.samples[1].ids[0], bos);
    assert!(!set.samples[1].truncated);
}

#[test]
fn max_samples_takes_the_head_or_repeats_cyclically() {
    let dir = model_dir(false);
    let tokenizer = CalibTokenizer::from_model_dir(dir.path()).unwrap();
    let path = write_jsonl(
        dir.path(),
        &[
            "{\"text\": \"the cat\"}",
            "{\"text\": \"a dog\"}",
            "{\"text\": \"hello\"}",
        ],
    );
    let head = CalibSet::load(&path, &tokenizer, &options(64, Some(2))).unwrap();
    let lines: Vec<usize> = head.samples.iter().map(|s| s.line).collect();
    assert_eq!(lines, vec![1, 2]);

    let cycled = CalibSet::load(&path, &tokenizer, &options(64, Some(7))).unwrap();
    let lines: Vec<(usize, usize)> = cycled.samples.iter().map(|s| (s.line, s.repeat)).collect();
    assert_eq!(
        lines,
        vec![(1, 0), (2, 0), (3, 0), (1, 1), (2, 1), (3, 1), (1, 2)]
    );
    assert_eq!(cycled.samples[3].ids, cycled.samples[0].ids);
    assert_eq!(cycled.distinct(), 3);
}

#[test]
fn messages_are_rendered_with_the_chat_template_and_bos_is_not_doubled() {
    let dir = model_dir(true);
    let tokenizer = CalibTokenizer::from_model_dir(dir.path()).unwrap();
    let path = write_jsonl(
        dir.path(),
        &[
            r#"{"messages": [{"role": "user", "content": "what is the answer"}, {"role": "assistant", "content": "forty two"}]}"#,
        ],
    );
    let set = CalibSet::load(&path, &tokenizer, &options(64, None)).unwrap();
    let rendered = "<s><|im_start|> user what is the answer <|im_end|> <|im_start|> assistant forty two <|im_end|> ";
    let expected = tokenizer.tokenizer().encode(rendered, false).unwrap();
    assert_eq!(set.samples[0].ids, expected.get_ids());
    let bos = tokenizer.tokenizer().token_to_id("<s>").unwrap();
    assert_eq!(
        set.samples[0].ids.iter().filter(|&&id| id == bos).count(),
        1
    );
}

#[test]
fn messages_without_a_template_are_joined_as_plain_text_and_counted() {
    let dir = model_dir(false);
    let tokenizer = CalibTokenizer::from_model_dir(dir.path()).unwrap();
    assert!(tokenizer.chat_template().is_none());
    let path = write_jsonl(
        dir.path(),
        &[
            "{\"text\": \"hello\"}",
            r#"{"messages": [{"role": "user", "content": "what is the answer"}, {"role": "assistant", "content": "forty two"}]}"#,
        ],
    );
    let set = CalibSet::load(&path, &tokenizer, &options(64, None)).unwrap();
    let expected = tokenizer
        .tokenizer()
        .encode("what is the answer\n\nforty two", true)
        .unwrap();
    assert_eq!(set.samples[1].ids, expected.get_ids());
    assert!(set.samples[1].untemplated_chat && !set.samples[0].untemplated_chat);
    let stats = CalibStats::of(&set, None);
    assert_eq!(stats.untemplated_chats, 1);
    assert!(
        stats.to_string().contains("1 joined as plain text"),
        "{stats}"
    );
}

#[test]
fn malformed_lines_fail_or_are_skipped_and_counted() {
    let dir = model_dir(false);
    let tokenizer = CalibTokenizer::from_model_dir(dir.path()).unwrap();
    let path = write_jsonl(
        dir.path(),
        &["{\"text\": \"hello\"}", "{oops", "{\"text\": \"world\"}"],
    );
    let err = CalibSet::load(&path, &tokenizer, &options(64, None)).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("calib.jsonl:2: not valid JSON"),
        "{message}"
    );

    let skipping = CalibOptions {
        skip_malformed: true,
        ..options(64, None)
    };
    let set = CalibSet::load(&path, &tokenizer, &skipping).unwrap();
    assert_eq!(set.samples.len(), 2);
    assert_eq!(set.skipped.len(), 1);
    assert_eq!(CalibStats::of(&set, None).skipped_lines, 1);

    let only_bad = write_jsonl(dir.path(), &["{oops"]);
    assert!(matches!(
        CalibSet::load(&only_bad, &tokenizer, &skipping),
        Err(CalibError::NoSamples { skipped: 1, .. })
    ));
}

#[test]
fn dense_len_check_reports_long_samples() {
    let dir = model_dir(false);
    let tokenizer = CalibTokenizer::from_model_dir(dir.path()).unwrap();
    let path = write_jsonl(
        dir.path(),
        &[
            "{\"text\": \"hello\"}",
            "{\"text\": \"the quick brown fox jumps\"}",
        ],
    );
    let set = CalibSet::load(&path, &tokenizer, &options(64, None)).unwrap();
    let over = set.at_or_above(6);
    assert_eq!(over.len(), 1);
    assert_eq!((over[0].line, over[0].tokens), (2, 6));
    let stats = CalibStats::of(&set, Some(6));
    assert_eq!(stats.total_tokens, 8);
    assert!(
        stats.to_string().contains("dense_len 6: 1 samples"),
        "{stats}"
    );
}

#[test]
fn missing_or_broken_model_files_name_the_file() {
    let empty = tempfile::tempdir().unwrap();
    let err = CalibTokenizer::from_model_dir(empty.path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.json"), "{err}");

    std::fs::write(empty.path().join("tokenizer.json"), "{}").unwrap();
    let err = CalibTokenizer::from_model_dir(empty.path()).unwrap_err();
    assert!(matches!(err, CalibError::Tokenizer { .. }), "{err}");

    let dir = model_dir(false);
    let tokenizer = CalibTokenizer::from_model_dir(dir.path()).unwrap();
    let missing = dir.path().join("absent.jsonl");
    let err = CalibSet::load(&missing, &tokenizer, &options(8, None)).unwrap_err();
    assert!(err.to_string().contains("absent.jsonl"), "{err}");
    let path = write_jsonl(dir.path(), &["{\"text\": \"hello\"}"]);
    assert!(matches!(
        CalibSet::load(&path, &tokenizer, &options(0, None)),
        Err(CalibError::Option(_))
    ));
}

#[test]
fn dense_len_comes_from_the_model_config() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(model_dense_len(dir.path()).unwrap(), None);
    let config = dir.path().join("config.json");
    std::fs::write(&config, r#"{"sparse_config": {"dense_len": 8192}}"#).unwrap();
    assert_eq!(model_dense_len(dir.path()).unwrap(), Some(8192));
    std::fs::write(&config, r#"{"sparse_config": {"dense_len": "long"}}"#).unwrap();
    let err = model_dense_len(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("config.json") && err.contains("dense_len"),
        "{err}"
    );
}

#[test]
fn record_kinds_survive_the_reader() {
    let records = sala_calib::parse_jsonl(
        "{\"question\": \"q\"}\n".as_bytes(),
        Path::new("x.jsonl"),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(records.records[0].text, CalibText::Plain("q".into()));
}

#[test]
fn huge_max_samples_is_refused_before_any_sample_is_built() {
    let dir = model_dir(false);
    let tokenizer = CalibTokenizer::from_model_dir(dir.path()).unwrap();
    let path = write_jsonl(dir.path(), &["{\"text\": \"hello\"}"]);
    for wanted in [usize::MAX, sala_calib::MAX_SAMPLES + 1] {
        let err = CalibSet::load(&path, &tokenizer, &options(64, Some(wanted))).unwrap_err();
        assert!(matches!(err, CalibError::Option(_)), "{err}");
        assert!(err.to_string().contains("--max-samples"), "{err}");
    }
    // Few enough samples, but too many tokens in all.
    let long = format!("{{\"text\": \"{}\"}}", "hello ".repeat(3000));
    let path = write_jsonl(dir.path(), &[&long]);
    let err = CalibSet::load(
        &path,
        &tokenizer,
        &options(4096, Some(sala_calib::MAX_SAMPLES)),
    )
    .unwrap_err();
    assert!(err.to_string().contains("tokens"), "{err}");
}
