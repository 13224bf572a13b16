//! The usage a response body reports: the top-level `usage` (or `response.usage`) in
//! either dialect, decided exactly as the Python reference (`usage_from_json` over a
//! full `json` parse) decides it, in one validating pass that keeps nothing else.

use std::sync::LazyLock;

use memchr::memmem::Finder;

use super::scan::{Num, Scan, Scanner, Shape, Stop};
use super::{Defer, Usage};

/// One field of a usage object as it last appeared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Field {
    /// Not in the object.
    #[default]
    Absent,
    /// `null` (Python's `None`, like an absent field for the first test).
    Null,
    /// An int >= 0 that fits a `u64`.
    Count(u64),
    /// An int >= 0 past `u64`: usable, but the reference must say how.
    Huge,
    /// Anything else: a negative int, a float, a bool, a string, a container.
    Other,
}

impl Field {
    fn of(shape: Shape<'_>) -> Self {
        match shape {
            Shape::Null => Field::Null,
            Shape::Num(Num::Int {
                negative: false,
                value: Some(v),
            }) => Field::Count(v),
            Shape::Num(Num::Int {
                negative: false,
                value: None,
            }) => Field::Huge,
            _ => Field::Other,
        }
    }

    fn is_none(self) -> bool {
        matches!(self, Field::Absent | Field::Null)
    }

    /// The count when the field is an int >= 0.
    fn count(self) -> Result<Option<u64>, Defer> {
        match self {
            Field::Count(v) => Ok(Some(v)),
            Field::Huge => Err(Defer),
            _ => Ok(None),
        }
    }
}

/// The fields of one `usage` object that either dialect reads.
#[derive(Clone, Copy, Debug, Default)]
struct Fields {
    input: Field,
    output: Field,
    prompt: Field,
    completion: Field,
    cache_creation: Field,
    cache_read: Field,
}

/// A `usage` value: an object's fields, or None when it is not an object.
type UsageValue = Option<Fields>;

impl Fields {
    fn slot(&mut self, key: &super::scan::Str<'_>) -> Option<&mut Field> {
        let name: &[u8] = if key.escaped {
            // Rare: compare the decoded key.
            return [
                (b"input_tokens" as &[u8], &mut self.input),
                (b"output_tokens", &mut self.output),
                (b"prompt_tokens", &mut self.prompt),
                (b"completion_tokens", &mut self.completion),
                (b"cache_creation_input_tokens", &mut self.cache_creation),
                (b"cache_read_input_tokens", &mut self.cache_read),
            ]
            .into_iter()
            .find(|(n, _)| key.is(n))
            .map(|(_, f)| f);
        } else {
            key.raw
        };
        Some(match name {
            b"input_tokens" => &mut self.input,
            b"output_tokens" => &mut self.output,
            b"prompt_tokens" => &mut self.prompt,
            b"completion_tokens" => &mut self.completion,
            b"cache_creation_input_tokens" => &mut self.cache_creation,
            b"cache_read_input_tokens" => &mut self.cache_read,
            _ => return None,
        })
    }

    /// `usage_of`: the usage this object reports, or None.
    fn usage(&self) -> Result<Option<Usage>, Defer> {
        let (i, o) = (self.input, self.output);
        if i.is_none() && o.is_none() {
            let (i, o) = (self.prompt.count()?, self.completion.count()?);
            if i.is_none() && o.is_none() {
                return Ok(None);
            }
            return Ok(Some(Usage::new(i.unwrap_or(0), o.unwrap_or(0))));
        }
        let (mut i, mut o) = (i.count()?, o.count()?);
        if i.is_none() && o.is_none() {
            // Neither field usable: the OpenAI chat names may still be.
            i = self.prompt.count()?;
            o = self.completion.count()?;
            if i.is_none() && o.is_none() {
                return Ok(None);
            }
        } else {
            // Anthropic counts cached input apart from input_tokens: all of it was sent.
            for extra in [self.cache_creation, self.cache_read] {
                if let Some(e) = extra.count()?.filter(|&e| e != 0) {
                    i = Some(i.unwrap_or(0).checked_add(e).ok_or(Defer)?);
                }
            }
        }
        Ok(Some(Usage::new(i.unwrap_or(0), o.unwrap_or(0))))
    }
}

fn usage_value(s: &mut Scanner<'_>, depth: usize) -> Scan<UsageValue> {
    if s.peek() != Some(b'{') {
        s.value(depth)?;
        return Ok(None);
    }
    let mut fields = Fields::default();
    s.object(depth + 1, |s, key| {
        match fields.slot(&key) {
            Some(slot) => *slot = Field::of(s.value(depth + 1)?),
            None => {
                s.value(depth + 1)?;
            }
        }
        Ok(())
    })?;
    Ok(Some(fields))
}

/// The top level's last `usage` and last `response` (when an object: its last `usage`).
#[derive(Default)]
struct Top {
    usage: UsageValue,
    response: Option<UsageValue>,
}

/// The usage a response body reports, exactly as `usage_from_json(json_object(body))`
/// finds it: None when the body is not a JSON object or reports none; `Err(Defer)` when
/// only the reference parser can tell (other encodings, nesting past the bound, counts
/// past `u64`).
pub fn response_usage(body: &[u8]) -> Result<Option<Usage>, Defer> {
    // A UTF-8 object that cannot name `usage` (no `"usage"`, no escape that could
    // spell it) reports none, valid or not.
    static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));
    static ESCAPE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\\u"));
    if body.first() == Some(&b'{') && USAGE.find(body).is_none() && ESCAPE.find(body).is_none() {
        return Ok(None);
    }
    let scanner = Scanner::new(body).ok_or(Defer)?;
    let top = scanner.document(|s| {
        let mut top = Top::default();
        s.object(1, |s, key| {
            if key.is(b"usage") {
                top.usage = usage_value(s, 1)?;
            } else if key.is(b"response") {
                if s.peek() == Some(b'{') {
                    let mut inner: UsageValue = None;
                    s.object(2, |s, key| {
                        if key.is(b"usage") {
                            inner = usage_value(s, 2)?;
                        } else {
                            s.value(2)?;
                        }
                        Ok(())
                    })?;
                    top.response = Some(inner);
                } else {
                    s.value(1)?;
                    top.response = None;
                }
            } else {
                s.value(1)?;
            }
            Ok(())
        })?;
        Ok(top)
    });
    let top = match top {
        Ok(Some(top)) => top,
        Ok(None) => return Ok(None),
        Err(Stop::Defer) | Err(Stop::Invalid) => return Err(Defer),
    };
    let u = match top.usage {
        Some(f) => f.usage()?,
        None => None,
    };
    if u.is_some() {
        return Ok(u);
    }
    match top.response {
        Some(Some(f)) => f.usage(),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(body: &str) -> Result<Option<(u64, u64)>, Defer> {
        response_usage(body.as_bytes()).map(|o| o.map(|u| (u.input_tokens, u.output_tokens)))
    }

    #[test]
    fn both_dialects() {
        assert_eq!(
            u(r#"{"usage":{"prompt_tokens":80,"completion_tokens":20,"total_tokens":100}}"#),
            Ok(Some((80, 20)))
        );
        assert_eq!(u(r#"{"usage":{"input_tokens":5,"output_tokens":7}}"#), Ok(Some((5, 7))));
        assert_eq!(
            u(
                r#"{"usage":{"input_tokens":5,"output_tokens":7,"cache_creation_input_tokens":3,"cache_read_input_tokens":2}}"#
            ),
            Ok(Some((10, 7)))
        );
        assert_eq!(
            u(r#"{"response":{"usage":{"input_tokens":1,"output_tokens":2}}}"#),
            Ok(Some((1, 2)))
        );
    }

    #[test]
    fn odd_values_as_the_reference() {
        assert_eq!(
            u(r#"{"usage":{"prompt_tokens":-1,"completion_tokens":4}}"#),
            Ok(Some((0, 4)))
        );
        assert_eq!(
            u(r#"{"usage":{"prompt_tokens":true,"completion_tokens":1.0}}"#),
            Ok(None)
        );
        assert_eq!(
            u(r#"{"usage":{"input_tokens":null,"prompt_tokens":3}}"#),
            Ok(Some((3, 0)))
        );
        assert_eq!(
            u(r#"{"usage":{"input_tokens":"x","prompt_tokens":3}}"#),
            Ok(Some((3, 0)))
        );
        assert_eq!(
            u(r#"{"usage":{"input_tokens":-0,"output_tokens":-5}}"#),
            Ok(Some((0, 0)))
        );
        assert_eq!(u(r#"{"usage":{"input_tokens":"a","output_tokens":"b"}}"#), Ok(None));
        assert_eq!(u(r#"{"usage":[1,2]}"#), Ok(None));
        assert_eq!(
            u(r#"{"usage":{"prompt_tokens":1,"completion_tokens":2},"usage":null}"#),
            Ok(None)
        );
        assert_eq!(
            u(r#"{"usage":null,"response":{"usage":{"input_tokens":4}}}"#),
            Ok(Some((4, 0)))
        );
        assert_eq!(
            u(r#"{"u\u0073age":{"prompt_tokens":1,"completion_tokens":2}}"#),
            Ok(Some((1, 2)))
        );
        assert_eq!(u(r#"{"usage":{"input_tokens":18446744073709551616}}"#), Err(Defer));
        assert_eq!(
            u(r#"{"usage":{"input_tokens":18446744073709551615,"cache_read_input_tokens":1}}"#),
            Err(Defer)
        );
    }

    #[test]
    fn usage_elsewhere_does_not_count() {
        assert_eq!(u(r#"{"x":"\"usage\":{\"prompt_tokens\":1}"}"#), Ok(None));
        assert_eq!(
            u(r#"{"x":{"usage":{"prompt_tokens":1,"completion_tokens":2}}}"#),
            Ok(None)
        );
        assert_eq!(u(r#"{"usage":{"prompt_tokens":1,"completion_tokens":2}"#), Ok(None));
        assert_eq!(u(r#"{"usage":{"prompt_tokens":1,"completion_tokens":2}} x"#), Ok(None));
        assert_eq!(u(r#"[{"usage":{"prompt_tokens":1,"completion_tokens":2}}]"#), Ok(None));
        assert_eq!(
            u(r#"{"usage":{"prompt_tokens":1,"completion_tokens":2},"x":[1,]}"#),
            Ok(None)
        );
    }

    #[test]
    fn deep_bodies_are_deferred() {
        let deep = format!(
            r#"{{"usage":{{"prompt_tokens":1,"completion_tokens":2}},"x":{}{}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(u(&deep), Err(Defer));
    }
}
