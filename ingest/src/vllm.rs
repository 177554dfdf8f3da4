//! vLLM's KV-event wire format (README, "vLLM KV events"; ../shared/reference/vllm-kv-events.md).
//!
//! A batch is msgpack `[ts, events, data_parallel_rank]` (or a map with those keys). Events are
//! maps with a `"type"` key (vLLM >= 0.24) or positional arrays whose first element is the type
//! name (vLLM <= 0.22). Hashes are u64, negative i64 (reinterpreted bit for bit) or byte
//! digests of 8 bytes or more - 32 for sha256, 16 for xxhash's 128-bit form - reduced to their
//! low 64 bits, big-endian, as vLLM does for its integer form.
//! Unknown fields are ignored; unknown event types and malformed events are skipped and
//! reported, never fatal to the rest of the batch.

use kvplane_state::{KvBatch, KvEvent, Tier};
use rmpv::Value;

use crate::DecodeError;

/// Why one event of a batch was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkippedEvent {
    /// The event type is not one this decoder knows.
    UnknownType(String),
    /// A known event whose fields have the wrong shape.
    Malformed(String),
    /// A KV-cache group that is not full attention (sliding window, mamba...): not a prefix cache.
    NonPrimaryGroup,
}

impl SkippedEvent {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnknownType(_) => "unknown_event_type",
            Self::Malformed(_) => "malformed_event",
            Self::NonPrimaryGroup => "non_primary_group",
        }
    }
}

/// A decoded batch plus what was skipped in it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The engine's timestamp (seconds); informational only, never read by the state machine.
    pub ts: f64,
    pub batch: KvBatch,
    pub skipped: Vec<SkippedEvent>,
}

/// Decodes one vLLM KV-event batch.
pub fn decode_batch(payload: &[u8]) -> Result<Decoded, DecodeError> {
    let mut rd = payload;
    let root =
        rmpv::decode::read_value(&mut rd).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::TrailingBytes(rd.len()));
    }
    let (ts, events, dp) = match &root {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (
            map_get(&root, "ts"),
            map_get(&root, "events"),
            map_get(&root, "data_parallel_rank"),
        ),
        other => return Err(DecodeError::BatchShape(kind_name(other))),
    };
    let ts = ts.and_then(Value::as_f64).unwrap_or(0.0);
    let dp_rank = match dp {
        None | Some(Value::Nil) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| DecodeError::BatchField {
                field: "data_parallel_rank",
                reason: "must be a non-negative integer or nil".into(),
            })?,
    };
    let Some(Value::Array(raw_events)) = events else {
        return Err(DecodeError::BatchField {
            field: "events",
            reason: "must be an array".into(),
        });
    };
    let mut out = Vec::with_capacity(raw_events.len());
    let mut skipped = Vec::new();
    for ev in raw_events {
        match decode_event(ev) {
            Ok(e @ KvEvent::OtherGroup { .. }) => {
                // Its blocks are skipped; the state learns the group is not a prefix cache.
                out.push(e);
                skipped.push(SkippedEvent::NonPrimaryGroup);
            }
            Ok(e) => out.push(e),
            Err(s) => skipped.push(s),
        }
    }
    Ok(Decoded {
        ts,
        batch: KvBatch {
            dp_rank,
            events: out,
        },
        skipped,
    })
}

/// Field access for both event shapes.
struct Fields<'a> {
    map: Option<&'a Value>,
    positional: &'a [Value],
    order: &'static [&'static str],
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        if let Some(m) = self.map {
            return map_get(m, name);
        }
        let pos = self.order.iter().position(|f| *f == name)?;
        self.positional.get(pos + 1)
    }

    fn present(&self, name: &str) -> Option<&'a Value> {
        self.get(name).filter(|v| !v.is_nil())
    }
}

const STORED_ORDER: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];
const REMOVED_ORDER: &[&str] = &[
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

fn decode_event(ev: &Value) -> Result<KvEvent, SkippedEvent> {
    let (ty, map, positional) = match ev {
        Value::Map(_) => (
            map_get(ev, "type").and_then(Value::as_str),
            Some(ev),
            &[][..],
        ),
        Value::Array(items) => (items.first().and_then(Value::as_str), None, &items[..]),
        other => {
            return Err(SkippedEvent::Malformed(format!(
                "event must be a map or an array, got {}",
                kind_name(other)
            )));
        }
    };
    let ty = ty.ok_or_else(|| SkippedEvent::Malformed("event has no type".into()))?;
    let order = match ty {
        "BlockStored" => STORED_ORDER,
        "BlockRemoved" => REMOVED_ORDER,
        "AllBlocksCleared" => return Ok(KvEvent::Cleared),
        other => return Err(SkippedEvent::UnknownType(other.to_owned())),
    };
    let f = Fields {
        map,
        positional,
        order,
    };
    // vLLM names the KV-cache group only when it is not 0.
    let group = match f.present("group_idx") {
        None => 0,
        Some(v) => v
            .as_u64()
            .and_then(|g| u32::try_from(g).ok())
            .ok_or_else(|| malformed("group_idx", "must be a non-negative integer or nil"))?,
    };
    if !primary_group(&f) {
        return Ok(KvEvent::OtherGroup { group });
    }
    let tier = tier(&f)?;
    let block_hashes = hashes(f.get("block_hashes"), "block_hashes")?;
    if ty == "BlockRemoved" {
        return Ok(if group == 0 {
            KvEvent::Removed { block_hashes, tier }
        } else {
            KvEvent::RemovedFromGroup {
                block_hashes,
                tier,
                group,
            }
        });
    }
    let parent_hash = match f.present("parent_block_hash") {
        None => None,
        Some(v) => Some(hash(v).ok_or_else(|| malformed("parent_block_hash", "not a hash"))?),
    };
    let token_ids = match f.get("token_ids") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| malformed("token_ids", "must be u32 integers"))?,
        _ => return Err(malformed("token_ids", "must be an array")),
    };
    // Offload tiers' stores may be placeholders: block size 0 and no tokens (never indexed).
    let block_size = f
        .get("block_size")
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| *n > 0 || tier != Tier::Gpu)
        .ok_or_else(|| malformed("block_size", "must be a positive integer"))?;
    let lora_name = match f.present("lora_name") {
        None => None,
        Some(Value::String(s)) => s.as_str().map(str::to_owned),
        Some(_) => return Err(malformed("lora_name", "must be a string or nil")),
    };
    let cache_salt = cache_salt(f.present("extra_keys"), lora_name.as_deref());
    Ok(KvEvent::Stored {
        block_hashes,
        parent_hash,
        token_ids,
        block_size,
        lora_name,
        cache_salt,
        tier,
    })
}

/// The request's `cache_salt`, from the extra keys of the event's first block: vLLM puts the
/// salt (after the LoRA key) only in the keys of a request's block 0. Its last string that is
/// not the LoRA name. Extra keys of another shape carry no salt.
fn cache_salt(extra_keys: Option<&Value>, lora_name: Option<&str>) -> Option<String> {
    let Some(Value::Array(per_block)) = extra_keys else {
        return None;
    };
    let Some(Value::Array(first)) = per_block.first() else {
        return None;
    };
    first
        .iter()
        .rev()
        .filter_map(Value::as_str)
        .find(|s| Some(*s) != lora_name)
        .map(str::to_owned)
}

/// Full-attention groups (or unspecified) describe the prefix cache; others do not.
fn primary_group(f: &Fields<'_>) -> bool {
    match f.present("kv_cache_spec_kind").and_then(Value::as_str) {
        None => true,
        Some(kind) => {
            !(kind.contains("sliding") || kind.contains("mamba") || kind.contains("local"))
        }
    }
}

fn tier(f: &Fields<'_>) -> Result<Tier, SkippedEvent> {
    if let Some(loc) = f.present("locality") {
        match loc.as_str() {
            Some("REMOTE") => return Ok(Tier::Remote),
            Some("LOCAL") => {}
            _ => return Err(malformed("locality", "must be LOCAL, REMOTE or nil")),
        }
    }
    match f.present("medium") {
        None => Ok(Tier::Gpu),
        Some(m) => match m.as_str() {
            Some("GPU") => Ok(Tier::Gpu),
            Some("CPU") => Ok(Tier::Cpu),
            // FS and OBJ were STORAGE's names for a while.
            Some("STORAGE" | "FS" | "OBJ" | "DISK") => Ok(Tier::Storage),
            _ => Err(malformed(
                "medium",
                "must be GPU, CPU, STORAGE (FS, OBJ) or nil",
            )),
        },
    }
}

fn hashes(v: Option<&Value>, field: &'static str) -> Result<Vec<u64>, SkippedEvent> {
    match v {
        Some(Value::Array(items)) => items
            .iter()
            .map(hash)
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| malformed(field, "every hash must be an integer or 8 bytes or more")),
        _ => Err(malformed(field, "must be an array")),
    }
}

/// A block hash in any of vLLM's encodings, as 64 bits.
pub fn hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|n| n as u64)),
        Value::Binary(b) if b.len() >= 8 => {
            let low: [u8; 8] = b[b.len() - 8..].try_into().ok()?;
            Some(u64::from_be_bytes(low))
        }
        _ => None,
    }
}

fn malformed(field: &str, reason: &str) -> SkippedEvent {
    SkippedEvent::Malformed(format!("{field}: {reason}"))
}

fn map_get<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    match map {
        Value::Map(entries) => entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

fn kind_name(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a boolean",
        Value::Integer(_) => "an integer",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "binary",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension",
    }
}

/// Encodes events in vLLM's current wire format (array batch, map-shaped events, u64 hashes,
/// defaults omitted): what vLLM >= 0.24 sends. Used by the engine simulator and tests. A
/// compact store ([`KvEvent::StoredBlocks`], the leader's form) has no token ids, so no vLLM
/// form: it is left out.
pub fn encode_batch(ts: f64, batch: &KvBatch) -> Vec<u8> {
    let events = batch.events.iter().filter_map(encode_event).collect();
    let root = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events),
        Value::from(batch.dp_rank),
    ]);
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &root);
    out
}

/// A `BlockRemoved` as vLLM sends it: `group_idx` only when it is not 0.
fn removed(block_hashes: &[u64], tier: Tier, group: u32) -> Value {
    let mut m = vec![
        (Value::from("type"), Value::from("BlockRemoved")),
        (
            Value::from("block_hashes"),
            Value::Array(block_hashes.iter().map(|x| Value::from(*x)).collect()),
        ),
        (Value::from("medium"), medium(tier)),
    ];
    if group != 0 {
        m.push((Value::from("group_idx"), Value::from(group)));
    }
    if tier == Tier::Remote {
        m.push((Value::from("locality"), Value::from("REMOTE")));
    }
    Value::Map(m)
}

fn medium(tier: Tier) -> Value {
    match tier {
        Tier::Gpu | Tier::Remote => Value::from("GPU"),
        Tier::Cpu => Value::from("CPU"),
        Tier::Storage => Value::from("STORAGE"),
    }
}

fn encode_event(ev: &KvEvent) -> Option<Value> {
    let s = |k: &str| Value::from(k);
    let hashes = |h: &[u64]| Value::Array(h.iter().map(|x| Value::from(*x)).collect());
    Some(match ev {
        KvEvent::Stored {
            block_hashes,
            parent_hash,
            token_ids,
            block_size,
            lora_name,
            cache_salt,
            tier,
        } => {
            let mut m = vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), hashes(block_hashes)),
                (
                    s("parent_block_hash"),
                    parent_hash.map_or(Value::Nil, Value::from),
                ),
                (
                    s("token_ids"),
                    Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
                ),
                (s("block_size"), Value::from(*block_size)),
                (s("lora_id"), Value::Nil),
                (s("medium"), medium(*tier)),
                (
                    s("lora_name"),
                    lora_name.as_deref().map_or(Value::Nil, Value::from),
                ),
            ];
            if let Some(salt) = cache_salt {
                // vLLM's extra keys: per block, the first block's holding the salt.
                let mut keys = vec![Value::Nil; block_hashes.len().max(1)];
                keys[0] = Value::Array(vec![Value::from(salt.as_str())]);
                m.push((s("extra_keys"), Value::Array(keys)));
            }
            if *tier == Tier::Remote {
                m.push((s("locality"), s("REMOTE")));
            }
            Value::Map(m)
        }
        KvEvent::Removed { block_hashes, tier } => removed(block_hashes, *tier, 0),
        KvEvent::RemovedFromGroup {
            block_hashes,
            tier,
            group,
        } => removed(block_hashes, *tier, *group),
        // What vLLM sends for a sliding-window group's store, reduced to what decodes.
        KvEvent::OtherGroup { group } => Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(Vec::new())),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), Value::Array(Vec::new())),
            (s("block_size"), Value::from(1)),
            (s("group_idx"), Value::from(*group)),
            (s("kv_cache_spec_kind"), s("sliding_window")),
        ]),
        KvEvent::Cleared => Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
        KvEvent::StoredBlocks { .. } => return None,
    })
}
