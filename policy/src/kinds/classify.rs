//! Taggers a `GatewayBackend` runs on its requests: tags from headers and from the prompt.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A request header whose value becomes tags: each comma-separated value, trimmed, with
/// `prefix` before it (`x-data-class: pii` gives `pii`; with prefix `complexity=`,
/// `x-complexity: low` gives `complexity=low`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TagHeader {
    /// The header name (matched case-insensitively).
    pub header: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prefix: String,
}

/// Built-in taggers run on the request's prompt (the body as sent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Classify {
    /// Tags requests whose prompt holds personal data or secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pii: Option<PiiTagger>,
    /// Tags `complexity=low`, `complexity=medium` or `complexity=high`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub complexity: Option<ComplexityTagger>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PiiTagger {
    /// The tag it sets (default `pii`).
    #[serde(default = "default_pii_tag")]
    pub tag: String,
    /// Rules switched off (every rule is on by default).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disabled: Vec<PiiRule>,
}

impl Default for PiiTagger {
    fn default() -> Self {
        Self {
            tag: default_pii_tag(),
            disabled: Vec::new(),
        }
    }
}

fn default_pii_tag() -> String {
    "pii".into()
}

/// One PII detector, by name.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
pub enum PiiRule {
    /// `name@example.com`.
    Email,
    /// Phone numbers: `+` and a country code, or North American `(555) 123-4567` forms.
    Phone,
    /// Payment card numbers (13-19 digits, spaces or dashes allowed) with a valid Luhn digit.
    PaymentCard,
    /// US social security numbers `123-45-6789` (area, group and serial in their valid ranges).
    UsSsn,
    /// IBANs with a valid mod-97 check.
    Iban,
    /// IPv4 addresses (every octet 0-255) and full IPv6 addresses.
    IpAddress,
    /// API keys and tokens of well-known shapes (`sk-...`, `ghp_...`, `AKIA...`, `xox?-...`,
    /// `AIza...`, JWTs).
    ApiKey,
    /// PEM private-key blocks (`-----BEGIN ... PRIVATE KEY-----`).
    PrivateKey,
}

impl PiiRule {
    pub const ALL: [PiiRule; 8] = [
        Self::Email,
        Self::Phone,
        Self::PaymentCard,
        Self::UsSsn,
        Self::Iban,
        Self::IpAddress,
        Self::ApiKey,
        Self::PrivateKey,
    ];

    /// Its name in Explain and metrics (`pii/email`...).
    pub fn label(self) -> &'static str {
        match self {
            Self::Email => "pii/email",
            Self::Phone => "pii/phone",
            Self::PaymentCard => "pii/payment-card",
            Self::UsSsn => "pii/us-ssn",
            Self::Iban => "pii/iban",
            Self::IpAddress => "pii/ip-address",
            Self::ApiKey => "pii/api-key",
            Self::PrivateKey => "pii/private-key",
        }
    }
}

/// Thresholds of the complexity tagger. A prompt is `high` when it has at least
/// `highMinPromptTokens` tokens, holds code (when `codeIsHigh`), or has at least
/// `highMinLines` lines; `low` when it has at most `lowMaxPromptTokens` tokens and none of
/// those; `medium` otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ComplexityTagger {
    #[serde(default = "default_low_max")]
    pub low_max_prompt_tokens: u32,
    #[serde(default = "default_high_min")]
    pub high_min_prompt_tokens: u32,
    #[serde(default = "default_true")]
    pub code_is_high: bool,
    #[serde(default = "default_high_lines")]
    pub high_min_lines: u32,
}

impl Default for ComplexityTagger {
    fn default() -> Self {
        Self {
            low_max_prompt_tokens: default_low_max(),
            high_min_prompt_tokens: default_high_min(),
            code_is_high: true,
            high_min_lines: default_high_lines(),
        }
    }
}

fn default_low_max() -> u32 {
    256
}
fn default_high_min() -> u32 {
    2048
}
fn default_true() -> bool {
    true
}
fn default_high_lines() -> u32 {
    40
}
