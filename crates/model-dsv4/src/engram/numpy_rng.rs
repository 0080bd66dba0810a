//! numpy's `default_rng(seed)` stream, bit for bit, as far as the Engram hash multipliers use
//! it: `SeedSequence(seed)` -> `PCG64` -> `Generator.integers(low, high, dtype=int64)`.
//!
//! The V4.1 reference draws its per-layer hash multipliers with
//! `numpy.random.default_rng(10007 * layer_id).integers(0, bound, size=N, dtype=int64)`. The
//! tables were trained with those exact numbers, so a different generator (or a different
//! bounded-integer method) would hash every n-gram to the wrong row. This module reproduces
//! numpy 2.x (`bit_generator.pyx`, `pcg64.h`, `distributions.c`): the SeedSequence entropy
//! mixing, the PCG64 128-bit LCG with its XSL-RR output and 32-bit buffering, and the
//! Lemire bounded draws numpy's `integers` uses for 64-bit dtypes.

/// `SeedSequence` hash constants (numpy `bit_generator.pyx`).
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;
/// numpy's `DEFAULT_POOL_SIZE` (in 32-bit words).
const POOL_SIZE: usize = 4;

/// The PCG64 LCG multiplier (`PCG_DEFAULT_MULTIPLIER_128`).
const PCG_MULT: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;

/// `hashmix` of `SeedSequence`: mixes `value` with the running hash constant, advancing it.
fn hashmix(value: u32, hash_const: &mut u32) -> u32 {
    let mut v = value ^ *hash_const;
    *hash_const = hash_const.wrapping_mul(MULT_A);
    v = v.wrapping_mul(*hash_const);
    v ^ (v >> XSHIFT)
}

/// `mix` of `SeedSequence`.
fn mix(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L
        .wrapping_mul(x)
        .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> XSHIFT)
}

/// `SeedSequence(seed).generate_state(4, uint64)`: the four words PCG64 is seeded with.
///
/// numpy turns a non-negative integer seed into little-endian 32-bit words (at least one, so
/// 0 is `[0]`), mixes them into a pool of four words, then draws 32-bit words from the pool
/// and pairs them (low word first) into 64-bit ones.
pub fn seed_sequence_state(seed: u128) -> [u64; 4] {
    let mut entropy = Vec::with_capacity(4);
    let mut s = seed;
    loop {
        entropy.push(s as u32);
        s >>= 32;
        if s == 0 {
            break;
        }
    }
    let mut pool = [0u32; POOL_SIZE];
    let mut hash_const = INIT_A;
    for (i, word) in pool.iter_mut().enumerate() {
        // Shorter entropy than the pool: keep running the hash over zeros.
        *word = hashmix(entropy.get(i).copied().unwrap_or(0), &mut hash_const);
    }
    for i_src in 0..POOL_SIZE {
        for i_dst in 0..POOL_SIZE {
            if i_src != i_dst {
                let h = hashmix(pool[i_src], &mut hash_const);
                pool[i_dst] = mix(pool[i_dst], h);
            }
        }
    }
    // Entropy past the pool: each word is mixed into every pool word.
    for &word in entropy.iter().skip(POOL_SIZE) {
        for dst in pool.iter_mut() {
            let h = hashmix(word, &mut hash_const);
            *dst = mix(*dst, h);
        }
    }
    let mut hash_const = INIT_B;
    let mut words = [0u32; 2 * 4];
    for (i, out) in words.iter_mut().enumerate() {
        let mut v = pool[i % POOL_SIZE] ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_B);
        v = v.wrapping_mul(hash_const);
        *out = v ^ (v >> XSHIFT);
    }
    std::array::from_fn(|i| u64::from(words[2 * i]) | (u64::from(words[2 * i + 1]) << 32))
}

/// numpy's `PCG64` bit generator (PCG XSL-RR 128/64), with its 32-bit output buffer.
#[derive(Debug, Clone)]
pub struct Pcg64 {
    state: u128,
    inc: u128,
    /// The upper half of the last 64-bit output, when `next_u32` has used only its lower half.
    buffered_u32: Option<u32>,
}

impl Pcg64 {
    /// `PCG64(SeedSequence(seed))`, i.e. the bit generator of `numpy.random.default_rng(seed)`.
    pub fn from_seed(seed: u128) -> Pcg64 {
        Pcg64::from_seed_state(seed_sequence_state(seed))
    }

    /// Seeds from `SeedSequence` output `s` as numpy's `pcg64_set_seed` does:
    /// `initstate = s0 << 64 | s1`, `initseq = s2 << 64 | s3`.
    pub fn from_seed_state(s: [u64; 4]) -> Pcg64 {
        let initstate = (u128::from(s[0]) << 64) | u128::from(s[1]);
        let initseq = (u128::from(s[2]) << 64) | u128::from(s[3]);
        // pcg64_srandom_r: state 0, odd increment, step, add the initial state, step.
        let mut rng = Pcg64 {
            state: 0,
            inc: (initseq << 1) | 1,
            buffered_u32: None,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(initstate);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    /// The next raw 64-bit output (`bit_generator.random_raw()`): step, then XSL-RR of the
    /// new state.
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let hi = (self.state >> 64) as u64;
        let lo = self.state as u64;
        (hi ^ lo).rotate_right((self.state >> 122) as u32)
    }

    /// numpy's `next_uint32` for PCG64: the low half of a fresh 64-bit output, then its high
    /// half on the next call.
    pub fn next_u32(&mut self) -> u32 {
        if let Some(v) = self.buffered_u32.take() {
            return v;
        }
        let next = self.next_u64();
        self.buffered_u32 = Some((next >> 32) as u32);
        next as u32
    }

    /// `Generator.integers(low, high, dtype=int64)` for one value (`high` exclusive), as
    /// numpy's `random_bounded_uint64_fill` with `use_masked = False` draws it: no draw for a
    /// single-value range, one raw 32- or 64-bit output for a full 32- or 64-bit range, and
    /// Lemire's multiply-and-reject on 32 bits when the range fits in them, else on 64 bits.
    ///
    /// Returns `None` when `high <= low` (numpy raises `ValueError`).
    pub fn integers_i64(&mut self, low: i64, high: i64) -> Option<i64> {
        if high <= low {
            return None;
        }
        // numpy works on the inclusive range `rng = high - 1 - low` as an unsigned offset.
        let rng = (high as u64).wrapping_sub(1).wrapping_sub(low as u64);
        let off = low as u64;
        let v = if rng == 0 {
            0
        } else if rng <= u64::from(u32::MAX) {
            let rng = rng as u32;
            if rng == u32::MAX {
                u64::from(self.next_u32())
            } else {
                u64::from(self.bounded_lemire_u32(rng))
            }
        } else if rng == u64::MAX {
            self.next_u64()
        } else {
            self.bounded_lemire_u64(rng)
        };
        Some(off.wrapping_add(v) as i64)
    }

    /// `buffered_bounded_lemire_uint32`: a value in `[0, rng]` (`rng < u32::MAX`).
    fn bounded_lemire_u32(&mut self, rng: u32) -> u32 {
        let rng_excl = rng + 1;
        let mut m = u64::from(self.next_u32()) * u64::from(rng_excl);
        let mut leftover = m as u32;
        if leftover < rng_excl {
            // (2^32 - rng_excl) % rng_excl: the count of low values that would bias the draw.
            let threshold = (u32::MAX - rng) % rng_excl;
            while leftover < threshold {
                m = u64::from(self.next_u32()) * u64::from(rng_excl);
                leftover = m as u32;
            }
        }
        (m >> 32) as u32
    }

    /// `bounded_lemire_uint64`: a value in `[0, rng]` (`rng < u64::MAX`).
    fn bounded_lemire_u64(&mut self, rng: u64) -> u64 {
        let rng_excl = rng + 1;
        let mut m = u128::from(self.next_u64()) * u128::from(rng_excl);
        let mut leftover = m as u64;
        if leftover < rng_excl {
            let threshold = (u64::MAX - rng) % rng_excl;
            while leftover < threshold {
                m = u128::from(self.next_u64()) * u128::from(rng_excl);
                leftover = m as u64;
            }
        }
        (m >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    //! Witnesses printed once with numpy 2.4.6 (the version the fixtures were built with):
    //! `SeedSequence(s).generate_state(4, np.uint64)`, `PCG64(s).random_raw(n)` and
    //! `default_rng(s).integers(0, high, size=n, dtype=np.int64)`, chosen to cover every
    //! branch of the seeding (one, two and three entropy words) and of the bounded draw.
    use super::*;

    #[test]
    fn seed_sequence_and_raw_outputs_match_numpy() {
        let cases: [(u128, [u64; 4], [u64; 3]); 5] = [
            (
                0,
                [
                    15793235383387715774,
                    12390638538380655177,
                    2361836109651742017,
                    3188717715514472916,
                ],
                [
                    11749869230777074271,
                    4976686463289251617,
                    755828109848996024,
                ],
            ),
            (
                1,
                [
                    7434755675892716031,
                    10007452063617845036,
                    5266248848659119178,
                    15045448681910192573,
                ],
                [
                    9441442522235856127,
                    17532960557476522086,
                    2659275481604167885,
                ],
            ),
            (
                10007,
                [
                    8634291315755388167,
                    11042498673593962405,
                    15418481100450270793,
                    9041516862649747678,
                ],
                [
                    15187255322829266483,
                    959186003677246517,
                    7126631698937927467,
                ],
            ),
            (
                (1 << 32) + 5,
                [
                    17996766564426832300,
                    12826844651305701079,
                    10630945381835142969,
                    6839746111962626529,
                ],
                [
                    14281546376153053393,
                    8683300866460616067,
                    12836726618003871680,
                ],
            ),
            (
                (1 << 70) + 3,
                [
                    4943007236101998820,
                    12091938953640079810,
                    11493795787252505438,
                    8139457820393360652,
                ],
                [
                    7754773597696927362,
                    5273438921104871389,
                    1960393013035974977,
                ],
            ),
        ];
        for (seed, state, raw) in cases {
            assert_eq!(seed_sequence_state(seed), state, "seed {seed}");
            let mut rng = Pcg64::from_seed(seed);
            let got: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
            assert_eq!(got, raw, "seed {seed}");
        }
    }

    #[test]
    fn integers_match_numpy_on_every_branch() {
        let draws = |high: i64, n: usize| {
            let mut rng = Pcg64::from_seed(123);
            (0..n)
                .map(|_| rng.integers_i64(0, high).unwrap())
                .collect::<Vec<_>>()
        };
        // 64-bit Lemire.
        assert_eq!(
            draws((1 << 40) + 7, 5),
            [
                750253807880,
                59176835992,
                242288242410,
                202718949698,
                193410583638
            ]
        );
        assert_eq!(
            draws((1 << 32) + 1, 5),
            [2930678937, 231159515, 946438447, 791870897, 755510092]
        );
        // 64-bit Lemire with a threshold near 2^63: rejections happen.
        assert_eq!(
            draws(i64::MAX, 3),
            [6293585094778680549, 496411279815456401, 2032461088575780170]
        );
        // 32-bit Lemire on buffered halves of the 64-bit outputs.
        assert_eq!(draws(1000, 7), [15, 682, 592, 53, 909, 220, 255]);
        // A full 32-bit range: raw 32-bit halves.
        assert_eq!(
            draws(1 << 32, 5),
            [66316749, 2930678937, 2546691363, 231159515, 3904498326]
        );
        // A single value draws nothing: the next raw output is the stream's first.
        let mut rng = Pcg64::from_seed(123);
        assert_eq!(rng.integers_i64(0, 1), Some(0));
        assert_eq!(rng.next_u64(), 12587170189557361101);
        assert_eq!(Pcg64::from_seed(123).integers_i64(5, 5), None);
    }
}
