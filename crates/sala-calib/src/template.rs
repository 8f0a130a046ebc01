//! Hugging Face chat templates, rendered with MiniJinja.

use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::{context, Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::Value as Json;

use crate::error::{CalibError, Result};
use crate::jsonl::ChatMessage;
use crate::model_dir::read_json;

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template with the special tokens it may print.
///
/// The environment mirrors what `transformers` uses for `apply_chat_template`: `trim_blocks`,
/// `lstrip_blocks`, loop controls, `raise_exception`, and Python string methods (`.strip()`,
/// `.split()`, …) through `minijinja-contrib`'s pycompat.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names where it came from in errors.
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
        origin: &Path,
    ) -> Result<Self> {
        let template_error = |source| CalibError::Template {
            path: origin.to_owned(),
            source,
        };
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(template_error)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(template_error)?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Loads the chat template of a Hugging Face model directory, if it has one:
    /// `chat_template.jinja` first (what current `transformers` saves), else the
    /// `chat_template` field of `tokenizer_config.json` (a string, or a list of
    /// `{name, template}` of which `default` is used). `bos_token` / `eos_token` come from
    /// `tokenizer_config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            Some(read_json(&config_path)?)
        } else {
            None
        };
        let token = |name| special_token(config.as_ref(), name, &config_path);
        let (bos_token, eos_token) = (token("bos_token")?, token("eos_token")?);

        let jinja_path = dir.join("chat_template.jinja");
        let (source, origin): (String, PathBuf) = if jinja_path.is_file() {
            let source = std::fs::read_to_string(&jinja_path).map_err(|source| CalibError::Io {
                path: jinja_path.clone(),
                source,
            })?;
            (source, jinja_path)
        } else {
            match config
                .as_ref()
                .map(|c| template_from_config(c, &config_path))
            {
                Some(Ok(Some(source))) => (source, config_path),
                Some(Err(err)) => return Err(err),
                Some(Ok(None)) | None => return Ok(None),
            }
        };
        Self::new(source, bos_token, eos_token, &origin).map(Some)
    }

    /// Renders a conversation as training text: every turn, no generation prompt.
    pub fn render(&self, messages: &[ChatMessage]) -> std::result::Result<String, JinjaError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => m.role.clone(), content => m.content.clone() })
            .collect();
        self.env.get_template(TEMPLATE_NAME)?.render(context! {
            messages => messages,
            add_generation_prompt => false,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
    }
}

/// `raise_exception(message)`, which Hugging Face templates call to refuse a conversation.
fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// The `chat_template` field of `tokenizer_config.json`, if any.
fn template_from_config(config: &Json, path: &Path) -> Result<Option<String>> {
    let shape_error = |message: &str| CalibError::Config {
        path: path.to_owned(),
        message: message.to_owned(),
    };
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(source)) => Ok(Some(source.clone())),
        Some(Json::Array(named)) => named
            .iter()
            .find(|entry| entry.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|entry| entry.get("template")?.as_str().map(str::to_owned))
            .map(Some)
            .ok_or_else(|| shape_error("`chat_template` list has no `default` template")),
        Some(_) => Err(shape_error(
            "`chat_template` is neither a string nor a list",
        )),
    }
}

/// A special token of `tokenizer_config.json`: a string, or an added-token object with `content`.
fn special_token(config: Option<&Json>, name: &str, path: &Path) -> Result<Option<String>> {
    match config.and_then(|c| c.get(name)) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(token)) => Ok(Some(token.clone())),
        Some(Json::Object(token)) => match token.get("content") {
            Some(Json::String(content)) => Ok(Some(content.clone())),
            _ => Err(CalibError::Config {
                path: path.to_owned(),
                message: format!("`{name}` object has no string `content`"),
            }),
        },
        Some(_) => Err(CalibError::Config {
            path: path.to_owned(),
            message: format!("`{name}` is neither a string nor a token object"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ChatML template written the way Hugging Face templates are: block tags indented on their
    /// own lines, relying on `trim_blocks` / `lstrip_blocks`, and Python's `.strip()`.
    const CHATML: &str = "{{ bos_token }}\n{% for m in messages %}\n    {% if m['role'] == 'system' %}\n<|im_start|>system\n{{ m['content'].strip() }}<|im_end|>\n    {% else %}\n<|im_start|>{{ m['role'] }}\n{{ m['content'].strip() }}<|im_end|>\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}\n";

    fn chat(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(role, content)| ChatMessage {
                role: (*role).into(),
                content: (*content).into(),
            })
            .collect()
    }

    #[test]
    fn renders_chatml_like_transformers() {
        let template =
            ChatTemplate::new(CHATML.into(), Some("<s>".into()), None, Path::new("t")).unwrap();
        let text = template
            .render(&chat(&[
                ("system", "Be brief."),
                ("user", " Hi "),
                ("assistant", "Hello."),
            ]))
            .unwrap();
        // What Python's jinja2 3.1.6 renders for the same template and messages with
        // `trim_blocks=True, lstrip_blocks=True` (as `transformers` configures it).
        assert_eq!(
            text,
            "<s>\n<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n"
        );
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_reported() {
        let refusing = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok";
        let template = ChatTemplate::new(refusing.into(), None, None, Path::new("t")).unwrap();
        let err = template.render(&chat(&[("assistant", "x")])).unwrap_err();
        assert!(err.to_string().contains("user first"), "{err}");
        assert_eq!(template.render(&chat(&[("user", "x")])).unwrap(), "ok");

        let err = ChatTemplate::new(
            "{% for %}".into(),
            None,
            None,
            Path::new("dir/chat_template.jinja"),
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("dir/chat_template.jinja: invalid chat template"),
            "{err}"
        );
    }

    #[test]
    fn model_dir_sources_in_priority_order() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_none());

        let config = serde_json::json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D{{ eos_token }}"}],
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let from_config = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(
            from_config.render(&chat(&[("user", "x")])).unwrap(),
            "<s>D</s>"
        );

        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "J{{ messages|length }}",
        )
        .unwrap();
        let from_file = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(from_file.render(&chat(&[("user", "x")])).unwrap(), "J1");
    }

    #[test]
    fn malformed_tokenizer_config_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(&path, r#"{"chat_template": 7}"#).unwrap();
        let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
        assert!(
            matches!(err, CalibError::Config { ref path, .. } if path.ends_with("tokenizer_config.json"))
        );
        std::fs::write(&path, "{broken").unwrap();
        let err = ChatTemplate::from_model_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("tokenizer_config.json"), "{err}");
    }
}
