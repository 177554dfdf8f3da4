//! Encoding text pre-token by pre-token, each pre-token's ids kept: a byte-level BPE
//! tokenizer's own result at a hash lookup per word.
//!
//! A byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen 2's) splits its input with one regex
//! into pre-tokens, maps each pre-token's bytes to GPT-2's printable characters and runs BPE on
//! each on its own. `Tokenizer::encode` also builds, for every token, its string, offsets and
//! alignments - most of its time goes to allocating them. [`Pretokens`] splits on the
//! tokenizer's own pattern (on a DFA where the pattern allows it, see [`Splitter`]), looks each
//! pre-token up in a cache of ids, and hands only pre-tokens never seen to the tokenizer's own
//! BPE model.
//!
//! Used only for the shapes it knows - no normalizer, truncation or padding; the `ByteLevel`
//! pre-tokenizer with its regex, or a regex `Split` (isolated) then `ByteLevel` without one; a
//! BPE model without dropout or word prefixes and suffixes - and only when a probe text encodes
//! to the tokenizer's own ids at load. Anything else is encoded by the tokenizer itself.

use std::sync::{Arc, Mutex, RwLock, Weak};

use ahash::AHashMap;
use tokenizers::models::ModelWrapper;
use tokenizers::utils::SysRegex;
use tokenizers::{Model, PreTokenizerWrapper, Tokenizer};

/// GPT-2's split pattern: what the `ByteLevel` pre-tokenizer splits on when `use_regex` is set.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Pre-tokens longer than this are encoded every time.
const MAX_CACHED_BYTES: usize = 64;
/// Pre-tokens kept; past this the cache starts over.
const CAPACITY: usize = 1 << 16;

pub(crate) struct Pretokens {
    split: Splitter,
    /// GPT-2's printable character for each byte, as the `ByteLevel` pre-tokenizer maps them.
    chars: [char; 256],
    /// Ids of each pre-token seen (its original text as the key). Randomly seeded: the keys are
    /// request text.
    cache: RwLock<AHashMap<Box<str>, Box<[u32]>>>,
}

impl Pretokens {
    /// The pre-token encoder of `tokenizer`, when its pipeline is one this knows and a probe
    /// text gives the tokenizer's own ids.
    pub(crate) fn new(tokenizer: &Tokenizer) -> Option<Self> {
        if tokenizer.get_normalizer().is_some()
            || tokenizer.get_truncation().is_some()
            || tokenizer.get_padding().is_some()
        {
            return None;
        }
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return None;
        };
        if bpe.dropout.is_some_and(|d| d > 0.0)
            || bpe.continuing_subword_prefix.is_some()
            || bpe.end_of_word_suffix.is_some()
        {
            return None;
        }
        let pattern = split_pattern(tokenizer.get_pre_tokenizer()?)?;
        let this = Self {
            split: Splitter::new(&pattern)?,
            chars: byte_chars(),
            cache: RwLock::default(),
        };
        let mut ids = Vec::new();
        this.encode(tokenizer, PROBE, &mut ids, false).ok()?;
        let whole = tokenizer.encode_fast(PROBE, false).ok()?;
        (ids == whole.get_ids()).then_some(this)
    }

    /// Appends the ids of `text` (no added tokens in it) to `out`; `remember`: whether the
    /// pre-tokens met for the first time enter the cache.
    pub(crate) fn encode<'t>(
        &self,
        tokenizer: &Tokenizer,
        text: &'t str,
        out: &mut Vec<u32>,
        remember: bool,
    ) -> tokenizers::Result<()> {
        // Pre-tokens not in the cache, met in this text: where their ids are in `out`.
        let mut new: AHashMap<&'t str, (usize, usize)> = AHashMap::new();
        {
            let read = || self.cache.read().unwrap_or_else(|p| p.into_inner());
            // Held across hits only: released while the model encodes a pre-token.
            let mut cache = Some(read());
            let mut mapped = String::new();
            for (start, end) in self.split.spans(text) {
                let w = &text[start..end];
                if let Some(ids) = cache.get_or_insert_with(read).get(w) {
                    out.extend_from_slice(ids);
                    continue;
                }
                if let Some(&(from, to)) = new.get(w) {
                    out.extend_from_within(from..to);
                    continue;
                }
                cache = None;
                mapped.clear();
                mapped.extend(w.bytes().map(|b| self.chars[usize::from(b)]));
                let first = out.len();
                out.extend(
                    tokenizer
                        .get_model()
                        .tokenize(&mapped)?
                        .into_iter()
                        .map(|t| t.id),
                );
                if w.len() <= MAX_CACHED_BYTES {
                    new.insert(w, (first, out.len()));
                }
            }
        }
        if remember && !new.is_empty() {
            let mut cache = self.cache.write().unwrap_or_else(|p| p.into_inner());
            if cache.len() + new.len() > CAPACITY {
                cache.clear();
            }
            for (w, (from, to)) in new {
                cache.insert(w.into(), out[from..to].into());
            }
        }
        Ok(())
    }
}

/// The split pattern, run by a DFA where the pattern allows it.
///
/// The split patterns of GPT-2, Llama 3 and Qwen 2 end in `\s+(?!\S)|\s+`: a run of
/// whitespace before a word leaves its last character to the word. The lookahead is the only
/// part a DFA cannot run, so for such a pattern the DFA runs it with the tail `\s+` and, where a
/// match came from that tail (all whitespace, no earlier alternative matching where it starts)
/// and a non-space follows, gives the last character back - what the lookahead does. Other
/// patterns run on the tokenizer's own regex engine (Oniguruma), whose every search costs more.
///
/// Each pre-token is searched for where the last one ended, anchored, on a dense DFA built
/// whole at load ([`Anchored`]): a request never waits for a lazy DFA to build its states (a
/// tokenizer just loaded built them for every pre-token of its first prompts) and no search
/// runs backwards to find where its match starts. Only where no match starts there (a gap
/// the pattern does not cover, kept as a pre-token of its own) does the unanchored search run.
enum Splitter {
    Dfa {
        /// The pattern with its tail `\s+`.
        all: regex_automata::meta::Regex,
        /// The pattern without its tail, asked only where an all-whitespace match starts.
        head: regex_automata::meta::Regex,
        /// `all` and `head` as anchored dense DFAs, when they could be built within
        /// [`DFA_BYTES`]; shared by every tokenizer of the process with the same pattern.
        anchored: Option<Arc<Anchored>>,
    },
    Onig(SysRegex),
}

/// The most a split pattern's two dense DFAs may take (half each; twice as much while one is
/// built); a larger pattern searches on the lazy DFAs of `meta::Regex` instead.
const DFA_BYTES: usize = 16 << 20;

/// A split pattern's forward DFAs, each search anchored where it starts.
struct Anchored {
    all: regex_automata::dfa::dense::DFA<Vec<u32>>,
    head: regex_automata::dfa::dense::DFA<Vec<u32>>,
}

impl Anchored {
    /// The DFAs of the pattern `all` (its head `head`): built once per pattern and kept while
    /// a tokenizer uses them (models of one family share a pattern).
    fn shared(all: &str, head: &str) -> Option<Arc<Self>> {
        static BUILT: Mutex<Vec<(String, Weak<Anchored>)>> = Mutex::new(Vec::new());
        let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
        built.retain(|(_, w)| w.strong_count() > 0);
        if let Some(a) = built
            .iter()
            .find(|(p, _)| p == all)
            .and_then(|(_, w)| w.upgrade())
        {
            return Some(a);
        }
        let a = Arc::new(Self::new(all, head)?);
        built.push((all.to_owned(), Arc::downgrade(&a)));
        Some(a)
    }

    fn new(all: &str, head: &str) -> Option<Self> {
        use regex_automata::dfa::{StartKind, dense};
        let build = |pattern: &str| {
            dense::Builder::new()
                .configure(
                    dense::Config::new()
                        .start_kind(StartKind::Anchored)
                        .dfa_size_limit(Some(DFA_BYTES / 2))
                        .determinize_size_limit(Some(DFA_BYTES)),
                )
                .build(pattern)
                .ok()
        };
        Some(Self {
            all: build(all)?,
            head: build(head)?,
        })
    }

    /// Where the leftmost-first match of `dfa` starting at `at` ends (`Err`: the DFA gave
    /// up, which a DFA built without quit bytes or heuristics never does).
    fn end(
        dfa: &regex_automata::dfa::dense::DFA<Vec<u32>>,
        text: &str,
        at: usize,
    ) -> Result<Option<usize>, regex_automata::MatchError> {
        use regex_automata::dfa::Automaton;
        let input = regex_automata::Input::new(text)
            .range(at..)
            .anchored(regex_automata::Anchored::Yes);
        Ok(dfa.try_search_fwd(&input)?.map(|m| m.offset()))
    }
}

impl Splitter {
    fn new(pattern: &str) -> Option<Self> {
        if let Some(head) = pattern.strip_suffix(r"|\s+(?!\S)|\s+") {
            let with_tail = format!(r"{head}|\s+");
            if let (Ok(all), Ok(head_re)) = (
                regex_automata::meta::Regex::new(&with_tail),
                regex_automata::meta::Regex::new(head),
            ) {
                return Some(Self::Dfa {
                    all,
                    head: head_re,
                    anchored: Anchored::shared(&with_tail, head),
                });
            }
        }
        SysRegex::new(pattern).ok().map(Self::Onig)
    }

    /// The pre-tokens of `text` as byte ranges: the pattern's matches and what lies between
    /// them (the `Isolated` split behaviour), empty ones left out.
    fn spans<'a>(&'a self, text: &'a str) -> Box<dyn Iterator<Item = (usize, usize)> + 'a> {
        let matches: Box<dyn Iterator<Item = (usize, usize)> + 'a> = match self {
            Self::Onig(re) => Box::new(re.find_iter(text)),
            Self::Dfa {
                all,
                head,
                anchored,
            } => {
                let mut at = 0;
                Box::new(std::iter::from_fn(move || {
                    use regex_automata::Input;
                    if at > text.len() {
                        return None;
                    }
                    // The leftmost-first match: one that starts here if any does, else the
                    // next one found.
                    let here = anchored
                        .as_ref()
                        .and_then(|a| Anchored::end(&a.all, text, at).ok().flatten());
                    let (start, mut end) = match here {
                        Some(end) => (at, end),
                        None => {
                            let m = all.find(Input::new(text).range(at..))?;
                            (m.start(), m.end())
                        }
                    };
                    if start == end {
                        // An empty match: the search goes on after the next character.
                        at = end + text[end..].chars().next().map_or(1, char::len_utf8);
                        return (at <= text.len()).then_some((start, end));
                    }
                    let run = &text[start..end];
                    if end < text.len()
                        && run.chars().nth(1).is_some()
                        && run.chars().all(char::is_whitespace)
                        && !Self::head_matches(head, anchored.as_deref(), text, start)
                    {
                        end -= run.chars().next_back().map_or(0, char::len_utf8);
                    }
                    at = end;
                    Some((start, end))
                }))
            }
        };
        let mut at = 0;
        Box::new(
            matches
                .chain(std::iter::once((text.len(), text.len())))
                .flat_map(move |(start, end)| {
                    let gap = (at, start);
                    at = end;
                    [gap, (start, end)]
                })
                .filter(|(start, end)| start < end),
        )
    }

    /// Whether the pattern without its whitespace tail matches at `start`.
    fn head_matches(
        head: &regex_automata::meta::Regex,
        anchored: Option<&Anchored>,
        text: &str,
        start: usize,
    ) -> bool {
        use regex_automata::{Anchored as Anchor, Input};
        match anchored.map(|a| Anchored::end(&a.head, text, start)) {
            Some(Ok(end)) => end.is_some(),
            _ => head.is_match(Input::new(text).range(start..).anchored(Anchor::Yes)),
        }
    }
}

/// The regex the pre-tokenizer splits on, when it is a byte-level one this knows: `ByteLevel`
/// with its own regex, or a `Split` on a regex (the splits kept, isolated) then `ByteLevel`
/// without one. Neither may add a prefix space.
fn split_pattern(pre: &PreTokenizerWrapper) -> Option<String> {
    let json = serde_json::to_value(pre).ok()?;
    let byte_level = |v: &serde_json::Value, regex: bool| {
        v["type"] == "ByteLevel" && v["add_prefix_space"] == false && v["use_regex"] == regex
    };
    if byte_level(&json, true) {
        return Some(GPT2_PATTERN.to_owned());
    }
    match (
        json["type"].as_str()?,
        json["pretokenizers"].as_array()?.as_slice(),
    ) {
        ("Sequence", [split, level])
            if split["type"] == "Split"
                && split["behavior"] == "Isolated"
                && split["invert"] == false
                && byte_level(level, false) =>
        {
            split["pattern"]["Regex"].as_str().map(str::to_owned)
        }
        _ => None,
    }
}

/// GPT-2's byte-to-character table (`bytes_to_unicode` of its `encoder.py`): printable
/// Latin-1 bytes stand for themselves, the other 68 for the characters from U+0100 on, in
/// byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut chars = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        chars[usize::from(b)] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\0');
            next += 1;
            c
        };
    }
    chars
}

/// Text that exercises every class of the split patterns: contractions, letters and digits
/// with and without a space before them, punctuation runs, whitespace runs before a word and
/// at the end, tabs and carriage returns, accented, CJK and emoji characters.
const PROBE: &str = "You are a careful assistant.\nAnswer in English, or en fran\u{e7}ais.\n  \
    Indented line, tabs\there.\r\nNumbers 12345 and 3.14159!\n\nA new paragraph: x = f(y);\n\
    def route(r):\n    return min(r)\nEnd \u{1f600} of the probe.  Two  spaces, it's don't I'm \
    we'll they've she'd you're IT'S 'quoted' \"double\" (paren) a-b a_b A1 b2 \u{1f680}x \
    x\u{e9}t\u{e9} \u{6771}\u{4eac} z.\n\n\u{a0}nbsp \u{2028} \u{200b}zw \u{7f}\u{1}ctl   \t \n last   ";

#[cfg(test)]
mod tests {
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{
        OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior,
    };

    use super::*;

    const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    /// A pattern that leaves gaps (single letters, punctuation): where no match starts, the
    /// unanchored search finds the next one.
    const GAPPY_PATTERN: &str = r"\p{N}+| ?\p{L}{2,}|\s+(?!\S)|\s+";
    const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// Where the `tokenizers` crate's own `Split` pre-tokenizer (isolated) splits `text`.
    fn tokenizers_spans(pattern: &str, text: &str) -> Vec<(usize, usize)> {
        let split = Split::new(
            SplitPattern::Regex(pattern.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .unwrap();
        let mut pre = PreTokenizedString::from(text);
        split.pre_tokenize(&mut pre).unwrap();
        pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, offsets, _)| offsets)
            .collect()
    }

    #[test]
    fn the_byte_level_patterns_and_a_gappy_one_get_their_anchored_dfas() {
        for p in [GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, GAPPY_PATTERN] {
            assert!(
                matches!(
                    Splitter::new(p),
                    Some(Splitter::Dfa {
                        anchored: Some(_),
                        ..
                    })
                ),
                "{p}"
            );
        }
        assert!(matches!(
            Splitter::new(r"\s+(?!\S)"),
            Some(Splitter::Onig(_))
        ));
    }

    #[test]
    fn an_anchored_search_ends_where_the_match_starting_there_ends() {
        let Some(Splitter::Dfa {
            anchored: Some(a), ..
        }) = Splitter::new(GPT2_PATTERN)
        else {
            panic!("the GPT-2 pattern has its anchored DFAs");
        };
        let text = " hello, it's 42";
        // Leftmost-first from each start: a word with its space, punctuation, a contraction.
        assert_eq!(Anchored::end(&a.all, text, 0).unwrap(), Some(6));
        assert_eq!(Anchored::end(&a.all, text, 6).unwrap(), Some(7));
        assert_eq!(Anchored::end(&a.all, text, 10).unwrap(), Some(12));
        assert_eq!(Anchored::end(&a.all, text, 12).unwrap(), Some(15));
        // The head, without the whitespace tail, takes a space only with what follows it.
        assert_eq!(Anchored::end(&a.head, text, 12).unwrap(), Some(15));
        assert_eq!(Anchored::end(&a.head, "  x", 0).unwrap(), None);
    }

    #[test]
    fn a_run_of_whitespace_before_a_character_splits_as_the_tokenizer_splits() {
        // Once found by the property below against a wrong give-back.
        let text = "\u{85}\r\u{119da}";
        for p in [GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN] {
            let dfa: Vec<_> = Splitter::new(p).unwrap().spans(text).collect();
            assert_eq!(dfa, tokenizers_spans(p, text), "{p}");
        }
    }

    #[test]
    fn a_pattern_matching_empty_text_splits_as_the_tokenizer_splits() {
        let p = r"\p{N}{0,3}|\s+(?!\S)|\s+";
        let text = "ab 12345  c\n\n d";
        let dfa: Vec<_> = Splitter::new(p).unwrap().spans(text).collect();
        assert_eq!(dfa, tokenizers_spans(p, text));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// The DFA with the lookahead given back, and Oniguruma on the whole pattern, split
        /// any text where the `tokenizers` crate's `Split` pre-tokenizer splits it, on the
        /// patterns of GPT-2, Llama 3 and Qwen 2 and one that leaves gaps.
        #[test]
        fn pretokens_split_where_the_tokenizer_splits(
            text in "(\\PC|[ \t\r\n\u{b}\u{c}\u{85}\u{a0}\u{2028}\u{3000}\u{200b}\u{feff}\u{17f}]|'(s|S|t|T|re|RE|Re|ve|VE|m|M|ll|LL|d|D)|[0-9]{1,5}){0,80}",
            pattern in proptest::sample::select(vec![GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, GAPPY_PATTERN]),
        ) {
            let expected = tokenizers_spans(pattern, &text);
            let dfa: Vec<_> = Splitter::new(pattern).unwrap().spans(&text).collect();
            proptest::prop_assert_eq!(&dfa, &expected);
            let onig = Splitter::Onig(SysRegex::new(pattern).unwrap());
            proptest::prop_assert_eq!(&onig.spans(&text).collect::<Vec<_>>(), &expected);
        }
    }
}
