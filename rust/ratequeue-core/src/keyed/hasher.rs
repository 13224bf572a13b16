//! Keys as 64-bit keyed hashes of their identity (kind and exact value).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

/// Hashing of keys, one identity per key: an integer by its exact value, a string by its
/// UTF-8 text and a byte string by its bytes, each kind in a domain of its own.
///
/// The integer mix is a bijection of u64 per domain (every hash is a key, 0 included:
/// the table marks empty slots apart). So distinct integers in [0, 2^64), or in
/// [-2^63, 0), never share a hash; any other two distinct keys share one only by chance
/// (about 2^-64 a pair, the price of keeping a 64-bit hash per key).
#[derive(Clone, Debug)]
pub struct KeyHasher {
    state: RandomState,
    k0: u64,
    k1: u64,
    /// The seed of negative integers: never `k0`, so -1 and 2^64 - 1 stay apart.
    k_neg: u64,
}

impl Default for KeyHasher {
    fn default() -> Self {
        let state = RandomState::new();
        let k0 = state.hash_one(0x5eed_u64);
        let k1 = state.hash_one(0x5eed_5eed_u64) | 1;
        let mut k_neg = state.hash_one(0x5eed_5eed_5eed_u64);
        if k_neg == k0 {
            k_neg ^= 1;
        }
        KeyHasher { state, k0, k1, k_neg }
    }
}

impl KeyHasher {
    #[inline]
    fn mix(&self, k: u64, seed: u64) -> u64 {
        let mut x = (k ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 32;
        x = x.wrapping_mul(self.k1);
        x ^ (x >> 29)
    }

    /// The non-negative integer whose key is `h` (tests only).
    #[cfg(test)]
    pub(crate) fn int_preimage(&self, h: u64) -> u64 {
        fn unshift(y: u64, s: u32) -> u64 {
            let mut x = y;
            for _ in 0..64 / s {
                x = y ^ (x >> s);
            }
            x
        }
        fn inverse(a: u64) -> u64 {
            let mut x = a;
            for _ in 0..6 {
                x = x.wrapping_mul(2u64.wrapping_sub(a.wrapping_mul(x)));
            }
            x
        }
        let mut x = unshift(h, 29).wrapping_mul(inverse(self.k1));
        x = unshift(x, 32).wrapping_mul(inverse(0x9E37_79B9_7F4A_7C15));
        let k = x ^ self.k0;
        debug_assert_eq!(self.mix(k, self.k0), h);
        k
    }

    /// The key of a non-negative integer `k` (a uint64 value).
    #[inline]
    pub fn int(&self, k: u64) -> u64 {
        self.mix(k, self.k0)
    }

    /// The key of the integer `v` (an int64 value): equal to `int(v)` when `v >= 0`,
    /// never to `int(v as u64)` when `v < 0`.
    #[inline]
    pub fn signed(&self, v: i64) -> u64 {
        if v >= 0 {
            self.mix(v as u64, self.k0)
        } else {
            self.mix(v as u64, self.k_neg)
        }
    }

    /// The key of a string (never equal to the same text as bytes or an int, but by chance).
    #[inline]
    pub fn str(&self, s: &str) -> u64 {
        self.state.hash_one((1u8, s))
    }

    /// The key of an integer outside [-2^63, 2^64), from its decimal digits (with a sign).
    #[inline]
    pub fn big_int(&self, digits: &str) -> u64 {
        self.state.hash_one((3u8, digits))
    }

    /// The key of a byte string.
    #[inline]
    pub fn bytes(&self, b: &[u8]) -> u64 {
        self.state.hash_one((2u8, b))
    }
}
