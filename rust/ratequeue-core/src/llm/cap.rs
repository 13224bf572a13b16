//! An output cap written into a request body without re-serialising it: the value of
//! every top-level occurrence of an output-bounding field is replaced by the cap's
//! number when any occurrence is above the cap or no count (a negative int, not an
//! int), or the field is added before the closing brace; every other byte stays. The same bytes as the Python reference (`apply_limit` over a full parse, then
//! `spliced`), or [`Defer`] where only it can tell.

use super::scan::{Num, Scanner, Shape, Stop};
use super::Defer;

/// The output-bounding fields, in the order the reference checks them.
pub const OUTPUT_FIELDS: [&str; 3] = ["max_completion_tokens", "max_output_tokens", "max_tokens"];

/// What a field's occurrences are, for the cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    Absent,
    /// Every occurrence a count the cap keeps (an int from 0 to the cap).
    Kept,
    /// An occurrence the cap replaces, the last such: a non-negative int above the cap
    /// (its value), or no count (None: a negative int, bool, float, string, null,
    /// container).
    Over(Option<u64>),
}

/// A body rewritten for a cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CappedBody {
    /// The new bytes.
    pub body: Vec<u8>,
    /// The field the record names (index in [`OUTPUT_FIELDS`]): the last replaced, or
    /// the one added.
    pub field: usize,
    /// What that field asked for when it was an int (None: not an int, or added).
    pub requested: Option<u64>,
}

/// `body` with its output bound capped at `limit`: `Ok(None)` when nothing changes
/// (every occurrence of every bound present is an int from 0 to `limit`); `add` is the field (index in
/// [`OUTPUT_FIELDS`]) added when none is present. `Err(Defer)` when the body is not a
/// UTF-8 JSON object this scanner reads, or a bound above the cap is past 64 bits.
pub fn cap_output(body: &[u8], limit: u64, add: usize) -> Result<Option<CappedBody>, Defer> {
    if add >= OUTPUT_FIELDS.len() {
        return Err(Defer);
    }
    let scanner = Scanner::new(body).ok_or(Defer)?;
    let mut seen = [Seen::Absent; 3];
    let mut spans: Vec<(usize, usize, usize)> = Vec::new(); // (field, start, end)
    let mut members = 0usize;
    let mut close = 0usize;
    let read = scanner.document(|s| {
        s.object(1, |s, key| {
            members += 1;
            let start = s.pos;
            let shape = s.value(1)?;
            if let Some(f) = OUTPUT_FIELDS.iter().position(|f| key.is(f.as_bytes())) {
                spans.push((f, start, s.pos));
                // Any occurrence over the cap writes them all: a parser that keeps the
                // first of a repeated key sees the cap too, not only one that keeps the
                // last. A negative bound is no count (some servers read -1 as no limit).
                let over = match shape {
                    Shape::Num(Num::Int { negative: true, .. }) => Some(None),
                    Shape::Num(Num::Int { value: Some(v), .. }) if v <= limit => None,
                    Shape::Num(Num::Int { value: Some(v), .. }) => Some(Some(v)),
                    Shape::Num(Num::Int { value: None, .. }) => return Err(Stop::Defer),
                    _ => Some(None),
                };
                seen[f] = match (over, seen[f]) {
                    (Some(asked), _) => Seen::Over(asked),
                    (None, Seen::Absent) => Seen::Kept,
                    (None, was) => was,
                };
            }
            Ok(())
        })?;
        close = s.pos - 1;
        Ok(())
    });
    match read {
        Ok(Some(())) => {}
        Ok(None) | Err(_) => return Err(Defer),
    }
    let number = limit.to_string();
    let mut edits: Vec<(usize, usize, Vec<u8>)> = Vec::new();
    let (mut field, mut requested) = (add, None);
    if seen.iter().all(|s| *s == Seen::Absent) {
        let mut text = Vec::new();
        if members > 0 {
            text.push(b',');
        }
        text.push(b'"');
        text.extend_from_slice(OUTPUT_FIELDS[add].as_bytes());
        text.extend_from_slice(b"\":");
        text.extend_from_slice(number.as_bytes());
        edits.push((close, close, text));
    } else {
        let mut any = false;
        for (f, s) in seen.iter().enumerate() {
            let Seen::Over(asked) = *s else {
                continue;
            };
            any = true;
            (field, requested) = (f, asked);
            for &(g, a, b) in &spans {
                if g == f {
                    edits.push((a, b, number.as_bytes().to_vec()));
                }
            }
        }
        if !any {
            return Ok(None);
        }
        edits.sort_by_key(|e| e.0);
    }
    let mut out = Vec::with_capacity(body.len() + 32);
    let mut at = 0;
    for (a, b, text) in edits {
        out.extend_from_slice(&body[at..a]);
        out.extend_from_slice(&text);
        at = b;
    }
    out.extend_from_slice(&body[at..]);
    Ok(Some(CappedBody {
        body: out,
        field,
        requested,
    }))
}

/// What a streamed chat call is asked for so that its last event carries the usage.
pub const STREAM_USAGE_FIELD: &[u8] = br#""stream_options":{"include_usage":true}"#;

/// `body` with `"stream_options":{"include_usage":true}` added before its closing brace
/// (every other byte kept), the bytes the Python reference (`_stream_opts`, then
/// `spliced`) writes when the body has no top-level `stream_options`. `Err(Defer)` when
/// it has one (the reference merges into it), or when the body is not a UTF-8 JSON
/// object this scanner reads. The caller asks only for a body whose `stream` is true.
pub fn ask_stream_usage(body: &[u8]) -> Result<Vec<u8>, Defer> {
    let scanner = Scanner::new(body).ok_or(Defer)?;
    let mut members = 0usize;
    let mut close = 0usize;
    let read = scanner.document(|s| {
        s.object(1, |s, key| {
            members += 1;
            if key.is(b"stream_options") {
                return Err(Stop::Defer);
            }
            s.value(1)?;
            Ok(())
        })?;
        close = s.pos - 1;
        Ok(())
    });
    match read {
        Ok(Some(())) => {}
        Ok(None) | Err(_) => return Err(Defer),
    }
    let mut out = Vec::with_capacity(body.len() + STREAM_USAGE_FIELD.len() + 1);
    out.extend_from_slice(&body[..close]);
    if members > 0 {
        out.push(b',');
    }
    out.extend_from_slice(STREAM_USAGE_FIELD);
    out.extend_from_slice(&body[close..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(body: &str, limit: u64, add: usize) -> Result<Option<(String, usize, Option<u64>)>, Defer> {
        cap_output(body.as_bytes(), limit, add)
            .map(|r| r.map(|c| (String::from_utf8(c.body).unwrap(), c.field, c.requested)))
    }

    #[test]
    fn lowers_every_occurrence_and_never_raises() {
        assert_eq!(
            cap(r#"{"max_tokens": 500, "a":1, "max_tokens" :900 }"#, 100, 0),
            Ok(Some((
                r#"{"max_tokens": 100, "a":1, "max_tokens" :100 }"#.into(),
                2,
                Some(900)
            )))
        );
        // Any occurrence over the cap writes every one (first-wins parsers included).
        assert_eq!(
            cap(r#"{"max_tokens":500,"max_tokens":5}"#, 100, 0),
            Ok(Some((r#"{"max_tokens":100,"max_tokens":100}"#.into(), 2, Some(500))))
        );
        assert_eq!(
            cap(r#"{"max_tokens":500,"max\u005ftokens":null,"max_tokens":5}"#, 100, 0),
            Ok(Some((
                r#"{"max_tokens":100,"max\u005ftokens":100,"max_tokens":100}"#.into(),
                2,
                None
            )))
        );
        assert_eq!(cap(r#"{"max_tokens":5,"max_tokens":100}"#, 100, 0), Ok(None));
        // A negative bound is no count: replaced.
        assert_eq!(
            cap(r#"{"max_tokens":-7}"#, 100, 0),
            Ok(Some((r#"{"max_tokens":100}"#.into(), 2, None)))
        );
        assert_eq!(cap(r#"{"max_tokens":-0}"#, 100, 0), Ok(None));
        assert_eq!(cap(r#"{"max_tokens":100}"#, 100, 0), Ok(None));
        assert_eq!(
            cap(r#"{"max_tokens":1.0,"max_completion_tokens":true}"#, 9, 0),
            Ok(Some((r#"{"max_tokens":9,"max_completion_tokens":9}"#.into(), 2, None)))
        );
        assert_eq!(
            cap(r#"{"max\u005ftokens":{"max_tokens":1000}}"#, 9, 0),
            Ok(Some((r#"{"max\u005ftokens":9}"#.into(), 2, None)))
        );
    }

    #[test]
    fn adds_a_missing_bound() {
        assert_eq!(
            cap(r#"{"model":"ü" }"#, 7, 1),
            Ok(Some((r#"{"model":"ü" ,"max_output_tokens":7}"#.into(), 1, None)))
        );
        assert_eq!(cap(" { } ", 7, 2), Ok(Some((r#" { "max_tokens":7} "#.into(), 2, None))));
    }

    #[test]
    fn defers() {
        assert_eq!(cap(r#"{"max_tokens":99999999999999999999999}"#, 7, 0), Err(Defer));
        assert_eq!(cap("[1]", 7, 0), Err(Defer));
        assert_eq!(cap(r#"{"a":"#, 7, 0), Err(Defer));
        assert_eq!(cap_output(b"\xff{}", 7, 0), Err(Defer));
        assert_eq!(cap("{}", 7, 3), Err(Defer));
    }

    #[test]
    fn asks_a_stream_for_its_usage() {
        let ask = |b: &str| ask_stream_usage(b.as_bytes()).map(|v| String::from_utf8(v).unwrap());
        assert_eq!(
            ask(r#"{"stream": true }"#),
            Ok(r#"{"stream": true ,"stream_options":{"include_usage":true}}"#.into())
        );
        assert_eq!(ask(" {} "), Ok(r#" {"stream_options":{"include_usage":true}} "#.into()));
        assert_eq!(ask(r#"{"stream":true,"stream_options":null}"#), Err(Defer));
        assert_eq!(ask(r#"{"stream":true,"stream\u005foptions":{}}"#), Err(Defer));
        assert_eq!(ask("[true]"), Err(Defer));
        assert_eq!(ask(r#"{"stream":"#), Err(Defer));
    }
}
