//! `filter.maxKvCacheUsage`: workers whose GPU KV cache is fuller are not candidates. A load
//! limit: fallbacks ignore it.

use super::{CandidateFilter, Words};
use crate::candidate::{Candidate, FilterId};
use crate::catalog::{Catalog, Check};
use crate::kinds::Filter;
use crate::resolve::Request;

pub(super) struct MaxKvCacheUsage;

impl CandidateFilter for MaxKvCacheUsage {
    fn id(&self) -> FilterId {
        FilterId("max_kv_cache_usage")
    }

    fn load_limit(&self) -> bool {
        true
    }

    fn configured(&self, f: &Filter, _req: &Request<'_>) -> bool {
        f.max_kv_cache_usage.is_some()
    }

    fn refuses(
        &self,
        f: &Filter,
        _req: &Request<'_>,
        c: &Candidate<'_>,
        _catalog: &Catalog,
        why: &mut Words,
    ) -> bool {
        let (Some((_, w)), Some(max)) = (c.worker(), f.max_kv_cache_usage) else {
            return false;
        };
        let refused = w.kv_cache_usage > max;
        if refused {
            why.say(format_args!(
                "KV cache {:.0}% > maxKvCacheUsage {:.0}%",
                w.kv_cache_usage * 100.0,
                max * 100.0
            ));
        }
        refused
    }

    fn problems(&self, f: &Filter, at: &str, c: &mut Check<'_>) {
        if let Some(v) = f.max_kv_cache_usage
            && !(0.0..=1.0).contains(&v)
        {
            c.fail(
                format!("{at}.maxKvCacheUsage"),
                format!("must be within 0..1, got {v}"),
            );
        }
    }
}
