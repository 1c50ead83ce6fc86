//! Structured output: a request's `response_format` (`json_object`, `json_schema`), `json_schema`
//! or `grammar` (Lark, or GBNF as llama.cpp takes it) compiled by llguidance — the grammar engine
//! of llama.cpp, vLLM and SGLang — into a [`Constraint`] that masks the logits of every token the
//! grammar does not allow before each draw. The output is then valid by construction: it parses,
//! and a JSON schema's required fields, types and enums hold.

use std::fmt;
use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use toy_core::tokenizer::Tokenizer;

use crate::error::ApiError;

/// How JSON is laid out when the schema does not say (`x-guidance`): `json.dumps`'s separators
/// and no other whitespace, the form models have seen most. Flexible whitespace lets a small
/// model pad with newlines until `max_tokens` cuts the object short.
pub(crate) fn json_layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// A grammar a request asked for, and the request field it came from (named in its errors).
#[derive(Debug, Clone)]
pub struct Requested {
    pub grammar: TopLevelGrammar,
    pub param: &'static str,
}

/// The grammar a request asks for, if any (at most one of `response_format` other than `text`,
/// `json_schema` and `grammar`).
pub fn requested(
    response_format: Option<&Value>,
    json_schema: Option<&Value>,
    grammar: Option<&str>,
) -> Result<Option<Requested>, ApiError> {
    let from_format = match response_format {
        None => None,
        Some(fmt) => match fmt.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(schema_grammar(json!({"type": "object"}))),
            Some("json_schema") => {
                let schema = fmt
                    .get("json_schema")
                    .and_then(|s| s.get("schema"))
                    .filter(|s| s.is_object() || s.is_boolean())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            Some("response_format"),
                            "response_format json_schema needs {\"json_schema\": {\"name\": …, \"schema\": {…}}}",
                        )
                    })?;
                Some(schema_grammar(schema.clone()))
            }
            _ => {
                return Err(ApiError::invalid(
                    Some("response_format"),
                    "response_format type must be \"text\", \"json_object\" or \"json_schema\"",
                ));
            }
        },
    };
    let from_schema = json_schema.map(|s| schema_grammar(s.clone()));
    let from_grammar = match grammar {
        None => None,
        Some(g) if g.trim().is_empty() => {
            return Err(ApiError::invalid(Some("grammar"), "grammar is empty"));
        }
        Some(g) => Some(TopLevelGrammar::from_lark(
            crate::gbnf::to_lark(g).map_err(|e| ApiError::invalid(Some("grammar"), e))?,
        )),
    };
    let mut given: Vec<Requested> = [
        (from_format, "response_format"),
        (from_schema, "json_schema"),
        (from_grammar, "grammar"),
    ]
    .into_iter()
    .filter_map(|(g, param)| g.map(|grammar| Requested { grammar, param }))
    .collect();
    if given.len() > 1 {
        return Err(ApiError::invalid(
            Some("grammar"),
            "give one of response_format (json_object / json_schema), json_schema and grammar",
        ));
    }
    Ok(given.pop())
}

fn schema_grammar(mut schema: Value) -> TopLevelGrammar {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(json_layout);
    }
    TopLevelGrammar::from_json_schema(schema)
}

/// The model's vocabulary as llguidance sees it, built on first use (a pass over the
/// vocabulary) and shared by every request.
#[derive(Default)]
pub struct Grammars {
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl Grammars {
    fn factory(&self, tokenizer: &Tokenizer) -> Result<Arc<ParserFactory>, String> {
        self.factory
            .get_or_init(|| {
                let mut factory = ParserFactory::new_simple(&token_env(tokenizer))
                    .map_err(|e| format!("cannot build the grammar engine's vocabulary: {e}"))?;
                // Grammar errors go back to the client; nothing to print on the server.
                factory.quiet();
                Ok(Arc::new(factory))
            })
            .clone()
    }

    /// Compile `grammar` for this vocabulary: an error is the client's (a schema llguidance
    /// cannot enforce, a grammar that does not parse).
    pub fn compile(
        &self,
        tokenizer: &Tokenizer,
        requested: Requested,
    ) -> Result<Constraint, ApiError> {
        let factory = self.factory(tokenizer).map_err(ApiError::internal)?;
        let matcher = Matcher::new(factory.create_parser(requested.grammar));
        if let Some(e) = matcher.get_error() {
            return Err(ApiError::invalid(
                Some(requested.param),
                format!("the grammar cannot be used: {e}"),
            ));
        }
        Ok(Constraint {
            matcher,
            vocab: tokenizer.vocab_size(),
        })
    }
}

/// The trie of every token's bytes. Control tokens carry llguidance's special-token marker, so
/// that no grammar matches them as text; generation may end (EOS allowed) where the grammar
/// accepts, at any of the model's end-of-generation tokens.
fn token_env(tokenizer: &Tokenizer) -> TokEnv {
    let n = tokenizer.vocab_size() as u32;
    let words: Vec<Vec<u8>> = (0..n)
        .map(|id| {
            let bytes = tokenizer.token_bytes(id);
            if tokenizer.is_control(id) || tokenizer.is_eog(id) {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(bytes);
                w
            } else {
                bytes.to_vec()
            }
        })
        .collect();
    let eog = tokenizer.eog_ids();
    let eos = tokenizer
        .eos_id()
        .or_else(|| eog.first().copied())
        .unwrap_or(n);
    let mut trie = TokTrie::from(&TokRxInfo::new(n, eos), &words);
    if !eog.is_empty() {
        trie = trie.with_eos_tokens(&eog);
    }
    Arc::new(ApproximateTokEnv::new(trie))
}

/// One sequence's grammar state.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// Set the logit of every token the grammar does not allow next to −∞ (and of any row past
    /// the vocabulary: padded output rows).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("grammar: {e}"))?;
        for (id, l) in logits.iter_mut().enumerate() {
            if id >= self.vocab || !allowed.is_allowed(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advance past the sampled token.
    pub fn accept(&mut self, id: u32) -> Result<(), String> {
        self.matcher
            .consume_token(id)
            .map_err(|e| format!("grammar: {e}"))
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/models/tiny-llama3.gguf"
        );
        let gguf = toy_core::gguf::GgufFile::open(path).expect("fixture");
        Tokenizer::from_gguf(&gguf).expect("tokenizer")
    }

    /// Decode under the constraint with arbitrary (seeded) logits, always taking the best
    /// allowed token: whatever the model prefers, the text obeys the grammar.
    fn generate(c: &mut Constraint, tok: &Tokenizer, seed: u64, most: usize) -> String {
        let mut rng = toy_core::rng::SplitMix64::new(seed);
        let mut ids = Vec::new();
        for _ in 0..most {
            let mut logits: Vec<f32> = (0..tok.vocab_size())
                .map(|_| (rng.next_u64() >> 40) as f32)
                .collect();
            c.mask(&mut logits).unwrap();
            let id = toy_core::sampling::argmax(&logits);
            if tok.is_eog(id) {
                break;
            }
            c.accept(id).unwrap();
            ids.push(id);
            if c.done() {
                break;
            }
        }
        tok.decode(&ids)
    }

    /// The text `grammar` gives under random logits (tiny-llama3's vocabulary), for the tests
    /// of other modules that build grammars.
    pub(crate) fn sample_with_random_logits(grammar: TopLevelGrammar, seed: u64) -> String {
        let tok = tokenizer();
        let requested = Requested {
            grammar,
            param: "test",
        };
        let mut c = Grammars::default().compile(&tok, requested).unwrap();
        generate(&mut c, &tok, seed, 400)
    }

    #[test]
    fn random_logits_still_give_schema_valid_json() {
        let tok = tokenizer();
        let grammars = Grammars::default();
        let schema = json!({
            "type": "object",
            "properties": {
                "colour": {"enum": ["red", "green", "blue"]},
                "n": {"type": "integer", "minimum": 0, "maximum": 99},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}
            },
            "required": ["colour", "n", "tags"],
            "additionalProperties": false
        });
        let g = requested(
            Some(&json!({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})),
            None,
            None,
        )
        .unwrap()
        .unwrap();
        let c = grammars.compile(&tok, g).unwrap();
        for seed in 0..5 {
            let text = generate(&mut c.clone(), &tok, seed, 200);
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(
                ["red", "green", "blue"].contains(&v["colour"].as_str().unwrap()),
                "{text}"
            );
            assert!(v["n"].as_u64().unwrap() <= 99, "{text}");
            assert!(v["tags"].as_array().unwrap().len() <= 2, "{text}");
            assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
        }
    }

    /// GBNF token references: by id, negated by id, and a control token by its text.
    #[test]
    fn gbnf_token_references_constrain_the_ids() {
        let tok = tokenizer();
        let control = (0..tok.vocab_size() as u32)
            .find(|&id| tok.is_control(id) && !tok.token_text(id).is_empty())
            .unwrap();
        let name = tok.token_text(control).to_string();
        let grammar = format!("root ::= <[100]> !<[100]> !<[100]> <[100]> {name}");
        let g = requested(None, None, Some(&grammar)).unwrap().unwrap();
        let c = Grammars::default().compile(&tok, g).unwrap();
        for seed in 0..4 {
            let mut c = c.clone();
            let mut rng = toy_core::rng::SplitMix64::new(seed);
            let mut ids = Vec::new();
            while !c.done() && ids.len() < 10 {
                let mut logits: Vec<f32> = (0..tok.vocab_size())
                    .map(|_| (rng.next_u64() >> 40) as f32)
                    .collect();
                // Make the excluded token the model's favourite: the mask must still drop it.
                logits[100] = 1e9;
                c.mask(&mut logits).unwrap();
                let id = toy_core::sampling::argmax(&logits);
                c.accept(id).unwrap();
                ids.push(id);
            }
            assert_eq!(ids.len(), 5, "{grammar}: {ids:?}");
            assert_eq!((ids[0], ids[3], ids[4]), (100, 100, control), "{ids:?}");
            assert!(ids[1] != 100 && ids[2] != 100, "{ids:?}");
        }
    }

    #[test]
    fn lark_and_gbnf_grammars_constrain_the_text() {
        let tok = tokenizer();
        let grammars = Grammars::default();
        for grammar in [
            r#"start: ("yes" | "no") "!""#,
            "root ::= answer \"!\"\nanswer ::= \"yes\" | \"no\"",
        ] {
            let g = requested(None, None, Some(grammar)).unwrap().unwrap();
            let c = grammars.compile(&tok, g).unwrap();
            for seed in 0..4 {
                let text = generate(&mut c.clone(), &tok, seed, 20);
                assert!(text == "yes!" || text == "no!", "{grammar:?} gave {text:?}");
            }
        }
    }

    #[test]
    fn bad_requests_are_the_clients_errors() {
        let tok = tokenizer();
        let grammars = Grammars::default();
        assert!(requested(Some(&json!({"type": "xml"})), None, None).is_err());
        assert!(requested(Some(&json!({"type": "json_schema"})), None, None).is_err());
        assert!(requested(None, Some(&json!({})), Some("start: \"a\"")).is_err());
        let g = requested(None, None, Some("start: undefined_rule"))
            .unwrap()
            .unwrap();
        let e = grammars.compile(&tok, g).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("grammar"));
        let g = requested(None, Some(&json!({"type": "object", "required": 5})), None)
            .unwrap()
            .unwrap();
        let e = grammars.compile(&tok, g).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("json_schema"));
    }
}
