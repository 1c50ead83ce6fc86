//! The prefix cache: the KV caches of finished sequences, kept so that a new request whose
//! prompt starts with the same tokens (a shared system prompt, the earlier turns of a chat)
//! starts from their keys and values instead of running those tokens again — llama-server's
//! `cache_prompt`, vLLM's automatic prefix caching.
//!
//! Entries are whole token sequences (prompt + generated tokens the cache holds) with their
//! KV; a lookup takes the entry with the longest common prefix. An entry that another one
//! extends is dropped (the longer one answers every lookup the shorter could), and the least
//! recently used ones go when the total passes the budget (`--cache-ram`).
//!
//! The reused tokens were computed in the pieces their first request ran them in, and the rest
//! of the prompt runs as its own pieces, so a hit's logits can differ from a cold run's in the
//! last bits, as on llama-server (CPU kernels group rows as llama.cpp's do); `cache_prompt:
//! false` on a request, or `--cache-ram 0`, gives the cold run's numbers exactly.

use burn::tensor::backend::Backend;
use toy_kernels::ToyBackend;
use toy_models::KvCache;

struct Entry<B: Backend> {
    tokens: Vec<u32>,
    cache: KvCache<B>,
    bytes: usize,
    /// Lookup clock at the last hit or insertion (least recently used goes first).
    used: u64,
}

pub struct PrefixCache<B: Backend> {
    entries: Vec<Entry<B>>,
    budget: usize,
    bytes: usize,
    clock: u64,
}

/// A reusable prefix: the first `len` tokens of a prompt, and their keys and values.
pub struct Hit<B: Backend> {
    pub len: usize,
    pub cache: KvCache<B>,
}

impl<B: ToyBackend> PrefixCache<B> {
    /// A cache holding at most `budget` bytes of keys and values (0: off).
    pub fn new(budget: usize) -> Self {
        PrefixCache {
            entries: Vec::new(),
            budget,
            bytes: 0,
            clock: 0,
        }
    }

    /// Bytes held, and entries.
    pub fn usage(&self) -> (usize, usize) {
        (self.bytes, self.entries.len())
    }

    /// The longest cached prefix of `prompt`, leaving at least its last token to run (its
    /// logits are the first sample's).
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Hit<B>> {
        let most = prompt.len().saturating_sub(1);
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_prefix(&e.tokens, prompt).min(most)))
            .max_by_key(|&(i, len)| (len, std::cmp::Reverse(i)))?;
        if len == 0 {
            return None;
        }
        self.clock += 1;
        let entry = &mut self.entries[best];
        entry.used = self.clock;
        Some(Hit {
            len,
            cache: entry.cache.prefix(len),
        })
    }

    /// Keep `cache`, which holds `tokens` (the prompt and the generated tokens that were run).
    pub fn insert(&mut self, tokens: Vec<u32>, mut cache: KvCache<B>) {
        debug_assert_eq!(tokens.len(), cache.len());
        // Already covered by an entry this one is a prefix of?
        if tokens.is_empty() || self.entries.iter().any(|e| e.tokens.starts_with(&tokens)) {
            return;
        }
        // A generation's buffers have room for tokens it never ran: keep only what it holds.
        cache.shrink_to_fit();
        let bytes = cache.bytes();
        if bytes > self.budget {
            return;
        }
        // Entries this one extends answer nothing it cannot.
        let mut freed = 0;
        self.entries.retain(|e| {
            let keep = !tokens.starts_with(&e.tokens);
            if !keep {
                freed += e.bytes;
            }
            keep
        });
        self.bytes -= freed;
        while self.bytes + bytes > self.budget {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            self.bytes -= self.entries.swap_remove(oldest).bytes;
        }
        self.clock += 1;
        self.bytes += bytes;
        self.entries.push(Entry {
            tokens,
            cache,
            bytes,
            used: self.clock,
        });
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Tensor;

    type B = Flex;

    /// A one-layer cache of `n` tokens whose key for token `i` is `tokens[i]` (to see which
    /// tokens a hit returns).
    fn cache_of(tokens: &[u32]) -> KvCache<B> {
        let ids: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        let k = Tensor::<B, 1>::from_floats(ids.as_slice(), &Default::default()).reshape([
            1,
            1,
            tokens.len(),
            1,
        ]);
        KvCache::from_layers(vec![(k.clone(), k)])
    }

    fn keys(c: &KvCache<B>) -> Vec<u32> {
        c.layer(0)
            .map(|(k, _)| {
                k.clone()
                    .into_data()
                    .to_vec::<f32>()
                    .unwrap()
                    .into_iter()
                    .map(|x| x as u32)
                    .collect()
            })
            .unwrap_or_default()
    }

    #[test]
    fn longest_prefix_wins_and_leaves_the_last_prompt_token() {
        let mut p = PrefixCache::<B>::new(1 << 20);
        p.insert(vec![1, 2, 3], cache_of(&[1, 2, 3]));
        p.insert(vec![1, 2, 9, 9, 9], cache_of(&[1, 2, 9, 9, 9]));
        let hit = p.lookup(&[1, 2, 9, 9, 7]).unwrap();
        assert_eq!((hit.len, keys(&hit.cache)), (4, vec![1, 2, 9, 9]));
        // The whole prompt cached: its last token still runs.
        let hit = p.lookup(&[1, 2, 3]).unwrap();
        assert_eq!((hit.len, keys(&hit.cache)), (2, vec![1, 2]));
        assert!(p.lookup(&[5, 1, 2]).is_none());
        assert!(p.lookup(&[1]).is_none());
    }

    #[test]
    fn an_extended_entry_replaces_its_prefix_and_the_budget_evicts_the_least_recent() {
        let bytes = cache_of(&[0; 4]).bytes(); // 4 tokens
        let mut p = PrefixCache::<B>::new(3 * bytes);
        p.insert(vec![1, 2], cache_of(&[1, 2]));
        p.insert(vec![1, 2, 3, 4], cache_of(&[1, 2, 3, 4]));
        assert_eq!(p.usage(), (bytes, 1)); // [1, 2] is gone
        p.insert(vec![1, 2], cache_of(&[1, 2])); // covered: not stored
        assert_eq!(p.usage(), (bytes, 1));
        p.insert(vec![5, 6, 7, 8], cache_of(&[5, 6, 7, 8]));
        p.insert(vec![9, 9, 9, 9], cache_of(&[9, 9, 9, 9]));
        assert_eq!(p.usage(), (3 * bytes, 3));
        // Touch [1, 2, 3, 4]; the next insertion evicts [5, 6, 7, 8], the least recent.
        assert!(p.lookup(&[1, 2, 3, 0]).is_some());
        p.insert(vec![4, 4, 4, 4], cache_of(&[4, 4, 4, 4]));
        assert_eq!(p.usage(), (3 * bytes, 3));
        assert!(p.lookup(&[5, 6, 7, 0]).is_none());
        assert!(p.lookup(&[9, 9, 9, 0]).is_some());
        // Larger than the whole budget: not stored; a zero budget stores nothing.
        p.insert(vec![7; 16], cache_of(&[7; 16]));
        assert!(p.lookup(&[7; 4]).is_none());
        let mut off = PrefixCache::<B>::new(0);
        off.insert(vec![1, 2], cache_of(&[1, 2]));
        assert_eq!(off.usage(), (0, 0));
    }
}
