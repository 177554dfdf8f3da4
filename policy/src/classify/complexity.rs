//! The complexity tagger: `complexity=low`, `medium` or `high` from the prompt's token count,
//! whether it holds code, and its line count.
//!
//! The body is scanned as sent (JSON, never parsed). Rules, first that applies wins:
//!
//! 1. `prompt_tokens >= highMinPromptTokens`: high.
//! 2. `codeIsHigh` and the body holds code: high. Code is a Markdown code fence (three
//!    backticks) anywhere, or at least **two distinct** markers of [`MARKERS`] (variants of
//!    one marker, such as `std::` and `::new`, count once). Markers are code syntax rarely
//!    seen in prose: `def `, `(self,`, `):` and `;` or `{` at the end of a line, `#include`,
//!    `public static`, `SELECT `, `FROM `, `fn main`, `=> `, `std::`, `();`, `) {`, `== `,
//!    `&& `, `print(`, `const `, `import` at the start of a line or string... One marker
//!    alone (an `a == b` in prose, "the function of") is not code.
//! 3. At least `highMinLines` lines: high (so `0` makes every prompt high). Lines are the
//!    newline bytes plus the JSON `\n` escapes (a `\\n`, an escaped backslash then `n`, is
//!    not one).
//! 4. `prompt_tokens <= lowMaxPromptTokens`: low.
//! 5. Otherwise medium.

use std::sync::LazyLock;

use aho_corasick::{AhoCorasick, MatchKind};

use crate::kinds::ComplexityTagger;

/// The tagger's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Complexity {
    Low,
    Medium,
    High,
}

impl Complexity {
    /// The tag it sets: `complexity=low`, `complexity=medium` or `complexity=high`.
    pub fn tag(self) -> &'static str {
        match self {
            Self::Low => "complexity=low",
            Self::Medium => "complexity=medium",
            Self::High => "complexity=high",
        }
    }
}

/// The marker id of a code fence: decisive on its own.
const FENCE: u8 = 0;

/// Code markers and their ids (variants of one marker share an id). A JSON body holds a
/// newline as `\n` (the two bytes), so line-end and line-start markers are in that spelling
/// (and, for line starts, after the `"` that opens a string; `=\"` is an attribute or
/// argument string). Every marker has at least 3 bytes and there are at most 32: that keeps
/// the automaton's SIMD (Teddy) prefilter, which fingerprints the first 3 bytes, fast on
/// prose.
const MARKERS: &[(&str, u8)] = &[
    ("```", FENCE),
    ("def ", 1),
    ("(self)", 2),
    ("(self,", 2),
    (r"):\n", 3),
    ("#include", 4),
    ("#!/", 5),
    ("public static", 6),
    (".log(", 7),
    ("=> ", 8),
    (r"<\/", 9),
    (r#"=\""#, 10),
    (":= ", 11),
    ("SELECT ", 12),
    ("FROM ", 13),
    ("fn main", 14),
    (") -> ", 15),
    ("std::", 16),
    ("::new", 16),
    ("();", 17),
    (") {", 18),
    ("!= ", 19),
    ("== ", 20),
    ("&& ", 21),
    ("|| ", 22),
    ("print(", 23),
    ("function ", 24),
    ("const ", 25),
    (r";\n", 26),
    (r"{\n", 27),
    (r"\nimport ", 28),
    ("\"import ", 28),
];

/// Leftmost-first (not the standard semantics) so that the automaton may use its packed
/// (Teddy) prefilter.
#[allow(clippy::expect_used)] // constant patterns, built by the tests
static CODE: LazyLock<AhoCorasick> = LazyLock::new(|| {
    AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostFirst)
        .build(MARKERS.iter().map(|&(marker, _)| marker))
        .expect("the code markers build")
});

/// Whether `text` holds code: a fence, or two distinct markers.
fn holds_code(text: &[u8]) -> bool {
    let mut seen: u64 = 0;
    for hit in CODE.find_iter(text) {
        let id = MARKERS[hit.pattern().as_usize()].1;
        if id == FENCE {
            return true;
        }
        seen |= 1 << id;
        if seen.count_ones() >= 2 {
            return true;
        }
    }
    false
}

/// Whether `text` has at least `min` lines: every newline byte plus the JSON `\n` escapes
/// (the byte after a backslash is escaped, so `\\n` is an escaped backslash then `n`).
/// Blocks of 32 bytes with neither a backslash nor a newline are skipped with one vectorized
/// test; it stops counting at `min`.
fn lines_at_least(text: &[u8], min: u32) -> bool {
    let min = min as usize;
    if min == 0 {
        return true;
    }
    let (blocks, rest) = text.as_chunks::<32>();
    let mut lines = 0;
    let mut escaped = false;
    for block in blocks {
        let special = block.iter().fold(0u8, |any, &b| {
            any | u8::from(b == b'\\') | u8::from(b == b'\n')
        });
        if special == 0 && !escaped {
            continue;
        }
        lines += count_lines(block, &mut escaped);
        if lines >= min {
            return true;
        }
    }
    lines + count_lines(rest, &mut escaped) >= min
}

/// Lines in `bytes`; `escaped` says whether its first byte follows an unescaped backslash,
/// and is left set when its last byte is one.
fn count_lines(bytes: &[u8], escaped: &mut bool) -> usize {
    let mut lines = 0;
    for &b in bytes {
        if std::mem::take(escaped) {
            // The escaped byte: `n`, or (invalid JSON) a newline byte, still a line.
            lines += usize::from(b == b'n' || b == b'\n');
        } else if b == b'\\' {
            *escaped = true;
        } else {
            lines += usize::from(b == b'\n');
        }
    }
    lines
}

/// The complexity of the prompt `text` (a request body as sent) of `prompt_tokens` tokens,
/// and why (`"prompt tokens >= 2048"`, `"code"`, `"lines >= 40"`, `"prompt tokens <= 256"`,
/// `"between the thresholds"`; with other thresholds the reason names the setting, e.g.
/// `"prompt tokens >= highMinPromptTokens"`). See the module documentation for the rules.
pub fn complexity(
    text: &[u8],
    prompt_tokens: u32,
    cfg: &ComplexityTagger,
) -> (Complexity, &'static str) {
    if prompt_tokens >= cfg.high_min_prompt_tokens {
        let why = match cfg.high_min_prompt_tokens {
            2048 => "prompt tokens >= 2048",
            _ => "prompt tokens >= highMinPromptTokens",
        };
        return (Complexity::High, why);
    }
    if cfg.code_is_high && holds_code(text) {
        return (Complexity::High, "code");
    }
    if lines_at_least(text, cfg.high_min_lines) {
        let why = match cfg.high_min_lines {
            40 => "lines >= 40",
            _ => "lines >= highMinLines",
        };
        return (Complexity::High, why);
    }
    if prompt_tokens <= cfg.low_max_prompt_tokens {
        let why = match cfg.low_max_prompt_tokens {
            256 => "prompt tokens <= 256",
            _ => "prompt tokens <= lowMaxPromptTokens",
        };
        return (Complexity::Low, why);
    }
    (Complexity::Medium, "between the thresholds")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An OpenAI chat body whose user content is `content`, already JSON-escaped.
    fn body(content: &str) -> Vec<u8> {
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}]}}"#)
            .into_bytes()
    }

    fn rate(content: &str, tokens: u32) -> (Complexity, &'static str) {
        complexity(&body(content), tokens, &ComplexityTagger::default())
    }

    #[test]
    fn tags_name_the_level() {
        assert_eq!(Complexity::Low.tag(), "complexity=low");
        assert_eq!(Complexity::Medium.tag(), "complexity=medium");
        assert_eq!(Complexity::High.tag(), "complexity=high");
    }

    #[test]
    fn markers_build_and_stay_within_the_fast_prefilter() {
        assert_eq!(CODE.patterns_len(), MARKERS.len());
        assert!(MARKERS.len() <= 32, "Teddy slows down past 32 patterns");
        assert!(
            MARKERS.iter().all(|&(m, _)| m.len() >= 3),
            "Teddy fingerprints 3 bytes"
        );
        assert!(MARKERS.iter().all(|&(_, id)| id < 64));
    }

    #[test]
    fn short_prose_is_low() {
        assert_eq!(
            rate("What is the capital of France?", 8),
            (Complexity::Low, "prompt tokens <= 256")
        );
        assert_eq!(
            rate(
                "Explain the function of mitochondria for my biology class.",
                256
            ),
            (Complexity::Low, "prompt tokens <= 256")
        );
    }

    #[test]
    fn prose_between_the_thresholds_is_medium() {
        assert_eq!(
            rate(r"Summarize this essay.\n\nIt was a dark night.", 257),
            (Complexity::Medium, "between the thresholds")
        );
        assert_eq!(
            rate("a long letter", 2047),
            (Complexity::Medium, "between the thresholds")
        );
    }

    #[test]
    fn many_prompt_tokens_are_high() {
        assert_eq!(
            rate("hi", 2048),
            (Complexity::High, "prompt tokens >= 2048")
        );
        assert_eq!(
            rate("hi", 100_000),
            (Complexity::High, "prompt tokens >= 2048")
        );
    }

    #[test]
    fn a_code_fence_alone_is_high() {
        assert_eq!(
            rate(r"Fix this:\n```\nx = 1\n```", 20),
            (Complexity::High, "code")
        );
    }

    #[test]
    fn two_distinct_markers_are_code() {
        assert_eq!(
            rate(r"def area(self):\n    return self.w * self.h", 20),
            (Complexity::High, "code")
        );
        assert_eq!(
            rate(r"#include <stdio.h>\nint main() { return 0; }", 20),
            (Complexity::High, "code")
        );
        assert_eq!(
            rate("SELECT name FROM users WHERE id = 1", 12),
            (Complexity::High, "code")
        );
        assert_eq!(
            rate(r"const f = (x) => x + 1;\nconsole.log(f(2));", 20),
            (Complexity::High, "code")
        );
        assert_eq!(
            rate(r"import os\nprint(os.getcwd())", 10),
            (Complexity::High, "code")
        );
        assert_eq!(
            rate(r"fn main() {\n    let v: Vec<u8> = Vec::new();\n}", 20),
            (Complexity::High, "code")
        );
        assert_eq!(
            rate(r#"<a href=\"/home\">home<\/a>"#, 10),
            (Complexity::High, "code")
        );
    }

    #[test]
    fn one_marker_or_its_variants_alone_is_not_code() {
        assert_eq!(rate("map each key -> value", 10).0, Complexity::Low);
        assert_eq!(rate("if (a) {} else if (b) {}", 10).0, Complexity::Low);
        assert_eq!(rate("is x == y, or x === y?", 10).0, Complexity::Low);
        assert_eq!(
            rate("I am (self-employed) and print(s) books", 10).0,
            Complexity::Low
        );
        assert_eq!(
            rate(
                "we import goods from abroad; the class learns the function of trade",
                20
            )
            .0,
            Complexity::Low
        );
        let stop = br#"{"model":"m","prompt":"hello","stop":["</s>"]}"#;
        assert_eq!(
            complexity(stop, 5, &ComplexityTagger::default()).0,
            Complexity::Low
        );
    }

    #[test]
    fn code_is_not_high_when_code_is_high_is_off() {
        let cfg = ComplexityTagger {
            code_is_high: false,
            ..ComplexityTagger::default()
        };
        assert_eq!(
            complexity(&body(r"```\nx = 1\n```"), 20, &cfg),
            (Complexity::Low, "prompt tokens <= 256")
        );
    }

    #[test]
    fn forty_escaped_newlines_are_high_thirty_nine_are_not() {
        let lines = |n: usize| r"a line\n".repeat(n);
        assert_eq!(rate(&lines(40), 100), (Complexity::High, "lines >= 40"));
        assert_eq!(
            rate(&lines(39), 100),
            (Complexity::Low, "prompt tokens <= 256")
        );
        assert_eq!(
            rate(&lines(39), 300),
            (Complexity::Medium, "between the thresholds")
        );
    }

    #[test]
    fn raw_newline_bytes_count_as_lines_and_escaped_backslashes_do_not() {
        let raw = "x\n".repeat(40);
        assert_eq!(
            complexity(raw.as_bytes(), 10, &ComplexityTagger::default()),
            (Complexity::High, "lines >= 40")
        );
        let mixed = format!("{}{}", "x\n".repeat(20), r"y\n".repeat(20));
        assert!(lines_at_least(mixed.as_bytes(), 40));
        assert!(!lines_at_least(r"C:\\new\\name\\".repeat(20).as_bytes(), 1));
        assert!(lines_at_least(br"\\\n", 1));
        assert!(!lines_at_least(br"trailing \", 1));
        assert!(lines_at_least(b"", 0));
    }

    /// The plain byte loop `lines_at_least` must agree with.
    fn lines_naive(text: &[u8]) -> usize {
        let (mut lines, mut i) = (0, 0);
        while i < text.len() {
            match text[i] {
                b'\n' => lines += 1,
                b'\\' => {
                    // The escaped byte: `n`, or (invalid JSON) a newline byte, still a line.
                    lines += usize::from(matches!(text.get(i + 1), Some(b'n' | b'\n')));
                    i += 1;
                }
                _ => {}
            }
            i += 1;
        }
        lines
    }

    #[test]
    fn line_blocks_agree_with_a_byte_loop_across_block_boundaries() {
        let pieces: [&[u8]; 5] = [b"a", br"\", b"n", b"\n", br"\n"];
        for len in [0usize, 1, 30, 31, 32, 33, 63, 64, 65, 100] {
            for seed in 0..200u32 {
                let mut text = Vec::new();
                let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(len as u32);
                while text.len() < len {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    text.extend_from_slice(pieces[(x % 5) as usize]);
                }
                let want = lines_naive(&text);
                let n = u32::try_from(want).unwrap_or(u32::MAX);
                assert!(
                    lines_at_least(&text, n),
                    "{:?}",
                    String::from_utf8_lossy(&text)
                );
                assert!(
                    !lines_at_least(&text, n + 1),
                    "{:?}",
                    String::from_utf8_lossy(&text)
                );
            }
        }
        let straddling = [&[b'a'; 31][..], br"\n"].concat();
        assert!(lines_at_least(&straddling, 1));
        let escaped_backslash = [&[b'a'; 31][..], br"\\n"].concat();
        assert!(!lines_at_least(&escaped_backslash, 1));
    }

    #[test]
    fn reasons_name_the_setting_when_thresholds_are_not_the_defaults() {
        let cfg = ComplexityTagger {
            low_max_prompt_tokens: 100,
            high_min_prompt_tokens: 1000,
            code_is_high: true,
            high_min_lines: 5,
        };
        let text = body("plain words");
        assert_eq!(
            complexity(&text, 1000, &cfg),
            (Complexity::High, "prompt tokens >= highMinPromptTokens")
        );
        assert_eq!(
            complexity(&text, 100, &cfg),
            (Complexity::Low, "prompt tokens <= lowMaxPromptTokens")
        );
        assert_eq!(
            complexity(&body(&r"l\n".repeat(5)), 10, &cfg),
            (Complexity::High, "lines >= highMinLines")
        );
        assert_eq!(
            complexity(&text, 500, &cfg),
            (Complexity::Medium, "between the thresholds")
        );
    }

    #[test]
    fn token_threshold_wins_over_code_and_code_over_lines() {
        let code_and_lines = format!(r"```\n{}", r"x\n".repeat(50));
        assert_eq!(rate(&code_and_lines, 5000).1, "prompt tokens >= 2048");
        assert_eq!(rate(&code_and_lines, 10).1, "code");
    }
}
