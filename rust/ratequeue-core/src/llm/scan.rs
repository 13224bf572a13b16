//! A validating JSON scanner over UTF-8 bytes with the grammar of CPython's `json`
//! (`NaN`, `Infinity` and `-Infinity` included) and its string semantics (characters are
//! code points; an escaped surrogate pair is one, a lone escaped surrogate is one).
//! Recursion is bounded by [`MAX_DEPTH`]; past it, or past [`MAX_INT_DIGITS`] digits
//! in an integer, the scan stops with [`Stop::Defer`] and the caller's reference
//! parser decides.

/// Nesting (objects and arrays) read here; deeper bodies are deferred.
pub const MAX_DEPTH: usize = 128;
/// Digits of an integer read here (CPython parses at least this many whatever its
/// `int_max_str_digits`); longer ones are deferred.
pub const MAX_INT_DIGITS: usize = 640;

/// Why a scan stopped early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Not JSON (CPython's parser would refuse it too).
    Invalid,
    /// Beyond what this scanner reads exactly: the reference parser must decide.
    Defer,
}

pub type Scan<T> = Result<T, Stop>;

/// A string as it stands in the body: the bytes between its quotes.
#[derive(Clone, Copy, Debug)]
pub struct Str<'a> {
    pub raw: &'a [u8],
    pub escaped: bool,
    /// Its length in code points once decoded (CPython's `len`).
    pub chars: usize,
}

impl Str<'_> {
    /// True when the decoded string equals `name` (ASCII).
    pub fn is(&self, name: &[u8]) -> bool {
        if !self.escaped {
            return self.raw == name;
        }
        let mut out = Vec::with_capacity(self.raw.len());
        decode(self.raw, &mut out);
        out == name
    }

    /// True when the decoded string starts with `data:`.
    pub fn starts_with_data(&self) -> bool {
        const P: &[u8] = b"data:";
        if !self.escaped {
            return self.raw.starts_with(P);
        }
        let mut it = CodePoints { raw: self.raw, i: 0 };
        P.iter().all(|&c| it.next() == Some(u32::from(c)))
    }
}

/// The decoded code points of a validated string's raw bytes (surrogates included).
struct CodePoints<'a> {
    raw: &'a [u8],
    i: usize,
}

impl Iterator for CodePoints<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        let r = self.raw;
        let i = self.i;
        let c = *r.get(i)?;
        if c != b'\\' {
            let (cp, n) = utf8_at(r, i);
            self.i = i + n;
            return Some(cp);
        }
        let e = r[i + 1];
        self.i = i + 2;
        Some(match e {
            b'b' => 8,
            b'f' => 12,
            b'n' => 10,
            b'r' => 13,
            b't' => 9,
            b'u' => {
                let hi = hex4(&r[i + 2..i + 6]).unwrap_or(0);
                self.i = i + 6;
                if (0xD800..0xDC00).contains(&hi) && r.get(i + 6) == Some(&b'\\') && r.get(i + 7) == Some(&b'u') {
                    let lo = hex4(&r[i + 8..i + 12]).unwrap_or(0);
                    if (0xDC00..0xE000).contains(&lo) {
                        self.i = i + 12;
                        return Some(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00));
                    }
                }
                hi
            }
            other => u32::from(other), // '"', '\\', '/'
        })
    }
}

fn utf8_at(r: &[u8], i: usize) -> (u32, usize) {
    let c = r[i];
    match c {
        0..=0x7F => (u32::from(c), 1),
        0xC0..=0xDF => ((u32::from(c & 0x1F) << 6) | u32::from(r[i + 1] & 0x3F), 2),
        0xE0..=0xEF => (
            (u32::from(c & 0x0F) << 12) | (u32::from(r[i + 1] & 0x3F) << 6) | u32::from(r[i + 2] & 0x3F),
            3,
        ),
        _ => (
            (u32::from(c & 0x07) << 18)
                | (u32::from(r[i + 1] & 0x3F) << 12)
                | (u32::from(r[i + 2] & 0x3F) << 6)
                | u32::from(r[i + 3] & 0x3F),
            4,
        ),
    }
}

/// Appends the decoded string, surrogates written as three-byte sequences (equal
/// strings give equal bytes).
pub fn decode(raw: &[u8], out: &mut Vec<u8>) {
    if !raw.contains(&b'\\') {
        out.extend_from_slice(raw);
        return;
    }
    for cp in (CodePoints { raw, i: 0 }) {
        push_code_point(cp, out);
    }
}

/// The decoded string, or None when it holds a lone surrogate (no Rust `String` can).
pub fn decode_string(s: &Str<'_>) -> Option<String> {
    if !s.escaped {
        return std::str::from_utf8(s.raw).ok().map(str::to_owned);
    }
    let mut out = String::with_capacity(s.raw.len());
    for cp in (CodePoints { raw: s.raw, i: 0 }) {
        out.push(char::from_u32(cp)?);
    }
    Some(out)
}

fn push_code_point(cp: u32, out: &mut Vec<u8>) {
    if cp < 0x80 {
        out.push(cp as u8);
    } else if cp < 0x800 {
        out.extend_from_slice(&[0xC0 | (cp >> 6) as u8, 0x80 | (cp & 0x3F) as u8]);
    } else if cp < 0x10000 {
        out.extend_from_slice(&[
            0xE0 | (cp >> 12) as u8,
            0x80 | ((cp >> 6) & 0x3F) as u8,
            0x80 | (cp & 0x3F) as u8,
        ]);
    } else {
        out.extend_from_slice(&[
            0xF0 | (cp >> 18) as u8,
            0x80 | ((cp >> 12) & 0x3F) as u8,
            0x80 | ((cp >> 6) & 0x3F) as u8,
            0x80 | (cp & 0x3F) as u8,
        ]);
    }
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Non-zero when a byte of `w` is zero.
#[inline]
fn has_zero(w: u64) -> u64 {
    w.wrapping_sub(ONES) & !w & HIGHS
}

/// Non-zero when a byte of `w` is below 0x20.
#[inline]
fn below_space(w: u64) -> u64 {
    w.wrapping_sub(ONES * 0x20) & !w & HIGHS
}

/// Sixteen bytes at once with SSE2 (part of every x86_64).
#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_cmplt_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };

    /// Bit `k` of the first mask: byte `k` is a quote, a backslash or below 0x20; of the
    /// second: byte `k` continues a UTF-8 sequence (`0b10xx_xxxx`).
    #[inline]
    pub(super) fn marks(block: &[u8; 16]) -> (u32, u32) {
        // SAFETY: SSE2 is in x86_64's baseline; the load reads the 16 bytes of `block`
        // (unaligned load).
        unsafe {
            let x = _mm_loadu_si128(block.as_ptr().cast());
            let quote = _mm_cmpeq_epi8(x, _mm_set1_epi8(b'"' as i8));
            let backslash = _mm_cmpeq_epi8(x, _mm_set1_epi8(b'\\' as i8));
            let control = _mm_cmpeq_epi8(_mm_min_epu8(x, _mm_set1_epi8(0x1F)), x); // x <= 0x1F
            let stop = _mm_movemask_epi8(_mm_or_si128(_mm_or_si128(quote, backslash), control));
            // 0x80..=0xBF are the signed bytes -128..=-65.
            let cont = _mm_movemask_epi8(_mm_cmplt_epi8(x, _mm_set1_epi8(-64)));
            (stop as u32, cont as u32)
        }
    }
}

/// How many bytes of `w` continue a UTF-8 sequence (`0b10xx_xxxx`).
#[inline]
fn continuations(w: u64) -> usize {
    let marks = (w & !(w << 1) & HIGHS) >> 7; // one per continuation byte, in its low bit
    (marks.wrapping_mul(ONES) >> 56) as usize
}

fn hex4(h: &[u8]) -> Option<u32> {
    if h.len() < 4 {
        return None;
    }
    let mut v = 0u32;
    for &c in &h[..4] {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            b'A'..=b'F' => c - b'A' + 10,
            _ => return None,
        };
        v = (v << 4) | u32::from(d);
    }
    Some(v)
}

/// A number as CPython's `json` reads it: an int (exact up to `u64`) or a float.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Num {
    /// An integer literal: its sign (`-0` is 0, not negative) and value when it fits.
    Int { negative: bool, value: Option<u64> },
    /// A fraction or exponent, `NaN` or an infinity.
    Float,
}

/// A value's shape, for what the readers keep of it.
#[derive(Clone, Copy, Debug)]
pub enum Shape<'a> {
    Str(Str<'a>),
    Num(Num),
    True,
    False,
    Null,
    Array(usize),
    Object,
}

/// A cursor over a body known to be valid UTF-8.
pub struct Scanner<'a> {
    pub b: &'a [u8],
    pub pos: usize,
}

impl<'a> Scanner<'a> {
    /// A scanner at the start of `b`, or None when `b` is not what the UTF-8 path of
    /// CPython's `json` reads the same way (not UTF-8, a BOM, a NUL in its first four
    /// bytes: other encodings).
    pub fn new(b: &'a [u8]) -> Option<Self> {
        if b.starts_with(b"\xEF\xBB\xBF") || b.iter().take(4).any(|&c| c == 0) || simdutf8::basic::from_utf8(b).is_err()
        {
            return None;
        }
        Some(Scanner { b, pos: 0 })
    }

    #[inline]
    pub fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.pos) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                break;
            }
            self.pos += 1;
        }
    }

    #[inline]
    pub fn peek(&self) -> Option<u8> {
        self.b.get(self.pos).copied()
    }

    /// True when only whitespace is left.
    pub fn at_end(&mut self) -> bool {
        self.ws();
        self.pos == self.b.len()
    }

    fn literal(&mut self, word: &[u8]) -> Scan<()> {
        if self.b[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(Stop::Invalid)
        }
    }

    /// A string from its opening quote, validated; the cursor after its closing quote.
    pub fn string(&mut self) -> Scan<Str<'a>> {
        let b = self.b;
        let start = self.pos + 1;
        let mut i = start;
        let mut chars = 0usize;
        let mut escaped = false;
        loop {
            // Eight bytes at a time up to the first quote, backslash or control byte (the
            // lowest flagged byte of each test is exact); each byte before it counts
            // unless it continues a UTF-8 sequence. The last few bytes one by one.
            let c = loop {
                // Sixteen at a time where SSE2 is there (every x86_64), as below.
                #[cfg(target_arch = "x86_64")]
                if let Some(block) = b.get(i..i + 16).and_then(|c| <&[u8; 16]>::try_from(c).ok()) {
                    let (stop, cont) = sse2::marks(block);
                    if stop == 0 {
                        chars += 16 - cont.count_ones() as usize;
                        i += 16;
                        continue;
                    }
                    let k = stop.trailing_zeros();
                    chars += k as usize - (cont & ((1 << k) - 1)).count_ones() as usize;
                    i += k as usize;
                    break block[k as usize];
                }
                if let Some(chunk) = b.get(i..i + 8) {
                    let w = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
                    let m = has_zero(w ^ (ONES * u64::from(b'"')))
                        | has_zero(w ^ (ONES * u64::from(b'\\')))
                        | below_space(w);
                    if m == 0 {
                        chars += 8 - continuations(w);
                        i += 8;
                        continue;
                    }
                    let k = (m.trailing_zeros() / 8) as usize;
                    let before = if k == 0 { 0 } else { w & (u64::MAX >> (64 - 8 * k)) };
                    chars += k - continuations(before);
                    i += k;
                    break chunk[k];
                }
                let c = *b.get(i).ok_or(Stop::Invalid)?;
                if c == b'"' || c == b'\\' || c < 0x20 {
                    break c;
                }
                chars += usize::from(c & 0xC0 != 0x80);
                i += 1;
            };
            match c {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    let e = *b.get(i + 1).ok_or(Stop::Invalid)?;
                    match e {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                        b'u' => {
                            let hi = hex4(b.get(i + 2..i + 6).ok_or(Stop::Invalid)?).ok_or(Stop::Invalid)?;
                            i += 6;
                            if (0xD800..0xDC00).contains(&hi) && b.get(i) == Some(&b'\\') && b.get(i + 1) == Some(&b'u')
                            {
                                // CPython joins an escaped low surrogate that follows (and
                                // rejects bad hex there either way).
                                let lo = hex4(b.get(i + 2..i + 6).ok_or(Stop::Invalid)?).ok_or(Stop::Invalid)?;
                                if (0xDC00..0xE000).contains(&lo) {
                                    i += 6;
                                }
                            }
                        }
                        _ => return Err(Stop::Invalid),
                    }
                    chars += 1;
                }
                _ => return Err(Stop::Invalid), // a control byte
            }
        }
        self.pos = i + 1;
        Ok(Str {
            raw: &b[start..i],
            escaped,
            chars,
        })
    }

    /// A number from its first byte (`-`, a digit, `N` or `I`).
    pub fn number(&mut self) -> Scan<Num> {
        let b = self.b;
        let mut i = self.pos;
        let negative = b[i] == b'-';
        if negative {
            i += 1;
        }
        match b.get(i) {
            Some(b'I') => {
                self.pos = i;
                self.literal(b"Infinity")?;
                return Ok(Num::Float);
            }
            Some(b'N') if !negative => {
                self.literal(b"NaN")?;
                return Ok(Num::Float);
            }
            _ => {}
        }
        let digits_at = i;
        let mut value: Option<u64> = Some(0);
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                while let Some(&c @ b'0'..=b'9') = b.get(i) {
                    value = value
                        .and_then(|v| v.checked_mul(10))
                        .and_then(|v| v.checked_add(u64::from(c - b'0')));
                    i += 1;
                }
            }
            _ => return Err(Stop::Invalid),
        }
        let digits = i - digits_at;
        let mut float = false;
        if b.get(i) == Some(&b'.') && matches!(b.get(i + 1), Some(b'0'..=b'9')) {
            float = true;
            i += 1;
            while matches!(b.get(i), Some(b'0'..=b'9')) {
                i += 1;
            }
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            let mut j = i + 1;
            if matches!(b.get(j), Some(b'+' | b'-')) {
                j += 1;
            }
            if matches!(b.get(j), Some(b'0'..=b'9')) {
                float = true;
                while matches!(b.get(j), Some(b'0'..=b'9')) {
                    j += 1;
                }
                i = j;
            }
        }
        self.pos = i;
        if float {
            return Ok(Num::Float);
        }
        if digits > MAX_INT_DIGITS {
            return Err(Stop::Defer);
        }
        Ok(Num::Int {
            negative: negative && value != Some(0),
            value,
        })
    }

    /// A value whose inside is not kept: validated, its shape returned. `depth` is the
    /// nesting of the container that holds it.
    pub fn value(&mut self, depth: usize) -> Scan<Shape<'a>> {
        let c = self.peek().ok_or(Stop::Invalid)?;
        Ok(match c {
            b'"' => Shape::Str(self.string()?),
            b'{' => {
                self.object(depth + 1, |s, _| s.value(depth + 1).map(drop))?;
                Shape::Object
            }
            b'[' => Shape::Array(self.array(depth + 1, |s| s.value(depth + 1).map(drop))?),
            b't' => {
                self.literal(b"true")?;
                Shape::True
            }
            b'f' => {
                self.literal(b"false")?;
                Shape::False
            }
            b'n' => {
                self.literal(b"null")?;
                Shape::Null
            }
            b'-' | b'0'..=b'9' | b'N' | b'I' => Shape::Num(self.number()?),
            _ => return Err(Stop::Invalid),
        })
    }

    /// An object from its `{` at nesting `depth`: `member(scanner, key)` reads each
    /// value (the cursor at it) in order.
    pub fn object<F>(&mut self, depth: usize, mut member: F) -> Scan<()>
    where
        F: FnMut(&mut Self, Str<'a>) -> Scan<()>,
    {
        if depth > MAX_DEPTH {
            return Err(Stop::Defer);
        }
        self.pos += 1;
        self.ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(());
        }
        loop {
            if self.peek() != Some(b'"') {
                return Err(Stop::Invalid);
            }
            let key = self.string()?;
            self.ws();
            if self.peek() != Some(b':') {
                return Err(Stop::Invalid);
            }
            self.pos += 1;
            self.ws();
            member(self, key)?;
            self.ws();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.ws();
                }
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(Stop::Invalid),
            }
        }
    }

    /// An array from its `[` at nesting `depth`: `item(scanner)` reads each element;
    /// returns how many there were.
    pub fn array<F>(&mut self, depth: usize, mut item: F) -> Scan<usize>
    where
        F: FnMut(&mut Self) -> Scan<()>,
    {
        if depth > MAX_DEPTH {
            return Err(Stop::Defer);
        }
        self.pos += 1;
        self.ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(0);
        }
        let mut n = 0usize;
        loop {
            item(self)?;
            n += 1;
            self.ws();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.ws();
                }
                Some(b']') => {
                    self.pos += 1;
                    return Ok(n);
                }
                _ => return Err(Stop::Invalid),
            }
        }
    }

    /// Reads one whole document whose top level is an object with `top`: `Ok(None)`
    /// when it is not such a document (not JSON, or another top-level value).
    pub fn document<T>(mut self, top: impl FnOnce(&mut Self) -> Scan<T>) -> Result<Option<T>, Stop> {
        self.ws();
        if self.peek() != Some(b'{') {
            // Another value, or not JSON: CPython's reader gives no object either way.
            return Ok(None);
        }
        match top(&mut self) {
            Ok(v) if self.at_end() => Ok(Some(v)),
            Ok(_) | Err(Stop::Invalid) => Ok(None),
            Err(Stop::Defer) => Err(Stop::Defer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skip(body: &str) -> Result<Option<()>, Stop> {
        Scanner::new(body.as_bytes())
            .ok_or(Stop::Defer)?
            .document(|s| s.value(0).map(drop))
    }

    #[test]
    fn grammar_matches_cpython() {
        for ok in [
            r#"{}"#,
            r#" {"a": [1, -0, 2.5e3, -1E-2, true, false, null, NaN, Infinity, -Infinity, "x\u00e9\n"]} "#,
            "{\"a\":{\"b\":[]}}\n\r\t",
        ] {
            assert_eq!(skip(ok), Ok(Some(())), "{ok}");
        }
        for bad in [
            r#"{"a": 01}"#,
            r#"{"a": 1.}"#,
            r#"{"a": .5}"#,
            r#"{"a": 1e}"#,
            r#"{"a": +1}"#,
            r#"{"a": -}"#,
            r#"{"a": -NaN}"#,
            r#"{"a": nan}"#,
            r#"{"a": [1,]}"#,
            r#"{"a": 1,}"#,
            r#"{"a" 1}"#,
            r#"{'a': 1}"#,
            r#"{"a": "\x"}"#,
            r#"{"a": "\u12G4"}"#,
            r#"{"a": "\ud800\u12G4"}"#,
            "{\"a\": \"tab\tinside\"}",
            r#"{"a": 1} x"#,
            r#"{"a": 1"#,
            r#"{"a": "#,
            r#"[1]"#,
            r#""usage""#,
        ] {
            assert_eq!(skip(bad), Ok(None), "{bad}");
        }
    }

    proptest::proptest! {
        /// Any text, at any alignment (the 16- and 8-byte steps and the bytes one by one
        /// meet at every offset): its code points counted, the scan ends after its quote;
        /// a raw control byte anywhere in it is refused.
        #[test]
        fn strings_at_any_alignment(
            text in "[^\"\\\\\\x00-\\x1f]{0,80}",
            pad in 0usize..33,
            escape_at in proptest::option::of(0usize..81),
            control_at in proptest::option::of(0usize..81),
            control in 0u8..0x20,
        ) {
            let mut body = vec![b' '; pad];
            body.push(b'"');
            let mut chars = 0;
            for (k, ch) in text.chars().enumerate() {
                if escape_at == Some(k) {
                    body.extend_from_slice(b"\\u00e9");
                    chars += 1;
                }
                let mut utf8 = [0u8; 4];
                body.extend_from_slice(ch.encode_utf8(&mut utf8).as_bytes());
                chars += 1;
            }
            let bad = control_at.filter(|&k| k < body.len() - pad);
            if let Some(k) = bad {
                // After the opening quote, and not inside a multi-byte character.
                let at = pad + 1 + k;
                if at < body.len() && body[at] & 0xC0 == 0x80 {
                    return Ok(());
                }
                body.insert(at.min(body.len()), control);
            }
            body.extend_from_slice(b"\" tail");
            let mut s = Scanner { b: &body, pos: pad };
            match bad {
                Some(_) => proptest::prop_assert!(s.string().is_err()),
                None => {
                    let got = s.string().unwrap();
                    proptest::prop_assert_eq!(got.chars, chars);
                    proptest::prop_assert_eq!(got.escaped, escape_at.is_some_and(|k| k < text.chars().count()));
                    proptest::prop_assert_eq!(&body[s.pos..], b" tail");
                }
            }
        }
    }

    #[test]
    fn strings_count_code_points_as_cpython() {
        let mut s = Scanner {
            b: br#""a\u00e9\ud83d\ude00\ud83d\u0041\udc00\n\u00e9""#,
            pos: 0,
        };
        // a, é, 😀 (a joined pair), a lone high, A, a lone low, \n, é
        assert_eq!(s.string().unwrap().chars, 8);
        let mut s = Scanner {
            b: "\"héllo 😀\"".as_bytes(),
            pos: 0,
        };
        assert_eq!(s.string().unwrap().chars, 7);
    }

    #[test]
    fn escaped_names_and_prefixes() {
        let mut s = Scanner {
            b: br#""\u0075sage""#,
            pos: 0,
        };
        let k = s.string().unwrap();
        assert!(k.is(b"usage"));
        let mut s = Scanner {
            b: br#""\u0064ata:x""#,
            pos: 0,
        };
        assert!(s.string().unwrap().starts_with_data());
        let mut s = Scanner {
            b: br#""dat\u0061""#,
            pos: 0,
        };
        assert!(!s.string().unwrap().starts_with_data());
        let mut s = Scanner {
            b: br#""\ud83d""#,
            pos: 0,
        };
        assert_eq!(decode_string(&s.string().unwrap()), None);
    }

    #[test]
    fn word_tests_match_bytewise_ones() {
        let words: [&[u8; 8]; 6] = [
            b"abcdefgh",
            b"ab\"defgh",
            b"abc\\efgh",
            b"a\tcdefgh",
            b"\x7f\x80\xff\x20\x1f ab",
            b"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98",
        ];
        for w8 in words {
            let w = u64::from_le_bytes(*w8);
            let special = w8.iter().any(|&c| c == b'"' || c == b'\\' || c < 0x20);
            let found =
                has_zero(w ^ (ONES * u64::from(b'"'))) | has_zero(w ^ (ONES * u64::from(b'\\'))) | below_space(w);
            assert_eq!(found != 0, special, "{w8:?}");
            let conts = w8.iter().filter(|&&c| c & 0xC0 == 0x80).count();
            assert_eq!(continuations(w), conts, "{w8:?}");
        }
    }

    #[test]
    fn special_bytes_at_every_offset_of_a_word() {
        // The word-at-a-time search: a quote, an escape or a control byte at each offset
        // of the first two words, after ASCII and multi-byte characters.
        for prefix in ["", "é", "😀", "ab€"] {
            for n in 0..17 {
                let head = format!("{prefix}{}", "x".repeat(n));
                let want = head.chars().count();
                let quoted = format!("\"{head}\"tail");
                let mut s = Scanner {
                    b: quoted.as_bytes(),
                    pos: 0,
                };
                let st = s.string().unwrap();
                assert_eq!((st.chars, st.escaped), (want, false), "{quoted}");
                assert_eq!(s.pos, quoted.len() - 4);
                let esc = format!("\"{head}\\u00e9\\\"é\"");
                let mut s = Scanner {
                    b: esc.as_bytes(),
                    pos: 0,
                };
                let st = s.string().unwrap();
                assert_eq!((st.chars, st.escaped), (want + 3, true), "{esc}");
                assert_eq!(s.pos, esc.len());
                let ctl = format!("\"{head}\u{1f}\"");
                let mut s = Scanner {
                    b: ctl.as_bytes(),
                    pos: 0,
                };
                assert_eq!(s.string().map(|_| ()), Err(Stop::Invalid), "{ctl:?}");
                let open = format!("\"{head}");
                let mut s = Scanner {
                    b: open.as_bytes(),
                    pos: 0,
                };
                assert_eq!(s.string().map(|_| ()), Err(Stop::Invalid), "{open:?}");
            }
        }
    }

    #[test]
    fn long_strings_count_as_short_ones() {
        for text in [
            "x".repeat(300),
            "é😀a".repeat(37),
            format!("{}\\n{}", "ab".repeat(9), "€".repeat(11)),
        ] {
            let quoted = format!("\"{text}\"");
            let mut s = Scanner {
                b: quoted.as_bytes(),
                pos: 0,
            };
            let st = s.string().unwrap();
            let want: usize = text.replace("\\n", "\n").chars().count();
            assert_eq!(st.chars, want, "{text}");
            assert_eq!(s.pos, quoted.len());
        }
    }

    #[test]
    fn numbers() {
        let n = |t: &str| {
            Scanner {
                b: t.as_bytes(),
                pos: 0,
            }
            .number()
        };
        assert_eq!(
            n("-0"),
            Ok(Num::Int {
                negative: false,
                value: Some(0)
            })
        );
        assert_eq!(
            n("-3"),
            Ok(Num::Int {
                negative: true,
                value: Some(3)
            })
        );
        assert_eq!(
            n("18446744073709551616"),
            Ok(Num::Int {
                negative: false,
                value: None
            })
        );
        assert_eq!(n("1.0"), Ok(Num::Float));
        assert_eq!(n("1e5"), Ok(Num::Float));
        assert_eq!(n(&"9".repeat(MAX_INT_DIGITS + 1)), Err(Stop::Defer));
    }

    #[test]
    fn deep_bodies_are_deferred_without_recursing_past_the_bound() {
        let deep = format!("{{\"a\":{}1{}}}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(skip(&deep), Err(Stop::Defer));
        let ok = format!("{{\"a\":{}1{}}}", "[".repeat(MAX_DEPTH - 1), "]".repeat(MAX_DEPTH - 1));
        assert_eq!(skip(&ok), Ok(Some(())));
    }

    #[test]
    fn other_encodings_are_deferred() {
        assert!(Scanner::new(b"\xEF\xBB\xBF{}").is_none());
        assert!(Scanner::new(b"{\x00}\x00").is_none());
        assert!(Scanner::new(b"{\"a\":\"\xED\xA0\x80\"}").is_none());
        assert!(Scanner::new(b"{}").is_some());
    }
}
