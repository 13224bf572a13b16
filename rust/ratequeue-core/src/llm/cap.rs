//! An output cap written into a request body without re-serialising it. The cap bounds
//! the call's total output: a body asking for several choices (`n`, `best_of`, Gemini's
//! `candidateCount`: [`CHOICES`], [`NESTED_CHOICES`]) gets the cap divided among them.
//! Every place a known bound is read ([`OUTPUT_BOUNDS`]: top level, or one object down
//! such as Gemini's `generationConfig`) carries it: the value of every occurrence is
//! replaced by the per-choice number when any occurrence is above it or no count (a
//! negative int, not an int); a container without a bound gets one added before its
//! closing brace; a body with no bound and no container gets the route's field added
//! before its closing brace; every other byte stays. The same bytes as the Python
//! reference (`cap_fields` over a full parse, then `spliced`), or [`Defer`] where only it
//! can tell.

use super::scan::{Num, Scan, Scanner, Shape, Stop};
use super::Defer;

/// The output-bounding fields the estimate and the caps know, in the order the
/// estimate reads them: `(container, name)`, the container `""` for a top-level field
/// (the top-level ones first). Proto3 JSON (Gemini) takes either spelling of a field
/// name; a container's first bound here is the one added to it. Bedrock's InvokeModel
/// bodies: Meta Llama's `max_gen_len`, Amazon Nova's `inferenceConfig.maxTokens` (its
/// older bodies' `max_new_tokens` read and capped, never added), Amazon Titan Text's
/// `textGenerationConfig.maxTokenCount`.
pub const OUTPUT_BOUNDS: [(&str, &str); 11] = [
    ("", "max_completion_tokens"),
    ("", "max_output_tokens"),
    ("", "max_tokens"),
    ("", "max_gen_len"),
    ("generationConfig", "maxOutputTokens"),
    ("generationConfig", "max_output_tokens"),
    ("generation_config", "max_output_tokens"),
    ("generation_config", "maxOutputTokens"),
    ("inferenceConfig", "maxTokens"),
    ("inferenceConfig", "max_new_tokens"),
    ("textGenerationConfig", "maxTokenCount"),
];
/// The top-level output-bounding fields (the first of [`OUTPUT_BOUNDS`]).
pub const OUTPUT_FIELDS: [&str; 4] = [
    "max_completion_tokens",
    "max_output_tokens",
    "max_tokens",
    "max_gen_len",
];
/// Top-level fields asking for several choices, each one output as long as the bound.
pub const CHOICES: [&str; 2] = ["n", "best_of"];
/// Choice counts inside a container of [`CONTAINERS`]: Gemini's `candidateCount`, in
/// every spelling proto3 JSON takes (each candidate may produce `maxOutputTokens`).
pub const NESTED_CHOICES: [(&str, &str); 4] = [
    ("generationConfig", "candidateCount"),
    ("generationConfig", "candidate_count"),
    ("generation_config", "candidate_count"),
    ("generation_config", "candidateCount"),
];
/// Containers of nested bounds: name, and the group of spellings of one field it is in
/// (a body naming one group twice is refused: a parser keeping the first and one keeping
/// the last would read different bounds).
pub const CONTAINERS: [(&str, usize); 4] = [
    ("generationConfig", 0),
    ("generation_config", 0),
    ("inferenceConfig", 1),
    ("textGenerationConfig", 2),
];
/// Groups of [`CONTAINERS`].
const GROUPS: usize = 3;

/// Why a body a cap matches cannot be capped (the transport refuses the call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// An `n`, `best_of` or nested choice count that is not a positive integer.
    Choices,
    /// More choices than the cap has tokens: the per-choice bound would be 0.
    TooManyChoices,
    /// A container of nested bounds named twice (in one spelling or two).
    RepeatedContainer,
}

/// What a cap does to a body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Capping {
    /// Every bound is within the cap: the body is sent as it is.
    Kept,
    Capped(CappedBody),
    Refused(Refusal),
}

/// A body rewritten for a cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CappedBody {
    /// The new bytes.
    pub body: Vec<u8>,
    /// The field the record names (index in [`OUTPUT_BOUNDS`]): the last replaced, else
    /// the last added.
    pub field: usize,
    /// What that field asked for when it was an int (None: not an int, or added).
    pub requested: Option<u64>,
    /// The bound written (the cap divided among the choices).
    pub sent: u64,
}

/// An occurrence of a bound: its index in [`OUTPUT_BOUNDS`], where its value is, and the
/// value when it is a count (a non-negative int in 64 bits).
struct Occurrence {
    field: usize,
    start: usize,
    end: usize,
    count: Option<u64>,
}

/// A top-level occurrence of a container: which, where its value is, and, when it is an
/// object, where its closing brace is and whether it holds a bound.
struct Container {
    which: usize,
    start: usize,
    end: usize,
    object: Option<(usize, bool, bool)>, // (close, has members, has a bound)
}

fn count_of(shape: Shape<'_>) -> Scan<Option<u64>> {
    match shape {
        Shape::Num(Num::Int {
            negative: false,
            value: Some(v),
        }) => Ok(Some(v)),
        Shape::Num(Num::Int {
            negative: false,
            value: None,
        }) => Err(Stop::Defer),
        _ => Ok(None),
    }
}

/// `body` with its output bounds capped at `limit` for the whole call; `add` is the
/// bound (index in [`OUTPUT_BOUNDS`]) added when the body has no bound and no container.
/// `Err(Defer)` when the body is not a UTF-8 JSON object this scanner reads, or a bound,
/// `n` or `best_of` is an int past 64 bits.
pub fn cap_output(body: &[u8], limit: u64, add: usize) -> Result<Capping, Defer> {
    if add >= OUTPUT_BOUNDS.len() {
        return Err(Defer);
    }
    let scanner = Scanner::new(body).ok_or(Defer)?;
    let mut found: Vec<Occurrence> = Vec::new();
    let mut containers: Vec<Container> = Vec::new();
    let (mut choices, mut bad_choices) = (1u64, false);
    let mut members = 0usize;
    let mut close = 0usize;
    let read = scanner.document(|s| {
        s.object(1, |s, key| {
            members += 1;
            let start = s.pos;
            if CHOICES.iter().any(|c| key.is(c.as_bytes())) {
                match s.value(1)? {
                    Shape::Null => {} // the API's default: one choice
                    shape => match count_of(shape)? {
                        Some(v) if v >= 1 => choices = choices.max(v),
                        _ => bad_choices = true,
                    },
                }
            } else if let Some(which) = CONTAINERS.iter().position(|(c, _)| key.is(c.as_bytes())) {
                if s.peek() != Some(b'{') {
                    s.value(1)?;
                    containers.push(Container {
                        which,
                        start,
                        end: s.pos,
                        object: None,
                    });
                    return Ok(());
                }
                let (mut inner, mut bound) = (false, false);
                let name = CONTAINERS[which].0;
                s.object(2, |s, k| {
                    inner = true;
                    let at = s.pos;
                    let shape = s.value(2)?;
                    if NESTED_CHOICES.iter().any(|(c, n)| *c == name && k.is(n.as_bytes())) {
                        match shape {
                            Shape::Null => {} // the API's default: one candidate
                            shape => match count_of(shape)? {
                                Some(v) if v >= 1 => choices = choices.max(v),
                                _ => bad_choices = true,
                            },
                        }
                        return Ok(());
                    }
                    let f = OUTPUT_BOUNDS.iter().position(|(c, n)| *c == name && k.is(n.as_bytes()));
                    if let Some(field) = f {
                        bound = true;
                        found.push(Occurrence {
                            field,
                            start: at,
                            end: s.pos,
                            count: count_of(shape)?,
                        });
                    }
                    Ok(())
                })?;
                containers.push(Container {
                    which,
                    start,
                    end: s.pos,
                    object: Some((s.pos - 1, inner, bound)),
                });
            } else {
                let shape = s.value(1)?;
                if let Some(field) = OUTPUT_FIELDS.iter().position(|f| key.is(f.as_bytes())) {
                    found.push(Occurrence {
                        field,
                        start,
                        end: s.pos,
                        count: count_of(shape)?,
                    });
                }
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
    if bad_choices {
        return Ok(Capping::Refused(Refusal::Choices));
    }
    let per = limit / choices;
    if per == 0 {
        return Ok(Capping::Refused(Refusal::TooManyChoices));
    }
    for group in 0..GROUPS {
        if containers.iter().filter(|c| CONTAINERS[c.which].1 == group).count() > 1 {
            return Ok(Capping::Refused(Refusal::RepeatedContainer));
        }
    }
    let number = per.to_string();
    let mut edits: Vec<(usize, usize, Vec<u8>)> = Vec::new();
    let mut replaced: Option<(usize, Option<u64>)> = None;
    let mut added: Option<usize> = None;
    for field in 0..OUTPUT_BOUNDS.len() {
        let over = |o: &&Occurrence| o.field == field && o.count.is_none_or(|v| v > per);
        let Some(last) = found.iter().rfind(over) else {
            continue;
        };
        replaced = Some((field, last.count));
        for o in found.iter().filter(|o| o.field == field) {
            edits.push((o.start, o.end, number.as_bytes().to_vec()));
        }
    }
    let top_bound = found.iter().any(|o| o.field < OUTPUT_FIELDS.len());
    for c in &containers {
        let name = CONTAINERS[c.which].0;
        let field = OUTPUT_BOUNDS.iter().position(|(n, _)| *n == name).unwrap_or(add);
        let inner = OUTPUT_BOUNDS[field].1;
        match c.object {
            Some((_, _, true)) => continue,
            Some((at, members, false)) => {
                let comma = if members { "," } else { "" };
                edits.push((at, at, format!("{comma}\"{inner}\":{number}").into_bytes()));
            }
            None => edits.push((c.start, c.end, format!("{{\"{inner}\":{number}}}").into_bytes())),
        }
        added = added.max(Some(field));
    }
    if !top_bound && containers.is_empty() {
        let (outer, inner) = OUTPUT_BOUNDS[add];
        let comma = if members > 0 { "," } else { "" };
        let text = if outer.is_empty() {
            format!("{comma}\"{inner}\":{number}")
        } else {
            format!("{comma}\"{outer}\":{{\"{inner}\":{number}}}")
        };
        edits.push((close, close, text.into_bytes()));
        added = Some(add);
    }
    let (field, requested) = match (replaced, added) {
        (Some(r), _) => r,
        (None, Some(f)) => (f, None),
        (None, None) => return Ok(Capping::Kept),
    };
    edits.sort_by_key(|e| e.0);
    let mut out = Vec::with_capacity(body.len() + 48);
    let mut at = 0;
    for (a, b, text) in edits {
        out.extend_from_slice(&body[at..a]);
        out.extend_from_slice(&text);
        at = b;
    }
    out.extend_from_slice(&body[at..]);
    Ok(Capping::Capped(CappedBody {
        body: out,
        field,
        requested,
        sent: per,
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
        cap_output(body.as_bytes(), limit, add).map(|r| match r {
            Capping::Kept => None,
            Capping::Capped(c) => Some((String::from_utf8(c.body).unwrap(), c.field, c.requested)),
            Capping::Refused(why) => panic!("refused: {why:?}"),
        })
    }

    #[test]
    fn divides_the_cap_among_choices() {
        assert_eq!(
            cap(r#"{"n":4,"max_tokens":5000,"n":2}"#, 100, 0),
            Ok(Some((r#"{"n":4,"max_tokens":25,"n":2}"#.into(), 2, Some(5000))))
        );
        assert_eq!(
            cap(r#"{"best_of":3}"#, 100, 2),
            Ok(Some((r#"{"best_of":3,"max_tokens":33}"#.into(), 2, None)))
        );
        assert_eq!(cap(r#"{"n":4,"max_tokens":25}"#, 100, 0), Ok(None));
        // null is the API's default: one choice
        assert_eq!(
            cap(r#"{"n":null,"max_tokens":500}"#, 100, 0),
            Ok(Some((r#"{"n":null,"max_tokens":100}"#.into(), 2, Some(500))))
        );
        let refused = |b: &str| match cap_output(b.as_bytes(), 100, 0) {
            Ok(Capping::Refused(why)) => Some(why),
            _ => None,
        };
        assert_eq!(refused(r#"{"n":101}"#), Some(Refusal::TooManyChoices));
        for b in [
            r#"{"n":0}"#,
            r#"{"n":-1}"#,
            r#"{"n":2.0}"#,
            r#"{"best_of":"2"}"#,
            r#"{"n":true}"#,
        ] {
            assert_eq!(refused(b), Some(Refusal::Choices), "{b}");
        }
        assert_eq!(refused(r#"{"n":99999999999999999999999}"#), None); // deferred
        assert_eq!(cap_output(br#"{"n":99999999999999999999999}"#, 100, 0), Err(Defer));
        assert_eq!(
            refused(r#"{"generationConfig":{},"generation_config":{}}"#),
            Some(Refusal::RepeatedContainer)
        );
        assert_eq!(
            refused(r#"{"inferenceConfig":{},"inferenceConfig":{}}"#),
            Some(Refusal::RepeatedContainer)
        );
    }

    #[test]
    fn caps_nested_bounds_in_place_and_adds_them_to_containers() {
        assert_eq!(
            cap(r#"{"generationConfig": {"t":1, "maxOutputTokens": 5000}}"#, 100, 2),
            Ok(Some((
                r#"{"generationConfig": {"t":1, "maxOutputTokens": 100}}"#.into(),
                4,
                Some(5000)
            )))
        );
        assert_eq!(
            cap(r#"{"max_tokens":5000,"generationConfig":{ }}"#, 100, 2),
            Ok(Some((
                r#"{"max_tokens":100,"generationConfig":{ "maxOutputTokens":100}}"#.into(),
                2,
                Some(5000)
            )))
        );
        assert_eq!(
            cap(r#"{"max_tokens":5,"inferenceConfig":null,"generation_config":{"a":1}}"#, 100, 2),
            Ok(Some((
                r#"{"max_tokens":5,"inferenceConfig":{"maxTokens":100},"generation_config":{"a":1,"max_output_tokens":100}}"#.into(),
                8,
                None
            )))
        );
        assert_eq!(
            cap(r#"{}"#, 100, 4),
            Ok(Some((
                r#"{"generationConfig":{"maxOutputTokens":100}}"#.into(),
                4,
                None
            )))
        );
        assert_eq!(cap(r#"{"generationConfig":{"maxOutputTokens":7}}"#, 100, 2), Ok(None));
        // Nested deeper than one object down is not a bound.
        assert_eq!(
            cap(r#"{"a":{"generationConfig":{"maxOutputTokens":5000}}}"#, 100, 2),
            Ok(Some((
                r#"{"a":{"generationConfig":{"maxOutputTokens":5000}},"max_tokens":100}"#.into(),
                2,
                None
            )))
        );
    }

    #[test]
    fn the_tables_agree() {
        for (i, f) in OUTPUT_FIELDS.iter().enumerate() {
            assert_eq!(OUTPUT_BOUNDS[i], ("", *f));
        }
        assert!(OUTPUT_BOUNDS[OUTPUT_FIELDS.len()..].iter().all(|(c, _)| !c.is_empty()));
        for (c, _) in OUTPUT_BOUNDS.iter().chain(NESTED_CHOICES.iter()) {
            assert!(c.is_empty() || CONTAINERS.iter().any(|(n, _)| n == c), "{c}");
        }
        assert!(CONTAINERS.iter().all(|(_, g)| *g < GROUPS));
    }

    #[test]
    fn gemini_candidates_share_the_cap() {
        assert_eq!(
            cap(
                r#"{"generationConfig":{"candidateCount":8,"maxOutputTokens":5000}}"#,
                100,
                2
            ),
            Ok(Some((
                r#"{"generationConfig":{"candidateCount":8,"maxOutputTokens":12}}"#.into(),
                4,
                Some(5000)
            )))
        );
        // Every occurrence of a repeated key, every spelling; null is one candidate.
        assert_eq!(
            cap(
                r#"{"generation_config":{"candidate_count":4,"candidateCount":1,"candidate_count":null}}"#,
                100,
                2
            ),
            Ok(Some((
                r#"{"generation_config":{"candidate_count":4,"candidateCount":1,"candidate_count":null,"max_output_tokens":25}}"#.into(),
                6,
                None
            )))
        );
        assert_eq!(
            cap(r#"{"n":3,"generationConfig":{"candidate\u0043ount":5}}"#, 100, 2),
            Ok(Some((
                r#"{"n":3,"generationConfig":{"candidate\u0043ount":5,"maxOutputTokens":20}}"#.into(),
                4,
                None
            )))
        );
        assert_eq!(
            cap(
                r#"{"generationConfig":{"candidateCount":4,"maxOutputTokens":25}}"#,
                100,
                2
            ),
            Ok(None)
        );
        // Elsewhere it counts nothing.
        assert_eq!(
            cap(
                r#"{"candidateCount":4,"inferenceConfig":{"candidateCount":4,"maxTokens":500}}"#,
                100,
                2
            ),
            Ok(Some((
                r#"{"candidateCount":4,"inferenceConfig":{"candidateCount":4,"maxTokens":100}}"#.into(),
                8,
                Some(500)
            )))
        );
        let refused = |b: &str| match cap_output(b.as_bytes(), 100, 0) {
            Ok(Capping::Refused(why)) => Some(why),
            _ => None,
        };
        assert_eq!(
            refused(r#"{"generationConfig":{"candidateCount":101}}"#),
            Some(Refusal::TooManyChoices)
        );
        for b in [
            r#"{"generationConfig":{"candidateCount":0}}"#,
            r#"{"generationConfig":{"candidate_count":-1}}"#,
            r#"{"generation_config":{"candidateCount":2.0}}"#,
            r#"{"generationConfig":{"candidateCount":"2"}}"#,
            r#"{"generationConfig":{"candidateCount":2,"candidateCount":{}}}"#,
        ] {
            assert_eq!(refused(b), Some(Refusal::Choices), "{b}");
        }
        assert_eq!(
            cap_output(
                br#"{"generationConfig":{"candidateCount":99999999999999999999999}}"#,
                100,
                0
            ),
            Err(Defer)
        );
    }

    #[test]
    fn titan_and_llama_bounds() {
        let titan = OUTPUT_BOUNDS
            .iter()
            .position(|b| *b == ("textGenerationConfig", "maxTokenCount"))
            .unwrap();
        assert_eq!(
            cap(r#"{"prompt":"x","max_gen_len":500}"#, 100, 2),
            Ok(Some((r#"{"prompt":"x","max_gen_len":100}"#.into(), 3, Some(500))))
        );
        assert_eq!(
            cap(r#"{"prompt":"x"}"#, 100, 3),
            Ok(Some((r#"{"prompt":"x","max_gen_len":100}"#.into(), 3, None)))
        );
        assert_eq!(
            cap(r#"{"textGenerationConfig":{"maxTokenCount":500,"topP":1}}"#, 100, 2),
            Ok(Some((
                r#"{"textGenerationConfig":{"maxTokenCount":100,"topP":1}}"#.into(),
                titan,
                Some(500)
            )))
        );
        assert_eq!(
            cap(r#"{"inputText":"x"}"#, 100, titan),
            Ok(Some((
                r#"{"inputText":"x","textGenerationConfig":{"maxTokenCount":100}}"#.into(),
                titan,
                None
            )))
        );
        assert_eq!(
            cap(r#"{"textGenerationConfig":{}}"#, 100, 2),
            Ok(Some((
                r#"{"textGenerationConfig":{"maxTokenCount":100}}"#.into(),
                titan,
                None
            )))
        );
        assert_eq!(
            cap_output(br#"{"textGenerationConfig":{},"textGenerationConfig":{}}"#, 100, 0),
            Ok(Capping::Refused(Refusal::RepeatedContainer))
        );
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
        assert_eq!(cap("{}", 7, OUTPUT_BOUNDS.len()), Err(Defer));
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
