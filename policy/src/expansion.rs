//! How many YAML nodes a file's documents expand to, aliases followed, counted without building
//! them: a document that names an anchor many times (a "billion laughs") is refused before it
//! is built. YAML's own recursion limit (128 levels) bounds the depth.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, Visitor};

/// Counts the nodes of a file's documents, failing once there are more than `limit`.
pub(crate) struct Budget<'a> {
    pub(crate) seen: &'a Cell<usize>,
    pub(crate) limit: usize,
}

impl Budget<'_> {
    fn take<E: de::Error>(&self) -> Result<(), E> {
        let n = self.seen.get() + 1;
        self.seen.set(n);
        if n > self.limit {
            return Err(E::custom(format!(
                "the file expands to more than {} nodes, its aliases followed (a node's limits.policy_file_nodes)",
                self.limit
            )));
        }
        Ok(())
    }

    fn again(&self) -> Budget<'_> {
        Budget {
            seen: self.seen,
            limit: self.limit,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Budget<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Budget<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.take()
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.take()
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.take()
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.take()
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.take()
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.take()
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.take()
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        self.take()?;
        self.again().deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.take()?;
        while seq.next_element_seed(self.again())?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.take()?;
        while map.next_key_seed(self.again())?.is_some() {
            map.next_value_seed(self.again())?;
        }
        Ok(())
    }
    /// A tagged node (`!Tag value`).
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        self.take()?;
        let ((), variant) = data.variant_seed(self.again())?;
        de::VariantAccess::newtype_variant_seed(variant, self.again())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn count(text: &str, limit: usize) -> Result<usize, String> {
        let seen = Cell::new(0);
        for de in serde_yaml_ng::Deserializer::from_str(text) {
            Budget { seen: &seen, limit }
                .deserialize(de)
                .map_err(|e| e.to_string())?;
        }
        Ok(seen.get())
    }

    #[test]
    fn nodes_are_counted_with_aliases_followed() {
        // {a: [1, 2], b: [1, 2]}: the map, 2 keys, 2 lists, 4 numbers.
        assert_eq!(count("a: &x [1, 2]\nb: *x\n", 100), Ok(9));
        // The tagged node, its tag, the map, its key and value.
        assert_eq!(count("!Tag {k: v}\n", 100), Ok(5));
    }

    #[test]
    fn a_billion_laughs_is_refused_early() {
        let mut doc = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
        for i in 1..10 {
            let p = i - 1;
            doc.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        let e = count(&doc, 100_000).unwrap_err();
        assert!(e.contains("more than 100000 nodes"), "{e}");
    }
}
