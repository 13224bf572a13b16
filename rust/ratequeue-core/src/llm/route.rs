//! The route of a call as a server routing leniently sees it, and the APIs whose calls
//! produce no tokens (the estimate charges them no output unless their body names a
//! bound).

use std::borrow::Cow;

/// Route endings (of [`route_of`]) of APIs that produce no output tokens: OpenAI's
/// embeddings and moderations, Anthropic's token count, Gemini's embeddings and token
/// count. Images and audio are not here: gpt-image-1 and gpt-4o-transcribe report output
/// tokens.
pub const NO_TOKEN_ROUTES: [&str; 6] = [
    "/embeddings",
    "/moderations",
    "/count_tokens",
    ":embedcontent",
    ":batchembedcontents",
    ":counttokens",
];

/// Route endings (of [`route_of`]) of model calls that produce text: with
/// [`NO_TEXT_ROUTES`], the calls that spend the model's tokens whatever other segment
/// their path has (an Azure deployment may be named `files`).
pub const MODEL_CALLS: [&str; 10] = [
    "/chat/completions",
    "/completions",
    "/responses",
    "/messages",
    ":generatecontent",
    ":streamgeneratecontent",
    "/converse",
    "/converse-stream",
    "/invoke",
    "/invoke-with-response-stream",
];

/// Route endings of APIs that produce no text, whose bodies a cap adds no bound to (their
/// servers refuse a field they do not know): OpenAI's embeddings, images, audio and
/// moderations, Anthropic's token count, Gemini's embeddings, token count and Imagen.
pub const NO_TEXT_ROUTES: [&str; 13] = [
    "/embeddings",
    "/images/generations",
    "/images/edits",
    "/images/variations",
    "/audio/speech",
    "/audio/transcriptions",
    "/audio/translations",
    "/moderations",
    "/count_tokens",
    ":embedcontent",
    ":batchembedcontents",
    ":counttokens",
    ":predict",
];

/// Path segments naming the APIs that manage batches, files, uploads, fine-tuning jobs
/// and vector stores: a call of them spends none of the model's tokens (a batch's requests
/// count against the batch quotas, not the model's per-minute ones) when the segment comes
/// right after a version segment (`v1`, `v1beta`) or `openai` (Azure), Anthropic's
/// `messages` between (`/v1/messages/batches`). Mistral's `batch` and fine-tuning's
/// `fine_tuning` name their collections next (`batch/jobs`, `fine_tuning/jobs`).
pub const MANAGEMENT: [&str; 6] = ["batches", "batch", "files", "uploads", "fine_tuning", "vector_stores"];

/// Stored objects of model calls whose reading generates nothing and whose usage was
/// settled when they were made, named by the id their creation returned: a stored chat
/// completion (`/chat/completions/chatcmpl-…`, read, updated or deleted; its `messages`)
/// and a response's input items (`/responses/resp_…/input_items`). A response itself
/// (`/responses/resp_…`, its `cancel`) is not here: a background response's creation
/// answers before it has run and keeps its estimate, so the usage a poll or a cancel
/// reports is charged (never less than it used, at worst twice). As (the collection's
/// segments, id prefix, what may follow the id: "" for nothing).
pub const STORED: [(&[&str], &str, &[&str]); 2] = [
    (&["responses"], "resp_", &["input_items"]),
    (&["chat", "completions"], "chatcmpl-", &["", "messages"]),
];

/// Route endings of calls that spend no tokens: token counts (Anthropic's, OpenAI's,
/// Gemini's) and Gemini's batch creation.
pub const FREE_CALLS: [&str; 4] = [
    "/messages/count_tokens",
    "/responses/input_tokens",
    ":counttokens",
    ":batchgeneratecontent",
];

/// `path` lower case, `;` parameters of each segment dropped, doubled slashes collapsed,
/// dot segments resolved (`..` never above the first segment), trailing slashes dropped
/// ("/" when nothing is left): the Python `route_of`.
pub fn route_of(path: &str) -> Cow<'_, str> {
    // The common path (what SDKs send) is already its route: nothing is copied.
    let plain = |b: &u8| !(b.is_ascii_uppercase() || *b == b';' || *b >= 0x80);
    if path.bytes().all(|b| plain(&b))
        && !path.contains("//")
        && !path.contains("/.")
        && path.len() > 1
        && !path.ends_with('/')
    {
        return Cow::Borrowed(path);
    }
    let mut p = path.to_lowercase();
    if p.contains(';') {
        // Each `;` up to the next `/` (not included).
        let mut out = String::with_capacity(p.len());
        let mut skipping = false;
        for c in p.chars() {
            if c == ';' {
                skipping = true;
            } else if c == '/' {
                skipping = false;
            }
            if !skipping {
                out.push(c);
            }
        }
        p = out;
    }
    if p.contains("//") {
        let mut out = String::with_capacity(p.len());
        for c in p.chars() {
            if !(c == '/' && out.ends_with('/')) {
                out.push(c);
            }
        }
        p = out;
    }
    if p.contains("/.") {
        let mut segs: Vec<&str> = Vec::new();
        for seg in p.split('/') {
            if seg == ".." {
                if segs.len() > 1 {
                    segs.pop();
                }
            } else if seg != "." {
                segs.push(seg);
            }
        }
        p = segs.join("/");
    }
    let trimmed = p.trim_end_matches('/');
    Cow::Owned(if trimmed.is_empty() {
        "/".to_owned()
    } else {
        trimmed.to_owned()
    })
}

/// True when a call on `path` produces no output tokens: a route of [`NO_TOKEN_ROUTES`],
/// or Bedrock's InvokeModel of an embedding model (its id, in the path, names `embed`).
pub fn emits_no_tokens(path: &str) -> bool {
    let p = route_of(path);
    if NO_TOKEN_ROUTES.iter().any(|r| p.ends_with(r)) {
        return true;
    }
    if !(p.ends_with("/invoke") || p.ends_with("/invoke-with-response-stream")) {
        return false;
    }
    let Some(at) = p.find("/model/") else {
        return false;
    };
    // The model id: from after "/model/" to the last "/" (nothing when that comes first).
    let start = at + "/model/".len();
    let end = p.rfind('/').unwrap_or(0);
    start < end && p[start..end].contains("embed")
}

/// True when a call on `path` spends none of the model's tokens: a token count or batch
/// creation of [`FREE_CALLS`], a stored object of a model call ([`STORED`]), or a call of
/// the batch, file, upload, fine-tuning or vector-store APIs ([`MANAGEMENT`], anchored) or
/// of the clouds' batch jobs that does not end as a model call ([`MODEL_CALLS`],
/// [`NO_TEXT_ROUTES`]). Its estimate is nothing and the usage its response reports (a
/// batch's own) is not its own: so only a path a server reads as it is counts (ASCII, no
/// `;`, doubled slash, dot segment nor trailing slash; any case); any other is a model
/// call's, charged.
pub fn spends_no_tokens(path: &str) -> bool {
    if !plain_path(path) {
        return false;
    }
    // Compared in any case, nothing copied (this runs on every call).
    let ends =
        |r: &str| path.len() >= r.len() && path.as_bytes()[path.len() - r.len()..].eq_ignore_ascii_case(r.as_bytes());
    if FREE_CALLS.iter().any(|r| ends(r)) {
        return true;
    }
    // Before the model calls' endings: a stored chat completion's list is `/messages`.
    if stored(path) {
        return true;
    }
    if MODEL_CALLS.iter().chain(&NO_TEXT_ROUTES).any(|r| ends(r)) {
        return false;
    }
    let segs: Vec<&str> = path.split('/').collect();
    if batch_jobs(&segs) {
        return true;
    }
    (1..segs.len()).any(|i| {
        if !MANAGEMENT.iter().any(|m| segs[i].eq_ignore_ascii_case(m)) {
            return false;
        }
        let anchor = if i > 1 && segs[i - 1].eq_ignore_ascii_case("messages") {
            segs[i - 2]
        } else {
            segs[i - 1]
        };
        (anchor.eq_ignore_ascii_case("openai") || is_version(anchor)) && manages(&segs[i..])
    })
}

/// [`spends_no_tokens`] remembered for the last path asked (a client calls one or a few
/// routes, and the test is long); never waits: a lock held by another thread skips the
/// memory.
#[derive(Default)]
pub struct RouteMemo {
    last: std::sync::Mutex<Option<(Box<str>, bool)>>,
}

impl RouteMemo {
    /// [`spends_no_tokens`] of `path`.
    pub fn spends_no_tokens(&self, path: &str) -> bool {
        if let Ok(last) = self.last.try_lock() {
            if let Some((q, free)) = last.as_ref() {
                if **q == *path {
                    return *free;
                }
            }
        }
        let free = spends_no_tokens(path);
        if let Ok(mut last) = self.last.try_lock() {
            *last = Some((path.into(), free));
        }
        free
    }
}

/// A stored object of [`STORED`] at the end of `path`: its collection's segments (after
/// at least one other), an id of its prefix and more (letters, digits, `_` and `-`
/// only), then what may follow it. Reads the last segments in place: nothing allocated.
fn stored(path: &str) -> bool {
    // The last five segments, the last first (a collection of two, an id, a tail, one
    // before them); `n` of them there.
    let mut last = [""; 5];
    let mut n = 0;
    for (slot, seg) in last.iter_mut().zip(path.rsplit('/')) {
        *slot = seg;
        n += 1;
    }
    let is = |s: &str, w: &str| s.eq_ignore_ascii_case(w);
    STORED.iter().any(|&(names, prefix, tails)| {
        tails.iter().any(|&tail| {
            let after = usize::from(!tail.is_empty());
            // The id, the collection's segments before it, and one segment before those.
            if n < after + 1 + names.len() + 1 {
                return false;
            }
            let id = last[after].as_bytes();
            (after == 0 || is(last[0], tail))
                && id.len() > prefix.len()
                && id[..prefix.len()].eq_ignore_ascii_case(prefix.as_bytes())
                && id.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                && names
                    .iter()
                    .rev()
                    .zip(&last[after + 1..])
                    .all(|(name, seg)| is(seg, name))
        })
    })
}

/// The batch jobs of the clouds' model APIs: Bedrock's model invocation jobs
/// (`/model-invocation-job` created, `/model-invocation-job/{id}` read,
/// `/model-invocation-job/{id}/stop`, `/model-invocation-jobs` listed) and Vertex AI's
/// batch prediction jobs (`/locations/{l}/batchPredictionJobs`, one of them by id, its
/// `:cancel` with it). Their requests are not the model's per-minute tokens.
fn batch_jobs(segs: &[&str]) -> bool {
    let is = |s: &str, w: &str| s.eq_ignore_ascii_case(w);
    (1..segs.len()).any(|i| {
        let rest = &segs[i + 1..];
        (is(segs[i], "model-invocation-job") && (rest.len() <= 1 || (rest.len() == 2 && is(rest[1], "stop"))))
            || (is(segs[i], "model-invocation-jobs") && rest.is_empty())
            || (is(segs[i], "batchpredictionjobs") && i >= 3 && is(segs[i - 2], "locations") && rest.len() <= 1)
    })
}

/// A path a server reads as it is: ASCII, no `;`, no `//` nor `/.`, no trailing `/`
/// (word-at-a-time and memchr scans and one loop over byte pairs: this runs on every
/// call).
fn plain_path(path: &str) -> bool {
    let b = path.as_bytes();
    b.is_ascii()
        && !b.contains(&b';')
        && !b.windows(2).any(|w| w[0] == b'/' && matches!(w[1], b'/' | b'.'))
        && b.last() != Some(&b'/')
}

/// Actions of the management APIs on one of their objects (`/batches/{id}/cancel`,
/// `/files/{id}/content`, `/uploads/{id}/parts`, `/vector_stores/{id}/files`).
pub const MANAGEMENT_ACTIONS: [&str; 12] = [
    "cancel",
    "content",
    "parts",
    "complete",
    "results",
    "events",
    "checkpoints",
    "files",
    "file_batches",
    "permissions",
    "pause",
    "resume",
];

/// True when `rest` (an API's segment and what follows) is one of its collections or
/// objects, or an action of [`MANAGEMENT_ACTIONS`] on one: ids and actions alternate
/// (`batches/{id}/cancel`, `vector_stores/{id}/file_batches/{id}/files`), fine-tuning's
/// collections are `fine_tuning/jobs` and `fine_tuning/checkpoints`, Mistral's batches'
/// `batch/jobs`. Anything else under
/// them (`fine_tuning/alpha/graders/run`, `vector_stores/{id}/search`) may run a model.
fn manages(rest: &[&str]) -> bool {
    let rest = if rest[0].eq_ignore_ascii_case("fine_tuning") {
        match rest.get(1) {
            Some(c) if c.eq_ignore_ascii_case("jobs") || c.eq_ignore_ascii_case("checkpoints") => &rest[1..],
            _ => return false,
        }
    } else if rest[0].eq_ignore_ascii_case("batch") {
        match rest.get(1) {
            Some(c) if c.eq_ignore_ascii_case("jobs") => &rest[1..],
            _ => return false,
        }
    } else {
        rest
    };
    rest.len() <= 5
        && rest
            .iter()
            .enumerate()
            .skip(1)
            .all(|(k, seg)| k % 2 == 1 || MANAGEMENT_ACTIONS.iter().any(|a| seg.eq_ignore_ascii_case(a)))
}

/// `v` and a digit, then letters and digits: `v1`, `v1beta`, `v2alpha`.
fn is_version(seg: &str) -> bool {
    let b = seg.as_bytes();
    b.len() >= 2
        && b[0].eq_ignore_ascii_case(&b'v')
        && b[1].is_ascii_digit()
        && b[2..].iter().all(u8::is_ascii_alphanumeric)
}

#[cfg(test)]
mod tests {
    use super::{emits_no_tokens, plain_path, route_of, spends_no_tokens, RouteMemo};

    /// The plain-path check against its plain definition, on every string of up to six
    /// characters over the ones that matter (and a few that do not).
    #[test]
    fn plain_paths_as_defined() {
        let alphabet = ['/', '.', ';', 'a', 'é', '\u{7f}'];
        let mut paths = vec![String::new()];
        for _ in 0..6 {
            let longer: Vec<String> = paths
                .iter()
                .filter(|p| p.chars().count() == paths.last().map_or(0, |l| l.chars().count()))
                .flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}")))
                .collect();
            paths.extend(longer);
        }
        assert!(paths.len() > 50_000);
        for p in &paths {
            let want = p.is_ascii() && !p.contains(';') && !p.contains("//") && !p.contains("/.") && !p.ends_with('/');
            assert_eq!(plain_path(p), want, "{p:?}");
        }
    }

    #[test]
    fn the_memo_answers_as_the_test() {
        let memo = RouteMemo::default();
        let paths = [
            "/v1/chat/completions",
            "/v1/batches",
            "/v1/batches",
            "/V1/Files/f-1/content",
            "/v1/chat/completions",
            "",
        ];
        for _ in 0..2 {
            for p in paths {
                assert_eq!(memo.spends_no_tokens(p), spends_no_tokens(p), "{p:?}");
            }
        }
    }

    #[test]
    fn calls_that_spend_no_tokens() {
        for path in [
            "/v1/messages/batches",
            "/v1/messages/batches/b/cancel",
            "/v1/batches",
            "/v1/files",
            "/upload/v1beta/files",
            "/v1/uploads/u/parts",
            "/v1/fine_tuning/jobs",
            "/v1/vector_stores/v/files",
            "/v1/messages/count_tokens",
            "/v1/responses/input_tokens",
            "/v1beta/models/m:countTokens",
            "/v1beta/models/m:batchGenerateContent",
            "/openai/batches",
            "/gateway/openai/v1/Files",
            "/v1/fine_tuning/jobs/j/cancel",
            "/v1/vector_stores/vs/file_batches/b/files",
            "/v1/messages/batches/b/results",
            "/v1beta/batches/b:cancel",
            // Stored objects of model calls: their creation was charged.
            "/v1/responses/resp_68af4030592c81938ec0a5fbab4a3e9f/input_items",
            "/openai/v1/responses/resp_1/input_items",
            "/v1/chat/completions/chatcmpl-abc123",
            "/v1/chat/completions/chatcmpl-AbC_1-2",
            "/v1/chat/completions/chatcmpl-abc123/messages",
            // The clouds' and Mistral's batch jobs.
            "/model-invocation-job",
            "/model-invocation-job/j1",
            "/model-invocation-job/j1/stop",
            "/model-invocation-jobs",
            "/v1/projects/p/locations/us-central1/batchPredictionJobs",
            "/v1/projects/p/locations/us-central1/batchPredictionJobs/123:cancel",
            "/v1/batch/jobs",
            "/v1/batch/jobs/b1/cancel",
        ] {
            assert!(spends_no_tokens(path), "{path:?}");
        }
        for path in [
            "/v1/chat/completions",
            "/v1/messages",
            "/openai/deployments/files/chat/completions",
            "/openai/deployments/batches/embeddings",
            "/v1/projects/batches/locations/l/publishers/anthropic/models/m:rawPredict",
            "/workspaces/uploads/chat",
            "/v1/files/../chat",
            "/v1/files;x",
            "/v1//files",
            "/v1/files/",
            "/v1/threads/runs",
            "/v1/files-like",
            "/v1/fine_tuning/alpha/graders/run",
            "/v1/vector_stores/vs/search",
            "/v1/files/f/generate",
            "/v1/fine_tuning",
            "/files",
            "/x/count_tokens",
            // Not a stored object's id, or an action that may generate.
            "/v1/responses/compact",
            "/v1/responses/resp_",
            "/v1/responses/resp_1/x",
            "/v1/responses/resp_1/cancel/x",
            // A response polled or cancelled: a background one reports its usage there.
            "/v1/responses/resp_68af4030592c81938ec0a5fbab4a3e9f",
            "/v1/responses/resp_1/cancel",
            "/v1/chat/completions/chatcmpl-1:generateContent",
            "/v1/chat/completions/chatcmpl-1.x",
            "/v1/responses/resp_1:x/input_items",
            "/v1/chat/completions/chatcmpl_1",
            "/v1/completions/chatcmpl-1",
            "/v1/responses/chatcmpl-1",
            "/resp_1",
            "/v1/chat/completions/chatcmpl-1/messages/x",
            "/model-invocation-job/j1/x",
            "/model-invocation-jobs/j1",
            "/v1/batchPredictionJobs",
            "/v1/batch",
            "/v1/batch/x",
            "/batch/jobs",
            "locations/l/batchPredictionJobs",
            "/",
            "",
        ] {
            assert!(!spends_no_tokens(path), "{path:?}");
        }
    }

    #[test]
    fn routes_as_the_python_reference_reads_them() {
        for (path, want) in [
            ("", "/"),
            ("/", "/"),
            ("///", "/"),
            ("/V1/Embeddings/", "/v1/embeddings"),
            ("/v1;a=1/embeddings;b", "/v1/embeddings"),
            ("/v1//x///y", "/v1/x/y"),
            ("/v1/x/../y", "/v1/y"),
            ("/../../x", "/x"),
            ("/./x/.", "/x"),
            ("v1/..", "v1"),
            ("/a/b/..", "/a"),
        ] {
            assert_eq!(route_of(path), want, "{path:?}");
        }
    }

    #[test]
    fn apis_without_output_tokens() {
        for path in [
            "/v1/embeddings",
            "/openai/deployments/e/embeddings",
            "/v1/moderations",
            "/v1/messages/count_tokens",
            "/v1beta/models/text-embedding-004:embedContent",
            "/v1beta/models/m:batchEmbedContents",
            "/v1beta/models/m:countTokens",
            "/model/amazon.titan-embed-text-v2:0/invoke",
            "/model/cohere.embed-english-v3/invoke-with-response-stream",
            "/V1//EMBEDDINGS;x/",
        ] {
            assert!(emits_no_tokens(path), "{path:?}");
        }
        for path in [
            "/v1/chat/completions",
            "/v1/images/generations",
            "/v1/audio/transcriptions",
            "/v1/embeddings/x",
            "/model/amazon.nova-lite-v1:0/invoke",
            "/model/x.embed-v1/converse",
            "/model//invoke",
            "/model/",
            "/embed/invoke",
            "",
        ] {
            assert!(!emits_no_tokens(path), "{path:?}");
        }
    }
}
