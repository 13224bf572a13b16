//! The readers of bytes a remote party controls (review21), over arbitrary bytes: SSE
//! framing, the response usage reader, the request readers. None may panic; the SSE
//! framing keeps at most `max(max_event, 3)` bytes, frames a stream the same however it
//! is cut (when no event is longer than the bound), and counts what a one-pass model
//! counts.

use proptest::prelude::*;
use ratequeue_core::llm::cap::{ask_stream_usage, cap_output, OUTPUT_BOUNDS};
use ratequeue_core::llm::sse::{handed_on, payload, SseFrames};
use ratequeue_core::llm::{request_facts, response_usage};

/// Bytes rich in what SSE and JSON framing turn on.
fn sse_bytes() -> impl Strategy<Value = Vec<u8>> {
    let atom = prop_oneof![
        Just(b"\n".to_vec()),
        Just(b"\r".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"\n\n".to_vec()),
        Just(b"\r\n\r\n".to_vec()),
        Just(b"data:".to_vec()),
        Just(b"data: ".to_vec()),
        Just(b"\"usage\"".to_vec()),
        Just(b" : {".to_vec()),
        Just(b"\"background\"".to_vec()),
        Just(b": true".to_vec()),
        Just(b"{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}".to_vec()),
        Just(b"\xEF\xBB\xBF".to_vec()),
        Just(b"\0".to_vec()),
        Just(b"\xff\xfe".to_vec()),
        Just(b"\\u0075".to_vec()),
        Just(b"99999999999999999999999".to_vec()),
        Just(b"[[[[[[[[".to_vec()),
        Just(b"{\"generationConfig\":{\"candidateCount\":".to_vec()),
        Just(b"\"candidate_count\":3,".to_vec()),
        Just(b"{\"textGenerationConfig\":{\"maxTokenCount\":".to_vec()),
        Just(b"{\"max_gen_len\":".to_vec()),
        Just(b"}}".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..6),
    ];
    proptest::collection::vec(atom, 0..40).prop_map(|v| v.concat())
}

/// `body` cut at `cuts` (positions taken modulo its length + 1).
fn chunks(body: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    at.sort_unstable();
    let mut out = Vec::new();
    let mut from = 0;
    for c in at {
        out.push(body[from..c].to_vec());
        from = c;
    }
    out.push(body[from..].to_vec());
    out
}

/// Each complete event of `body` (ending at the first `\n\n` or `\r\n\r\n`), in one pass.
fn model(body: &[u8]) -> (u64, Vec<Vec<u8>>) {
    let (mut n, mut found, mut start) = (0, Vec::new(), 0);
    loop {
        let rest = &body[start..];
        let lf = rest.windows(2).position(|w| w == b"\n\n");
        let crlf = rest.windows(4).position(|w| w == b"\r\n\r\n");
        let (end, sep) = match (lf, crlf) {
            (None, None) => break,
            (Some(a), Some(b)) if b < a => (b, 4),
            (None, Some(b)) => (b, 4),
            (Some(a), _) => (a, 2),
        };
        n += 1;
        let raw = &rest[..end];
        if handed_on(raw) {
            found.push(payload(raw));
        }
        start += end + sep;
    }
    (n, found)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn sse_framing_is_bounded_and_never_panics(
        body in sse_bytes(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
        max_event in prop_oneof![0usize..8, Just(40usize), Just(1usize << 20)],
    ) {
        let mut f = SseFrames::new(max_event);
        let mut found = Vec::new();
        for c in chunks(&body, &cuts) {
            f.feed(&c, |p| found.push(p));
            prop_assert!(f.buffered() <= max_event.max(3));
        }
        if max_event >= body.len() {
            // No event past the bound: the same as framing the whole body in one pass.
            let (n, want) = model(&body);
            prop_assert_eq!(f.events, n);
            prop_assert_eq!(found, want);
        }
    }

    #[test]
    fn json_readers_never_panic(body in sse_bytes(), limit in any::<u64>(), add in 0usize..OUTPUT_BOUNDS.len() + 1) {
        let _ = response_usage(&body);
        let _ = request_facts(&body);
        let _ = cap_output(&body, limit, add);
        if let Ok(new) = ask_stream_usage(&body) {
            // What is sent reads as a JSON object that no longer asks for its usage.
            let sent = request_facts(&new);
            prop_assert!(matches!(sent, Ok(Some(ref f)) if !f.stream_wants_usage), "{:?}", sent);
        }
    }
}

#[test]
fn a_bound_below_three_bytes_does_not_panic() {
    for max_event in 0..4 {
        let mut f = SseFrames::new(max_event);
        let mut found = Vec::new();
        for c in [&b"a"[..], b"bc", b"\n", b"\ndata: \"usage\":{}\n\n"] {
            f.feed(c, |p| found.push(p));
            assert!(f.buffered() <= 3);
        }
        assert_eq!(found, vec![b"\"usage\":{}".to_vec()], "max_event {max_event}");
    }
}

/// An event that never ends, sent a few bytes at a time: the framing keeps at most the
/// bound and its work per chunk stays proportional to the chunk, not to what is kept.
#[test]
fn an_endless_event_in_small_chunks_stays_bounded() {
    let max_event = 1 << 14;
    let mut f = SseFrames::new(max_event);
    let mut found = 0;
    let chunk = [b'x'; 7];
    for _ in 0..(4 * max_event / 7) {
        f.feed(&chunk, |_| found += 1);
        assert!(f.buffered() <= max_event);
    }
    f.feed(b"\n\ndata: \"usage\":{}\n\n", |_| found += 1);
    assert_eq!((found, f.events), (1, 1));
}
