//! Block hashes chained per block, like vLLM's: `hash_i = H(hash_{i-1}, tokens of block i)`,
//! with the root's parent a fixed seed. (H is xxh3 here, as with vLLM's `xxhash` option.)
//! Equal prefixes give equal hashes, so a block's hash names its whole prefix.

use xxhash_rust::xxh3::Xxh3;

/// The parent of the first block (vLLM's `NONE_HASH`).
pub const NONE_HASH: u64 = 0x6b76_706c_616e_6500;

/// The chained hashes of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: u32, lora_name: Option<&str>) -> Vec<u64> {
    salted_block_hashes(tokens, block_size, lora_name, None)
}

/// As [`block_hashes`], for a request with a `cache_salt`: as in vLLM, the salt is an extra key
/// of the first block only, and the chain carries it to every later block.
pub fn salted_block_hashes(
    tokens: &[u32],
    block_size: u32,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> Vec<u64> {
    let mut parent = NONE_HASH;
    tokens
        .chunks_exact(block_size as usize)
        .enumerate()
        .map(|(i, block)| {
            parent = next_hash(parent, block, lora_name);
            if let (0, Some(salt)) = (i, cache_salt) {
                let mut h = Xxh3::new();
                h.update(&parent.to_le_bytes());
                h.update(salt.as_bytes());
                parent = h.digest();
            }
            parent
        })
        .collect()
}

/// The hash of one block after `parent`.
pub fn next_hash(parent: u64, block: &[u32], lora_name: Option<&str>) -> u64 {
    let mut h = Xxh3::new();
    h.update(&parent.to_le_bytes());
    for t in block {
        h.update(&t.to_le_bytes());
    }
    if let Some(l) = lora_name {
        h.update(l.as_bytes());
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_have_equal_hashes_and_chains_diverge_after() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999;
        let ha = block_hashes(&a, 16, None);
        let hb = block_hashes(&b, 16, None);
        assert_eq!(ha.len(), 4);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        assert_ne!(ha[3], hb[3]);
        assert_ne!(block_hashes(&a, 16, Some("lora"))[0], ha[0]);
    }
}
