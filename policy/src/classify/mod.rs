//! Built-in prompt taggers, run on a request body as the client sent it (never parsed):
//!
//! - [`pii_rule_found`]: the first enabled [`PiiRule`](crate::kinds::PiiRule) that finds
//!   personal data or a secret (one `RegexSet` pass, then check digits for the candidates
//!   that need them).
//! - [`complexity`]: [`Complexity`] low, medium or high from the prompt's tokens, whether it
//!   holds code (one Aho-Corasick pass) and its line count, with the reason.

mod complexity;
mod pii;

pub use complexity::{Complexity, complexity};
pub use pii::pii_rule_found;
