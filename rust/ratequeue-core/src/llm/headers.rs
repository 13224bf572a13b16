//! The transport's first look at a response's headers: its content type, and whether a
//! rate-limit header may say a quota is exhausted (the full parse then decides). Names
//! are classified by their bytes alone (no table grows with what the network sends).

/// What the scan does with a header, by its lower-case name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderKind {
    /// `content-type`.
    ContentType,
    /// Not a rate-limit field, or one that cannot say a quota is exhausted (limits and
    /// resets, `ratelimit-policy`).
    Other,
    /// `x-ratelimit-remaining-*` or `anthropic-ratelimit-*remaining*`: 0 or less is exhausted.
    Remaining,
    /// An IETF `ratelimit*` field: any `=0` may say so.
    Ietf,
    /// The IETF draft's `ratelimit-remaining*`: the full parse decides.
    IetfRemaining,
}

/// A naive search: names and values are short, and a `Finder` costs more to build.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// `value` without leading and trailing ASCII whitespace as Python's `bytes.strip()`
/// sees it (vertical tab included, unlike `trim_ascii`).
fn strip(value: &[u8]) -> &[u8] {
    let space = |c: &u8| matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0B | 0x0C);
    let start = value.iter().position(|c| !space(c)).unwrap_or(value.len());
    let end = value.iter().rposition(|c| !space(c)).map_or(start, |i| i + 1);
    &value[start..end]
}

/// The kind of a header of this lower-case name.
pub fn header_kind(lower: &[u8]) -> HeaderKind {
    match lower {
        b"content-type" => return HeaderKind::ContentType,
        b"ratelimit-policy" => return HeaderKind::Other,
        _ => {}
    }
    if lower.starts_with(b"ratelimit") {
        return if contains(lower, b"remaining") {
            HeaderKind::IetfRemaining
        } else {
            HeaderKind::Ietf
        };
    }
    if (lower.starts_with(b"x-ratelimit-remaining-") || lower.starts_with(b"anthropic-ratelimit-"))
        && contains(lower, b"remaining")
    {
        return HeaderKind::Remaining;
    }
    HeaderKind::Other
}

/// What a scan of the headers found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeaderScan {
    /// Which header is the (last) content type.
    pub content_type: Option<usize>,
    /// A rate-limit header may say a quota is exhausted.
    pub exhausted: bool,
}

/// Scans `(lower-case name, value)` pairs in order.
pub fn scan_headers<'a>(headers: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> HeaderScan {
    let mut out = HeaderScan::default();
    for (i, (name, value)) in headers.into_iter().enumerate() {
        match header_kind(name) {
            HeaderKind::ContentType => out.content_type = Some(i),
            HeaderKind::Other => {}
            _ if out.exhausted => {}
            HeaderKind::Ietf => out.exhausted = contains(value, b"=0"),
            HeaderKind::IetfRemaining => out.exhausted = true,
            HeaderKind::Remaining => {
                let v = strip(value);
                out.exhausted = v == b"0" || v.starts_with(b"0.") || v.starts_with(b"-");
            }
        }
    }
    out
}

/// A request header the transport reads (its own headers are removed before sending).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestHeader {
    /// `x-ratequeue-priority`.
    Priority = 0,
    /// `x-ratequeue-task`.
    Task = 1,
    /// `x-ratequeue-account`.
    Account = 2,
    /// `idempotency-key`: the SDK's request id.
    IdempotencyKey = 3,
    /// `content-length`.
    ContentLength = 4,
}

/// The request header of this lower-case name, if the transport reads it.
pub fn request_header(lower: &[u8]) -> Option<RequestHeader> {
    Some(match lower {
        b"x-ratequeue-priority" => RequestHeader::Priority,
        b"x-ratequeue-task" => RequestHeader::Task,
        b"x-ratequeue-account" => RequestHeader::Account,
        b"idempotency-key" => RequestHeader::IdempotencyKey,
        b"content-length" => RequestHeader::ContentLength,
        _ => return None,
    })
}

/// Per [`RequestHeader`] (by its number), which of the lower-case `names` holds it: the
/// last one, as a reader that assigns each in order keeps.
pub fn scan_request<'a>(names: impl IntoIterator<Item = &'a [u8]>) -> [Option<usize>; 5] {
    let mut out = [None; 5];
    for (i, name) in names.into_iter().enumerate() {
        if let Some(h) = request_header(name) {
            out[h as usize] = Some(i);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds() {
        use HeaderKind::*;
        for (name, kind) in [
            (&b"content-type"[..], ContentType),
            (b"ratelimit-policy", Other),
            (b"ratelimit", Ietf),
            (b"ratelimit-remaining", IetfRemaining),
            (b"x-ratelimit-remaining-tokens", Remaining),
            (b"x-ratelimit-limit-tokens", Other),
            (b"x-ratelimit-reset-requests", Other),
            (b"anthropic-ratelimit-tokens-remaining", Remaining),
            (b"anthropic-ratelimit-tokens-limit", Other),
            (b"x-other", Other),
            (b"", Other),
        ] {
            assert_eq!(header_kind(name), kind, "{}", String::from_utf8_lossy(name));
        }
    }

    #[test]
    fn exhausted() {
        let scan = |h: &[(&'static [u8], &'static [u8])]| scan_headers(h.iter().copied());
        assert!(scan(&[(b"x-ratelimit-remaining-tokens", b" 0 ")]).exhausted);
        assert!(scan(&[(b"x-ratelimit-remaining-tokens", b"0.5")]).exhausted);
        assert!(scan(&[(b"x-ratelimit-remaining-tokens", b"\x0b0\x0c")]).exhausted);
        assert!(!scan(&[(b"x-ratelimit-remaining-tokens", b"")]).exhausted);
        assert!(scan(&[(b"x-ratelimit-remaining-tokens", b"-1")]).exhausted);
        assert!(!scan(&[(b"x-ratelimit-remaining-tokens", b"10")]).exhausted);
        assert!(!scan(&[(b"x-ratelimit-remaining-tokens", b"00")]).exhausted);
        assert!(scan(&[(b"ratelimit", b"\"a\";r=0;t=1")]).exhausted);
        // The first header that says so decides; later ones do not undo it.
        let h = scan(&[
            (b"content-type", b"a"),
            (b"x-ratelimit-remaining-tokens", b"0"),
            (b"x-ratelimit-remaining-requests", b"5"),
            (b"content-type", b"b"),
        ]);
        assert_eq!(
            h,
            HeaderScan {
                content_type: Some(3),
                exhausted: true
            }
        );
    }

    #[test]
    fn request_headers() {
        let names: [&[u8]; 7] = [
            b"host",
            b"content-length",
            b"x-ratequeue-task",
            b"idempotency-key",
            b"x-ratequeue-task",
            b"X-Ratequeue-Priority", // not lower case: not read
            b"x-ratequeue-account",
        ];
        assert_eq!(
            scan_request(names.iter().copied()),
            [None, Some(4), Some(6), Some(3), Some(1)]
        );
        assert_eq!(scan_request(std::iter::empty()), [None; 5]);
        assert_eq!(request_header(b"x-ratequeue-priority"), Some(RequestHeader::Priority));
        assert_eq!(request_header(b"content-type"), None);
    }
}
