//! The PII tagger: does a request body hold personal data or a secret?
//!
//! The body is scanned as the client sent it (OpenAI JSON, never parsed), so JSON escapes
//! appear literally: a newline in a prompt is the two bytes `\` `n`. Every pattern therefore
//! accepts a JSON escape (`\n`, `\r`, `\t`, `\b`, `\f`, `\uXXXX`) where it wants a word
//! boundary before the match: `...\n4111 1111 1111 1111` is a card even though `n4` is not
//! a boundary.
//!
//! One pass decides which rules may fire: a single [`RegexSet`] over every pattern (all
//! ASCII, `(?-u)`, so the lazy DFA never gives up on non-ASCII bytes). Ranges (SSN parts,
//! IPv4 octets, IPv6 group counts) are in the patterns themselves, so most rules fire on the
//! set hit alone. Three need a look at their candidates, and only when the set says they may
//! fire:
//!
//! - email: `find_iter` (cheap: the regex searches for `@` first), to drop image names such
//!   as `icon@2x.png`;
//! - payment card and IBAN: one more pass of one regex holding both, each candidate checked
//!   in code (Luhn, ISO 13616 mod-97, and what is just before it).
//!
//! Matched text is never returned.

use std::sync::LazyLock;

use regex::bytes::{Regex, RegexSet};

use crate::kinds::{PiiRule, PiiTagger};

/// An optional JSON escape before a pattern whose candidates are validated in code: the
/// match then starts at the `\` and [`context`] strips it.
macro_rules! esc {
    () => {
        r"(?:\\(?:[nrtbf]|u[0-9A-Fa-f]{4}))?"
    };
}

/// Before a key or a `+`: the start, a non-word byte other than `-` and `+`, or a JSON escape.
macro_rules! lead_word {
    () => {
        r"(?:^|[^0-9A-Za-z_\-+]|\\[nrtbf]|\\u[0-9A-Fa-f]{4})"
    };
}

/// Before a dash- or dot-separated number: the start, a non-word byte other than `.` and `-`
/// (so the number does not continue a longer one), or a JSON escape.
macro_rules! lead_num {
    () => {
        r"(?:^|[^0-9A-Za-z_.\-]|\\[nrtbf]|\\u[0-9A-Fa-f]{4})"
    };
}

/// After a dash- or dot-separated number: the end, a non-word byte other than `.`/`-`, or a
/// `.`/`-` that does not go on with a word character (`call 555-123-4567.` is fine).
macro_rules! tail_num {
    () => {
        r"(?:$|[^0-9A-Za-z_.\-]|[.\-](?:$|[^0-9A-Za-z_]))"
    };
}

/// One IPv4 octet, 0-255 without leading zeros.
macro_rules! octet {
    () => {
        r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    };
}

/// One IPv6 group.
macro_rules! h16 {
    () => {
        "[0-9A-Fa-f]{1,4}"
    };
}

/// Payment card candidates: 13-19 digits, first 2-6 (the major networks' ranges: keeps epoch
/// milliseconds and other 1-led ids out), contiguous or in groups of 3-6 after a first group
/// of 4, separated by single spaces or single dashes.
macro_rules! card {
    () => {
        r"(?:[2-6][0-9]{12,18}|[2-6][0-9]{3}(?:[ ][0-9]{3,6}){2,4}|[2-6][0-9]{3}(?:-[0-9]{3,6}){2,4})\b"
    };
}

/// IBAN candidates: country, check digits, then 11-30 capitals and digits, contiguous or in
/// space-separated groups of 4 (the last may be shorter).
macro_rules! iban {
    () => {
        r"[A-Z]{2}[0-9]{2}(?:[A-Z0-9]{11,30}|(?:[ ][A-Z0-9]{4}){2,7}(?:[ ][A-Z0-9]{1,4})?)\b"
    };
}

/// IPv6: eight groups, or `::` with 3-7 groups around it (one alternative per count on its
/// left), not inside a longer `:`-separated token.
#[rustfmt::skip]
const IPV6: &str = concat!(
    "(?-u)",
    r"(?:^|[^0-9A-Za-z_:]|\\[nrtbf]|\\u[0-9A-Fa-f]{4})",
    "(?:", h16!(), "(?::", h16!(), "){7}",                                          // 8
    "|::", h16!(), "(?::", h16!(), "){2,6}",                                        // 0 + 3-7
    "|", h16!(), "::", h16!(), "(?::", h16!(), "){1,5}",                            // 1 + 2-6
    "|", h16!(), ":", h16!(), "::", h16!(), "(?::", h16!(), "){0,4}",               // 2 + 1-5
    "|", h16!(), "(?::", h16!(), "){2}::(?:", h16!(), "(?::", h16!(), "){0,3})?",   // 3 + 0-4
    "|", h16!(), "(?::", h16!(), "){3}::(?:", h16!(), "(?::", h16!(), "){0,2})?",   // 4 + 0-3
    "|", h16!(), "(?::", h16!(), "){4}::(?:", h16!(), "(?::", h16!(), ")?)?",       // 5 + 0-2
    "|", h16!(), "(?::", h16!(), "){5}::(?:", h16!(), ")?",                         // 6 + 0-1
    "|", h16!(), "(?::", h16!(), "){6}::",                                          // 7 + 0
    ")",
    r"(?:$|[^0-9A-Za-z_:])",
);

/// Every pattern of the set, grouped by rule in [`PiiRule::ALL`] order.
const PATTERNS: &[(PiiRule, &str)] = &[
    (
        PiiRule::Email,
        concat!(
            "(?-u)",
            r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?",
            r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?)*\.[A-Za-z]{2,}\b",
        ),
    ),
    // International: `+`, a country code, then 7-14 digits, each after up to two of
    // space . - ( ) (`+1 (415) 555-0100`, `+44 20 7946 0958`, `+14155550100`).
    (
        PiiRule::Phone,
        concat!(
            "(?-u)",
            lead_word!(),
            r"\+[1-9][0-9]{0,2}(?:[ .\-()]{0,2}[0-9]){7,14}(?:$|[^0-9A-Za-z_])",
        ),
    ),
    // North American: `(555) 123-4567`, `555-123-4567`, `555.123.4567`.
    (
        PiiRule::Phone,
        concat!(
            "(?-u)",
            lead_num!(),
            r"(?:\([0-9]{3}\)[ ]?[0-9]{3}[\-. ][0-9]{4}|[0-9]{3}-[0-9]{3}-[0-9]{4}|[0-9]{3}\.[0-9]{3}\.[0-9]{4})",
            tail_num!(),
        ),
    ),
    (PiiRule::PaymentCard, concat!("(?-u)", card!())),
    // AAA-GG-SSSS: area 001-899 but 666, group 01-99, serial 0001-9999.
    (
        PiiRule::UsSsn,
        concat!(
            "(?-u)",
            lead_num!(),
            r"(?:00[1-9]|0[1-9][0-9]|[1-578][0-9]{2}|6[0-57-9][0-9]|66[0-57-9])",
            r"-(?:0[1-9]|[1-9][0-9])",
            r"-(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})",
            tail_num!(),
        ),
    ),
    (PiiRule::Iban, concat!("(?-u)", iban!())),
    // Four octets, not inside a longer dotted number (`1.2.3.4.5`, `v1.2.3.4`).
    (
        PiiRule::IpAddress,
        concat!(
            "(?-u)",
            r"(?:^|[^0-9A-Za-z_.]|(?:^|[^0-9A-Za-z_])\.|\\[nrtbf]|\\u[0-9A-Fa-f]{4})",
            octet!(),
            r"\.",
            octet!(),
            r"\.",
            octet!(),
            r"\.",
            octet!(),
            r"(?:$|[^0-9A-Za-z_.]|\.(?:$|[^0-9]))",
        ),
    ),
    (PiiRule::IpAddress, IPV6),
    (
        PiiRule::ApiKey,
        concat!(
            "(?-u)",
            lead_word!(),
            "(?:",
            r"sk-[A-Za-z0-9_\-]{20,}",
            r"|gh[pousr]_[A-Za-z0-9]{20,}",
            r"|github_pat_[A-Za-z0-9_]{20,}",
            r"|(?:AKIA|ASIA)[0-9A-Z]{16}(?:$|[^0-9A-Za-z])",
            r"|xox[abpr]-[A-Za-z0-9\-]{10,}",
            r"|AIza[0-9A-Za-z_\-]{35}(?:$|[^0-9A-Za-z_\-])",
            r"|eyJ[A-Za-z0-9_\-]{5,}\.eyJ[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]*",
            ")",
        ),
    ),
    (
        PiiRule::PrivateKey,
        concat!(
            "(?-u)",
            r"-----BEGIN (?:RSA |EC |DSA |OPENSSH |ENCRYPTED )?PRIVATE KEY-----",
        ),
    ),
];

/// The email pattern alone, to check its candidates.
const EMAIL: &str = PATTERNS[0].1;

/// Card and IBAN candidates in one regex (a card starts with a digit, an IBAN with a letter).
const NUMBERS: &str = concat!("(?-u)", esc!(), "(?:", card!(), "|", iban!(), ")");

struct Detectors {
    /// Every pattern of [`PATTERNS`], by index.
    set: RegexSet,
    email: Regex,
    numbers: Regex,
}

#[allow(clippy::expect_used)] // constant patterns, compiled by the tests
static DETECTORS: LazyLock<Detectors> = LazyLock::new(|| Detectors {
    set: RegexSet::new(PATTERNS.iter().map(|&(_, pattern)| pattern))
        .expect("the PII patterns compile"),
    email: Regex::new(EMAIL).expect("the email pattern compiles"),
    numbers: Regex::new(NUMBERS).expect("the card and IBAN pattern compiles"),
});

/// The first rule of [`PiiRule::ALL`] that is not in `cfg.disabled` and finds personal data
/// or a secret in `text` (a request body as sent), or `None`.
pub fn pii_rule_found(text: &[u8], cfg: &PiiTagger) -> Option<PiiRule> {
    let enabled = |rule: PiiRule| !cfg.disabled.contains(&rule);
    if text.is_empty() || !PiiRule::ALL.into_iter().any(enabled) {
        return None;
    }
    let detectors = &*DETECTORS;
    let hits = detectors.set.matches(text);
    if !hits.matched_any() {
        return None;
    }
    let may_fire = |rule: PiiRule| {
        enabled(rule)
            && PATTERNS
                .iter()
                .enumerate()
                .any(|(i, &(r, _))| r == rule && hits.matched(i))
    };
    let mut numbers = None;
    PiiRule::ALL
        .into_iter()
        .filter(|&r| may_fire(r))
        .find(|&rule| match rule {
            PiiRule::Email => detectors
                .email
                .find_iter(text)
                .any(|m| email_ok(text, m.start(), m.end())),
            PiiRule::PaymentCard | PiiRule::Iban => {
                let found: &Numbers = numbers.get_or_insert_with(|| {
                    scan_numbers(
                        &detectors.numbers,
                        text,
                        may_fire(PiiRule::PaymentCard),
                        may_fire(PiiRule::Iban),
                    )
                });
                if rule == PiiRule::PaymentCard {
                    found.card
                } else {
                    found.iban
                }
            }
            _ => true,
        })
}

/// Which of the checked rules have a valid candidate.
struct Numbers {
    card: bool,
    iban: bool,
}

/// One pass over the card and IBAN candidates, stopping once the answer cannot change (a
/// card outranks an IBAN).
fn scan_numbers(regex: &Regex, text: &[u8], want_card: bool, want_iban: bool) -> Numbers {
    let mut found = Numbers {
        card: false,
        iban: false,
    };
    for m in regex.find_iter(text) {
        let cx = context(text, m.start());
        let candidate = &text[cx.start..m.end()];
        let word = |b: Option<u8>| b.is_some_and(is_word);
        if word(cx.prev) {
            continue;
        }
        if candidate.first().is_some_and(u8::is_ascii_digit) {
            if want_card
                && !(cx.prev == Some(b'.') && cx.prev2.is_some_and(|b| b.is_ascii_digit()))
                && card_ok(candidate)
            {
                found.card = true;
                return found;
            }
        } else if want_iban && !found.iban && iban_ok(candidate) {
            found.iban = true;
            if !want_card {
                return found;
            }
        }
    }
    found
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Where a candidate starts once the optional JSON escape [`esc!`] before it is stripped,
/// and the bytes just before it.
struct Context {
    /// Where the candidate itself starts.
    start: usize,
    /// The byte before it; `None` at the start or after a JSON escape.
    prev: Option<u8>,
    /// The byte before `prev`.
    prev2: Option<u8>,
}

fn context(text: &[u8], start: usize) -> Context {
    let before = |at: usize, back: usize| at.checked_sub(back).map(|i| text[i]);
    if text.get(start) != Some(&b'\\') {
        return Context {
            start,
            prev: before(start, 1),
            prev2: before(start, 2),
        };
    }
    let len = if text.get(start + 1) == Some(&b'u') {
        6
    } else {
        2
    };
    let escaped_backslash = text[..start]
        .iter()
        .rev()
        .take_while(|&&b| b == b'\\')
        .count()
        % 2
        == 1;
    if escaped_backslash {
        // `\\n4111...`: a literal backslash, then the letter `n` right before.
        Context {
            start: start + len,
            prev: before(start + len, 1),
            prev2: before(start + len, 2),
        }
    } else {
        Context {
            start: start + len,
            prev: None,
            prev2: None,
        }
    }
}

/// The address `text[start..end]` is real: its local part is not only the letter of a JSON
/// escape (`\n@app.route` is a decorator on a new line, not `n@app.route`), and it is not an
/// image name such as `icon@2x.png` (the top-level domain is an image extension).
fn email_ok(text: &[u8], start: usize, end: usize) -> bool {
    const IMAGES: [&[u8]; 8] = [
        b"png", b"jpg", b"jpeg", b"gif", b"svg", b"webp", b"ico", b"bmp",
    ];
    let after_escape = text[..start]
        .iter()
        .rev()
        .take_while(|&&b| b == b'\\')
        .count()
        % 2
        == 1;
    let candidate = &text[start + usize::from(after_escape)..end];
    let local = candidate.iter().take_while(|&&b| b != b'@').count();
    let tld = candidate.rsplit(|&b| b == b'.').next().unwrap_or_default();
    local > 0 && !IMAGES.iter().any(|ext| tld.eq_ignore_ascii_case(ext))
}

/// Luhn on the digits of `groups`, read as one number.
fn luhn(groups: &[&[u8]]) -> bool {
    const DOUBLED: [u32; 10] = [0, 2, 4, 6, 8, 1, 3, 5, 7, 9];
    let (mut sum, mut double) = (0u32, false);
    for group in groups.iter().rev() {
        for &d in group.iter().rev() {
            let v = usize::from(d.wrapping_sub(b'0')).min(9);
            sum += if double { DOUBLED[v] } else { v as u32 };
            double = !double;
        }
    }
    sum % 10 == 0
}

/// A contiguous candidate passes Luhn; a grouped one (`4111 1111 1111 1111 2025`) has a run
/// of at least 3 of its groups, the first of 4 digits starting 2-6, 13-19 digits in all, that
/// passes Luhn.
fn card_ok(candidate: &[u8]) -> bool {
    let mut groups: [&[u8]; 5] = [&[]; 5];
    let mut n = 0;
    for group in candidate.split(|&b| b == b' ' || b == b'-') {
        let Some(slot) = groups.get_mut(n) else {
            return false;
        };
        *slot = group;
        n += 1;
    }
    let groups = &groups[..n];
    if n == 1 {
        return luhn(groups);
    }
    (0..n).any(|i| {
        groups[i].len() == 4
            && (b'2'..=b'6').contains(&groups[i][0])
            && (i + 3..=n).any(|j| {
                let run = &groups[i..j];
                let digits: usize = run.iter().map(|g| g.len()).sum();
                (13..=19).contains(&digits) && luhn(run)
            })
    })
}

/// ISO 13616: 15-34 characters, mod 97 of the number (first four moved to the end, letters
/// as 10-35) is 1. A grouped candidate may run into following words of four capitals, so
/// each prefix ending at a group is tried too (in the same pass).
fn iban_ok(candidate: &[u8]) -> bool {
    /// Appends one character's digits; reduces mod 97 only when the value grows large.
    fn push(acc: u64, b: u8) -> u64 {
        let acc = if acc >= 1 << 50 { acc % 97 } else { acc };
        if b.is_ascii_digit() {
            acc * 10 + u64::from(b - b'0')
        } else {
            acc * 100 + u64::from(b.wrapping_sub(b'A')) + 10
        }
    }
    let Some((head, bban)) = candidate.split_at_checked(4) else {
        return false;
    };
    let valid = |acc: u64, len: usize| {
        (15..=34).contains(&len) && head.iter().fold(acc, |a, &b| push(a, b)) % 97 == 1
    };
    let (mut acc, mut len) = (0, head.len());
    for &b in bban {
        if b == b' ' {
            if valid(acc, len) {
                return true;
            }
        } else {
            acc = push(acc, b);
            len += 1;
        }
    }
    valid(acc, len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An OpenAI chat body whose user content is `content`, already JSON-escaped.
    fn body(content: &str) -> Vec<u8> {
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}]}}"#)
            .into_bytes()
    }

    fn found(content: &str) -> Option<PiiRule> {
        pii_rule_found(&body(content), &PiiTagger::default())
    }

    fn only(rule: PiiRule) -> PiiTagger {
        PiiTagger {
            disabled: PiiRule::ALL.into_iter().filter(|&r| r != rule).collect(),
            ..PiiTagger::default()
        }
    }

    /// Whether `rule` alone (all others disabled) fires on `content`.
    fn fires(rule: PiiRule, content: &str) -> bool {
        pii_rule_found(&body(content), &only(rule)) == Some(rule)
    }

    #[test]
    fn every_pattern_compiles() {
        let detectors = &*DETECTORS;
        assert_eq!(detectors.set.len(), PATTERNS.len());
        assert!(detectors.email.is_match(b"a@example.com"));
        assert!(
            detectors
                .numbers
                .is_match(b"4111111111111111 GB82WEST12345698765432")
        );
    }

    #[test]
    fn patterns_are_grouped_by_rule_in_all_order() {
        let order = |r: PiiRule| PiiRule::ALL.iter().position(|&a| a == r);
        assert!(PATTERNS.windows(2).all(|w| order(w[0].0) <= order(w[1].0)));
        for rule in PiiRule::ALL {
            assert!(
                PATTERNS.iter().any(|p| p.0 == rule),
                "{rule:?} has a pattern"
            );
        }
        assert_eq!(PATTERNS[0].0, PiiRule::Email);
    }

    #[test]
    fn email_in_json_body_fires() {
        assert_eq!(
            found(r"reach me at jane.doe+work@mail.example.co.uk\nthanks"),
            Some(PiiRule::Email)
        );
        assert!(fires(PiiRule::Email, r"\njohn@example.com"));
        assert!(fires(
            PiiRule::Email,
            r#"my address is \"a_b@example.org\""#
        ));
    }

    #[test]
    fn email_near_misses_do_not_fire() {
        assert!(!fires(PiiRule::Email, "write to root@localhost"));
        assert!(!fires(PiiRule::Email, "npm install left-pad@1.3.0"));
        assert!(!fires(PiiRule::Email, r#"<img src=\"icon@2x.png\">"#));
        assert!(!fires(
            PiiRule::Email,
            "an @ sign alone, or me@ or @example.com"
        ));
        // A Python decorator on a new line: `\n@app.route`, not the address `n@app.route`.
        assert!(!fires(
            PiiRule::Email,
            r#"app = Flask()\n@app.route(\"/\")\ndef index():"#
        ));
        assert!(!fires(PiiRule::Email, r"\t@dataclass.field"));
    }

    #[test]
    fn international_phone_in_json_body_fires() {
        assert_eq!(
            found(r"call me at +1 415 555 0100\nthanks"),
            Some(PiiRule::Phone)
        );
        assert!(fires(PiiRule::Phone, r"\n+44 20 7946 0958"));
        assert!(fires(PiiRule::Phone, "+1 (415) 555-0100"));
        assert!(fires(PiiRule::Phone, "+49-30-1234567"));
        assert!(fires(PiiRule::Phone, "+14155550100."));
    }

    #[test]
    fn north_american_phone_in_json_body_fires() {
        assert!(fires(PiiRule::Phone, r"office: (555) 123-4567\n"));
        assert!(fires(PiiRule::Phone, r"\n555-123-4567"));
        assert!(fires(PiiRule::Phone, "cell 555.123.4567."));
    }

    #[test]
    fn digit_runs_and_timestamps_are_not_phones() {
        assert!(!fires(PiiRule::Phone, "order 4155550100 shipped"));
        assert!(!fires(PiiRule::Phone, "at 2024-01-15T10:00:00+01:00 sharp"));
        assert!(!fires(PiiRule::Phone, "score +12 34 today"));
        assert!(!fires(PiiRule::Phone, "dial 555-1234"));
        assert!(!fires(
            PiiRule::Phone,
            "ids 1555-123-4567 and 555-123-45678"
        ));
        assert_eq!(found("order 4155550100 shipped"), None);
    }

    #[test]
    fn payment_card_with_valid_luhn_fires() {
        assert_eq!(
            found(r"card: 4111 1111 1111 1111\nexp 12/27"),
            Some(PiiRule::PaymentCard)
        );
        assert!(fires(PiiRule::PaymentCard, r"\n4111111111111111"));
        assert!(fires(PiiRule::PaymentCard, "amex 378282246310005"));
        assert!(fires(PiiRule::PaymentCard, "mc 5555-5555-5555-4444"));
        assert!(fires(PiiRule::PaymentCard, "amex 3782 822463 10005"));
        assert!(fires(PiiRule::PaymentCard, "card 4111 1111 1111 1111 2027"));
        assert!(fires(
            PiiRule::PaymentCard,
            "order 2027 4111 1111 1111 1111"
        ));
    }

    #[test]
    fn payment_card_near_misses_do_not_fire() {
        assert_eq!(found("card: 4111 1111 1111 1112"), None);
        assert!(!fires(PiiRule::PaymentCard, "4111111111111112"));
        assert!(!fires(PiiRule::PaymentCard, "41111111111111110")); // 17 digits, bad Luhn
        assert!(!fires(PiiRule::PaymentCard, "id 94111111111111111111"));
        assert!(!fires(PiiRule::PaymentCard, "x4111111111111111"));
        assert!(!fires(PiiRule::PaymentCard, "pi 3.4111111111111111"));
        // Luhn-valid but 1-led: epoch milliseconds, not a card.
        assert!(!fires(PiiRule::PaymentCard, "ts 1700000000009"));
        assert!(!fires(PiiRule::PaymentCard, "4111 1111-1111 1111"));
    }

    #[test]
    fn us_ssn_in_valid_ranges_fires() {
        assert_eq!(found(r"SSN 078-05-1120\nok"), Some(PiiRule::UsSsn));
        assert!(fires(PiiRule::UsSsn, r"\n123-45-6789"));
        assert!(fires(PiiRule::UsSsn, "ssn: 899-99-9999."));
    }

    #[test]
    fn us_ssn_outside_valid_ranges_does_not_fire() {
        for ssn in [
            "000-12-3456",
            "666-12-3456",
            "900-12-3456",
            "999-12-3456",
            "123-00-4567",
            "123-45-0000",
            "1123-45-6789",
            "123-45-67890",
            "2024-123-45-6789",
        ] {
            assert!(!fires(PiiRule::UsSsn, &format!("ssn {ssn} here")), "{ssn}");
        }
        assert_eq!(found("ssn 000-12-3456 here"), None);
    }

    #[test]
    fn iban_with_valid_check_fires() {
        assert_eq!(
            found(r"IBAN DE89 3704 0044 0532 0130 00\nthanks"),
            Some(PiiRule::Iban)
        );
        assert!(fires(PiiRule::Iban, r"\nGB82WEST12345698765432"));
        assert!(fires(PiiRule::Iban, "GB82 WEST 1234 5698 7654 32 THEN"));
        assert!(fires(PiiRule::Iban, "to NO9386011117947"));
        assert!(fires(
            PiiRule::Iban,
            "DE89 3704 0044 0532 0130 00 WITH ABCD"
        ));
        // The regex takes the following capitals as a fifth group; a shorter prefix passes.
        assert!(fires(PiiRule::Iban, "BE68 5390 0754 7034 WITH CASH"));
    }

    #[test]
    fn iban_with_wrong_check_does_not_fire() {
        assert_eq!(found("IBAN DE88 3704 0044 0532 0130 00"), None);
        assert!(!fires(PiiRule::Iban, "GB82WEST12345698765433"));
        assert!(!fires(PiiRule::Iban, "XGB82WEST12345698765432"));
        assert!(!fires(PiiRule::Iban, "AB12 CDEF"));
    }

    #[test]
    fn ipv4_in_json_body_fires() {
        assert_eq!(
            found(r"server 192.168.1.10\nport 80"),
            Some(PiiRule::IpAddress)
        );
        assert!(fires(PiiRule::IpAddress, r"\n10.0.0.1:8080"));
        assert!(fires(PiiRule::IpAddress, "gateway 255.255.255.0."));
        assert!(fires(PiiRule::IpAddress, "net 172.16.0.0/12"));
    }

    #[test]
    fn ipv4_near_misses_do_not_fire() {
        assert_eq!(found("host 999.1.1.1"), None);
        assert!(!fires(PiiRule::IpAddress, "host 256.1.1.1"));
        assert!(!fires(PiiRule::IpAddress, "version 1.2.3.4.5"));
        assert!(!fires(PiiRule::IpAddress, "version 1.2.3.4.5.6.7.8"));
        assert!(!fires(PiiRule::IpAddress, "v1.2.3.4"));
        assert!(!fires(PiiRule::IpAddress, "1.2.3.4567 and 1234.1.1.1"));
        assert!(!fires(PiiRule::IpAddress, "Python 3.12.1 on 2024.01.15"));
        assert!(!fires(PiiRule::IpAddress, "padded 010.000.000.001"));
    }

    #[test]
    fn ipv6_full_and_compressed_fire() {
        assert!(fires(
            PiiRule::IpAddress,
            r"\n2001:0db8:85a3:0000:0000:8a2e:0370:7334"
        ));
        assert!(fires(PiiRule::IpAddress, "addr 2001:db8::8a2e:370:7334 up"));
        assert!(fires(PiiRule::IpAddress, "addr 2001:db8::1"));
        assert!(fires(PiiRule::IpAddress, "addr fe80:0:0::"));
        assert!(fires(PiiRule::IpAddress, "addr ::ffff:0:1"));
        assert!(fires(PiiRule::IpAddress, "addr 1:2:3:4:5:6:7::"));
    }

    #[test]
    fn ipv6_near_misses_do_not_fire() {
        assert_eq!(found("loopback ::1 and fe80::1"), None);
        assert!(!fires(
            PiiRule::IpAddress,
            "use std::collections::HashMap; a::b::c"
        ));
        assert!(!fires(
            PiiRule::IpAddress,
            "time 10:30:45, mac 00:1a:2b:3c:4d:5e"
        ));
        assert!(!fires(PiiRule::IpAddress, "1:2:3:4:5:6:7:8:9"));
        assert!(!fires(PiiRule::IpAddress, "1:2:3:4::5:6:7:8"));
    }

    #[test]
    fn api_keys_of_known_shapes_fire() {
        for key in [
            "sk-abcdefghijklmnopqrstuvwxyz012345",
            "sk-proj-Ab3_dEf-GhIjKlMnOpQrStUv",
            "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
            "github_pat_11ABCDEFG0123456789_abcdefghij",
            "AKIAIOSFODNN7EXAMPLE",
            "xoxb-1234567890-abcdefghij",
            "AIzaSyA-1234567890abcdefghijklmnopqrstu",
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
        ] {
            assert!(
                fires(PiiRule::ApiKey, &format!(r#"key: \"{key}\"\n"#)),
                "{key}"
            );
            assert!(fires(PiiRule::ApiKey, &format!(r"\n{key}")), "{key}");
        }
        assert_eq!(
            found(r"Bearer sk-abcdefghijklmnopqrstuvwxyz\n"),
            Some(PiiRule::ApiKey)
        );
    }

    #[test]
    fn api_key_near_misses_do_not_fire() {
        for text in [
            "sk-short",
            "task-abcdefghijklmnopqrstuvwxyz",
            "ghp_tooshort",
            "AKIAIOSFODNN7EXAMPL",
            "AKIAIOSFODNN7EXAMPLE1",
            "xoxz-1234567890-abc",
            "AIzaSyA-tooshort",
            "eyJhbGciOiJIUzI1NiJ9 only a header",
        ] {
            assert!(!fires(PiiRule::ApiKey, text), "{text}");
        }
    }

    #[test]
    fn private_key_blocks_fire() {
        for kind in ["", "RSA ", "EC ", "DSA ", "OPENSSH ", "ENCRYPTED "] {
            let pem = format!(r"-----BEGIN {kind}PRIVATE KEY-----\nMIIEvQIBADANBg\n");
            assert_eq!(found(&pem), Some(PiiRule::PrivateKey), "{kind}");
        }
    }

    #[test]
    fn public_keys_and_certificates_do_not_fire() {
        assert_eq!(found(r"-----BEGIN PUBLIC KEY-----\nMIIBIjANBg"), None);
        assert_eq!(found(r"-----BEGIN CERTIFICATE-----\nMIIDdzCCAl"), None);
        assert_eq!(found("-----BEGIN PGP PRIVATE KEY-----"), None);
    }

    #[test]
    fn plain_prose_and_numbers_do_not_fire() {
        let prose = concat!(
            r"Summarize the meeting notes below.\n\nOn 2024-06-01 the team (5 people) ",
            r"reviewed Q2: revenue was $1,234,567.89, up 12.5% from 1.2.3.4.5-style versions ",
            r"of the plan. Python 3.12.1 and Rust 1.80 were chosen; see section 4.2.1. ",
            r#"Call it \"v2\" - the budget is 25,000 EUR, ticket ABC-1234, order #98765, "#,
            r"ratio 16:9, time 10:30:00, C++ and std::vector::push_back, user@ mention. ",
            r"Items: 1) apples 2) pears. ISBN 978-0-306-40615-7. The function of the class.",
        );
        assert_eq!(found(prose), None);
        let long = prose.repeat(100);
        assert_eq!(found(&long), None);
        assert_eq!(pii_rule_found(b"", &PiiTagger::default()), None);
    }

    #[test]
    fn a_realistic_request_body_without_pii_does_not_fire() {
        let body = concat!(
            r#"{"model":"gpt-4o-mini-2024-07-18","temperature":0.7,"top_p":1,"#,
            r#""max_tokens":4096,"stream":true,"stream_options":{"include_usage":true},"#,
            r#""messages":[{"role":"system","content":"You are a helpful assistant.\n"},"#,
            r#"{"role":"user","content":"Compare Python 3.12 and 3.13 (released 2024-10-07) "#,
            r#"for a 16:9 dashboard; budget $12,500.\nUse https://docs.python.org/3/."}],"#,
            r#""tools":[{"type":"function","function":{"name":"get_weather","#,
            r#""parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],"#,
            r#""user":"a1b2c3d4-e5f6-7890-abcd-ef1234567890","seed":1234567890123}"#,
        );
        assert_eq!(pii_rule_found(body.as_bytes(), &PiiTagger::default()), None);
    }

    #[test]
    fn disabled_rules_do_not_fire() {
        let text = r"mail jane@example.com or call +1 415 555 0100";
        let no_email = PiiTagger {
            disabled: vec![PiiRule::Email],
            ..PiiTagger::default()
        };
        assert_eq!(pii_rule_found(&body(text), &no_email), Some(PiiRule::Phone));
        let neither = PiiTagger {
            disabled: vec![PiiRule::Email, PiiRule::Phone],
            ..PiiTagger::default()
        };
        assert_eq!(pii_rule_found(&body(text), &neither), None);
        let none = PiiTagger {
            disabled: PiiRule::ALL.to_vec(),
            ..PiiTagger::default()
        };
        assert_eq!(pii_rule_found(&body("card 4111111111111111"), &none), None);
    }

    #[test]
    fn the_first_rule_in_all_order_is_returned() {
        let text = r"-----BEGIN PRIVATE KEY-----\n ip 10.1.2.3, jane@example.com";
        assert_eq!(found(text), Some(PiiRule::Email));
        let no_email = PiiTagger {
            disabled: vec![PiiRule::Email],
            ..PiiTagger::default()
        };
        assert_eq!(
            pii_rule_found(&body(text), &no_email),
            Some(PiiRule::IpAddress)
        );
    }

    #[test]
    fn a_rejected_candidate_does_not_hide_a_later_valid_one() {
        assert!(fires(
            PiiRule::PaymentCard,
            "4111111111111112 then 4111111111111111"
        ));
        assert!(fires(PiiRule::IpAddress, "999.1.1.1 then 8.8.8.8"));
        assert!(fires(
            PiiRule::Iban,
            "DE88370400440532013000 DE89370400440532013000"
        ));
    }

    #[test]
    fn an_escaped_backslash_is_not_a_json_escape() {
        // `\\n4111...` is a literal backslash, then the word `n4111...`.
        assert!(!fires(PiiRule::PaymentCard, r"path C:\\n4111111111111111"));
        assert!(fires(PiiRule::PaymentCard, r"path C:\\\n4111111111111111"));
    }

    #[test]
    fn non_ascii_bytes_are_scanned() {
        let mut text = body("caf\u{e9} \u{1F600} jane@example.com");
        assert_eq!(
            pii_rule_found(&text, &PiiTagger::default()),
            Some(PiiRule::Email)
        );
        text.extend_from_slice(&[0xff, 0xfe]);
        assert_eq!(
            pii_rule_found(&text, &PiiTagger::default()),
            Some(PiiRule::Email)
        );
    }
}
