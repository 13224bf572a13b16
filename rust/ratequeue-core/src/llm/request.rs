//! What the transport needs of a request body before sending it, read in one pass
//! without building the body: the model, whether a stream must be asked for its usage,
//! the output bound, and the prompt's characters exactly as the Python reference
//! (`_estimate._chars` over a full `json` parse) counts them.

use super::cap::{CHOICES, CONTAINERS, NESTED_CHOICES, OUTPUT_BOUNDS, OUTPUT_FIELDS};
use super::scan::{decode, decode_string, Num, Scan, Scanner, Shape, Str, MAX_DEPTH};
use super::Defer;

/// Nesting of the containers whose strings count as prompt (the root object is 0).
pub const PROMPT_DEPTH: usize = 64;
/// Members of one object read here; an object with more is deferred to the reference
/// (each key is checked against the earlier ones: a repeated key keeps its last value).
pub const MAX_MEMBERS: usize = 1024;

/// Keys whose values are not prompt text (ids, roles, base64 data...).
const SKIP: [&[u8]; 9] = [
    b"model",
    b"role",
    b"type",
    b"id",
    b"data",
    b"image_url",
    b"source",
    b"file_data",
    b"b64_json",
];

/// An output-bounding field as it last appeared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Bound {
    #[default]
    Unusable,
    Count(u64),
    Huge,
}

/// What a request body says, for the estimate and the call's record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestFacts {
    /// The last top-level `model` when it is a string.
    pub model: Option<String>,
    /// `"stream": true` without `"stream_options": {"include_usage": true}`.
    pub stream_wants_usage: bool,
    /// Characters of the prompt strings, one separator each (`_chars(body)`).
    pub prompt_chars: u64,
    /// Elements of `messages` and of `input` when each is an array.
    pub messages: Option<u64>,
    pub input: Option<u64>,
    /// The bounds of [`OUTPUT_BOUNDS`] (a nested one from its container's last
    /// occurrence, when that is an object).
    bounds: [Bound; OUTPUT_BOUNDS.len()],
    /// `n` and `best_of`.
    choices: [Bound; CHOICES.len()],
    /// The choice counts of [`NESTED_CHOICES`] (from their container's last occurrence).
    nested_choices: [Bound; NESTED_CHOICES.len()],
}

impl RequestFacts {
    /// True when [`estimate`](Self::estimate) would take its `default_output` (the body
    /// names no usable bound).
    pub fn uses_default(&self) -> bool {
        !self.bounds.iter().any(|b| matches!(b, Bound::Count(_) | Bound::Huge))
    }

    /// The character fallback's estimate (`TokenEstimator(None)`): prompt tokens
    /// (ceil(chars / `chars_per_token`) + 4 per message) and the output: the first
    /// bound that is an int >= 0, else `default_output`, times the choices asked for
    /// (the largest `n`, `best_of` or nested count such as Gemini's `candidateCount`
    /// that is an int >= 1, else one).
    pub fn estimate(&self, chars_per_token: u64, default_output: u64) -> Result<(u64, u64), Defer> {
        if chars_per_token == 0 {
            return Err(Defer);
        }
        let chars = self.prompt_chars.saturating_sub(1);
        let mut prompt = chars.div_ceil(chars_per_token);
        let per_message = match (self.messages, self.input) {
            (Some(n), _) | (None, Some(n)) => n.checked_mul(4).ok_or(Defer)?,
            (None, None) => 4,
        };
        prompt = prompt.checked_add(per_message).ok_or(Defer)?;
        let mut output = default_output;
        for b in self.bounds {
            match b {
                Bound::Count(v) => {
                    output = v;
                    break;
                }
                Bound::Huge => return Err(Defer),
                Bound::Unusable => {}
            }
        }
        let mut choices = 1u64;
        for c in self.choices.iter().chain(self.nested_choices.iter()) {
            match *c {
                Bound::Count(v) => choices = choices.max(v),
                Bound::Huge => return Err(Defer),
                Bound::Unusable => {}
            }
        }
        Ok((prompt, output.checked_mul(choices).ok_or(Defer)?))
    }
}

fn array_len(shape: Shape<'_>) -> Option<u64> {
    match shape {
        Shape::Array(n) => Some(n as u64),
        _ => None,
    }
}

fn bound(shape: Shape<'_>) -> Bound {
    match shape {
        Shape::Num(Num::Int {
            negative: false,
            value: Some(v),
        }) => Bound::Count(v),
        Shape::Num(Num::Int {
            negative: false,
            value: None,
        }) => Bound::Huge,
        _ => Bound::Unusable,
    }
}

/// A member of an object being counted: its decoded key (in `Counter::keys`) and what
/// its value counts.
struct Member {
    key: std::ops::Range<usize>,
    chars: u64,
}

/// Counts prompt characters, keeping each open object's keys to honour repeats.
struct Counter {
    keys: Vec<u8>,
    members: Vec<Member>,
}

impl Counter {
    fn string(s: &Str<'_>) -> u64 {
        if s.starts_with_data() {
            0
        } else {
            s.chars as u64 + 1
        }
    }

    /// What a value held by a counted container at prompt depth `level` (its nesting
    /// `depth`) counts, and its shape.
    fn value<'a>(&mut self, s: &mut Scanner<'a>, level: usize, depth: usize) -> Scan<(u64, Shape<'a>)> {
        match s.peek() {
            Some(b'"') => {
                let st = s.string()?;
                Ok((Self::string(&st), Shape::Str(st)))
            }
            Some(b'{') | Some(b'[') if level < PROMPT_DEPTH => self.container(s, level + 1, depth),
            _ => s.value(depth).map(|shape| (0, shape)),
        }
    }

    /// A counted container at prompt depth `level` whose parent has nesting `depth`.
    fn container<'a>(&mut self, s: &mut Scanner<'a>, level: usize, depth: usize) -> Scan<(u64, Shape<'a>)> {
        if s.peek() == Some(b'[') {
            let mut n = 0u64;
            let len = s.array(depth + 1, |s| {
                n += self.value(s, level, depth + 1)?.0;
                Ok(())
            })?;
            return Ok((n, Shape::Array(len)));
        }
        let first = self.members.len();
        let keys_at = self.keys.len();
        let mut n = 0u64;
        let r = s.object(depth + 1, |s, key| {
            let c = if SKIP.iter().any(|k| key.is(k)) {
                s.value(depth + 1)?;
                0
            } else {
                self.value(s, level, depth + 1)?.0
            };
            n = self.member(first, &key, c, n)?;
            Ok(())
        });
        self.members.truncate(first);
        self.keys.truncate(keys_at);
        r.map(|()| (n, Shape::Object))
    }

    /// Adds a member's count to its object's total `n`, replacing an earlier member of
    /// the same key (a dict keeps the last value).
    fn member(&mut self, first: usize, key: &Str<'_>, chars: u64, n: u64) -> Scan<u64> {
        if self.members.len() - first >= MAX_MEMBERS {
            return Err(super::scan::Stop::Defer);
        }
        let at = self.keys.len();
        decode(key.raw, &mut self.keys);
        let (done, new) = self.keys.split_at(at);
        if let Some(m) = self.members[first..].iter_mut().find(|m| &done[m.key.clone()] == new) {
            let n = n - m.chars + chars;
            m.chars = chars;
            self.keys.truncate(at);
            return Ok(n);
        }
        let end = self.keys.len();
        self.members.push(Member { key: at..end, chars });
        Ok(n + chars)
    }
}

/// The facts of a request body, exactly as a full parse would give them: None when the
/// body is not a JSON object; `Err(Defer)` when only the reference parser can tell
/// (other encodings, nesting past the scanner's bound, numbers past its range, an
/// object of more than [`MAX_MEMBERS`] members, a `model` holding a lone surrogate).
pub fn request_facts(body: &[u8]) -> Result<Option<RequestFacts>, Defer> {
    let scanner = Scanner::new(body).ok_or(Defer)?;
    let mut counter = Counter {
        keys: Vec::with_capacity(256),
        members: Vec::with_capacity(32),
    };
    let mut facts = RequestFacts::default();
    let mut model: Option<Str<'_>> = None;
    let (mut stream_true, mut include_usage) = (false, false);
    let read = scanner.document(|s| {
        let mut n = 0u64;
        s.object(1, |s, key| {
            let k: &[u8] = if key.escaped { b"" } else { key.raw };
            let named = |name: &[u8]| k == name || (key.escaped && key.is(name));
            if SKIP.iter().any(|k| named(k)) {
                let shape = s.value(1)?;
                if named(b"model") {
                    model = match shape {
                        Shape::Str(m) => Some(m),
                        _ => None,
                    };
                }
                n = counter.member(0, &key, 0, n)?;
                return Ok(());
            }
            let at = s.pos;
            let (chars, shape) = counter.value(s, 0, 1)?;
            if named(b"stream") {
                stream_true = matches!(shape, Shape::True);
            } else if named(b"stream_options") {
                include_usage = false;
                if let Shape::Object = shape {
                    // Its last `include_usage`, read again (a small object).
                    let mut again = Scanner { b: s.b, pos: at };
                    again.object(2, |s2, k2| {
                        let v = s2.value(2)?;
                        if k2.is(b"include_usage") {
                            include_usage = matches!(v, Shape::True);
                        }
                        Ok(())
                    })?;
                }
            } else if named(b"messages") {
                facts.messages = array_len(shape);
            } else if named(b"input") {
                facts.input = array_len(shape);
            } else if let Some(i) = OUTPUT_FIELDS.iter().position(|f| named(f.as_bytes())) {
                facts.bounds[i] = bound(shape);
            } else if let Some(i) = CHOICES.iter().position(|f| named(f.as_bytes())) {
                facts.choices[i] = bound(shape);
            } else if let Some(c) = CONTAINERS.iter().position(|(c, _)| named(c.as_bytes())) {
                // Its bounds as a dict keeps them: this occurrence's, read again.
                let name = CONTAINERS[c].0;
                for (j, (outer, _)) in OUTPUT_BOUNDS.iter().enumerate() {
                    if *outer == name {
                        facts.bounds[j] = Bound::Unusable;
                    }
                }
                for (j, (outer, _)) in NESTED_CHOICES.iter().enumerate() {
                    if *outer == name {
                        facts.nested_choices[j] = Bound::Unusable;
                    }
                }
                if let Shape::Object = shape {
                    let mut again = Scanner { b: s.b, pos: at };
                    again.object(2, |s2, k2| {
                        let v = s2.value(2)?;
                        let named = |(o, n): &(&str, &str)| *o == name && k2.is(n.as_bytes());
                        if let Some(j) = OUTPUT_BOUNDS.iter().position(named) {
                            facts.bounds[j] = bound(v);
                        } else if let Some(j) = NESTED_CHOICES.iter().position(named) {
                            facts.nested_choices[j] = bound(v);
                        }
                        Ok(())
                    })?;
                }
            }
            n = counter.member(0, &key, chars, n)?;
            Ok(())
        })?;
        Ok(n)
    });
    let chars = match read {
        Ok(Some(n)) => n,
        Ok(None) => return Ok(None),
        Err(_) => return Err(Defer),
    };
    facts.prompt_chars = chars;
    facts.stream_wants_usage = stream_true && !include_usage;
    if let Some(m) = model {
        facts.model = Some(decode_string(&m).ok_or(Defer)?);
    }
    const { assert!(MAX_DEPTH > PROMPT_DEPTH + 2) };
    Ok(Some(facts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn est(body: &str) -> Result<Option<(u64, u64)>, Defer> {
        match request_facts(body.as_bytes())? {
            Some(f) => f.estimate(4, 1024).map(Some),
            None => Ok(None),
        }
    }

    #[test]
    fn a_chat_request() {
        let body = r#"{"model":"gpt-x","messages":[{"role":"user","content":"hello world"}],"max_tokens":200}"#;
        let f = request_facts(body.as_bytes()).unwrap().unwrap();
        assert_eq!(f.model.as_deref(), Some("gpt-x"));
        assert_eq!(f.prompt_chars, 12);
        assert_eq!(f.messages, Some(1));
        assert!(!f.stream_wants_usage);
        // ceil(11 / 4) + 4
        assert_eq!(f.estimate(4, 1024), Ok((7, 200)));
    }

    #[test]
    fn output_bounds_in_order() {
        assert_eq!(
            est(r#"{"max_tokens":5,"max_completion_tokens":-1,"max_output_tokens":7}"#),
            Ok(Some((4, 7)))
        );
        assert_eq!(est(r#"{"max_tokens":true}"#), Ok(Some((4, 1024))));
        assert_eq!(est(r#"{"max_tokens":99999999999999999999}"#), Err(Defer));
        assert_eq!(est(r#"{"input":[1,2,3],"max_tokens":-0}"#), Ok(Some((12, 0))));
        assert_eq!(est(r#"{"messages":"x","input":[1,2]}"#), Ok(Some((1 + 8, 1024))));
    }

    #[test]
    fn choices_and_nested_bounds() {
        assert_eq!(est(r#"{"n":3,"max_tokens":10}"#), Ok(Some((4, 30))));
        assert_eq!(est(r#"{"n":3,"best_of":5,"n":0}"#), Ok(Some((4, 5 * 1024))));
        assert_eq!(est(r#"{"n":true,"best_of":-2,"max_tokens":10}"#), Ok(Some((4, 10))));
        assert_eq!(est(r#"{"n":99999999999999999999,"max_tokens":1}"#), Err(Defer));
        assert_eq!(est(r#"{"n":4294967296,"max_tokens":4294967296}"#), Err(Defer));
        assert_eq!(est(r#"{"generationConfig":{"maxOutputTokens":77}}"#), Ok(Some((4, 77))));
        assert_eq!(
            est(r#"{"generation_config":{"maxOutputTokens":7,"maxOutputTokens":8}}"#),
            Ok(Some((4, 8)))
        );
        assert_eq!(
            est(r#"{"inferenceConfig":{"maxTokens":7},"inferenceConfig":null}"#),
            Ok(Some((4, 1024)))
        );
        assert_eq!(
            est(r#"{"max_tokens":5,"inferenceConfig":{"maxTokens":7}}"#),
            Ok(Some((4, 5)))
        );
    }

    #[test]
    fn candidates_titan_and_llama() {
        let gemini = r#"{"generationConfig":{"candidateCount":8,"maxOutputTokens":100}}"#;
        assert_eq!(est(gemini), Ok(Some((4, 800))));
        assert_eq!(
            est(r#"{"generation_config":{"candidate_count":3}}"#),
            Ok(Some((4, 3 * 1024)))
        );
        assert_eq!(
            est(r#"{"n":2,"generationConfig":{"candidate_count":3,"maxOutputTokens":10}}"#),
            Ok(Some((4, 30)))
        );
        // A repeated key or container: the last, as a dict keeps it.
        assert_eq!(
            est(r#"{"generationConfig":{"candidateCount":8,"candidateCount":2,"maxOutputTokens":1}}"#),
            Ok(Some((4, 2)))
        );
        assert_eq!(
            est(r#"{"generationConfig":{"candidateCount":8},"generationConfig":{"maxOutputTokens":1}}"#),
            Ok(Some((4, 1)))
        );
        assert_eq!(est(r#"{"candidateCount":8,"max_tokens":1}"#), Ok(Some((4, 1))));
        assert_eq!(
            est(r#"{"generationConfig":{"candidateCount":0,"maxOutputTokens":9}}"#),
            Ok(Some((4, 9)))
        );
        assert_eq!(
            est(r#"{"generationConfig":{"candidateCount":4294967296,"maxOutputTokens":4294967296}}"#),
            Err(Defer)
        );
        assert_eq!(
            est(r#"{"generationConfig":{"candidateCount":99999999999999999999}}"#),
            Err(Defer)
        );
        assert_eq!(est(r#"{"prompt":"abcd","max_gen_len":66}"#), Ok(Some((5, 66))));
        assert_eq!(est(r#"{"max_gen_len":66,"max_tokens":5}"#), Ok(Some((4, 5))));
        assert_eq!(
            est(r#"{"textGenerationConfig":{"maxTokenCount":77}}"#),
            Ok(Some((4, 77)))
        );
    }

    #[test]
    fn skipped_keys_data_urls_and_repeats() {
        // "data:" strings and skipped keys count nothing; a repeated key keeps its last value.
        let body = r#"{"a":"data:xyz","role":"abcdef","b":["abc",{"type":"t","text":"xy"}],"b":"z"}"#;
        let f = request_facts(body.as_bytes()).unwrap().unwrap();
        assert_eq!(f.prompt_chars, 2);
        let body = r#"{"c":{"k":"aaaa","k":"b"},"c2":"\u0064ata:x"}"#;
        assert_eq!(request_facts(body.as_bytes()).unwrap().unwrap().prompt_chars, 2);
    }

    #[test]
    fn streams() {
        let f = |b: &str| request_facts(b.as_bytes()).unwrap().unwrap().stream_wants_usage;
        assert!(f(r#"{"stream":true}"#));
        assert!(!f(r#"{"stream":false}"#));
        assert!(!f(r#"{"stream":true,"stream_options":{"include_usage":true}}"#));
        assert!(f(
            r#"{"stream":true,"stream_options":{"include_usage":true,"include_usage":1}}"#
        ));
        assert!(f(
            r#"{"stream":true,"stream_options":{"include_usage":true},"stream_options":null}"#
        ));
    }

    #[test]
    fn prompt_depth_bound() {
        // Strings in containers down to depth 64 count; deeper ones do not.
        let nest = |n: usize| format!(r#"{{"a":{}"xy"{}}}"#, "[".repeat(n), "]".repeat(n));
        assert_eq!(request_facts(nest(64).as_bytes()).unwrap().unwrap().prompt_chars, 3);
        assert_eq!(request_facts(nest(65).as_bytes()).unwrap().unwrap().prompt_chars, 0);
        assert_eq!(request_facts(nest(100_000).as_bytes()), Err(Defer));
    }

    #[test]
    fn not_objects() {
        assert_eq!(request_facts(b"[1]"), Ok(None));
        assert_eq!(request_facts(b"{\"a\":"), Ok(None));
        assert_eq!(request_facts(b"\xff{}"), Err(Defer));
        assert_eq!(request_facts(br#"{"model":"\ud800"}"#), Err(Defer));
    }
}
