//! Server-Sent Events framed as they pass, for the usage they report: events end at a
//! blank line (`\n\n` or `\r\n\r\n`); at most one partial event of at most `max_event`
//! bytes is kept (a longer one is skipped up to its end, never buffered). Only events
//! that mention a usage object (`"usage"`, blanks, `:`, blanks, `{`) or a background
//! response (`"background"`, blanks, `:`, blanks, `true`: its id, should the stream be
//! cut before its usage) are handed on, as their `data:` lines joined: the same rules as
//! the Python reference (`SSEUsage`).

use std::sync::LazyLock;

use memchr::memmem::{self, Finder};

/// The framing state of one stream.
#[derive(Debug)]
pub struct SseFrames {
    buf: Vec<u8>,
    skip: bool,
    max_event: usize,
    /// Events read (complete, not skipped).
    pub events: u64,
}

/// Python's `bytes` regex `\s`: ASCII blanks.
fn blank(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

/// The searchers of the keys, built once (a search builds none).
static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));
static BACKGROUND: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"background\""));

/// True when `raw` holds the key `key` finds, blanks, `:`, blanks, `value`.
fn mentions(raw: &[u8], key: &Finder<'_>, value: &[u8]) -> bool {
    let mut from = 0;
    while let Some(i) = key.find(&raw[from..]) {
        let mut p = from + i + key.needle().len();
        while p < raw.len() && blank(raw[p]) {
            p += 1;
        }
        if p < raw.len() && raw[p] == b':' {
            p += 1;
            while p < raw.len() && blank(raw[p]) {
                p += 1;
            }
            if raw[p..].starts_with(value) {
                return true;
            }
        }
        from += i + 1;
    }
    false
}

/// True when `raw` holds `"usage"`, blanks, `:`, blanks, `{`.
pub fn mentions_usage(raw: &[u8]) -> bool {
    mentions(raw, &USAGE, b"{")
}

/// True when `raw` holds `"background"`, blanks, `:`, blanks, `true`.
pub fn mentions_background(raw: &[u8]) -> bool {
    mentions(raw, &BACKGROUND, b"true")
}

/// True when the event `raw` is handed on: it mentions a usage object or a background
/// response.
pub fn handed_on(raw: &[u8]) -> bool {
    mentions_usage(raw) || mentions_background(raw)
}

/// The `data:` lines of an event (each without `data:` and its leading spaces), joined
/// by `\n`; lines end at `\n`, `\r` or `\r\n`.
pub fn payload(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    let mut first = true;
    let mut i = 0;
    while i < raw.len() {
        let end = raw[i..]
            .iter()
            .position(|&c| c == b'\n' || c == b'\r')
            .map_or(raw.len(), |e| i + e);
        let line = &raw[i..end];
        if let Some(rest) = line.strip_prefix(b"data:") {
            if !first {
                out.push(b'\n');
            }
            first = false;
            let skip = rest.iter().take_while(|&&c| c == b' ').count();
            out.extend_from_slice(&rest[skip..]);
        }
        i = end;
        if i < raw.len() {
            i += if raw[i] == b'\r' && raw.get(i + 1) == Some(&b'\n') {
                2
            } else {
                1
            };
        }
    }
    out
}

impl SseFrames {
    /// A stream's framing, keeping at most `max_event` bytes of one event.
    pub fn new(max_event: usize) -> Self {
        SseFrames {
            buf: Vec::new(),
            skip: false,
            max_event,
            events: 0,
        }
    }

    /// Bytes kept of a partial event (at most `max_event`, or 3 while one is skipped).
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Reads one chunk: `usage_event(payload)` for each complete event (not skipped)
    /// that mentions a usage object. The work is proportional to the chunk, not to what
    /// is kept: the kept part holds no separator, so only its last 3 bytes are searched
    /// again, and it is grown in place while no event ends (an event sent a few bytes at
    /// a time costs no copy of what came before).
    pub fn feed(&mut self, chunk: &[u8], mut usage_event: impl FnMut(Vec<u8>)) {
        // Where a separator may start: not in the kept bytes but their last 3 (one that
        // straddles the two chunks).
        let from = self.buf.len().saturating_sub(3);
        let joined = if self.buf.is_empty() {
            None
        } else {
            let mut d = std::mem::take(&mut self.buf);
            d.extend_from_slice(chunk);
            Some(d)
        };
        let data: &[u8] = joined.as_deref().unwrap_or(chunk);
        let mut start = 0;
        // The next `\r\n\r\n` at or after `start` (searched again only once passed:
        // the chunk is scanned for it once, not once per event).
        let mut crlf = memmem::find(&data[from..], b"\r\n\r\n").map(|c| from + c);
        loop {
            if crlf.is_some_and(|c| c < start) {
                crlf = memmem::find(&data[start..], b"\r\n\r\n").map(|c| start + c);
            }
            let at = start.max(from);
            let lf = memmem::find(&data[at..], b"\n\n").map(|a| at + a);
            let (end, sep) = match (lf, crlf) {
                (None, None) => break,
                (Some(a), Some(b)) if b < a => (b, 4),
                (None, Some(b)) => (b, 4),
                (Some(a), _) => (a, 2),
            };
            if self.skip {
                self.skip = false;
            } else {
                self.events += 1;
                let raw = &data[start..end];
                if handed_on(raw) {
                    usage_event(payload(raw));
                }
            }
            start = end + sep;
        }
        let len = data.len();
        if len - start > self.max_event {
            // An event longer than the bound: dropped up to its end (its last bytes stay:
            // a separator may straddle two chunks; fewer when fewer came, as Python's
            // `rest[-3:]`: a bound below 3 bytes must not underflow).
            self.skip = true;
            self.buf = data[len.saturating_sub(3).max(start)..].to_vec();
        } else if start == 0 && joined.is_some() {
            // No event ended: the kept bytes and the chunk, as they are.
            self.buf = joined.unwrap_or_default();
        } else {
            self.buf = data[start..].to_vec();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&[u8]], max_event: usize) -> (Vec<Vec<u8>>, u64) {
        let mut f = SseFrames::new(max_event);
        let mut out = Vec::new();
        for c in chunks {
            f.feed(c, |p| out.push(p));
        }
        (out, f.events)
    }

    #[test]
    fn frames_and_finds_usage_events() {
        let (found, n) = run(
            &[
                b"data: {\"usage\":null}\n\ndata: {\"usage\" :\n {\"a\":1}}\r",
                b"\n\r\nev",
                b"ent: x\n\n",
            ],
            1 << 20,
        );
        assert_eq!(found, vec![b"{\"usage\" :".to_vec()]);
        assert_eq!(n, 3);
        assert_eq!(payload(b"data:  a\r\nid: 1\rdata:b\ndata:"), b"a\nb\n".to_vec());
        assert!(mentions_usage(b"x\"usage\"\x0b:\x0c{"));
        assert!(!mentions_usage(b"\"usage\":[{"));
        assert!(mentions_background(b"{\"background\" :\ttrue,"));
        assert!(!mentions_background(b"{\"background\":false,\"background\":tru"));
        assert!(handed_on(b"data: {\"background\":true}") && !handed_on(b"data: {\"usage\":null}"));
    }

    #[test]
    fn mixed_separators_end_events_in_order() {
        let (found, n) = run(
            &[b"data: \"usage\":{1}\r\n\r\ndata: x\n\ndata: \"usage\":{2}\n\ndata: \"usage\":{3}\r\n\r\n"],
            1 << 20,
        );
        let want: Vec<Vec<u8>> = vec![
            b"\"usage\":{1}".to_vec(),
            b"\"usage\":{2}".to_vec(),
            b"\"usage\":{3}".to_vec(),
        ];
        assert_eq!(found, want);
        assert_eq!(n, 4);
    }

    #[test]
    fn skips_an_event_past_the_bound() {
        let (found, n) = run(&[b"data: \"usage\":{", b"xxxxxxxx", b"x\n\ndata: \"usage\":{}\n\n"], 8);
        assert_eq!(found, vec![b"\"usage\":{}".to_vec()]);
        assert_eq!(n, 1);
    }
}
