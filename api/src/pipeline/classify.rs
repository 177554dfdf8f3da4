//! Stage 3, classify: the request's tags - its own (`RouteRequest.tags`), those its headers
//! carry (the backend's `tagHeaders`), and those the backend's built-in taggers find in the
//! prompt (`classify.pii`, `classify.complexity`). A tagger runs only when some attached rule
//! matches on its tag. Explain names the source of every tag, never the text that matched.

use std::collections::HashMap;

use kvplane_policy::classify::{complexity, pii_rule_found};
use kvplane_policy::kinds::GatewayBackendSpec;

/// Where a tag came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TagSource {
    Request,
    Header(String),
    /// The tagger rule that fired (`pii/email`, `complexity`...) and why.
    Tagger(&'static str, &'static str),
}

impl std::fmt::Display for TagSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Request => f.write_str("the request"),
            Self::Header(h) => write!(f, "header {h}"),
            Self::Tagger(rule, "") => write!(f, "tagger {rule}"),
            Self::Tagger(rule, why) => write!(f, "tagger {rule} ({why})"),
        }
    }
}

/// The tags of one request, each with its source.
#[derive(Debug, Clone, Default)]
pub struct Tags {
    pub tags: Vec<String>,
    pub sources: Vec<TagSource>,
}

impl Tags {
    fn add(&mut self, tag: String, source: TagSource) {
        if !self.tags.contains(&tag) {
            self.tags.push(tag);
            self.sources.push(source);
        }
    }
}

/// Classifies a request: `read` says which tags attached rules match on.
pub(crate) fn classify(
    own: &[String],
    headers: &HashMap<String, String>,
    backend: Option<&GatewayBackendSpec>,
    body: &[u8],
    prompt_tokens: u32,
    read: impl Fn(&str) -> bool,
) -> Tags {
    let mut out = Tags::default();
    for t in own {
        out.add(t.clone(), TagSource::Request);
    }
    let Some(b) = backend else {
        return out;
    };
    for th in &b.tag_headers {
        let value = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(&th.header))
            .map(|(_, v)| v.as_str());
        for v in value.into_iter().flat_map(|v| v.split(',')) {
            let v = v.trim();
            if !v.is_empty() {
                out.add(
                    format!("{}{v}", th.prefix),
                    TagSource::Header(th.header.clone()),
                );
            }
        }
    }
    let Some(c) = &b.classify else {
        return out;
    };
    if let Some(p) = &c.pii
        && !out.tags.contains(&p.tag)
        && read(&p.tag)
        && let Some(rule) = pii_rule_found(body, p)
    {
        out.add(p.tag.clone(), TagSource::Tagger(rule.label(), ""));
    }
    if let Some(cfg) = &c.complexity
        && read("complexity=")
        && !out.tags.iter().any(|t| t.starts_with("complexity="))
    {
        let (level, why) = complexity(body, prompt_tokens, cfg);
        out.add(level.tag().to_owned(), TagSource::Tagger("complexity", why));
    }
    out
}
